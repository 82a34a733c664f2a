//! [`Isa`] implementations on explicit vector registers: AVX2 and AVX-512F on x86-64, NEON on aarch64.
//!
//! Each token type is zero-sized with a field private to `simd`, so only
//! [`dispatch`](super::dispatch) (after checking the CPU) and the crate's tests create one; holding a token
//! is the proof that makes its `unsafe` intrinsic calls sound.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m128i, __m256, __m256i, __m512, _mm256_add_ps, _mm256_castps256_ps128, _mm256_castsi256_ps,
    _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_extractf128_ps, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_loadu_si256, _mm256_set1_ps, _mm256_setzero_ps, _mm256_slli_epi32,
    _mm256_storeu_ps, _mm512_add_ps, _mm512_castps512_ps256, _mm512_castsi512_ps,
    _mm512_cvtepu16_epi32, _mm512_cvtph_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_slli_epi32, _mm512_storeu_ps, _mm_add_ps,
    _mm_add_ss, _mm_cvtss_f32, _mm_loadu_si128, _mm_movehl_ps, _mm_shuffle_ps,
};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::{
    float32x4_t, vdupq_n_f32, vfmaq_f32, vld1_u16, vld1q_f32, vreinterpretq_f32_u32, vshll_n_u16,
    vst1q_f32,
};

use super::{Isa, LANES};

/// AVX2 lanes (two `__m256`). Only [`dispatch`](super::dispatch) creates it, after checking the CPU.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(pub(super) ());

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    type V = [__m256; 2];

    #[inline(always)]
    fn zero(self) -> Self::V {
        // SAFETY: an `Avx2` token exists only when the CPU supports AVX2 (see `dispatch`).
        unsafe { [_mm256_setzero_ps(), _mm256_setzero_ps()] }
    }

    #[inline(always)]
    fn load(self, s: &[f32]) -> Self::V {
        assert!(s.len() >= LANES, "load: fewer than 16 values");
        // SAFETY: AVX2 is supported (token); the 16 values read are in bounds (checked above).
        unsafe {
            [
                _mm256_loadu_ps(s.as_ptr()),
                _mm256_loadu_ps(s.as_ptr().add(8)),
            ]
        }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        // SAFETY: AVX2 is supported (token).
        unsafe { [_mm256_set1_ps(x), _mm256_set1_ps(x)] }
    }

    #[inline(always)]
    fn store(self, v: Self::V, s: &mut [f32]) {
        assert!(s.len() >= LANES, "store: fewer than 16 slots");
        // SAFETY: AVX2 is supported (token); the 16 slots written are in bounds (checked above).
        unsafe {
            _mm256_storeu_ps(s.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(s.as_mut_ptr().add(8), v[1]);
        }
    }

    #[inline(always)]
    fn lanes(self, v: Self::V) -> [f32; LANES] {
        // SAFETY: two __m256 are 16 f32 in lane order, with no padding.
        unsafe { std::mem::transmute::<[__m256; 2], [f32; LANES]>(v) }
    }

    #[inline(always)]
    fn fma(self, acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: an `Avx2` token implies FMA (see `dispatch`).
        unsafe {
            [
                _mm256_fmadd_ps(a[0], b[0], acc[0]),
                _mm256_fmadd_ps(a[1], b[1], acc[1]),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> Self::V {
        // SAFETY: AVX2 is supported (token); the caller guarantees 16 readable u16s at p.
        unsafe {
            let lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>()));
            let hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(8).cast::<__m128i>()));
            [
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo)),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi)),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> Self::V {
        // SAFETY: an `Avx2` token implies F16C; the caller guarantees 16 readable u16s at p.
        unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast::<__m128i>())),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_ptr(self, p: *const f32) -> Self::V {
        // SAFETY: AVX2 is supported (token); the caller guarantees 16 readable f32s at p.
        unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
    }

    #[inline(always)]
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32) {
        // SAFETY: AVX2 is supported (token); the caller guarantees 16 writable f32s at p.
        unsafe {
            _mm256_storeu_ps(p, v[0]);
            _mm256_storeu_ps(p.add(8), v[1]);
        }
    }

    #[inline(always)]
    fn reduce(self, v: Self::V) -> f32 {
        // SAFETY: AVX2 (token) implies AVX and SSE.
        unsafe {
            let s8 = _mm256_add_ps(v[0], v[1]);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }
}

/// AVX-512F lanes (one `__m512`). Only [`dispatch`](super::dispatch) creates it, after checking the CPU.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(pub(super) ());

#[cfg(target_arch = "x86_64")]
impl Isa for Avx512 {
    type V = __m512;

    #[inline(always)]
    fn zero(self) -> Self::V {
        // SAFETY: an `Avx512` token exists only when the CPU supports AVX-512F (see `dispatch`).
        unsafe { _mm512_setzero_ps() }
    }

