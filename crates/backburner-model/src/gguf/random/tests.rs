//! The generator: files read back with the GGUF reader as planned (types, dims, bytes, config), every block's
//! scales finite and non-zero, dequantized values of the target size, determinism, fallbacks, bounded writes.

use std::collections::HashMap;

use backburner_kernels::quant::{dequantize, QuantFormat};
use half::f16;

use super::*;
use crate::gguf::{config_from_gguf, GgufFile};
use crate::synthetic::tiny_config;

fn config(v: &serde_json::Value) -> ModelConfig {
    ModelConfig::from_json_str(&v.to_string()).unwrap()
}

/// Every row length a multiple of 256: hidden 256, intermediate 512, attention 4 × 64, Gated DeltaNet 2 k heads of
/// 64 and 4 v heads of 64.
fn wide_config(n_layers: usize) -> serde_json::Value {
    let mut c = tiny_config(n_layers);
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("head_dim", 64),
        ("linear_key_head_dim", 64),
        ("linear_value_head_dim", 64),
    ] {
        c[k] = v.into();
    }
    c
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The super-block scale `d` of a block of `t` and its second scale (Q4_1 / Q5_1's `m`, the K-quants' `dmin`), read
/// at the offsets ggml's block structs give them; MXFP4's `d` is `2^(e − 128)`.
fn scales(t: GgmlType, b: &[u8]) -> (f32, Option<f32>) {
    use GgmlType::*;
    match t {
        Q4_1 | Q5_1 | Q4K | Q5K => (f16_at(b, 0), Some(f16_at(b, 2))),
        Q2K => (f16_at(b, 80), Some(f16_at(b, 82))),
        Q3K => (f16_at(b, 108), None),
        Q6K => (f16_at(b, 208), None),
        Tq1_0 => (f16_at(b, 52), None),
        Tq2_0 => (f16_at(b, 64), None),
        Iq1M => {
            let w = |i: usize| u16::from_le_bytes([b[48 + 2 * i], b[49 + 2 * i]]) >> 12;
            let bits = w(0) | (w(1) << 4) | (w(2) << 8) | (w(3) << 12);
            (f16::from_bits(bits).to_f32(), None)
        }
        Mxfp4 => (2f32.powi(i32::from(b[0]) - 128), None),
        _ => (f16_at(b, 0), None),
    }
}

/// Checks every block's scales of quantized data of type `t`.
fn check_scales(what: &str, t: GgmlType, data: &[u8]) {
    let (_, bb) = t.block().unwrap();
    for (i, b) in data.chunks_exact(bb).enumerate() {
        let (d, m) = scales(t, b);
        assert!(d.is_finite() && d > 0.0, "{what} block {i}: d = {d}");
        if let Some(m) = m {
            assert!(m.is_finite() && m != 0.0, "{what} block {i}: min = {m}");
            let centred_below = matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1);
            assert_eq!(m < 0.0, centred_below, "{what} block {i}: min = {m}");
        }
        if t == GgmlType::Tq2_0 {
            assert!(b[..64]
                .iter()
                .all(|&x| (0..4).all(|k| (x >> (2 * k)) & 3 != 3)));
        }
    }
}

