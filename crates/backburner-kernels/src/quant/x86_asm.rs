//! Hand-written asm blocks of the x86-64 [`QIsa`](super::isa::QIsa) instances ([`super::x86`]): the 4-row integer sums
//! of the many-row path on AVX2, where compiled intrinsics spilled, and the ordered loads of a Q8_0 unit on AVX-512,
//! whose order the compiler would otherwise choose.

use std::arch::asm;
use std::arch::x86_64::*;

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

/// `vpbroadcastd` of a row's 4 inputs at `[$xr + $x]` into `{xa}`.
macro_rules! broadcast_x {
    ($xr:literal, $x:literal) => {
        concat!("vpbroadcastd {xa}, dword ptr [", $xr, " + ", $x, "]\n")
    };
}

/// One row of a `signed` group: the input with the code's sign (`vpsignb`), `vpmaddubsw` against `|v|` (pair sums
/// within ±32512), `vpmaddwd` by ones to i32, added to the row's accumulators `$s0`, `$s1`.
macro_rules! signed_row {
    ($xr:literal, $s0:literal, $s1:literal, $x:literal) => {
        concat!(
            broadcast_x!($xr, $x),
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
            broadcast_x!($xr, $x),
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

/// [`QIsa::quad_sums`](super::isa::QIsa::quad_sums) of offset-128 codes on AVX2: per group, `|v|` once for the four
/// rows, then per row and half `vpsignb` (the input with the code's sign), `vpmaddubsw` (pair sums within ±32512: no
/// saturation), `vpmaddwd` by ones (i32) and the add: the [`Avx2`](super::x86::Avx2) `dot_s` and `widen` steps. One asm
/// block with a fixed assignment of all 16 ymm registers: compiled from intrinsics (2 rows), the code loads were
/// hoisted ahead of their use and spilled, and 4 rows did not fit; here 4 rows share each code load and `vpabsb` (a
/// fifth fewer instructions per row than 2 rows).
///
/// # Safety
/// The CPU must support AVX2; `codes` must be valid for reading 512 bytes and each `x[r]` for reading 32.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn signed_quad_avx2(codes: *const u8, x: [*const u8; 4]) -> [[__m256i; 2]; 4] {
    quad_asm!(codes, x, signed, "", [w0, w1, m0, m1, xa, t0, t1])
}

/// [`QIsa::quad_sums`](super::isa::QIsa::quad_sums) of unsigned codes `≤ 16` on AVX2: per group and row, `vpmaddubsw`
/// of the codes against the broadcast inputs and a `vpaddw` into i16 pair sums — 8 steps of at most `2·16·127` each
/// stay within `±32512` — then one `vpmaddwd` by ones to i32: the [`Avx2`](super::x86::Avx2) `dot_u` and `widen` steps
/// for codes `≤ 16`. One asm block, 14 ymm registers, for the reasons of [`signed_quad_avx2`].
///
/// # Safety
/// The CPU must support AVX2; `codes` must be valid for reading 512 bytes of codes `≤ 16` and each `x[r]` for
/// reading 32.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn small_quad_avx2(codes: *const u8, x: [*const u8; 4]) -> [[__m256i; 2]; 4] {
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

/// The eight 64-byte vectors at `p`, `p + 64`, …, `p + 448`, loaded in that order (one asm block, so the compiler
/// cannot interleave or reorder them), and `p` passed through the block (see [`QIsa::load8_w`](super::isa::QIsa::load8_w)).
///
/// # Safety
/// The CPU must support AVX-512F; `p` must be valid for reading 512 bytes.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn load8_avx512(mut p: *const u8) -> ([__m512i; 8], *const u8) {
    let (a, b, c, d, e, f, g, h): (
        __m512i,
        __m512i,
        __m512i,
        __m512i,
        __m512i,
        __m512i,
        __m512i,
        __m512i,
    );
    // SAFETY: eight unaligned loads inside the 512 bytes the caller vouches for; no stack, no flags touched.
    unsafe {
        asm!(
            "vmovdqu64 {a}, zmmword ptr [{p}]",
            "vmovdqu64 {b}, zmmword ptr [{p} + 64]",
            "vmovdqu64 {c}, zmmword ptr [{p} + 128]",
            "vmovdqu64 {d}, zmmword ptr [{p} + 192]",
            "vmovdqu64 {e}, zmmword ptr [{p} + 256]",
            "vmovdqu64 {f}, zmmword ptr [{p} + 320]",
            "vmovdqu64 {g}, zmmword ptr [{p} + 384]",
            "vmovdqu64 {h}, zmmword ptr [{p} + 448]",
            p = inout(reg) p,
            a = out(zmm_reg) a, b = out(zmm_reg) b, c = out(zmm_reg) c, d = out(zmm_reg) d,
            e = out(zmm_reg) e, f = out(zmm_reg) f, g = out(zmm_reg) g, h = out(zmm_reg) h,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    ([a, b, c, d, e, f, g, h], p)
}
