//! What `vdpbf16ps` computes: the scalar step against values measured on AMD Zen 4 (EPYC, AVX-512 BF16), the native
//! instruction against the scalar step on millions of random and edge-case lanes (where the CPU has it), and the
//! AVX-512F / AVX2 emulations against the scalar step.

use super::*;

/// The bits of `2^e` (normal range).
fn p2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The bf16 pair `(lo, hi)` of two f32 whose low 16 bits are zero.
fn pair(lo: f32, hi: f32) -> u32 {
    assert!(lo.to_bits() & 0xffff == 0 && hi.to_bits() & 0xffff == 0);
    lo.to_bits() >> 16 | hi.to_bits() & 0xffff_0000
}

/// (what, acc, a, b, the result bits `vdpbf16ps` gave on AMD Zen 4).
fn measured() -> Vec<(&'static str, f32, u32, u32, u32)> {
    let one = 1.0f32;
    vec![
        // bf16 denormal inputs read as zero (else 2^-33)
        ("daz bf16", 0.0, 0x0001_0000, pair(0.0, p2(100)), 0),
        // a denormal accumulator reads as zero (else 2^-126 + 1e-40)
        (
            "daz acc",
            1e-40,
            pair(0.0, p2(-63)),
            pair(0.0, p2(-63)),
            0x0080_0000,
        ),
        ("ftz result", 0.0, pair(0.0, p2(-65)), pair(0.0, p2(-65)), 0),
        // the first step's tiny 2^-130 is flushed before the second adds 2^-126
        (
            "ftz between steps",
            0.0,
            pair(p2(-63), p2(-65)),
            pair(p2(-63), p2(-65)),
            0x0080_0000,
        ),
        // two roundings: 1 + 2^-24 + 2^-24 gives 1 (one rounding would give 1 + 2^-23)
        (
            "two roundings",
            1.0,
            pair(p2(-12), p2(-12)),
            pair(p2(-12), p2(-12)),
            0x3f80_0000,
        ),
        // the product is not rounded to f32 alone: -MAX + 2^128 = 2^104
        (
            "fused overflow",
            -f32::MAX,
            pair(0.0, p2(64)),
            pair(0.0, p2(64)),
            0x7380_0000,
        ),
        // nor flushed alone: 2^-126 + 2^-140
        (
            "fused underflow",
            p2(-126),
            pair(0.0, p2(-70)),
            pair(0.0, p2(-70)),
            0x0080_0200,
        ),
        // tininess after rounding to 24 bits: 2^-126 - 2^-150 is tiny, 2^-126 - 2^-152 rounds to 2^-126
        (
            "tiny at 2^-150",
            p2(-126),
            pair(0.0, p2(-75)),
            pair(0.0, -p2(-75)),
            0,
        ),
        (
            "not tiny at 2^-152",
            p2(-126),
            pair(0.0, p2(-76)),
            pair(0.0, -p2(-76)),
            0x0080_0000,
        ),
        (
            "-2^-126 - 2^-152",
            -p2(-126),
            pair(0.0, p2(-76)),
            pair(0.0, p2(-76)),
            0x8080_0000,
        ),
        (
            "2^-125 - 2^-150",
            p2(-125),
            pair(0.0, p2(-75)),
            pair(0.0, -p2(-75)),
            0x0100_0000,
        ),
        (
            "2^-125 - 2^-148",
            p2(-125),
            pair(0.0, p2(-74)),
            pair(0.0, -p2(-74)),
            0x00ff_fffe,
        ),
        // flushes and denormal reads keep the sign
        (
            "ftz keeps sign",
            0.0,
            pair(-p2(-65), 0.0),
            pair(p2(-65), 0.0),
            0x8000_0000,
        ),
        (
            "ftz then -0",
            -0.0,
            pair(-0.0, -p2(-65)),
            pair(one, p2(-65)),
            0x8000_0000,
        ),
        (
            "daz acc keeps sign",
            -1e-40,
            pair(-0.0, -0.0),
            pair(one, one),
            0x8000_0000,
        ),
        (
            "daz bf16 keeps sign",
            -0.0,
            0x8000_8001,
            pair(one, one),
            0x8000_0000,
        ),
        (
            "-0 + -0",
            -0.0,
            pair(-0.0, -0.0),
            pair(one, one),
            0x8000_0000,
        ),
        ("-0 + +0", -0.0, 0, 0, 0),
        // NaNs: the first NaN quieted, invalid operations give the default NaN
        (
            "nan acc",
            f32::from_bits(0x7fc1_2345),
            pair(one, one),
            pair(one, one),
            0x7fc1_2345,
        ),
        (
            "snan acc",
            f32::from_bits(0x7f81_2345),
            pair(one, one),
            pair(one, one),
            0x7fc1_2345,
        ),
        ("nan a", 1.0, 0x7fc3_3f80, pair(one, one), 0x7fc3_0000),
        ("inf·0", 1.0, pair(0.0, f32::INFINITY), 0, 0xffc0_0000),
        (
            "inf - inf",
            f32::INFINITY,
            pair(0.0, -f32::INFINITY),
            pair(0.0, one),
            0xffc0_0000,
        ),
    ]
}

