//! [`Dp`] on x86-64: native AVX-512 BF16 (`vdpbf16ps`), and its bit-exact emulations on AVX-512F and AVX2 (two fused
//! multiply-adds per pair with the denormal handling of the instruction; see `dp.rs`).

use std::arch::x86_64::{
    __m256, __m256i, __m512, __m512bh, __m512i, _mm256_and_si256, _mm256_blendv_epi8,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32,
    _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_set1_epi32,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps, _mm512_and_si512, _mm512_castps_si512,
    _mm512_castsi512_ps, _mm512_cmpeq_epi32_mask, _mm512_cmplt_epu32_mask, _mm512_dpbf16_ps,
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_and_epi32, _mm512_set1_epi32,
    _mm512_setzero_ps, _mm512_slli_epi32, _mm512_storeu_ps, _mm512_test_epi32_mask,
};

use super::arch::{Avx2, Avx512};
use super::dp::{ftz_rounded, Dp, DpKernel};
use super::LANES;

const SIGN: i32 = 0x8000_0000u32 as i32;
const EXP: i32 = 0x7f80_0000;
const ABS: i32 = 0x7fff_ffff;
const HI: i32 = 0xffff_0000u32 as i32;
/// The bits of `2^-126`.
const MIN_NORMAL: i32 = 0x0080_0000;

/// Native AVX-512 BF16 (with AVX-512F). Only [`dp_dispatch`](super::dp::dp_dispatch) creates it, after checking the
/// CPU.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512Bf16(pub(super) ());

/// The lanes `l` where `mask` has bit `l` set, recomputed by [`ftz_rounded`] from the step's inputs (the rare results
/// of magnitude exactly `2^-126`).
#[cold]
#[inline(never)]
fn fix_lanes(r: &mut [f32; LANES], c: [f32; LANES], a: [f32; LANES], b: [f32; LANES], mask: u32) {
    for l in 0..LANES {
        if mask & (1 << l) != 0 {
            r[l] = ftz_rounded(r[l], c[l], a[l], b[l]);
        }
    }
}

macro_rules! acc512 {
    () => {
        type A = __m512;
        type P = __m512i;
        const WIDE: bool = true;

        #[inline(always)]
        fn zero(self) -> Self::A {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_setzero_ps() }
        }

        #[inline(always)]
        unsafe fn load_acc(self, p: *const f32) -> Self::A {
            // SAFETY: AVX-512F (token); the caller guarantees 16 readable f32s at p.
            unsafe { _mm512_loadu_ps(p) }
        }

        #[inline(always)]
        unsafe fn store_acc(self, a: Self::A, p: *mut f32) {
            // SAFETY: AVX-512F (token); the caller guarantees 16 writable f32s at p.
            unsafe { _mm512_storeu_ps(p, a) }
        }

        #[inline(always)]
        fn lanes(self, a: Self::A) -> [f32; LANES] {
            // SAFETY: an __m512 is 16 f32 in lane order.
            unsafe { std::mem::transmute::<__m512, [f32; LANES]>(a) }
        }

        #[inline(always)]
        fn acc_of(self, v: [f32; LANES]) -> Self::A {
            // SAFETY: AVX-512F (token); 16 f32 read from the array.
            unsafe { _mm512_loadu_ps(v.as_ptr()) }
        }

        #[inline(always)]
        unsafe fn load_pairs(self, p: *const u32) -> Self::P {
            // SAFETY: AVX-512F (token); the caller guarantees 64 readable bytes at p.
            unsafe { _mm512_loadu_si512(p.cast()) }
        }

        #[inline(always)]
        fn splat_pair(self, x: u32) -> Self::P {
            // SAFETY: AVX-512F (token).
            unsafe { _mm512_set1_epi32(x as i32) }
        }
    };
}

impl Dp for Avx512Bf16 {
    acc512!();

    #[inline(always)]
    fn dp(self, acc: Self::A, w: Self::P, x: Self::P) -> Self::A {
        // SAFETY: the token proves AVX-512 BF16; __m512i and __m512bh are both 64 bytes of vector.
        unsafe {
            _mm512_dpbf16_ps(
                acc,
                std::mem::transmute::<__m512i, __m512bh>(w),
                std::mem::transmute::<__m512i, __m512bh>(x),
            )
        }
    }
}

