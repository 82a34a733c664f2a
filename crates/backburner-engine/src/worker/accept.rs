//! Accepting a host: the handshake on the worker's side, the checks of the session parameters, and loading the
//! layer range a session asks for.

use std::net::TcpStream;
use std::ops::Range;
use std::sync::Arc;

use backburner_kernels::kv::{KvDtype, KV_BLOCK};
use backburner_link::handshake::{worker_handshake, WorkerOffer};
use backburner_link::message::SessionParams;
use backburner_link::{Conn, ErrorCode, LinkError, WireKvDtype, WorkerLimits};
use backburner_model::{fingerprint, KvOptions, LoadOptions, Model, ModelConfig};
use tracing::info;

use super::registry::SessionGuard;
use super::{Loaded, SessionCore, SessionSpec, Shared, WorkerError, MAX_POSITIONS};

/// Checks a session's layer range: a split-prefill mirror needs a tail range `[L, n)` with L on a layer-cycle seam
/// strictly inside the model, or the empty range `[n, n)` for a session that only holds KV pages (a model without
/// such a seam, e.g. one layer cycle); a layer-split session (`layer_split`) any non-empty range inside `0..n`.
pub(super) fn check_range(
    c: &ModelConfig,
    r: &Range<usize>,
    layer_split: bool,
) -> Result<(), (ErrorCode, String)> {
    let n = c.num_hidden_layers;
    if layer_split {
        if r.start >= r.end || r.end > n {
            return Err((
                ErrorCode::LayerRangeMismatch,
                format!(
                    "layer range {}..{} is not a non-empty range of this {n}-layer model",
                    r.start, r.end
                ),
            ));
        }
        return Ok(());
    }
    let cyc = c.full_attention_interval;
    if r.start == n && r.end == n {
        return Ok(()); // KV pages only
    }
    if r.end != n || r.start == 0 || r.start >= r.end || !r.start.is_multiple_of(cyc) {
        let valid = valid_split_layers(c);
        let valid = if valid.is_empty() {
            "none".to_string()
        } else {
            valid
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err((
            ErrorCode::LayerRangeMismatch,
            format!(
                "layer range {}..{} is not a tail range on a {cyc}-layer cycle boundary of this {n}-layer model (valid starts: {valid})",
                r.start, r.end
            ),
        ));
    }
    Ok(())
}

/// Split points a host may use: multiples of `full_attention_interval` strictly inside `(0, n_layers)` (none when
/// the cycle is as long as the model).
pub fn valid_split_layers(c: &ModelConfig) -> Vec<usize> {
    (1..c.num_hidden_layers)
        .filter(|l| l % c.full_attention_interval == 0)
        .collect()
}

/// Drops the layers loaded for earlier sessions if none uses them now and they are not pinned (`--layers`).
pub(super) fn drop_idle_layers(shared: &Shared) {
    if shared.opts.layers.is_some() {
        return;
    }
    let mut g = shared.loaded.lock().unwrap_or_else(|p| p.into_inner());
    if g.as_ref().is_some_and(|l| Arc::strong_count(l) == 1) {
        *g = None;
    }
}

pub(super) fn load(shared: &Shared, range: Range<usize>) -> Result<Arc<Loaded>, WorkerError> {
    // experts loaded for earlier sessions that none uses now give their memory back (one lock at a time)
    super::experts::drop_idle_experts(shared);
    let mut g = shared.loaded.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = g.as_ref() {
        if l.range == range {
            return Ok(l.clone());
        }
        if Arc::strong_count(l) > 1 {
            return Err(WorkerError::LayerRange(format!(
                "this worker serves layers {}..{} to other hosts now",
                l.range.start, l.range.end
            )));
        }
    }
    // free the old range's weights (and their reservation) before loading the new one; the new weights count
    // against --max-memory, reserved from the checkpoint's headers before anything is allocated
    *g = None;
    let opts = LoadOptions {
        layers: range.clone(),
        ends: false,
    };
    let need = backburner_model::load_bytes(&shared.ckpt, &shared.config, &opts)?;
    let weights = shared
        .budget
        .reserve(need, "the weights of its layers")
        .map_err(|e| WorkerError::Memory {
            layers: range.clone(),
            need,
            used: e.used,
            limit: e.limit,
        })?;
    info!(?range, weight_bytes = need, "loading layers");
    let model = shared.pool.install(|| {
        Model::from_checkpoint(
            shared.config.clone(),
            &shared.ckpt,
            &LoadOptions {
                layers: range.clone(),
                ends: false,
            },
            |_, _| {},
        )
    })?;
    let fp = fingerprint(&shared.ckpt, &shared.config, range.clone())?;
    let l = Arc::new(Loaded {
        model: Arc::new(model),
        range,
        fingerprint: fp,
        _weights: weights,
    });
    *g = Some(l.clone());
    Ok(l)
}

/// A session the handshake accepted: the layers it uses (held, so no other range replaces them meanwhile), its slot
/// and its state.
pub(super) struct Accepted {
    pub loaded: Option<Arc<Loaded>>,
    /// Experts on the worker: the experts the session answers with.
    pub experts: Option<Arc<super::experts::LoadedExperts>>,
    pub guard: SessionGuard,
    pub core: SessionCore,
}

/// Checks the host's parameters (after its MAC verified); loads the layers, opens the session slot and reserves
/// the session's state.
fn accept_params(
    shared: &Shared,
    p: &SessionParams,
    session: u64,
    handle: TcpStream,
) -> Result<Accepted, (ErrorCode, String)> {
    let c = &shared.config;
    let o = &shared.opts;
    let range = p.layer_start as usize..p.layer_end as usize;
    if p.n_layers as usize != c.num_hidden_layers || p.hidden as usize != c.hidden_size {
        return Err((
            ErrorCode::ModelMismatch,
            format!(
                "host model has {} layers / hidden {}, this worker's has {} / {}",
                p.n_layers, p.hidden, c.num_hidden_layers, c.hidden_size
            ),
        ));
    }
    let holds_experts = !p.experts.is_empty();
    check_range(c, &range, p.layer_split || holds_experts)?;
    if let (Some(fixed), false) = (&o.layers, holds_experts) {
        if *fixed != range {
            return Err((
                ErrorCode::LayerRangeMismatch,
                format!(
                    "this worker serves layers {}..{} (--layers), the host asked for {}..{}",
                    fixed.start, fixed.end, range.start, range.end
                ),
            ));
        }
    }
    // an experts session holds no KV: its page size is not used
    let page = usize::try_from(p.kv_page_size)
        .ok()
        .filter(|v| *v > 0 && v.is_multiple_of(KV_BLOCK) && (*v as u64) <= MAX_POSITIONS)
        .or(holds_experts.then_some(KV_BLOCK));
    let max_positions = usize::try_from(MAX_POSITIONS).unwrap_or(usize::MAX);
    let Some(page) = page else {
        return Err((
            ErrorCode::ParamMismatch,
            // pages allocate whole blocks of 64 positions: smaller or ragged pages would hold up to 64 times the
            // memory the budget counts
            format!(
                "kv_page_size {} must be a multiple of {KV_BLOCK} in {KV_BLOCK}..=2^40",
                p.kv_page_size
            ),
        ));
    };
    let kv = KvOptions {
        page_size: page,
        dtype: match p.kv_dtype {
            WireKvDtype::F16 => KvDtype::F16,
            WireKvDtype::F32 => KvDtype::F32,
            WireKvDtype::Bf16 => KvDtype::Bf16,
        },
    };
    // bf16 pages pair dimensions: they need an even head_dim (docs/PROTOCOL.md §4.4 check 5)
    kv.check(c).map_err(|m| (ErrorCode::ParamMismatch, m))?;
    if p.ubatch == 0 || p.ubatch as usize > o.max_ubatch {
        return Err((
            ErrorCode::ParamMismatch,
            format!(
                "ubatch {} is outside 1..={} (the worker's --max-ubatch)",
                p.ubatch, o.max_ubatch
            ),
        ));
    }
    let guard = shared
        .registry
        .open_session(session, handle)
        .map_err(|m| (ErrorCode::Busy, m))?;
    if holds_experts {
        return accept_experts(shared, p, range, kv, guard);
    }
    let l = load(shared, range).map_err(load_fault)?;
    if l.fingerprint != p.fingerprint {
        return Err((
            ErrorCode::ModelMismatch,
            format!(
                "model fingerprint differs for layers {}..{}: the worker's checkpoint ({}, --precision {}) is not the \
                 host's (or the host's --precision differs)",
                p.layer_start,
                p.layer_end,
                o.model_dir.display(),
                o.precision
            ),
        ));
    }
    let spec = SessionSpec {
        range: l.range.clone(),
        kv,
        ubatch: p.ubatch as usize,
        max_positions,
        max_frame: o.max_frame,
        pack_pages: o.pack_pages,
        layer_split: p.layer_split,
    };
    // the session's state is reserved before the host is welcomed, so a full worker says so in the handshake
    let core =
        SessionCore::new(l.model.clone(), spec, &shared.budget).map_err(|f| (f.code, f.message))?;
    Ok(Accepted {
        loaded: Some(l),
        experts: None,
        guard,
        core,
    })
}

/// The handshake's code and message for a failed load.
fn load_fault(e: WorkerError) -> (ErrorCode, String) {
    match e {
        WorkerError::LayerRange(m) => (ErrorCode::LayerRangeMismatch, m),
        e @ WorkerError::Memory { .. } => (ErrorCode::OutOfMemory, e.to_string()),
        WorkerError::Model(m @ backburner_model::ModelError::InvalidConfig(_)) => {
            (ErrorCode::ParamMismatch, m.to_string())
        }
        other => (ErrorCode::Internal, other.to_string()),
    }
}

/// An experts session (`SessionParams.experts`): loads the experts, checks the fingerprint of their layers, and
/// opens a session that runs no layer and answers `Experts` requests.
fn accept_experts(
    shared: &Shared,
    p: &SessionParams,
    range: Range<usize>,
    kv: KvOptions,
    guard: SessionGuard,
) -> Result<Accepted, (ErrorCode, String)> {
    let c = &shared.config;
    if let Some(fixed) = &shared.opts.layers {
        return Err((
            ErrorCode::LayerRangeMismatch,
            format!(
                "this worker serves layers {}..{} (--layers); start it without --layers to hold routed experts",
                fixed.start, fixed.end
            ),
        ));
    }
    let ids: Vec<usize> = p.experts.iter().map(|&e| e as usize).collect();
    if p.layer_split || ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err((
            ErrorCode::ParamMismatch,
            "an experts session names its experts in strictly ascending order and runs no layer"
                .into(),
        ));
    }
    let l = super::experts::load(shared, range.clone(), &ids).map_err(load_fault)?;
    if l.fingerprint != p.fingerprint {
        return Err((
            ErrorCode::ModelMismatch,
            format!(
                "model fingerprint differs for layers {}..{}: the worker's checkpoint ({}, --precision {}) is not the \
                 host's (or the host's --precision differs)",
                range.start,
                range.end,
                shared.opts.model_dir.display(),
                shared.opts.precision
            ),
        ));
    }
    let n = c.num_hidden_layers;
    let none = LoadOptions {
        layers: n..n,
        ends: false,
    };
    let model = Model::from_checkpoint(c.clone(), &shared.ckpt, &none, |_, _| {})
        .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
    let spec = SessionSpec {
        range: n..n,
        kv,
        ubatch: p.ubatch as usize,
        max_positions: usize::try_from(MAX_POSITIONS).unwrap_or(usize::MAX),
        max_frame: shared.opts.max_frame,
        pack_pages: false,
        layer_split: false,
    };
    let mut core =
        SessionCore::new(Arc::new(model), spec, &shared.budget).map_err(|f| (f.code, f.message))?;
    core.experts = Some(l.store.clone());
    Ok(Accepted {
        loaded: None,
        experts: Some(l),
        guard,
        core,
    })
}