/// The values of float data of type `t`.
fn floats(t: GgmlType, data: &[u8]) -> Vec<f32> {
    match t {
        GgmlType::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        GgmlType::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Dequantized values of `data` when the kernels read type `t`.
fn dequantized(t: GgmlType, data: &[u8]) -> Option<Vec<f32>> {
    let f = QuantFormat::from_ggml_type(t.id())?;
    let (be, bb) = t.block().unwrap();
    let mut out = vec![0f32; data.len() / bb * be];
    dequantize(f, data, &mut out).unwrap();
    Some(out)
}

#[test]
fn every_quantized_type_makes_blocks_with_finite_nonzero_scales_of_the_target_size() {
    let exact = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Iq4Xs,
    ];
    let mut checked = Vec::new();
    for &t in GENERATED_TYPES.iter().filter(|&&t| !is_float(t)) {
        let q = blocks::quant(t).unwrap_or_else(|| panic!("{t} has a recipe"));
        let (be, bb) = t.block().unwrap();
        let mut data = vec![0u8; bb * (16384 / be)];
        blocks::fill_quant(t, &q, &mut data, 0.02, &mut SplitMix(7));
        check_scales(&t.name(), t, &data);
        let Some(v) = dequantized(t, &data) else {
            continue;
        };
        assert!(v.iter().all(|x| x.is_finite()), "{t}");
        let r = rms(&v);
        assert!((0.01..0.04).contains(&r), "{t}: rms {r}");
        if exact.contains(&t) {
            assert!((r / 0.02 - 1.0).abs() < 0.15, "{t}: rms {r}");
        }
        checked.push(t);
    }
    for t in exact {
        assert!(checked.contains(&t), "{t} dequantized");
    }
}

#[test]
fn float_draws_have_their_distribution() {
    let mut rng = SplitMix(3);
    let mut data = vec![0u8; 4 * 20000];
    let draw = |mean, std, map| Draw { mean, std, map };
    let values = |data: &[u8]| -> Vec<f32> {
        data.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    blocks::fill_floats(
        GgmlType::F32,
        &mut data,
        &draw(0.0, 0.1, ValueMap::OnePlus),
        &mut rng,
    );
    let v = values(&data);
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
    assert!((mean - 1.0).abs() < 0.005, "{mean}");
    let sd = rms(&v.iter().map(|&x| x - 1.0).collect::<Vec<_>>());
    assert!((sd / 0.1 - 1.0).abs() < 0.03, "{sd}");
    blocks::fill_floats(
        GgmlType::F32,
        &mut data,
        &draw(0.0, 0.5, ValueMap::NegExp),
        &mut rng,
    );
    assert!(values(&data).iter().all(|&a| a < 0.0 && a.is_finite()));
    for t in [GgmlType::F16, GgmlType::BF16] {
        let mut d = vec![0u8; 2 * 20000];
        blocks::fill_floats(t, &mut d, &draw(0.0, 0.02, ValueMap::Plain), &mut rng);
        let v: Vec<f32> = d
            .chunks_exact(2)
            .map(|c| match t {
                GgmlType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
                _ => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            })
            .collect();
        assert!((rms(&v) / 0.02 - 1.0).abs() < 0.03, "{t}");
    }
}

#[test]
fn rules_parse_match_and_fall_back_as_llama_quantize() {
    let r = TypeRule::parse(
        "iq2_xs",
        &["^output.weight$=Q6_K".into(), "ffn=q8_0".into()],
    )
    .unwrap();
    assert_eq!(r.default, GgmlType::Iq2Xs);
    assert_eq!(r.explicit("output.weight"), Some(GgmlType::Q6K));
    assert_eq!(r.explicit("blk.0.attn_output.weight"), None);
    assert_eq!(r.explicit("blk.0.ffn_down.weight"), Some(GgmlType::Q8_0));
    assert_eq!(r.describe(), "IQ2_XS,^output.weight$=Q6_K,ffn=Q8_0");
    assert!(pattern_matches("ssm_", "blk.1.ssm_alpha.weight"));
    assert!(pattern_matches("alpha.weight$", "blk.1.ssm_alpha.weight"));
    assert!(!pattern_matches("^ssm", "blk.1.ssm_alpha.weight"));
    for bad in ["Q4_K_M", "Q8_K", "nope"] {
        assert!(TypeRule::parse(bad, &[]).is_err(), "{bad}");
    }
    assert!(TypeRule::parse("Q4_0", &["ffn".into()]).is_err());
    assert!(TypeRule::parse("Q4_0", &["=F16".into()]).is_err());
    use GgmlType::*;
    let cases = [
        (Iq2Xs, 5120, Iq2Xs),
        (Iq2Xs, 96, Iq4Nl),
        (Q4K, 64, Q5_0),
        (Q5K, 64, Q5_1),
        (Q6K, 64, Q8_0),
        (Tq1_0, 64, Q4_0),
        (Q3K, 48, F16),
        (Q8_0, 48, F16),
    ];
    for (t, cols, want) in cases {
        let (req, got, fb) = rule::choose(&TypeRule::new(t).unwrap(), "x", cols, true);
        assert_eq!((req, got), (t, want), "{t} on {cols}");
        assert_eq!(fb.is_some(), t != want);
    }
    let r = TypeRule::parse("Q4_0", &["norm=F16".into(), "a=Q8_0".into()]).unwrap();
    assert_eq!(rule::choose(&r, "x_norm", 64, false), (F16, F16, None));
    let nq = Some(Fallback::NotQuantizable);
    assert_eq!(rule::choose(&r, "ssm_a", 64, false), (Q8_0, F32, nq));
    assert_eq!(rule::choose(&r, "ssm_d", 64, false), (F32, F32, None));
}

/// Writes `g` to a file in `dir` and checks it against its plan with the GGUF reader: the same tensors, types, dims
/// and byte lengths, the planned config read back, every quantized block's scales, dequantized projections of about
/// 0.02 where the kernels read the type, finite float values. Returns the file.
fn check_written(g: &Generator, dir: &std::path::Path) -> GgufFile {
    let path = dir.join("random.gguf");
    let stats = g
        .write_file(&path, DEFAULT_BUFFER_BYTES, &mut |_| {})
        .unwrap();
    assert_eq!(stats.bytes, g.file_bytes());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), g.file_bytes());
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensor_names().len(), g.tensors().len());
    assert_eq!(&config_from_gguf(&f).unwrap(), g.config());
    // llama.cpp's loaders require the MRoPE sections (four, summing to the rotary pairs unless the config gave them).
    let arch = f.architecture().unwrap().to_string();
    let sections = f
        .metadata()
        .get_i32_array(&format!("{arch}.rope.dimension_sections"))
        .expect("rope.dimension_sections");
    let mut want: Vec<i32> = g
        .config()
        .rope
        .mrope_section
        .as_ref()
        .expect("sections")
        .iter()
        .map(|&x| x as i32)
        .collect();
    want.resize(4, 0);
    assert_eq!(sections, want);
    for t in g.tensors() {
        let info = f.tensor(&t.name).unwrap_or_else(|| panic!("{}", t.name));
        assert_eq!(
            (&info.dims, info.ggml_type, info.n_bytes),
            (&t.dims, t.ggml_type, t.n_bytes),
            "{}",
            t.name
        );
        let data = f.data(&t.name).unwrap();
        if is_float(t.ggml_type) {
            let v = floats(t.ggml_type, data);
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            continue;
        }
        check_scales(&t.name, t.ggml_type, data);
        if let Some(v) = dequantized(t.ggml_type, data) {
            let r = rms(&v);
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            assert!(
                (0.01..0.04).contains(&r),
                "{}: {} rms {r}",
                t.name,
                t.ggml_type
            );
        }
    }
    f
}

