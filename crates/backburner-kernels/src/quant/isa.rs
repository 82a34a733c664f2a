//! The integer-dot vector abstraction of the quantized kernels ([`QIsa`]), its plain-Rust implementation and the
//! dispatch to the best one the CPU has (AVX-512 VNNI with or without VBMI and GFNI, AVX2 — in `x86.rs` — or
//! plain Rust).
//!
//! A [`QIsa::W`] is 64 bytes of codes read as 16 lanes of 4 bytes (lane `l` = output row `l` of a panel, its 4
//! bytes = 4 consecutive inputs); [`QIsa::dot_u`] adds, per lane, the dot product of those 4 unsigned codes with 4
//! signed activation bytes. Every integer operation is exact (the implementations differ only in how they reach
//! the exact sum, see [`QIsa::widen_every`]) and the float operations are IEEE 754 multiplications and fused
//! multiply-adds, so all implementations give the same bits.

/// Lanes of every vector (outputs of one panel).
pub(crate) const LANES: usize = 16;

/// An integer-dot instruction set.
pub(crate) trait QIsa: Copy {
    /// 64 code bytes (16 lanes × 4).
    type W: Copy;
    /// A dot-product accumulator (16 lanes; i16 pairs on AVX2, i32 elsewhere).
    type A: Copy;
    /// 16 i32 lanes.
    type I: Copy;
    /// 16 f32 lanes.
    type F: Copy;
    /// Whether the codes of the offset-128 formats (Q8_0, IQ4_XS) go to [`QIsa::dot_s`] as signed values (`true`:
    /// the sum is `Σ v·x`) or as unsigned `v + 128` (`false`: the sum is `Σ (v + 128)·x`, corrected by the caller).
    const SIGNED: bool;
    /// Rows of a register tile (the decode path takes `m` rows in tiles of at most this many).
    const ROWS: usize;
    /// Most rows of a *wide* register tile, for the formats with [`Fmt::WIDE_TILES`]: products of up to
    /// [`QIsa::FEW_ROWS`] rows (a verify step of speculative decoding) stream each panel once from memory in tiles of
    /// up to this many rows (at most 8), the codes unpacked once per tile. The default: [`QIsa::ROWS`] (no wide
    /// tiles).
    ///
    /// [`Fmt::WIDE_TILES`]: super::fmt::Fmt::WIDE_TILES
    const WIDE_ROWS: usize = Self::ROWS;
    /// Most rows a product of a [`Fmt::WIDE_TILES`] format runs on the few-row (streaming) path; more go through the
    /// many-row path (cache blocks decoded into a buffer). The default: [`QIsa::ROWS`].
    ///
    /// [`Fmt::WIDE_TILES`]: super::fmt::Fmt::WIDE_TILES
    const FEW_ROWS: usize = Self::ROWS;

    /// 64 bytes at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading 64 bytes (no alignment needed).
    unsafe fn load_w(self, p: *const u8) -> Self::W;
    /// Whether [`QIsa::load8_w`] reads in address order (and so [`Prefetch::OneLine`] suits Q8_0).
    ///
    /// [`Prefetch::OneLine`]: super::fmt::Prefetch::OneLine
    const ORDERED_LOAD8: bool = false;
    /// A Q8_0 unit's eight code vectors as [`QIsa::load8_w`] leaves them: the vectors themselves where
    /// [`QIsa::ORDERED_LOAD8`], else their address, each vector then loaded where [`QIsa::pick8`] is called (held in
    /// an array instead, AVX2's 8 × two ymm registers would be spilled to the stack).
    type Codes8: Copy;
    /// The eight 64-byte vectors at `p`, `p + 64`, …, `p + 448` (a Q8_0 unit's codes), and `p` again. Where
    /// [`QIsa::ORDERED_LOAD8`] (AVX-512: one asm block), the loads run here, in address order, and the returned
    /// address is a value the compiler only knows after them, so that what is read through it next (the unit's
    /// scales) cannot be moved ahead: the unit is then read line by line upwards, which the hardware stream
    /// prefetcher follows. Elsewhere nothing is read yet, and `p` itself is returned.
    ///
    /// # Safety
    /// `p` must be valid for reading 512 bytes (no alignment needed), and stay so while the result is used.
    unsafe fn load8_w(self, p: *const u8) -> (Self::Codes8, *const u8);
    /// Vector `i < 8` of [`QIsa::load8_w`]'s result.
    ///
    /// # Safety
    /// `c` comes from [`QIsa::load8_w`] under its contract; `i < 8`.
    unsafe fn pick8(self, c: Self::Codes8, i: usize) -> Self::W;
    /// Every byte `b`.
    fn splat_w(self, b: u8) -> Self::W;
    /// Bitwise and.
    fn and_w(self, a: Self::W, b: Self::W) -> Self::W;
    /// Bitwise or.
    fn or_w(self, a: Self::W, b: Self::W) -> Self::W;
    /// Bitwise xor.
    fn xor_w(self, a: Self::W, b: Self::W) -> Self::W;
    /// Each 16-bit lane shifted left by `n < 16` (callers mask the bits that cross a byte).
    fn shl16(self, a: Self::W, n: u32) -> Self::W;
    /// Each 16-bit lane shifted right (logical) by `n < 16`.
    fn shr16(self, a: Self::W, n: u32) -> Self::W;
    /// Each byte `i` (in `0..16`) replaced by `table[i]`.
    fn lut16(self, table: [u8; 16], idx: Self::W) -> Self::W;
    /// The 64 bytes at `p` split into their low and high nibbles (as [`QIsa::W`]s of values `0..16`, byte for byte),
    /// each then replaced by `table[nibble]`: (low, high). The default: masks, a shift and [`QIsa::lut16`].
    ///
    /// # Safety
    /// `p` must be valid for reading 64 bytes (no alignment needed).
    #[inline(always)]
    unsafe fn nibble_lut(self, table: [u8; 16], p: *const u8) -> (Self::W, Self::W) {
        // SAFETY: forwarded from the caller.
        unsafe { masked_nibble_lut(self, table, p) }
    }