/// The worker's side of the handshake on a new connection, within the connection's handshake deadline.
pub(super) fn handshake(
    shared: &Shared,
    conn: &mut Conn,
    handle: TcpStream,
) -> Result<Accepted, LinkError> {
    let o = &shared.opts;
    let offer = WorkerOffer {
        secret: o.secret.clone(),
        threads: u32::try_from(o.threads).unwrap_or(u32::MAX),
        layers: o
            .layers
            .as_ref()
            .and_then(|r| Some((u32::try_from(r.start).ok()?, u32::try_from(r.end).ok()?))),
        limits: WorkerLimits {
            max_ubatch: u32::try_from(o.max_ubatch).unwrap_or(u32::MAX),
            max_frame: o.max_frame as u64,
            max_memory: o.max_memory,
        },
        session: loop {
            let s: u64 = rand::random();
            if s != 0 {
                break s;
            }
        },
        reply_timeout: o.pace.base,
    };
    let mut accepted = None;
    worker_handshake(conn, &offer, |p| {
        accepted = Some(accept_params(shared, p, offer.session, handle)?);
        Ok(())
    })?;
    let acc = accepted.expect("the handshake accepted the parameters");
    conn.reader.set_max_tensor(o.max_frame);
    conn.reader.set_pace(Some(o.pace));
    Ok(acc)
}
