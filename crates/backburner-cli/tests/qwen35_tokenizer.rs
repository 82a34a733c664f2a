//! The bundled Qwen3.5 tokenizer through the Rust `tokenizers` crate gives the ids Python `tokenizers` gives
//! (assets/qwen3.5/test_vectors.json), reproduces llama.cpp's Qwen3.5 tokenizer hash, and the chat template renders
//! through minijinja exactly as transformers renders it (assets/qwen3.5/chat_vectors.json, and the tool and reasoning
//! conversations of assets/qwen3.5/chat_template_vectors.json, ids included).

use std::io::Read;
use std::path::PathBuf;

use backburner_model::{ChatMessage, ChatRequest, TextTokenizer};
use sha2::{Digest, Sha256};

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5")
}

fn load() -> (tempfile::TempDir, TextTokenizer) {
    let d = tempfile::tempdir().unwrap();
    let gz = std::fs::read(assets().join("tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    std::fs::write(d.path().join("tokenizer.json"), json).unwrap();
    for f in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(assets().join(f), d.path().join(f)).unwrap();
    }
    let t = TextTokenizer::from_dir(d.path(), 248_320, &[])
        .unwrap()
        .unwrap();
    (d, t)
}

fn json(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(assets().join(name)).unwrap()).unwrap()
}

#[test]
fn qwen35_ids_match_python_tokenizers_on_every_vector() {
    let (_d, tok) = load();
    let v = json("test_vectors.json");
    assert_eq!(tok.vocab_size(), 248_077);
    assert_eq!(tok.eos_ids(), &[248_046, 248_044]);
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 100);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(tok.encode(text).unwrap(), want, "case {}", c["name"]);
        let decoded = c.get("decoded").and_then(|d| d.as_str()).unwrap_or(text);
        assert_eq!(tok.decode(&want).unwrap(), decoded, "decode {}", c["name"]);
    }
    for (s, id) in v["special_tokens"].as_object().unwrap() {
        assert_eq!(
            tok.encode(s).unwrap(),
            vec![id.as_u64().unwrap() as u32],
            "{s}"
        );
    }
}

#[test]
fn qwen35_reproduces_the_llama_cpp_tokenizer_hash() {
    // llama.cpp identifies a tokenizer by sha256(str(ids)) of a fixed check text; for Qwen3.5 it records d30d75d9….
    let (_d, tok) = load();
    let v = json("test_vectors.json");
    let ids = tok
        .encode(v["hash_check"]["text"].as_str().unwrap())
        .unwrap();
    let s = format!(
        "[{}]",
        ids.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let hash: String = Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(hash.starts_with("d30d75d9"), "{hash}");
}

#[test]
fn qwen35_chat_template_renders_like_transformers() {
    let (_d, tok) = load();
    let v = json("chat_vectors.json");
    for c in v["cases"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage {
                role: m["role"].as_str().unwrap().into(),
                content: m["content"].as_str().unwrap().into(),
            })
            .collect();
        let agp = c["add_generation_prompt"].as_bool().unwrap();
        let text = tok.apply_chat_template(&msgs, agp).unwrap();
        assert_eq!(text, c["text"].as_str().unwrap());
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(tok.encode(&text).unwrap(), ids);
    }
}

#[test]
fn qwen35_tool_and_reasoning_conversations_render_and_tokenize_like_transformers() {
    let (_d, tok) = load();
    let v = json("chat_template_vectors.json");
    let empty = serde_json::Map::new();
    for c in v["chat_cases"].as_array().unwrap() {
        for key in ["messages", "openai_messages"] {
            let Some(msgs) = c.get(key).and_then(|m| m.as_array()) else {
                continue;
            };
            for r in c["renders"].as_array().unwrap() {
                let req = ChatRequest {
                    messages: msgs,
                    tools: c["tools"].as_array().map(Vec::as_slice),
                    add_generation_prompt: r["add_generation_prompt"].as_bool().unwrap(),
                    kwargs: r["kwargs"].as_object().unwrap_or(&empty),
                };
                let text = tok.render_chat(&req).unwrap();
                assert_eq!(text, r["text"].as_str().unwrap(), "{} ({key})", c["name"]);
                let ids: Vec<u32> = serde_json::from_value(r["ids"].clone()).unwrap();
                assert_eq!(tok.encode(&text).unwrap(), ids, "{}", c["name"]);
            }
        }
    }
}
