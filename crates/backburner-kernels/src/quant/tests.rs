//! Internal checks: the integer view of a block ([`Unit`]) against the ggml formulas and its round trips through
//! GGUF bytes and the panel layout; the products on every instruction set this CPU has.

use std::sync::atomic::Ordering;

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::unit::{Lay, Unit};
use super::*;
use crate::simd::{ISA_CAP, ISA_MAX};

/// One random GGUF block with finite f16 scales.
pub(super) fn random_block(r: &mut StdRng, fmt: QuantFormat) -> Vec<u8> {
    let mut b: Vec<u8> = (0..fmt.block_bytes()).map(|_| r.random()).collect();
    let d = f16::from_f32(r.random_range(-0.1f32..0.1));
    let dmin = f16::from_f32(r.random_range(-0.1f32..0.1));
    fmt.write_scales(&mut b, d, dmin);
    b
}

/// The weight of element `e` from the integer view, with `dequantize`'s operation order.
fn value(fmt: QuantFormat, u: &Unit, e: usize) -> f32 {
    if let Some(s) = super::spec::spec(fmt) {
        return super::spec::value(s, u, e);
    }
    let d = f16::from_bits(u.d).to_f32();
    let c = i32::from(u.code[e]);
    match fmt {
        QuantFormat::Q8_0 => (c - 128) as f32 * d,
        QuantFormat::Q4_0 => (c - 8) as f32 * d,
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let dmin = f16::from_bits(u.dmin).to_f32();
            d * f32::from(u.sc[e / 32]) * c as f32 - dmin * f32::from(u.m[e / 32])
        }
        QuantFormat::Q6K => d * f32::from(u.sc[e / 16] as i8) * (c - 32) as f32,
        QuantFormat::Iq4Xs => d * f32::from(u.sc[e / 32] as i8) * f32::from(IQ4_VALUES[c as usize]),
        _ => unreachable!("generic formats are handled above"),
    }
}

#[test]
fn the_integer_view_of_a_block_gives_dequantize_values_and_round_trips() {
    let mut r = StdRng::seed_from_u64(7);
    for fmt in QuantFormat::ALL {
        let lay = Lay::of(fmt);
        for _ in 0..50 {
            let blocks: Vec<Vec<u8>> = (0..16).map(|_| random_block(&mut r, fmt)).collect();
            let mut panel_unit = vec![0u8; lay.bytes];
            for (l, b) in blocks.iter().enumerate() {
                let u = Unit::from_gguf(fmt, b);
                let mut want = vec![0.0f32; lay.unit];
                dequantize(fmt, b, &mut want).unwrap();
                for (e, w) in want.iter().enumerate() {
                    assert_eq!(
                        value(fmt, &u, e).to_bits(),
                        w.to_bits(),
                        "{fmt} element {e}"
                    );
                }
                let mut back = vec![0u8; fmt.block_bytes()];
                if u.to_gguf(fmt, &mut back) {
                    assert_eq!(&back, b, "{fmt} GGUF round trip");
                }
                u.store(fmt, &mut panel_unit, l);
            }
            for (l, b) in blocks.iter().enumerate() {
                assert_eq!(
                    Unit::load(fmt, &panel_unit, l),
                    Unit::from_gguf(fmt, b),
                    "{fmt} lane {l}"
                );
            }
        }
    }
}

#[test]
fn products_give_the_same_bits_on_every_instruction_set() {
    let mut r = StdRng::seed_from_u64(8);
    let (n, k) = (40, 512);
    for fmt in QuantFormat::ALL {
        let rows: Vec<u8> = (0..n * k / fmt.block_elems())
            .flat_map(|_| random_block(&mut r, fmt))
            .collect();
        let w = QuantMatrix::pack(fmt, k, &[(&rows, n)]).unwrap();
        for m in [1, 3, 9] {
            let xf: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
            let mut x = QuantizedActs::new();
            x.quantize(&xf, m, k);
            let mut want = vec![0.0f32; m * n];
            qmatmul_reference(&x, &w, &mut want, n);
            for cap in (0..=ISA_MAX).rev() {
                ISA_CAP.store(cap, Ordering::SeqCst);
                let mut y = vec![0.0f32; m * n];
                qmatmul(&x, &w, &mut y, n);
                let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
                assert!(same, "{fmt} m={m} cap={cap} ({})", kernel_isa());
            }
        }
    }
}

