//! The bf16 pair dot-product step of AVX-512 BF16's `vdpbf16ps`, as a vector abstraction ([`Dp`]) with one native
//! implementation (AVX-512 BF16, in `dp_x86.rs`) and bit-exact emulations (AVX-512F, AVX2 there; plain Rust here).
//!
//! # What `vdpbf16ps` computes
//! Per f32 lane `l`, with `a`, `b` the two sources' bf16 pairs (element `2l` in the low half of the lane's 32 bits,
//! `2l + 1` in the high half) and `acc` the destination (Intel SDM, and measured on AMD Zen 4 by
//! `vdpbf16ps_matches_the_scalar_step` in `isa_tests.rs`):
//!
//! ```text
//! acc = step(acc, a[2l+1], b[2l+1]);  acc = step(acc, a[2l], b[2l])
//! step(c, x, y) = ftz(round(daz(c) + daz(x)·daz(y)))     (one rounding: the bf16 product is exact)
//! ```
//!
//! `daz` replaces a denormal input (bf16 or the f32 accumulator) by a zero of its sign; `round` is round to nearest
//! even with the exponent unbounded, as a fused multiply-add does; `ftz` replaces a *tiny* result (IEEE 754 tininess
//! **after** rounding: `|result| < 2^-126` once rounded to 24 significant bits with unbounded exponent) by a zero of
//! its sign. So `2^-126 − 2^-150` flushes to 0 although the subnormal-aware rounding of an FMA would give `2^-126`,
//! while `2^-126 − 2^-152` gives `2^-126`. NaNs propagate as the FMA of x86 does (the first NaN operand quieted, in
//! the order acc, x, y; an invalid operation gives the default NaN `0xffc00000`); the emulations give the same
//! NaN-ness but their payloads are not guaranteed (no kernel relies on them).

use super::LANES;

/// The smallest normal f32, `2^-126`.
const MIN_NORMAL: f32 = f32::MIN_POSITIVE;

/// `x` with a denormal replaced by a zero of its sign.
#[inline(always)]
fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// One step of `vdpbf16ps` (see the module docs): `ftz(round(daz(c) + daz(x)·daz(y)))` for f32 `c` and bf16 values
/// `x`, `y` given as f32.
#[inline(always)]
pub(crate) fn step(c: f32, x: f32, y: f32) -> f32 {
    let (c, x, y) = (daz(c), daz(x), daz(y));
    let r = x.mul_add(y, c);
    ftz_rounded(r, c, x, y)
}

/// The flush of a step's result: `r` is `round(c + x·y)` with subnormals (an FMA's), the step's inputs after `daz`.
/// `|r| > 2^-126`, inf and NaN stay; `|r| < 2^-126` is tiny whatever the rounding; `|r| = 2^-126` is tiny iff the
/// exact value is below `2^-126 − 2^-151` in magnitude (then 24-bit rounding would have given `2^-126 − 2^-150`).
#[inline(always)]
pub(crate) fn ftz_rounded(r: f32, c: f32, x: f32, y: f32) -> f32 {
    let a = r.abs();
    if a.is_nan() || a > MIN_NORMAL {
        r
    } else if a < MIN_NORMAL {
        f32::from_bits(r.to_bits() & 0x8000_0000)
    } else {
        at_min_normal(r, c, x, y)
    }
}

/// [`ftz_rounded`] for `|r| = 2^-126`: compares the exact `c + x·y` with `±(2^-126 − 2^-151)` in f64. `x·y` is exact
/// in f64 (two 8-bit significands); `s + e = c + x·y` exactly (TwoSum); `s` is within a factor 2 of the threshold
/// `t`, so `s − t` is exact (Sterbenz) and a multiple of `2^-179`, while `|e| ≤ 2^-180`: the sign of the exact
/// difference is that of `s − t`, or of `e` when `s = t`.
#[cold]
#[inline(never)]
pub(crate) fn at_min_normal(r: f32, c: f32, x: f32, y: f32) -> f32 {
    let p = f64::from(x) * f64::from(y);
    let c = f64::from(c);
    let s = c + p;
    let bb = s - c;
    let e = (c - (s - bb)) + (p - bb);
    let t = f64::from(MIN_NORMAL) * (1.0 - 2f64.powi(-25));
    let d = s.abs() - t;
    let below = if d != 0.0 {
        d < 0.0
    } else {
        // s = ±t exactly: below iff e points towards zero
        (e < 0.0) == (s > 0.0) && e != 0.0
    };
    if below {
        f32::from_bits(r.to_bits() & 0x8000_0000)
    } else {
        r
    }
}

/// `acc` after one `vdpbf16ps` lane: the high pair elements first, then the low ones (see the module docs). `w` and
/// `x` are bf16 pairs (element `2l` in bits 0..16).
#[inline(always)]
pub(crate) fn dp_lane(acc: f32, w: u32, x: u32) -> f32 {
    let hi = |v: u32| f32::from_bits(v & 0xffff_0000);
    let lo = |v: u32| f32::from_bits(v << 16);
    let t = step(acc, hi(w), hi(x));
    step(t, lo(w), lo(x))
}

