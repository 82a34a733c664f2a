//! The MTP block's tensors in a GGUF file, asked for by their Hugging Face names (`mtp.*`, or `model.mtp.*` as a
//! few re-uploads spell them). llama.cpp's converter (`conversion/qwen.py`, `_Qwen35MtpMixin`) stores MTP layer `j`
//! as block `L + j` after the `L` trunk blocks, its decoder layer under the names of a trunk layer and the rest as
//! `nextn` tensors:
//!
//! | Hugging Face | GGUF |
//! |---|---|
//! | `mtp.layers.{j}.<rest>` | as `model.layers.{L + j}.<rest>` (`blk.{L+j}.attn_q.weight`, …) |
//! | `mtp.fc.weight` | `blk.{L}.nextn.eh_proj.weight` |
//! | `mtp.pre_fc_norm_embedding.weight` | `blk.{L}.nextn.enorm.weight` |
//! | `mtp.pre_fc_norm_hidden.weight` | `blk.{L}.nextn.hnorm.weight` |
//! | `mtp.norm.weight` | `blk.{L}.nextn.shared_head_norm.weight` |

/// What an MTP name is in a file whose first MTP block is block `first`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum MtpName {
    /// A tensor of an MTP decoder layer, under the Hugging Face name of the trunk layer at its block (or any other
    /// Hugging Face name, as is).
    Layer(String),
    /// A `nextn` tensor, by its GGUF name.
    Nextn(String),
}

/// The prefix of an MTP tensor's Hugging Face name, stripped; `None` for any other name.
pub(crate) fn strip_mtp_prefix(name: &str) -> Option<&str> {
    name.strip_prefix("mtp.")
        .or_else(|| name.strip_prefix("model.mtp."))
}

/// The GGUF side of the Hugging Face MTP name `name` for a file whose MTP blocks start at block `first`; `None`
/// when `name` is not an MTP name this map knows.
pub(crate) fn mtp_name(name: &str, first: usize) -> Option<MtpName> {
    let rest = strip_mtp_prefix(name)?;
    if let Some(layer) = rest.strip_prefix("layers.") {
        let (j, tail) = layer.split_once('.')?;
        let j: usize = j.parse().ok()?;
        return Some(MtpName::Layer(format!(
            "model.layers.{}.{tail}",
            first.checked_add(j)?
        )));
    }
    let nextn = match rest {
        "fc.weight" => "eh_proj.weight",
        "pre_fc_norm_embedding.weight" => "enorm.weight",
        "pre_fc_norm_hidden.weight" => "hnorm.weight",
        "norm.weight" => "shared_head_norm.weight",
        _ => return None,
    };
    Some(MtpName::Nextn(format!("blk.{first}.nextn.{nextn}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtp_names_map_as_the_converter_writes_them() {
        let l = |s: &str| Some(MtpName::Layer(s.into()));
        let n = |s: &str| Some(MtpName::Nextn(s.into()));
        assert_eq!(
            mtp_name("mtp.fc.weight", 64),
            n("blk.64.nextn.eh_proj.weight")
        );
        assert_eq!(
            mtp_name("model.mtp.pre_fc_norm_embedding.weight", 64),
            n("blk.64.nextn.enorm.weight")
        );
        assert_eq!(
            mtp_name("mtp.pre_fc_norm_hidden.weight", 4),
            n("blk.4.nextn.hnorm.weight")
        );
        assert_eq!(
            mtp_name("mtp.norm.weight", 4),
            n("blk.4.nextn.shared_head_norm.weight")
        );
        assert_eq!(
            mtp_name("mtp.layers.0.self_attn.q_proj.weight", 4),
            l("model.layers.4.self_attn.q_proj.weight")
        );
        assert_eq!(
            mtp_name("mtp.layers.1.mlp.experts.3.down_proj.weight", 40),
            l("model.layers.41.mlp.experts.3.down_proj.weight")
        );
        for bad in [
            "model.layers.0.self_attn.q_proj.weight",
            "mtp.layers.x.input_layernorm.weight",
            "mtp.embed_tokens.weight",
            "mtp.layers.0",
        ] {
            assert_eq!(mtp_name(bad, 4), None, "{bad}");
        }
    }
}
