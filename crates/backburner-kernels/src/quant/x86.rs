//! [`QIsa`] on x86-64 vector registers: AVX-512 with VNNI (`vpdpbusd`: u8×i8 → i32, four products per lane) and
//! AVX2 (`vpmaddubsw` → i16 pair sums, `vpmaddwd` → i32), with asm blocks for the 4-row tiles of the many-row path
//! (offset-128 codes, and unsigned codes `≤ 16`).
//!
//! The tokens have a field private to `quant`, so only [`qdispatch`](super::isa::qdispatch) (after checking the
//! CPU) creates one; holding a token is the proof that makes its intrinsic calls sound.

use std::arch::asm;
use std::arch::x86_64::*;

use super::isa::{QIsa, LANES};

/// AVX-512F + BW + VNNI lanes (one 512-bit register each).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512Vnni(pub(super) ());

impl QIsa for Avx512Vnni {
    type W = __m512i;
    type A = __m512i;
    type I = __m512i;
    type F = __m512;
    const SIGNED: bool = false;
    const ROWS: usize = 4;

    // SAFETY (every method): the token exists only when the CPU supports AVX-512F, BW and VNNI; pointer
    // arguments are valid as each method's contract requires.

    #[inline(always)]
    unsafe fn load_w(self, p: *const u8) -> Self::W {
        unsafe { _mm512_loadu_si512(p.cast()) }
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
}

/// The body of a 4-row asm kernel: the 8 groups ([`quad_group`]) of kind `$kind` of a 32-block (code vectors at
/// `codes + 64g`, inputs at `x[r] + 4g`), then the `$tail` instructions, with the accumulators `{s00}`..`{s31}`
/// (rows × halves, from zero), `{ones}` (i16 ones) and the scratch ymm registers `$scratch`; evaluates to the
/// accumulators.
macro_rules! quad_asm {
    ($codes:ident, $x:ident, $kind:ident, $tail:expr, [$($scratch:ident),*]) => {{
        let ones = _mm256_set1_epi16(1);
        let mut s = [[_mm256_setzero_si256(); 2]; 4];
        // SAFETY: reads 512 bytes at `codes` and 32 at each row, as the caller guarantees; writes only registers.
        unsafe {
            asm!(
                quad_group!($kind, "0", "32", "0"),
                quad_group!($kind, "64", "96", "4"),
                quad_group!($kind, "128", "160", "8"),
                quad_group!($kind, "192", "224", "12"),
                quad_group!($kind, "256", "288", "16"),
                quad_group!($kind, "320", "352", "20"),
                quad_group!($kind, "384", "416", "24"),
                quad_group!($kind, "448", "480", "28"),
                $tail,
                codes = in(reg) $codes,
                x0 = in(reg) $x[0],
                x1 = in(reg) $x[1],
                x2 = in(reg) $x[2],
                x3 = in(reg) $x[3],
                ones = in(ymm_reg) ones,
                s00 = inout(ymm_reg) s[0][0],
                s01 = inout(ymm_reg) s[0][1],
                s10 = inout(ymm_reg) s[1][0],
                s11 = inout(ymm_reg) s[1][1],
                s20 = inout(ymm_reg) s[2][0],
                s21 = inout(ymm_reg) s[2][1],
                s30 = inout(ymm_reg) s[3][0],
                s31 = inout(ymm_reg) s[3][1],
                $($scratch = out(ymm_reg) _,)*
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        s
    }};
}

/// One group `g` of a 4-row kernel: code vector `g` (bytes `$c0 = 64g`, `$c1 = 64g + 32`) into `{w0}`, `{w1}`, then
/// per row the inputs `$x = 4g..4g + 4` (`signed`: with `|v|` in `{m0}`, `{m1}` once for the 4 rows).
macro_rules! quad_group {
    (signed, $c0:literal, $c1:literal, $x:literal) => {
        concat!(
            quad_group!(load, $c0, $c1),
            "vpabsb {m0}, {w0}\n",
            "vpabsb {m1}, {w1}\n",
            signed_row!("{x0}", "{s00}", "{s01}", $x),
            signed_row!("{x1}", "{s10}", "{s11}", $x),
            signed_row!("{x2}", "{s20}", "{s21}", $x),
            signed_row!("{x3}", "{s30}", "{s31}", $x),
        )
    };
    (small, $c0:literal, $c1:literal, $x:literal) => {
        concat!(
            quad_group!(load, $c0, $c1),
            small_row!("{x0}", "{s00}", "{s01}", $x),
            small_row!("{x1}", "{s10}", "{s11}", $x),
            small_row!("{x2}", "{s20}", "{s21}", $x),
            small_row!("{x3}", "{s30}", "{s31}", $x),
        )
    };
    (load, $c0:literal, $c1:literal) => {
        concat!(
            "vmovdqu {w0}, ymmword ptr [{codes} + ",
            $c0,
            "]\n",
            "vmovdqu {w1}, ymmword ptr [{codes} + ",
            $c1,
            "]\n",
        )
    };
}

/// One row of a `signed` group: the input with the code's sign (`vpsignb`), `vpmaddubsw` against `|v|` (pair sums
/// within ±32512), `vpmaddwd` by ones to i32, added to the row's accumulators `$s0`, `$s1`.
macro_rules! signed_row {
    ($xr:literal, $s0:literal, $s1:literal, $x:literal) => {
        concat!(
            "vpbroadcastd {xa}, dword ptr [",
            $xr,
            " + ",
            $x,
            "]\n",
            "vpsignb {t0}, {xa}, {w0}\n",
            "vpsignb {t1}, {xa}, {w1}\n",
            "vpmaddubsw {t0}, {m0}, {t0}\n",
            "vpmaddubsw {t1}, {m1}, {t1}\n",
            "vpmaddwd {t0}, {t0}, {ones}\n",
            "vpmaddwd {t1}, {t1}, {ones}\n",
            "vpaddd ",
            $s0,
            ", ",
            $s0,
            ", {t0}\n",
            "vpaddd ",
            $s1,
            ", ",
            $s1,
            ", {t1}\n",
        )
    };
}

/// One row of a `small` group: `vpmaddubsw` of the codes against the input, added in i16 to `$s0`, `$s1`.
macro_rules! small_row {
    ($xr:literal, $s0:literal, $s1:literal, $x:literal) => {
        concat!(
            "vpbroadcastd {xa}, dword ptr [",
            $xr,
            " + ",
            $x,
            "]\n",
            "vpmaddubsw {t0}, {w0}, {xa}\n",
            "vpmaddubsw {t1}, {w1}, {xa}\n",
            "vpaddw ",
            $s0,
            ", ",
            $s0,
            ", {t0}\n",
            "vpaddw ",
            $s1,
            ", ",
            $s1,
            ", {t1}\n",
        )
    };
}

/// [`QIsa::quad_sums`] of offset-128 codes on AVX2: per group, `|v|` once for the four rows, then per row and half
/// `vpsignb` (the input with the code's sign), `vpmaddubsw` (pair sums within ±32512: no saturation), `vpmaddwd` by
/// ones (i32) and the add: the [`Avx2`] `dot_s` and `widen` steps. One asm block with a fixed assignment of all 16
/// ymm registers: compiled from intrinsics (2 rows), the code loads were hoisted ahead of their use and spilled, and
/// 4 rows did not
/// fit; here 4 rows share each code load and `vpabsb` (a fifth fewer instructions per row than 2 rows).
///
/// # Safety
/// The CPU must support AVX2; `codes` must be valid for reading 512 bytes and each `x[r]` for reading 32.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn signed_quad_avx2(codes: *const u8, x: [*const u8; 4]) -> [[__m256i; 2]; 4] {
    quad_asm!(codes, x, signed, "", [w0, w1, m0, m1, xa, t0, t1])
}

/// [`QIsa::quad_sums`] of unsigned codes `≤ 16` on AVX2: per group and row, `vpmaddubsw` of the codes against the
/// broadcast inputs and a `vpaddw` into i16 pair sums — 8 steps of at most `2·16·127` each stay within `±32512` —
/// then one `vpmaddwd` by ones to i32: the [`Avx2`] `dot_u` and `widen` steps for codes `≤ 16`. One asm block, 14
/// ymm registers, for the reasons of [`signed_quad_avx2`].
///
/// # Safety
/// The CPU must support AVX2; `codes` must be valid for reading 512 bytes of codes `≤ 16` and each `x[r]` for
/// reading 32.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn small_quad_avx2(codes: *const u8, x: [*const u8; 4]) -> [[__m256i; 2]; 4] {
    // After the 8 groups: the i16 pair sums to i32.
    quad_asm!(
        codes,
        x,
        small,
        concat!(
            "vpmaddwd {s00}, {s00}, {ones}\n",
            "vpmaddwd {s01}, {s01}, {ones}\n",
            "vpmaddwd {s10}, {s10}, {ones}\n",
            "vpmaddwd {s11}, {s11}, {ones}\n",
            "vpmaddwd {s20}, {s20}, {ones}\n",
            "vpmaddwd {s21}, {s21}, {ones}\n",
            "vpmaddwd {s30}, {s30}, {ones}\n",
            "vpmaddwd {s31}, {s31}, {ones}\n",
        ),
        [w0, w1, xa, t0, t1]
    )
}
