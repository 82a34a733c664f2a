//! Every GGUF block type against gguf-py: `fixtures/quants/ggml_blocks.bin` holds random blocks of each type (scale
//! fields finite; over a type's blocks every i-quant grid row is used) and gguf-py's `dequantize` of them
//! (`scripts/make_quant_fixture.py`). Our `dequantize` must give the same values bit for bit, and the panels (and so
//! the kernels, which read the panels) must hold the same weights.

use backburner_kernels::quant::{
    dequantize, qmatmul, qmatmul_reference, QuantFormat, QuantMatrix, QuantizedActs,
};

/// One type's blocks and gguf-py's values.
struct Case {
    fmt: QuantFormat,
    blocks: usize,
    bytes: Vec<u8>,
    values: Vec<f32>,
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

fn cases() -> Vec<Case> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/quants/ggml_blocks.bin"
    );
    let f = std::fs::read(path).expect("fixtures/quants/ggml_blocks.bin");
    assert_eq!(&f[..4], b"BBQF");
    let mut at = 8;
    let mut out = Vec::new();
    for _ in 0..u32_at(&f, 4) {
        let (id, n, bb, be) = (
            u32_at(&f, at) as u32,
            u32_at(&f, at + 4),
            u32_at(&f, at + 8),
            u32_at(&f, at + 12),
        );
        at += 16;
        let fmt = QuantFormat::from_ggml_type(id).expect("a type we know");
        assert_eq!((fmt.block_bytes(), fmt.block_elems()), (bb, be), "{fmt}");
        let bytes = f[at..at + n * bb].to_vec();
        at += n * bb;
        let values = f[at..at + 4 * n * be]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += 4 * n * be;
        out.push(Case {
            fmt,
            blocks: n,
            bytes,
            values,
        });
    }
    assert_eq!(at, f.len());
    out
}

#[test]
fn the_fixture_covers_every_type() {
    let got: Vec<QuantFormat> = cases().iter().map(|c| c.fmt).collect();
    assert_eq!(got, QuantFormat::ALL.to_vec());
}

#[test]
fn dequantize_equals_gguf_py_value_for_value_for_every_type() {
    for c in cases() {
        let mut y = vec![0.0f32; c.values.len()];
        dequantize(c.fmt, &c.bytes, &mut y).unwrap();
        for (e, (a, b)) in y.iter().zip(&c.values).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{} element {e}: {a} vs gguf-py {b}",
                c.fmt
            );
        }
    }
}

/// The weights as the kernels see them: a one-hot activation row per input picks out a column of `W` exactly when
/// the activation block's scale is 1/127 · 127 = 1 (one input of 1.0 in an otherwise zero block quantizes to 127
/// with `dx = 1/127`); so each product `y = W·e_i` is `w_i·127·(1/127)` rounded once. Compared against gguf-py's
/// value pushed through the same rounding.
#[test]
fn the_panels_hold_gguf_py_s_weights_for_every_type() {
    for c in cases() {
        let k = c.fmt.block_elems();
        let n = c.blocks;
        let w = QuantMatrix::pack(c.fmt, k, &[(&c.bytes, n)]).unwrap();
        let mut x = vec![0.0f32; k * k];
        for i in 0..k {
            x[i * k + i] = 1.0;
        }
        let mut xq = QuantizedActs::new();
        xq.quantize(&x, k, k);
        let mut y = vec![0.0f32; k * n];
        qmatmul(&xq, &w, &mut y, n);
        let mut want = vec![0.0f32; k * n];
        qmatmul_reference(&xq, &w, &mut want, n);
        let dx = 1.0f32 / 127.0;
        for i in 0..k {
            for j in 0..n {
                let got = y[i * n + j];
                assert_eq!(
                    got.to_bits(),
                    want[i * n + j].to_bits(),
                    "{} kernel vs reference",
                    c.fmt
                );
                let v = c.values[j * k + i];
                let close = (got - v).abs() <= v.abs() * 2e-6 + f32::MIN_POSITIVE;
                assert!(
                    close,
                    "{} row {j} input {i}: {got} vs gguf-py {v} (dx {dx})",
                    c.fmt
                );
            }
        }
    }
}
