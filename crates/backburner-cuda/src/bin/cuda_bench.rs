//! `cuda_bench`: the CUDA backend's figures at Qwen3.5-27B's per-layer shapes (hidden 5120, MLP 17408, attention 24
//! q / 4 kv heads × 256, Gated DeltaNet 16 k / 48 v heads × 128, conv 4: `fixtures/ref-27b-config/config.json`).
//!
//! 1. device-to-device copy bandwidth (`cuMemcpyDtoD` of 1 GiB, best of 10; read + write bytes per second);
//! 2. decode products (1 row of x): weight bytes read per second for each projection of a layer in Q4_K (from a
//!    random GGUF) and bf16, as a percentage of (1);
//! 3. prefill products at 512 rows (cuBLAS, bf16; Q4_K dequantized to a tile first): TFLOP/s;
//! 4. whole layers through `DeviceLayers` on a random 27B-shaped Q4_K GGUF of `--layers` layers (default 8: six
//!    Gated DeltaNet, two attention; vocabulary 1024): a 512-token prefill and decode steps, milliseconds per layer.
//!
//! Prints one JSON object on stdout (progress on stderr). Usage:
//! `cuda_bench [--layers N] [--dir DIR] [--quick] [--probe] [--small]` (`--dir`: where the GGUF is written, default
//! the system's temp dir; `--quick`: fewer repetitions; `--probe`: open the device, print what it is, stop;
//! `--small`: every width shrunk and a 16-token prefill, a dry run of the code paths, e.g. on the CPU emulation of scripts/gpu/emulate.sh).

use std::sync::Arc;
use std::time::Instant;

use backburner_cuda::CudaBackend;
use backburner_kernels::matmul::{PackedMatrix, WeightDtype};
use backburner_model::device::{Backend, DeviceLayers, DeviceMatrix};
use backburner_model::gguf::random::{Generator, TypeRule, Vocab};
use backburner_model::model::{Ffn, Mixer};
use backburner_model::{KvOptions, Linear, Model, ModelConfig};
use serde_json::{json, Value};

const CONFIG_27B: &str = include_str!("../../../../fixtures/ref-27b-config/config.json");

type Res<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The best (smallest) seconds of `reps` runs of `f`, each followed by a stream sync.
fn best(be: &CudaBackend, reps: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    be.sync().map_err(s)?;
    let mut b = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        be.sync().map_err(s)?;
        b = b.min(t.elapsed().as_secs_f64());
    }
    Ok(b)
}

/// Device-to-device copy: GB/s of read + write bytes.
fn copy_bandwidth(be: &CudaBackend, reps: usize) -> Res<f64> {
    let bytes = 1usize << 30;
    let (a, b) = (
        be.alloc_bytes(bytes).map_err(s)?,
        be.alloc_bytes(bytes).map_err(s)?,
    );
    let t = best(be, reps, || be.copy_bytes(&b, &a, bytes).map_err(s))?;
    Ok(2.0 * bytes as f64 / t / 1e9)
}

/// The 27B config with `layers` layers and a small vocabulary (`small`: every width shrunk, for a dry run).
fn config(layers: usize, small: bool) -> Res<ModelConfig> {
    let mut v: Value = serde_json::from_str(CONFIG_27B).map_err(s)?;
    v["num_hidden_layers"] = layers.into();
    v["vocab_size"] = 1024.into();
    if small {
        for (k, n) in [
            ("hidden_size", 256),
            ("intermediate_size", 512),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("head_dim", 64),
            ("linear_num_key_heads", 2),
            ("linear_num_value_heads", 4),
            ("linear_key_head_dim", 32),
            ("linear_value_head_dim", 64),
        ] {
            v[k] = n.into();
        }
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("layer_types");
    }
    ModelConfig::from_json_str(&v.to_string()).map_err(s)
}

/// Writes and loads a random Q4_K GGUF of `c`.
fn q4k_model(c: &ModelConfig, dir: &std::path::Path) -> Res<Model> {
    let path = dir.join("cuda-bench-27b-q4k.gguf");
    let rule = TypeRule::parse("Q4_K", &[]).map_err(s)?;
    let g = Generator::new(c, &rule, &Vocab::ByteLevel, 11).map_err(s)?;
    let t = Instant::now();
    g.write_file(&path, 64 << 20, &mut |_| {}).map_err(s)?;
    eprintln!(
        "wrote {} in {:.1} s",
        path.display(),
        t.elapsed().as_secs_f64()
    );
    let m = Model::load(&path).map_err(s)?;
    let _ = std::fs::remove_file(&path);
    Ok(m)
}

/// The projections of layer 0 (Gated DeltaNet) and of the first attention layer, by name.
fn projections(m: &Model) -> Vec<(String, &Linear)> {
    let mut v = Vec::new();
    let mut seen_attn = false;
    for i in 0..m.config().num_hidden_layers {
        let Some(l) = m.layer(i) else { continue };
        match &l.mixer {
            Mixer::Linear(w) if i == 0 => v.extend([
                ("gdn.in_proj".into(), &w.in_proj),
                ("gdn.out_proj".into(), &w.out_proj),
            ]),
            Mixer::Attention(w) if !seen_attn => {
                seen_attn = true;
                v.extend([
                    ("attn.qkv".into(), &w.qkv),
                    ("attn.o_proj".into(), &w.o_proj),
                ]);
            }
            _ => continue,
        }
        if let (0, Ffn::Dense { gate_up, down }) = (i, &l.ffn) {
            v.extend([("mlp.gate_up".into(), gate_up), ("mlp.down".into(), down)]);
        }
    }
    v
}

