//! The tokenizer from `tokenizer.*` metadata: GGUF files built the way llama.cpp's converter builds them from our
//! `tokenizer.json` files tokenize exactly as those files do; llama.cpp's own vocab files reproduce its test vectors.

use std::io::Read;

use serde_json::Value;

use super::super::{chat_template, tokenizer_json_from_gguf, GgufFile, MetaValue};
use super::*;
use crate::tokenizer::{ChatMessage, TextTokenizer};

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The `tokenizer.*` metadata `convert_hf_to_gguf.py` writes for a Qwen tokenizer (`_set_vocab_gpt2` +
/// `SpecialVocab`): every id below `vocab_size` (unused ids as `[PAD<id>]`, type 5), added tokens typed control when
/// special or when they look special (`<|…|>`) and user-defined otherwise, merges as `"a b"` strings, eos/pad ids
/// from tokenizer_config.json, the chat template.
fn converter_vocab(tok: &Value, tcfg: &Value, pre: &str, vocab_size: usize) -> GgufWriter {
    let mut texts: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![5i32; vocab_size];
    for (t, id) in tok["model"]["vocab"].as_object().unwrap() {
        let id = id.as_u64().unwrap() as usize;
        texts[id] = Some(t.clone());
        types[id] = 1;
    }
    for a in tok["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        let t = a["content"].as_str().unwrap();
        let looks_special = t.starts_with("<|") && t.ends_with("|>");
        types[id] = if a["special"].as_bool().unwrap() || looks_special {
            3
        } else {
            4
        };
        texts[id] = Some(t.to_string());
    }
    let texts: Vec<String> = texts
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]")))
        .collect();
    let merges: Vec<String> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            other => panic!("{other}"),
        })
        .collect();
    let id_of = |t: &str| texts.iter().position(|x| x == t).unwrap() as u32;
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::Str("qwen35".into()))
        .kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", MetaValue::Str(pre.into()))
        .kv(
            "tokenizer.ggml.tokens",
            str_array(&texts.iter().map(String::as_str).collect::<Vec<_>>()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array(super::MetaArray::I32(types)),
        )
        .kv(
            "tokenizer.ggml.merges",
            str_array(&merges.iter().map(String::as_str).collect::<Vec<_>>()),
        )
        .kv(
            "tokenizer.ggml.eos_token_id",
            MetaValue::U32(id_of(tcfg["eos_token"].as_str().unwrap())),
        )
        .kv(
            "tokenizer.ggml.padding_token_id",
            MetaValue::U32(id_of(tcfg["pad_token"].as_str().unwrap())),
        )
        .kv("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    if let Some(t) = tcfg["chat_template"].as_str() {
        w.kv("tokenizer.chat_template", MetaValue::Str(t.into()));
    }
    w
}

fn open_written(w: &GgufWriter) -> (tempfile::TempDir, GgufFile) {
    let d = tempfile::tempdir().unwrap();
    let p = write_tmp(w, d.path(), "vocab.gguf");
    (d, GgufFile::open(&p).unwrap())
}

const TEXTS: &[&str] = &[
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's 'fine' — won't they?",
    "北京欢迎你。日本語のテキストと한국어.",
    "emoji 🚀🔥 and ZWJ 👩‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|>x<|im_start|>",
    "numbers 3 33 333 1234567 3.14159 -42",
    "  spaces   runs\t\ttabs\n\n\nnewlines \r\n crlf    ",
    "e\u{301}te\u{301} (decomposed) café",
    "",
    " ",
    "fn main() { println!(\"{}\", x); }",
];

