//! A `qwen35moe` GGUF file as llama.cpp lays one out (its `llama_model_qwen35moe::load_arch_tensors`): each kind of
//! expert matrix one 3-D tensor `blk.N.ffn_{gate,up,down}_exps.weight` (`[H, I, E]`, `[I, H, E]` in ggml order), the
//! shared expert's gate a vector `ffn_gate_inp_shexp.weight` `[H]`, the experts' sizes in `qwen35moe.expert_*`
//! keys, norms stored as `1 + w` and `A` as `−exp(A_log)`. Written here from a random f32 checkpoint (its v heads as
//! many as its k heads, so the converter's v-head reordering is the identity), it must give the checkpoint's
//! logits bit for bit.
//!
//! A `qwen3next` file as llama.cpp's converter writes one (`Qwen3NextModel.modify_tensors`): Hugging Face's
//! `in_proj_qkvz` (fused per k head) split by kind into `attn_qkv` (every q, every k, every v) and `attn_gate` (z),
//! or kept fused as `ssm_in` (older converters); `in_proj_ba` kept fused per k head as `ssm_ba`; the v heads in
//! Hugging Face's grouped order (no reordering). From a random f32 Qwen3-Next checkpoint with more v heads than k
//! heads, both layouts must give its logits bit for bit.

use std::path::Path;

use crate::moe::logit_bits;

use backburner_model::arch::{arch_of, GdnProjections, Read, Slot, TensorSpec};
use backburner_model::gguf::writer::GgufWriter;
use backburner_model::gguf::{GgmlType, MetaValue};
use backburner_model::{synthetic, Checkpoint, Model, ModelConfig};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The random MoE checkpoint rewritten as f32 safetensors (so that both files hold the same f32 weights).
fn f32_checkpoint(dir: &Path) -> ModelConfig {
    let mut cfg = synthetic::tiny_moe_config(4);
    cfg["linear_num_value_heads"] = 2.into();
    f32_checkpoint_of(dir, &cfg)
}

