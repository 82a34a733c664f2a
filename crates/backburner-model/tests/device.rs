//! The device layer on the CPU backend: layers placed on it give the CPU path's logits bit for bit, whatever the
//! range placed (all layers, a middle range, two ranges), through prefill (more than a delta-rule chunk) and decode,
//! for dense (safetensors) and block-format (GGUF Q4_K, Q6_K, Q8_0 mix) weights, the output head placed too; and the
//! placement's typed errors.

use std::sync::Arc;

use backburner_model::device::{top_k_row, Backend, CpuBackend, DeviceError, DeviceId, Registry};
use backburner_model::gguf::random::{Generator, TypeRule, Vocab};
use backburner_model::synthetic::{tiny_config, tiny_moe_config, write_random_checkpoint};
use backburner_model::{KvOptions, Model, ModelConfig, ModelState};

/// Small pages so that the prompt and the decode steps cross page boundaries.
const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F16,
};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend)
}

/// Logits of a 70-token prompt (one 64-token chunk and a rest), then of 5 decode steps, as bits.
fn run(m: &Model) -> Vec<Vec<u32>> {
    let c = m.config();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let prompt: Vec<u32> = (0..70u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % c.vocab_size as u32)
        .collect();
    let mut out = vec![bits(&m.forward_tokens(&prompt, &mut s, Some(0..70)))];
    let mut next = 3u32;
    for _ in 0..5 {
        let l = m.forward_tokens(&[next], &mut s, Some(0..1));
        next = top_k_row(&l, 1)[0].0;
        out.push(bits(&l));
    }
    assert!(s.take_remote_error().is_none());
    out
}

fn check_placements(load: impl Fn() -> Model) {
    let want = run(&load());
    let n = load().config().num_hidden_layers;
    let placements: Vec<Vec<std::ops::Range<usize>>> =
        vec![vec![0..n], vec![1..n - 1], vec![0..1, 2..n], vec![n - 1..n]];
    for ranges in placements {
        let mut m = load();
        for r in &ranges {
            m.place_layers(r.clone(), cpu()).unwrap();
        }
        let placed: Vec<_> = m.placement().into_iter().map(|(r, _)| r).collect();
        assert_eq!(placed, ranges);
        assert!(m.device_weight_bytes() > 0);
        assert_eq!(run(&m), want, "layers {ranges:?} on the CPU backend");
    }
    let mut m = load();
    m.place_layers(0..n, cpu()).unwrap();
    m.place_head(cpu()).unwrap();
    assert_eq!(m.head_placement(), Some(DeviceId::CPU));
    assert_eq!(run(&m), want, "every layer and the head on the CPU backend");
}

#[test]
fn layers_on_the_cpu_backend_give_the_cpu_paths_bits_dense() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    check_placements(|| Model::load(dir.path()).unwrap());
}

#[test]
fn layers_on_the_cpu_backend_give_the_cpu_paths_bits_block_formats() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let c = ModelConfig::from_json_str(&tiny_config(4).to_string()).unwrap();
    let o = vec!["ffn_down=Q6_K".to_string(), "attn_qkv=Q8_0".to_string()];
    let rule = TypeRule::parse("Q4_K", &o).unwrap();
    let g = Generator::new(&c, &rule, &Vocab::ByteLevel, 7).unwrap();
    g.write_file(&path, 1 << 20, &mut |_| {}).unwrap();
    check_placements(|| Model::load(&path).unwrap());
}

#[test]
fn placing_layers_checks_the_range_and_the_layers() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    let mut m = Model::load(dir.path()).unwrap();
    for r in [0..0, 2..5] {
        assert!(matches!(
            m.place_layers(r, cpu()),
            Err(DeviceError::Unsupported(DeviceId::CPU, _))
        ));
    }
    m.place_layers(1..3, cpu()).unwrap();
    let e = m.place_layers(2..4, cpu()).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    assert!(m.placement().len() == 1);

    let moe = tempfile::tempdir().unwrap();
    write_random_checkpoint(moe.path(), &tiny_moe_config(2), 5).unwrap();
    let mut m = Model::load(moe.path()).unwrap();
    let e = m.place_layers(0..2, cpu()).unwrap_err();
    assert!(e.to_string().contains("mixture-of-experts"), "{e}");
    assert!(m.placement().is_empty());
}

