//! The state manager's one way back ([`ModelState::go_back`]): inside an open verify step it rolls back with the
//! bits of the kept decode steps; to a checkpoint it restores it (preferred when both cover the position); at the
//! state's own position it does nothing; elsewhere, or ahead, it refuses with the state unchanged.

use backburner_kernels::kv::KvDtype;
use backburner_model::state::{Back, BackError};
use backburner_model::{Model, ModelState};

use crate::verify::{assert_same_state, decode_steps, fixture, fork, ids, kv};

#[test]
fn going_back_uses_the_open_verify_a_checkpoint_or_refuses() {
    let m = Model::load(&fixture("tiny-f32")).unwrap();
    let vocab = m.config().vocab_size;
    let (prompt, drafts) = (ids(13, 1, vocab), ids(6, 2, vocab));
    let mut base = ModelState::new(
        m.config(),
        0..m.config().num_hidden_layers,
        kv(KvDtype::F16),
    );
    m.forward_tokens(&prompt, &mut base, None);
    let (_, after) = decode_steps(&m, &base, &drafts);
    let checkpoint = base.snapshot();

    // inside an open verify step of 6: its rollback, the bits of the kept decode steps
    for to in 14..19 {
        let mut s = fork(&m, &base);
        m.forward_verify(&drafts, &mut s).unwrap();
        assert_eq!(s.go_back(to, &[]).unwrap(), Back::Verify);
        assert_same_state(&m, &s, &after[to - 14], &format!("verify rollback to {to}"));
    }
    // to the verify's start: not inside it, so the checkpoint there
    let mut s = fork(&m, &base);
    m.forward_verify(&drafts, &mut s).unwrap();
    assert!(matches!(
        s.go_back(13, &[]),
        Err(BackError::NotKept { to: 13 })
    ));
    assert_same_state(&m, &s, &after[5], "unchanged after a refusal");
    assert_eq!(s.go_back(13, &[&checkpoint]).unwrap(), Back::Checkpoint);
    assert_same_state(&m, &s, &base, "the checkpoint");
    // a checkpoint inside an open verify step is preferred (both are exact)
    let mut s = fork(&m, &base);
    m.forward_verify(&drafts[..2], &mut s).unwrap();
    let mid = s.snapshot();
    let mut s2 = fork(&m, &s);
    m.forward_verify(&drafts[2..], &mut s2).unwrap();
    assert_eq!(
        s2.go_back(15, &[&checkpoint, &mid]).unwrap(),
        Back::Checkpoint
    );
    assert_same_state(&m, &s2, &after[1], "checkpoint at 15");
    // here, ahead, nothing kept
    let mut s = fork(&m, &after[2]);
    assert_eq!(s.go_back(16, &[]).unwrap(), Back::Here);
    assert!(matches!(
        s.go_back(17, &[]),
        Err(BackError::Ahead { to: 17, at: 16 })
    ));
    assert!(matches!(
        s.go_back(14, &[&checkpoint]),
        Err(BackError::NotKept { to: 14 })
    ));
    assert_same_state(&m, &s, &after[2], "unchanged after the refusals");
}