    /// The 64 bytes at `p` split into their nibbles with high bits added from two planes: (low, high) =
    /// `(nib_lo | ((planes.0 >> from.0) & m) << 4, nib_hi | ((planes.1 >> from.1) & m) << 4)` per byte, with
    /// `m = 2^width − 1` (Q5_K: `width` 1, Q6_K: 2; `from + width ≤ 8`). The default: masks, word shifts and ors
    /// ([`to_bit4`](super::fmt::to_bit4)).
    ///
    /// # Safety
    /// `p` must be valid for reading 64 bytes (no alignment needed).
    #[inline(always)]
    unsafe fn nibbles_high(
        self,
        p: *const u8,
        planes: (Self::W, Self::W),
        from: (u32, u32),
        width: u32,
    ) -> (Self::W, Self::W) {
        // SAFETY: forwarded from the caller.
        unsafe { nibbles_high_masked(self, p, planes, from, width) }
    }

    /// An accumulator of zeros.
    fn a_zero(self) -> Self::A;
    /// `a + Σ_t w[4l + t]·x_t` per lane `l`, with unsigned codes `w ≤ 63` and `x_t` the signed bytes of `x4`
    /// (little-endian, each in `-127..=127`).
    fn dot_u(self, a: Self::A, w: Self::W, x4: i32) -> Self::A;
    /// As [`QIsa::dot_u`] for offset-128 codes, given as [`QIsa::SIGNED`] says.
    fn dot_s(self, a: Self::A, w: Self::W, x4: i32) -> Self::A;
    /// How many `dot_*` calls with codes of magnitude `≤ cmax` an accumulator takes before [`QIsa::widen`] (at
    /// least 1): the AVX2 accumulator holds i16 pair sums that must not overflow.
    fn widen_every(self, cmax: u32) -> usize;
    /// `s` plus the accumulator's lanes as i32.
    fn widen(self, a: Self::A, s: Self::I) -> Self::I;

    /// Whether the many-row path runs 4-row tiles through [`QIsa::quad_sums`] (for offset-128 formats and those with
    /// unsigned codes `≤ 16`; AVX2: hand-scheduled asm; plain Rust: the default, to test those tiles everywhere).
    const QUAD: bool = false;
    /// The exact sums `Σ_t code_t·x_r[t]` of four rows `r` over one 32-block: the block's 8 code vectors at `codes`
    /// (group `g`, inputs `4g..4g + 4`, at byte `64·g`), row `r`'s 32 quantized inputs at `x[r]`. Offset-128 codes
    /// (`OFFSET_128`, given as [`QIsa::SIGNED`] says) or unsigned codes `≤ 16`. The default: [`QIsa::dot_s`] or
    /// [`QIsa::dot_u`], widened after every step.
    ///
    /// # Safety
    /// `codes` must be valid for reading 512 bytes (unsigned codes `≤ 16` unless `OFFSET_128`) and each `x[r]` for
    /// reading 32.
    #[inline(always)]
    unsafe fn quad_sums<const OFFSET_128: bool>(
        self,
        codes: *const u8,
        x: [*const u8; 4],
    ) -> [Self::I; 4] {
        let mut s = [self.i_zero(); 4];
        for g in 0..8 {
            // SAFETY: code vector g and inputs 4g..4g + 4 lie in the caller's ranges.
            let w = unsafe { self.load_w(codes.add(64 * g)) };
            for r in 0..4 {
                // SAFETY: as above.
                let x4 = unsafe { x[r].add(4 * g).cast::<i32>().read_unaligned() };
                let a = if OFFSET_128 {
                    self.dot_s(self.a_zero(), w, x4)
                } else {
                    self.dot_u(self.a_zero(), w, x4)
                };
                s[r] = self.widen(a, s[r]);
            }
        }
        s
    }
    /// 16 zeros.
    fn i_zero(self) -> Self::I;
    /// Lane-wise `a + b`.
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I;
    /// Lane-wise `a − v`.
    fn sub_splat_i(self, a: Self::I, v: i32) -> Self::I;
    /// The lanes as f32 (round to nearest even; exact below `2^24`).
    fn cvt(self, a: Self::I) -> Self::F;

