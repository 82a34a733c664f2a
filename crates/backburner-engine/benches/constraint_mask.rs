//! What a grammar costs per generated token on the real Qwen3.5 vocabulary (248,320 logits, the bundled
//! `assets/qwen3.5` tokenizer): building the token trie once, compiling a schema, and per step the mask (llguidance)
//! plus setting the disallowed logits to `-inf`, while a JSON value of the schema is generated token by token (the
//! tokens of a fixed answer, so every step is a real mid-answer state). Prints medians; compare with a decode step's
//! time (`backburner bench local`).
//!
//! `cargo bench -p backburner-engine --bench constraint_mask`

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
use backburner_model::TextTokenizer;
use serde_json::json;

fn qwen35() -> (tempfile::TempDir, TextTokenizer) {
    let assets = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5");
    let d = tempfile::tempdir().unwrap();
    let gz = std::fs::read(assets.join("tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    std::fs::write(d.path().join("tokenizer.json"), &json).unwrap();
    for f in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(assets.join(f), d.path().join(f)).unwrap();
    }
    let t = TextTokenizer::from_dir(d.path(), 248_320, &[])
        .unwrap()
        .unwrap();
    (d, t)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (_d, tok) = qwen35();
    let tok = Arc::new(tok);
    let t0 = Instant::now();
    let g = Arc::new(Grammars::new(&tok, 248_320, tok.eos_ids()).unwrap());
    println!(
        "trie of 248,320 tokens: {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                        "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": false}
        },
        "required": ["name", "age", "email", "tags", "address"],
        "additionalProperties": false
    });
    let answer = r#"{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "12345"}}"#;
    let ids = tok.encode(answer).unwrap();
    let mut logits = vec![0.5f32; 248_320];
    for (name, grammar) in [
        ("json_schema", Grammar::JsonSchema(schema)),
        ("json_object", Grammar::JsonObject),
    ] {
        let spec = ConstraintSpec {
            grammars: g.clone(),
            grammar,
            after: None,
        };
        let mut compile = Vec::new();
        let mut steps = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let mut c = spec.start().unwrap();
            compile.push(t.elapsed().as_secs_f64() * 1e3);
            for &id in &ids {
                let t = Instant::now();
                c.mask(&mut logits).unwrap();
                steps.push(t.elapsed().as_secs_f64() * 1e3);
                assert!(
                    logits[id as usize].is_finite(),
                    "the answer's token {id} is allowed"
                );
                c.accept(id).unwrap();
                logits.iter_mut().for_each(|x| *x = 0.5);
            }
        }
        println!(
            "{name}: compile {:.2} ms; per token (mask + -inf): median {:.3} ms, max {:.3} ms over {} steps",
            median(compile),
            median(steps.clone()),
            steps.iter().copied().fold(0.0, f64::max),
            steps.len()
        );
    }
}
