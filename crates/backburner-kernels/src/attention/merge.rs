//! The LSE merge of two attention partials.

use super::Partial;

/// `acc ← merge(acc, other)` by log-sum-exp, row by row (`[n_tokens, n_heads]` rows of `head_dim`):
///
/// ```text
/// m = max(λ1, λ2);  w_i = exp(λ_i − m);  o = (w1·o1 + w2·o2)/(w1 + w2);  λ = m + ln(w1 + w2)
/// ```
///
/// (the online-softmax normalizer update of Milakov & Gimelshein 2018, as used by FlashAttention). A row
/// whose `other.lse` is `-inf` is left untouched and a row whose `acc.lse` is `-inf` becomes a copy of
/// `other`'s, so merging with [`Partial::empty`] on either side is an exact identity; both `-inf` stays
/// empty. Computed in f32, one row at a time in a fixed order: deterministic. In floats the merge is
/// commutative but only approximately associative — fix the order (see
/// [`attend_pages`](super::attend_pages)) for reproducible bits.
///
/// Panics if the shapes of `acc` and `other` differ or a partial's vectors do not match its fields.
pub fn merge_into(acc: &mut Partial, other: &Partial) {
    assert!(
        acc.is_consistent() && other.is_consistent(),
        "merge_into: partial vectors do not match their shape fields"
    );
    assert!(
        acc.n_tokens == other.n_tokens
            && acc.n_heads == other.n_heads
            && acc.head_dim == other.head_dim,
        "merge_into: shapes differ: [{}, {}, {}] vs [{}, {}, {}]",
        acc.n_tokens,
        acc.n_heads,
        acc.head_dim,
        other.n_tokens,
        other.n_heads,
        other.head_dim
    );
    let dim = acc.head_dim;
    for (row, (l1, &l2)) in acc.lse.iter_mut().zip(&other.lse).enumerate() {
        if l2 == f32::NEG_INFINITY {
            continue;
        }
        let o1 = &mut acc.o[row * dim..(row + 1) * dim];
        let o2 = &other.o[row * dim..(row + 1) * dim];
        if *l1 == f32::NEG_INFINITY {
            o1.copy_from_slice(o2);
            *l1 = l2;
            continue;
        }
        let m = l1.max(l2);
        let w1 = (*l1 - m).exp();
        let w2 = (l2 - m).exp();
        let sum = w1 + w2;
        let (c1, c2) = (w1 / sum, w2 / sum);
        for (a, b) in o1.iter_mut().zip(o2) {
            *a = c1 * *a + c2 * b;
        }
        *l1 = m + sum.ln();
    }
}
