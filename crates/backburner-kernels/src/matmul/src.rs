//! Where the micro-kernels read weight panels from: the packed matrix in its dtype (f32, bf16 or f16, widened in
//! registers) or an f32 block widened once into an L2-resident buffer.

use super::PANEL;
use crate::simd::Isa;

/// Widens panels `g0..g1`, inputs `k0..k0 + kc` of `src` into `buf` as `[g1 - g0][kc][16]` f32; returns the block
/// as a source whose panel 0 is `g0`.
#[inline(always)]
pub(super) fn widen_block<I: Isa, S: Src>(
    isa: I,
    src: S,
    buf: &mut Vec<f32>,
    g0: usize,
    g1: usize,
    k0: usize,
    kc: usize,
) -> F32Src {
    if let Some(direct) = src.as_f32(g0, k0) {
        return direct;
    }
    let len = (g1 - g0) * kc * PANEL;
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    for p in g0..g1 {
        let dst = &mut buf[(p - g0) * kc * PANEL..(p - g0 + 1) * kc * PANEL];
        for (kk, d) in dst.chunks_exact_mut(PANEL).enumerate() {
            // SAFETY: panel p < the storage's panels, input k0 + kk < k.
            isa.store(unsafe { src.load(isa, p, k0 + kk) }, d);
        }
    }
    F32Src {
        base: buf.as_ptr(),
        stride: kc * PANEL,
    }
}

/// Panels of `B` in some dtype: element `(panel p, input kk, lane l)` at `base + p·stride + kk·16 + l`.
pub(super) trait Src: Copy {
    /// The 16 lanes of panel `p`, input `kk`, as f32.
    ///
    /// # Safety
    /// `p·stride + kk·16 + 16` must be within the storage.
    unsafe fn load<I: Isa>(self, isa: I, p: usize, kk: usize) -> I::V;
    /// The same panels as an f32 source starting at panel `p0`, input `k0`, if the storage is f32.
    fn as_f32(self, p0: usize, k0: usize) -> Option<F32Src>;
}

#[derive(Clone, Copy)]
pub(super) struct F32Src {
    pub(super) base: *const f32,
    pub(super) stride: usize,
}

impl Src for F32Src {
    #[inline(always)]
    unsafe fn load<I: Isa>(self, isa: I, p: usize, kk: usize) -> I::V {
        // SAFETY: forwarded from the caller.
        unsafe { isa.load_ptr(self.base.add(p * self.stride + kk * PANEL)) }
    }

    #[inline(always)]
    fn as_f32(self, p0: usize, k0: usize) -> Option<F32Src> {
        Some(F32Src {
            // SAFETY: panel p0 / input k0 lie inside the storage (the caller's block is within it).
            base: unsafe { self.base.add(p0 * self.stride + k0 * PANEL) },
            stride: self.stride,
        })
    }
}

#[derive(Clone, Copy)]
pub(super) struct Bf16Src {
    pub(super) base: *const u16,
    pub(super) stride: usize,
}

impl Src for Bf16Src {
    #[inline(always)]
    unsafe fn load<I: Isa>(self, isa: I, p: usize, kk: usize) -> I::V {
        // SAFETY: forwarded from the caller.
        unsafe { isa.load_bf16(self.base.add(p * self.stride + kk * PANEL)) }
    }

    #[inline(always)]
    fn as_f32(self, _: usize, _: usize) -> Option<F32Src> {
        None
    }
}

#[derive(Clone, Copy)]
pub(super) struct F16Src {
    pub(super) base: *const u16,
    pub(super) stride: usize,
}

impl Src for F16Src {
    #[inline(always)]
    unsafe fn load<I: Isa>(self, isa: I, p: usize, kk: usize) -> I::V {
        // SAFETY: forwarded from the caller.
        unsafe { isa.load_f16(self.base.add(p * self.stride + kk * PANEL)) }
    }

    #[inline(always)]
    fn as_f32(self, _: usize, _: usize) -> Option<F32Src> {
        None
    }
}
