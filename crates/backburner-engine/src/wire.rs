//! Encoding of state payloads on the link (`Sync` and `FetchDone` tensor sections), shared by host and worker.
//!
//! Layout, for the layers of a range in ascending order: each full-attention layer contributes K rows then V rows of
//! positions `[p0, p1)` (`[p1-p0, n_kv_heads, head_dim]`, in the KV dtype: f16, f32 or bf16, little-endian); then, if
//! linear states are included, each Gated DeltaNet layer contributes its conv state `[conv_dim, kernel-1]` f32 and
//! its recurrent state `[n_v_heads, d_k, d_v]` f32. KV rows travel in their storage dtype, so adopting them is exact.

use std::ops::Range;

use backburner_kernels::kv::KvDtype;
use backburner_link::LinkError;
use backburner_model::{LayerKind, LinearState, ModelConfig, ModelState};
use half::{bf16, f16};

/// Bytes of one KV element on the wire.
fn elem(dtype: KvDtype) -> usize {
    match dtype {
        KvDtype::F16 | KvDtype::Bf16 => 2,
        KvDtype::F32 => 4,
    }
}

fn put(out: &mut Vec<u8>, x: &[f32], dtype: KvDtype) {
    match dtype {
        KvDtype::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        KvDtype::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        KvDtype::Bf16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
    }
}

fn get(b: &[u8], dtype: KvDtype) -> Vec<f32> {
    match dtype {
        KvDtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        KvDtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        KvDtype::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

/// Size in bytes of a payload for `n_rows` positions over `layers` (with or without linear states), or `None` when
/// it does not fit in `usize` (a size taken from the wire may be anything).
pub fn payload_len(
    cfg: &ModelConfig,
    layers: Range<usize>,
    n_rows: usize,
    dtype: KvDtype,
    linear: bool,
) -> Option<usize> {
    let row = (cfg.num_key_value_heads * cfg.head_dim * elem(dtype)).checked_mul(2)?;
    let lin = 4
        * (cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1)
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
    layers.clone().try_fold(0usize, |acc, i| {
        let add = match cfg.layer_types.get(i)? {
            LayerKind::FullAttention => n_rows.checked_mul(row)?,
            LayerKind::LinearAttention if linear => lin,
            LayerKind::LinearAttention => 0,
        };
        acc.checked_add(add)
    })
}

/// Bytes of K and V rows of one full-attention layer as f32 (the transient buffer encoding or applying a payload
/// allocates per layer), or `None` on overflow.
pub fn layer_rows_f32_bytes(cfg: &ModelConfig, n_rows: usize) -> Option<usize> {
    n_rows.checked_mul(8 * cfg.num_key_value_heads * cfg.head_dim)
}

/// Encodes rows `[p0, p1)` of the attention layers of `layers` and (if `linear`) the linear states.
pub fn encode(
    state: &ModelState,
    cfg: &ModelConfig,
    layers: Range<usize>,
    p0: usize,
    p1: usize,
    linear: bool,
) -> Vec<u8> {
    let dtype = state.kv_options().dtype;
    let mut out =
        Vec::with_capacity(payload_len(cfg, layers.clone(), p1 - p0, dtype, linear).unwrap_or(0));
    for i in layers.clone() {
        if let Some((k, v)) = state.read_kv_rows(i, p0, p1) {
            put(&mut out, &k, dtype);
            put(&mut out, &v, dtype);
        }
    }
    if linear {
        for i in layers {
            if let Some(s) = state.linear(i) {
                s.conv
                    .iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
                s.recurrent
                    .iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
    }
    out
}

/// Applies a payload for `n_rows` positions: appends the KV rows to each attention layer of `layers` and, if `linear`,
/// replaces the linear states. The caller sets the position afterwards.
///
/// Errors: [`LinkError::Malformed`] when the payload length does not match (nothing is applied then) or a value is
/// not finite (earlier layers may be applied then: the caller restores or discards the state).
pub fn apply(
    state: &mut ModelState,
    cfg: &ModelConfig,
    layers: Range<usize>,
    n_rows: usize,
    linear: bool,
    payload: &[u8],
) -> Result<(), LinkError> {
    let dtype = state.kv_options().dtype;
    let want = payload_len(cfg, layers.clone(), n_rows, dtype, linear);
    if Some(payload.len()) != want {
        return Err(LinkError::Malformed(format!(
            "state payload is {} bytes, expected {want:?} for {n_rows} rows of layers {layers:?}",
            payload.len()
        )));
    }
    let kv = n_rows * cfg.num_key_value_heads * cfg.head_dim * elem(dtype);
    let mut off = 0;
    for i in layers.clone() {
        if cfg.layer_types[i] == LayerKind::FullAttention {
            let k = get(&payload[off..off + kv], dtype);
            let v = get(&payload[off + kv..off + 2 * kv], dtype);
            finite(&k, i)?;
            finite(&v, i)?;
            off += 2 * kv;
            if !state.append_kv_rows(i, &k, &v, n_rows) {
                return Err(LinkError::Malformed(format!("layer {i} is not held")));
            }
        }
    }
    if linear {
        let nc = cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1);
        let nr = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
        for i in layers {
            if cfg.layer_types[i] == LayerKind::LinearAttention {
                let conv = backburner_link::frame::bytes_f32(&payload[off..off + 4 * nc])?;
                off += 4 * nc;
                let recurrent = backburner_link::frame::bytes_f32(&payload[off..off + 4 * nr])?;
                finite(&conv, i)?;
                finite(&recurrent, i)?;
                off += 4 * nr;
                if !state.set_linear(i, LinearState { conv, recurrent }) {
                    return Err(LinkError::Malformed(format!("layer {i} is not held")));
                }
            }
        }
    }
    Ok(())
}

/// Refuses rows or states with a NaN or an infinity: a correct peer never sends them for a model whose local run is
/// finite, and adopting them would turn every later logit into NaN. (A local run that overflows f16 falls back to
/// local compute and gets its own result.)
fn finite(x: &[f32], layer: usize) -> Result<(), LinkError> {
    if x.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    Err(LinkError::Malformed(format!(
        "non-finite values in the state of layer {layer} from the peer"
    )))
}

/// Truncates the attention layers' KV caches of `state` to `len` positions (the linear states are left alone; the
/// caller replaces them).
pub fn truncate_kv(state: &mut ModelState, layers: Range<usize>, len: usize) {
    for i in layers {
        if let Some(backburner_model::LayerState::Attention(c)) = state.layer_mut(i) {
            c.truncate(len);
        }
    }
}
