//! The incremental detokenizer ([`TextStream`], a window of recent ids per token) streams exactly what decoding every
//! id on every token streamed, on the real Qwen3.5 tokenizer (`assets/qwen3.5`): byte tokens that split UTF-8
//! sequences, stop strings spanning tokens, a long output and random ids.

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;

use backburner_engine::TextStream;
use backburner_model::TextTokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5")
}

/// The bundled Qwen3.5 tokenizer, unpacked into a temporary checkpoint directory, and its raw `tokenizer.json`.
fn qwen35() -> (tempfile::TempDir, TextTokenizer, serde_json::Value) {
    let d = tempfile::tempdir().unwrap();
    let gz = std::fs::read(assets().join("tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    std::fs::write(d.path().join("tokenizer.json"), &json).unwrap();
    for f in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(assets().join(f), d.path().join(f)).unwrap();
    }
    let t = TextTokenizer::from_dir(d.path(), 248_320, &[])
        .unwrap()
        .unwrap();
    (d, t, serde_json::from_slice(&json).unwrap())
}

/// The id of the byte-level token of each byte (GPT-2 `bytes_to_unicode`, which Qwen's vocabulary uses).
fn byte_ids(tokenizer_json: &serde_json::Value) -> [u32; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let vocab: HashMap<&str, u32> = tokenizer_json["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_u64().unwrap() as u32))
        .collect();
    let mut ids = [0u32; 256];
    for (b, c) in printable.iter().zip(&chars) {
        let s = char::from_u32(*c).unwrap().to_string();
        ids[*b as usize] = vocab[s.as_str()];
    }
    ids
}

/// The stream as it was before the window: decodes every id on every push. Kept verbatim as the reference.
struct FullDecodeStream<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    text: String,
    emitted: usize,
    stop: &'a [String],
}

impl FullDecodeStream<'_> {
    fn push(&mut self, id: u32) -> (String, bool) {
        self.ids.push(id);
        let full = self.tok.decode(&self.ids).unwrap();
        if full.ends_with('\u{FFFD}') {
            return (String::new(), false);
        }
        self.text = full;
        if let Some(pos) = self
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            self.text.truncate(pos);
            let out = self.text.get(self.emitted..).unwrap_or("").to_string();
            self.emitted = self.text.len();
            return (out, true);
        }
        let mut hold = 0;
        for s in self.stop {
            for k in (1..s.len()).rev() {
                if k > hold && s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let upto = self.text.len() - hold;
        let out = if upto > self.emitted && self.text.is_char_boundary(upto) {
            let o = self.text[self.emitted..upto].to_string();
            self.emitted = upto;
            o
        } else {
            String::new()
        };
        (out, false)
    }

    fn finish(&mut self) -> String {
        let full = self.tok.decode(&self.ids).unwrap();
        if full.len() >= self.text.len() && full.starts_with(self.text.as_str()) {
            self.text = full;
        }
        let o = self.text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = self.text.len();
        o
    }
}

/// Streams `ids` through both, as the generation loop does (stop pushing at a stop string, else finish), asserting
/// that every push and the finish give the same piece. Returns the pieces (the finish last, if reached) and whether
/// a stop string was hit.
fn assert_same_stream(tok: &TextTokenizer, ids: &[u32], stop: &[String]) -> (Vec<String>, bool) {
    let mut new = TextStream::new(tok, stop);
    let mut old = FullDecodeStream {
        tok,
        ids: Vec::new(),
        text: String::new(),
        emitted: 0,
        stop,
    };
    let mut pieces = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let got = new.push(id).unwrap();
        let want = old.push(id);
        assert_eq!(got, want, "push {i} (id {id}) with stops {stop:?}");
        pieces.push(got.0);
        if got.1 {
            assert_eq!(new.text(), old.text);
            return (pieces, true);
        }
    }
    let got = new.finish().unwrap();
    assert_eq!(got, old.finish(), "finish with stops {stop:?}");
    pieces.push(got);
    assert_eq!(new.text(), old.text);
    (pieces, false)
}

fn byte_tokens(b: &[u32; 256], bytes: &[u8]) -> Vec<u32> {
    bytes.iter().map(|&x| b[x as usize]).collect()
}

