//! `bench spec`'s part 1: verify steps of `T = 1..=K + 1` positions against `T` decode steps from one snapshot, in
//! alternating order, with the verify rows checked bit for bit against the decode steps' logits first.

use std::time::Instant;

use anyhow::{bail, Result};
use backburner_engine::{argmax, Session};
use backburner_model::StateSnapshot;

use super::{median, VerifyRow};

/// The greedy ids of `t` decode steps from `snap` starting with `first`, and their logits `[t, vocab]`; the
/// session is then rewound to `snap`.
fn greedy_steps(
    s: &mut Session,
    snap: &StateSnapshot,
    first: u32,
    t: usize,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (mut ids, mut rows) = (vec![first], Vec::new());
    for i in 0..t {
        let l = s.decode(ids[i])?;
        if i + 1 < t {
            ids.push(argmax(&l));
        }
        rows.extend_from_slice(&l);
    }
    s.rewind(snap);
    Ok((ids, rows))
}

/// Seconds of one timed closure on `s`, which is then rewound to `snap`.
fn timed(
    s: &mut Session,
    snap: &StateSnapshot,
    f: impl FnOnce(&mut Session) -> Result<()>,
) -> Result<f64> {
    let t = Instant::now();
    f(s)?;
    let el = t.elapsed().as_secs_f64();
    s.rewind(snap);
    Ok(el)
}

/// Seconds of `keep_verified(m)` after an untimed verify step of `ids`; the session is then rewound to `snap`.
fn rollback(s: &mut Session, snap: &StateSnapshot, ids: &[u32], m: usize) -> Result<f64> {
    s.verify(ids)?;
    timed(s, snap, |s| {
        s.keep_verified(m);
        Ok(())
    })
}

/// Part 1: verify steps of `1..=max_t` positions against as many decode steps, from `snap` (see the module
/// documentation). `first` is the pending token at `snap`.
pub(super) fn verify_cost(
    s: &mut Session,
    snap: &StateSnapshot,
    first: u32,
    max_t: usize,
    rounds: usize,
) -> Result<Vec<VerifyRow>> {
    s.in_pool(|s| {
        let (ids, dec_rows) = greedy_steps(s, snap, first, max_t)?;
        let ver_rows = s.verify(&ids)?;
        s.keep_verified(max_t);
        s.rewind(snap);
        if let Some(i) = ver_rows.iter().zip(&dec_rows).position(|(a, b)| a.to_bits() != b.to_bits()) {
            let vocab = ver_rows.len() / max_t;
            bail!(
                "verify step of {max_t} positions: row {} differs from the decode step's logits at id {} ({} vs {}): \
                 a verify step must equal decoding the tokens one by one bit for bit",
                i / vocab,
                i % vocab,
                ver_rows[i],
                dec_rows[i]
            );
        }
        let (mut ver, mut dec, mut back1, mut back_last) =
            (vec![vec![]; max_t], vec![vec![]; max_t], vec![vec![]; max_t], vec![vec![]; max_t]);
        for r in 0..rounds {
            for t in 1..=max_t {
                let ids = &ids[..t];
                let verify = |s: &mut Session| -> Result<()> {
                    s.verify(ids)?;
                    s.keep_verified(t);
                    Ok(())
                };
                let decodes = |s: &mut Session| -> Result<()> {
                    for &id in ids {
                        s.decode(id)?;
                    }
                    Ok(())
                };
                if (r + t) % 2 == 0 {
                    ver[t - 1].push(timed(s, snap, verify)?);
                    dec[t - 1].push(timed(s, snap, decodes)?);
                } else {
                    dec[t - 1].push(timed(s, snap, decodes)?);
                    ver[t - 1].push(timed(s, snap, verify)?);
                }
                if t >= 2 {
                    back1[t - 1].push(rollback(s, snap, ids, 1)?);
                }
                if t >= 3 {
                    back_last[t - 1].push(rollback(s, snap, ids, t - 1)?);
                }
            }
        }
        Ok((0..max_t)
            .map(|i| {
                let t = i + 1;
                let pairs = ver[i].iter().zip(&dec[i]);
                let ms = |v: &Vec<f64>| (!v.is_empty()).then(|| 1e3 * median(v.clone()));
                VerifyRow {
                    t,
                    verify_ms: 1e3 * median(ver[i].clone()),
                    decodes_ms: 1e3 * median(dec[i].clone()),
                    v: median(pairs.clone().map(|(v, d)| v * t as f64 / d).collect()),
                    verify_over_decodes: median(pairs.map(|(v, d)| v / d).collect()),
                    rollback_to_1_ms: ms(&back1[i]),
                    rollback_to_t_minus_1_ms: ms(&back_last[i]),
                }
            })
            .collect())
    })
}