/// Decode (1 row) and prefill (512 rows) timings of `w` on the device.
fn products(be: &Arc<CudaBackend>, w: &DeviceMatrix, copy_gbs: f64, reps: usize) -> Res<Value> {
    let x1 = be.upload(&vec![0.01; w.k]).map_err(s)?;
    let x512 = be.upload(&vec![0.01; 512 * w.k]).map_err(s)?;
    let mut y = be.zeros(0).map_err(s)?;
    let t1 = best(be, reps * 5, || be.matmul(&x1, 1, w, &mut y).map_err(s))?;
    let t512 = best(be, reps, || be.matmul(&x512, 512, w, &mut y).map_err(s))?;
    let gbs = w.bytes as f64 / t1 / 1e9;
    Ok(json!({
        "n": w.n, "k": w.k, "bytes": w.bytes,
        "decode_us": t1 * 1e6, "decode_read_gbs": gbs, "decode_pct_of_copy": 100.0 * gbs / copy_gbs,
        "prefill512_ms": t512 * 1e3, "prefill512_tflops": 2.0 * 512.0 * (w.n * w.k) as f64 / t512 / 1e12,
    }))
}

/// A random bf16 `[n, k]` matrix on the device.
fn bf16_matrix(be: &CudaBackend, n: usize, k: usize) -> Res<DeviceMatrix> {
    let v: Vec<f32> = (0..n * k)
        .map(|i| ((i * 2_654_435_761) % 1000) as f32 * 1e-5 - 5e-3)
        .collect();
    be.upload_matrix(&Linear::new(PackedMatrix::from_f32(
        n,
        k,
        &v,
        WeightDtype::Bf16,
    )))
    .map_err(s)
}

/// Prefill and decode milliseconds per layer through DeviceLayers.
fn whole_layers(be: Arc<CudaBackend>, m: &Model, reps: usize, tokens: usize) -> Res<Value> {
    let n = m.config().num_hidden_layers;
    let h = m.config().hidden_size;
    let dl = DeviceLayers::new(m, 0..n, be.clone()).map_err(s)?;
    let kv = KvOptions {
        page_size: 4096,
        dtype: backburner_kernels::kv::KvDtype::F16,
    };
    let mut prefill = f64::INFINITY;
    let mut decode = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let mut st = dl.new_state(kv).map_err(s)?;
        let mut x: Vec<f32> = (0..tokens * h)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-3)
            .collect();
        let t = Instant::now();
        dl.forward_host(0..n, &mut x, tokens, 0, &mut st)
            .map_err(s)?;
        prefill = prefill.min(t.elapsed().as_secs_f64());
        for p in 0..8 {
            let mut x1: Vec<f32> = x[..h].to_vec();
            let t = Instant::now();
            dl.forward_host(0..n, &mut x1, 1, tokens + p, &mut st)
                .map_err(s)?;
            decode = decode.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(json!({
        "layers": n, "weight_bytes": dl.weight_bytes(),
        "prefill_tokens": tokens,
        "prefill_ms_per_layer": prefill * 1e3 / n as f64,
        "prefill_tokens_per_s": tokens as f64 / prefill,
        "decode_ms_per_layer": decode * 1e3 / n as f64,
        "note": "forward_host: one upload and one download of the residual stream per call (included)",
    }))
}

fn run() -> Res<Value> {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let layers: usize = opt("--layers").map_or(Ok(8), |v| v.parse().map_err(s))?;
    let dir = opt("--dir").map_or_else(std::env::temp_dir, Into::into);
    let reps = if args.iter().any(|a| a == "--quick") {
        3
    } else {
        10
    };
    let be = Arc::new(CudaBackend::open(0).map_err(s)?);
    let info = be.info();
    eprintln!("{} ({})", info.name, info.backend);
    if args.iter().any(|a| a == "--probe") {
        return Ok(json!({"device": info.name, "backend": info.backend, "opened": true}));
    }
    let copy = copy_bandwidth(&be, reps)?;
    eprintln!("copy {copy:.0} GB/s");
    let small = args.iter().any(|a| a == "--small");
    let c = config(layers, small)?;
    let m = q4k_model(&c, &dir)?;
    let mut q4 = serde_json::Map::new();
    let mut bf = serde_json::Map::new();
    for (name, w) in projections(&m) {
        let dq = be.upload_matrix(w).map_err(s)?;
        q4.insert(name.clone(), products(&be, &dq, copy, reps)?);
        drop(dq);
        let db = bf16_matrix(&be, w.out_features(), w.in_features())?;
        bf.insert(name.clone(), products(&be, &db, copy, reps)?);
        eprintln!("{name} done");
    }
    let tokens = if small { 16 } else { 512 };
    let layers_v = whole_layers(be.clone(), &m, reps.min(3), tokens)?;
    Ok(json!({
        "device": info.name, "backend": info.backend, "memory_bytes": info.memory_bytes,
        "copy_dtod_gbs": copy,
        "q4_k": q4, "bf16": bf,
        "layers_q4_k": layers_v,
    }))
}

fn main() {
    match run() {
        Ok(v) => println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default()),
        Err(e) => {
            eprintln!("cuda_bench: {e}");
            std::process::exit(1);
        }
    }
}
