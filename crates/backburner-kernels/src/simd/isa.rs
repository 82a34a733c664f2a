//! The 16-lane vector abstraction ([`Isa`]), the register-blocked products built on it, and kernel dispatch.
//!
//! LLVM does not reliably vectorize register-blocked dot products (`R` rows × `C` columns of 16-lane
//! accumulators) from plain Rust, so the lanes are explicit: an [`Isa`] is a zero-sized token whose
//! existence proves the CPU supports its instructions, and whose [`Isa::V`] holds 16 f32 lanes (one
//! `__m512`, two `__m256`, four NEON registers — see `arch.rs` — or a plain array here). Lane `l` means the
//! same thing in every implementation and every product is an exactly specified fused multiply-add, so [`dots`]
//! gives the same bits on all of them.

#[cfg(target_arch = "aarch64")]
use super::arch::Neon;
#[cfg(target_arch = "x86_64")]
use super::arch::{Avx2, Avx512};
use super::{reduce_lanes, LANES};

/// A vector instruction set: 16 f32 lanes with load, multiply-then-add and extraction.
pub(crate) trait Isa: Copy {
    /// 16 f32 lanes.
    type V: Copy;
    /// All lanes 0.
    fn zero(self) -> Self::V;
    /// Lanes from `s[..16]`; panics if `s.len() < 16`.
    fn load(self, s: &[f32]) -> Self::V;
    /// Every lane `x`.
    fn splat(self, x: f32) -> Self::V;
    /// Writes the lanes to `s[..16]`; panics if `s.len() < 16`.
    fn store(self, v: Self::V, s: &mut [f32]);
    /// The lanes as an array, lane 0 first.
    fn lanes(self, v: Self::V) -> [f32; LANES];
    /// `acc + a·b` lane-wise with a single rounding (fused multiply-add, IEEE 754 `fusedMultiplyAdd`): the
    /// same bits on every implementation, since the operation is exactly specified.
    fn fma(self, acc: Self::V, a: Self::V, b: Self::V) -> Self::V;
    /// Lanes from 16 bfloat16 bit patterns at `p` (exact: a bf16 is the top half of an f32).
    ///
    /// # Safety
    /// `p` must be valid for reading 16 `u16`s (no alignment needed).
    unsafe fn load_bf16(self, p: *const u16) -> Self::V;
    /// Lanes from 16 IEEE binary16 bit patterns at `p` (exact conversion).
    ///
    /// # Safety
    /// `p` must be valid for reading 16 `u16`s (no alignment needed).
    unsafe fn load_f16(self, p: *const u16) -> Self::V;
    /// Lanes from 16 f32 at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 `f32`s (no alignment needed).
    unsafe fn load_ptr(self, p: *const f32) -> Self::V;
    /// Writes the lanes to 16 f32 at `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing 16 `f32`s (no alignment needed).
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32);
    /// Whether the instruction set has 32 registers of 16 lanes (AVX-512): kernels then use larger register tiles.
    const WIDE: bool = false;
    /// [`reduce_lanes`] of the lanes (the same order of additions).
    #[inline(always)]
    fn reduce(self, v: Self::V) -> f32 {
        reduce_lanes(self.lanes(v))
    }
}

/// Plain Rust lanes (any CPU).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

impl Isa for Scalar {
    type V = [f32; LANES];

    #[inline(always)]
    fn zero(self) -> Self::V {
        [0.0; LANES]
    }

