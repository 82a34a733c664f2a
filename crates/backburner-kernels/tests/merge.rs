//! LSE merge of attention partials: identity, order independence, reproducibility.

use crate::common;

use backburner_kernels::attention::{merge_into, Partial};
use common::*;
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::Rng;

/// A random partial: o in [-1, 1), lse in [-10, 10), about one row in five empty (-inf, o = 0).
fn random_partial(n_tokens: usize, n_heads: usize, head_dim: usize, seed: u64) -> Partial {
    let mut r = rng(seed);
    let mut p = Partial::empty(n_tokens, n_heads, head_dim);
    for row in 0..n_tokens * n_heads {
        if r.random_range(0..5) == 0 {
            continue;
        }
        p.lse[row] = r.random_range(-10.0..10.0);
        for x in &mut p.o[row * head_dim..(row + 1) * head_dim] {
            *x = r.random_range(-1.0..1.0);
        }
    }
    p
}

fn fold(parts: &[&Partial]) -> Partial {
    let mut acc = Partial::empty(parts[0].n_tokens, parts[0].n_heads, parts[0].head_dim);
    for p in parts {
        merge_into(&mut acc, p);
    }
    acc
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any permutation of the merge order gives the same result within f32 rounding: each merge is a
    /// convex combination (|o| <= 1) with weights from one f32 exp each, so a handful of merges stays
    /// within a few 1e-7; 1e-5 absolute on o and 1e-5·max(1, |λ|) on lse is a safe bound.
    #[test]
    fn merge_is_order_independent_within_tolerance(
        n_parts in 2usize..7,
        n_tokens in 1usize..4,
        n_heads in 1usize..4,
        head_dim in 1usize..9,
        seed in any::<u64>(),
        perm_seed in any::<u64>(),
    ) {
        let parts: Vec<Partial> = (0..n_parts)
            .map(|i| random_partial(n_tokens, n_heads, head_dim, seed.wrapping_add(i as u64)))
            .collect();
        let in_order: Vec<&Partial> = parts.iter().collect();
        let mut shuffled = in_order.clone();
        shuffled.shuffle(&mut rng(perm_seed));
        let a = fold(&in_order);
        let b = fold(&shuffled);
        prop_assert!(max_diff(&a.o, &b.o) <= 1e-5, "o differs by {}", max_diff(&a.o, &b.o));
        for (x, y) in a.lse.iter().zip(&b.lse) {
            if *x == f32::NEG_INFINITY || *y == f32::NEG_INFINITY {
                prop_assert_eq!(x, y);
            } else {
                prop_assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "lse {} vs {}", x, y);
            }
        }
    }

    /// Merging with an empty partial, on either side, is an exact identity.
    #[test]
    fn merging_with_an_empty_partial_is_an_exact_identity(
        n_tokens in 1usize..4,
        n_heads in 1usize..4,
        head_dim in 1usize..9,
        seed in any::<u64>(),
    ) {
        let p = random_partial(n_tokens, n_heads, head_dim, seed);
        let mut left = p.clone();
        merge_into(&mut left, &Partial::empty(n_tokens, n_heads, head_dim));
        let mut right = Partial::empty(n_tokens, n_heads, head_dim);
        merge_into(&mut right, &p);
        for got in [&left, &right] {
            prop_assert_eq!(bits(&got.o), bits(&p.o));
            prop_assert_eq!(bits(&got.lse), bits(&p.lse));
        }
    }
}

#[test]
fn merge_in_a_fixed_order_is_bit_reproducible_for_any_thread_count() {
    let parts: Vec<Partial> = (0..8).map(|i| random_partial(16, 6, 64, 100 + i)).collect();
    let refs: Vec<&Partial> = parts.iter().collect();
    let first = fold(&refs);
    for threads in [1, 2, 5] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let again = pool.install(|| fold(&refs));
        assert_eq!(bits(&again.o), bits(&first.o));
        assert_eq!(bits(&again.lse), bits(&first.lse));
    }
}

#[test]
fn merge_of_two_partials_weights_them_by_their_sum_of_exponentials() {
    // Partial 1 saw keys with Σ exp = 1 (λ = 0) and o = 1; partial 2 saw Σ exp = 3 (λ = ln 3) and o = -1:
    // the merge is (1·1 + 3·(−1)) / 4 = −0.5 with λ = ln 4.
    let mut a = Partial::empty(1, 1, 1);
    a.o[0] = 1.0;
    a.lse[0] = 0.0;
    let mut b = Partial::empty(1, 1, 1);
    b.o[0] = -1.0;
    b.lse[0] = 3.0f32.ln();
    merge_into(&mut a, &b);
    assert!((a.o[0] + 0.5).abs() < 1e-6, "{}", a.o[0]);
    assert!((a.lse[0] - 4.0f32.ln()).abs() < 1e-6, "{}", a.lse[0]);
}

#[test]
fn merging_two_empty_partials_stays_empty() {
    let mut a = Partial::empty(2, 3, 4);
    merge_into(&mut a, &Partial::empty(2, 3, 4));
    assert_eq!(a, Partial::empty(2, 3, 4));
}

#[test]
#[should_panic(expected = "shapes differ")]
fn merging_partials_of_different_shapes_panics() {
    let mut a = Partial::empty(2, 3, 4);
    merge_into(&mut a, &Partial::empty(2, 3, 5));
}