/// 16 lanes of f32 bits with denormals replaced by zeros of their sign.
#[inline(always)]
fn daz512(v: __m512i) -> __m512 {
    // SAFETY: only called with an `Avx512` token alive (AVX-512F).
    unsafe {
        let normal = _mm512_test_epi32_mask(v, _mm512_set1_epi32(EXP));
        _mm512_castsi512_ps(_mm512_mask_and_epi32(
            v,
            !normal,
            v,
            _mm512_set1_epi32(SIGN),
        ))
    }
}

/// One emulated step on 16 lanes: `ftz(round(c + a·b))` (inputs already without denormals).
#[inline(always)]
fn step512(c: __m512, a: __m512, b: __m512) -> __m512 {
    // SAFETY: only called with an `Avx512` token alive (AVX-512F).
    unsafe {
        let bits = _mm512_castps_si512(_mm512_fmadd_ps(a, b, c));
        let abs = _mm512_and_si512(bits, _mm512_set1_epi32(ABS));
        let tiny = _mm512_cmplt_epu32_mask(abs, _mm512_set1_epi32(MIN_NORMAL));
        let r = _mm512_castsi512_ps(_mm512_mask_and_epi32(
            bits,
            tiny,
            bits,
            _mm512_set1_epi32(SIGN),
        ));
        let edge = _mm512_cmpeq_epi32_mask(abs, _mm512_set1_epi32(MIN_NORMAL));
        if edge == 0 {
            return r;
        }
        let t = |v: __m512| std::mem::transmute::<__m512, [f32; LANES]>(v);
        let mut out = t(r);
        fix_lanes(&mut out, t(c), t(a), t(b), u32::from(edge));
        _mm512_loadu_ps(out.as_ptr())
    }
}

impl Dp for Avx512 {
    acc512!();

    #[inline(always)]
    fn dp(self, acc: Self::A, w: Self::P, x: Self::P) -> Self::A {
        // SAFETY: AVX-512F (token).
        unsafe {
            let hi = _mm512_set1_epi32(HI);
            let (w_hi, w_lo) = (_mm512_and_si512(w, hi), _mm512_slli_epi32::<16>(w));
            let (x_hi, x_lo) = (_mm512_and_si512(x, hi), _mm512_slli_epi32::<16>(x));
            let t = step512(acc, daz512(w_hi), daz512(x_hi));
            step512(t, daz512(w_lo), daz512(x_lo))
        }
    }
}

/// [`daz512`] on AVX2 (8 lanes).
#[inline(always)]
fn daz256(v: __m256i) -> __m256 {
    // SAFETY: only called with an `Avx2` token alive.
    unsafe {
        let zero_exp = _mm256_cmpeq_epi32(
            _mm256_and_si256(v, _mm256_set1_epi32(EXP)),
            _mm256_set1_epi32(0),
        );
        let signed_zero = _mm256_and_si256(v, _mm256_set1_epi32(SIGN));
        _mm256_castsi256_ps(_mm256_blendv_epi8(v, signed_zero, zero_exp))
    }
}

/// [`step512`] on AVX2 (8 lanes); lanes at `2^-126` are fixed by the caller from the returned mask.
#[inline(always)]
fn step256(c: __m256, a: __m256, b: __m256) -> (__m256, i32) {
    // SAFETY: only called with an `Avx2` token alive (AVX2 and FMA).
    unsafe {
        let bits = _mm256_castps_si256(_mm256_fmadd_ps(a, b, c));
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(ABS));
        let tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(MIN_NORMAL), abs);
        let zeroed = _mm256_and_si256(bits, _mm256_set1_epi32(SIGN));
        let r = _mm256_castsi256_ps(_mm256_blendv_epi8(bits, zeroed, tiny));
        let edge = _mm256_cmpeq_epi32(abs, _mm256_set1_epi32(MIN_NORMAL));
        (r, _mm256_movemask_epi8(edge))
    }
}

