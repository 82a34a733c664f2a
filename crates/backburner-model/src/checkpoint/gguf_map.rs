//! A GGUF file seen through Hugging Face tensor names: the names llama.cpp gives the `qwen35`, `qwen35moe` and
//! `qwen3next` architectures' tensors (its `src/models/qwen35.cpp`, `qwen3next.cpp` and `gguf-py` tensor map), and the
//! shapes in Hugging Face's convention.
//!
//! What llama.cpp's converter (`conversion/qwen.py`) changed and how the model follows it:
//! - RMSNorm weights (`attn_norm`, `post_attention_norm`, `attn_q_norm`, `attn_k_norm`, `output_norm`) hold
//!   `1 + w`, and `ssm_a` holds `A = −exp(A_log)`: both are what the model computes with, read as stored;
//! - `ssm_conv1d` is `[conv_dim, kernel]` (Hugging Face `[conv_dim, 1, kernel]`, the same bytes);
//! - the linear-attention v heads are tiled rather than grouped by k head, in every per-v-head tensor: the model
//!   follows the stored order ([`crate::config::VHeadOrder::Tiled`]); not so in `qwen3next`, whose converter keeps
//!   Hugging Face's grouped order;
//! - `qwen3next`: Hugging Face's `in_proj_qkvz` (fused per k head) is stored split by kind as `attn_qkv` (every q,
//!   every k, every v) and `attn_gate` (z), older converters kept it fused as `ssm_in`; `in_proj_ba` stays fused per
//!   k head as `ssm_ba`, whose rows the loader gathers as it does Hugging Face's
//!   ([`crate::arch::GdnProjections::SplitQkvzFusedBa`]);
//! - the MTP blocks are stored after the trunk's (`nextn_predict_layers`): `mtp.*` names map there
//!   (`mtp_names.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use backburner_kernels::matmul::RowMajor;
use backburner_kernels::quant::QuantFormat;

use super::mtp_names::{mtp_name, MtpName};
use super::{dense_dtype, unsupported, StoredDtype, WeightPart};
use crate::arch::{arch_of_gguf, Arch};
use crate::error::{ModelError, Result};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};

/// An opened GGUF model with its name map.
pub(crate) struct GgufCheckpoint {
    path: PathBuf,
    /// The file's architecture: its tensor table names the tensors.
    arch: &'static Arch,
    file: GgufFile,
    /// Hugging Face names of the tensors present, sorted.
    names: Vec<String>,
    /// Per-expert views of the 3-D expert tensors (`blk.N.ffn_gate_exps.weight` `[H, I, E]` → the Hugging Face name
    /// of expert e's `[I, H]` matrix), by Hugging Face name.
    views: HashMap<String, TensorInfo>,
    /// The first MTP block (`block_count − nextn_predict_layers`; `block_count` when there is none): where the
    /// `mtp.*` names map.
    mtp_block: usize,
}

