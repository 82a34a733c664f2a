//! The bytes of the weights a node holds, where they are held (the host, devices), and what a decode step reads.

use super::{Layer, Mixer, Model, Mtp};
use crate::linear::Linear;

/// Bytes of an f32 vector.
fn f32_bytes(v: &[f32]) -> usize {
    4 * v.len()
}

impl Layer {
    /// Bytes of this layer's weights as held on the host: its projections as packed (their checkpoint dtype plus
    /// panel padding; every expert's for a mixture-of-experts block) and its f32 vectors (norms, conv kernel,
    /// `dt_bias`, `A`).
    pub fn weight_bytes(&self) -> usize {
        let f = f32_bytes;
        let mixer = match &self.mixer {
            Mixer::Linear(w) => {
                w.in_proj.bytes()
                    + w.out_proj.bytes()
                    + f(&w.conv_weight)
                    + f(&w.dt_bias)
                    + f(&w.neg_a)
                    + f(&w.norm)
            }
            Mixer::Attention(w) => w.qkv.bytes() + w.o_proj.bytes() + f(&w.q_norm) + f(&w.k_norm),
        };
        mixer
            + self.ffn.linears().iter().map(|m| m.bytes()).sum::<usize>()
            + f(&self.input_norm)
            + f(&self.post_norm)
    }
}

impl Model {
    /// Bytes of this node's weights in their host format, wherever they are held: every loaded projection, the
    /// embedding and head as packed (their checkpoint dtype plus panel padding), and the f32 vectors (norms, conv
    /// kernels, `dt_bias`, `A`), the MTP block's included; the layers placed on devices count as they were on the
    /// host ([`Layer::weight_bytes`]). Equals [`super::load_bytes`] of the same checkpoint and
    /// [`super::LoadOptions`]. What the host holds is [`Model::host_weight_bytes`].
    pub fn weight_bytes(&self) -> usize {
        self.host_weight_bytes() + self.placed_bytes
    }

    /// Bytes of weights held in host memory: [`Model::weight_bytes`] less the layers placed on devices
    /// ([`Model::place_layers`] drops the host's copy of each; the device's own bytes are
    /// [`Model::device_weight_bytes`]).
    pub fn host_weight_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().flatten().map(Layer::weight_bytes).sum();
        let ends = self.embed.as_ref().map_or(0, Linear::bytes)
            + self.lm_head.as_ref().map_or(0, Linear::bytes)
            + self.final_norm.as_deref().map_or(0, f32_bytes);
        layers + ends + self.mtp.as_ref().map_or(0, Mtp::bytes)
    }

    /// The storage of every weight matrix this model holds on the host, in the order a decode step reads them
    /// (layers, then the head: the tied embedding or `lm_head`; an untied embedding table, of which decode reads one
    /// row, comes first), as byte slices: what [`Model::host_weight_bytes`] counts less the f32 vectors and the MTP
    /// block (which drafting reads, not a decode step: [`Mtp::linears`]). For a plain read of the very memory the
    /// products stream (`bench local`'s read passes).
    pub fn weight_storage(&self) -> Vec<&[u8]> {
        let mut out: Vec<&[u8]> = Vec::new();
        if self.lm_head.is_some() {
            out.extend(self.embed.iter().flat_map(Linear::storage));
        }
        for l in self.layers.iter().flatten() {
            let mixer: [&Linear; 2] = match &l.mixer {
                Mixer::Linear(w) => [&w.in_proj, &w.out_proj],
                Mixer::Attention(w) => [&w.qkv, &w.o_proj],
            };
            for m in mixer.into_iter().chain(l.ffn.linears()) {
                out.extend(m.storage());
            }
        }
        let head = self.lm_head.as_ref().or(self.embed.as_ref());
        out.extend(head.into_iter().flat_map(Linear::storage));
        out
    }

    /// Bytes of weights one decode step reads on this node, for a dense model: [`Model::weight_bytes`] less an untied
    /// embedding table (a step reads one row of it: its bytes over the vocabulary, rounded up, are counted instead).
    /// A tied embedding is the head, read whole. A mixture-of-experts model's routed experts are counted whole here;
    /// callers subtract [`Model::expert_bytes`] and add what [`Model::expert_bytes_read`] saw.
    pub fn decode_weight_bytes(&self) -> usize {
        let all = self.weight_bytes();
        match (&self.embed, &self.lm_head) {
            (Some(embed), Some(_)) => all - embed.bytes() + one_row(embed),
            _ => all,
        }
    }
}

/// Bytes of one row of `table` (its bytes over its rows, rounded up; the panel padding shared out).
fn one_row(table: &Linear) -> usize {
    table.bytes().div_ceil(table.out_features().max(1))
}
