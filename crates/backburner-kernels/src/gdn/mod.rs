//! Gated DeltaNet (linear attention) kernels.
//!
//! Math: "Gated Delta Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh 2024) and the
//! Hugging Face transformers `qwen3_5` reference, as written down in `ARCH_SPEC.md` ("Gated DeltaNet
//! layer"). Per v head `j` with state `S ∈ R^{d_k×d_v}` and one token `(q, k, v, g, β)`:
//!
//! ```text
//! S ← exp(g)·S;  u = Sᵀk;  δ = β·(v − u);  S ← S + k ⊗ δ;  o = Sᵀq
//! ```
//!
//! * [`causal_conv1d_silu`]: the depthwise causal conv + SiLU applied to the raw `in_proj_qkv` output.
//! * [`delta_rule_recurrent`]: the recurrence token by token (decode path).
//! * [`delta_rule_chunked`]: the same result through the chunked WY/UT form (prefill path).
//! * [`delta_rule_decode_step`]: one decode token of the whole core (conv, q/k norms, recurrence, gated norm) in one
//!   parallel region, bit-identical to the separate kernels.
//! * [`delta_rule_recurrent_from`] and [`delta_rule_replay`]: the recurrence out of place (a speculative verify keeps
//!   the state it started from) and state-only (a rollback replays the accepted tokens), with the recurrence's bits.
//!
//! Both delta rules run each head with subnormals flushed to zero on x86-64 (`flush.rs`: several times faster for
//! fast-forgetting heads on Intel cores; only values below 2^-126 change).
//!
//! GQA-style sharing: v head `j` reads q/k head `j / (n_v_heads / n_k_heads)` (HF `repeat_interleave`).

mod chunked;
mod conv;
mod decode;
mod flush;
mod linalg;
mod recurrent;
mod verify;

pub use chunked::delta_rule_chunked;
pub use conv::causal_conv1d_silu;
pub use decode::{delta_rule_decode_step, DecodeInputs};
pub use recurrent::delta_rule_recurrent;
pub use verify::{delta_rule_recurrent_from, delta_rule_replay};

/// Shapes of one Gated DeltaNet call.
///
/// * `n_tokens`: tokens in the call (may be 0);
/// * `n_k_heads`: q/k heads (`linear_num_key_heads`, Hk);
/// * `n_v_heads`: v heads (`linear_num_value_heads`, Hv), a positive multiple of `n_k_heads`;
/// * `d_k`: q/k head dim (Dk); `d_v`: v head dim (Dv).
///
/// * `tiled_v_heads`: the order of the v heads. `false` (Hugging Face checkpoints): grouped by q/k head, v head `j`
///   reads q/k head `j / (n_v_heads / n_k_heads)` (repeat_interleave). `true` (llama.cpp's GGUF files, whose
///   converter reorders the v heads so that ggml can broadcast): tiled, v head `j` reads q/k head `j % n_k_heads`.
///   The two orders are one permutation of the v heads (and of every per-v-head weight), so they compute the
///   same function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    /// Tokens in this call.
    pub n_tokens: usize,
    /// Query/key heads.
    pub n_k_heads: usize,
    /// Value heads (a multiple of `n_k_heads`).
    pub n_v_heads: usize,
    /// Query/key head dimension.
    pub d_k: usize,
    /// Value head dimension.
    pub d_v: usize,
    /// Tiled (GGUF) rather than grouped (Hugging Face) v-head order.
    pub tiled_v_heads: bool,
}

impl GdnDims {
    /// v heads per q/k head; panics if the head counts are zero or `n_v_heads % n_k_heads != 0`.
    pub(crate) fn ratio(&self) -> usize {
        assert!(
            self.n_k_heads > 0 && self.n_v_heads > 0,
            "GdnDims: head counts must be positive, got {self:?}"
        );
        assert!(
            self.n_v_heads.is_multiple_of(self.n_k_heads),
            "GdnDims: n_v_heads ({}) must be a multiple of n_k_heads ({})",
            self.n_v_heads,
            self.n_k_heads
        );
        assert!(
            self.d_k > 0 && self.d_v > 0,
            "GdnDims: head dims must be positive, got {self:?}"
        );
        self.n_v_heads / self.n_k_heads
    }

    /// The q/k head that v head `j` reads (see [`GdnDims`]). Panics if the head counts are zero or
    /// `n_v_heads % n_k_heads != 0`.
    pub fn k_head(&self, j: usize) -> usize {
        if self.tiled_v_heads {
            self.ratio();
            j % self.n_k_heads
        } else {
            j / self.ratio()
        }
    }

    /// Asserts the lengths of every delta-rule argument against these dims (see [`delta_rule_recurrent`]); `q` and
    /// `out` are `None` for a call that computes no output.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_delta_args(
        &self,
        what: &str,
        q: Option<&[f32]>,
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
        out: Option<&[f32]>,
    ) {
        self.ratio();
        let t = self.n_tokens;
        let qk = t * self.n_k_heads * self.d_k;
        let check = |name: &str, len: usize, want: usize, shape: String| {
            assert_eq!(
                len, want,
                "{what}: `{name}` must have shape {shape} ({want} values), got {len} values"
            );
        };
        if let Some(q) = q {
            check(
                "q",
                q.len(),
                qk,
                format!("[{t}, {}, {}]", self.n_k_heads, self.d_k),
            );
        }
        check(
            "k",
            k.len(),
            qk,
            format!("[{t}, {}, {}]", self.n_k_heads, self.d_k),
        );
        let vt = t * self.n_v_heads * self.d_v;
        check(
            "v",
            v.len(),
            vt,
            format!("[{t}, {}, {}]", self.n_v_heads, self.d_v),
        );
        check(
            "g",
            g.len(),
            t * self.n_v_heads,
            format!("[{t}, {}]", self.n_v_heads),
        );
        check(
            "beta",
            beta.len(),
            t * self.n_v_heads,
            format!("[{t}, {}]", self.n_v_heads),
        );
        let s = self.n_v_heads * self.d_k * self.d_v;
        check(
            "state",
            state.len(),
            s,
            format!("[{}, {}, {}]", self.n_v_heads, self.d_k, self.d_v),
        );
        if let Some(out) = out {
            check(
                "out",
                out.len(),
                vt,
                format!("[{t}, {}, {}]", self.n_v_heads, self.d_v),
            );
        }
    }
}

/// Copies head `head`'s rows of a `[n_tokens, n_heads, dim]` tensor for tokens `[t0, t0 + n)` into
/// `dst` as `[n, dim]`.
pub(crate) fn gather_head(
    src: &[f32],
    n_heads: usize,
    dim: usize,
    head: usize,
    t0: usize,
    n: usize,
    dst: &mut [f32],
) {
    for (i, row) in dst[..n * dim].chunks_exact_mut(dim).enumerate() {
        let base = ((t0 + i) * n_heads + head) * dim;
        row.copy_from_slice(&src[base..base + dim]);
    }
}

/// Writes per-head outputs `[n_v_heads][n_tokens, d_v]` into `out: [n_tokens, n_v_heads, d_v]`.
pub(crate) fn scatter_heads(heads: &[Vec<f32>], n_tokens: usize, d_v: usize, out: &mut [f32]) {
    let n_heads = heads.len();
    for (j, h) in heads.iter().enumerate() {
        for t in 0..n_tokens {
            let dst = (t * n_heads + j) * d_v;
            out[dst..dst + d_v].copy_from_slice(&h[t * d_v..(t + 1) * d_v]);
        }
    }
}
