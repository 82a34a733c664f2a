//! The tile order of a packed page's blocks ([`PageLayout::HeadMajor`](super::PageLayout::HeadMajor)): inside a
//! block, K and V are stored in the order the attention kernel's widest tiles read them, so that a decode streams
//! each block front to back as one run instead of four interleaved ones.
//!
//! The block layout of pages on the link ([`k_offset`], [`v_offset`] and their pair forms) puts the four lane
//! groups of K 16 · `head_dim` keys apart, and four 16-dimension chunks of V 64 keys apart. The kernel's tiles read
//! one vector of each of the four at a time, so the hardware sees four streams a few KiB apart per block; on the
//! AMD EPYC (Zen 5) dev VM a plain read of 256 MiB in that pattern runs at 22–24 GB/s (28–30 with software
//! prefetches) against 36 GB/s front to back (`scripts/stream_pattern_read.c`). In tile order the same loads are adjacent:
//!
//! * K `[dim][KV_BLOCK]` ([`k_tile_offset`]): the 64 keys of one dimension side by side (bf16: `[dim / 2][KV_BLOCK][2]`,
//!   [`k_pair_tile_offset`]);
//! * V in quads of 64 dimensions, `[⌈dim / 64⌉][KV_BLOCK][w]` with `w = 64` (or what is left of `dim` for the last
//!   quad) ([`v_tile_offset`]; bf16: `[⌈dim / 64⌉][KV_BLOCK / 2][w][2]`, [`v_pair_tile_offset`]).
//!
//! The elements and the kernel's arithmetic are unchanged: a packed page gives the bits of the page it was packed
//! from.

use super::{k_offset, k_pair_offset, v_offset, v_pair_offset, KV_BLOCK, KV_LANES};

/// Dimensions of V per quad of the tile order: the kernel's widest value tile (4 vectors of 16 lanes).
pub const V_QUAD: usize = 4 * KV_LANES;

/// Offset of key `lane` (`< KV_BLOCK`), dimension `d` inside a K block in tile order: `[dim][KV_BLOCK]`. This and
/// the three offsets below give a meaningless offset for arguments out of range, as [`k_offset`] does.
#[inline]
pub fn k_tile_offset(lane: usize, d: usize) -> usize {
    d * KV_BLOCK + lane
}

/// Offset of key `j` (`< KV_BLOCK`), dimension `d` (`< dim`) inside a V block in tile order: quads of
/// [`V_QUAD`] dimensions, `[⌈dim / 64⌉][KV_BLOCK][w]`, `w = min(64, dim − quad start)`.
#[inline]
pub fn v_tile_offset(dim: usize, j: usize, d: usize) -> usize {
    let q0 = d / V_QUAD * V_QUAD;
    let w = (dim - q0).min(V_QUAD);
    q0 * KV_BLOCK + j * w + d % V_QUAD
}

/// Offset of key `lane`, dimension `d` (`dim` even) inside a bf16 K block in tile order: `[dim / 2][KV_BLOCK][2]`
/// (dimensions `2i, 2i + 1` of a key side by side, as [`k_pair_offset`]).
#[inline]
pub fn k_pair_tile_offset(lane: usize, d: usize) -> usize {
    ((d / 2) * KV_BLOCK + lane) * 2 + d % 2
}

/// Offset of key `j`, dimension `d` inside a bf16 V block in tile order: quads of [`V_QUAD`] dimensions, each
/// `[KV_BLOCK / 2][w][2]` (keys `2i, 2i + 1` of a dimension side by side, as [`v_pair_offset`]).
#[inline]
pub fn v_pair_tile_offset(dim: usize, j: usize, d: usize) -> usize {
    let q0 = d / V_QUAD * V_QUAD;
    let w = (dim - q0).min(V_QUAD);
    q0 * KV_BLOCK + ((j / 2) * w + d % V_QUAD) * 2 + j % 2
}