#[test]
fn extreme_codes_against_full_scale_inputs_give_the_reference_bits() {
    // The largest pair sums the AVX2 kernels form — codes of magnitude 127 or 128 (signed) or 15 (unsigned, summed 8
    // steps in i16) against inputs of magnitude 127, products of one sign — must not saturate, in the decode path
    // (m ≤ 2) and the 4-row tiles of the many-row path.
    let (n, k) = (32, 512);
    let d = f16::from_f32(1.0).to_bits().to_le_bytes();
    let q8 = |q: u8| [&d[..], &[q; 32]].concat();
    // IQ4_XS: sub-block scales ls = 63 (ls − 32 = 31), every index `i`.
    let iq4 = |i: u8| [&d[..], &[0xFF; 6], &[i | i << 4; 128]].concat();
    let q4 = |q: u8| [&d[..], &[q; 16]].concat();
    // Q4_K: d = 1, dmin = 0, every 6-bit scale and min 63, every code 15.
    let q4k = [&d[..], &[0, 0], &[0xFF; 12], &[0xFF; 128]].concat();
    let cases = [
        (QuantFormat::Q4_0, q4(0xFF), 7.0f32),
        (QuantFormat::Q4_0, q4(0x00), -8.0),
        (QuantFormat::Q4K, q4k, 63.0 * 15.0),
        (QuantFormat::Q8_0, q8(0x80), -128.0),
        (QuantFormat::Q8_0, q8(0x7F), 127.0),
        (QuantFormat::Iq4Xs, iq4(0), -127.0 * 31.0),
        (QuantFormat::Iq4Xs, iq4(15), 113.0 * 31.0),
    ];
    for (fmt, block, weight) in cases {
        let mut one = vec![0.0f32; fmt.block_elems()];
        dequantize(fmt, &block, &mut one).unwrap();
        assert!(one.iter().all(|&v| v == weight), "{fmt} test block");
        let rows = block.repeat(n * k / fmt.block_elems());
        let w = QuantMatrix::pack(fmt, k, &[(&rows, n)]).unwrap();
        for m in [1, 2, 4, 5, 8] {
            for sign in [1.0f32, -1.0] {
                let mut x = QuantizedActs::new();
                x.quantize(&vec![sign; m * k], m, k);
                let mut want = vec![0.0f32; m * n];
                qmatmul_reference(&x, &w, &mut want, n);
                let exact = sign * weight * k as f32;
                for v in &want {
                    assert!(
                        (v - exact).abs() <= 1e-5 * exact.abs(),
                        "{fmt} {v} vs {exact}"
                    );
                }
                for cap in (0..=ISA_MAX).rev() {
                    ISA_CAP.store(cap, Ordering::SeqCst);
                    let mut y = vec![0.0f32; m * n];
                    qmatmul(&x, &w, &mut y, n);
                    ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
                    let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{fmt} m={m} sign {sign} cap={cap} ({})", kernel_isa());
                }
            }
        }
    }
}

/// [`isa::QIsa::load8_w`] through [`isa::qdispatch`]: the eight vectors' bytes (stored back with `store_w`) and how far
/// the returned address lies from the one given.
struct Load8<'a>(&'a [u8]);

impl isa::QKernel for Load8<'_> {
    type Out = (Vec<u8>, isize);
    #[inline(always)]
    fn run<I: isa::QIsa>(self, isa: I) -> Self::Out {
        assert!(self.0.len() >= 512);
        let p = self.0.as_ptr();
        let mut out = vec![0u8; 512];
        // SAFETY: 512 readable bytes at p (asserted); vector i is stored into out's bytes 64·i..64·i + 64.
        let q = unsafe {
            let (v, q) = isa.load8_w(p);
            for i in 0..8 {
                isa.store_w(isa.pick8(v, i), out.as_mut_ptr().add(64 * i));
            }
            q
        };
        (out, q as isize - p as isize)
    }
}

