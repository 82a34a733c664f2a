//! The routed experts of some layers on a node that holds only them (a worker serving experts,
//! docs/EXPERTS.md): each request is a layer, rows and [`Segment`]s; the answer is one vector per segment, its pairs'
//! weighted outputs folded from +0 in order ([`crate::remote_experts`]).

use std::ops::Range;
use std::sync::atomic::AtomicU64;

use super::load::load_experts;
use super::moe::{run_groups, Groups};
use super::scratch::MoeBufs;
use crate::checkpoint::Checkpoint;
use crate::config::{FfnKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::remote_experts::Segment;

/// One layer's routed experts (index = expert id; `None` for one not held).
type LayerExperts = Vec<Option<(Linear, Linear)>>;

/// The routed experts `ids` of the MoE layers of a layer range.
#[derive(Debug)]
pub struct ExpertStore {
    hidden: usize,
    top_k: usize,
    layers: Range<usize>,
    ids: Vec<usize>,
    /// Per layer of `layers`: its experts (index = expert id), or `None` for a dense layer.
    held: Vec<Option<LayerExperts>>,
    reads: AtomicU64,
}

impl ExpertStore {
    /// Loads the experts `ids` (each `< num_experts`) of every MoE layer in `layers`.
    ///
    /// Errors: [`ModelError::InvalidConfig`] for a dense model, a range outside the model or an id out of range;
    /// the tensors' load errors.
    pub fn load(
        c: &ModelConfig,
        ck: &Checkpoint,
        layers: Range<usize>,
        ids: &[usize],
    ) -> Result<Self> {
        let Some(mc) = c.moe.as_ref() else {
            return Err(ModelError::InvalidConfig(
                "the model has no routed experts".into(),
            ));
        };
        if layers.start > layers.end || layers.end > c.num_hidden_layers {
            return Err(ModelError::InvalidConfig(format!(
                "layer range {layers:?} is outside 0..{}",
                c.num_hidden_layers
            )));
        }
        if let Some(&e) = ids.iter().find(|&&e| e >= mc.num_experts) {
            return Err(ModelError::InvalidConfig(format!(
                "expert {e} is outside 0..{}",
                mc.num_experts
            )));
        }
        let held = layers
            .clone()
            .map(|i| match c.ffn_types[i] {
                FfnKind::Moe => load_experts(c, ck, i, ids).map(Some),
                FfnKind::Dense => Ok(None),
            })
            .collect::<Result<_>>()?;
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        Ok(ExpertStore {
            hidden: c.hidden_size,
            top_k: mc.num_experts_per_tok,
            layers,
            ids,
            held,
            reads: AtomicU64::new(0),
        })
    }

    /// The layers whose experts this store holds (dense ones among them hold none).
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The expert ids held in each MoE layer, ascending.
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    /// Whether `expert` of `layer` is held here.
    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        self.experts_of(layer)
            .and_then(|ex| ex.get(expert))
            .is_some_and(Option::is_some)
    }

    /// Bytes of the weights held.
    pub fn weight_bytes(&self) -> usize {
        self.held
            .iter()
            .flatten()
            .flatten()
            .flatten()
            .map(|(g, d)| g.bytes() + d.bytes())
            .sum()
    }

    fn experts_of(&self, layer: usize) -> Option<&LayerExperts> {
        let i = layer.checked_sub(self.layers.start)?;
        self.held.get(i)?.as_ref()
    }

    /// The answer to `segments` of `layer` on the rows `x` (`[n_rows, H]` f32): `[segments.len(), H]` f32, each
    /// segment's pairs' weighted outputs `p · expert(x_row)` folded from +0 in order. Runs on the current rayon
    /// pool.
    ///
    /// Errors (a message; nothing is computed): `x` not `[n_rows, H]`, a layer not held, a segment whose row is
    /// out of range, with no pair or more than the model's k, whose experts are not strictly ascending or not held
    /// here, or with a weight that is not finite.
    pub fn run(
        &self,
        layer: usize,
        x: &[f32],
        n_rows: usize,
        segments: &[Segment],
    ) -> std::result::Result<Vec<f32>, String> {
        let h = self.hidden;
        if n_rows.checked_mul(h) != Some(x.len()) {
            return Err(format!("{} values are not {n_rows} rows of {h}", x.len()));
        }
        let Some(experts) = self.experts_of(layer) else {
            return Err(format!("this worker holds no experts of layer {layer}"));
        };
        let mut groups: Groups = vec![Vec::new(); experts.len()];
        let mut slot = 0usize;
        for (s, seg) in segments.iter().enumerate() {
            let bad = |why: &str| Err(format!("segment {s}: {why}"));
            if seg.row as usize >= n_rows {
                return bad("its row is out of range");
            }
            if seg.pairs.is_empty() || seg.pairs.len() > self.top_k {
                return bad("it has no pair or more than the model's experts per token");
            }
            if seg.pairs.windows(2).any(|w| w[0].0 >= w[1].0) {
                return bad("its experts are not in strictly ascending order");
            }
            for &(e, p) in &seg.pairs {
                if !self.holds(layer, e as usize) {
                    return bad(&format!("expert {e} of layer {layer} is not held here"));
                }
                if !p.is_finite() {
                    return bad("a weight is not finite");
                }
                groups[e as usize].push((seg.row as usize, p, slot));
                slot += 1;
            }
        }
        let mut pairs = vec![0f32; slot * h];
        let mut bufs = MoeBufs::default();
        run_groups(
            experts,
            h,
            x,
            &groups,
            &mut bufs,
            &self.reads,
            |_, p, slot, y| {
                for (d, &v) in pairs[slot * h..(slot + 1) * h].iter_mut().zip(y) {
                    *d = v * p;
                }
            },
        );
        let mut out = vec![0f32; segments.len() * h];
        let mut slot = 0;
        for (seg, o) in segments.iter().zip(out.chunks_exact_mut(h)) {
            for _ in &seg.pairs {
                for (d, &v) in o.iter_mut().zip(&pairs[slot * h..(slot + 1) * h]) {
                    *d += v;
                }
                slot += 1;
            }
        }
        Ok(out)
    }
}