/// Batched decode with layers on a device: each sequence's logits equal its own single-sequence pass (on the
/// plain model too), sequences at different positions.
#[test]
fn batched_decode_with_placed_layers_gives_each_sequences_own_bits() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    let plain = Model::load(dir.path()).unwrap();
    let mut m = Model::load(dir.path()).unwrap();
    m.place_layers(1..3, cpu()).unwrap();
    m.place_head(cpu()).unwrap();
    let c = m.config().clone();
    let prompts: [Vec<u32>; 3] = [vec![1, 2, 3], (0..20).collect(), vec![7; 9]];
    let mut batch: Vec<ModelState> = Vec::new();
    let mut alone: Vec<ModelState> = Vec::new();
    for p in &prompts {
        let mut s = ModelState::new(&c, 0..4, KV);
        m.forward_tokens(p, &mut s, None);
        batch.push(s);
        let mut s = ModelState::new(&c, 0..4, KV);
        plain.forward_tokens(p, &mut s, None);
        alone.push(s);
    }
    for step in 0..3u32 {
        let ids = [5 + step, 9, 40 - step];
        let mut refs: Vec<&mut ModelState> = batch.iter_mut().collect();
        let got = m.forward_decode_batch(&ids, &mut refs);
        for (i, s) in alone.iter_mut().enumerate() {
            let want = plain.forward_tokens(&[ids[i]], s, Some(0..1));
            let row = &got[i * c.vocab_size..(i + 1) * c.vocab_size];
            assert_eq!(bits(row), bits(&want), "step {step}, sequence {i}");
        }
    }
}

#[test]
#[should_panic(expected = "verify runs on the CPU path only")]
fn verify_with_placed_layers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    let mut m = Model::load(dir.path()).unwrap();
    m.place_layers(0..2, cpu()).unwrap();
    let c = m.config().clone();
    let mut s = ModelState::new(&c, 0..4, KV);
    let _ = m.forward_verify(&[1, 2], &mut s);
}

#[test]
fn top_k_orders_by_logit_then_id_and_the_registry_opens_the_cpu() {
    let row = [0.5, 2.0, f32::NAN, 2.0, -1.0, 3.0];
    assert_eq!(top_k_row(&row, 3), vec![(5, 3.0), (1, 2.0), (3, 2.0)]);
    assert_eq!(top_k_row(&row, 0), vec![]);
    assert_eq!(top_k_row(&row, 10).len(), 6);
    assert_eq!(top_k_row(&row, 10)[5].0, 2, "NaN last");
    let cpu = CpuBackend;
    let mut l = cpu.upload(&row).unwrap();
    assert_eq!(
        cpu.top_k(&l, 2, 1).unwrap(),
        vec![vec![(1, 2.0)], vec![(2, 3.0)]]
    );
    let y = cpu.upload(&[1.0; 6]).unwrap();
    cpu.add_assign(&mut l, &y).unwrap();
    let mut back = [0.0; 6];
    cpu.download(&l, &mut back).unwrap();
    assert_eq!(back[..2], [1.5, 3.0]);

    let reg = Registry::cpu_only();
    let (list, missing) = reg.list();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].id, DeviceId::CPU);
    assert!(list[0].memory_bytes > 0);
    assert!(missing.is_empty());
    assert_eq!(reg.open(DeviceId::CPU).unwrap().info().id, DeviceId::CPU);
    let e = reg.open("cuda:0".parse().unwrap()).err().unwrap();
    assert!(matches!(e, DeviceError::NotBuilt("cuda", _)), "{e}");
    assert!(e.to_string().contains("--features cuda"));
}

/// Decodes `ids` one at a time from `s`, each step's logits as bits.
fn decode(m: &Model, s: &mut ModelState, ids: &[u32]) -> Vec<Vec<u32>> {
    ids.iter()
        .map(|&id| bits(&m.forward_tokens(&[id], s, Some(0..1))))
        .collect()
}

