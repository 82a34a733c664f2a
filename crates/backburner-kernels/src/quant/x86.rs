//! [`QIsa`] on x86-64 vector registers: AVX-512 with VNNI (`vpdpbusd`: u8×i8 → i32, four products per lane) and
//! AVX2 (`vpmaddubsw` → i16 pair sums, `vpmaddwd` → i32), with the asm blocks of [`super::x86_asm`] for the 4-row
//! tiles of the many-row path on AVX2 and the ordered unit loads on AVX-512.
//!
//! The tokens have a field private to `quant`, so only [`qdispatch`](super::isa::qdispatch) (after checking the
//! CPU) creates one; holding a token is the proof that makes its intrinsic calls sound.

use std::arch::x86_64::*;

use super::isa::{codes8_by_address, masked_nibble_lut, QIsa, LANES};
use super::x86_asm::{load8_avx512, signed_quad_avx2, small_quad_avx2};

/// AVX-512F + BW + VNNI lanes (one 512-bit register each); with `VBMI` (AVX-512 VBMI and GFNI too), the nibble
/// lookups of [`QIsa::nibble_lut`] are byte permutes (`vpermb`) over the table repeated four times, which need no
/// masks, and [`QIsa::nibbles_high`] moves the high-bit planes with `vgf2p8affineqb` and merges with `vpternlogd`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512Vnni<const VBMI: bool>(pub(super) ());

impl<const VBMI: bool> QIsa for Avx512Vnni<VBMI> {
    type W = __m512i;
    type A = __m512i;
    type I = __m512i;
    type F = __m512;
    const SIGNED: bool = false;
    const ROWS: usize = 4;
    const WIDE_ROWS: usize = 8;
    const FEW_ROWS: usize = 16;

    // SAFETY (every method): the token exists only when the CPU supports AVX-512F, BW and VNNI; pointer
    // arguments are valid as each method's contract requires.