#[test]
fn gguf_tokenizer_of_the_fixture_matches_its_tokenizer_json() {
    let dir = repo("fixtures/tiny-f32");
    let tok = read_json(&dir.join("tokenizer.json"));
    let tcfg = read_json(&dir.join("tokenizer_config.json"));
    let (_d, f) = open_written(&converter_vocab(&tok, &tcfg, "qwen35", 512));
    let from_gguf = TextTokenizer::from_gguf(&f, 512).unwrap();
    let from_dir = TextTokenizer::from_dir(&dir, 512, &[]).unwrap().unwrap();
    assert_eq!(
        from_gguf.vocab_size(),
        448,
        "unused [PAD] ids are not tokens"
    );
    assert_eq!(from_gguf.vocab_size(), from_dir.vocab_size());
    assert_eq!(from_gguf.eos_ids(), from_dir.eos_ids());
    assert_eq!(from_gguf.eos_ids(), [447, 445]);
    for text in TEXTS {
        let ids = from_dir.encode(text).unwrap();
        assert_eq!(from_gguf.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(
            from_gguf.decode(&ids).unwrap(),
            from_dir.decode(&ids).unwrap()
        );
    }
    // The generated document has the fixture's vocabulary and merges, in order.
    let doc: Value = serde_json::from_str(&tokenizer_json_from_gguf(&f).unwrap()).unwrap();
    assert_eq!(doc["model"]["vocab"], tok["model"]["vocab"]);
    assert_eq!(doc["model"]["merges"], tok["model"]["merges"]);
    assert_eq!(doc["added_tokens"], tok["added_tokens"]);
    assert_eq!(doc["normalizer"], tok["normalizer"]);
    assert_eq!(doc["pre_tokenizer"], tok["pre_tokenizer"]);
    assert_eq!(doc["decoder"], tok["decoder"]);
    // Same chat template, same rendering.
    assert_eq!(chat_template(&f).as_deref(), tcfg["chat_template"].as_str());
    let msgs = [
        ChatMessage {
            role: "system".into(),
            content: "Be brief.".into(),
        },
        ChatMessage {
            role: "user".into(),
            content: "hello".into(),
        },
    ];
    assert_eq!(
        from_gguf.apply_chat_template(&msgs, true).unwrap(),
        from_dir.apply_chat_template(&msgs, true).unwrap()
    );
}

fn assets(name: &str) -> PathBuf {
    repo("assets/qwen3.5").join(name)
}

#[test]
fn gguf_tokenizer_of_the_real_qwen35_vocabulary_passes_its_test_vectors() {
    let gz = std::fs::read(assets("tokenizer.json.gz")).unwrap();
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut text)
        .unwrap();
    let tok: Value = serde_json::from_str(&text).unwrap();
    let tcfg = read_json(&assets("tokenizer_config.json"));
    let (_d, f) = open_written(&converter_vocab(&tok, &tcfg, "qwen35", 248_320));
    let t = TextTokenizer::from_gguf(&f, 248_320).unwrap();
    assert_eq!(t.vocab_size(), 248_077);
    // generation_config.json's eos ids, found from the vocabulary as llama.cpp finds them.
    assert_eq!(t.eos_ids(), [248_046, 248_044]);
    let v = read_json(&assets("test_vectors.json"));
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 100);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(t.encode(text).unwrap(), want, "case {}", c["name"]);
        let decoded = c.get("decoded").and_then(|d| d.as_str()).unwrap_or(text);
        assert_eq!(t.decode(&want).unwrap(), decoded, "decode {}", c["name"]);
    }
    for (s, id) in v["special_tokens"].as_object().unwrap() {
        assert_eq!(t.encode(s).unwrap(), [id.as_u64().unwrap() as u32], "{s}");
    }
    let hash_ids: Vec<u32> = serde_json::from_value(v["hash_check"]["ids"].clone()).unwrap();
    assert_eq!(
        t.encode(v["hash_check"]["text"].as_str().unwrap()).unwrap(),
        hash_ids
    );
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "hello".into(),
    }];
    assert_eq!(
        t.apply_chat_template(&msgs, true).unwrap(),
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
}

/// llama.cpp's `ggml-vocab-qwen35.gguf` and `ggml-vocab-qwen2.gguf` (written by its converter) reproduce its
/// `.inp`/`.out` test vectors, except inputs that are not NFC: llama.cpp does not normalize, we (as Qwen's
/// tokenizer.json) do. Set `BACKBURNER_LLAMACPP_MODELS` to llama.cpp's `models/` directory to run it.
#[test]
fn gguf_llama_cpp_vocab_files_reproduce_their_test_vectors_when_available() {
    let Ok(dir) = std::env::var("BACKBURNER_LLAMACPP_MODELS") else {
        eprintln!("BACKBURNER_LLAMACPP_MODELS unset: skipping");
        return;
    };
    for name in ["ggml-vocab-qwen35.gguf", "ggml-vocab-qwen2.gguf"] {
        let p = Path::new(&dir).join(name);
        let f = GgufFile::open(&p).unwrap();
        let t = TextTokenizer::from_gguf(&f, usize::MAX).unwrap();
        let inp = std::fs::read_to_string(p.with_extension("gguf.inp")).unwrap();
        let out = std::fs::read_to_string(p.with_extension("gguf.out")).unwrap();
        let inputs: Vec<&str> = inp
            .strip_suffix("\n__ggml_vocab_test__\n")
            .unwrap_or(&inp)
            .split("\n__ggml_vocab_test__\n")
            .collect();
        let outputs: Vec<&str> = out.lines().collect();
        assert_eq!(inputs.len(), outputs.len(), "{name}");
        let (mut same, mut not_nfc) = (0, 0);
        for (s, o) in inputs.iter().zip(&outputs) {
            let want: Vec<u32> = o.split_whitespace().map(|x| x.parse().unwrap()).collect();
            let mut n = tokenizers::NormalizedString::from(*s);
            n.nfc();
            if n.get() != *s {
                not_nfc += 1;
                continue;
            }
            assert_eq!(t.encode(s).unwrap(), want, "{name}: {s:?}");
            same += 1;
        }
        eprintln!("{name}: {same} identical, {not_nfc} non-NFC inputs skipped");
        assert!(same >= 40 && not_nfc <= 3, "{name}: {same} / {not_nfc}");
    }
}

