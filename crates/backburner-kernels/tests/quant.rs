//! Quantized weights: the ggml formulas on hand-built blocks, rows read back from the panels, the kernels against
//! their plain-loop twin bit for bit (every format, shape class, thread count and output stride), the error bound
//! of the activation quantization against the f64 product, and malformed input.

use backburner_kernels::quant::{
    dequantize, k_pack_scale_min, k_scale_min, qmatmul, qmatmul_reference, QuantError, QuantFormat,
    QuantMatrix, QuantizedActs, IQ4_VALUES,
};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn f16le(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Random GGUF rows of `fmt`: random code and scale bytes, f16 `d` (and `dmin`) random finite in ±[2^-10, 2^-4].
pub(crate) fn random_rows(r: &mut StdRng, fmt: QuantFormat, rows: usize, k: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..rows * fmt.row_bytes(k).unwrap())
        .map(|_| r.random())
        .collect();
    let scale = |r: &mut StdRng| {
        let s = if r.random::<bool>() { 1.0 } else { -1.0 };
        f16::from_f32(s * r.random_range(0.001f32..0.06))
    };
    for blk in b.chunks_exact_mut(fmt.block_bytes()) {
        let (d, dmin) = (scale(r), scale(r));
        fmt.write_scales(blk, d, dmin);
    }
    b
}

/// Activations with some structure: mostly uniform, one all-zero block, one row of large values.
pub(crate) fn activations(r: &mut StdRng, m: usize, k: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
    if k >= 64 {
        x[32..64].fill(0.0);
    }
    if m > 2 {
        x[2 * k..3 * k].iter_mut().for_each(|v| *v *= 1000.0);
    }
    x
}

fn ks(fmt: QuantFormat) -> &'static [usize] {
    if fmt.block_elems() == 32 {
        &[32, 96, 256, 512]
    } else {
        &[256, 512]
    }
}

#[test]
fn format_ids_sizes_and_names_follow_ggml() {
    let want = [
        (QuantFormat::Q4_0, 2, "Q4_0", 32, 18),
        (QuantFormat::Q8_0, 8, "Q8_0", 32, 34),
        (QuantFormat::Q4K, 12, "Q4_K", 256, 144),
        (QuantFormat::Q5K, 13, "Q5_K", 256, 176),
        (QuantFormat::Q6K, 14, "Q6_K", 256, 210),
        (QuantFormat::Iq4Xs, 23, "IQ4_XS", 256, 136),
        (QuantFormat::Q4_1, 3, "Q4_1", 32, 20),
        (QuantFormat::Q5_0, 6, "Q5_0", 32, 22),
        (QuantFormat::Q5_1, 7, "Q5_1", 32, 24),
        (QuantFormat::Q2K, 10, "Q2_K", 256, 84),
        (QuantFormat::Q3K, 11, "Q3_K", 256, 110),
        (QuantFormat::Iq2Xxs, 16, "IQ2_XXS", 256, 66),
        (QuantFormat::Iq2Xs, 17, "IQ2_XS", 256, 74),
        (QuantFormat::Iq3Xxs, 18, "IQ3_XXS", 256, 98),
        (QuantFormat::Iq1S, 19, "IQ1_S", 256, 50),
        (QuantFormat::Iq4Nl, 20, "IQ4_NL", 32, 18),
        (QuantFormat::Iq3S, 21, "IQ3_S", 256, 110),
        (QuantFormat::Iq2S, 22, "IQ2_S", 256, 82),
        (QuantFormat::Iq1M, 29, "IQ1_M", 256, 56),
        (QuantFormat::Tq1_0, 34, "TQ1_0", 256, 54),
        (QuantFormat::Tq2_0, 35, "TQ2_0", 256, 66),
        (QuantFormat::Mxfp4, 39, "MXFP4", 32, 17),
    ];
    assert_eq!(want.len(), QuantFormat::ALL.len());
    for (f, id, name, be, bb) in want {
        assert_eq!(QuantFormat::from_ggml_type(id), Some(f));
        assert_eq!(
            (f.ggml_type(), f.name(), f.block_elems(), f.block_bytes()),
            (id, name, be, bb)
        );
        assert_eq!(f.row_bytes(3 * be), Some(3 * bb));
        assert_eq!(f.row_bytes(be + 16), None);
        assert_eq!(f.row_bytes(0), Some(0));
    }
    for t in [0, 1, 4, 5, 9, 15, 24, 30, 36, 40, 1000] {
        assert_eq!(QuantFormat::from_ggml_type(t), None, "{t}");
    }
    assert_eq!(QuantFormat::Q8_0.row_bytes(usize::MAX - 31), None);
}

