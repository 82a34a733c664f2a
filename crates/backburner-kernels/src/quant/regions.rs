//! Products that run as one parallel region: the parts of a fused projection stored in different block formats
//! ([`qmatmul_parts`]), and the MLP's fused gate/up projection with its SwiGLU ([`qmatmul_swiglu`]). Each task runs
//! the kernel of [`qmatmul`](super::qmatmul) on its panels, so the bits are `qmatmul`'s; what they save at decode is a
//! region's fork, join and imbalance, and (SwiGLU) a pass over the output on one thread while the others wait.

use std::ops::Range;

use super::acts::QuantizedActs;
use super::isa::{qdispatch, LANES};
use super::kernel::{check_shapes, OutPtr, Task, SERIAL_WORK};
use super::pack::{QuantMatrix, PANEL_GROUP};
use crate::parallel::{for_each_task, split_range, threads};
use crate::rowops;

/// [`qmatmul`](super::qmatmul) of several matrices on the same activations in one parallel region (a fused
/// projection whose parts are stored in different formats): part `(w, first)` writes columns `first..first + w.n()`
/// of each output row (`y` row-major with row stride `ldy`), exactly as `qmatmul(x, w, &mut y[first..], ldy)`
/// would. Each part is split over the tasks as `qmatmul` splits it, so every thread streams its share of every part;
/// the bits are `qmatmul`'s.
///
/// Panics as [`qmatmul`](super::qmatmul) for each part, or if the parts' column ranges overlap or pass `ldy`.
pub fn qmatmul_parts(
    x: &QuantizedActs,
    parts: &[(&QuantMatrix, usize)],
    y: &mut [f32],
    ldy: usize,
) {
    let mut cols: Vec<(usize, usize)> = parts.iter().map(|(w, f)| (*f, *f + w.n())).collect();
    cols.sort_unstable();
    assert!(
        cols.windows(2).all(|c| c[0].1 <= c[1].0) && cols.last().is_none_or(|c| c.1 <= ldy),
        "qmatmul_parts: the parts' columns {cols:?} overlap or pass the row stride {ldy}"
    );
    let m = x.rows();
    let mut live = Vec::with_capacity(parts.len());
    let mut work = 0usize;
    for &(w, first) in parts {
        assert!(
            first <= y.len(),
            "qmatmul_parts: part at column {first} lies past y"
        );
        if !check_shapes("qmatmul", x, w, &y[first..], ldy) {
            continue;
        }
        if w.k() == 0 {
            for i in 0..m {
                y[first + i * ldy..first + i * ldy + w.n()].fill(0.0);
            }
            continue;
        }
        work = work.saturating_add(m.saturating_mul(w.n()).saturating_mul(w.k()));
        live.push((w, first));
    }
    // Checked above: each part's columns lie in `y` (`first ≤ y.len()`).
    let base = y.as_mut_ptr();
    let live_parts: Vec<(&QuantMatrix, OutPtr)> = live
        .into_iter()
        .map(|(w, first)| (w, OutPtr(base.wrapping_add(first))))
        .collect();
    let max_groups = live_parts
        .iter()
        .map(|(w, _)| w.n_panels() / PANEL_GROUP)
        .max();
    let n_tasks = match max_groups {
        None => return,
        Some(_) if work < SERIAL_WORK => 1,
        Some(g) => threads().min(g),
    };
    for_each_task(n_tasks, |t| {
        for (w, out) in &live_parts {
            let groups = w.n_panels() / PANEL_GROUP;
            let live = w.n().div_ceil(LANES);
            let g = split_range(groups, n_tasks, t);
            qdispatch(Task {
                x,
                w,
                out,
                ldy,
                panels: (g.start * PANEL_GROUP).min(live)..(g.end * PANEL_GROUP).min(live),
                streams: n_tasks,
            });
        }
    });
}

/// The SwiGLU MLP's input from its fused gate/up projection, in one parallel region: `gu = x·Wᵀ` with `W = [gate;
/// up]` (`w: [2·inter, k]`, `gu: [m, 2·inter]` f32), then `act = silu(gate)·up` (`[m, inter]`, as
/// [`rowops::silu_mul_halves`]). Each task computes the same panels of both halves and then `act`'s columns of them
/// while they are in its cache, instead of one thread passing over all of `gu` after the region. The bits are those
/// of [`qmatmul`](super::qmatmul) followed by `silu_mul_halves`.
///
/// Panics if `inter` is not a multiple of 16 (a half must start on a panel), on the shape errors of `qmatmul`, or
/// if `gu` or `act` does not have its shape.
pub fn qmatmul_swiglu(x: &QuantizedActs, w: &QuantMatrix, gu: &mut [f32], act: &mut [f32]) {
    let (m, n, k) = (x.rows(), w.n(), w.k());
    assert!(
        n.is_multiple_of(2 * LANES),
        "qmatmul_swiglu: 2·inter = {n} is not a multiple of {}",
        2 * LANES
    );
    let inter = n / 2;
    assert_eq!(gu.len(), m * n, "qmatmul_swiglu: gu is not [{m}, {n}]");
    assert_eq!(
        act.len(),
        m * inter,
        "qmatmul_swiglu: act is not [{m}, {inter}]"
    );
    if !check_shapes("qmatmul_swiglu", x, w, gu, n) {
        return;
    }
    if k == 0 {
        super::qmatmul(x, w, gu, n);
        return rowops::silu_mul_halves(gu, inter, act);
    }
    let half = inter / LANES;
    let groups = half.div_ceil(PANEL_GROUP);
    let n_tasks = if m.saturating_mul(n).saturating_mul(k) < SERIAL_WORK {
        1
    } else {
        threads().min(groups)
    };
    let (out, act_out) = (OutPtr(gu.as_mut_ptr()), OutPtr(act.as_mut_ptr()));
    for_each_task(n_tasks, |t| {
        let g = split_range(groups, n_tasks, t);
        let p = (g.start * PANEL_GROUP).min(half)..(g.end * PANEL_GROUP).min(half);
        for panels in [p.clone(), p.start + half..p.end + half] {
            qdispatch(Task {
                x,
                w,
                out: &out,
                ldy: n,
                panels,
                streams: n_tasks,
            });
        }
        // SAFETY: this task wrote `gu`'s columns of panels `p` in both halves (above, on this thread) and no other
        // task touches them; `act`'s columns of `p` are this task's alone; both buffers outlive the region.
        unsafe { swiglu_cols(&out, &act_out, m, inter, p.start * LANES..p.end * LANES) };
    });
}

/// `act[i][c] = silu(gu[i][c])·gu[i][inter + c]` for every row `i < m` and column `c` in `cols`.
///
/// # Safety
/// `gu` points to `[m, 2·inter]` and `act` to `[m, inter]` live f32 buffers, `cols` lies in `0..inter`, and no other
/// thread reads or writes those columns of `act` or writes those of `gu` meanwhile.
unsafe fn swiglu_cols(gu: &OutPtr, act: &OutPtr, m: usize, inter: usize, cols: Range<usize>) {
    let w = cols.len();
    for i in 0..m {
        // SAFETY: the caller's contract; the three ranges lie in row i of their buffers and do not overlap.
        let (g, u, o) = unsafe {
            let row = gu.0.add(i * 2 * inter);
            (
                std::slice::from_raw_parts(row.add(cols.start), w),
                std::slice::from_raw_parts(row.add(inter + cols.start), w),
                std::slice::from_raw_parts_mut(act.0.add(i * inter + cols.start), w),
            )
        };
        rowops::silu_mul_into(g, u, o);
    }
}
