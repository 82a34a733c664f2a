//! Causal depthwise conv1d + SiLU over time with a carried state (the GDN short convolution).

use rayon::prelude::*;

use crate::simd::{dispatch, silu, Isa, Kernel};

/// Tokens per rayon task.
const TOKEN_BLOCK: usize = 16;

/// Causal depthwise conv1d + SiLU over time with carried state.
///
/// For every channel `c` and token `t` (ARCH_SPEC "Gated DeltaNet layer", HF `Qwen3_5GatedDeltaNet` with
/// `causal_conv1d_fn` semantics):
/// `out[t][c] = silu( Σ_{j<kernel} weight[c][j] · xe[t + j][c] )` where `xe` is the raw input sequence with
/// the carried state prepended (`xe = state rows (oldest first) ++ x`), i.e. `weight[c][kernel-1]`
/// multiplies the current token and zero state means zero left padding.
///
/// * `x`: `[n_tokens, conv_dim]` f32, the raw `in_proj_qkv` output;
/// * `weight`: `[conv_dim, kernel]` f32 (HF `conv1d.weight` `[conv_dim, 1, kernel]` flattened);
/// * `state`: `[conv_dim, kernel-1]` f32, the previous `kernel-1` raw inputs of each channel, oldest first
///   (zeros at sequence start); updated in place to the last `kernel-1` raw inputs of `xe` (so it still
///   holds older state entries when `n_tokens < kernel-1`);
/// * `out`: `[n_tokens, conv_dim]` f32, written.
///
/// Each output is the same sequence of f32 operations whatever the split of the sequence into calls, so
/// calling on `[0, a)` then `[a, n)` gives bit-identical outputs and state to one call on `[0, n)`.
///
/// Panics if `kernel == 0` or a slice length does not match its shape.
pub fn causal_conv1d_silu(
    x: &[f32],
    n_tokens: usize,
    conv_dim: usize,
    kernel: usize,
    weight: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(kernel > 0, "causal_conv1d_silu: kernel must be positive");
    let h = kernel - 1;
    // The shape text is built only on a failure (this runs once per q/k/v head per decode token).
    let check = |name: &str, len: usize, rows: usize, cols: usize| {
        assert_eq!(
            len,
            rows * cols,
            "causal_conv1d_silu: `{name}` must have shape [{rows}, {cols}] ({} values), got {len} values",
            rows * cols
        );
    };
    check("x", x.len(), n_tokens, conv_dim);
    check("weight", weight.len(), conv_dim, kernel);
    check("state", state.len(), conv_dim, h);
    check("out", out.len(), n_tokens, conv_dim);
    if conv_dim == 0 {
        return;
    }
    if n_tokens == 1 {
        return conv_one_token(x, kernel, weight, state, out);
    }

    // Transpose weight to [kernel, conv_dim] and the state to rows [h, conv_dim] so every inner loop runs
    // contiguously over channels.
    let mut wt = vec![0.0f32; kernel * conv_dim];
    let mut hist = vec![0.0f32; h * conv_dim];
    for c in 0..conv_dim {
        for j in 0..kernel {
            wt[j * conv_dim + c] = weight[c * kernel + j];
        }
        for s in 0..h {
            hist[s * conv_dim + c] = state[c * h + s];
        }
    }
    // Row `i` of the extended sequence `xe` (state rows then x rows).
    let xe = |i: usize| -> &[f32] {
        if i < h {
            &hist[i * conv_dim..(i + 1) * conv_dim]
        } else {
            &x[(i - h) * conv_dim..(i - h + 1) * conv_dim]
        }
    };

    out.par_chunks_mut(TOKEN_BLOCK * conv_dim)
        .enumerate()
        .for_each(|(b, block)| {
            for (i, row) in block.chunks_exact_mut(conv_dim).enumerate() {
                let t = b * TOKEN_BLOCK + i;
                row.fill(0.0);
                for j in 0..kernel {
                    let w = &wt[j * conv_dim..(j + 1) * conv_dim];
                    for ((o, wi), xi) in row.iter_mut().zip(w).zip(xe(t + j)) {
                        *o += wi * xi;
                    }
                }
                dispatch(SiluInPlace(row));
            }
        });

    // New state: rows [n_tokens, n_tokens + h) of xe.
    let mut new_rows = vec![0.0f32; h * conv_dim];
    for s in 0..h {
        new_rows[s * conv_dim..(s + 1) * conv_dim].copy_from_slice(xe(n_tokens + s));
    }
    for c in 0..conv_dim {
        for s in 0..h {
            state[c * h + s] = new_rows[s * conv_dim + c];
        }
    }
}

/// The decode case of [`causal_conv1d_silu`] (one token), channel by channel with no buffers: the same operations in
/// the same order as the general path (`acc += w[c][j]·xe[j][c]` for `j` in order, then SiLU).
fn conv_one_token(x: &[f32], kernel: usize, weight: &[f32], state: &mut [f32], out: &mut [f32]) {
    let h = kernel - 1;
    if h == 0 {
        for ((o, w), xc) in out.iter_mut().zip(weight).zip(x) {
            *o = 0.0 + w * xc;
        }
    } else if kernel == 4 {
        // the architecture's kernel: fixed-size rows, which vectorize over channels with the machine's ISA
        dispatch(OneToken4 {
            x,
            weight,
            state,
            out: &mut *out,
        });
    } else {
        // Pre-activations first (the state shifted by hand: a `copy_within` per channel was a `memmove` call each),
        // then SiLU over the row.
        for (((o, w), st), &xc) in out
            .iter_mut()
            .zip(weight.chunks_exact(kernel))
            .zip(state.chunks_exact_mut(h))
            .zip(x)
        {
            let mut acc = 0.0f32;
            for j in 0..h {
                acc += w[j] * st[j];
            }
            *o = acc + w[h] * xc;
            for j in 1..h {
                st[j - 1] = st[j];
            }
            st[h - 1] = xc;
        }
    }
    dispatch(SiluInPlace(out));
}

/// [`conv_one_token`]'s pre-activations for kernel 4, as a [`Kernel`]: per channel the same products and sums in the
/// same order (`((0 + w₀s₀) + w₁s₁) + w₂s₂) + w₃x`, no fused multiply-add) on `[f32; 4]` weight and `[f32; 3]`
/// state rows, so LLVM vectorizes over channels with interleaved loads (the loop over `kernel` did not).
struct OneToken4<'a> {
    x: &'a [f32],
    weight: &'a [f32],
    state: &'a mut [f32],
    out: &'a mut [f32],
}

impl Kernel for OneToken4<'_> {
    type Out = ();

    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        let (w, _) = self.weight.as_chunks::<4>();
        let (st, _) = self.state.as_chunks_mut::<3>();
        for (((o, w), s), &xc) in self.out.iter_mut().zip(w).zip(st).zip(self.x) {
            *o = 0.0 + w[0] * s[0] + w[1] * s[1] + w[2] * s[2] + w[3] * xc;
            *s = [s[1], s[2], xc];
        }
    }
}

/// `x ← silu(x)` elementwise, as a [`Kernel`] so that the loop vectorizes with the machine's instruction set
/// (the same bits on every one: `silu` is plain IEEE arithmetic).
struct SiluInPlace<'a>(&'a mut [f32]);

impl Kernel for SiluInPlace<'_> {
    type Out = ();

    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        for o in self.0.iter_mut() {
            *o = silu(*o);
        }
    }
}
