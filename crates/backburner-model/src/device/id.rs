//! Naming the devices a build and a machine offer: `cpu`, `cuda:0`, `vulkan:1` (as `--device` takes them), what each
//! is (name, memory, backend) and the errors of finding and using one.

use std::fmt;
use std::str::FromStr;

/// The compute backends a device can belong to. Which of them a build has is [`crate::device::Registry`]'s business;
/// every kind parses whatever the build, so that a command line naming a backend the build lacks gets a clear error
/// rather than a parse failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// The host's cores: the kernels of `backburner-kernels` (always present).
    Cpu,
    /// An NVIDIA GPU through the CUDA driver API (the `backburner-cuda` crate, cargo feature `cuda`).
    Cuda,
    /// A GPU through Vulkan (not built yet; named so that `vulkan:0` gets a clear error).
    Vulkan,
}

impl BackendKind {
    /// The name as `--device` spells it (`cpu`, `cuda`, `vulkan`).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Vulkan => "vulkan",
        }
    }
}

/// One device: a backend and its index among that backend's devices (`cuda:1` is the second CUDA device). The CPU
/// is one device, `cpu` (index 0), whatever its cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// Its backend.
    pub kind: BackendKind,
    /// Its index among the backend's devices (0 for the CPU).
    pub index: usize,
}

impl DeviceId {
    /// The host's CPU.
    pub const CPU: DeviceId = DeviceId {
        kind: BackendKind::Cpu,
        index: 0,
    };

    /// Whether this is the host's CPU.
    pub fn is_cpu(&self) -> bool {
        self.kind == BackendKind::Cpu
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            BackendKind::Cpu => f.write_str("cpu"),
            k => write!(f, "{}:{}", k.name(), self.index),
        }
    }
}

impl FromStr for DeviceId {
    type Err = DeviceError;

    /// Parses `cpu`, `cuda`, `cuda:N`, `vulkan`, `vulkan:N` (no index: 0), case-insensitively.
    ///
    /// Errors: [`DeviceError::BadName`] for anything else (an unknown backend, an index that is not a number, `cpu:1`).
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let bad = || DeviceError::BadName(s.to_string());
        let lower = s.trim().to_ascii_lowercase();
        let (kind, index) = match lower.split_once(':') {
            Some((k, i)) => (k, Some(i.parse::<usize>().map_err(|_| bad())?)),
            None => (lower.as_str(), None),
        };
        let kind = match kind {
            "cpu" => BackendKind::Cpu,
            "cuda" => BackendKind::Cuda,
            "vulkan" => BackendKind::Vulkan,
            _ => return Err(bad()),
        };
        let index = index.unwrap_or(0);
        if kind == BackendKind::Cpu && index != 0 {
            return Err(bad());
        }
        Ok(DeviceId { kind, index })
    }
}

/// What one device is, as `backburner devices` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its id (`cpu`, `cuda:0`).
    pub id: DeviceId,
    /// Its name as the system gives it (the CPU's model name, the GPU's product name).
    pub name: String,
    /// Memory it offers for weights and state, in bytes: the host's available memory for the CPU, the device's
    /// total memory for a GPU.
    pub memory_bytes: u64,
    /// Memory free now, in bytes, where the backend can tell.
    pub free_bytes: Option<u64>,
    /// A line on the backend (`kernels: AVX-512 BF16`, `CUDA 12.8, sm_90`).
    pub backend: String,
}

/// Errors of finding, opening and computing on a device.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DeviceError {
    /// A `--device` value that names no backend this program knows.
    #[error(
        "'{0}' is not a device name: use cpu, cuda:N or vulkan:N (`backburner devices` lists them)"
    )]
    BadName(String),
    /// A backend this build was made without.
    #[error("this build has no {0} backend: {1}")]
    NotBuilt(&'static str, &'static str),
    /// A device index the machine does not have, or a backend whose driver is missing.
    #[error("no device {0}: {1}")]
    NotFound(DeviceId, String),
    /// The device ran out of memory.
    #[error("{device} is out of memory: {what} needs {need} bytes")]
    OutOfMemory {
        /// The device.
        device: DeviceId,
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        need: u64,
    },
    /// An operation or a weight format this backend does not have.
    #[error("{0} does not support {1}")]
    Unsupported(DeviceId, String),
    /// The driver failed (a launch, a copy, a compile of a kernel).
    #[error("{0}: {1}")]
    Driver(DeviceId, String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_print_back() {
        for (s, want) in [
            ("cpu", "cpu"),
            ("CPU", "cpu"),
            ("cuda", "cuda:0"),
            ("cuda:1", "cuda:1"),
            ("vulkan:0", "vulkan:0"),
        ] {
            let id: DeviceId = s.parse().unwrap();
            assert_eq!(id.to_string(), want);
            assert_eq!(want.parse::<DeviceId>().unwrap(), id);
        }
        assert_eq!("cuda:3".parse::<DeviceId>().unwrap().index, 3);
        for bad in ["gpu", "cuda:x", "cpu:1", "", "cuda:-1", "metal:0"] {
            assert!(
                matches!(bad.parse::<DeviceId>(), Err(DeviceError::BadName(_))),
                "{bad}"
            );
        }
    }
}
