//! Loading only what is held, measured: a process that loads half the layers (and the ends) has a peak resident
//! memory above its baseline equal, within 15 %, to the bytes of the weights it holds (single-file and sharded
//! checkpoints), and fingerprinting the layers it does not hold adds nothing resident.
//!
//! Each measurement runs in a fresh child process (this test binary re-run on one test with `BB_RSS_CHILD` set),
//! whose peak resident memory (`VmHWM`) it prints.

use std::path::Path;
use std::process::Command;

use backburner_engine::memory::{peak_rss_bytes, rss_bytes};
use backburner_model::{load_bytes, synthetic, Checkpoint, LoadOptions, Model, ModelConfig};

const N_LAYERS: usize = 8;

/// 8 layers of hidden 512 / intermediate 2048 (about 8 MB each in bf16) and a 8k vocabulary with an untied head
/// (8 MB each): the layers are most of the 80 MB.
fn write_model(dir: &Path) {
    let mut c = synthetic::tiny_config(N_LAYERS);
    c["hidden_size"] = 512.into();
    c["intermediate_size"] = 2048.into();
    c["vocab_size"] = 8192.into();
    c["num_attention_heads"] = 8.into();
    c["num_key_value_heads"] = 2.into();
    c["head_dim"] = 64.into();
    c["linear_num_key_heads"] = 4.into();
    c["linear_num_value_heads"] = 8.into();
    c["linear_key_head_dim"] = 64.into();
    c["linear_value_head_dim"] = 64.into();
    synthetic::write_random_checkpoint(dir, &c, 3).unwrap();
}

/// Rewrites `dir`'s single file as one shard per layer plus one for the ends, with `model.safetensors.index.json`.
fn shard(dir: &Path) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut groups: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for name in st.names() {
        let g = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .map_or("ends".to_string(), |(i, _)| format!("layer{i}"));
        groups.entry(g).or_default().push(name.to_string());
    }
    let mut map = serde_json::Map::new();
    for (g, names) in &groups {
        let file = format!("model-{g}.safetensors");
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for n in names {
            map.insert(n.clone(), file.clone().into());
        }
    }
    drop(st);
    std::fs::remove_file(&path).unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// In a child: opens `dir`, loads `layers` (and the ends if asked), optionally fingerprints every layer, and prints
/// `peak <VmHWM> rss <VmRSS> weights <bytes>`.
#[test]
fn child() {
    let Ok(spec) = std::env::var("BB_RSS_CHILD") else {
        return;
    };
    let v: Vec<&str> = spec.split(',').collect();
    let (dir, a, b, ends, fp) = (
        Path::new(v[0]),
        v[1].parse::<usize>().unwrap(),
        v[2].parse::<usize>().unwrap(),
        v[3] == "1",
        v[4] == "1",
    );
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let opts = LoadOptions { layers: a..b, ends };
    let m = Model::from_checkpoint(cfg.clone(), &ck, &opts, |_, _| {}).unwrap();
    if fp {
        let f = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
        f(0..cfg.num_hidden_layers).unwrap();
    }
    println!(
        "MEASURED peak {} rss {} weights {}",
        peak_rss_bytes().unwrap(),
        rss_bytes().unwrap(),
        m.weight_bytes()
    );
}

/// Runs [`child`] in a new process; returns its peak RSS.
fn measure(dir: &Path, layers: std::ops::Range<usize>, ends: bool, fp: bool) -> u64 {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(
            "BB_RSS_CHILD",
            format!(
                "{},{},{},{},{}",
                dir.display(),
                layers.start,
                layers.end,
                ends as u8,
                fp as u8
            ),
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // the harness may print "test child ... " on the same line
    let line = text.split("MEASURED").nth(1).expect("the child's line");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn check(dir: &Path, label: &str) {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let bytes = |layers: std::ops::Range<usize>, ends| {
        load_bytes(&ck, &cfg, &LoadOptions { layers, ends }).unwrap()
    };
    let half = N_LAYERS / 2;
    let (w_full, w_half) = (bytes(0..N_LAYERS, true), bytes(0..half, true));
    let base = measure(dir, 0..0, false, false);
    let full = measure(dir, 0..N_LAYERS, true, false);
    let part = measure(dir, 0..half, true, false);
    let part_fp = measure(dir, 0..half, true, true);
    let mb = |b: u64| b as f64 / 1e6;
    eprintln!(
        "{label}: baseline {:.1} MB; full: peak {:.1} MB above it for {:.1} MB of weights; half: {:.1} MB for {:.1} MB; \
         half + fingerprint of every layer: {:.1} MB",
        mb(base),
        mb(full - base),
        mb(w_full),
        mb(part - base),
        mb(w_half),
        mb(part_fp - base),
    );
    for (got, want, what) in [(full, w_full, "full"), (part, w_half, "half")] {
        let above = got.saturating_sub(base) as f64;
        assert!(
            (above - want as f64).abs() <= 0.15 * want as f64,
            "{label} {what}: {above} bytes above the baseline for {want} bytes of weights"
        );
    }
    // fingerprinting the layers it does not hold reads them through 4 MiB buffers, not the map
    assert!(
        part_fp <= part + (8 << 20),
        "{label}: fingerprinting added {} bytes",
        part_fp - part
    );
}

#[test]
#[cfg(target_os = "linux")]
fn half_the_layers_take_half_the_memory_and_fingerprints_add_none() {
    if std::env::var("BB_RSS_CHILD").is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    check(dir.path(), "single file");
    shard(dir.path());
    check(dir.path(), "sharded");
}