    /// 16 IEEE binary16 values at `p`, widened exactly.
    ///
    /// # Safety
    /// `p` must be valid for reading 32 bytes.
    unsafe fn load_f16(self, p: *const u8) -> Self::F;
    /// 16 unsigned bytes at `p` as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 bytes.
    unsafe fn load_u8f(self, p: *const u8) -> Self::F;
    /// 16 signed bytes at `p` as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 bytes.
    unsafe fn load_i8f(self, p: *const u8) -> Self::F;
    /// 16 zeros.
    fn f_zero(self) -> Self::F;
    /// Every lane `x`.
    fn splat_f(self, x: f32) -> Self::F;
    /// Lane-wise `a·b` (one rounding).
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    /// Lane-wise `a·b + c` with one rounding.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Lane-wise `a·b − c` with one rounding (`fma(a, b, −c)`).
    fn fms(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// The lanes, lane 0 first.
    fn lanes(self, a: Self::F) -> [f32; LANES];
    /// Lanes from an array, lane 0 first.
    fn load_f(self, v: [f32; LANES]) -> Self::F;
    /// Writes the 64 bytes of `w` to `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing 64 bytes (no alignment needed).
    unsafe fn store_w(self, w: Self::W, p: *mut u8);
    /// Writes the 16 f32 lanes of `f` to `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing 64 bytes (no alignment needed).
    unsafe fn store_fp(self, f: Self::F, p: *mut u8);
    /// 16 f32 lanes from `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading 64 bytes (no alignment needed).
    unsafe fn load_fp(self, p: *const u8) -> Self::F;
    /// A hint to bring the cache line at `p` into L2, ahead of a sequential stream (any address: never dereferenced,
    /// never faults; see [`crate::simd::prefetch_l2`]).
    fn prefetch(self, p: *const u8);
    /// A hint to bring the cache line at `p` close to the core for one use ([`crate::simd::prefetch_once`]):
    /// [`Prefetch::Near`](super::fmt::Prefetch::Near)'s.
    fn prefetch_once(self, p: *const u8) {
        self.prefetch(p);
    }
}

/// Plain Rust lanes (any CPU), with the unsigned semantics of VNNI (`SIGNED = false`), so that the offset
/// corrections the AVX-512 path relies on are exercised on every machine; it also takes the 4-row tiles AVX2 runs in
/// asm ([`QIsa::quad_sums`]'s default).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

/// [`QIsa::Codes8`] as the unit's address, for ISAs without ordered loads: [`QIsa::load8_w`] reads nothing and
/// [`QIsa::pick8`] loads each vector where it is used.
macro_rules! codes8_by_address {
    () => {
        type Codes8 = *const u8;
        #[inline(always)]
        unsafe fn load8_w(self, p: *const u8) -> (*const u8, *const u8) {
            (p, p)
        }
        #[inline(always)]
        unsafe fn pick8(self, c: *const u8, i: usize) -> Self::W {
            // SAFETY: vector i < 8 lies in the 512 bytes at c (the caller's promise).
            unsafe { self.load_w(c.add(64 * i)) }
        }
    };
}
pub(super) use codes8_by_address;

impl QIsa for Scalar {
    type W = [u8; 64];
    type A = [i32; LANES];
    type I = [i32; LANES];
    type F = [f32; LANES];
    const SIGNED: bool = false;
    const ROWS: usize = 2;
    /// The default [`QIsa::quad_sums`] (plain loops), so that the 4-row tiles AVX2 runs in asm are exercised on
    /// every machine.
    const QUAD: bool = true;