/// Where the vectors a kernel tile reads start, and how far apart consecutive ones are, in elements of the block
/// (bf16 pages: in pairs, i.e. `u32`s). `T` selects the tile order over the link's block layout (a constant, so
/// that the kernels' strides are too).
///
/// * [`BlockWalk::k`]: lane group `g` (keys `16g..16g + 16`) at dimension (bf16: pair) 0, step per dimension (pair);
/// * [`BlockWalk::v`]: 16-dimension chunk `c` at key (bf16: key pair) 0, step per key (pair).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockWalk<const T: bool> {
    /// `head_dim` of the page.
    pub dim: usize,
}

impl<const T: bool> BlockWalk<T> {
    /// `(start, step)` of lane group `g`'s vectors over the dimensions (`units` = dimensions, or `dim / 2` pairs).
    #[inline(always)]
    pub fn k(self, g: usize, units: usize) -> (usize, usize) {
        if T {
            (g * KV_LANES, KV_BLOCK)
        } else {
            (g * units * KV_LANES, KV_LANES)
        }
    }

    /// `(start, step)` of chunk `c`'s vectors over the keys (`pairs`: bf16, in u32 units and key pairs). The chunk
    /// must be a whole 16 dimensions wide.
    #[inline(always)]
    pub fn v(self, c: usize, pairs: bool) -> (usize, usize) {
        let div = if pairs { 2 } else { 1 };
        if T {
            let q0 = c * KV_LANES / V_QUAD * V_QUAD;
            let w = (self.dim - q0).min(V_QUAD);
            ((q0 * KV_BLOCK) / div + (c * KV_LANES) % V_QUAD, w)
        } else {
            (c * KV_LANES * KV_BLOCK / div, KV_LANES)
        }
    }

    /// Offset of V element `(j, d)` in the block (for the dimensions past the last whole chunk).
    #[inline(always)]
    pub fn v_at(self, j: usize, d: usize, pairs: bool) -> usize {
        match (T, pairs) {
            (true, true) => v_pair_tile_offset(self.dim, j, d),
            (true, false) => v_tile_offset(self.dim, j, d),
            (false, true) => v_pair_offset(self.dim, j, d),
            (false, false) => v_offset(self.dim, j, d),
        }
    }
}

/// Appends one K block (`dim · KV_BLOCK` elements in the link's block layout, [`k_offset`] or for `pairs`
/// [`k_pair_offset`]) to `out` in tile order, run by run.
pub(crate) fn push_k_tiles<T: Copy>(src: &[T], dim: usize, pairs: bool, out: &mut Vec<T>) {
    let at = out.len();
    out.resize(at + dim * KV_BLOCK, src[0]);
    let dst = &mut out[at..];
    let (step, n) = if pairs {
        (2, 2 * KV_LANES)
    } else {
        (1, KV_LANES)
    };
    for g in 0..KV_BLOCK / KV_LANES {
        for d in (0..dim).step_by(step) {
            let lane = g * KV_LANES;
            let (from, to) = if pairs {
                (k_pair_offset(dim, lane, d), k_pair_tile_offset(lane, d))
            } else {
                (k_offset(dim, lane, d), k_tile_offset(lane, d))
            };
            dst[to..to + n].copy_from_slice(&src[from..from + n]);
        }
    }
}