#[test]
fn k_scale_unpacking_follows_get_scale_min_k4_and_its_inverse_packs_every_value() {
    // Hand-packed: scale j = j + 1 (low 4) and 60 + j (high 4), mins = 2j and 40 + j.
    let sc = [1u8, 2, 3, 4, 60, 61, 62, 63];
    let m = [0u8, 2, 4, 6, 40, 41, 42, 43];
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    for j in 0..8 {
        assert_eq!(k_scale_min(&q, j), (sc[j], m[j]), "j = {j}");
    }
    assert_eq!(k_pack_scale_min(&sc, &m), q);
    // Every 6-bit value in every slot survives packing.
    for v in 0..64u8 {
        for j in 0..8 {
            let (mut s2, mut m2) = ([5u8; 8], [9u8; 8]);
            s2[j] = v;
            m2[7 - j] = 63 - v;
            let p = k_pack_scale_min(&s2, &m2);
            assert_eq!(k_scale_min(&p, j).0, v);
            assert_eq!(k_scale_min(&p, 7 - j).1, 63 - v);
        }
    }
}

#[test]
fn dequantize_q8_0_and_q4_0_hand_built_blocks() {
    let mut b = f16le(0.5).to_vec();
    let q: Vec<i8> = (0..32)
        .map(|j| [-128i8, -1, 0, 1, 127, 77, -33, 5][j % 8])
        .collect();
    b.extend(q.iter().map(|&v| v as u8));
    let mut y = [0.0f32; 32];
    dequantize(QuantFormat::Q8_0, &b, &mut y).unwrap();
    for j in 0..32 {
        assert_eq!(y[j], f32::from(q[j]) * 0.5);
    }
    // Q4_0: byte j holds element j (low) and j + 16 (high); w = (q − 8)·d.
    let mut b = f16le(-2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    dequantize(QuantFormat::Q4_0, &b, &mut y).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * -2.0, "{j}");
        assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * -2.0, "{j}");
    }
}

/// Scales 1..8 + 50 and mins 3j; d, dmin powers of two so every product is exact.
fn k_scales() -> ([u8; 8], [u8; 8]) {
    (
        std::array::from_fn(|j| j as u8 + 1 + 7 * (j as u8 % 2) * 7),
        std::array::from_fn(|j| 3 * j as u8),
    )
}