    codes8_by_address!();
    #[inline(always)]
    unsafe fn load_w(self, p: *const u8) -> Self::W {
        // SAFETY: the caller guarantees 64 readable bytes.
        unsafe { p.cast::<[u8; 64]>().read_unaligned() }
    }
    #[inline(always)]
    fn splat_w(self, b: u8) -> Self::W {
        [b; 64]
    }
    #[inline(always)]
    fn and_w(self, a: Self::W, b: Self::W) -> Self::W {
        std::array::from_fn(|i| a[i] & b[i])
    }
    #[inline(always)]
    fn or_w(self, a: Self::W, b: Self::W) -> Self::W {
        std::array::from_fn(|i| a[i] | b[i])
    }
    #[inline(always)]
    fn xor_w(self, a: Self::W, b: Self::W) -> Self::W {
        std::array::from_fn(|i| a[i] ^ b[i])
    }
    #[inline(always)]
    fn shl16(self, a: Self::W, n: u32) -> Self::W {
        map16(a, |v| v << n)
    }
    #[inline(always)]
    fn shr16(self, a: Self::W, n: u32) -> Self::W {
        map16(a, |v| v >> n)
    }
    #[inline(always)]
    fn lut16(self, table: [u8; 16], idx: Self::W) -> Self::W {
        std::array::from_fn(|i| table[usize::from(idx[i] & 0xF)])
    }
    #[inline(always)]
    fn a_zero(self) -> Self::A {
        [0; LANES]
    }
    #[inline(always)]
    fn dot_u(self, mut a: Self::A, w: Self::W, x4: i32) -> Self::A {
        let x = x4.to_le_bytes().map(|b| i32::from(b as i8));
        for (l, acc) in a.iter_mut().enumerate() {
            for (t, xt) in x.iter().enumerate() {
                *acc += i32::from(w[4 * l + t]) * xt;
            }
        }
        a
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
        self.add_i(a, s)
    }
    #[inline(always)]
    fn i_zero(self) -> Self::I {
        [0; LANES]
    }
    #[inline(always)]
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    fn sub_splat_i(self, a: Self::I, v: i32) -> Self::I {
        a.map(|x| x - v)
    }
    #[inline(always)]
    fn cvt(self, a: Self::I) -> Self::F {
        a.map(|x| x as f32)
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> Self::F {
        // SAFETY: the caller guarantees 32 readable bytes.
        let b = unsafe { p.cast::<[u8; 32]>().read_unaligned() };
        std::array::from_fn(|l| {
            half::f16::from_bits(u16::from_le_bytes([b[2 * l], b[2 * l + 1]])).to_f32()
        })
    }
    #[inline(always)]
    unsafe fn load_u8f(self, p: *const u8) -> Self::F {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { p.cast::<[u8; 16]>().read_unaligned() }.map(f32::from)
    }
    #[inline(always)]
    unsafe fn load_i8f(self, p: *const u8) -> Self::F {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { p.cast::<[u8; 16]>().read_unaligned() }.map(|b| f32::from(b as i8))
    }
    #[inline(always)]
    fn f_zero(self) -> Self::F {
        [0.0; LANES]
    }
    #[inline(always)]
    fn splat_f(self, x: f32) -> Self::F {
        [x; LANES]
    }
    #[inline(always)]
    fn mul(self, a: Self::F, b: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    #[inline(always)]
    fn fms(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l].mul_add(b[l], -c[l]))
    }
    #[inline(always)]
    fn lanes(self, a: Self::F) -> [f32; LANES] {
        a
    }
    #[inline(always)]
    fn load_f(self, v: [f32; LANES]) -> Self::F {
        v
    }
    #[inline(always)]
    unsafe fn store_w(self, w: Self::W, p: *mut u8) {
        // SAFETY: the caller guarantees 64 writable bytes.
        unsafe { p.cast::<[u8; 64]>().write_unaligned(w) }
    }
    #[inline(always)]
    unsafe fn store_fp(self, f: Self::F, p: *mut u8) {
        // SAFETY: the caller guarantees 64 writable bytes.
        unsafe { p.cast::<[f32; LANES]>().write_unaligned(f) }
    }
    #[inline(always)]
    unsafe fn load_fp(self, p: *const u8) -> Self::F {
        // SAFETY: the caller guarantees 64 readable bytes.
        unsafe { p.cast::<[f32; LANES]>().read_unaligned() }
    }
    #[inline(always)]
    fn prefetch(self, _: *const u8) {}
}

/// [`QIsa::nibble_lut`] by masks: `lut16(v & 0x0F)` and `lut16((v >> 4) & 0x0F)`.
///
/// # Safety
/// `p` must be valid for reading 64 bytes (no alignment needed).
#[inline(always)]
pub(crate) unsafe fn masked_nibble_lut<I: QIsa>(
    isa: I,
    table: [u8; 16],
    p: *const u8,
) -> (I::W, I::W) {
    // SAFETY: forwarded from the caller.
    let (lo, hi) = unsafe { nibbles(isa, p) };
    (isa.lut16(table, lo), isa.lut16(table, hi))
}

/// [`QIsa::nibbles_high`] by masks, word shifts and ors.
///
/// # Safety
/// `p` must be valid for reading 64 bytes.
#[inline(always)]
pub(crate) unsafe fn nibbles_high_masked<I: QIsa>(
    isa: I,
    p: *const u8,
    planes: (I::W, I::W),
    from: (u32, u32),
    width: u32,
) -> (I::W, I::W) {
    // SAFETY: forwarded from the caller.
    let (lo, hi) = unsafe { nibbles(isa, p) };
    let bits = isa.splat_w((((1u32 << width) - 1) << 4) as u8);
    let lift = |v, f| isa.and_w(super::fmt::to_bit4(isa, v, f), bits);
    (
        isa.or_w(lo, lift(planes.0, from.0)),
        isa.or_w(hi, lift(planes.1, from.1)),
    )
}

/// Low and high nibbles of the 64 bytes at `p` (values `0..16`, byte for byte).
///
/// # Safety
/// `p` must be valid for reading 64 bytes.
#[inline(always)]
pub(crate) unsafe fn nibbles<I: QIsa>(isa: I, p: *const u8) -> (I::W, I::W) {
    // SAFETY: forwarded from the caller.
    let v = unsafe { isa.load_w(p) };
    let mask = isa.splat_w(0x0F);
    (isa.and_w(v, mask), isa.and_w(isa.shr16(v, 4), mask))
}

/// Applies `f` to each little-endian 16-bit lane of `a`.
#[inline(always)]
fn map16(a: [u8; 64], f: impl Fn(u16) -> u16) -> [u8; 64] {
    let mut out = [0u8; 64];
    for i in 0..32 {
        let v = f(u16::from_le_bytes([a[2 * i], a[2 * i + 1]])).to_le_bytes();
        out[2 * i] = v[0];
        out[2 * i + 1] = v[1];
    }
    out
}

/// A unit of kernel work compiled once per [`QIsa`] by [`qdispatch`] (implement `run` with `#[inline(always)]`).
pub(crate) trait QKernel {
    /// The result.
    type Out;
    /// Does the work with `isa`.
    fn run<I: QIsa>(self, isa: I) -> Self::Out;
}

/// Which [`QIsa`] [`qdispatch`] picks on this CPU: 3 = AVX-512 (F, BW, VNNI) with VBMI and GFNI (byte permutes for
/// the nibble lookups, bit-matrix products for the high-bit planes), 2 = AVX-512 (F, BW, VNNI), 1 = AVX2 (with
/// FMA and F16C), 0 = plain Rust; capped by the crate's
/// test-only dispatch cap.
pub(crate) fn qisa_level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni");
        if crate::simd::allowed(3)
            && avx512
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("gfni")
        {
            return 3;
        }
        if crate::simd::allowed(2) && avx512 {
            return 2;
        }
        if crate::simd::allowed(1)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return 1;
        }
    }
    0
}

/// Runs `k` with the best integer-dot instruction set of the CPU ([`qisa_level`]); every choice gives the same
/// bits.
#[inline]
pub(crate) fn qdispatch<K: QKernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    {
        match qisa_level() {
            // SAFETY: level 3 means the CPU supports AVX-512F, BW, VNNI, VBMI and GFNI (checked by `qisa_level`).
            3 => return unsafe { with_avx512_vbmi(k) },
            // SAFETY: level 2 means the CPU supports AVX-512F, BW and VNNI.
            2 => return unsafe { with_avx512(k) },
            // SAFETY: level 1 means the CPU supports AVX2, FMA and F16C.
            1 => return unsafe { with_avx2(k) },
            _ => {}
        }
    }
    k.run(Scalar)
}

/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512 VNNI, AVX-512 VBMI and GFNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c")]
unsafe fn with_avx512_vbmi<K: QKernel>(k: K) -> K::Out {
    k.run(super::x86::Avx512Vnni::<true>(()))
}

/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn with_avx512<K: QKernel>(k: K) -> K::Out {
    k.run(super::x86::Avx512Vnni::<false>(()))
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn with_avx2<K: QKernel>(k: K) -> K::Out {
    k.run(super::x86::Avx2(()))
}