#[test]
fn the_scalar_step_gives_the_measured_results() {
    for (what, acc, a, b, want) in measured() {
        let got = dp_lane(acc, a, b);
        assert_eq!(got.to_bits(), want, "{what}: {got:e}");
    }
}

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A bf16 of class `mode`: 0 moderate exponents, 1 any bit pattern, 2 tiny (denormals included), 3 near 1.
    fn bf16(&mut self, mode: u64) -> u32 {
        let x = self.next();
        let exp = |lo: u64, span: u64| ((x >> 8) as u32 & 0x807f) | (((lo + x % span) as u32) << 7);
        match mode {
            0 => exp(100, 55),
            1 => x as u32 & 0xffff,
            2 => exp(0, 12),
            _ => exp(120, 14),
        }
    }

    /// A case of `mode` (accumulator, a, b); with `normal_acc` the accumulator is never denormal.
    fn case(&mut self, mode: u64, normal_acc: bool) -> (f32, u32, u32) {
        let a = self.bf16(mode) | self.bf16(mode) << 16;
        let b = self.bf16(mode) | self.bf16(mode) << 16;
        let x = self.next();
        let mut acc = match mode {
            0 | 3 => f32::from_bits((x as u32 & 0x807f_ffff) | ((100 + x % 55) as u32) << 23),
            1 => f32::from_bits(x as u32),
            _ => f32::from_bits(x as u32 & 0x81ff_ffff),
        };
        if normal_acc && acc.is_subnormal() {
            acc = 0.0;
        }
        (acc, a, b)
    }
}

fn same(got: f32, want: f32) -> bool {
    if want.is_nan() {
        got.is_nan()
    } else {
        got.to_bits() == want.to_bits()
    }
}

/// `dp` on 16 lanes of random cases, `rounds` times per class, against [`dp_lane`]; returns the lanes compared.
fn check_against_scalar<D: Dp>(dp: D, rounds: usize, normal_acc: bool) -> usize {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let mut n = 0;
    for it in 0..rounds * 4 {
        let cases: [(f32, u32, u32); LANES] =
            std::array::from_fn(|_| r.case(it as u64 % 4, normal_acc));
        let acc = dp.acc_of(cases.map(|c| c.0));
        // SAFETY: 16 u32 each.
        let (a, b) = unsafe {
            (
                dp.load_pairs(cases.map(|c| c.1).as_ptr()),
                dp.load_pairs(cases.map(|c| c.2).as_ptr()),
            )
        };
        let got = dp.lanes(dp.dp(acc, a, b));
        for (l, &(c, a, b)) in cases.iter().enumerate() {
            let want = dp_lane(c, a, b);
            assert!(
                same(got[l], want),
                "acc {c:e} a {a:08x} b {b:08x}: {:e} vs {want:e}",
                got[l]
            );
            n += 1;
        }
    }
    n
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vdpbf16ps_matches_the_scalar_step() {
    use super::super::dp_x86::Avx512Bf16;
    if !std::arch::is_x86_feature_detected!("avx512bf16") {
        eprintln!("no AVX-512 BF16 on this CPU: the instruction is not checked");
        return;
    }
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn run() -> usize {
        // the measured edge cases, then 4 × 50,000 rounds of 16 random lanes
        let d = Avx512Bf16(());
        for (what, acc, a, b, want) in measured() {
            // SAFETY: 16 u32 each.
            let (av, bv) = unsafe {
                (
                    d.load_pairs([a; LANES].as_ptr()),
                    d.load_pairs([b; LANES].as_ptr()),
                )
            };
            let got = d.lanes(d.dp(d.acc_of([acc; LANES]), av, bv))[0];
            assert_eq!(got.to_bits(), want, "{what}: {got:e}");
        }
        check_against_scalar(d, 50_000, false)
    }
    // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above).
    let n = unsafe { run() };
    assert_eq!(n, 3_200_000);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_avx512f_and_avx2_emulations_match_the_scalar_step() {
    use super::super::arch::{Avx2, Avx512};
    if std::arch::is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f")]
        unsafe fn run() -> usize {
            check_against_scalar(Avx512(()), 20_000, true)
        }
        // SAFETY: the CPU has AVX-512F (checked above).
        assert!(unsafe { run() } > 0);
    }
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run() -> usize {
            check_against_scalar(Avx2(()), 20_000, true)
        }
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        assert!(unsafe { run() } > 0);
    }
}

#[test]
fn the_min_normal_boundary_is_decided_on_the_exact_value() {
    // exact values just below, at and above 2^-126 - 2^-151 (the 24-bit midpoint) from products of bf16
    let t = p2(-126);
    // 2^-126 - 2^-151 exactly: a tie, rounds to the even 2^-126 → kept
    assert_eq!(step(t, p2(-75), -p2(-76)).to_bits(), t.to_bits());
    // 2^-126 - 2^-151 - 2^-159: below → flushed (the FMA's subnormal rounding gave 2^-126)
    assert_eq!(ftz_rounded(t, t, p2(-75), -(p2(-76) + p2(-84))), 0.0);
    // 2^-126 - 2^-151 + 2^-160: above → kept
    assert_eq!(ftz_rounded(t, t, p2(-75), -(p2(-76) - p2(-85))), t);
    // negative side
    assert_eq!(step(-t, p2(-75), p2(-75)).to_bits(), 0x8000_0000);
    assert_eq!(step(-t, p2(-76), p2(-76)).to_bits(), (-t).to_bits());
}