    #[inline(always)]
    fn load(self, s: &[f32]) -> Self::V {
        s[..LANES].try_into().expect("16 lanes")
    }

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        [x; LANES]
    }

    #[inline(always)]
    fn store(self, v: Self::V, s: &mut [f32]) {
        s[..LANES].copy_from_slice(&v);
    }

    #[inline(always)]
    fn lanes(self, v: Self::V) -> [f32; LANES] {
        v
    }

    #[inline(always)]
    fn fma(self, mut acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l], acc[l]);
        }
        acc
    }

    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u16) -> Self::V {
        let mut v = [0.0f32; LANES];
        for (l, x) in v.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 16 readable u16s at p.
            *x = f32::from_bits(u32::from(unsafe { p.add(l).read_unaligned() }) << 16);
        }
        v
    }

    #[inline(always)]
    unsafe fn load_f16(self, p: *const u16) -> Self::V {
        // SAFETY: forwarded from the caller.
        unsafe { super::f16x16_to_f32(p) }
    }

    #[inline(always)]
    unsafe fn load_ptr(self, p: *const f32) -> Self::V {
        // SAFETY: the caller guarantees 16 readable f32s at p.
        unsafe { p.cast::<[f32; LANES]>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32s at p.
        unsafe { p.cast::<[f32; LANES]>().write_unaligned(v) }
    }
}

/// All `R × C` dot products `a[r]·b[c]`, sharing every load across the others (register blocking).
///
/// Product `(r, c)` is accumulated in 16 lanes by fused multiply-adds (lane `l` takes the indices `≡ l` mod 16 in
/// increasing order, the tail `n mod 16` going to lanes `0..`) and the lanes are tree-reduced by [`reduce_lanes`],
/// so every entry has the bits of `dot(a[r], b[c])` whatever `R`, `C` and the [`Isa`].
///
/// Panics if the slices do not all have the same length.
#[inline(always)]
pub(crate) fn dots<I: Isa, const R: usize, const C: usize>(
    isa: I,
    a: [&[f32]; R],
    b: [&[f32]; C],
) -> [[f32; C]; R] {
    let n = if R > 0 { a[0].len() } else { 0 };
    assert!(
        a.iter().all(|x| x.len() == n) && b.iter().all(|x| x.len() == n),
        "dots: slices of different lengths"
    );
    let mut acc = [[isa.zero(); C]; R];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        let mut bv = [isa.zero(); C];
        for c in 0..C {
            bv[c] = isa.load(&b[c][i..]);
        }
        for r in 0..R {
            let av = isa.load(&a[r][i..]);
            for c in 0..C {
                acc[r][c] = isa.fma(acc[r][c], av, bv[c]);
            }
        }
        i += LANES;
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = if full == n {
                isa.reduce(acc[r][c])
            } else {
                let mut lanes = isa.lanes(acc[r][c]);
                for l in 0..n - full {
                    lanes[l] = a[r][full + l].mul_add(b[c][full + l], lanes[l]);
                }
                reduce_lanes(lanes)
            };
        }
    }
    out
}

/// `Σ a[i]·b[i]` in the lane structure of [`dots`] (the same bits on every [`Isa`]).
///
/// Panics if the lengths differ.
#[inline(always)]
pub(crate) fn dot<I: Isa>(isa: I, a: &[f32], b: &[f32]) -> f32 {
    dots::<I, 1, 1>(isa, [a], [b])[0][0]
}

/// A unit of kernel work that [`dispatch`] compiles once per [`Isa`]. Implement `run` with
/// `#[inline(always)]` and keep its hot helpers `#[inline(always)]`, so that the body is inlined into, and
/// compiled for, each `#[target_feature]` entry point (element-wise loops then use the wide registers
/// too).
pub(crate) trait Kernel {
    /// The result of the work.
    type Out;
    /// Does the work with the vector instructions of `isa`.
    fn run<I: Isa>(self, isa: I) -> Self::Out;
}

/// Runs `k` with the widest vector extension the CPU has: AVX-512F, else AVX2 (with FMA and F16C), else plain
/// Rust on x86-64;
/// NEON on aarch64; plain Rust elsewhere.
///
/// Every path gives bit-identical results (see the module docs).
#[inline]
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    {
        if allowed(2) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { with_avx512(k) };
        }
        if allowed(1)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above).
            return unsafe { with_avx2(k) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if allowed(1) {
            return k.run(Neon(()));
        }
    }
    k.run(Scalar)
}