impl GgufCheckpoint {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let name = crate::gguf::check_architecture(&file)?;
        let arch = arch_of_gguf(name).ok_or_else(|| {
            ModelError::InvalidConfig(format!("GGUF architecture {name:?} has no tensor table"))
        })?;
        let (mut names, views) = hf_names(arch, &file);
        names.sort();
        let md = file.metadata();
        let blocks = md.get_u64(&format!("{name}.block_count")).unwrap_or(0);
        let nextn = md
            .get_u64(&format!("{name}.nextn_predict_layers"))
            .unwrap_or(0);
        let mtp_block = usize::try_from(blocks.saturating_sub(nextn)).unwrap_or(usize::MAX);
        Ok(GgufCheckpoint {
            path: path.to_path_buf(),
            arch,
            file,
            names,
            views,
            mtp_block,
        })
    }

    /// The Hugging Face name the table and the views know for `name` (an MTP layer's tensor becomes the trunk name
    /// of its block; [`MtpName::Layer`]), or the GGUF name of an MTP `nextn` tensor ([`MtpName::Nextn`]).
    fn resolve(&self, name: &str) -> MtpName {
        mtp_name(name, self.mtp_block).unwrap_or_else(|| MtpName::Layer(name.to_string()))
    }

    /// The GGUF name of the Hugging Face name `name` (or of the view holding it), if the file's names map it.
    fn gguf_of(&self, name: &str) -> Option<String> {
        match self.resolve(name) {
            MtpName::Nextn(g) => Some(g),
            MtpName::Layer(h) => match self.views.get(&h) {
                Some(v) => Some(v.name.clone()),
                None => self.arch.gguf_name(&h),
            },
        }
    }

    /// The per-expert view holding the Hugging Face name `name`, if any.
    fn view(&self, name: &str) -> Option<&TensorInfo> {
        match self.resolve(name) {
            MtpName::Layer(h) => self.views.get(&h),
            MtpName::Nextn(_) => None,
        }
    }

    pub(crate) fn arch(&self) -> &'static Arch {
        self.arch
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn info(&self, name: &str) -> Result<(String, &TensorInfo)> {
        if let Some(v) = self.view(name) {
            return Ok((v.name.clone(), v));
        }
        let missing = || ModelError::MissingTensor {
            name: self.stored_name(name),
            dir: self.path.clone(),
        };
        let g = self.gguf_of(name).ok_or_else(missing)?;
        let info = self.file.tensor(&g).ok_or_else(missing)?;
        Ok((g, info))
    }

    /// The tensor's name in the file (for error messages).
    pub(crate) fn stored_name(&self, name: &str) -> String {
        self.gguf_of(name).unwrap_or_else(|| name.to_string())
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.info(name).is_ok()
    }

    pub(crate) fn names(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }

    /// Whether the model reads (part of) the stored tensor `g`: it maps to a name the architecture reads, or views
    /// of it do.
    pub(crate) fn maps(&self, g: &str) -> bool {
        if self.arch.hf_name(g).is_some() {
            return true;
        }
        // a merged gate|up expert tensor: its views carry the gate entry's names
        let gate = g
            .strip_suffix(".ffn_gate_up_exps.weight")
            .and_then(|blk| self.arch.hf_name(&format!("{blk}.ffn_gate_exps.weight")));
        gate.is_some_and(|h| self.views.contains_key(&h.replace("{e}", "0")))
    }

    /// Every tensor's name as the file stores it.
    pub(crate) fn stored_names(&self) -> Vec<&str> {
        self.file.tensor_names()
    }

    /// Hugging Face's shape: the GGUF dims reversed, with the conv kernel's middle 1 restored.
    pub(crate) fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let (_, info) = self.info(name)?;
        let mut shape = info
            .dims
            .iter()
            .rev()
            .map(|&d| {
                usize::try_from(d).map_err(|_| {
                    ModelError::InvalidConfig(format!(
                        "{}: dim {d} overflows",
                        self.stored_name(name)
                    ))
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        if name.ends_with("linear_attn.conv1d.weight") && shape.len() == 2 {
            shape.insert(1, 1);
        }
        // llama.cpp stores the shared expert's gate `[1, H]` as a vector `[H]` (the same bytes)
        if name.ends_with("mlp.shared_expert_gate.weight") && shape.len() == 1 {
            shape.insert(0, 1);
        }
        Ok(shape)
    }

    pub(crate) fn dtype(&self, name: &str) -> Result<StoredDtype> {
        let (_, info) = self.info(name)?;
        Ok(stored_dtype(info.ggml_type))
    }

    pub(crate) fn raw(&self, name: &str) -> Result<&[u8]> {
        let (_, info) = self.info(name)?;
        self.file.data_of(info)
    }

    pub(crate) fn stored_bytes(&self, name: &str) -> Result<usize> {
        let (_, info) = self.info(name)?;
        usize::try_from(info.n_bytes).map_err(|_| {
            ModelError::InvalidConfig(format!("{}: size overflows", self.stored_name(name)))
        })
    }

    pub(crate) fn shard_path(&self, name: &str) -> Result<&Path> {
        let (_, info) = self.info(name)?;
        Ok(&self.file.paths()[info.part])
    }

    pub(crate) fn read_chunks(&self, name: &str, chunk: usize, f: impl FnMut(&[u8])) -> Result<()> {
        let (_, info) = self.info(name)?;
        self.file.read_chunks_of(info, chunk, f)
    }

    /// Checks a tensor's shape (Hugging Face order) against `expected`; a mismatch is reported as the file stores
    /// the tensor: its GGUF name and dims in GGUF order (`ne[0]` first, as llama.cpp prints them).
    pub(crate) fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let found = self.shape(name)?;
        if found != expected {
            let gguf_order = |hf: &[usize]| {
                let mut dims = hf.to_vec();
                if name.ends_with("linear_attn.conv1d.weight") && dims.len() == 3 && dims[1] == 1 {
                    dims.remove(1);
                }
                dims.reverse();
                dims
            };
            return Err(ModelError::ShapeMismatch {
                name: self.stored_name(name),
                expected: gguf_order(expected),
                found: gguf_order(&found),
            });
        }
        Ok(())
    }

    /// The tensor's values as f32 (any supported dtype, quantized ones dequantized), shape checked.
    pub(crate) fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        self.check_shape(name, expected)?;
        let d = self.dtype(name)?;
        let bytes = self.raw(name)?;
        let n: usize = expected.iter().product();
        let out = match &d {
            StoredDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StoredDtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StoredDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StoredDtype::Quant(q) => {
                let mut out = vec![0.0f32; n];
                backburner_kernels::quant::dequantize(*q, bytes, &mut out).map_err(|e| {
                    ModelError::InvalidConfig(format!("{}: {e}", self.stored_name(name)))
                })?;
                out
            }
            StoredDtype::Other(_) => return Err(unsupported(&self.stored_name(name), &d)),
        };
        self.release(name);
        Ok(out)
    }

    pub(crate) fn weight_part(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<WeightPart<'_>> {
        self.check_shape(name, &[rows, cols])?;
        let d = self.dtype(name)?;
        let bytes = self.raw(name)?;
        if let Some(dtype) = dense_dtype(&d) {
            return Ok(WeightPart::Dense(RowMajor { dtype, bytes, rows }));
        }
        match d {
            StoredDtype::Quant(format) => Ok(WeightPart::Quant {
                format,
                bytes,
                rows,
            }),
            other => Err(unsupported(&self.stored_name(name), &other)),
        }
    }

    pub(crate) fn release(&self, name: &str) {
        if let Ok((_, info)) = self.info(name) {
            self.file.release_of(info);
        }
    }

    pub(crate) fn total_bytes(&self) -> usize {
        usize::try_from(self.file.total_tensor_bytes()).unwrap_or(usize::MAX)
    }
}

