//! Vector helpers of the kernels.
//!
//! * [`isa`]: the explicit 16-lane vectors (plain Rust; AVX-512F, AVX2 and NEON in `arch`), the
//!   register-blocked [`dots`], and the [`Kernel`]/[`dispatch`] pair that compiles a
//!   kernel body for the best instruction set the CPU has.
//! * Here: element-wise loops written so that LLVM's loop vectorizer handles them (inside a dispatched
//!   kernel they use the wide registers), and short reductions with a fixed lane structure.
//!
//! Determinism: float addition is not associative, so the compiler never reorders a sum; every reduction
//! here and in [`isa`] has one fixed order. Products that accumulate in the vector kernels use the fused
//! multiply-add ([`Isa::fma`], IEEE 754 `fusedMultiplyAdd`, one rounding) and element-wise loops use separate
//! multiply and add, never a mix that depends on the instruction set: both are exactly specified, so all vector
//! widths and the plain-Rust path give bit-identical results. (The fused form replaced separate multiply and add
//! in the dense products, attention and the chunked delta rule: one instruction instead of two — the chunked delta
//! rule ran 10 % faster with it, and the dense and attention kernels reach the FMA peak only with it.)

mod arch;
pub(crate) mod dp;
#[cfg(target_arch = "x86_64")]
mod dp_x86;
mod isa;

pub(crate) use isa::{allowed, dispatch, dot, dots, Isa, Kernel};
#[cfg(test)]
pub(crate) use isa::{ISA_CAP, ISA_MAX};

/// Number of interleaved partial sums of every reduction (one AVX-512 register of f32).
pub(crate) const LANES: usize = 16;

/// Pairwise tree sum of the lanes: `l += l + 8` for `l < 8`, then `+4`, `+2`, `+1`; a fixed order.
#[inline(always)]
pub(crate) fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `Σ x[i]` with `LANES` interleaved partial sums, tree-reduced like [`dot`].
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut c = x.chunks_exact(LANES);
    for v in &mut c {
        for l in 0..LANES {
            acc[l] += v[l];
        }
    }
    for (l, v) in c.remainder().iter().enumerate() {
        acc[l] += v;
    }
    reduce_lanes(acc)
}

/// `max x[i]` (`-inf` for an empty slice), with `LANES` interleaved partial maxima. Exact whatever the
/// order (max is associative); the lanes only break the dependency chain.
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut c = x.chunks_exact(LANES);
    for v in &mut c {
        for l in 0..LANES {
            acc[l] = acc[l].max(v[l]);
        }
    }
    for (l, v) in c.remainder().iter().enumerate() {
        acc[l] = acc[l].max(*v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b))
}

/// `y[i] += a·x[i]`.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `y[i] = s·y[i] + a·x[i]`.
#[inline(always)]
pub(crate) fn scale_axpy(y: &mut [f32], s: f32, a: f32, x: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = s * *yi + a * xi;
    }
}

/// A hint that the cache line holding `p` will be read soon, into L2 (`prefetcht1` on x86-64; nothing elsewhere):
/// for the streams decode reads from memory (quantized weight panels, KV blocks), where a request per line into L1
/// would hold one of L1's few miss buffers for the whole trip to memory (on an AMD EPYC with AVX-512: the quantized
/// decode stream read 11–14 GiB/s with `prefetcht0` against 16–22 GiB/s with `prefetcht1`; decode attention over
/// 8,192 cold f16 positions took 1.0–1.1 ms against 0.6–0.7). Never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const u8) {
    prefetch_hint::<HINT_T1>(p);
}

/// A hint to bring the cache line at `p` close to the core for one use (`prefetchnta`): any address (never
/// dereferenced, never faults); nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch_once(p: *const u8) {
    prefetch_hint::<HINT_NTA>(p);
}

/// `_MM_HINT_T1` and `_MM_HINT_NTA` (checked against `std::arch` below), spelled out so that the callers compile
/// on every target.
const HINT_T1: i32 = 2;
const HINT_NTA: i32 = 0;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(
    HINT_T1 == std::arch::x86_64::_MM_HINT_T1 && HINT_NTA == std::arch::x86_64::_MM_HINT_NTA
);