/// Appends one V block (`dim · KV_BLOCK` elements in the link's block layout, [`v_offset`] or for `pairs`
/// [`v_pair_offset`]) to `out` in tile order, run by run.
pub(crate) fn push_v_tiles<T: Copy>(src: &[T], dim: usize, pairs: bool, out: &mut Vec<T>) {
    let at = out.len();
    out.resize(at + dim * KV_BLOCK, src[0]);
    let dst = &mut out[at..];
    for d in (0..dim).step_by(KV_LANES) {
        let w = (dim - d).min(KV_LANES);
        if pairs {
            for j in (0..KV_BLOCK).step_by(2) {
                let (from, to) = (v_pair_offset(dim, j, d), v_pair_tile_offset(dim, j, d));
                dst[to..to + 2 * w].copy_from_slice(&src[from..from + 2 * w]);
            }
        } else {
            for j in 0..KV_BLOCK {
                let (from, to) = (v_offset(dim, j, d), v_tile_offset(dim, j, d));
                dst[to..to + w].copy_from_slice(&src[from..from + w]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: [usize; 8] = [2, 8, 16, 24, 40, 80, 128, 256];

    #[test]
    fn the_tile_orders_place_every_element_once() {
        for dim in DIMS {
            let k = |j, d| k_tile_offset(j, d);
            let kp = |j, d| k_pair_tile_offset(j, d);
            let fs: [&dyn Fn(usize, usize) -> usize; 4] =
                [&k, &|j, d| v_tile_offset(dim, j, d), &kp, &|j, d| {
                    v_pair_tile_offset(dim, j, d)
                }];
            for f in fs {
                let mut seen = vec![false; dim * KV_BLOCK];
                for j in 0..KV_BLOCK {
                    for d in 0..dim {
                        let at = f(j, d);
                        assert!(
                            !seen[at],
                            "dim {dim}: ({j}, {d}) lands on a taken slot {at}"
                        );
                        seen[at] = true;
                    }
                }
            }
        }
        // The loads of one tile step are adjacent: 4 lane groups of K, 4 chunks of V (dim 256).
        assert_eq!(k_tile_offset(16, 5) - k_tile_offset(0, 5), 16);
        assert_eq!(v_tile_offset(256, 7, 16) - v_tile_offset(256, 7, 0), 16);
        assert_eq!(v_tile_offset(256, 8, 0) - v_tile_offset(256, 7, 0), 64);
        assert_eq!(v_tile_offset(80, 3, 64), 64 * 64 + 3 * 16);
        assert_eq!(
            v_pair_tile_offset(256, 2, 16) - v_pair_tile_offset(256, 2, 0),
            32
        );
    }

    #[test]
    fn the_run_copies_move_each_element_to_its_tile_offset() {
        for dim in DIMS {
            let src: Vec<u32> = (0..(dim * KV_BLOCK) as u32).collect();
            for pairs in [false, true] {
                let (mut k, mut v) = (Vec::new(), Vec::new());
                push_k_tiles(&src, dim, pairs, &mut k);
                push_v_tiles(&src, dim, pairs, &mut v);
                for j in 0..KV_BLOCK {
                    for d in 0..dim {
                        let (kf, kt, vf, vt) = if pairs {
                            let kt = k_pair_tile_offset(j, d);
                            (
                                k_pair_offset(dim, j, d),
                                kt,
                                v_pair_offset(dim, j, d),
                                v_pair_tile_offset(dim, j, d),
                            )
                        } else {
                            (
                                k_offset(dim, j, d),
                                k_tile_offset(j, d),
                                v_offset(dim, j, d),
                                v_tile_offset(dim, j, d),
                            )
                        };
                        assert_eq!(k[kt], src[kf], "K dim {dim} pairs {pairs} ({j}, {d})");
                        assert_eq!(v[vt], src[vf], "V dim {dim} pairs {pairs} ({j}, {d})");
                    }
                }
                walks_agree(BlockWalk::<false> { dim }, pairs);
                walks_agree(BlockWalk::<true> { dim }, pairs);
            }
        }
    }

    /// The walks point at the same elements as the offsets.
    fn walks_agree<const T: bool>(w: BlockWalk<T>, pairs: bool) {
        let dim = w.dim;
        let (units, per) = if pairs { (dim / 2, 2) } else { (dim, 1) };
        for g in 0..4 {
            let (s, st) = w.k(g, units);
            let (lane, i) = (g * KV_LANES, 3 % units);
            let d = i * per;
            let off = match (T, pairs) {
                (true, true) => k_pair_tile_offset(lane, d) / 2,
                (true, false) => k_tile_offset(lane, d),
                (false, true) => k_pair_offset(dim, lane, d) / 2,
                (false, false) => k_offset(dim, lane, d),
            };
            assert_eq!(s + i * st, off, "K walk dim {dim} tiles {T} pairs {pairs}");
        }
        for c in 0..dim / KV_LANES {
            let (s, st) = w.v(c, pairs);
            let j = 6;
            let off = w.v_at(j, c * KV_LANES, pairs) / per;
            assert_eq!(
                s + j / per * st,
                off,
                "V walk dim {dim} tiles {T} pairs {pairs}"
            );
        }
    }
}
