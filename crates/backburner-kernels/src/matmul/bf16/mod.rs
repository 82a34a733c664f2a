//! The "bf16 activations" arithmetic of products against bf16 weights ([`Precision::Bf16`](super::Precision)): the
//! activations are rounded to bf16 and every output is a chain of AVX-512 BF16 `vdpbf16ps` steps.
//!
//! # Layout
//! A matrix in this arithmetic keeps its bf16 weights in panels of 16 outputs holding *k-pairs*: with
//! `kp = ⌈k / 2⌉` pairs (an odd `k` padded with one zero input), panel `p`'s 32-bit word `q·16 + l` holds output
//! `16p + l`'s inputs `2q` (bits 0..16) and `2q + 1` (bits 16..32). One 64-byte load is 16 outputs × 2 inputs: the
//! operand of one `vdpbf16ps` against a broadcast activation pair. Panels are padded to a multiple of 4 with zeros.
//!
//! # Arithmetic
//! `x` is rounded to bf16 per element by [`round_act`] (round to nearest even as llama.cpp's `GGML_FP32_TO_BF16`;
//! NaN stays a quiet NaN; a result that is a bf16 denormal becomes a zero of its sign, as the instruction would read
//! it anyway). Then, for output `(i, j)`, from `acc = +0.0`, for `q = 0..kp` in order:
//!
//! ```text
//! acc = step(acc, x[i][2q+1], W[j][2q+1]);  acc = step(acc, x[i][2q], W[j][2q])
//! ```
//!
//! with `step` the exact `vdpbf16ps` step of `crate::simd::dp` (fused multiply-add rounding, bf16 and accumulator
//! denormals read as zero, tiny results flushed to a signed zero). On a CPU with AVX-512 BF16 this is the
//! instruction; elsewhere (AVX-512F, AVX2, plain Rust) it is emulated bit for bit. So, as for the f32 arithmetic,
//! the result is the same bits on every instruction set, thread count, blocking of `k`, batch size and row position,
//! and [`matmul_reference`](super::matmul_reference) is the plain loop.

mod kernel;

pub(super) use kernel::matmul_pairs;

use crate::simd::dp::dp_lane;

/// `x` rounded to bf16 as the bf16-activation products read it: round to nearest even (llama.cpp's
/// `GGML_FP32_TO_BF16`: add `0x7fff` plus the kept lowest bit, keep the top 16 bits; overflow gives ±inf); a NaN
/// keeps its sign and top payload bits and is made quiet (bit 6 set), as there; a result whose exponent field is 0 (a
/// bf16 denormal) becomes the zero of its sign, which is how `vdpbf16ps` reads it.
#[inline(always)]
pub fn round_act(x: f32) -> u16 {
    let u = x.to_bits();
    let h = if u & 0x7fff_ffff > 0x7f80_0000 {
        (u >> 16) as u16 | 0x40
    } else {
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    };
    if h & 0x7f80 == 0 {
        h & 0x8000
    } else {
        h
    }
}

/// The pair of inputs `2q`, `2q + 1` of one row (`2q + 1 = row.len()` reads as 0) rounded by [`round_act`].
#[inline(always)]
fn act_pair(row: &[f32], q: usize) -> u32 {
    let lo = u32::from(round_act(row[2 * q]));
    let hi = row.get(2 * q + 1).map_or(0, |&v| u32::from(round_act(v)));
    lo | hi << 16
}

/// `x [m, k]` as blocks of `mr` rows of bf16 pairs, each `[⌈k/2⌉][mr]` u32 (zero rows past `m`).
pub(super) fn pack_act_pairs(x: &[f32], m: usize, k: usize, mr: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let blocks = m.div_ceil(mr);
    let mut a = vec![0u32; blocks * kp * mr];
    for (b, blk) in a.chunks_mut(kp * mr).enumerate() {
        for r in 0..mr.min(m - b * mr) {
            let row = &x[(b * mr + r) * k..(b * mr + r + 1) * k];
            for q in 0..kp {
                blk[q * mr + r] = act_pair(row, q);
            }
        }
    }
    a
}

/// The plain loop of the arithmetic: `y [m, n] = x [m, k] · Wᵀ` with `w_pairs` the weights as `[n][⌈k/2⌉]` bf16
/// pairs (row-major, the layout's words in row order).
pub(super) fn matmul_pairs_reference(
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    w_pairs: &[u32],
    y: &mut [f32],
) {
    let kp = k.div_ceil(2);
    for i in 0..m {
        let row = &x[i * k..(i + 1) * k];
        let xa: Vec<u32> = (0..kp).map(|q| act_pair(row, q)).collect();
        for j in 0..n {
            let wr = &w_pairs[j * kp..(j + 1) * kp];
            y[i * n + j] = xa
                .iter()
                .zip(wr)
                .fold(0.0f32, |acc, (&xq, &wq)| dp_lane(acc, wq, xq));
        }
    }
}

#[cfg(test)]
mod kernel_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_act_rounds_to_nearest_even_and_keeps_nans_quiet() {
        let b = |x: f32| round_act(x);
        assert_eq!(b(1.0), 0x3f80);
        // 1 + 2^-8 is the midpoint of 1 and 1 + 2^-7: ties to even (1.0); just above rounds up
        assert_eq!(b(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(b(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(b(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(b(-2.5), 0xc020);
        assert_eq!(b(f32::MAX), 0x7f80); // overflows to inf
        assert_eq!(b(f32::INFINITY), 0x7f80);
        assert_eq!(b(f32::from_bits(0x7f80_0001)), 0x7fc0); // signalling NaN → quiet
        assert_eq!(b(f32::from_bits(0xffa1_2345)), 0xffe1);
        // f32 denormals and bf16 denormals → signed zero; the largest f32 denormal rounds up to 2^-126
        assert_eq!(b(1e-40), 0);
        assert_eq!(b(-1e-39), 0x8000);
        assert_eq!(b(f32::from_bits(0x007f_ffff)), 0x0080);
        assert_eq!(b(f32::from_bits(0x0080_0000)), 0x0080);
        // exhaustive against half's bf16 rounding (RNE) for finite non-tiny values
        for bits in (0..=u32::MAX).step_by(9973) {
            let x = f32::from_bits(bits);
            let want = half::bf16::from_f32(x).to_bits();
            if x.is_nan() || want & 0x7f80 == 0 {
                continue;
            }
            assert_eq!(b(x), want, "{x:e}");
        }
    }
}