type Edit = Box<dyn Fn(&mut GgufWriter)>;

/// Edits of a good vocabulary, each with what its error must say.
fn tokenizer_error_cases() -> Vec<(Edit, &'static str)> {
    let set = |k: &'static str, v: MetaValue| {
        move |w: &mut GgufWriter| {
            w.remove(k).kv(k, v.clone());
        }
    };
    vec![
        (
            Box::new(set("tokenizer.ggml.model", MetaValue::Str("none".into()))),
            "carries no tokenizer",
        ),
        (
            Box::new(set("tokenizer.ggml.model", MetaValue::Str("llama".into()))),
            "\"llama\" is not supported",
        ),
        (
            Box::new(|w: &mut GgufWriter| {
                w.remove("tokenizer.ggml.model");
            }),
            "tokenizer.ggml.model is missing",
        ),
        (
            Box::new(set(
                "tokenizer.ggml.pre",
                MetaValue::Str("llama-bpe".into()),
            )),
            "\"llama-bpe\"",
        ),
        (
            Box::new(|w: &mut GgufWriter| {
                w.remove("tokenizer.ggml.pre");
            }),
            "tokenizer.ggml.pre is missing",
        ),
        (
            Box::new(|w: &mut GgufWriter| {
                w.remove("tokenizer.ggml.tokens");
            }),
            "tokens",
        ),
        (
            Box::new(|w: &mut GgufWriter| {
                w.remove("tokenizer.ggml.merges");
            }),
            "merges",
        ),
        (
            Box::new(set("tokenizer.ggml.merges", str_array(&["Ġt", "h e"]))),
            "merge 0",
        ),
        (
            Box::new(set("tokenizer.ggml.merges", str_array(&["h zz"]))),
            "zz",
        ),
        (
            Box::new(set(
                "tokenizer.ggml.token_type",
                MetaValue::Array(super::MetaArray::I32(vec![1; 3])),
            )),
            "as long as the token list",
        ),
        (
            Box::new(set(
                "tokenizer.ggml.token_type",
                MetaValue::Array(super::MetaArray::I32(vec![9; 448])),
            )),
            "unknown type 9",
        ),
        (
            Box::new(|w: &mut GgufWriter| {
                w.remove("tokenizer.ggml.token_type")
                    .remove("tokenizer.ggml.tokens")
                    .kv("tokenizer.ggml.tokens", str_array(&["a", "a"]));
            }),
            "appears twice",
        ),
    ]
}

#[test]
fn gguf_files_without_a_usable_tokenizer_are_refused_clearly() {
    let tok = read_json(&repo("fixtures/tiny-f32/tokenizer.json"));
    let tcfg = read_json(&repo("fixtures/tiny-f32/tokenizer_config.json"));
    let base = converter_vocab(&tok, &tcfg, "qwen35", 448);
    let err = |edit: &dyn Fn(&mut GgufWriter)| {
        let mut w = base.clone();
        edit(&mut w);
        let (_d, f) = open_written(&w);
        match TextTokenizer::from_gguf(&f, 1 << 20) {
            Err(ModelError::Tokenizer(m)) => m,
            other => panic!("{other:?}"),
        }
    };
    for (edit, want) in tokenizer_error_cases() {
        let m = err(edit.as_ref());
        assert!(m.contains(want), "want {want:?}: {m}");
    }
    // A vocabulary larger than the model's embedding.
    let (_d, f) = open_written(&base);
    assert!(matches!(
        TextTokenizer::from_gguf(&f, 100),
        Err(ModelError::VocabMismatch {
            tokenizer: 448,
            model: 100
        })
    ));
    // One token per embedding row, as llama.cpp requires (the converter pads with unused ones).
    let mut types = vec![5i32; 512];
    types[..445].fill(1);
    types[445..448].fill(3);
    types[500] = 1;
    let mut w = converter_vocab(&tok, &tcfg, "qwen35", 512);
    w.remove("tokenizer.ggml.token_type").kv(
        "tokenizer.ggml.token_type",
        MetaValue::Array(super::MetaArray::I32(types)),
    );
    let (_d, f) = open_written(&w);
    assert!(matches!(
        TextTokenizer::from_gguf(&f, 500),
        Err(ModelError::VocabMismatch {
            tokenizer: 512,
            model: 500
        })
    ));
    // ... and a layout whose ids the tokenizers crate would renumber (a normal token past the added ones) is refused
    assert!(matches!(
        TextTokenizer::from_gguf(&f, 512),
        Err(ModelError::Tokenizer(m)) if m.contains("\"<|endoftext|>\" is stored at id 445")
    ));
    let mut w = base.clone();
    w.remove("tokenizer.chat_template");
    let (_d, f) = open_written(&w);
    assert_eq!(chat_template(&f), None);
}