/// Highest dispatch level tests allow: 3 = AVX-512 VBMI (the quantized kernels only), 2 = AVX-512F, 1 = AVX2 or
/// NEON, 0 = plain Rust (test builds only; lets the crate's tests check that every path gives the same bits on one
/// machine).
#[cfg(test)]
pub(crate) static ISA_CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(ISA_MAX);

/// The highest dispatch level ([`ISA_CAP`]'s value when uncapped).
#[cfg(test)]
pub(crate) const ISA_MAX: u8 = 3;

#[inline(always)]
#[allow(dead_code)]
pub(crate) fn allowed(level: u8) -> bool {
    #[cfg(test)]
    {
        ISA_CAP.load(std::sync::atomic::Ordering::SeqCst) >= level
    }
    #[cfg(not(test))]
    {
        let _ = level;
        true
    }
}

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn with_avx512<K: Kernel>(k: K) -> K::Out {
    k.run(Avx512(()))
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn with_avx2<K: Kernel>(k: K) -> K::Out {
    k.run(Avx2(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<Vec<f32>> {
        (0..6)
            .map(|r| (0..37).map(|i| ((r * 37 + i) as f32 * 0.7).sin()).collect())
            .collect()
    }

    /// `dots::<4, 2>` on `isa`, as bit patterns.
    fn block_bits<I: Isa>(isa: I, x: &[Vec<f32>]) -> Vec<u32> {
        let d = dots::<I, 4, 2>(isa, [&x[0], &x[1], &x[2], &x[3]], [&x[4], &x[5]]);
        d.iter().flatten().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn dots_in_blocks_equal_single_dots() {
        let x = rows();
        let blk = block_bits(Scalar, &x);
        for r in 0..4 {
            for c in 0..2 {
                assert_eq!(blk[r * 2 + c], dot(Scalar, &x[r], &x[4 + c]).to_bits());
            }
        }
        let plain: f32 = x[0].iter().zip(&x[4]).map(|(a, b)| a * b).sum();
        assert!((dot(Scalar, &x[0], &x[4]) - plain).abs() < 1e-5);
    }

    #[test]
    fn dots_give_the_same_bits_on_every_instruction_set() {
        let x = rows();
        let want = block_bits(Scalar, &x);
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                assert_eq!(block_bits(Avx2(()), &x), want);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                assert_eq!(block_bits(Avx512(()), &x), want);
            }
        }
        #[cfg(target_arch = "aarch64")]
        assert_eq!(block_bits(Neon(()), &x), want);
    }

    #[test]
    fn reduce_gives_the_same_bits_on_every_instruction_set() {
        let x: Vec<f32> = (0..16)
            .map(|i| 1.0 + (i as f32 * 1.3).sin() * 1e-3 * (1 << i) as f32)
            .collect();
        let want = Scalar.reduce(Scalar.load(&x)).to_bits();
        assert_eq!(want, reduce_lanes(x[..].try_into().unwrap()).to_bits());
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                let i = Avx2(());
                assert_eq!(i.reduce(i.load(&x)).to_bits(), want);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                let i = Avx512(());
                assert_eq!(i.reduce(i.load(&x)).to_bits(), want);
            }
        }
    }

    #[test]
    fn dispatch_gives_the_same_bits_as_plain_rust() {
        struct Probe<'a>(&'a [Vec<f32>]);
        impl Kernel for Probe<'_> {
            type Out = (Vec<u32>, Vec<u32>);
            #[inline(always)]
            fn run<I: Isa>(self, isa: I) -> Self::Out {
                let e = self.0[0]
                    .iter()
                    .map(|x| super::super::exp_fast(x * 10.0).to_bits());
                (block_bits(isa, self.0), e.collect())
            }
        }
        let x = rows();
        assert_eq!(dispatch(Probe(&x)), Probe(&x).run(Scalar));
    }
}
