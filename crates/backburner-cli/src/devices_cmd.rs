//! `backburner devices`: what this build and machine offer to compute on, as `llama-cli --list-devices` lists them:
//! one line per device (id, name, memory, free memory where known, backend), then why a backend built found none,
//! then the backends this build was made without and how to get them.

use anyhow::Result;
use backburner_model::device::{BackendKind, DeviceError, DeviceId, DeviceInfo, Registry};
use clap::Args;

use crate::device_args::{gib, registry};
use crate::run_cmd::out_line;

/// `backburner devices`.
#[derive(Args)]
pub struct DevicesArgs {
    /// Print one JSON object: `devices` (`id`, `name`, `memory_bytes`, `free_bytes` or null, `backend`),
    /// `unavailable` (`backend`, `why`: built, found none) and `not_built` (`backend`, `how`).
    #[arg(long)]
    json: bool,
}

/// The backends this program knows beside the CPU, in listing order.
const OTHER_BACKENDS: [BackendKind; 2] = [BackendKind::Cuda, BackendKind::Vulkan];

/// What a registry offers: its devices, the backends built that found none (with why), the backends not built (with
/// how to get them).
struct Listing {
    devices: Vec<DeviceInfo>,
    unavailable: Vec<(BackendKind, String)>,
    not_built: Vec<(BackendKind, String)>,
}

fn listing(reg: &Registry) -> Listing {
    let (devices, unavailable) = reg.list();
    let not_built = OTHER_BACKENDS
        .into_iter()
        .filter(|&k| !reg.has(k))
        .map(|kind| {
            // the registry's own words for a backend it lacks (the cargo feature to build it with)
            let how = match reg.open(DeviceId { kind, index: 0 }) {
                Err(DeviceError::NotBuilt(_, how)) => how.to_string(),
                _ => String::new(),
            };
            (kind, how)
        })
        .collect();
    Listing {
        devices,
        unavailable,
        not_built,
    }
}

/// One device's line: `cpu  AMD EPYC 9B45  62.80 GiB (41.07 GiB free)  kernels: AVX-512 BF16, 2 threads`.
fn device_line(d: &DeviceInfo) -> String {
    let free = d
        .free_bytes
        .map_or(String::new(), |f| format!(" ({} free)", gib(f)));
    format!(
        "{:<9} {}  {}{free}  {}",
        d.id.to_string(),
        d.name,
        gib(d.memory_bytes),
        d.backend
    )
}

/// Runs `backburner devices`.
pub fn run(a: DevicesArgs) -> Result<()> {
    let l = listing(&registry());
    if a.json {
        let devices: Vec<serde_json::Value> = l
            .devices
            .iter()
            .map(|d| {
                serde_json::json!({
                    "id": d.id.to_string(),
                    "name": d.name,
                    "memory_bytes": d.memory_bytes,
                    "free_bytes": d.free_bytes,
                    "backend": d.backend,
                })
            })
            .collect();
        let pairs = |v: &[(BackendKind, String)], key: &str| -> Vec<serde_json::Value> {
            v.iter()
                .map(|(k, s)| serde_json::json!({"backend": k.name(), key: s}))
                .collect()
        };
        let obj = serde_json::json!({
            "devices": devices,
            "unavailable": pairs(&l.unavailable, "why"),
            "not_built": pairs(&l.not_built, "how"),
        });
        out_line(&obj.to_string());
        return Ok(());
    }
    out_line("devices:");
    for d in &l.devices {
        out_line(&format!("  {}", device_line(d)));
    }
    for (k, why) in &l.unavailable {
        out_line(&format!("{} backend: no device: {why}", k.name()));
    }
    for (k, how) in &l.not_built {
        out_line(&format!("not built: {}: {how}", k.name()));
    }
    Ok(())
}
