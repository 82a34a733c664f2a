//! Loading a layer's weights from a checkpoint, and the bytes a load will allocate, from one list of the tensors
//! each layer reads.

use super::{AttnWeights, GdnWeights, Layer, LoadOptions, Mixer};
use crate::checkpoint::{dense_dtype, unsupported, Checkpoint, StoredDtype, VectorKind};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::linear::Linear;

/// A fused projection as the loader reads it: its parts (tensor name, rows) concatenated by rows, and its input
/// width.
type Fused = (Vec<(String, usize)>, usize);

/// The projections of layer `i` in load order: gate|up, down, the mixer's fused input projection and its output
/// projection (shared by [`load_layer`] and [`load_bytes`], so the budget check sizes exactly what is loaded).
fn layer_linears(c: &ModelConfig, i: usize) -> [Fused; 4] {
    let p = format!("{}layers.{i}.", c.layout.prefix());
    let part = |name: &str, rows: usize| (format!("{p}{name}"), rows);
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let gate_up = vec![
        part("mlp.gate_proj.weight", inter),
        part("mlp.up_proj.weight", inter),
    ];
    let down = vec![part("mlp.down_proj.weight", h)];
    match c.layer_types[i] {
        LayerKind::LinearAttention => {
            let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
            let in_proj = vec![
                part("linear_attn.in_proj_qkv.weight", c.conv_dim()),
                part("linear_attn.in_proj_z.weight", hv * dv),
                part("linear_attn.in_proj_b.weight", hv),
                part("linear_attn.in_proj_a.weight", hv),
            ];
            let out = vec![part("linear_attn.out_proj.weight", h)];
            [(gate_up, h), (down, inter), (in_proj, h), (out, hv * dv)]
        }
        LayerKind::FullAttention => {
            let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let qkv = vec![
                part("self_attn.q_proj.weight", hq * 2 * d),
                part("self_attn.k_proj.weight", hkv * d),
                part("self_attn.v_proj.weight", hkv * d),
            ];
            let o = vec![part("self_attn.o_proj.weight", h)];
            [(gate_up, h), (down, inter), (qkv, h), (o, hq * d)]
        }
    }
}

/// The vectors of layer `i` read as f32 (name, shape, meaning), in load order: the two layer norms' gains, then the
/// Gated DeltaNet's conv kernel, `dt_bias`, `A` and gated norm, or the attention's q and k norm gains.
fn layer_vectors(c: &ModelConfig, i: usize) -> Vec<(String, Vec<usize>, VectorKind)> {
    let p = format!("{}layers.{i}.", c.layout.prefix());
    let v = |name: &str, shape: &[usize]| (format!("{p}{name}"), shape.to_vec(), VectorKind::Plain);
    let g =
        |name: &str, shape: &[usize]| (format!("{p}{name}"), shape.to_vec(), VectorKind::NormGain);
    let h = c.hidden_size;
    let mut out = vec![
        g("input_layernorm.weight", &[h]),
        g("post_attention_layernorm.weight", &[h]),
    ];
    match c.layer_types[i] {
        LayerKind::LinearAttention => {
            let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
            out.extend([
                v(
                    "linear_attn.conv1d.weight",
                    &[c.conv_dim(), 1, c.linear_conv_kernel_dim],
                ),
                v("linear_attn.dt_bias", &[hv]),
                (
                    format!("{p}linear_attn.A_log"),
                    vec![hv],
                    VectorKind::NegExp,
                ),
                v("linear_attn.norm.weight", &[dv]),
            ]);
        }
        LayerKind::FullAttention => {
            let d = c.head_dim;
            out.extend([
                g("self_attn.q_norm.weight", &[d]),
                g("self_attn.k_norm.weight", &[d]),
            ]);
        }
    }
    out
}

/// Hugging Face names of every tensor a load of the whole model reads: the ends (embedding, final norm and, unless
/// tied, the head) and each layer's projections and vectors.
pub(crate) fn read_names(c: &ModelConfig) -> Vec<String> {
    let pre = c.layout.prefix();
    let mut out = vec![
        format!("{pre}embed_tokens.weight"),
        format!("{pre}norm.weight"),
    ];
    if !c.tie_word_embeddings {
        out.push("lm_head.weight".to_string());
    }
    for i in 0..c.num_hidden_layers {
        for (parts, _) in layer_linears(c, i) {
            out.extend(parts.into_iter().map(|(name, _)| name));
        }
        out.extend(layer_vectors(c, i).into_iter().map(|(name, _, _)| name));
    }
    out
}