    #[inline(always)]
    fn load(self, s: &[f32]) -> Self::V {
        assert!(s.len() >= LANES, "load: fewer than 16 values");
        // SAFETY: AVX-512F is supported (token); the 16 values read are in bounds (checked above).
        unsafe { _mm512_loadu_ps(s.as_ptr()) }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        // SAFETY: AVX-512F is supported (token).
        unsafe { _mm512_set1_ps(x) }
    }

    #[inline(always)]
    fn store(self, v: Self::V, s: &mut [f32]) {
        assert!(s.len() >= LANES, "store: fewer than 16 slots");
        // SAFETY: AVX-512F is supported (token); the 16 slots written are in bounds (checked above).
        unsafe { _mm512_storeu_ps(s.as_mut_ptr(), v) }
    }

    #[inline(always)]
    fn lanes(self, v: Self::V) -> [f32; LANES] {
        // SAFETY: an __m512 is 16 f32 in lane order.
        unsafe { std::mem::transmute::<__m512, [f32; LANES]>(v) }
    }

    const WIDE: bool = true;

    #[inline(always)]
    fn fma(self, acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: AVX-512F is supported (token).
        unsafe { _mm512_fmadd_ps(a, b, acc) }
    }

    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> Self::V {
        // SAFETY: AVX-512F is supported (token); the caller guarantees 16 readable u16s at p.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast::<__m256i>()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
    }

    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> Self::V {
        // SAFETY: AVX-512F is supported (token); the caller guarantees 16 readable u16s at p.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())) }
    }

    #[inline(always)]
    unsafe fn load_ptr(self, p: *const f32) -> Self::V {
        // SAFETY: AVX-512F is supported (token); the caller guarantees 16 readable f32s at p.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32) {
        // SAFETY: AVX-512F is supported (token); the caller guarantees 16 writable f32s at p.
        unsafe { _mm512_storeu_ps(p, v) }
    }

    #[inline(always)]
    fn reduce(self, v: Self::V) -> f32 {
        // SAFETY: AVX-512F (token) implies AVX and SSE.
        unsafe {
            // l += l + 8 (lanes 0..8), via the upper 256 bits moved down.
            let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(v, v);
            let s8 = _mm512_castps512_ps256(_mm512_add_ps(v, hi));
            // l += l + 4, l += l + 2, l += l + 1.
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }
}

/// NEON lanes (four `float32x4_t`), always available on aarch64 (e.g. Apple silicon). Only [`dispatch`](super::dispatch)
/// creates it.
#[cfg(target_arch = "aarch64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Neon(pub(super) ());

#[cfg(target_arch = "aarch64")]
impl Isa for Neon {
    type V = [float32x4_t; 4];

    #[inline(always)]
    fn zero(self) -> Self::V {
        self.splat(0.0)
    }

    #[inline(always)]
    fn load(self, s: &[f32]) -> Self::V {
        assert!(s.len() >= LANES, "load: fewer than 16 values");
        let p = s.as_ptr();
        // SAFETY: NEON is part of the aarch64 baseline; the 16 values read are in bounds (checked above).
        unsafe {
            [
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ]
        }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { [vdupq_n_f32(x); 4] }
    }

    #[inline(always)]
    fn store(self, v: Self::V, s: &mut [f32]) {
        assert!(s.len() >= LANES, "store: fewer than 16 slots");
        let p = s.as_mut_ptr();
        // SAFETY: NEON is part of the aarch64 baseline; the 16 slots written are in bounds (checked above).
        unsafe {
            for (q, x) in v.iter().enumerate() {
                vst1q_f32(p.add(4 * q), *x);
            }
        }
    }

    #[inline(always)]
    fn lanes(self, v: Self::V) -> [f32; LANES] {
        // SAFETY: four float32x4_t are 16 f32 in lane order, with no padding.
        unsafe { std::mem::transmute::<[float32x4_t; 4], [f32; LANES]>(v) }
    }

    #[inline(always)]
    fn fma(self, acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe {
            [
                vfmaq_f32(acc[0], a[0], b[0]),
                vfmaq_f32(acc[1], a[1], b[1]),
                vfmaq_f32(acc[2], a[2], b[2]),
                vfmaq_f32(acc[3], a[3], b[3]),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> Self::V {
        // SAFETY: NEON is part of the aarch64 baseline; the caller guarantees 16 readable u16s at p.
        unsafe {
            let q = |i: usize| vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.add(4 * i))));
            [q(0), q(1), q(2), q(3)]
        }
    }

    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> Self::V {
        // SAFETY: forwarded from the caller.
        let v = unsafe { super::f16x16_to_f32(p) };
        self.load(&v)
    }

    #[inline(always)]
    unsafe fn load_ptr(self, p: *const f32) -> Self::V {
        // SAFETY: NEON is part of the aarch64 baseline; the caller guarantees 16 readable f32s at p.
        unsafe {
            [
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ]
        }
    }

    #[inline(always)]
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32) {
        // SAFETY: NEON is part of the aarch64 baseline; the caller guarantees 16 writable f32s at p.
        unsafe {
            for (q, x) in v.iter().enumerate() {
                vst1q_f32(p.add(4 * q), *x);
            }
        }
    }
}