#[test]
fn dequantize_q4_k_and_q5_k_hand_built_blocks() {
    let (sc, m) = k_scales();
    let q4 = |e: usize| (e * 7 + e / 64) % 16;
    let q5 = |e: usize| (e * 11 + 3) % 32;
    for five in [false, true] {
        let mut b = [f16le(0.25), f16le(0.125)].concat();
        b.extend(k_pack_scale_min(&sc, &m));
        let q = |e: usize| if five { q5(e) } else { q4(e) };
        if five {
            // qh byte l, bit c: fifth bit of element 32c + l.
            b.extend((0..32).map(|l| {
                (0..8)
                    .map(|c| ((q(32 * c + l) >> 4) as u8) << c)
                    .sum::<u8>()
            }));
        }
        // Nibble byte 32c + l: element 64c + l (low) and 64c + 32 + l (high).
        for c in 0..4 {
            b.extend(
                (0..32)
                    .map(|l| (q(64 * c + l) & 15) as u8 | (((q(64 * c + 32 + l) & 15) as u8) << 4)),
            );
        }
        let fmt = if five {
            QuantFormat::Q5K
        } else {
            QuantFormat::Q4K
        };
        assert_eq!(b.len(), fmt.block_bytes());
        let mut y = [0.0f32; 256];
        dequantize(fmt, &b, &mut y).unwrap();
        for e in 0..256 {
            let want = 0.25 * f32::from(sc[e / 32]) * q(e) as f32 - 0.125 * f32::from(m[e / 32]);
            assert_eq!(y[e], want, "{fmt} element {e}");
        }
    }
}

