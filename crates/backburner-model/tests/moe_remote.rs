//! Routed experts held elsewhere (an in-process holder over [`ExpertStore`]s): a model loaded without them gives
//! the bits of the whole model in prefill, decode and batched decode, for any placement (whole layers, a subset of
//! ids, two holders, every expert elsewhere); a holder's failure is latched, never silent.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use backburner_model::{
    Checkpoint, ExpertStore, HolderAsk, KvOptions, LoadOptions, Model, ModelConfig, ModelState,
    RemoteError, RemoteExperts, Segment,
};

const KV: KvOptions = KvOptions {
    page_size: 4096,
    dtype: backburner_kernels::kv::KvDtype::F32,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// Holders over stores in this process; `fail` makes every call fail; `calls` counts calls with segments.
struct InProcess {
    stores: Vec<ExpertStore>,
    fail: Mutex<bool>,
    calls: Mutex<usize>,
}

impl RemoteExperts for InProcess {
    fn holder(&self, layer: usize, expert: usize) -> Option<usize> {
        self.stores.iter().position(|s| s.holds(layer, expert))
    }

    fn holders(&self) -> usize {
        self.stores.len()
    }

    fn run(
        &self,
        layer: usize,
        hidden: usize,
        x: &[f32],
        asks: &[HolderAsk],
        local: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<f32>>, RemoteError> {
        if *self.fail.lock().unwrap() {
            return Err(RemoteError("holder gone".into()));
        }
        local();
        let mut out = Vec::new();
        for (s, a) in self.stores.iter().zip(asks) {
            if a.segments.is_empty() {
                out.push(Vec::new());
                continue;
            }
            *self.calls.lock().unwrap() += 1;
            let rows: Vec<f32> = a
                .rows
                .iter()
                .flat_map(|&r| {
                    x[r as usize * hidden..(r as usize + 1) * hidden]
                        .iter()
                        .copied()
                })
                .collect();
            out.push(
                s.run(layer, &rows, a.rows.len(), &a.segments)
                    .map_err(RemoteError)?,
            );
        }
        Ok(out)
    }
}

/// Holder placements: (layers, ids) per holder.
type Placement = Vec<(Range<usize>, Vec<usize>)>;

fn split_model(dir: &Path, placement: &Placement) -> (Model, Arc<InProcess>) {
    let c = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let n = c.num_hidden_layers;
    let opts = LoadOptions {
        layers: 0..n,
        ends: true,
    };
    let p = placement.clone();
    let elsewhere =
        move |l: usize, e: usize| p.iter().any(|(r, ids)| r.contains(&l) && ids.contains(&e));
    let m = Model::from_checkpoint_without(c.clone(), &ck, &opts, &elsewhere, |_, _| {}).unwrap();
    let whole = backburner_model::load_bytes(&ck, &c, &opts).unwrap();
    let held = backburner_model::load_bytes_without(&ck, &c, &opts, &elsewhere).unwrap();
    assert_eq!(held, m.weight_bytes() as u64);
    let stores: Vec<ExpertStore> = placement
        .iter()
        .map(|(r, ids)| ExpertStore::load(&c, &ck, r.clone(), ids).unwrap())
        .collect();
    let away: u64 = stores.iter().map(|s| s.weight_bytes() as u64).sum();
    for ((r, ids), s) in placement.iter().zip(&stores) {
        assert_eq!(
            s.weight_bytes() as u64,
            backburner_model::experts_bytes(&ck, &c, r.clone(), ids).unwrap()
        );
    }
    assert_eq!(held + away, whole, "the experts are on exactly one side");
    let rx = Arc::new(InProcess {
        stores,
        fail: Mutex::new(false),
        calls: Mutex::new(0),
    });
    assert!(m.has_remote_experts());
    assert!(m.attach_remote_experts(rx.clone()));
    (m, rx)
}

/// Prefill of 37 tokens then 5 greedy decode steps: every logit's bits.
fn run_bits(m: &Model, prompt: &[u32]) -> Vec<u32> {
    let c = m.config();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let mut out = m.forward_tokens(prompt, &mut s, Some(0..prompt.len()));
    assert!(s.take_remote_error().is_none());
    let mut last = out[out.len() - c.vocab_size..].to_vec();
    for _ in 0..5 {
        let id = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap() as u32;
        last = m.forward_tokens(&[id], &mut s, Some(0..1));
        assert!(s.take_remote_error().is_none());
        out.extend(&last);
    }
    out.into_iter().map(f32::to_bits).collect()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 200).collect()
}

#[test]
fn experts_held_elsewhere_give_the_bits_of_the_whole_model() {
    for name in ["tiny-moe-f32", "tiny-next-f32"] {
        let dir = fixture(name);
        let whole = Model::load(&dir).unwrap();
        let p = prompt(37);
        let want = run_bits(&whole, &p);
        let all: Vec<usize> = (0..8).collect();
        let placements: Vec<Placement> = vec![
            vec![(2..4, all.clone())],
            vec![(0..4, vec![1, 2, 5])],
            vec![(0..2, vec![0, 3, 4, 6]), (1..4, vec![1, 7])],
            vec![(0..4, all.clone())],
        ];
        for pl in &placements {
            let (m, rx) = split_model(&dir, pl);
            assert_eq!(run_bits(&m, &p), want, "{name} {pl:?}");
            assert!(
                *rx.calls.lock().unwrap() > 0,
                "{name} {pl:?}: the holders were used"
            );
        }
    }
}

#[test]
fn runs_of_several_experts_on_one_holder_keep_the_bits() {
    // 5 of 8 experts per token: a token's first run on a holder is often several experts long (folded there), and
    // later runs of several experts come back one by one
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = backburner_model::synthetic::tiny_moe_config(4);
    cfg["num_experts_per_tok"] = 5.into();
    backburner_model::synthetic::write_random_checkpoint(tmp.path(), &cfg, 5).unwrap();
    let dir = tmp.path().to_path_buf();
    let whole = Model::load(&dir).unwrap();
    let p = prompt(41);
    let want = run_bits(&whole, &p);
    for pl in [
        vec![(0..4, vec![0, 1, 2, 3])],
        vec![(0..4, vec![4, 5, 6, 7])],
        vec![(0..4, vec![0, 1, 2, 6, 7]), (0..4, vec![3, 4])],
        vec![(0..4, vec![1, 3, 5, 7])],
    ] {
        let (m, _) = split_model(&dir, &pl);
        assert_eq!(run_bits(&m, &p), want, "{pl:?}");
    }
}

#[test]
fn a_batched_decode_with_experts_elsewhere_equals_each_sequence_alone() {
    let dir = fixture("tiny-moe-f32");
    let (m, _) = split_model(&dir, &vec![(1..4, vec![0, 2, 4, 6, 7])]);
    let whole = Model::load(&dir).unwrap();
    let c = m.config().clone();
    let prompts = [prompt(9), prompt(23), prompt(4)];
    let next = [5u32, 17, 99];
    let mut states: Vec<ModelState> = prompts
        .iter()
        .map(|p| {
            let mut s = ModelState::new(&c, 0..c.num_hidden_layers, KV);
            m.forward_tokens(p, &mut s, None);
            s
        })
        .collect();
    let mut refs: Vec<&mut ModelState> = states.iter_mut().collect();
    let got = m.forward_decode_batch(&next, &mut refs);
    for (i, p) in prompts.iter().enumerate() {
        assert!(states[i].take_remote_error().is_none());
        let mut s = ModelState::new(&c, 0..c.num_hidden_layers, KV);
        whole.forward_tokens(p, &mut s, None);
        let alone = whole.forward_tokens(&[next[i]], &mut s, Some(0..1));
        let row = &got[i * c.vocab_size..(i + 1) * c.vocab_size];
        assert_eq!(
            row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_failing_holder_is_latched_in_every_state_it_touched() {
    let dir = fixture("tiny-moe-f32");
    let (m, rx) = split_model(&dir, &vec![(3..4, (0..8).collect())]);
    let c = m.config().clone();
    *rx.fail.lock().unwrap() = true;
    let mut s = ModelState::new(&c, 0..c.num_hidden_layers, KV);
    m.forward_tokens(&prompt(8), &mut s, Some(0..1));
    let e = s.take_remote_error().expect("the failure is latched");
    assert!(e.to_string().contains("holder gone"), "{e}");
    let mut a = ModelState::new(&c, 0..c.num_hidden_layers, KV);
    let mut b = ModelState::new(&c, 0..c.num_hidden_layers, KV);
    m.forward_decode_batch(&[1, 2], &mut [&mut a, &mut b]);
    assert!(a.take_remote_error().is_some() && b.take_remote_error().is_some());
    // a model without holders attached latches instead of running without those experts
    let ck = Checkpoint::open(&dir).unwrap();
    let opts = LoadOptions {
        layers: 0..4,
        ends: true,
    };
    let bare =
        Model::from_checkpoint_without(c.clone(), &ck, &opts, &|l, _| l == 0, |_, _| {}).unwrap();
    let mut s = ModelState::new(&c, 0..4, KV);
    bare.forward_tokens(&prompt(3), &mut s, None);
    assert!(s
        .take_remote_error()
        .unwrap()
        .to_string()
        .contains("no holder"));
}

#[test]
fn a_store_refuses_segments_it_cannot_answer() {
    let dir = fixture("tiny-moe-f32");
    let c = ModelConfig::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let s = ExpertStore::load(&c, &ck, 2..4, &[1, 3]).unwrap();
    let h = c.hidden_size;
    let x = vec![0.5f32; 2 * h];
    let seg = |row, pairs: Vec<(u32, f32)>| Segment { row, pairs };
    assert_eq!(
        s.run(2, &x, 2, &[seg(1, vec![(1, 0.5), (3, 0.5)])])
            .unwrap()
            .len(),
        h
    );
    for (layer, segs, why) in [
        (1, vec![seg(0, vec![(1, 1.0)])], "no experts of layer 1"),
        (2, vec![seg(2, vec![(1, 1.0)])], "row is out of range"),
        (2, vec![seg(0, vec![])], "no pair"),
        (2, vec![seg(0, vec![(3, 0.5), (1, 0.5)])], "ascending"),
        (2, vec![seg(0, vec![(2, 1.0)])], "not held"),
        (2, vec![seg(0, vec![(1, f32::NAN)])], "not finite"),
        (
            2,
            vec![seg(0, vec![(1, 0.1), (3, 0.1), (3, 0.1)])],
            "more than",
        ),
    ] {
        let e = s.run(layer, &x, 2, &segs).unwrap_err();
        assert!(e.contains(why), "{e} / {why}");
    }
    assert!(s.run(2, &x[..h + 1], 2, &[]).is_err());
    assert!(ExpertStore::load(&c, &ck, 0..4, &[8]).is_err());
}