pub(super) fn load_layer(c: &ModelConfig, ck: &Checkpoint, i: usize) -> Result<Layer> {
    let [gate_up, down, mix_in, mix_out] =
        layer_linears(c, i).map(|(parts, k)| Linear::load(ck, k, &parts));
    let mut vecs = layer_vectors(c, i)
        .into_iter()
        .map(|(name, shape, kind)| ck.read_vector(&name, &shape, kind))
        .collect::<Result<Vec<_>>>()?
        .into_iter();
    let mut next = || {
        vecs.next()
            .expect("layer_vectors lists every vector read here")
    };
    let (input_norm, post_norm) = (next(), next());
    let (in_proj, out_proj) = (mix_in?, mix_out?);
    let mixer = match c.layer_types[i] {
        LayerKind::LinearAttention => {
            let (conv_weight, dt_bias, neg_a, norm) = (next(), next(), next(), next());
            Mixer::Linear(GdnWeights {
                in_proj,
                conv_weight,
                dt_bias,
                neg_a,
                norm,
                out_proj,
            })
        }
        LayerKind::FullAttention => Mixer::Attention(AttnWeights {
            qkv: in_proj,
            q_norm: next(),
            k_norm: next(),
            o_proj: out_proj,
        }),
    };
    Ok(Layer {
        input_norm,
        post_norm,
        mixer,
        gate_up: gate_up?,
        down: down?,
    })
}

/// Bytes of a vector the load reads as f32 (4 per element), checked as that read checks it: present, of `shape`,
/// in a dtype it converts.
fn vector_bytes(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<u64> {
    ckpt.check_shape(name, shape)?;
    let d = ckpt.dtype(name)?;
    if let StoredDtype::Other(_) = d {
        return Err(unsupported(&ckpt.stored_name(name), &d));
    }
    shape
        .iter()
        .try_fold(4u64, |a, &x| a.checked_mul(x as u64))
        .ok_or_else(|| ModelError::InvalidConfig("the weights' size overflows".into()))
}

/// Bytes [`Model::from_checkpoint`] will allocate for the weights `opts` names, computed from the checkpoint's tensor
/// headers alone (nothing is read or allocated): each fused projection packed in its parts' common dtype with its
/// panel padding ([`PackedMatrix::packed_bytes`](backburner_kernels::matmul::PackedMatrix::packed_bytes)), and 4
/// bytes per element of every vector read as f32. Equals [`Model::weight_bytes`] of the loaded model, so a caller can
/// check a memory budget before loading. (The load's transient memory is the file pages it reads, which it releases
/// tensor by tensor, and a few small allocations.)
///
/// Errors: [`ModelError::InvalidConfig`] for a layer range outside the model or a size that overflows `u64`;
/// [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`] and [`ModelError::UnsupportedDtype`] for any tensor
/// the load would read (the ends' embedding, final norm and untied head, every layer's projections and vectors), as
/// the load itself reports them.
pub fn load_bytes(ckpt: &Checkpoint, c: &ModelConfig, opts: &LoadOptions) -> Result<u64> {
    use backburner_kernels::matmul::WeightDtype;
    if opts.layers.end > c.num_hidden_layers || opts.layers.start > opts.layers.end {
        return Err(ModelError::InvalidConfig(format!(
            "layer range {:?} is outside 0..{}",
            opts.layers, c.num_hidden_layers
        )));
    }
    let overflow = || ModelError::InvalidConfig("the weights' size overflows".into());
    let add = |a: u64, b: u64| a.checked_add(b).ok_or_else(overflow);
    // a fused projection: the parts' rows packed in their common dtype
    let linear = |parts: &[(String, usize)], k: usize| -> Result<u64> {
        let formats = parts
            .iter()
            .map(|(name, rows)| {
                // the shape first: a size from the config that the file does not have is named as such
                ckpt.check_shape(name, &[*rows, k])?;
                let d = ckpt.dtype(name)?;
                match (&d, dense_dtype(&d)) {
                    (_, Some(dense)) => Ok((None, dense, *rows)),
                    (StoredDtype::Quant(q), None) => Ok((Some(*q), WeightDtype::F32, *rows)),
                    _ => Err(unsupported(&ckpt.stored_name(name), &d)),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        crate::linear::packed_bytes(&formats, k)
            .map(|b| b as u64)
            .ok_or_else(overflow)
    };
    let vector = |name: &str, shape: &[usize]| vector_bytes(ckpt, name, shape);
    let pre = c.layout.prefix();
    let (h, v) = (c.hidden_size, c.vocab_size);
    let mut total = 0u64;
    if opts.ends {
        total = add(
            total,
            linear(&[(format!("{pre}embed_tokens.weight"), v)], h)?,
        )?;
        total = add(total, vector(&format!("{pre}norm.weight"), &[h])?)?;
        if !c.tie_word_embeddings {
            total = add(total, linear(&[("lm_head.weight".to_string(), v)], h)?)?;
        }
    }
    for i in opts.layers.clone() {
        for (parts, k) in layer_linears(c, i) {
            total = add(total, linear(&parts, k)?)?;
        }
        for (name, shape, _) in layer_vectors(c, i) {
            total = add(total, vector(&name, &shape)?)?;
        }
    }
    Ok(total)
}