#[test]
fn dequantize_q6_k_hand_built_block() {
    let q = |e: usize| (e * 5 + e / 100) % 64;
    let sc: Vec<i8> = (0..16).map(|s| (s as i8 - 8) * 3).collect();
    let mut b = vec![0u8; 210];
    // Element 128n + 32·quarter + l: ql[64n + 32·(quarter & 1) + l], nibble quarter / 2; qh[32n + l], pair quarter.
    for e in 0..256 {
        let (n, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
        b[64 * n + 32 * (quarter & 1) + l] |= ((q(e) & 15) as u8) << (4 * (quarter / 2));
        b[128 + 32 * n + l] |= ((q(e) >> 4) as u8) << (2 * quarter);
    }
    for (s, v) in sc.iter().enumerate() {
        b[192 + s] = *v as u8;
    }
    b[208..210].copy_from_slice(&f16le(0.5));
    let mut y = [0.0f32; 256];
    dequantize(QuantFormat::Q6K, &b, &mut y).unwrap();
    for e in 0..256 {
        assert_eq!(
            y[e],
            0.5 * f32::from(sc[e / 16]) * (q(e) as f32 - 32.0),
            "{e}"
        );
    }
}

#[test]
fn dequantize_iq4_xs_hand_built_block() {
    let ls: Vec<u8> = (0..8).map(|ib| 10 + 7 * ib as u8).collect(); // 10..59: ls − 32 from −22 to 27
    let idx = |e: usize| (e * 3 + e / 32) % 16;
    let mut b = f16le(0.25).to_vec();
    let scales_h: u16 = (0..8).map(|ib| u16::from(ls[ib] >> 4) << (2 * ib)).sum();
    b.extend(scales_h.to_le_bytes());
    b.extend((0..4).map(|i| (ls[2 * i] & 15) | ((ls[2 * i + 1] & 15) << 4)));
    for ib in 0..8 {
        b.extend((0..16).map(|j| idx(32 * ib + j) as u8 | ((idx(32 * ib + 16 + j) as u8) << 4)));
    }
    let mut y = [0.0f32; 256];
    dequantize(QuantFormat::Iq4Xs, &b, &mut y).unwrap();
    for e in 0..256 {
        let want = 0.25 * (f32::from(ls[e / 32]) - 32.0) * f32::from(IQ4_VALUES[idx(e)]);
        assert_eq!(y[e], want, "{e}");
    }
}

#[test]
fn malformed_lengths_are_errors_not_panics() {
    let mut y = vec![0.0f32; 64];
    assert_eq!(
        dequantize(QuantFormat::Q8_0, &[0; 67], &mut y),
        Err(QuantError::ByteLength {
            expected: 68,
            found: 67
        })
    );
    assert_eq!(
        dequantize(QuantFormat::Q4K, &[0; 144], &mut y),
        Err(QuantError::RowLength {
            format: QuantFormat::Q4K,
            k: 64
        })
    );
    let row = [0u8; 144];
    assert_eq!(
        QuantMatrix::pack(QuantFormat::Q4K, 128, &[(&row[..], 1)]),
        Err(QuantError::RowLength {
            format: QuantFormat::Q4K,
            k: 128
        })
    );
    assert_eq!(
        QuantMatrix::pack(QuantFormat::Q4K, 256, &[(&row[..], 1), (&row[..143], 1)]),
        Err(QuantError::PartLength {
            part: 1,
            rows: 1,
            expected: 144,
            found: 143
        })
    );
    assert_eq!(
        QuantMatrix::pack(QuantFormat::Q4K, 256, &[(&row[..], usize::MAX)]),
        Err(QuantError::Overflow)
    );
    assert_eq!(QuantMatrix::packed_bytes(QuantFormat::Q6K, 3, 100), None);
    assert_eq!(
        QuantMatrix::packed_bytes(QuantFormat::Q8_0, usize::MAX, 32),
        None
    );
}

#[test]
fn rows_read_back_from_the_panels_equal_dequantize_of_their_gguf_bytes() {
    let mut r = StdRng::seed_from_u64(1);
    for fmt in QuantFormat::ALL {
        let k = if fmt.block_elems() == 32 { 96 } else { 512 };
        let rb = fmt.row_bytes(k).unwrap();
        // Two fused parts, 20 + 17 rows: n = 37 is not a multiple of 16.
        let (a, b) = (
            random_rows(&mut r, fmt, 20, k),
            random_rows(&mut r, fmt, 17, k),
        );
        let w = QuantMatrix::pack(fmt, k, &[(&a, 20), (&b, 17)]).unwrap();
        assert_eq!((w.n(), w.k(), w.format()), (37, k, fmt));
        assert_eq!(QuantMatrix::packed_bytes(fmt, 37, k), Some(w.bytes()));
        let mut got = vec![0.0f32; k];
        let mut want = vec![0.0f32; k];
        let mut gguf = vec![0u8; rb];
        for row in 0..37 {
            let src = if row < 20 {
                &a[row * rb..][..rb]
            } else {
                &b[(row - 20) * rb..][..rb]
            };
            w.row_into(row, &mut got);
            dequantize(fmt, src, &mut want).unwrap();
            assert_eq!(bits(&got), bits(&want), "{fmt} row {row}");
            if w.gguf_row_into(row, &mut gguf) {
                assert_eq!(gguf, src, "{fmt} row {row} bytes");
            }
        }
    }
}

#[test]
fn packed_memory_is_about_the_gguf_bytes() {
    let (n, k) = (1024, 3072);
    for (fmt, ratio) in [
        (QuantFormat::Q8_0, 1.0),
        (QuantFormat::Q4_0, 1.0),
        (QuantFormat::Q4K, 2368.0 / 16.0 / 144.0),
        (QuantFormat::Q5K, 2880.0 / 16.0 / 176.0),
        (QuantFormat::Q6K, 1.0),
        (QuantFormat::Iq4Xs, 2208.0 / 16.0 / 136.0),
    ] {
        let gguf = n * fmt.row_bytes(k).unwrap();
        let packed = QuantMatrix::packed_bytes(fmt, n, k).unwrap();
        assert_eq!(packed as f64 / gguf as f64, ratio, "{fmt}");
        assert!(ratio < 1.03);
    }
    // The generic formats: 4-bit codes (plus a fifth-bit plane) or 2-bit codes (plus a sign plane), an f32 d (and
    // dmin) per row and unit, i8 sub-scales (and u8 mins) per row and sub-block: the bytes of a 16-row unit, against
    // 16 GGUF blocks.
    for (fmt, unit_bytes) in [
        (QuantFormat::Q4_1, 128 + 256),
        (QuantFormat::Q5_0, 64 + 64 + 256),
        (QuantFormat::Q5_1, 128 + 64 + 256),
        (QuantFormat::Q2K, 128 + 8 * (128 + 32 + 32)),
        (QuantFormat::Q3K, 64 + 8 * (256 + 32)),
        (QuantFormat::Iq2Xxs, 64 + 8 * (64 + 128 + 16)),
        (QuantFormat::Iq2Xs, 64 + 8 * (64 + 128 + 32)),
        (QuantFormat::Iq2S, 64 + 8 * (64 + 128 + 32)),
        (QuantFormat::Iq3Xxs, 64 + 8 * (256 + 16)),
        (QuantFormat::Iq3S, 64 + 8 * (256 + 16)),
        (QuantFormat::Iq1S, 64 + 8 * (64 + 128 + 16)),
        (QuantFormat::Iq1M, 64 + 8 * (64 + 128 + 32)),
        (QuantFormat::Iq4Nl, 64 + 256),
        (QuantFormat::Tq1_0, 64 + 8 * 128),
        (QuantFormat::Tq2_0, 64 + 8 * 128),
        (QuantFormat::Mxfp4, 64 + 256),
    ] {
        let gguf = n * fmt.row_bytes(k).unwrap();
        let packed = QuantMatrix::packed_bytes(fmt, n, k).unwrap();
        let ratio = unit_bytes as f64 / (16 * fmt.block_bytes()) as f64;
        assert_eq!(packed as f64 / gguf as f64, ratio, "{fmt}");
    }
}

/// `qmatmul` into a strided output whose other columns hold a sentinel.
fn run(x: &QuantizedActs, w: &QuantMatrix, ldy: usize, reference: bool) -> Vec<f32> {
    let mut y = vec![-7.5f32; x.rows() * ldy];
    if reference {
        qmatmul_reference(x, w, &mut y, ldy);
    } else {
        qmatmul(x, w, &mut y, ldy);
    }
    for i in 0..x.rows() {
        assert!(
            y[i * ldy + w.n()..(i + 1) * ldy].iter().all(|&v| v == -7.5),
            "columns past n touched"
        );
    }
    y
}

/// Rayon pools of 1 and 2 threads.
fn pools() -> Vec<rayon::ThreadPool> {
    [1, 2]
        .map(|t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .into()
}

#[test]
fn qmatmul_equals_the_reference_bit_for_bit_for_every_format_shape_and_thread_count() {
    let mut r = StdRng::seed_from_u64(2);
    let pools = pools();
    for fmt in QuantFormat::ALL {
        for &k in ks(fmt) {
            for n in [1, 17, 48, 150] {
                let w = QuantMatrix::pack(fmt, k, &[(&random_rows(&mut r, fmt, n, k), n)]).unwrap();
                for m in [1, 2, 3, 5, 8, 9, 13, 64] {
                    if n == 150 && m > 13 {
                        continue;
                    }
                    let mut x = QuantizedActs::new();
                    x.quantize(&activations(&mut r, m, k), m, k);
                    let ldy = n + 3;
                    let want = run(&x, &w, ldy, true);
                    for pool in &pools {
                        let got = pool.install(|| run(&x, &w, ldy, false));
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{fmt} m={m} n={n} k={k} t={}",
                            pool.current_num_threads()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn long_rows_cut_into_k_ranges_give_the_same_bits() {
    // k = 2560: the many-row path cuts k into ranges of 24 blocks (4 ranges here) and n = 300 (19 panels) into cache
    // blocks of 16 panels, carrying the accumulators through y.
    let mut r = StdRng::seed_from_u64(5);
    let (n, k) = (300, 2560);
    let pools = pools();
    for fmt in QuantFormat::ALL {
        let w = QuantMatrix::pack(fmt, k, &[(&random_rows(&mut r, fmt, n, k), n)]).unwrap();
        for m in [2, 9] {
            let mut x = QuantizedActs::new();
            x.quantize(&activations(&mut r, m, k), m, k);
            let want = run(&x, &w, n + 1, true);
            for pool in &pools {
                let got = pool.install(|| run(&x, &w, n + 1, false));
                let t = pool.current_num_threads();
                assert_eq!(bits(&got), bits(&want), "{fmt} m={m} t={t}");
            }
        }
    }
}

#[test]
fn a_row_alone_gives_the_same_bits_as_inside_a_batch() {
    let mut r = StdRng::seed_from_u64(3);
    let (n, k, m) = (100, 512, 37);
    for fmt in QuantFormat::ALL {
        let w = QuantMatrix::pack(fmt, k, &[(&random_rows(&mut r, fmt, n, k), n)]).unwrap();
        let xf = activations(&mut r, m, k);
        let mut x = QuantizedActs::new();
        x.quantize(&xf, m, k);
        let batch = run(&x, &w, n, false);
        for i in [0, 5, 36] {
            x.quantize(&xf[i * k..(i + 1) * k], 1, k);
            assert_eq!(
                bits(&run(&x, &w, n, false)),
                bits(&batch[i * n..(i + 1) * n]),
                "{fmt} row {i}"
            );
        }
    }
}

#[test]
fn activation_quantization_rounds_to_nearest_with_amax_over_127() {
    // amax = 127/64, so dx = 1/64 exactly and x·(1/dx) is exact: the ties are real ties.
    let d = 1.0f32 / 64.0;
    let mut x = vec![0.0f32; 64];
    x[..6].copy_from_slice(&[-127.0 * d, 0.5 * d, 1.5 * d, 2.5 * d, -50.4 * d, 126.6 * d]);
    let mut q = QuantizedActs::new();
    q.quantize(&x, 1, 64);
    assert_eq!((q.rows(), q.k()), (1, 64));
    assert_eq!(q.row_scales(0), vec![d, 0.0]);
    let xq: Vec<f32> = q.row_dequantized(0).iter().map(|v| v / d).collect();
    assert_eq!(&xq[..6], &[-127.0, 0.0, 2.0, 2.0, -50.0, 127.0]);
    assert!(xq[6..].iter().all(|&v| v == 0.0));
    // Reuse with another shape.
    q.quantize(&[3.0; 96], 3, 32);
    assert_eq!((q.rows(), q.k()), (3, 32));
    assert!(q
        .row_dequantized(2)
        .iter()
        .all(|&v| v == 127.0 * (3.0f32 / 127.0)));
}

#[test]
fn large_activations_quantize_the_same_on_the_pool_as_row_by_row() {
    // 40 × 2048 elements: above the serial threshold, so rows are quantized in parallel.
    let mut r = StdRng::seed_from_u64(6);
    let (m, k) = (40, 2048);
    let xf = activations(&mut r, m, k);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut all = QuantizedActs::new();
    pool.install(|| all.quantize(&xf, m, k));
    let mut one = QuantizedActs::new();
    for i in 0..m {
        one.quantize(&xf[i * k..(i + 1) * k], 1, k);
        assert_eq!(
            bits(&all.row_dequantized(i)),
            bits(&one.row_dequantized(0)),
            "row {i}"
        );
        assert_eq!(all.row_scales(i), one.row_scales(0), "row {i}");
    }
}

#[test]
fn empty_shapes_compute_nothing_or_zeros() {
    for fmt in QuantFormat::ALL {
        let w = QuantMatrix::pack(fmt, 0, &[(&[], 3)]).unwrap();
        assert_eq!((w.n(), w.k(), w.bytes()), (3, 0, 0));
        let mut x = QuantizedActs::new();
        x.quantize(&[], 2, 0);
        for reference in [false, true] {
            assert_eq!(
                run(&x, &w, 4, reference),
                vec![0.0, 0.0, 0.0, -7.5, 0.0, 0.0, 0.0, -7.5]
            );
        }
        let k = fmt.block_elems();
        let w = QuantMatrix::pack(fmt, k, &[]).unwrap();
        assert_eq!((w.n(), w.bytes()), (0, 0));
        x.quantize(&vec![1.0; 2 * k], 2, k);
        assert_eq!(run(&x, &w, 1, false), vec![-7.5, -7.5]);
        x.quantize(&[], 0, k);
        assert!(run(
            &x,
            &QuantMatrix::pack(fmt, k, &[(&vec![0; fmt.block_bytes()], 1)]).unwrap(),
            1,
            false
        )
        .is_empty());
    }
}

#[test]
fn qmatmul_is_within_the_activation_rounding_bound_of_the_exact_product() {
    let mut r = StdRng::seed_from_u64(4);
    let (n, k, m) = (40, 1024, 6);
    for fmt in QuantFormat::ALL {
        let w = QuantMatrix::pack(fmt, k, &[(&random_rows(&mut r, fmt, n, k), n)]).unwrap();
        let wf = w.to_f32_rows();
        let xf: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let mut x = QuantizedActs::new();
        x.quantize(&xf, m, k);
        let y = run(&x, &w, n, false);
        let (mut err2, mut ref2, mut worst) = (0.0f64, 0.0f64, 0.0f64);
        for i in 0..m {
            let dx = x.row_scales(i);
            for j in 0..n {
                let (wr, xr) = (&wf[j * k..(j + 1) * k], &xf[i * k..(i + 1) * k]);
                let exact: f64 = wr
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let wmax = wr.iter().fold(0.0f64, |a, v| a.max(f64::from(v.abs())));
                // Activation rounding: |x − dx·xq| ≤ dx/2 (+ the rounding of 1/dx and of x·(1/dx)).
                let quant: f64 = (0..k)
                    .map(|kk| f64::from(wr[kk].abs()) * f64::from(dx[kk / 32]) * 0.500_02)
                    .sum();
                // Float rounding of the weights' scale products, the block terms and the k/32-long chain.
                let mag: f64 = (0..k)
                    .map(|kk| {
                        (f64::from(wr[kk].abs()) + wmax)
                            * (f64::from(xr[kk].abs()) + f64::from(dx[kk / 32]))
                    })
                    .sum();
                let slack = (k / 32 + 4) as f64 * 2f64.powi(-20) * mag;
                let e = (f64::from(y[i * n + j]) - exact).abs();
                assert!(
                    e <= quant + slack,
                    "{fmt} ({i}, {j}): error {e} > bound {quant} + {slack}"
                );
                worst = worst.max(e / quant);
                err2 += e * e;
                ref2 += exact * exact;
            }
        }
        eprintln!(
            "{fmt}: relative RMS error {:.2e}, worst error / bound {:.3}",
            (err2 / ref2).sqrt(),
            worst
        );
    }
}

#[test]
fn a_block_with_a_non_finite_scale_is_refused_with_its_row_and_block() {
    let mut r = StdRng::seed_from_u64(31);
    for fmt in QuantFormat::ALL {
        let (n, k) = (20, 2 * fmt.block_elems());
        let mut rows = random_rows(&mut r, fmt, n, k);
        assert!(QuantMatrix::pack(fmt, k, &[(&rows, n)]).is_ok(), "{fmt}");
        // MXFP4's E8M0 scale is finite for every byte as ggml reads it (0xFF is 2^127).
        if fmt == QuantFormat::Mxfp4 {
            continue;
        }
        // Row 17's second block gets an infinite d (IQ1_M: d's bits in its scale words).
        let at = 17 * fmt.row_bytes(k).unwrap() + fmt.block_bytes();
        fmt.write_scales(
            &mut rows[at..at + fmt.block_bytes()],
            f16::INFINITY,
            f16::from_f32(0.01),
        );
        let e = QuantMatrix::pack(fmt, k, &[(&rows, n)]).unwrap_err();
        assert_eq!(e, QuantError::NonFiniteScale { row: 17, block: 1 }, "{fmt}");
    }
}
