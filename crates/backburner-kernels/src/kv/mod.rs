//! Paged KV cache of one full-attention layer (DESIGN.md §3.3, §4).
//!
//! A [`PagedKvCache`] is a list of [`KvPage`]s of a fixed capacity (`page_size` positions); only the last
//! page may be partly filled. K and V rows go in and come out as `[len, n_kv_heads, head_dim]` in a [`KvDtype`]
//! (f16 → f32 is exact); inside a page they are stored in the attention kernel's block layout.

mod cache;
mod packed;
pub(crate) mod page;
pub(crate) mod tiles;
mod view;

use std::fmt;
use std::str::FromStr;

pub use cache::{KvError, PagedKvCache};
pub use packed::PackedPage;
pub use page::KvPage;
pub use tiles::{k_pair_tile_offset, k_tile_offset, v_pair_tile_offset, v_tile_offset, V_QUAD};
pub use view::{PageLayout, PageView, PageViewError, RowsRef};

/// Positions per storage block of a page: the attention kernel reads one block of one KV head as one contiguous
/// run of keys (transposed) and one of values (see [`KvPage`]).
pub const KV_BLOCK: usize = 64;

/// Width of the lane groups inside a block: 16 keys of K (one vector of the attention kernel), 16 dimensions of V.
pub const KV_LANES: usize = 16;

/// Offset of key `lane` (`< KV_BLOCK`), dimension `d` (`< dim`) inside one KV head's K block of `dim · KV_BLOCK`
/// elements, laid out `[KV_BLOCK / 16][dim][16]`: the 16 keys of a lane group are one vector per dimension, and a
/// lane group's `dim` vectors are one contiguous run, so each pass of the kernel over the dimensions reads memory
/// in order. The block layout of pages on the link (docs/PROTOCOL.md §5.11). Arguments out of range give a
/// meaningless offset.
#[inline]
pub fn k_offset(dim: usize, lane: usize, d: usize) -> usize {
    ((lane / KV_LANES) * dim + d) * KV_LANES + lane % KV_LANES
}

/// Offset of key `j` (`< KV_BLOCK`), dimension `d` (`< dim`) inside one KV head's V block of `dim · KV_BLOCK`
/// elements, laid out as chunks of 16 dimensions, `[⌈dim / 16⌉][KV_BLOCK][w]` with `w = 16` (the last chunk
/// `dim mod 16` wide when that is not 0): one chunk of every key is one contiguous run, read in order by the
/// kernel's pass over the keys for those 16 output dimensions. The block layout of pages on the link
/// (docs/PROTOCOL.md §5.11). Panics (in debug builds) or gives a meaningless offset if `d ≥ dim`.
#[inline]
pub fn v_offset(dim: usize, j: usize, d: usize) -> usize {
    let c = d / KV_LANES;
    let w = (dim - c * KV_LANES).min(KV_LANES);
    c * KV_LANES * KV_BLOCK + j * w + d % KV_LANES
}

/// Offset of key `lane` (`< KV_BLOCK`), dimension `d` (`< dim`, `dim` even) inside one KV head's K block of
/// bf16 pages: `[KV_BLOCK / 16][dim / 2][16][2]`, as [`k_offset`] with the dimensions taken in pairs, so one vector
/// of 32 bf16 holds dimensions `2i, 2i + 1` of 16 keys: the operand of one `vdpbf16ps` against a query's pair. The
/// block layout of bf16 pages on the link (docs/PROTOCOL.md §5.11).
#[inline]
pub fn k_pair_offset(dim: usize, lane: usize, d: usize) -> usize {
    (((lane / KV_LANES) * (dim / 2) + d / 2) * KV_LANES + lane % KV_LANES) * 2 + d % 2
}

/// Offset of key `j` (`< KV_BLOCK`), dimension `d` (`< dim`) inside one KV head's V block of bf16 pages: chunks of
/// 16 dimensions as in [`v_offset`], each `[KV_BLOCK / 2][w][2]` (`w = 16`, or `dim mod 16` for the last chunk):
/// keys taken in pairs, so one vector of 32 bf16 holds keys `2i, 2i + 1` of 16 dimensions, the operand of one
/// `vdpbf16ps` against a pair of softmax weights. The block layout of bf16 pages on the link (docs/PROTOCOL.md
/// §5.11).
#[inline]
pub fn v_pair_offset(dim: usize, j: usize, d: usize) -> usize {
    let c = d / KV_LANES;
    let w = (dim - c * KV_LANES).min(KV_LANES);
    c * KV_LANES * KV_BLOCK + ((j / 2) * w + d % KV_LANES) * 2 + j % 2
}

