//! `--device` and `--device-layers`: which device computes a command's layers (`cpu`, the default, computes them all
//! as before), the registry of the devices this build offers, and the typed refusals of the commands and modes that
//! cannot run layers on a device yet (docs/DEVICES.md).

use std::ops::Range;
use std::sync::Arc;

use backburner_model::device::{Backend, DeviceError, DeviceId, LayerPlacement, Registry};
use backburner_model::{Model, ModelConfig};
use clap::Args;

pub use crate::device_layers::DeviceLayers;

/// The device flags of every command that computes.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Device that computes the model's layers: `cpu` (the default: every layer on this machine's cores, as without
    /// the flag), `cuda:N` (an NVIDIA GPU: a build with `--features cuda`) or `vulkan:N` (no backend yet).
    /// `backburner devices` lists what this build and machine offer; llama.cpp's spellings (`CUDA0`, `none` for
    /// cpu) work too. Layers on a device run in `run`, `chat`, `serve` and `perplexity` (workers may hold KV pages,
    /// not compute layers; no speculative decoding); the other commands and modes accept only `cpu` for now
    /// (docs/DEVICES.md).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceId,
    /// With a --device other than cpu: the first N of the layers this command holds go on the device, the rest stay
    /// on the CPU (llama.cpp's -ngl; more than the model has: all). `all` or -1: every layer (the default). `auto`:
    /// as many as fit the device's free memory with their KV or state at the command's context (serve: for each
    /// --parallel slot) and a 1 GiB reserve, as `backburner plan --device D --device-memory M` computes it; a line
    /// says what it chose. With --device cpu, `all` and `auto` place nothing.
    #[arg(long, value_name = "N|all|auto", allow_hyphen_values = true, value_parser = crate::device_layers::parse_device_layers)]
    pub device_layers: Option<DeviceLayers>,
    /// Tests: place the layers on the device layer's CPU backend (`--device cpu` only), which gives the CPU path's
    /// bits, so that the placement path of a command runs without a GPU.
    #[arg(long, hide = true)]
    pub device_cpu_backend: bool,
    /// The free memory `--device-layers auto` sizes for, in place of what the device reports (tests: the CPU
    /// backend reports the host's).
    #[arg(long, hide = true, value_name = "BYTES", value_parser = crate::device_layers::parse_device_memory)]
    pub device_free_memory: Option<u64>,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        DeviceArgs {
            device: DeviceId::CPU,
            device_layers: None,
            device_cpu_backend: false,
            device_free_memory: None,
        }
    }
}

/// Why a command cannot compute on the device its flags name.
#[derive(Debug, thiserror::Error)]
pub enum DeviceFlagError {
    /// A command or mode that runs every layer on the CPU path only (for now).
    #[error(
        "--device {device}: {what} cannot run layers on a device yet; use --device cpu (layers on a device run in \
         `run`, `chat`, `serve` and `perplexity`, with workers holding KV pages but not computing layers, without \
         speculative decoding; see docs/DEVICES.md)"
    )]
    NotSupported {
        /// The device asked for.
        device: DeviceId,
        /// What cannot run on it, and why.
        what: String,
    },
    /// `--device-layers N` (N > 0) with `--device cpu`.
    #[error(
        "--device-layers {n} puts layers on a device, but --device is cpu: name one (--device cuda:0; `backburner \
         devices` lists them)"
    )]
    LayersWithoutDevice {
        /// The layers asked for.
        n: usize,
    },
    /// `--device-layers auto` could not size the model.
    #[error("--device-layers auto on {device}: {why}")]
    Auto {
        /// The device asked for.
        device: DeviceId,
        /// Why.
        why: String,
    },
    /// The device layer refused: a backend this build lacks, a device the machine lacks, layers it cannot hold.
    #[error("--device {device}: {cause}")]
    Device {
        /// The device asked for.
        device: DeviceId,
        /// The device layer's error.
        cause: DeviceError,
    },
}

/// `--device`: a [`DeviceId`] (`cpu`, `cuda:N`, `vulkan:N`), or llama.cpp's names of one (`CUDA0`, `Vulkan1`,
/// `none` = the CPU). Errors: [`DeviceError::BadName`]'s message.
pub fn parse_device(s: &str) -> Result<DeviceId, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("none") {
        return Ok(DeviceId::CPU);
    }
    // llama.cpp's `CUDA0`: a backend's name and an index with no colon
    let split = t
        .find(|c: char| c.is_ascii_digit())
        .filter(|&i| i > 0 && !t.contains(':') && t[i..].bytes().all(|b| b.is_ascii_digit()));
    let r = match split {
        Some(i) if !t[..i].eq_ignore_ascii_case("cpu") => {
            format!("{}:{}", &t[..i], &t[i..]).parse::<DeviceId>()
        }
        _ => t.parse::<DeviceId>(),
    };
    r.map_err(|_| DeviceError::BadName(s.to_string()).to_string())
}