#[test]
fn the_ordered_unit_load_reads_eight_vectors_upwards_and_returns_its_address() {
    // Random bytes: no vector equals another, so a load from a wrong offset cannot pass.
    let mut r = StdRng::seed_from_u64(9);
    let bytes: Vec<u8> = (0..600).map(|_| r.random()).collect();
    // Offset 32: the Q8_0 units of odd index start half-way into a cache line.
    let src = &bytes[32..];
    for cap in (0..=ISA_MAX).rev() {
        ISA_CAP.store(cap, Ordering::SeqCst);
        let (got, moved) = isa::qdispatch(Load8(src));
        ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
        assert_eq!(got, &src[..512], "cap={cap} ({})", kernel_isa());
        assert_eq!(moved, 0, "cap={cap} ({})", kernel_isa());
    }
}

/// The decode prefetch [`fmt::Fmt::prefetch`] picks for Q8_0 with one and with two streaming tasks, then for Q4_K,
/// Q6_K, Q4_0, Q3_K (generic, nibbles), IQ4_NL (generic, byte codebook), IQ4_XS, Q2_K and IQ2_XS (2-bit planes) with
/// two.
struct PrefetchPolicy;

impl isa::QKernel for PrefetchPolicy {
    type Out = [fmt::Prefetch; 10];
    #[inline(always)]
    fn run<I: isa::QIsa>(self, _: I) -> Self::Out {
        use fmt::Fmt;
        use fmt_gen::Gen;
        [
            fmt::Q80::prefetch::<I>(1),
            fmt::Q80::prefetch::<I>(2),
            fmt::Q4K::prefetch::<I>(2),
            fmt::Q6K::prefetch::<I>(2),
            fmt::Q40::prefetch::<I>(2),
            Gen::<11>::prefetch::<I>(2),
            Gen::<20>::prefetch::<I>(2),
            fmt::Iq4Xs::prefetch::<I>(2),
            Gen::<10>::prefetch::<I>(2),
            Gen::<17>::prefetch::<I>(2),
        ]
    }
}

#[test]
fn decode_prefetch_follows_the_measured_policy_of_each_format_isa_and_vendor() {
    use fmt::Prefetch::{EveryLine, Hardware, Near, OneLine};
    for cap in (0..=ISA_MAX).rev() {
        ISA_CAP.store(cap, Ordering::SeqCst);
        let isa = kernel_isa();
        let got = isa::qdispatch(PrefetchPolicy);
        ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
        let amd512 = isa.starts_with("avx512-vnni") && fmt::lone_stream_prefetcher();
        let (one, two) = if amd512 {
            (OneLine, Hardware)
        } else {
            (EveryLine, EveryLine)
        };
        let in_order = match (amd512, super::prefetch::amd_zen4_or_older()) {
            (true, true) => Hardware,
            (true, false) => Near,
            (false, _) => EveryLine,
        };
        let want = [
            one, two, in_order, in_order, in_order, in_order, in_order, in_order, EveryLine,
            EveryLine,
        ];
        assert_eq!(got, want, "{isa}");
    }
}

/// The byte ranges of a panel unit's fields in `lay`, in the order the decode kernel reads them (the unit's `d`,
/// `dmin`, then per 32-block its high-bit planes, codes, scales and mins), each `(start, end, name)`.
fn unit_fields(fmt: QuantFormat, lay: Lay) -> Vec<(usize, usize, String)> {
    use super::spec::{spec, Codes, Mins, Scales};
    let blocks = lay.unit / 32;
    let generic = spec(fmt);
    let (codes, planes, scales, mins, dlen) = match (fmt, generic) {
        (_, Some(s)) => (
            if matches!(s.codes, Codes::Two | Codes::Lut3) {
                128
            } else {
                256
            },
            if matches!(s.codes, Codes::Five | Codes::Lut3) {
                64
            } else {
                0
            },
            match s.scales {
                Scales::None => 0,
                Scales::Per32 => 16,
                Scales::Per16 => 32,
            },
            if s.mins == Mins::Per16 { 32 } else { 0 },
            64,
        ),
        (QuantFormat::Q8_0, _) => (512, 0, 0, 0, 32),
        (QuantFormat::Q4_0, _) => (256, 0, 0, 0, 32),
        (QuantFormat::Q4K, _) => (256, 0, 16, 16, 32),
        (QuantFormat::Iq4Xs, _) => (256, 0, 16, 0, 32),
        (QuantFormat::Q5K, _) => (256, 64, 16, 16, 32),
        (_, None) => (256, 128, 32, 0, 32),
    };
    let mut f = vec![(lay.d, lay.d + dlen, "d".to_string())];
    if generic.is_some_and(|s| s.mins != Mins::None) || (generic.is_none() && lay.dmin != 0) {
        f.push((lay.dmin, lay.dmin + dlen, "dmin".into()));
    }
    for b in 0..blocks {
        for (len, field, name) in [
            (planes, lay.hb, "planes"),
            (codes, lay.codes, "codes"),
            (scales, lay.sc, "scales"),
            (mins, lay.m, "mins"),
        ] {
            if len > 0 {
                f.push((field.at(b), field.at(b) + len, format!("{name} {b}")));
            }
        }
    }
    f
}