/// `prefetch` with hint `H` at `p` on x86-64, nothing elsewhere.
#[inline(always)]
fn prefetch_hint<const H: i32>(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it reads nothing architecturally and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<H>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `y[i] *= s`.
#[inline(always)]
pub(crate) fn scale(y: &mut [f32], s: f32) {
    for yi in y.iter_mut() {
        *yi *= s;
    }
}

/// `e^x` rounded to f32 from a double-precision evaluation, from plain IEEE operations only (no libm call, no
/// fused multiply-add), so that loops over it vectorize and give the same bits at every vector width. Within
/// 0.5 ulp plus ~1e-15 relative (libm's `expf` bits except near rounding midpoints, where it is the nearer one;
/// see the test), where [`exp_fast`] is ~2 ulp.
///
/// `x = k·ln2 + r` with `k` an integer and `|r| <= ln2/2` (reduction in f64 with a two-part ln2), `e^r` by its
/// Taylor series to degree 12 (truncation below 1e-15 relative), scaled by `2^k` through the exponent bits and
/// rounded once to f32 (overflow to inf and subnormal results included). Inputs are clamped to ±150 (beyond
/// which the f32 result is inf or 0 anyway); NaN gives NaN.
#[inline(always)]
pub(crate) fn exp_rounded(x: f32) -> f32 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    // ln2 in two parts (fdlibm's): the high one has 32 significant bits, so k·LN2_HI is exact for |k| < 2^21.
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5·2^52: adding it rounds to an integer (ties to even).
    let y = f64::from(x).clamp(-150.0, 150.0);
    let t = y * LOG2E + MAGIC;
    let k = t - MAGIC;
    let r = (y - k * LN2_HI) - k * LN2_LO;
    let mut p = 1.0 / 479_001_600.0; // 1/12!
    for c in [
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    // t's low mantissa bits hold k (|k| <= 217): 2^k as exponent bits.
    let ki = (t.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    let scale = f64::from_bits((ki.wrapping_add(1023) as u64) << 52);
    (p * scale) as f32
}

/// `e^x` in f32 from plain IEEE operations only (no libm call, no fused multiply-add), so that loops over
/// it vectorize and give the same bits at every vector width.
///
/// Cody–Waite reduction `x = n·ln2 + r`, `|r| <= ln2/2`, with the degree-6 minimax polynomial of Cephes
/// `expf` for `e^r` (relative error about 1e-7, i.e. within ~2 ulp of the correctly rounded value), then
/// scaling by `2^n` through the exponent bits. Accurate on `[-87.3, 88]`; returns exactly 0 for
/// `x < -87.3` (below the smallest normal result) and clamps `x > 88` to 88. The kernels only call it with
/// `x <= 0`. Not for NaN inputs (the result is unspecified).
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer (ties to even).
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
    let y = p * (r * r) + r + 1.0;
    // n is in [-126, 127] and t's low mantissa bits hold it (t's ulp is 1): 2^n from the exponent field.
    let ni = t.to_bits().wrapping_sub(MAGIC.to_bits());
    let e = f32::from_bits(ni.wrapping_add(127) << 23);
    let out = y * e;
    if x < LO {
        0.0
    } else {
        out
    }
}

/// Converts IEEE binary16 values to f32 exactly (normals, subnormals, ±0, ±inf and NaN payloads), from
/// plain integer and float operations so that it vectorizes inside [`dispatch`]ed kernels.
///
/// The 15 magnitude bits shifted into f32 position read as `x · 2^-112`, so one multiplication by `2^112`
/// (exact) restores normals and subnormals; inf/NaN get the all-ones exponent. Panics if the lengths
/// differ.
#[inline(always)]
pub(crate) fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths differ");
    let two_112 = f32::from_bits((127 + 112) << 23);
    for (d, s) in dst.iter_mut().zip(src) {
        let h = s.to_bits() as u32;
        let mag = h & 0x7fff;
        let finite = f32::from_bits(mag << 13) * two_112;
        let special = f32::from_bits((mag << 13) | 0x7f80_0000);
        let v = if mag >= 0x7c00 { special } else { finite };
        *d = f32::from_bits(v.to_bits() | ((h & 0x8000) << 16));
    }
}

