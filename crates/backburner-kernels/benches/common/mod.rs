//! What the product benches share (each bench uses part of it).
#![allow(dead_code)]

use backburner_kernels::quant::QuantFormat;
use rand::rngs::StdRng;
use rand::Rng;

/// `n` random GGUF rows of `k` elements in `fmt`: random bytes with bit 6 clear (any f16 field is then finite, its
/// exponent below 31, whatever the format's layout; the packing refuses non-finite scales), and small finite f16 `d`
/// (and `dmin`) where the K-quants and the 32-blocks keep them. The values do not change a product's time.
pub fn random_gguf(r: &mut StdRng, fmt: QuantFormat, n: usize, k: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..n * fmt.row_bytes(k).unwrap())
        .map(|_| r.random::<u8>() & 0xBF)
        .collect();
    let fields: &[usize] = match fmt {
        QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
        _ => &[0],
    };
    for blk in b.chunks_exact_mut(fmt.block_bytes()) {
        for &at in fields {
            let v = half::f16::from_f32(r.random_range(0.001f32..0.01));
            blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    b
}

/// `n × k` random bf16 weights in `[-0.05, 0.05)`, little-endian bytes (row-major `[n, k]`).
pub fn random_bf16(r: &mut StdRng, n: usize, k: usize) -> Vec<u8> {
    (0..n * k)
        .flat_map(|_| {
            half::bf16::from_f32(r.random_range(-0.05f32..0.05))
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

/// The bench's arguments after the harness's `--bench`, and the first two as `[rounds] [threads]` (defaults 5
/// and 1).
pub fn bench_args() -> (Vec<String>, usize, usize) {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let rounds = args.first().and_then(|s| s.parse().ok()).unwrap_or(5);
    let threads = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    (args, rounds, threads)
}