/// A bf16 dot-product instruction set: 16 f32 accumulator lanes advanced by `vdpbf16ps` (native or emulated; every
/// implementation gives the same bits, NaN payloads aside).
pub(crate) trait Dp: Copy {
    /// 16 f32 lanes.
    type A: Copy;
    /// 16 lanes of one bf16 pair each (32 bf16).
    type P: Copy;
    /// Whether the instruction set has 32 vector registers of 16 lanes (AVX-512): kernels then use larger tiles.
    const WIDE: bool;
    /// All lanes +0.
    fn zero(self) -> Self::A;
    /// Lanes from 16 f32 at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 `f32`s (no alignment needed).
    unsafe fn load_acc(self, p: *const f32) -> Self::A;
    /// Writes the lanes to 16 f32 at `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing 16 `f32`s (no alignment needed).
    unsafe fn store_acc(self, a: Self::A, p: *mut f32);
    /// The lanes, lane 0 first.
    fn lanes(self, a: Self::A) -> [f32; LANES];
    /// Lanes from an array.
    fn acc_of(self, v: [f32; LANES]) -> Self::A;
    /// 16 pairs (64 bytes) at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 `u32`s (no alignment needed).
    unsafe fn load_pairs(self, p: *const u32) -> Self::P;
    /// Every lane the pair `x`.
    fn splat_pair(self, x: u32) -> Self::P;
    /// Per lane: [`dp_lane`]`(acc, w, x)`. The emulations assume `acc` holds no denormal (true of every value a chain
    /// of steps from +0 produces); the native instruction treats one as zero.
    fn dp(self, acc: Self::A, w: Self::P, x: Self::P) -> Self::A;
}

/// Plain-Rust emulation (any CPU).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScalarDp;

impl Dp for ScalarDp {
    type A = [f32; LANES];
    type P = [u32; LANES];
    const WIDE: bool = false;

    #[inline(always)]
    fn zero(self) -> Self::A {
        [0.0; LANES]
    }

    #[inline(always)]
    unsafe fn load_acc(self, p: *const f32) -> Self::A {
        // SAFETY: the caller guarantees 16 readable f32s at p.
        unsafe { p.cast::<[f32; LANES]>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn store_acc(self, a: Self::A, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32s at p.
        unsafe { p.cast::<[f32; LANES]>().write_unaligned(a) }
    }

    #[inline(always)]
    fn lanes(self, a: Self::A) -> [f32; LANES] {
        a
    }

    #[inline(always)]
    fn acc_of(self, v: [f32; LANES]) -> Self::A {
        v
    }

    #[inline(always)]
    unsafe fn load_pairs(self, p: *const u32) -> Self::P {
        // SAFETY: the caller guarantees 16 readable u32s at p.
        unsafe { p.cast::<[u32; LANES]>().read_unaligned() }
    }

    #[inline(always)]
    fn splat_pair(self, x: u32) -> Self::P {
        [x; LANES]
    }

    #[inline(always)]
    fn dp(self, mut acc: Self::A, w: Self::P, x: Self::P) -> Self::A {
        for l in 0..LANES {
            acc[l] = dp_lane(acc[l], w[l], x[l]);
        }
        acc
    }
}

/// A unit of kernel work that [`dp_dispatch`] compiles once per [`Dp`] (implement `run` with `#[inline(always)]`).
pub(crate) trait DpKernel {
    /// The result.
    type Out;
    /// Does the work with `dp`.
    fn run<D: Dp>(self, dp: D) -> Self::Out;
}

/// Which [`Dp`] [`dp_dispatch`] picks on this CPU: 3 = AVX-512 BF16 (native `vdpbf16ps`), 2 = AVX-512F emulation,
/// 1 = AVX2 emulation, 0 = plain Rust; capped by the crate's test-only dispatch cap. Never AMX.
pub(crate) fn dp_level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        let f = std::arch::is_x86_feature_detected!("avx512f");
        if super::allowed(3) && f && std::arch::is_x86_feature_detected!("avx512bf16") {
            return 3;
        }
        if super::allowed(2) && f {
            return 2;
        }
        if super::allowed(1)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return 1;
        }
    }
    0
}

/// Runs `k` with the best [`Dp`] of the CPU ([`dp_level`]); every choice gives the same bits.
#[inline]
pub(crate) fn dp_dispatch<K: DpKernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    {
        use super::dp_x86::{with_avx2, with_avx512, with_avx512_bf16};
        match dp_level() {
            // SAFETY: level 3 means the CPU supports AVX-512F and AVX-512 BF16 (checked by `dp_level`).
            3 => return unsafe { with_avx512_bf16(k) },
            // SAFETY: level 2 means the CPU supports AVX-512F.
            2 => return unsafe { with_avx512(k) },
            // SAFETY: level 1 means the CPU supports AVX2 and FMA.
            1 => return unsafe { with_avx2(k) },
            _ => {}
        }
    }
    k.run(ScalarDp)
}

/// The instruction set [`dp_dispatch`] uses: `"avx512-bf16"`, `"avx512f-emulated"`, `"avx2-emulated"` or
/// `"scalar-emulated"`.
pub(crate) fn dp_name() -> &'static str {
    match dp_level() {
        3 => "avx512-bf16",
        2 => "avx512f-emulated",
        1 => "avx2-emulated",
        _ => "scalar-emulated",
    }
}

#[cfg(test)]
#[path = "dp_tests.rs"]
mod tests;