#[test]
fn a_tiny_model_with_a_type_mix_reads_back_with_its_fallbacks() {
    let c = config(&tiny_config(4));
    let overrides: Vec<String> = [
        "ssm_alpha=F32",
        "ssm_beta=BF16",
        "token_embd=Q8_0",
        "^output.weight$=Q6_K",
        "attn_qkv=F16",
        "attn_norm=Q8_0",
        "ssm_norm=F16",
        "ffn_down=IQ4_XS",
        "attn_gate=TQ2_0",
        "attn_k.=MXFP4",
        "attn_v=Q5_1",
        "attn_q.=Q4_1",
    ]
    .map(String::from)
    .to_vec();
    let rule = TypeRule::parse("Q4_K", &overrides).unwrap();
    let g = Generator::new(&c, &rule, &Vocab::ByteLevel, 11).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = check_written(&g, dir.path());
    let ty = |n: &str| f.tensor(n).unwrap().ggml_type;
    use GgmlType::*;
    for (n, t) in [
        ("blk.0.ssm_alpha.weight", F32),
        ("blk.0.ssm_beta.weight", BF16),
        ("token_embd.weight", Q8_0),
        ("output.weight", Q8_0),
        ("blk.3.attn_output.weight", Q5_0),
        ("blk.0.attn_qkv.weight", F16),
        ("blk.0.attn_norm.weight", F32),
        ("blk.0.ssm_norm.weight", F16),
        ("blk.2.ffn_down.weight", Iq4Nl),
        ("blk.1.attn_gate.weight", Q4_0),
        ("blk.3.attn_k.weight", Mxfp4),
        ("blk.3.attn_k_norm.weight", F32),
        ("blk.3.attn_v.weight", Q5_1),
        ("blk.3.attn_q.weight", Q4_1),
        ("blk.0.ffn_gate.weight", Q5_0),
        ("blk.0.ssm_out.weight", Q5_0),
        ("blk.0.ssm_conv1d.weight", F32),
        ("blk.0.ssm_a", F32),
    ] {
        assert_eq!(ty(n), t, "{n}");
    }
    let fb: HashMap<&str, Fallback> = g
        .fallbacks()
        .map(|t| (t.name.as_str(), t.fallback.unwrap()))
        .collect();
    let rows = |cols, block| Fallback::RowLength { cols, block };
    assert_eq!(fb["output.weight"], rows(64, 256));
    assert_eq!(fb["blk.2.ffn_down.weight"], rows(128, 256));
    assert_eq!(fb["blk.0.attn_norm.weight"], Fallback::NotQuantizable);
    assert!(!fb.contains_key("blk.0.ssm_alpha.weight"));
    assert!(!fb.contains_key("blk.3.attn_k.weight"));
    // a norm gain near 1, A negative, the conv kernel N(0, 0.3)
    let vals = |n: &str| floats(ty(n), f.data(n).unwrap());
    let norm = vals("output_norm.weight");
    let mean = norm.iter().sum::<f32>() / norm.len() as f32;
    assert!((mean - 1.0).abs() < 0.05, "{mean}");
    assert!(vals("blk.1.ssm_a").iter().all(|&a| a < 0.0));
    let conv = rms(&vals("blk.1.ssm_conv1d.weight"));
    assert!((0.2..0.4).contains(&conv), "{conv}");
    // the byte-level vocabulary: eos <|im_end|>, then <|endoftext|>
    assert_eq!(g.config().eos_token_ids, [258, 256]);
    let counts = g.type_counts();
    assert_eq!(
        counts.iter().map(|c| c.tensors).sum::<usize>(),
        g.tensors().len()
    );
    let data: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    assert_eq!(counts.iter().map(|c| c.bytes).sum::<u64>(), data);
}