#[test]
fn byte_tokens_that_split_utf8_sequences_stream_like_a_full_decode() {
    let (_d, tok, json) = qwen35();
    let b = byte_ids(&json);
    // "é" as two byte tokens: nothing until the second byte, then the whole character
    let (pieces, _) = assert_same_stream(&tok, &byte_tokens(&b, "hé!".as_bytes()), &[]);
    assert_eq!(pieces, ["h", "", "é", "!", ""]);
    // a 4-byte emoji byte by byte, between ordinary tokens
    let mut ids = tok.encode("crab:").unwrap();
    ids.extend(byte_tokens(&b, "🦀".as_bytes()));
    ids.extend(tok.encode(" 世界 ok").unwrap());
    let (pieces, _) = assert_same_stream(&tok, &ids, &[]);
    assert_eq!(pieces.concat(), "crab:🦀 世界 ok");
    // invalid and incomplete sequences: a stray continuation byte, a truncated 3-byte sequence before ASCII, a real
    // U+FFFD written as bytes, and an incomplete sequence at the very end (finish emits it lossily)
    let cases: [&[u8]; 5] = [
        b"a\x80b",
        b"x\xe4\xb8y",
        b"\xef\xbf\xbdz",
        b"tail\xf0\x9f\xa6",
        b"\xe4\xb8\xad\xe6\x96",
    ];
    for bytes in cases {
        let (pieces, _) = assert_same_stream(&tok, &byte_tokens(&b, bytes), &[]);
        assert_eq!(pieces.concat(), String::from_utf8_lossy(bytes), "{bytes:?}");
    }
    // the same bytes mixed with multi-byte tokens and stop strings made of partial characters' neighbours
    let stops = ["中".to_string(), "文本".to_string(), "b🦀".to_string()];
    let mut ids = byte_tokens(&b, "ab".as_bytes());
    ids.extend(byte_tokens(&b, "🦀".as_bytes()));
    ids.extend(tok.encode("文本中").unwrap());
    for k in 0..stops.len() {
        assert_same_stream(&tok, &ids, &stops[k..k + 1]);
    }
    let (pieces, hit) = assert_same_stream(&tok, &ids, &stops[2..]);
    assert!(hit);
    assert_eq!(pieces.concat(), "a");
}

#[test]
fn stop_strings_spanning_tokens_are_cut_like_a_full_decode() {
    let (_d, tok, _) = qwen35();
    let text =
        "The quick brown fox jumps over the lazy dog. 日本語のテキスト🦀 and <|im_end|> done";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() > 20);
    let (pieces, hit) = assert_same_stream(&tok, &ids, &["fox jumps".to_string()]);
    assert!(hit);
    assert_eq!(pieces.concat(), "The quick brown ");
    // every substring of 1 to 7 characters as a stop string, alone and with a decoy that is a held-back prefix
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    for (ci, &(start, _)) in chars.iter().enumerate() {
        for len in 1..=7 {
            let Some(&(end, _)) = chars.get(ci + len) else {
                break;
            };
            let stop = text[start..end].to_string();
            let (pieces, hit) = assert_same_stream(&tok, &ids, std::slice::from_ref(&stop));
            assert!(hit, "{stop:?}");
            assert_eq!(pieces.concat(), text[..text.find(&stop).unwrap()]);
            let decoy = format!("{stop}\u{0}never");
            assert_same_stream(&tok, &ids, &[decoy, stop]);
        }
    }
}

#[test]
fn a_long_output_streams_like_a_full_decode() {
    let (_d, tok, _) = qwen35();
    let vectors: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(assets().join("test_vectors.json")).unwrap())
            .unwrap();
    let mut text = String::new();
    for c in vectors["cases"].as_array().unwrap() {
        text.push_str(c["text"].as_str().unwrap());
        text.push('\n');
    }
    let mut ids = Vec::new();
    while ids.len() < 6000 {
        ids.extend(tok.encode(&text).unwrap());
    }
    ids.extend(tok.encode("THE END 🦀").unwrap());
    let (pieces, hit) = assert_same_stream(&tok, &ids, &[]);
    assert!(!hit);
    let full = tok.decode(&ids).unwrap();
    assert_eq!(pieces.concat(), full);
    // a stop string that comes only at the end, spanning tokens, and one that never comes but whose prefixes keep
    // being held back
    let (pieces, hit) = assert_same_stream(&tok, &ids, &["THE END!".into(), "ND 🦀".into()]);
    assert!(hit);
    assert_eq!(pieces.concat(), full[..full.len() - "ND 🦀".len()]);
}

#[test]
fn random_ids_stream_like_a_full_decode() {
    let (_d, tok, _) = qwen35();
    let vocab = tok.vocab_size() as u32;
    let mut g = StdRng::seed_from_u64(77);
    for round in 0..6 {
        let ids: Vec<u32> = (0..1500).map(|_| g.random_range(0..vocab)).collect();
        let stops = if round % 2 == 0 {
            Vec::new()
        } else {
            // a piece of the middle of the text, which may start or end inside a token
            let full = tok.decode(&ids).unwrap();
            let at: Vec<usize> = full.char_indices().map(|(i, _)| i).collect();
            let i = at[at.len() / 2 + round];
            vec![full[i..].chars().take(3).collect::<String>()]
        };
        let (pieces, _) = assert_same_stream(&tok, &ids, &stops);
        if stops.is_empty() {
            assert_eq!(pieces.concat(), tok.decode(&ids).unwrap());
        }
    }
}