/// A random checkpoint of `cfg` written as f32 safetensors into `dir`.
fn f32_checkpoint_of(dir: &Path, cfg: &serde_json::Value) -> ModelConfig {
    let tmp = tempfile::tempdir().unwrap();
    synthetic::write_random_checkpoint(tmp.path(), cfg, 71).unwrap();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let bufs: Vec<(String, Vec<usize>, Vec<u8>)> = ck
        .names()
        .into_iter()
        .map(|n| {
            let shape = ck.shape(n).unwrap();
            (
                n.to_string(),
                shape.clone(),
                f32_bytes(&ck.read_f32(n, &shape).unwrap()),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bufs
        .iter()
        .map(|(n, s, b)| {
            let t = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (n.clone(), t)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::copy(tmp.path().join("config.json"), dir.join("config.json")).unwrap();
    ModelConfig::from_dir(dir).unwrap()
}

/// The GGUF metadata of `c` as llama.cpp's converter writes it for `arch` (`qwen35moe`, `qwen3next`).
fn metadata(w: &mut GgufWriter, c: &ModelConfig, arch: &str) {
    let m = c.moe.as_ref().unwrap();
    let u = |x: usize| MetaValue::U32(x as u32);
    let a = |k: &str| format!("{arch}.{k}");
    w.kv("general.architecture", MetaValue::Str(arch.into()));
    if arch == "qwen3next" {
        w.kv(&a("feed_forward_length"), u(c.intermediate_size));
    }
    for (k, v) in [
        ("block_count", c.num_hidden_layers),
        ("context_length", c.max_position_embeddings),
        ("embedding_length", c.hidden_size),
        ("attention.head_count", c.num_attention_heads),
        ("attention.head_count_kv", c.num_key_value_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.rotary_dim()),
        ("ssm.conv_kernel", c.linear_conv_kernel_dim),
        ("ssm.state_size", c.linear_key_head_dim),
        ("ssm.group_count", c.linear_num_key_heads),
        ("ssm.time_step_rank", c.linear_num_value_heads),
        (
            "ssm.inner_size",
            c.linear_num_value_heads * c.linear_value_head_dim,
        ),
        ("full_attention_interval", c.full_attention_interval),
        ("expert_count", m.num_experts),
        ("expert_used_count", m.num_experts_per_tok),
        ("expert_feed_forward_length", m.moe_intermediate_size),
        (
            "expert_shared_feed_forward_length",
            m.shared_expert_intermediate_size,
        ),
    ] {
        w.kv(&a(k), u(v));
    }
    w.kv(
        &a("rope.freq_base"),
        MetaValue::F32(c.rope.rope_theta as f32),
    )
    .kv(
        &a("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(c.rms_norm_eps as f32),
    );
}

/// One tensor's values as the GGUF stores them (the computed-with value of a vector) and its ggml dims.
fn stored(ck: &Checkpoint, t: &TensorSpec) -> (Vec<f32>, Vec<u64>) {
    let v = match t.read {
        Read::Vector(kind) => ck.read_vector(&t.name, &t.shape, kind).unwrap(),
        Read::Matrix => ck.read_f32(&t.name, &t.shape).unwrap(),
    };
    let mut dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
    if t.slot == Slot::Conv || t.slot == Slot::SharedGate {
        dims.retain(|&d| d != 1); // [kernel, conv_dim] and [H]
    }
    (v, dims)
}

/// Writes `ck` as a `qwen35moe` GGUF at `path`; `merged`: each layer's gate and up experts as one
/// `ffn_gate_up_exps` tensor (`[H, 2I, E]`: each expert's gate rows, then its up rows), as newer converters may.
fn write_gguf(ck: &Checkpoint, c: &ModelConfig, path: &Path, merged: bool) {
    write_gguf_as(ck, c, path, merged, Layout::Qwen35Moe);
}

/// The file's architecture and, for `qwen3next`, how the fused Gated DeltaNet projection `in_proj_qkvz` is written.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// `qwen35moe`.
    Qwen35Moe,
    /// `qwen3next`, `in_proj_qkvz` split by kind into `attn_qkv` and `attn_gate` (llama.cpp's converter).
    NextSplit,
    /// `qwen3next`, `in_proj_qkvz` fused per k head as `ssm_in` (older converters).
    NextFused,
}

/// The rows of `v` (`[rows, cols]` f32, row-major) in `ranges`, in order.
fn gather(v: &[f32], cols: usize, ranges: &[std::ops::Range<usize>]) -> Vec<f32> {
    ranges
        .iter()
        .flat_map(|r| v[r.start * cols..r.end * cols].iter().copied())
        .collect()
}

/// [`write_gguf`] in the layout `next`.
fn write_gguf_as(ck: &Checkpoint, c: &ModelConfig, path: &Path, merged: bool, next: Layout) {
    let arch = arch_of(c);
    let mut w = GgufWriter::new();
    let name = if next == Layout::Qwen35Moe {
        "qwen35moe"
    } else {
        "qwen3next"
    };
    metadata(&mut w, c, name);
    let n_exp = c.moe.as_ref().unwrap().num_experts;
    let mut specs = arch.end_tensors(c);
    for i in 0..c.num_hidden_layers {
        specs.extend(arch.layer_tensors(c, i));
    }
    let mut stacks: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    for t in &specs {
        let (v, dims) = stored(ck, t);
        let Some(e) = t.expert else {
            let g = arch.gguf_name(&t.name).unwrap();
            if next == Layout::NextSplit && g.ends_with(".ssm_in.weight") {
                // q, k, v of every k head (the first three quarters of the gathered ranges), then every z
                let ranges = t.rows.as_ref().unwrap();
                let (qkv, z) = ranges.split_at(ranges.len() / 4 * 3);
                let blk = g.strip_suffix(".ssm_in.weight").unwrap();
                for (part, r) in [("attn_qkv", qkv), ("attn_gate", z)] {
                    let rows = gather(&v, c.hidden_size, r);
                    let d = [c.hidden_size as u64, (rows.len() / c.hidden_size) as u64];
                    w.tensor(
                        &format!("{blk}.{part}.weight"),
                        &d,
                        GgmlType::F32,
                        f32_bytes(&rows),
                    );
                }
                continue;
            }
            w.tensor(&g, &dims, GgmlType::F32, f32_bytes(&v));
            continue;
        };
        // blk.N.ffn_*_exps.weight: expert e's matrix at its place in the stack
        let layer = t.name.split('.').nth(2).unwrap();
        let kind = t.name.rsplit('.').nth(1).unwrap().trim_end_matches("_proj");
        let g = format!("blk.{layer}.ffn_{kind}_exps.weight");
        match stacks.iter_mut().find(|(n, _, _)| *n == g) {
            Some((_, _, data)) => data.extend(&v),
            None => stacks.push((g, [dims, vec![n_exp as u64]].concat(), v)),
        }
        assert!(e < n_exp);
    }
    if merged {
        stacks = merge_gate_up(stacks, n_exp);
    }
    for (g, dims, data) in stacks {
        w.tensor(&g, &dims, GgmlType::F32, f32_bytes(&data));
    }
    w.write(path).unwrap();
}

type Stack = (String, Vec<u64>, Vec<f32>);

/// Each layer's `ffn_gate_exps` and `ffn_up_exps` stacks merged into `ffn_gate_up_exps`, expert by expert.
fn merge_gate_up(stacks: Vec<Stack>, n_exp: usize) -> Vec<Stack> {
    let is = |n: &str, k: &str| n.ends_with(&format!(".ffn_{k}_exps.weight"));
    let mut out: Vec<Stack> = stacks
        .iter()
        .filter(|(n, _, _)| !is(n, "gate") && !is(n, "up"))
        .cloned()
        .collect();
    for (n, dims, gate) in stacks.iter().filter(|(n, _, _)| is(n, "gate")) {
        let blk = n.strip_suffix(".ffn_gate_exps.weight").unwrap();
        let up_name = format!("{blk}.ffn_up_exps.weight");
        let (_, _, up) = stacks.iter().find(|(n, _, _)| *n == up_name).unwrap();
        let per = gate.len() / n_exp;
        let mut data = Vec::with_capacity(2 * gate.len());
        for e in 0..n_exp {
            data.extend_from_slice(&gate[e * per..(e + 1) * per]);
            data.extend_from_slice(&up[e * per..(e + 1) * per]);
        }
        let dims = vec![dims[0], 2 * dims[1], dims[2]];
        out.push((format!("{blk}.ffn_gate_up_exps.weight"), dims, data));
    }
    out
}

#[test]
fn a_qwen35moe_gguf_gives_its_checkpoints_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let c = f32_checkpoint(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let gguf = dir.path().join("moe.gguf");
    write_gguf(&ck, &c, &gguf, false);
    let merged = dir.path().join("merged.gguf");
    write_gguf(&ck, &c, &merged, true);
    let (a, b) = (
        Model::load(dir.path()).unwrap(),
        Model::load(&gguf).unwrap(),
    );
    let gc = b.config();
    assert_eq!(gc.moe, c.moe);
    assert_eq!(gc.ffn_types, c.ffn_types);
    let ids: Vec<u32> = (0..90).map(|i| (i * 53) % 512).collect();
    assert_eq!(logit_bits(&a, &ids), logit_bits(&b, &ids));
    // the merged gate|up layout reads the same weights
    let m = Model::load(&merged).unwrap();
    assert_eq!(logit_bits(&a, &ids), logit_bits(&m, &ids));
    assert_eq!(a.weight_bytes(), m.weight_bytes());
    // every tensor of either file is read: none is reported unused
    for f in [&gguf, &merged] {
        let g = Checkpoint::open(f).unwrap();
        let unused = backburner_model::checkpoint::unused_tensors(&g, gc);
        assert!(unused.unknown.is_empty(), "{:?}", unused.unknown);
    }
    assert_eq!(a.weight_bytes(), b.weight_bytes());
}

#[test]
fn a_qwen35moe_gguf_with_fewer_experts_than_its_metadata_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let c = f32_checkpoint(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let gguf = dir.path().join("moe.gguf");
    write_gguf(&ck, &c, &gguf, false);
    // the metadata says 9 experts; the tensors hold 8
    let f = backburner_model::GgufFile::open(&gguf).unwrap();
    let mut w = GgufWriter::copy_of(&f).unwrap();
    w.remove("qwen35moe.expert_count")
        .kv("qwen35moe.expert_count", MetaValue::U32(9));
    let bad = dir.path().join("bad.gguf");
    w.write(&bad).unwrap();
    let e = Model::load(&bad).unwrap_err().to_string();
    assert_eq!(
        e,
        "tensor \"blk.0.ffn_gate_inp.weight\" has shape [64, 8], expected [64, 9]"
    );
}

#[test]
fn a_qwen3next_gguf_gives_its_checkpoints_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    // Hv 4 over Hk 2 (the grouped order shows); as llama.cpp's qwen3next: every layer MoE, the top k renormalized
    let mut cfg = synthetic::tiny_next_config(4);
    cfg["norm_topk_prob"] = true.into();
    cfg["mlp_only_layers"] = serde_json::json!([]);
    let c = f32_checkpoint_of(dir.path(), &cfg);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let a = Model::load(dir.path()).unwrap();
    let ids: Vec<u32> = (0..90).map(|i| (i * 53) % 512).collect();
    let want = logit_bits(&a, &ids);
    for (next, file, stored) in [
        (
            Layout::NextSplit,
            "next.gguf",
            GdnProjections::SplitQkvzFusedBa,
        ),
        (
            Layout::NextFused,
            "next-ssm-in.gguf",
            GdnProjections::FusedPerKHead,
        ),
    ] {
        let gguf = dir.path().join(file);
        write_gguf_as(&ck, &c, &gguf, false, next);
        let b = Model::load(&gguf).unwrap();
        let gc = b.config();
        assert_eq!(gc.model_type, "qwen3_next");
        assert_eq!(gc.moe, c.moe);
        assert_eq!(gc.ffn_types, c.ffn_types);
        assert_eq!(gc.linear_v_head_order, c.linear_v_head_order);
        assert_eq!(gc.gdn_projections, Some(stored));
        assert_eq!(logit_bits(&b, &ids), want, "{file}");
        assert_eq!(a.weight_bytes(), b.weight_bytes());
        let g = Checkpoint::open(&gguf).unwrap();
        let unused = backburner_model::checkpoint::unused_tensors(&g, gc);
        assert!(unused.unknown.is_empty(), "{file}: {:?}", unused.unknown);
    }
}
