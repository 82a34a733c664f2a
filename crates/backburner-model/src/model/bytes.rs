//! What a decode step reads of the weights a node holds.

use super::Model;
use crate::linear::Linear;

impl Model {
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