/// Streams `bytes` one byte-level token each with `stops` (checked against the full-decode reference too) and
/// asserts the pieces (the finish last unless a stop string was hit) and whether one was.
fn byte_stream(
    tok: &TextTokenizer,
    b: &[u32; 256],
    bytes: &str,
    stops: &[&str],
    want: &[&str],
    hit: bool,
) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let got = assert_same_stream(tok, &byte_tokens(b, bytes.as_bytes()), &stops);
    assert_eq!(got.0, want, "{bytes:?} with {stops:?}");
    assert_eq!(got.1, hit, "{bytes:?} with {stops:?}");
}

#[test]
fn stop_strings_stream_exact_pieces_one_byte_per_token() {
    let (_d, tok, json) = qwen35();
    let b = &byte_ids(&json);
    let tok = &tok;
    // at the very start: nothing is ever emitted
    byte_stream(tok, b, "STOP rest", &["STOP"], &["", "", "", ""], true);
    // a possible start is held back across tokens, then released when it turns out not to be one
    byte_stream(
        tok,
        b,
        "abXYc",
        &["XYZ"],
        &["a", "b", "", "", "XYc", ""],
        false,
    );
    // multi-byte characters: "é" arrives in two byte tokens, is held as the start of "é!", then cut or released
    byte_stream(tok, b, "aé!b", &["é!"], &["a", "", "", ""], true);
    byte_stream(tok, b, "aé?", &["é!"], &["a", "", "", "é?", ""], false);
    // a 4-byte character at the end of a stop string, and a stop string made of one
    byte_stream(tok, b, "x🦀y", &["x🦀"], &["", "", "", "", ""], true);
    byte_stream(tok, b, "ab🦀", &["🦀"], &["a", "b", "", "", "", ""], true);
    // overlapping stop strings: the one that begins first wins when both end at the same token
    byte_stream(tok, b, "abcdz", &["cd", "bcd"], &["a", "", "", ""], true);
    // ... and the one that ends first otherwise, even if a longer one began earlier: the "a" held back as the start
    // of "abcd" comes out with the cut
    byte_stream(tok, b, "xabce", &["abcd", "bc"], &["x", "", "", "a"], true);
    // a stop string overlapping itself ("aab" in "aaab") and one whose prefix recurs before it completes
    byte_stream(tok, b, "aaab", &["aab"], &["", "", "a", ""], true);
    byte_stream(
        tok,
        b,
        "abababc!",
        &["ababc"],
        &["", "", "", "", "ab", "", ""],
        true,
    );
}

#[test]
fn a_stop_string_inside_one_token_cuts_that_token() {
    let (_d, tok, _) = qwen35();
    let ids = tok.encode("Hello world, hello again").unwrap();
    // " world" is one token of this tokenizer: the stop string "wor" ends inside it
    let world = tok.encode(" world").unwrap();
    assert_eq!(world.len(), 1);
    assert!(ids.contains(&world[0]));
    let (pieces, hit) = assert_same_stream(&tok, &ids, &["wor".to_string()]);
    assert!(hit);
    assert_eq!(pieces.concat(), "Hello ");
    // the stop string spans the end of one token and the start of the next
    let (pieces, hit) = assert_same_stream(&tok, &ids, &["lo wo".to_string()]);
    assert!(hit);
    assert_eq!(pieces.concat(), "Hel");
}

/// Each token's bytes (`TextTokenizer::token_bytes`, what logprobs report) are the byte it stands for, and the bytes
/// of a text's tokens, joined, are the text's UTF-8, special tokens included, also where tokens split a character.
#[test]
fn token_bytes_join_to_the_text_and_byte_tokens_give_their_byte() {
    let (_d, t, json) = qwen35();
    for (b, id) in byte_ids(&json).iter().enumerate() {
        assert_eq!(t.token_bytes(*id).unwrap(), [b as u8], "byte {b}");
    }
    let text = "<|im_start|>user\nnaïve café — 北京 🦀\t\u{1}x<|im_end|>\n";
    let ids = t.encode(text).unwrap();
    let joined: Vec<u8> = ids
        .iter()
        .flat_map(|&i| t.token_bytes(i).unwrap())
        .collect();
    assert_eq!(joined, text.as_bytes());
    assert_eq!(t.token_bytes(u32::MAX), None);
}