#[test]
fn snapshots_restore_and_clear_cover_the_layers_on_a_device() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    let plain = Model::load(dir.path()).unwrap();
    let mut placed = Model::load(dir.path()).unwrap();
    placed.place_layers(1..4, cpu()).unwrap();
    let c = plain.config().clone();
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 7 + 3) % 200).collect();
    let steps = [5u32, 9, 2, 11];
    let mut want = ModelState::new(&c, 0..4, KV);
    plain.forward_tokens(&prompt, &mut want, None);
    let want = decode(&plain, &mut want, &steps);

    let mut s = ModelState::new(&c, 0..4, KV);
    placed.forward_tokens(&prompt, &mut s, None);
    let snap = s.snapshot();
    assert_eq!(snap.n_tokens(), 70);
    assert_eq!(decode(&placed, &mut s, &steps), want);
    // back to the snapshot: the device's recurrent states and KV rows go back too
    s.restore(&snap);
    assert_eq!(decode(&placed, &mut s, &steps), want, "after restore");
    assert_eq!(
        s.go_back(70, &[&snap]).unwrap(),
        backburner_model::state::Back::Checkpoint
    );
    assert_eq!(decode(&placed, &mut s, &steps), want, "after go_back");
    // a fork copies the device's state too (tests/device_fork.rs): the copy is at the state's position
    let mut other = ModelState::new(&c, 0..4, KV);
    assert!(other.copy_from(&s));
    assert_eq!(other.n_tokens(), s.n_tokens());
    // a cleared state starts over on the device too
    s.clear();
    placed.forward_tokens(&prompt, &mut s, None);
    assert_eq!(decode(&placed, &mut s, &steps), want, "after clear");
    assert!(s.take_remote_error().is_none());
}

#[test]
fn checkpoints_inside_a_prefill_cover_the_layers_on_a_device() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 29).unwrap();
    let plain = Model::load(dir.path()).unwrap();
    let mut placed = Model::load(dir.path()).unwrap();
    placed.place_layers(0..3, cpu()).unwrap();
    let c = plain.config().clone();
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 13 + 1) % 200).collect();
    let steps = [4u32, 8, 15];
    let run_with = |m: &Model| {
        let mut s = ModelState::new(&c, 0..4, KV);
        s.request_checkpoints(&[64, 100, 128, 150]);
        m.forward_tokens(&prompt, &mut s, None);
        let cps = s.take_checkpoints();
        (s, cps)
    };
    let (mut ps, plain_cps) = run_with(&plain);
    let want = decode(&plain, &mut ps, &steps);
    let (mut s, cps) = run_with(&placed);
    // 64 and 128 are chunk boundaries and 150 the call's end; 100 is neither
    let at: Vec<usize> = cps.iter().map(|c| c.n_tokens()).collect();
    assert_eq!(at, vec![64, 128, 150]);
    assert_eq!(
        at,
        plain_cps.iter().map(|c| c.n_tokens()).collect::<Vec<_>>()
    );
    assert_eq!(cps[0].bytes(), plain_cps[0].bytes());
    for cp in &cps {
        // resume from each checkpoint: the rest of the prompt, then the decode steps, give the uninterrupted bits
        s.go_back(cp.n_tokens(), &[cp]).unwrap();
        placed.forward_tokens(&prompt[cp.n_tokens()..], &mut s, None);
        assert_eq!(
            decode(&placed, &mut s, &steps),
            want,
            "from {}",
            cp.n_tokens()
        );
        // and the plain model resumes from the placed model's checkpoint alike (the same states)
        ps.go_back(cp.n_tokens(), &[cp]).unwrap();
        plain.forward_tokens(&prompt[cp.n_tokens()..], &mut ps, None);
        assert_eq!(
            decode(&plain, &mut ps, &steps),
            want,
            "plain from {}",
            cp.n_tokens()
        );
    }
    // a decode step's checkpoint is its end
    let n = s.n_tokens();
    s.request_checkpoints(&[n + 1]);
    ps.request_checkpoints(&[n + 1]);
    placed.forward_tokens(&[3], &mut s, None);
    plain.forward_tokens(&[3], &mut ps, None);
    let (a, b) = (s.take_checkpoints(), ps.take_checkpoints());
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].n_tokens(), a[0].bytes()),
        (b[0].n_tokens(), b[0].bytes())
    );
}