/// 16 IEEE binary16 bit patterns at `p` widened to f32 exactly (the portable `load_f16` of the [`Isa`]s without a
/// conversion instruction).
///
/// # Safety
/// `p` must be valid for reading 16 `u16`s (no alignment needed).
#[inline(always)]
pub(crate) unsafe fn f16x16_to_f32(p: *const u16) -> [f32; LANES] {
    let mut bits = [half::f16::ZERO; LANES];
    for (l, x) in bits.iter_mut().enumerate() {
        // SAFETY: the caller guarantees 16 readable u16s at p.
        *x = half::f16::from_bits(unsafe { p.add(l).read_unaligned() });
    }
    let mut v = [0.0f32; LANES];
    f16_to_f32(&bits, &mut v);
    v
}

/// SiLU `x·σ(x) = x / (1 + e^{-x})` in f32, with [`exp_rounded`].
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp_rounded(-x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_equals_the_plain_sum_for_small_integers() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 5) as f32).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(isa::Scalar, &a, &b), want);
        assert_eq!(dot(isa::Scalar, &[], &[]), 0.0);
        assert_eq!(sum(&b), b.iter().sum::<f32>());
        assert_eq!(max(&b), 4.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn axpy_and_scale_axpy_compute_elementwise() {
        let mut y = vec![1.0, 2.0, 3.0];
        axpy(&mut y, 2.0, &[1.0, 1.0, 0.5]);
        assert_eq!(y, vec![3.0, 4.0, 4.0]);
        scale_axpy(&mut y, 0.5, 1.0, &[1.0, 0.0, -1.0]);
        assert_eq!(y, vec![2.5, 2.0, 1.0]);
        scale(&mut y, 2.0);
        assert_eq!(y, vec![5.0, 4.0, 2.0]);
        assert_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn exp_rounded_is_libms_expf_or_nearer_the_exact_value() {
        // Every 101st f32 bit pattern (42 million inputs: all magnitudes, both signs, subnormals, inf, NaN).
        let (mut differ, mut finite) = (0usize, 0usize);
        for bits in (0..=u32::MAX)
            .step_by(101)
            .chain([0x7f80_0000, 0xff80_0000, 0x3f80_0000])
        {
            let x = f32::from_bits(bits);
            let (got, want) = (exp_rounded(x), x.exp());
            if want.is_nan() {
                assert!(got.is_nan(), "{x:e}");
                continue;
            }
            finite += usize::from(want.is_finite() && want != 0.0);
            if got.to_bits() == want.to_bits() {
                continue;
            }
            // glibc's expf is within ~0.502 ulp: near a rounding midpoint it can round the other way. Ours must then
            // be one ulp away and the nearer one to e^x (f64's exp, far more accurate than an f32 ulp).
            differ += 1;
            assert_eq!(
                got.to_bits().abs_diff(want.to_bits()),
                1,
                "{x:e}: {got:e} vs libm {want:e}"
            );
            let exact = f64::from(x).exp();
            let (eg, ew) = (
                (f64::from(got) - exact).abs(),
                (f64::from(want) - exact).abs(),
            );
            assert!(
                eg <= ew,
                "{x:e}: {got:e} is farther than libm's {want:e} from {exact:e}"
            );
        }
        // Rare: 1,705 of the ~20 million finite, non-zero results with glibc 2.36.
        assert!(differ * 1000 < finite, "{differ} of {finite} differ");
    }

    #[test]
    fn f16_to_f32_is_exact_for_every_bit_pattern() {
        let all: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        let mut got = vec![0.0f32; all.len()];
        f16_to_f32(&all, &mut got);
        for (h, g) in all.iter().zip(&got) {
            let want = h.to_f32();
            if want.is_nan() {
                assert!(g.is_nan(), "{h:?}");
            } else {
                assert_eq!(g.to_bits(), want.to_bits(), "{h:?}");
            }
        }
    }

    #[test]
    fn exp_fast_is_within_two_ulp_of_the_exact_exponential() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_fast(x) as f64;
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            assert!(
                (got - want).abs() <= 2.0 * ulp,
                "exp({x}) = {got} vs {want}"
            );
            x += 0.001_37;
        }
        assert_eq!(exp_fast(0.0), 1.0);
        assert_eq!(exp_fast(-100.0), 0.0);
        assert_eq!(exp_fast(f32::NEG_INFINITY), 0.0);
        assert!(exp_fast(88.0).is_finite());
    }
}