/// The devices this build offers: the CPU, and the CUDA backend in a build with the `cuda` feature.
pub fn registry() -> Registry {
    #[cfg(feature = "cuda")]
    {
        Registry::cpu_only().with(Box::new(backburner_cuda::CudaProvider))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Registry::cpu_only()
    }
}

impl DeviceArgs {
    /// Whether every layer computes on the CPU path (`--device cpu`, the default, without the tests' CPU backend).
    pub fn is_cpu(&self) -> bool {
        self.device.is_cpu() && !self.device_cpu_backend
    }

    /// Refuses a device other than the CPU for `what` (a command or mode that cannot run layers on one: named in the
    /// error with why); `--device cpu` passes (with `--device-layers` 0 or absent).
    pub fn refuse(&self, what: &str) -> Result<(), DeviceFlagError> {
        self.check_layers()?;
        if self.is_cpu() {
            return Ok(());
        }
        Err(DeviceFlagError::NotSupported {
            device: self.device,
            what: what.to_string(),
        })
    }

    /// Opens the device (before the weights load, so that a build or machine without it fails at once): `None` for
    /// the CPU. Errors: [`DeviceFlagError::LayersWithoutDevice`], and the registry's ([`DeviceError::NotBuilt`]
    /// naming the cargo feature, [`DeviceError::NotFound`], a driver's).
    pub fn open(&self) -> Result<Option<Arc<dyn Backend>>, DeviceFlagError> {
        self.check_layers()?;
        if self.is_cpu() {
            return Ok(None);
        }
        if self.device.is_cpu() {
            return Ok(Some(Arc::new(backburner_model::device::CpuBackend)));
        }
        registry()
            .open(self.device)
            .map(Some)
            .map_err(|cause| DeviceFlagError::Device {
                device: self.device,
                cause,
            })
    }

    /// For a serving command (`what`: serve, chat): refuses the modes whose steps cannot run placed layers yet,
    /// workers that compute layers (`worker_layers`: split prefill at a layer, a layer split, routed experts;
    /// workers holding KV pages are fine) and speculative decoding (`spec`: its verify steps and MTP drafts), then
    /// opens the device (`None` for the CPU), before anything loads. The load places the layers ([`place`]).
    ///
    /// Errors: [`DeviceFlagError`] (a refusal, the device's).
    pub fn open_for_serving(
        &self,
        what: &str,
        worker_layers: bool,
        spec: bool,
    ) -> Result<Option<Arc<dyn Backend>>, DeviceFlagError> {
        if worker_layers {
            self.refuse(&format!(
                "{what} with workers that compute layers (--split-layer, --layer-split, --expert-split)"
            ))?;
        }
        if spec {
            self.refuse(&format!(
                "{what} with speculative decoding (--spec: its verify steps and MTP drafts)"
            ))?;
        }
        self.open()
    }

    /// `--device-layers N` with N > 0 needs a device (`all` and `auto` with `--device cpu` place nothing).
    fn check_layers(&self) -> Result<(), DeviceFlagError> {
        match self.device_layers {
            Some(DeviceLayers::Count(n)) if n > 0 && self.is_cpu() => {
                Err(DeviceFlagError::LayersWithoutDevice { n })
            }
            _ if self.device_cpu_backend && !self.device.is_cpu() => {
                Err(DeviceFlagError::NotSupported {
                    device: self.device,
                    what: "--device-cpu-backend (it takes --device cpu)".into(),
                })
            }
            _ => Ok(()),
        }
    }
}

/// With layers on a device, workers hold KV pages only, and only with a KV budget (`--kv-budget`, or the plan's for
/// `--max-memory`): says so on stderr when `--worker` is given without either, as those workers will not be used.
pub fn note_idle_workers(model: &crate::ModelArgs, link: &crate::link_args::LinkArgs) {
    let device = !model.device.is_cpu();
    if device && !link.worker.is_empty() && link.kv_budget.is_none() && model.max_memory.is_none() {
        eprintln!(
            "note: with layers on {}, workers hold KV pages only, with --kv-budget B (or --max-memory for the plan to \
             set one); without either, --worker {} is not used",
            model.device.device,
            link.worker.join(",")
        );
    }
}

/// The layers `--device-layers` puts on the device: the first `n` (all when `None`; at most all) of `held`.
pub fn device_range(held: Range<usize>, n: Option<usize>) -> Range<usize> {
    let n = n.unwrap_or(held.len()).min(held.len());
    held.start..held.start + n
}

/// The layers `--device-layers n` puts on `backend` for a model with `config`: the first `n` (see [`device_range`])
/// of its layers, for a load to place as it reads them ([`backburner_engine::open::load_placed`]: the host never
/// holds their weights), ending before the first mixture-of-experts layer (they run on the CPU: a line on stderr
/// says so when that shortens the placement); `None` for no layer (`--device-layers 0`, or a first layer that is
/// one).
pub fn place(
    config: &ModelConfig,
    backend: &Arc<dyn Backend>,
    n: Option<usize>,
) -> Option<LayerPlacement> {
    let mut layers = device_range(0..config.num_hidden_layers, n);
    if let Some(moe) = layers
        .clone()
        .find(|&i| config.ffn_types.get(i) == Some(&backburner_model::FfnKind::Moe))
    {
        eprintln!(
            "layers {moe}..{} are mixture-of-experts layers, which run on the CPU: {} takes layers {}..{moe}",
            layers.end,
            backend.info().id,
            layers.start
        );
        layers.end = moe;
    }
    (!layers.is_empty()).then(|| LayerPlacement {
        layers,
        backend: backend.clone(),
    })
}

