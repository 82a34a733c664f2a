//! [`qmatmul_reference`]: the canonical arithmetic as plain loops, one output at a time.

use half::f16;

use super::acts::{QuantizedActs, ACT_BLOCK};
use super::format::{QuantFormat, IQ4_VALUES};
use super::kernel::check_shapes;
use super::pack::QuantMatrix;
use super::spec::{spec, Codes, Mins, Scales, Spec};
use super::unit::{Lay, Unit};
use crate::matmul::PANEL;

/// How a 32-block's integer sums become its float term (weights' scales already in f32, as the kernels form them).
#[derive(Clone, Copy, Debug)]
enum Scale {
    /// `ds·float(S)`.
    Plain(f32),
    /// `fma(ds, float(S), −(dm·float(Σxq)))`.
    Min(f32, f32),
    /// `fma(ds_a, float(S_a), ds_b·float(S_b))` over the two halves of 16.
    Halves(f32, f32),
    /// [`Scale::Halves`] `− fma(dm_a, float(Σxq_a), dm_b·float(Σxq_b))` (Q2_K).
    HalvesMin(f32, f32, f32, f32),
}

/// One 32-block of a weight row: its true integer values and scales.
struct Term {
    q: [i32; ACT_BLOCK],
    scale: Scale,
}

/// The same arithmetic as [`qmatmul`](super::qmatmul) as plain scalar Rust: for each output, over the 32-blocks in
/// `k` order, the exact `S = Σ q·xq` (true weight values `q`, per half for Q6_K), the block term of the [module
/// docs](super) and `acc = fma(term, dx, acc)` from `+0.0`. Bit-identical to `qmatmul`; the slow, obvious twin for
/// tests.
///
/// Panics as [`qmatmul`](super::qmatmul).
pub fn qmatmul_reference(x: &QuantizedActs, w: &QuantMatrix, y: &mut [f32], ldy: usize) {
    if !check_shapes("qmatmul_reference", x, w, y, ldy) {
        return;
    }
    let (m, n) = (x.rows(), w.n());
    for j in 0..n {
        let terms = row_terms(w, j);
        for i in 0..m {
            let (q, xb) = (x.row_q(i), x.row_blocks(i));
            let mut acc = 0.0f32;
            for (bi, t) in terms.iter().enumerate() {
                let xs = &q[ACT_BLOCK * bi..ACT_BLOCK * (bi + 1)];
                let dot = |r: std::ops::Range<usize>| -> i32 {
                    r.map(|e| t.q[e] * i32::from(xs[e])).sum()
                };
                let (lo, hi) = (dot(0..16), dot(16..32));
                let f = match t.scale {
                    Scale::Plain(ds) => ds * (lo + hi) as f32,
                    Scale::Min(ds, dm) => ds.mul_add((lo + hi) as f32, -(dm * xb[bi].sumf)),
                    Scale::Halves(dsa, dsb) => dsa.mul_add(lo as f32, dsb * hi as f32),
                    Scale::HalvesMin(dsa, dsb, dma, dmb) => {
                        let (ha, hb) = (xb[bi].half, xb[bi].sum - xb[bi].half);
                        let t = dma.mul_add(ha as f32, dmb * hb as f32);
                        dsa.mul_add(lo as f32, dsb * hi as f32) - t
                    }
                };
                acc = f.mul_add(xb[bi].d, acc);
            }
            y[i * ldy + j] = acc;
        }
    }
}

/// Row `j`'s 32-blocks, read back from the panels.
fn row_terms(w: &QuantMatrix, j: usize) -> Vec<Term> {
    let fmt = w.format();
    let lay = Lay::of(fmt);
    let panel = &w.as_bytes()[(j / PANEL) * w.panel_bytes()..][..w.panel_bytes()];
    let mut terms = Vec::with_capacity(w.k() / ACT_BLOCK);
    for unit in panel.chunks_exact(lay.bytes.max(1)).take(w.k() / lay.unit) {
        let u = Unit::load(fmt, unit, j % PANEL);
        if let Some(s) = spec(fmt) {
            generic_terms(s, &u, &mut terms);
            continue;
        }
        let d = f16::from_bits(u.d).to_f32();
        let dmin = f16::from_bits(u.dmin).to_f32();
        for b in 0..lay.unit / ACT_BLOCK {
            let code = |e: usize| i32::from(u.code[ACT_BLOCK * b + e]);
            let (q, scale): ([i32; ACT_BLOCK], Scale) = match fmt {
                QuantFormat::Q8_0 => (std::array::from_fn(|e| code(e) - 128), Scale::Plain(d)),
                QuantFormat::Q4_0 => (std::array::from_fn(|e| code(e) - 8), Scale::Plain(d)),
                QuantFormat::Q4K | QuantFormat::Q5K => (
                    std::array::from_fn(code),
                    Scale::Min(d * f32::from(u.sc[b]), dmin * f32::from(u.m[b])),
                ),
                QuantFormat::Q6K => (
                    std::array::from_fn(|e| code(e) - 32),
                    Scale::Halves(
                        d * f32::from(u.sc[2 * b] as i8),
                        d * f32::from(u.sc[2 * b + 1] as i8),
                    ),
                ),
                QuantFormat::Iq4Xs => (
                    std::array::from_fn(|e| {
                        i32::from(IQ4_VALUES[u.code[ACT_BLOCK * b + e] as usize])
                    }),
                    Scale::Plain(d * f32::from(u.sc[b] as i8)),
                ),
                _ => unreachable!("generic formats are handled above"),
            };
            terms.push(Term { q, scale });
        }
    }
    terms
}

/// The 32-blocks of a generic format's unit ([`super::spec`]): true values and the scales as the kernel forms them.
fn generic_terms(s: Spec, u: &Unit, terms: &mut Vec<Term>) {
    for b in 0..s.unit / ACT_BLOCK {
        let q = std::array::from_fn(|e| {
            let c = u.code[ACT_BLOCK * b + e];
            match s.codes {
                Codes::Lut | Codes::Lut3 => i32::from(s.lut[usize::from(c)]),
                Codes::Nib | Codes::Five | Codes::Two => i32::from(c) - s.offset,
            }
        });
        let sc = |i: usize| u.df * f32::from(u.sc[i] as i8);
        let dm = |i: usize| u.dmf * f32::from(u.m[i]);
        let scale = match (s.scales, s.mins) {
            (Scales::Per16, Mins::Per16) => {
                Scale::HalvesMin(sc(2 * b), sc(2 * b + 1), dm(2 * b), dm(2 * b + 1))
            }
            (Scales::Per16, _) => Scale::Halves(sc(2 * b), sc(2 * b + 1)),
            (Scales::Per32, Mins::Unit) => Scale::Min(sc(b), u.dmf),
            (Scales::Per32, _) => Scale::Plain(sc(b)),
            (Scales::None, Mins::Unit) => Scale::Min(u.df, u.dmf),
            (Scales::None, _) => Scale::Plain(u.df),
        };
        terms.push(Term { q, scale });
    }
}