/// The Hugging Face names of a file's tensors that `arch` reads, and the per-expert views: a 3-D expert tensor
/// (`[cols, rows, E]`) gives one name per expert, each a view of its byte range ([`TensorInfo::expert`]).
fn hf_names(arch: &Arch, file: &GgufFile) -> (Vec<String>, HashMap<String, TensorInfo>) {
    let (mut names, mut views) = (Vec::new(), HashMap::new());
    for g in file.tensor_names() {
        if let Some(blk) = g.strip_suffix(".ffn_gate_up_exps.weight") {
            merged_gate_up(arch, file, g, blk, &mut names, &mut views);
            continue;
        }
        let Some(h) = arch.hf_name(g) else { continue };
        if !h.contains("{e}") {
            names.push(h);
            continue;
        }
        let info = file.tensor(g).expect("a listed tensor");
        let n = info
            .dims
            .get(2)
            .map_or(0, |&n| usize::try_from(n).unwrap_or(0));
        for e in 0..n {
            if let Some(v) = info.expert(e) {
                let name = h.replace("{e}", &e.to_string());
                names.push(name.clone());
                views.insert(name, v);
            }
        }
    }
    (names, views)
}

/// Views of a merged `blk.N.ffn_gate_up_exps.weight` (`[H, 2·I, E]`: each expert's gate rows, then its up rows, as
/// transformers' fused `gate_up_proj`): expert e's gate and up matrices under the names of the separate
/// `ffn_gate_exps` / `ffn_up_exps` entries.
fn merged_gate_up(
    arch: &Arch,
    file: &GgufFile,
    g: &str,
    blk: &str,
    names: &mut Vec<String>,
    views: &mut HashMap<String, TensorInfo>,
) {
    let info = file.tensor(g).expect("a listed tensor");
    let n = info
        .dims
        .get(2)
        .map_or(0, |&n| usize::try_from(n).unwrap_or(0));
    let parts = [".ffn_gate_exps.weight", ".ffn_up_exps.weight"];
    for e in 0..n {
        let Some(both) = info.expert(e) else { continue };
        for (j, p) in parts.iter().enumerate() {
            let (Some(h), Some(v)) = (arch.hf_name(&format!("{blk}{p}")), both.rows_part(j, 2))
            else {
                continue;
            };
            let name = h.replace("{e}", &e.to_string());
            names.push(name.clone());
            views.insert(name, v);
        }
    }
}

/// Our name for a ggml tensor type.
pub(crate) fn stored_dtype(t: GgmlType) -> StoredDtype {
    match t {
        GgmlType::F32 => StoredDtype::F32,
        GgmlType::F16 => StoredDtype::F16,
        GgmlType::BF16 => StoredDtype::BF16,
        other => match QuantFormat::from_ggml_type(other.id()) {
            Some(q) => StoredDtype::Quant(q),
            None => StoredDtype::Other(other.name()),
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::arch::arch_of_gguf;

    #[test]
    fn every_name_maps_both_ways() {
        let arch = arch_of_gguf("qwen35").unwrap();
        for (h, g) in [
            ("model.layers.17.linear_attn.A_log", "blk.17.ssm_a"),
            (
                "model.layers.17.mlp.down_proj.weight",
                "blk.17.ffn_down.weight",
            ),
            (
                "model.layers.17.self_attn.q_proj.weight",
                "blk.17.attn_q.weight",
            ),
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(arch.gguf_name(h).as_deref(), Some(g));
            assert_eq!(arch.hf_name(g).as_deref(), Some(h));
        }
        for e in arch.table {
            let g = format!("blk.5.{}", e.gguf);
            let h = arch.hf_name(&g).or_else(|| arch.hf_name(e.gguf)).unwrap();
            let back = arch.gguf_name(&h).unwrap();
            assert!(back == g || back == e.gguf, "{g} -> {h} -> {back}");
        }
        assert_eq!(arch.hf_name("blk.3.nextn.eh_proj.weight"), None);
        assert_eq!(arch.hf_name("blk.x.attn_norm.weight"), None);
        assert_eq!(arch.gguf_name("model.visual.blocks.0.weight"), None);
    }
}
