//! Layers placed on a device leave the host: after [`Model::place_layers`] the host holds none of their weights
//! ([`Model::host_weight_bytes`] falls by exactly their bytes, counted here from the unplaced model's own tensors),
//! and a load that places layers as it reads them ([`Model::from_checkpoint_placed`]) gives the same model, bit for
//! bit, as a load then a placement. On the device layer's CPU backend, for the f32, bf16 and GGUF block-format
//! fixtures.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use backburner_model::device::{top_k_row, Backend, CpuBackend, DeviceError, LayerPlacement};
use backburner_model::model::{Ffn, Layer, Mixer};
use backburner_model::synthetic::{tiny_moe_config, write_random_checkpoint};
use backburner_model::{
    load_bytes, Checkpoint, KvOptions, LoadOptions, Model, ModelConfig, ModelError, ModelState,
};

const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F16,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

const FIXTURES: [&str; 4] = ["tiny-f32", "tiny-bf16", "gguf/tiny-q-mix.gguf", "tiny-mtp"];

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Logits of a 70-token prompt (a delta-rule chunk and a rest), then of 4 greedy decode steps, as bits.
fn run(m: &Model) -> Vec<Vec<u32>> {
    let c = m.config();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let prompt: Vec<u32> = (0..70u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) % c.vocab_size as u32)
        .collect();
    let first = m.forward_tokens(&prompt, &mut s, Some(69..70));
    let mut next = top_k_row(&first, 1)[0].0;
    let mut out = vec![bits(&first)];
    for _ in 0..4 {
        let l = m.forward_tokens(&[next], &mut s, Some(0..1));
        next = top_k_row(&l, 1)[0].0;
        out.push(bits(&l));
    }
    assert!(s.take_remote_error().is_none());
    out
}

/// Bytes of `l`'s projections' packed storage, summed here from its tensors.
fn layer_storage(l: &Layer) -> usize {
    let mix = match &l.mixer {
        Mixer::Linear(w) => [&w.in_proj, &w.out_proj],
        Mixer::Attention(w) => [&w.qkv, &w.o_proj],
    };
    let Ffn::Dense { gate_up, down } = &l.ffn else {
        panic!("a dense fixture")
    };
    mix.into_iter()
        .chain([gate_up, down])
        .flat_map(|m| m.storage())
        .map(<[u8]>::len)
        .sum()
}

/// Bytes of `l`'s weights, summed here from its tensors: [`layer_storage`] and every f32 vector.
fn layer_bytes(l: &Layer) -> usize {
    let vectors = match &l.mixer {
        Mixer::Linear(w) => vec![&w.conv_weight, &w.dt_bias, &w.neg_a, &w.norm],
        Mixer::Attention(w) => vec![&w.q_norm, &w.k_norm],
    };
    let vecs: usize = vectors
        .into_iter()
        .chain([&l.input_norm, &l.post_norm])
        .map(|v| 4 * v.len())
        .sum();
    layer_storage(l) + vecs
}

/// A load of every layer and the ends of `path`, placing `place` on the CPU backend as it reads (none: a plain
/// load); with the progress calls it made.
fn load_placed(path: &Path, place: Option<Range<usize>>) -> (Model, Vec<(usize, usize)>) {
    let config = ModelConfig::from_dir(path).unwrap();
    let ckpt = Checkpoint::open(path).unwrap();
    let opts = LoadOptions {
        layers: 0..config.num_hidden_layers,
        ends: true,
    };
    let place = place.map(|layers| LayerPlacement {
        layers,
        backend: cpu(),
    });
    let mut calls = Vec::new();
    let m = Model::from_checkpoint_placed(
        config,
        &ckpt,
        &opts,
        &|_, _| false,
        place.as_ref(),
        |d, t| calls.push((d, t)),
    )
    .unwrap();
    (m, calls)
}

#[test]
fn placed_layers_weights_leave_the_host_and_the_bits_stay() {
    for name in FIXTURES {
        let path = fixture(name);
        let plain = Model::load(&path).unwrap();
        let n = plain.config().num_hidden_layers;
        let want = run(&plain);
        let all = plain.weight_bytes();
        assert_eq!(plain.host_weight_bytes(), all, "{name}: nothing placed");
        assert_eq!(plain.device_weight_bytes(), 0);
        let ckpt = Checkpoint::open(&path).unwrap();
        let opts = LoadOptions {
            layers: 0..n,
            ends: true,
        };
        assert_eq!(
            load_bytes(&ckpt, plain.config(), &opts).unwrap(),
            all as u64
        );
        let placements: Vec<Vec<Range<usize>>> =
            vec![vec![0..n], vec![0..n / 2], vec![0..1, n - 2..n]];
        for ranges in placements {
            let mut m = Model::load(&path).unwrap();
            for r in &ranges {
                m.place_layers(r.clone(), cpu()).unwrap();
            }
            let on = |i: usize| ranges.iter().any(|r| r.contains(&i));
            let gone: usize = (0..n)
                .filter(|&i| on(i))
                .map(|i| layer_bytes(plain.layer(i).unwrap()))
                .sum();
            assert!(gone > 0);
            assert_eq!(m.host_weight_bytes(), all - gone, "{name} {ranges:?}");
            // the node's weights, wherever held, are still the checkpoint's share
            assert_eq!(m.weight_bytes(), all, "{name} {ranges:?}");
            for i in 0..n {
                assert_eq!(m.layer(i).is_none(), on(i), "{name} layer {i}");
            }
            let storage = |m: &Model| m.weight_storage().iter().map(|s| s.len()).sum::<usize>();
            let gone_storage: usize = (0..n)
                .filter(|&i| on(i))
                .map(|i| layer_storage(plain.layer(i).unwrap()))
                .sum();
            assert_eq!(storage(&m), storage(&plain) - gone_storage);
            assert_eq!(run(&m), want, "{name}: layers {ranges:?} placed");
        }
    }
}