#[test]
fn every_type_is_written_where_rows_fit_and_reads_back() {
    let c = config(&wide_config(4));
    // one type per tensor kind, every generated type once over the two rules
    let kinds = [
        "token_embd",
        "^output.weight$",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "attn_qkv",
        "attn_gate",
        "ssm_alpha",
        "ssm_beta",
        "ssm_out",
        "attn_q.",
        "attn_k.",
        "attn_v.",
        "attn_output",
    ];
    let all: Vec<GgmlType> = GENERATED_TYPES.to_vec();
    for (round, types) in all.chunks(kinds.len()).enumerate() {
        let overrides: Vec<String> = kinds
            .iter()
            .zip(types)
            .map(|(k, t)| format!("{k}={t}"))
            .collect();
        let rule = TypeRule::parse("Q8_0", &overrides).unwrap();
        let g = Generator::new(&c, &rule, &Vocab::ByteLevel, round as u64).unwrap();
        assert_eq!(g.fallbacks().count(), 0, "round {round}");
        let dir = tempfile::tempdir().unwrap();
        let f = check_written(&g, dir.path());
        for (k, &t) in kinds.iter().zip(types) {
            let hit = g.tensors().iter().filter(|p| pattern_matches(k, &p.name));
            for p in hit.filter(|p| p.dims.len() >= 2) {
                assert_eq!(f.tensor(&p.name).unwrap().ggml_type, t, "{}", p.name);
            }
        }
    }
}