/// One emulated step on 16 lanes (two halves).
#[inline(always)]
fn step2x256(c: [__m256; 2], a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
    let (r0, e0) = step256(c[0], a[0], b[0]);
    let (r1, e1) = step256(c[1], a[1], b[1]);
    if e0 | e1 == 0 {
        return [r0, r1];
    }
    // movemask gives 4 bits per 32-bit lane: one bit per lane.
    let lane_mask = |e: i32| (0..8).fold(0u32, |m, l| m | (((e as u32 >> (4 * l)) & 1) << l));
    let mask = lane_mask(e0) | lane_mask(e1) << 8;
    // SAFETY: two __m256 are 16 f32 in lane order.
    let t = |v: [__m256; 2]| unsafe { std::mem::transmute::<[__m256; 2], [f32; LANES]>(v) };
    let mut out = t([r0, r1]);
    fix_lanes(&mut out, t(c), t(a), t(b), mask);
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[f32; LANES], [__m256; 2]>(out) }
}

impl Dp for Avx2 {
    type A = [__m256; 2];
    type P = [__m256i; 2];
    const WIDE: bool = false;

    #[inline(always)]
    fn zero(self) -> Self::A {
        // SAFETY: the token proves AVX2.
        unsafe { [_mm256_setzero_ps(), _mm256_setzero_ps()] }
    }

    #[inline(always)]
    unsafe fn load_acc(self, p: *const f32) -> Self::A {
        // SAFETY: AVX2 (token); the caller guarantees 16 readable f32s at p.
        unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
    }

    #[inline(always)]
    unsafe fn store_acc(self, a: Self::A, p: *mut f32) {
        // SAFETY: AVX2 (token); the caller guarantees 16 writable f32s at p.
        unsafe {
            _mm256_storeu_ps(p, a[0]);
            _mm256_storeu_ps(p.add(8), a[1]);
        }
    }

    #[inline(always)]
    fn lanes(self, a: Self::A) -> [f32; LANES] {
        // SAFETY: two __m256 are 16 f32 in lane order.
        unsafe { std::mem::transmute::<[__m256; 2], [f32; LANES]>(a) }
    }

    #[inline(always)]
    fn acc_of(self, v: [f32; LANES]) -> Self::A {
        // SAFETY: AVX2 (token); 16 f32 read from the array.
        unsafe { self.load_acc(v.as_ptr()) }
    }

    #[inline(always)]
    unsafe fn load_pairs(self, p: *const u32) -> Self::P {
        // SAFETY: AVX2 (token); the caller guarantees 64 readable bytes at p.
        unsafe {
            [
                _mm256_loadu_si256(p.cast()),
                _mm256_loadu_si256(p.add(8).cast()),
            ]
        }
    }

    #[inline(always)]
    fn splat_pair(self, x: u32) -> Self::P {
        // SAFETY: AVX2 (token).
        unsafe { [_mm256_set1_epi32(x as i32); 2] }
    }

    #[inline(always)]
    fn dp(self, acc: Self::A, w: Self::P, x: Self::P) -> Self::A {
        // SAFETY: AVX2 (token).
        unsafe {
            let hi = _mm256_set1_epi32(HI);
            let split = |v: __m256i| {
                (
                    daz256(_mm256_and_si256(v, hi)),
                    daz256(_mm256_slli_epi32::<16>(v)),
                )
            };
            let (w0h, w0l) = split(w[0]);
            let (w1h, w1l) = split(w[1]);
            let (x0h, x0l) = split(x[0]);
            let (x1h, x1l) = split(x[1]);
            let t = step2x256(acc, [w0h, w1h], [x0h, x1h]);
            step2x256(t, [w0l, w1l], [x0l, x1l])
        }
    }
}

/// # Safety
/// The CPU must support AVX-512F and AVX-512 BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn with_avx512_bf16<K: DpKernel>(k: K) -> K::Out {
    k.run(Avx512Bf16(()))
}

/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn with_avx512<K: DpKernel>(k: K) -> K::Out {
    k.run(Avx512(()))
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn with_avx2<K: DpKernel>(k: K) -> K::Out {
    k.run(Avx2(()))
}
