//! `run --device`: the modes of `run` that cannot run layers on a device are refused before anything loads, the
//! device is opened, and after the load the layers `--device-layers` names are placed on it.

use std::sync::Arc;

use anyhow::Result;
use backburner_engine::open::{self, Host, SessionRequest};
use backburner_engine::Session;
use backburner_model::device::Backend;

use super::RunArgs;
use crate::spec_args::SpecKind;

/// Refuses what `run` cannot do with layers on a device (workers that compute layers, speculative decoding; workers
/// holding KV pages are fine: split prefill is not used with placed layers; `--n-choices` rewinds to a snapshot,
/// which covers the device's state), then opens the device: `None` for `--device cpu`.
///
/// Errors: [`crate::device_args::DeviceFlagError`].
pub(super) fn check(a: &RunArgs) -> Result<Option<Arc<dyn Backend>>> {
    let d = &a.model.device;
    let refused = if a.link.splits_layers() {
        Some("a run whose workers compute layers (--split-layer, --layer-split, --expert-split)")
    } else if a.spec.spec != SpecKind::None {
        Some("speculative decoding (--spec: its verify steps and MTP drafts)")
    } else {
        None
    };
    if let Some(what) = refused {
        d.refuse(what)?;
    }
    crate::device_args::note_idle_workers(&a.model, &a.link);
    Ok(d.open()?)
}

/// Loads the model as `req` asks, placing the layers `--device-layers` names on `backend` (when given) as they
/// load ([`open::load_placed`]: the host never holds their weights), and opens the session: with no backend,
/// exactly [`open::open`]. `printer` hears the load.
pub(super) fn open_session(
    req: SessionRequest,
    a: &RunArgs,
    backend: Option<Arc<dyn Backend>>,
) -> Result<(Host, Session)> {
    let mut printer = crate::placement::Printer::new(a.json);
    let Some(b) = backend else {
        return Ok(open::open(req, &mut printer)?);
    };
    let n = a
        .model
        .device_layer_count(Some(&b), &req.dir, a.model.ctx_limit(), 1)?;
    let place = crate::device_args::place(&req.config, &b, n);
    let host = open::load_placed(req, place, &mut printer)?;
    crate::device_args::place_loaded(&host.model, Some(&b));
    let session = host.session()?;
    Ok((host, session))
}
