//! The activation quantization ([`QuantizedActs`](super::QuantizedActs)) with AVX2: the same bits as
//! [`quantize_block`] (every step is an exact or correctly rounded IEEE 754 operation, a maximum, or integer
//! arithmetic), about 10× faster than the plain loop, whose rounding is a libm call per element on baseline x86-64.

use std::arch::x86_64::*;

use super::acts::{quantize_block, ActBlock, ACT_BLOCK};

/// [`quantize_block`] over a row's blocks.
///
/// # Safety
/// The CPU must support AVX2; `x.len() == q.len() == 32 · blocks.len()`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], blocks: &mut [ActBlock]) {
    assert!(x.len() == q.len() && x.len() == ACT_BLOCK * blocks.len());
    for ((x, q), blk) in x
        .chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .zip(blocks.iter_mut())
    {
        // SAFETY: AVX2 (this function's contract); 32 elements each.
        *blk = unsafe { block(x, q) }.unwrap_or_else(|| quantize_block(x, q));
    }
}

/// One block, or `None` where the plain loop must decide (a NaN or infinity in the block, or a scale whose
/// reciprocal overflows): those take [`quantize_block`].
///
/// # Safety
/// The CPU must support AVX2; `x` and `q` have 32 elements.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block(x: &[f32], q: &mut [i8]) -> Option<ActBlock> {
    let v: [__m256; 4] = std::array::from_fn(|i| {
        // SAFETY: 8 of the 32 elements.
        unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) }
    });
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let inf = _mm256_set1_ps(f32::INFINITY);
    let mut amax = _mm256_setzero_ps();
    let mut finite = 0xFF;
    for vi in v {
        let a = _mm256_and_ps(vi, abs);
        // A NaN compares false, an infinity is not below infinity.
        finite &= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, inf));
        amax = _mm256_max_ps(amax, a);
    }
    if finite != 0xFF {
        return None;
    }
    // Finite magnitudes: their maximum does not depend on the order.
    let m4 = _mm_max_ps(
        _mm256_castps256_ps128(amax),
        _mm256_extractf128_ps::<1>(amax),
    );
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
    let d = _mm_cvtss_f32(m1) / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    if !id.is_finite() {
        return None;
    }
    let (idv, lo, hi) = (
        _mm256_set1_ps(id),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    // |x·id| ≤ 127 (up to rounding) and finite: round to nearest even, clamp, convert exactly.
    let iv: [__m256i; 4] = std::array::from_fn(|i| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v[i], idv),
        );
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    });
    let first = _mm256_add_epi32(iv[0], iv[1]);
    let half = hsum(first);
    let sum = hsum(_mm256_add_epi32(first, _mm256_add_epi32(iv[2], iv[3])));
    // Saturating packs (values are within i8) interleave the 128-bit lanes; the permutation restores the order.
    let p16a = _mm256_packs_epi32(iv[0], iv[1]);
    let p16b = _mm256_packs_epi32(iv[2], iv[3]);
    let p8 = _mm256_packs_epi16(p16a, p16b);
    let ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: q has 32 elements.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered) };
    Some(ActBlock {
        d,
        sumf: sum as f32,
        sum,
        half,
    })
}

/// The sum of 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256i) -> i32 {
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2));
    _mm_cvtsi128_si32(s1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Blocks of every kind the vector path and its fallbacks meet.
    fn cases() -> Vec<[f32; 32]> {
        let mut r = StdRng::seed_from_u64(11);
        let mut out = Vec::new();
        for scale in [1e-38f32, 1e-30, 1e-3, 1.0, 3.7, 1e4, 3e38] {
            for _ in 0..50 {
                out.push(std::array::from_fn(|_| {
                    r.random_range(-1.0f32..1.0) * scale
                }));
            }
        }
        // Exact ties after scaling (amax 127: x·id is x itself), zeros, signed zeros, subnormals.
        out.push(std::array::from_fn(|i| {
            if i == 0 {
                127.0
            } else {
                i as f32 - 16.5
            }
        }));
        out.push([0.0; 32]);
        out.push(std::array::from_fn(|i| if i % 2 == 0 { -0.0 } else { 0.0 }));
        out.push(std::array::from_fn(|i| f32::from_bits(i as u32 + 1)));
        out.push(std::array::from_fn(|i| {
            if i == 31 {
                f32::from_bits(1)
            } else {
                0.0
            }
        }));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut b: [f32; 32] = std::array::from_fn(|i| i as f32);
            b[7] = bad;
            out.push(b);
        }
        out
    }

    #[test]
    fn avx2_quantization_is_the_plain_loop_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        let cases = cases();
        let x: Vec<f32> = cases.iter().flatten().copied().collect();
        let nb = cases.len();
        let (mut q, mut b) = (vec![0i8; x.len()], vec![ActBlock::default(); nb]);
        // SAFETY: AVX2 checked; the lengths match.
        unsafe { quantize_row_avx2(&x, &mut q, &mut b) };
        for (i, c) in cases.iter().enumerate() {
            let mut want_q = [0i8; 32];
            let want = quantize_block(c, &mut want_q);
            assert_eq!(&q[32 * i..32 * i + 32], &want_q, "block {i}: values");
            assert_eq!(b[i].d.to_bits(), want.d.to_bits(), "block {i}: scale");
            assert_eq!(
                (b[i].sum, b[i].half, b[i].sumf.to_bits()),
                (want.sum, want.half, want.sumf.to_bits()),
                "block {i}: sums"
            );
        }
        // The fallbacks were taken where they must be: NaN scales and zero values for the non-finite blocks.
        assert!(b[nb - 3..].iter().all(|b| b.d.is_nan() && b.sum == 0));
    }
}