#[test]
fn moe_and_next_files_read_back_with_their_configs() {
    for (cfg, arch) in [
        (crate::synthetic::tiny_moe_config(4), "qwen35moe"),
        (crate::synthetic::tiny_next_config(4), "qwen3next"),
    ] {
        let c = config(&cfg);
        let rule = TypeRule::parse("Q8_0", &["ffn_down_exps=Q4_0".into()]).unwrap();
        let g = Generator::new(&c, &rule, &Vocab::None, 5).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = check_written(&g, dir.path());
        assert_eq!(f.architecture(), Some(arch));
        let exps = f.tensor("blk.1.ffn_down_exps.weight").unwrap();
        assert_eq!(exps.dims, [32, 64, 8]);
        assert_eq!(exps.ggml_type, GgmlType::Q4_0);
        assert_eq!(
            f.tensor("blk.1.ffn_gate_inp.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            f.tensor("blk.1.ffn_gate_inp_shexp.weight").unwrap().dims,
            [64]
        );
        // every layer MoE, as llama.cpp's loaders read these architectures
        assert!(g
            .config()
            .ffn_types
            .iter()
            .all(|&k| k == crate::FfnKind::Moe));
        assert!(g.config().eos_token_ids.is_empty());
    }
}

#[test]
fn the_same_seed_gives_the_same_bytes_whatever_the_buffer_and_another_seed_other_data() {
    let c = config(&wide_config(4));
    let rule = TypeRule::parse("Q4_K", &["ffn_up=F16".into(), "attn_qkv=IQ2_XS".into()]).unwrap();
    let bytes = |seed: u64, buffer: usize| {
        let g = Generator::new(&c, &rule, &Vocab::ByteLevel, seed).unwrap();
        let mut out = Vec::new();
        g.write_to(&mut out, buffer, &mut |_| {}).unwrap();
        (out, g.header_bytes() as usize)
    };
    let (a, header) = bytes(1, DEFAULT_BUFFER_BYTES);
    assert_eq!(a, bytes(1, DEFAULT_BUFFER_BYTES).0);
    assert_eq!(a, bytes(1, MIN_BUFFER_BYTES).0);
    assert_eq!(a, bytes(1, 100_000).0);
    let (b, header_b) = bytes(2, DEFAULT_BUFFER_BYTES);
    assert_eq!((a.len(), header), (b.len(), header_b));
    let same = a[header..]
        .iter()
        .zip(&b[header..])
        .filter(|(x, y)| x == y)
        .count();
    assert!(
        same < (a.len() - header) / 10,
        "{same} of {} bytes equal",
        a.len() - header
    );
}

/// Records the size of every write and discards the bytes.
#[derive(Default)]
struct CountingWriter {
    bytes: u64,
    largest: usize,
    calls: u64,
}

impl Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes += buf.len() as u64;
        self.largest = self.largest.max(buf.len());
        self.calls += 1;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn data_leave_in_chunks_no_larger_than_the_buffer() {
    // 8 MB of data (F32 everywhere) through a 64 KiB buffer
    let c = config(&wide_config(4));
    let g = Generator::new(
        &c,
        &TypeRule::new(GgmlType::F32).unwrap(),
        &Vocab::ByteLevel,
        9,
    )
    .unwrap();
    assert!(
        g.file_bytes() > 100 * MIN_BUFFER_BYTES as u64,
        "{}",
        g.file_bytes()
    );
    let mut w = CountingWriter::default();
    let mut seen = Vec::new();
    let stats = g
        .write_to(&mut w, MIN_BUFFER_BYTES, &mut |b| seen.push(b))
        .unwrap();
    assert_eq!(w.bytes, g.file_bytes());
    assert_eq!(stats.bytes, w.bytes);
    assert!(w.largest <= MIN_BUFFER_BYTES && stats.largest_write <= MIN_BUFFER_BYTES);
    assert!(stats.writes >= g.file_bytes() / MIN_BUFFER_BYTES as u64);
    assert_eq!(seen.len() as u64, stats.writes);
    assert!(seen.windows(2).all(|p| p[0] < p[1]) && seen.last() == Some(&w.bytes));
}