#[test]
fn a_load_that_places_layers_as_it_reads_them_gives_the_placed_model() {
    for name in FIXTURES {
        let path = fixture(name);
        let n = ModelConfig::from_dir(&path).unwrap().num_hidden_layers;
        let (plain, calls) = load_placed(&path, None);
        assert_eq!(calls, (1..=n).map(|d| (d, n)).collect::<Vec<_>>());
        for r in [0..n, 0..3, 2..n - 1] {
            let mut then = Model::load(&path).unwrap();
            then.place_layers(r.clone(), cpu()).unwrap();
            if r == (0..n) {
                then.place_head(cpu()).unwrap();
            }
            let (streamed, calls) = load_placed(&path, Some(r.clone()));
            // every layer placed: the head goes too
            let head = (r == (0..n)).then_some(backburner_model::device::DeviceId::CPU);
            assert_eq!(streamed.head_placement(), head, "{name} {r:?}");
            assert_eq!(calls.len(), n, "{name}: every layer reported");
            assert_eq!(streamed.placement(), then.placement(), "{name} {r:?}");
            assert_eq!(streamed.host_weight_bytes(), then.host_weight_bytes());
            assert_eq!(streamed.device_weight_bytes(), then.device_weight_bytes());
            assert_eq!(streamed.weight_bytes(), plain.weight_bytes());
            assert!(r.clone().all(|i| streamed.layer(i).is_none()));
            assert_eq!(run(&streamed), run(&then), "{name}: layers {r:?} streamed");
        }
        assert_eq!(run(&plain), run(&Model::load(&path).unwrap()));
    }
}

/// Batched decode and snapshots on a model whose placed layers never were on the host: each sequence's logits equal
/// the plain model's, and going back to a snapshot repeats them.
#[test]
fn batched_decode_and_snapshots_run_a_streamed_placement() {
    let path = fixture("tiny-bf16");
    let plain = Model::load(&path).unwrap();
    let (m, _) = load_placed(&path, Some(0..5));
    let c = m.config().clone();
    let n = c.num_hidden_layers;
    let prompts: [Vec<u32>; 2] = [vec![4, 8, 15], (0..30).collect()];
    let (mut batch, mut alone) = (Vec::new(), Vec::new());
    for p in &prompts {
        let mut s = ModelState::new(&c, 0..n, KV);
        m.forward_tokens(p, &mut s, None);
        batch.push(s);
        let mut s = ModelState::new(&c, 0..n, KV);
        plain.forward_tokens(p, &mut s, None);
        alone.push(s);
    }
    let snap = batch[1].snapshot();
    let mut first = Vec::new();
    for step in 0..3u32 {
        let ids = [5 + step, 40 - step];
        let mut refs: Vec<&mut ModelState> = batch.iter_mut().collect();
        let got = m.forward_decode_batch(&ids, &mut refs);
        for (i, s) in alone.iter_mut().enumerate() {
            let want = plain.forward_tokens(&[ids[i]], s, Some(0..1));
            let row = &got[i * c.vocab_size..(i + 1) * c.vocab_size];
            assert_eq!(bits(row), bits(&want), "step {step}, sequence {i}");
        }
        first.push(bits(&got[c.vocab_size..]));
    }
    batch[1].restore(&snap);
    for (step, want) in (0..3u32).zip(&first) {
        let got = m.forward_tokens(&[40 - step], &mut batch[1], Some(0..1));
        assert_eq!(&bits(&got), want, "after restore, step {step}");
    }
}

#[test]
fn a_load_refuses_placements_it_cannot_make_before_reading() {
    let path = fixture("tiny-f32");
    let config = ModelConfig::from_dir(&path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let refuse =
        |config: &ModelConfig, ckpt: &Checkpoint, layers: Range<usize>, held: Range<usize>| {
            let opts = LoadOptions {
                layers: held,
                ends: true,
            };
            let place = LayerPlacement {
                layers,
                backend: cpu(),
            };
            let mut heard = 0;
            let r = Model::from_checkpoint_placed(
                config.clone(),
                ckpt,
                &opts,
                &|_, _| false,
                Some(&place),
                |_, _| heard += 1,
            );
            assert_eq!(heard, 0, "refused before any layer loads");
            match r {
                Err(ModelError::Device(e @ DeviceError::Unsupported(..))) => e.to_string(),
                other => panic!("{other:?}"),
            }
        };
    let e = refuse(&config, &ckpt, 0..0, 0..8);
    assert!(e.contains("this node holds 0..8"), "{e}");
    let e = refuse(&config, &ckpt, 4..9, 0..8);
    assert!(e.contains("layers 4..9"), "{e}");
    let e = refuse(&config, &ckpt, 0..4, 2..8);
    assert!(e.contains("this node holds 2..8"), "{e}");

    let moe = tempfile::tempdir().unwrap();
    write_random_checkpoint(moe.path(), &tiny_moe_config(2), 5).unwrap();
    let config = ModelConfig::from_dir(moe.path()).unwrap();
    let ckpt = Checkpoint::open(moe.path()).unwrap();
    let e = refuse(&config, &ckpt, 0..2, 0..2);
    assert!(e.contains("mixture-of-experts"), "{e}");
}
