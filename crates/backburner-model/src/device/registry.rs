//! Which devices this build and machine offer, and opening one by id. The CPU is always there; a GPU backend crate
//! adds a [`Provider`] (the CLI registers `backburner-cuda`'s when built with the `cuda` feature).

use std::sync::Arc;

use super::backend::Backend;
use super::cpu::CpuBackend;
use super::id::{BackendKind, DeviceError, DeviceId, DeviceInfo};

/// One backend's devices: lists them and opens one.
pub trait Provider: Send + Sync {
    /// The backend.
    fn kind(&self) -> BackendKind;
    /// The devices it finds on this machine (empty, not an error, when the driver is missing or finds none).
    fn devices(&self) -> Vec<DeviceInfo>;
    /// Why [`Provider::devices`] is empty, if it is (the driver library is missing, no device was found).
    fn unavailable(&self) -> Option<String>;
    /// Opens device `index`.
    ///
    /// Errors: [`DeviceError::NotFound`] for an index the machine lacks or a missing driver; the driver's errors.
    fn open(&self, index: usize) -> Result<Arc<dyn Backend>, DeviceError>;
}

/// The CPU's provider.
struct CpuProvider;

impl Provider for CpuProvider {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![cpu_info()]
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    fn open(&self, _index: usize) -> Result<Arc<dyn Backend>, DeviceError> {
        Ok(Arc::new(CpuBackend))
    }
}

/// The providers of a build.
pub struct Registry {
    providers: Vec<Box<dyn Provider>>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::cpu_only()
    }
}

impl Registry {
    /// The CPU alone.
    pub fn cpu_only() -> Self {
        Registry {
            providers: vec![Box::new(CpuProvider)],
        }
    }

    /// Adds a backend's provider (replacing one of the same kind).
    pub fn with(mut self, p: Box<dyn Provider>) -> Self {
        self.providers.retain(|q| q.kind() != p.kind());
        self.providers.push(p);
        self
    }

    /// Whether this build has the backend.
    pub fn has(&self, kind: BackendKind) -> bool {
        self.providers.iter().any(|p| p.kind() == kind)
    }

    /// Every device of every backend built, the CPU first; with, per backend that found none, why.
    pub fn list(&self) -> (Vec<DeviceInfo>, Vec<(BackendKind, String)>) {
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for p in &self.providers {
            let d = p.devices();
            if d.is_empty() {
                let why = p.unavailable().unwrap_or_else(|| "no device found".into());
                missing.push((p.kind(), why));
            }
            found.extend(d);
        }
        (found, missing)
    }

    /// Opens device `id`.
    ///
    /// Errors: [`DeviceError::NotBuilt`] when this build lacks its backend (with the cargo feature that adds it);
    /// the provider's errors.
    pub fn open(&self, id: DeviceId) -> Result<Arc<dyn Backend>, DeviceError> {
        match self.providers.iter().find(|p| p.kind() == id.kind) {
            Some(p) => p.open(id.index),
            None => Err(DeviceError::NotBuilt(id.kind.name(), build_hint(id.kind))),
        }
    }

    /// The info of device `id`, if this build and machine have it.
    pub fn info(&self, id: DeviceId) -> Option<DeviceInfo> {
        let p = self.providers.iter().find(|p| p.kind() == id.kind)?;
        p.devices().into_iter().find(|d| d.id == id)
    }
}

/// How to get a build with `kind`'s backend.
fn build_hint(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Cpu => "",
        BackendKind::Cuda => {
            "rebuild with `cargo build --release --features cuda` (see docs/DEVICES.md)"
        }
        BackendKind::Vulkan => {
            "no Vulkan backend exists yet (docs/DEVICES.md says why CUDA came first)"
        }
    }
}

/// The CPU as a device: its model name (`/proc/cpuinfo`), the memory available to this process
/// (`/proc/meminfo`'s `MemAvailable`; total where that is missing) and the kernels' instruction set.
pub fn cpu_info() -> DeviceInfo {
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let (total, avail) = meminfo();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    DeviceInfo {
        id: DeviceId::CPU,
        name,
        memory_bytes: total,
        free_bytes: avail,
        backend: format!(
            "kernels: {}, {threads} threads",
            backburner_kernels::matmul::bf16_kernel_isa()
        ),
    }
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo` in bytes (0 and `None` where it cannot be read).
fn meminfo() -> (u64, Option<u64>) {
    let Ok(s) = std::fs::read_to_string("/proc/meminfo") else {
        return (0, None);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .and_then(|kb| kb.checked_mul(1024))
    };
    (field("MemTotal:").unwrap_or(0), field("MemAvailable:"))
}