/// For a command that opened `backend` (none: the CPU path, nothing printed), prints where each layer of the
/// loaded `model` runs (`layers 0..48 on cuda:0 (40.25 GiB), 48..64 on cpu`).
pub fn place_loaded(model: &Model, backend: Option<&Arc<dyn Backend>>) {
    if let Some(line) = placement_of(model, backend) {
        eprintln!("{line}");
    }
}

/// Where each layer of the loaded `model` runs, for a command that opened `backend` (`None` without one): the line
/// [`place_loaded`] prints.
pub fn placement_of(model: &Model, backend: Option<&Arc<dyn Backend>>) -> Option<String> {
    let b = backend?;
    let held = model.layer_range();
    let on = model
        .placement()
        .first()
        .map_or(held.start..held.start, |(r, _)| r.clone());
    let line = placement_line(
        b.info().id,
        on.clone(),
        on.end..held.end,
        model.device_weight_bytes(),
    );
    Some(line)
}

/// `layers 0..48 on cuda:0 (40.25 GiB), 48..64 on cpu` (a side without layers left out).
pub fn placement_line(
    device: DeviceId,
    on: Range<usize>,
    cpu: Range<usize>,
    device_bytes: u64,
) -> String {
    let mut parts = Vec::new();
    if !on.is_empty() {
        parts.push(format!(
            "{}..{} on {device} ({})",
            on.start,
            on.end,
            gib(device_bytes)
        ));
    }
    if !cpu.is_empty() {
        parts.push(format!("{}..{} on cpu", cpu.start, cpu.end));
    }
    if parts.is_empty() {
        return "no layers".into();
    }
    format!("layers {}", parts.join(", "))
}

/// Bytes in GiB (2^30) with two decimals, MiB below one GiB.
pub fn gib(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if b as f64 >= GIB {
        format!("{:.2} GiB", b as f64 / GIB)
    } else {
        format!("{:.1} MiB", b as f64 / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_with_llama_cpp_spellings() {
        for (s, want) in [
            ("cpu", "cpu"),
            ("none", "cpu"),
            ("cuda:1", "cuda:1"),
            ("CUDA0", "cuda:0"),
            ("Vulkan2", "vulkan:2"),
            ("cuda", "cuda:0"),
        ] {
            assert_eq!(parse_device(s).unwrap().to_string(), want, "{s}");
        }
        for bad in ["gpu", "cpu1", "cuda:x", "metal0", "", "0"] {
            let e = parse_device(bad).unwrap_err();
            assert!(e.contains("is not a device name"), "{bad}: {e}");
        }
    }

    #[test]
    fn device_layers_take_the_first_n_held_layers() {
        assert_eq!(device_range(0..64, None), 0..64);
        assert_eq!(device_range(0..64, Some(48)), 0..48);
        assert_eq!(device_range(0..64, Some(999)), 0..64);
        assert_eq!(device_range(0..24, Some(0)), 0..0);
        assert_eq!(device_range(8..16, Some(3)), 8..11);
        assert_eq!(
            placement_line("cuda:0".parse().unwrap(), 0..48, 48..64, 3 << 30),
            "layers 0..48 on cuda:0 (3.00 GiB), 48..64 on cpu"
        );
        assert_eq!(
            placement_line("cuda:1".parse().unwrap(), 0..8, 8..8, 5 << 20),
            "layers 0..8 on cuda:1 (5.0 MiB)"
        );
    }

    #[test]
    fn refusals_name_the_device_and_pass_the_cpu() {
        let mut a = DeviceArgs::default();
        a.refuse("serve").unwrap();
        assert!(a.open().unwrap().is_none());
        a.device_layers = Some(DeviceLayers::Count(0));
        a.refuse("serve").unwrap();
        // every layer, or as many as fit: none without a device, not an error
        for l in [DeviceLayers::All, DeviceLayers::Auto] {
            a.device_layers = Some(l);
            a.refuse("serve").unwrap();
            assert!(a.open().unwrap().is_none());
        }
        a.device_layers = Some(DeviceLayers::Count(4));
        let e = a.refuse("serve").unwrap_err().to_string();
        assert!(
            e.starts_with("--device-layers 4 puts layers on a device"),
            "{e}"
        );
        a.device_layers = None;
        a.device = "cuda:0".parse().unwrap();
        let e = a
            .refuse("serve (its batched slots)")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--device cuda:0: serve (its batched slots) cannot run layers"),
            "{e}"
        );
        assert!(e.contains("docs/DEVICES.md"), "{e}");
    }
}