    #[inline(always)]
    unsafe fn load_w(self, p: *const u8) -> Self::W {
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    const ORDERED_LOAD8: bool = true;
    type Codes8 = [__m512i; 8];
    #[inline(always)]
    unsafe fn load8_w(self, p: *const u8) -> ([__m512i; 8], *const u8) {
        // SAFETY: the token proves AVX-512F; the 512 bytes are the caller's promise.
        unsafe { load8_avx512(p) }
    }
    #[inline(always)]
    unsafe fn pick8(self, c: [__m512i; 8], i: usize) -> __m512i {
        c[i]
    }
    #[inline(always)]
    fn splat_w(self, b: u8) -> Self::W {
        unsafe { _mm512_set1_epi8(b as i8) }
    }
    #[inline(always)]
    fn and_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    fn or_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    fn xor_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { _mm512_xor_si512(a, b) }
    }
    #[inline(always)]
    fn shl16(self, a: Self::W, n: u32) -> Self::W {
        unsafe { _mm512_sll_epi16(a, _mm_cvtsi32_si128(n as i32)) }
    }
    #[inline(always)]
    fn shr16(self, a: Self::W, n: u32) -> Self::W {
        unsafe { _mm512_srl_epi16(a, _mm_cvtsi32_si128(n as i32)) }
    }
    #[inline(always)]
    fn lut16(self, table: [u8; 16], idx: Self::W) -> Self::W {
        unsafe {
            let t = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast()));
            _mm512_shuffle_epi8(t, idx)
        }
    }
    #[inline(always)]
    unsafe fn nibble_lut(self, table: [u8; 16], p: *const u8) -> (Self::W, Self::W) {
        if !VBMI {
            // SAFETY: forwarded from the caller.
            return unsafe { masked_nibble_lut(self, table, p) };
        }
        // SAFETY: the caller guarantees 64 readable bytes; a `VBMI` token is only made on a CPU with AVX-512 VBMI
        // (and GFNI).
        // `vpermb` reads the low 6 bits of each index byte, and the table is repeated in all four 16-byte quarters,
        // so bits 4 and 5 (the other nibble's, or a shifted-in neighbour's) pick the same entry.
        unsafe {
            let v = _mm512_loadu_si512(p.cast());
            let t = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast()));
            (
                _mm512_permutexvar_epi8(v, t),
                _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v), t),
            )
        }
    }
    #[inline(always)]
    unsafe fn nibbles_high(
        self,
        p: *const u8,
        planes: (Self::W, Self::W),
        from: (u32, u32),
        width: u32,
    ) -> (Self::W, Self::W) {
        if !VBMI {
            // SAFETY: forwarded from the caller.
            return unsafe { super::isa::nibbles_high_masked(self, p, planes, from, width) };
        }
        // SAFETY: the caller guarantees 64 readable bytes; a `VBMI` token is only made on a CPU with GFNI too.
        // `vgf2p8affineqb` moves each byte's bits `from..from + width` to bits `4..` and clears the rest (one
        // bit-matrix product per byte); `vpternlogd` 0xEA is `(a & b) | c`: the nibble (the high one after a word
        // shift, whose bits 4–7 the mask drops) or-ed with the moved bits.
        unsafe {
            let v = _mm512_loadu_si512(p.cast());
            let m = _mm512_set1_epi8(0x0F);
            let lo = _mm512_gf2p8affine_epi64_epi8::<0>(planes.0, lift_matrix(from.0, width));
            let hi = _mm512_gf2p8affine_epi64_epi8::<0>(planes.1, lift_matrix(from.1, width));
            (
                _mm512_ternarylogic_epi32::<0xEA>(v, m, lo),
                _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi16::<4>(v), m, hi),
            )
        }
    }
    #[inline(always)]
    fn a_zero(self) -> Self::A {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    fn dot_u(self, a: Self::A, w: Self::W, x4: i32) -> Self::A {
        // vpdpbusd: the first multiplicand is unsigned, the second signed; sums of 4 exact products, no saturation.
        unsafe { _mm512_dpbusd_epi32(a, w, _mm512_set1_epi32(x4)) }
    }
    #[inline(always)]
    fn dot_s(self, a: Self::A, w: Self::W, x4: i32) -> Self::A {
        self.dot_u(a, w, x4)
    }
    #[inline(always)]
    fn widen_every(self, _cmax: u32) -> usize {
        8
    }
    #[inline(always)]
    fn widen(self, a: Self::A, s: Self::I) -> Self::I {
        unsafe { _mm512_add_epi32(a, s) }
    }
    #[inline(always)]
    fn i_zero(self) -> Self::I {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn sub_splat_i(self, a: Self::I, v: i32) -> Self::I {
        unsafe { _mm512_sub_epi32(a, _mm512_set1_epi32(v)) }
    }
    #[inline(always)]
    fn cvt(self, a: Self::I) -> Self::F {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> Self::F {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_u8f(self, p: *const u8) -> Self::F {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn load_i8f(self, p: *const u8) -> Self::F {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    fn f_zero(self) -> Self::F {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    fn splat_f(self, x: f32) -> Self::F {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn mul(self, a: Self::F, b: Self::F) -> Self::F {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn fms(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        unsafe { _mm512_fmsub_ps(a, b, c) }
    }
    #[inline(always)]
    fn lanes(self, a: Self::F) -> [f32; LANES] {
        // SAFETY: an __m512 is 16 f32 in lane order.
        unsafe { std::mem::transmute::<__m512, [f32; LANES]>(a) }
    }
    #[inline(always)]
    fn load_f(self, v: [f32; LANES]) -> Self::F {
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    }
    #[inline(always)]
    unsafe fn store_w(self, w: Self::W, p: *mut u8) {
        unsafe { _mm512_storeu_si512(p.cast(), w) }
    }
    #[inline(always)]
    unsafe fn store_fp(self, f: Self::F, p: *mut u8) {
        unsafe { _mm512_storeu_ps(p.cast(), f) }
    }
    #[inline(always)]
    unsafe fn load_fp(self, p: *const u8) -> Self::F {
        unsafe { _mm512_loadu_ps(p.cast()) }
    }
    #[inline(always)]
    fn prefetch(self, p: *const u8) {
        crate::simd::prefetch_l2(p);
    }
    #[inline(always)]
    fn prefetch_once(self, p: *const u8) {
        crate::simd::prefetch_once(p);
    }
}

/// AVX2 lanes (two 256-bit registers each: rows 0..8, rows 8..16).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(pub(super) ());

/// Applies a 256-bit intrinsic to both halves (a plain expansion, no closure: a closure body would be compiled
/// without the caller's target features).
macro_rules! both {
    ($f:ident, $a:expr) => {
        [$f($a[0]), $f($a[1])]
    };
    ($f:ident, $a:expr, $b:expr) => {
        [$f($a[0], $b[0]), $f($a[1], $b[1])]
    };
}

impl QIsa for Avx2 {
    type W = [__m256i; 2];
    /// 16 i16 per half: lane `l`'s two pair sums at positions `2l, 2l + 1`.
    type A = [__m256i; 2];
    type I = [__m256i; 2];
    type F = [__m256; 2];
    const SIGNED: bool = true;
    const ROWS: usize = 2;

    // SAFETY (every method): the token exists only when the CPU supports AVX2, FMA and F16C; pointer arguments are
    // valid as each method's contract requires.

    codes8_by_address!();
    #[inline(always)]
    unsafe fn load_w(self, p: *const u8) -> Self::W {
        unsafe {
            [
                _mm256_loadu_si256(p.cast()),
                _mm256_loadu_si256(p.add(32).cast()),
            ]
        }
    }
    #[inline(always)]
    fn splat_w(self, b: u8) -> Self::W {
        unsafe { [_mm256_set1_epi8(b as i8); 2] }
    }
    #[inline(always)]
    fn and_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { both!(_mm256_and_si256, a, b) }
    }
    #[inline(always)]
    fn or_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { both!(_mm256_or_si256, a, b) }
    }
    #[inline(always)]
    fn xor_w(self, a: Self::W, b: Self::W) -> Self::W {
        unsafe { both!(_mm256_xor_si256, a, b) }
    }
    #[inline(always)]
    fn shl16(self, a: Self::W, n: u32) -> Self::W {
        unsafe {
            let c = _mm_cvtsi32_si128(n as i32);
            [_mm256_sll_epi16(a[0], c), _mm256_sll_epi16(a[1], c)]
        }
    }
    #[inline(always)]
    fn shr16(self, a: Self::W, n: u32) -> Self::W {
        unsafe {
            let c = _mm_cvtsi32_si128(n as i32);
            [_mm256_srl_epi16(a[0], c), _mm256_srl_epi16(a[1], c)]
        }
    }
    #[inline(always)]
    fn lut16(self, table: [u8; 16], idx: Self::W) -> Self::W {
        unsafe {
            let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr().cast()));
            [
                _mm256_shuffle_epi8(t, idx[0]),
                _mm256_shuffle_epi8(t, idx[1]),
            ]
        }
    }
    #[inline(always)]
    fn a_zero(self) -> Self::A {
        unsafe { [_mm256_setzero_si256(); 2] }
    }
    #[inline(always)]
    fn dot_u(self, a: Self::A, w: Self::W, x4: i32) -> Self::A {
        // vpmaddubsw saturates its i16 pair sums, but codes ≤ 63 keep them within ±16002.
        unsafe {
            let x = _mm256_set1_epi32(x4);
            [
                _mm256_add_epi16(a[0], _mm256_maddubs_epi16(w[0], x)),
                _mm256_add_epi16(a[1], _mm256_maddubs_epi16(w[1], x)),
            ]
        }
    }
    #[inline(always)]
    fn dot_s(self, a: Self::A, w: Self::W, x4: i32) -> Self::A {
        // Signed codes v: |v| as the unsigned operand and x with v's sign as the signed one (0 where v = 0), so each
        // pair sum is within 2·128·127 = 32512 and vpmaddubsw never saturates.
        unsafe {
            let x = _mm256_set1_epi32(x4);
            let p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(w[0]), _mm256_sign_epi8(x, w[0]));
            let p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(w[1]), _mm256_sign_epi8(x, w[1]));
            [_mm256_add_epi16(a[0], p0), _mm256_add_epi16(a[1], p1)]
        }
    }
    #[inline(always)]
    fn widen_every(self, cmax: u32) -> usize {
        // Each call adds at most 2·cmax·127 to an i16 pair sum.
        (32767 / (2 * cmax as usize * 127)).clamp(1, 8)
    }
    #[inline(always)]
    fn widen(self, a: Self::A, s: Self::I) -> Self::I {
        unsafe {
            let ones = _mm256_set1_epi16(1);
            [
                _mm256_add_epi32(s[0], _mm256_madd_epi16(a[0], ones)),
                _mm256_add_epi32(s[1], _mm256_madd_epi16(a[1], ones)),
            ]
        }
    }
    const QUAD: bool = true;
    #[inline(always)]
    unsafe fn quad_sums<const OFFSET_128: bool>(
        self,
        codes: *const u8,
        x: [*const u8; 4],
    ) -> [Self::I; 4] {
        // SAFETY: forwarded from the caller; the token proves AVX2.
        unsafe {
            if OFFSET_128 {
                signed_quad_avx2(codes, x)
            } else {
                small_quad_avx2(codes, x)
            }
        }
    }
    #[inline(always)]
    fn i_zero(self) -> Self::I {
        unsafe { [_mm256_setzero_si256(); 2] }
    }
    #[inline(always)]
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I {
        unsafe { both!(_mm256_add_epi32, a, b) }
    }
    #[inline(always)]
    fn sub_splat_i(self, a: Self::I, v: i32) -> Self::I {
        unsafe {
            let s = _mm256_set1_epi32(v);
            [_mm256_sub_epi32(a[0], s), _mm256_sub_epi32(a[1], s)]
        }
    }
    #[inline(always)]
    fn cvt(self, a: Self::I) -> Self::F {
        unsafe { both!(_mm256_cvtepi32_ps, a) }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> Self::F {
        unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load_u8f(self, p: *const u8) -> Self::F {
        unsafe {
            let v = _mm_loadu_si128(p.cast());
            [
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load_i8f(self, p: *const u8) -> Self::F {
        unsafe {
            let v = _mm_loadu_si128(p.cast());
            [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v))),
            ]
        }
    }
    #[inline(always)]
    fn f_zero(self) -> Self::F {
        unsafe { [_mm256_setzero_ps(); 2] }
    }
    #[inline(always)]
    fn splat_f(self, x: f32) -> Self::F {
        unsafe { [_mm256_set1_ps(x); 2] }
    }
    #[inline(always)]
    fn mul(self, a: Self::F, b: Self::F) -> Self::F {
        unsafe { both!(_mm256_mul_ps, a, b) }
    }
    #[inline(always)]
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        unsafe {
            [
                _mm256_fmadd_ps(a[0], b[0], c[0]),
                _mm256_fmadd_ps(a[1], b[1], c[1]),
            ]
        }
    }
    #[inline(always)]
    fn fms(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        unsafe {
            [
                _mm256_fmsub_ps(a[0], b[0], c[0]),
                _mm256_fmsub_ps(a[1], b[1], c[1]),
            ]
        }
    }
    #[inline(always)]
    fn lanes(self, a: Self::F) -> [f32; LANES] {
        // SAFETY: two __m256 are 16 f32 in lane order.
        unsafe { std::mem::transmute::<[__m256; 2], [f32; LANES]>(a) }
    }
    #[inline(always)]
    fn load_f(self, v: [f32; LANES]) -> Self::F {
        unsafe {
            [
                _mm256_loadu_ps(v.as_ptr()),
                _mm256_loadu_ps(v.as_ptr().add(8)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn store_w(self, w: Self::W, p: *mut u8) {
        unsafe {
            _mm256_storeu_si256(p.cast(), w[0]);
            _mm256_storeu_si256(p.add(32).cast(), w[1]);
        }
    }
    #[inline(always)]
    unsafe fn store_fp(self, f: Self::F, p: *mut u8) {
        unsafe {
            _mm256_storeu_ps(p.cast(), f[0]);
            _mm256_storeu_ps(p.add(32).cast(), f[1]);
        }
    }
    #[inline(always)]
    unsafe fn load_fp(self, p: *const u8) -> Self::F {
        unsafe { [_mm256_loadu_ps(p.cast()), _mm256_loadu_ps(p.add(32).cast())] }
    }
    #[inline(always)]
    fn prefetch(self, p: *const u8) {
        crate::simd::prefetch_l2(p);
    }
    #[inline(always)]
    fn prefetch_once(self, p: *const u8) {
        crate::simd::prefetch_once(p);
    }
}

/// The `vgf2p8affineqb` matrix (broadcast to every qword) that moves bits `from..from + width` of a byte to bits
/// `4..4 + width` and clears the others: row `7 − o` (byte `7 − o` of the qword) selects the input bit of output
/// bit `o`.
#[inline(always)]
fn lift_matrix(from: u32, width: u32) -> __m512i {
    let mut a = 0u64;
    for i in 0..width {
        a |= (1u64 << (from + i)) << (8 * (3 - i));
    }
    // SAFETY: the token's target features include AVX-512F (every caller holds one).
    unsafe { _mm512_set1_epi64(a as i64) }
}