/// Storage dtype of KV rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE 754 binary16; f32 inputs are rounded to nearest even on append.
    F16,
    /// IEEE 754 binary32; stored as given.
    F32,
    /// bfloat16 (f32's exponent, 8 significant bits); f32 inputs are rounded to nearest even on append. Pages keep
    /// pairs of dimensions (K) and of keys (V) side by side ([`k_pair_offset`], [`v_pair_offset`]) and attention
    /// multiplies them with bf16 dot products (`vdpbf16ps`, or its exact emulation): queries and softmax weights are
    /// rounded to bf16, as llama.cpp does with `-ctk bf16 -ctv bf16` without flash attention. Needs an even
    /// `head_dim`.
    Bf16,
}

impl KvDtype {
    /// Bytes per stored element: 2 for [`KvDtype::F16`] and [`KvDtype::Bf16`], 4 for [`KvDtype::F32`].
    pub fn size_of(self) -> usize {
        match self {
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// The lowercase name, `"f16"`, `"f32"` or `"bf16"` (what [`FromStr`] accepts and [`fmt::Display`] prints).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Whether pages of this dtype keep pairs side by side ([`k_pair_offset`], [`v_pair_offset`]).
    pub fn pairs(self) -> bool {
        self == KvDtype::Bf16
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error of parsing a [`KvDtype`] from a string other than `"f16"`, `"f32"` or `"bf16"`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV dtype {0:?} (expected \"f16\", \"f32\" or \"bf16\")")]
pub struct ParseKvDtypeError(pub String);

impl FromStr for KvDtype {
    type Err = ParseKvDtypeError;

    /// Parses `"f16"`, `"f32"` or `"bf16"` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            "bf16" => Ok(KvDtype::Bf16),
            _ => Err(ParseKvDtypeError(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_round_trips_through_its_name() {
        for d in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
            assert_eq!(d.to_string().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!("F16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert_eq!("BF16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert_eq!(
            "q8_0".parse::<KvDtype>(),
            Err(ParseKvDtypeError("q8_0".into()))
        );
        assert_eq!(KvDtype::F16.size_of(), 2);
        assert_eq!(KvDtype::Bf16.size_of(), 2);
        assert_eq!(KvDtype::F32.size_of(), 4);
    }

    #[test]
    fn the_block_layouts_place_every_element_once_where_the_docs_say() {
        // K: lane group, then dimension, then the key's lane in its group.
        assert_eq!(k_offset(128, 0, 0), 0);
        assert_eq!(k_offset(128, 15, 0), 15);
        assert_eq!(k_offset(128, 0, 1), 16);
        assert_eq!(k_offset(128, 16, 0), 128 * 16);
        assert_eq!(k_offset(128, 63, 127), 64 * 128 - 1);
        // V: 16-dimension chunk, then key, then dimension in the chunk; the last chunk of dim 24 is 8 wide.
        assert_eq!(v_offset(128, 0, 15), 15);
        assert_eq!(v_offset(128, 1, 0), 16);
        assert_eq!(v_offset(128, 0, 16), 64 * 16);
        assert_eq!(v_offset(24, 63, 15), 63 * 16 + 15);
        assert_eq!(v_offset(24, 0, 16), 64 * 16);
        assert_eq!(v_offset(24, 1, 16), 64 * 16 + 8);
        assert_eq!(v_offset(24, 63, 23), 64 * 24 - 1);
        // Pairs: K pairs dimensions of a key, V pairs keys of a dimension.
        assert_eq!(k_pair_offset(128, 0, 1), 1);
        assert_eq!(k_pair_offset(128, 1, 0), 2);
        assert_eq!(k_pair_offset(128, 0, 2), 32);
        assert_eq!(k_pair_offset(128, 16, 0), 128 * 16);
        assert_eq!(k_pair_offset(128, 63, 127), 64 * 128 - 1);
        assert_eq!(v_pair_offset(128, 1, 0), 1);
        assert_eq!(v_pair_offset(128, 0, 1), 2);
        assert_eq!(v_pair_offset(128, 2, 0), 32);
        assert_eq!(v_pair_offset(128, 0, 16), 64 * 16);
        assert_eq!(v_pair_offset(24, 3, 17), 64 * 16 + (8 + 1) * 2 + 1);
        assert_eq!(v_pair_offset(24, 63, 23), 64 * 24 - 1);
        for dim in [2, 8, 16, 24, 40, 128, 256] {
            for f in [k_pair_offset, v_pair_offset] {
                let mut seen = vec![false; dim * KV_BLOCK];
                for j in 0..KV_BLOCK {
                    for d in 0..dim {
                        let at = f(dim, j, d);
                        assert!(!seen[at], "pairs, dim {dim}: ({j}, {d}) taken");
                        seen[at] = true;
                    }
                }
            }
        }
        for dim in [1, 8, 16, 24, 40, 128, 256] {
            for f in [k_offset, v_offset] {
                let mut seen = vec![false; dim * KV_BLOCK];
                for j in 0..KV_BLOCK {
                    for d in 0..dim {
                        let at = f(dim, j, d);
                        assert!(
                            !seen[at],
                            "dim {dim}: ({j}, {d}) lands on a taken slot {at}"
                        );
                        seen[at] = true;
                    }
                }
            }
        }
    }
}
