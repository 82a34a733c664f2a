//! A GGUF whose tensors mix every block type, as llama-quantize writes them: `fixtures/gguf/tiny-q-mix.gguf` (the
//! tiny-q model requantized with one `--tensor-type` per matrix: IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S, IQ4_NL, IQ4_XS,
//! TQ1_0, TQ2_0, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K–Q6_K, F32 `ssm_alpha`/`ssm_beta`, a Q8_0 embedding) against
//! llama.cpp on the same file (`tiny-q-mix.reference.json`): its greedy run, and its f32 run of the file dequantized
//! by llama-quantize, whose logits are the exact products of the quantized weights.

use std::collections::BTreeSet;
use std::path::PathBuf;

use backburner_model::gguf::{GgmlType, GgufFile};
use backburner_model::{KvOptions, Model, ModelState};

const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F32,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf")
        .join(name)
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ints(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap() as u32
}

#[test]
fn the_file_holds_every_block_type() {
    let f = GgufFile::open(&fixture("tiny-q-mix.gguf")).unwrap();
    let got: BTreeSet<String> = f
        .tensor_names()
        .iter()
        .map(|n| f.tensor(n).unwrap().ggml_type.name())
        .collect();
    for t in [
        "F32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
        "TQ1_0", "TQ2_0", "MXFP4",
    ] {
        assert!(got.contains(t), "{t} missing: {got:?}");
    }
    assert_eq!(
        f.tensor("blk.0.ssm_alpha.weight").unwrap().ggml_type,
        GgmlType::F32
    );
}

#[test]
fn every_type_mixed_in_one_file_gives_llama_cpp_s_tokens_and_logits_as_close_to_the_exact_ones() {
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("tiny-q-mix.reference.json")).unwrap())
            .unwrap();
    let m = Model::load(&fixture("tiny-q-mix.gguf")).unwrap();
    let c = m.config().clone();
    let mut s = ModelState::new(&c, 0..c.num_hidden_layers, KV);
    let prompt = ints(&r["prompt"]);
    let mut logits = m.forward_tokens(&prompt, &mut s, Some(prompt.len() - 1..prompt.len()));
    let logits0 = logits.clone();
    let mut tokens = Vec::new();
    for _ in 0..8 {
        let t = argmax(&logits);
        tokens.push(t);
        logits = m.forward_tokens(&[t], &mut s, Some(0..1));
    }
    // Both engines round activations to 8 bits; ours must be at least about as close to the exact logits.
    let exact = floats(&r["exact_logits0"]);
    let (ours, llama) = (
        max_diff(&logits0, &exact),
        max_diff(&floats(&r["llama_logits0"]), &exact),
    );
    assert!(
        ours <= 1.1 * llama && ours < 0.6,
        "ours {ours} vs llama.cpp {llama} from the exact logits"
    );
    // Tokens: equal to llama.cpp's and to the exact run's up to the first step whose top-2 margin is below llama.cpp's
    // error from the exact logits (steps 0..3 here: margins 0.89, 1.27, 4.21, then 0.14).
    let margins = floats(&r["llama_margins"]);
    let clear = margins.iter().take_while(|&&g| g > llama).count();
    assert_eq!(clear, 3);
    assert_eq!(tokens[..clear], ints(&r["llama_tokens"])[..clear]);
    assert_eq!(tokens[..clear], ints(&r["exact_tokens"])[..clear]);
}
