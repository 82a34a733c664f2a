//! Speculation with the checkpoint's MTP block (`fixtures/tiny-mtp`: a random model with a full `mtp.*` block):
//! the session feeds the block every position it computes and drafts from the last one; output equal to plain
//! decoding, and the drafts those of the block run by hand on the same hidden rows.

use crate::common;

use std::sync::Arc;

use backburner_engine::spec::{SpecParams, SpecSource};
use backburner_engine::{
    generate, GenerateParams, Generation, Logits, SamplingParams, Session, SessionOptions,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model, MtpState};
use common::*;

fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: 8,
        kv: KvOptions {
            page_size: 4,
            dtype: KvDtype::F32,
        },
        ..SessionOptions::default()
    }
}

fn prompt(vocab: usize) -> Vec<u32> {
    (0..21u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
}

fn params(temperature: f32, spec: Option<SpecParams>) -> GenerateParams {
    GenerateParams {
        max_tokens: 30,
        keep_logits: true,
        sampling: SamplingParams {
            temperature,
            seed: 3,
            ..SamplingParams::default()
        },
        spec,
        ..GenerateParams::default()
    }
}

fn mtp(draft_max: usize, fixed: bool) -> SpecParams {
    SpecParams {
        source: SpecSource::Mtp,
        draft_max,
        fixed,
        cost: None,
    }
}

fn run(model: &Arc<Model>, p: &[u32], params: &GenerateParams, with_mtp: bool) -> Generation {
    let mut s = Session::new(model.clone(), opts()).unwrap();
    if with_mtp {
        s.enable_mtp().unwrap();
    }
    generate(&mut s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn mtp_speculation_equals_plain_decoding() {
    for file in ["tiny-mtp", "tiny-mtp/model.gguf"] {
        let model = load_model(file);
        assert!(model.mtp().is_some(), "{file}: the block loaded");
        let p = prompt(model.config().vocab_size);
        for temperature in [0.0, 0.9] {
            let want = run(&model, &p, &params(temperature, None), false);
            for spec in [mtp(3, true), mtp(6, false)] {
                let got = run(&model, &p, &params(temperature, Some(spec.clone())), true);
                assert_eq!(got.tokens, want.tokens, "{file} t={temperature} {spec:?}");
                assert_eq!(
                    bits(&got.step_logits),
                    bits(&want.step_logits),
                    "{file}: logits"
                );
                let c = got.speculative.unwrap();
                assert!(c.drafted > 0 && c.accepted <= c.drafted, "{file}: {c:?}");
            }
            // speculating without the block on: nothing drafted, same output
            let off = run(&model, &p, &params(temperature, Some(mtp(3, true))), false);
            assert_eq!(off.tokens, want.tokens);
            assert_eq!(off.speculative.unwrap().drafted, 0);
        }
    }
}

#[test]
fn the_session_drafts_what_the_block_drafts_on_the_same_hidden_rows() {
    let model = load_model("tiny-mtp");
    let p = prompt(model.config().vocab_size);
    // by hand: the prompt's hidden rows, the greedy next token, the pairs, 4 drafts
    let mut state = backburner_model::ModelState::new(
        model.config(),
        0..model.config().num_hidden_layers,
        opts().kv,
    );
    let (logits, hidden) = model.forward_tokens_hidden(&p, &mut state, Some(p.len() - 1..p.len()));
    let x = backburner_engine::argmax(&logits);
    let mut st = MtpState::new(model.config(), opts().kv);
    let next: Vec<u32> = p[1..].iter().copied().chain([x]).collect();
    model.mtp_ingest(&mut st, &hidden, &next).unwrap();
    let want = model.mtp_draft(&mut st, 4).unwrap();
    // the session, prefilling in ubatches of 8 (three calls)
    let mut s = Session::new(model.clone(), opts()).unwrap();
    s.enable_mtp().unwrap();
    let l = s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    assert_eq!(backburner_engine::argmax(&l), x);
    assert_eq!(s.mtp_draft(x, 4), want);
    // drafting again gives the same tokens
    assert_eq!(s.mtp_draft(x, 4), want);
    // after a verify of [x, d1, d2] keeping 2 positions, the block drafts from the pair (h of d1, the next token)
    let ids = [x, want[0], want[1]];
    let rows = s.verify(&ids).unwrap();
    s.keep_verified(2);
    let vocab = model.config().vocab_size;
    let b = backburner_engine::argmax(&rows[vocab..2 * vocab]);
    let mut hand = backburner_model::ModelState::new(
        model.config(),
        0..model.config().num_hidden_layers,
        opts().kv,
    );
    let (_, h_all) = model.forward_tokens_hidden(&[&p[..], &ids[..2]].concat(), &mut hand, None);
    let mut st2 = MtpState::new(model.config(), opts().kv);
    let next2: Vec<u32> = p[1..].iter().copied().chain([x, want[0], b]).collect();
    model.mtp_ingest(&mut st2, &h_all, &next2).unwrap();
    assert_eq!(s.mtp_draft(b, 3), model.mtp_draft(&mut st2, 3).unwrap());
}

#[test]
fn a_rewind_keeps_the_block_drafting_and_the_output_exact() {
    let model = load_model("tiny-mtp");
    let p = prompt(model.config().vocab_size);
    let want = run(&model, &p, &params(0.0, None), false);
    let mut s = Session::new(model.clone(), opts()).unwrap();
    s.enable_mtp().unwrap();
    let snap_at = 13;
    s.prefill(&p[..snap_at], Logits::Last, |_, _| {}).unwrap();
    let snap = s.snapshot();
    s.prefill(&p[snap_at..], Logits::Last, |_, _| {}).unwrap();
    assert!(s.rewind(&snap));
    // the rest of the prompt again, then generate with MTP drafts
    let seq_params = params(0.0, Some(mtp(3, true)));
    let got = generate(
        &mut s,
        &p[snap_at..],
        &seq_params,
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert!(got.speculative.unwrap().drafted > 0);
}