#[test]
fn panel_units_tile_their_bytes_and_read_upwards() {
    for fmt in QuantFormat::ALL {
        let lay = Lay::of(fmt);
        let fields = unit_fields(fmt, lay);
        // Every byte of the unit belongs to exactly one field.
        let mut owner = vec![0u8; lay.bytes];
        for &(s, e, ref name) in &fields {
            assert!(
                e <= lay.bytes,
                "{fmt}: {name} ends at {e} past {}",
                lay.bytes
            );
            owner[s..e].iter_mut().for_each(|o| *o += 1);
        }
        assert!(owner.iter().all(|&o| o == 1), "{fmt}: {owner:?}");
        // Q4_0, the K-quants and IQ4_XS: read in the kernel's order, each field starts where the previous one ends.
        if super::spec::spec(fmt).is_some()
            || matches!(
                fmt,
                QuantFormat::Q4_0
                    | QuantFormat::Q4K
                    | QuantFormat::Q5K
                    | QuantFormat::Q6K
                    | QuantFormat::Iq4Xs
            )
        {
            let mut at = 0;
            for (s, e, name) in fields {
                assert_eq!(s, at, "{fmt}: {name} is not next in reading order");
                at = e;
            }
        }
    }
}

/// [`isa::QIsa::nibble_lut`] of 64 bytes, as plain bytes (low nibbles' entries, then high nibbles').
struct NibbleLut<'a>(&'a [u8; 64], [u8; 16]);

impl isa::QKernel for NibbleLut<'_> {
    type Out = [u8; 128];
    #[inline(always)]
    fn run<I: isa::QIsa>(self, isa: I) -> Self::Out {
        let mut out = [0u8; 128];
        // SAFETY: 64 readable bytes in, 2 × 64 writable bytes out.
        unsafe {
            let (lo, hi) = isa.nibble_lut(self.1, self.0.as_ptr());
            isa.store_w(lo, out.as_mut_ptr());
            isa.store_w(hi, out.as_mut_ptr().add(64));
        }
        out
    }
}

#[test]
fn nibble_lookups_give_each_nibbles_table_entry_on_every_instruction_set() {
    // Every byte value occurs (high bits set included), and the table's entries are all distinct, so a lookup by a
    // wrong or unmasked index cannot pass.
    let mut table = [0u8; 16];
    for (i, t) in table.iter_mut().enumerate() {
        *t = (i as u8).wrapping_mul(37).wrapping_add(129);
    }
    for start in [0u8, 64, 128, 192] {
        let bytes: [u8; 64] = std::array::from_fn(|i| start.wrapping_add(i as u8).rotate_left(3));
        let mut want = [0u8; 128];
        for (i, b) in bytes.iter().enumerate() {
            want[i] = table[usize::from(b & 0xF)];
            want[64 + i] = table[usize::from(b >> 4)];
        }
        for cap in (0..=ISA_MAX).rev() {
            ISA_CAP.store(cap, Ordering::SeqCst);
            let got = isa::qdispatch(NibbleLut(&bytes, table));
            ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
            assert_eq!(got, want, "cap={cap} ({})", kernel_isa());
        }
    }
}
