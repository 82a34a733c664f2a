//! [`CudaProvider`]: the CUDA devices of this machine for the device [`Registry`](backburner_model::device::Registry).

use std::sync::Arc;

use backburner_model::device::{Backend, BackendKind, DeviceError, DeviceId, DeviceInfo, Provider};
use cudarc::driver::{result, sys, CudaContext};

use crate::backend::CudaBackend;
use crate::loader::{compute_libs_usable, driver_usable, guarded};

/// The CUDA backend's provider: lists the GPUs the driver sees and opens one as a [`CudaBackend`]. Never panics,
/// whether or not the driver library exists.
#[derive(Clone, Debug, Default)]
pub struct CudaProvider;

/// The driver's version as `major.minor` (`cuDriverGetVersion`).
fn driver_version() -> Result<String, String> {
    let mut v = 0i32;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion: {e:?}"))?;
    Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// The number of devices (initializing the driver).
fn device_count() -> Result<usize, String> {
    guarded("the CUDA driver", || {
        result::init().map_err(|e| format!("cuInit: {e:?}"))?;
        let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))?;
        Ok(n.max(0) as usize)
    })
}

/// What device `index` is: name, memory (total, free through its primary context), compute capability, driver.
/// Errors: a driver library missing or lacking functions, an index the driver does not see, the driver's errors.
pub(crate) fn device_info(index: usize) -> Result<DeviceInfo, String> {
    if let Some(why) = driver_usable() {
        return Err(why);
    }
    let n = device_count()?;
    if index >= n {
        return Err(format!("the driver sees {n} CUDA device(s)"));
    }
    guarded("the CUDA driver", || {
        let ctx = CudaContext::new(index).map_err(|e| format!("creating a context: {e:?}"))?;
        let name = ctx.name().map_err(|e| format!("{e:?}"))?;
        let (free, total) = ctx.mem_get_info().map_err(|e| format!("{e:?}"))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| format!("{e:?}"))?;
        Ok(DeviceInfo {
            id: DeviceId {
                kind: BackendKind::Cuda,
                index,
            },
            name,
            memory_bytes: total as u64,
            free_bytes: Some(free as u64),
            backend: format!("CUDA driver {}, sm_{major}{minor}", driver_version()?),
        })
    })
}

impl Provider for CudaProvider {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    /// The GPUs the driver sees; when NVRTC or cuBLAS cannot serve, each one's backend line says so (the device
    /// exists, but opening it will fail with that reason).
    fn devices(&self) -> Vec<DeviceInfo> {
        if driver_usable().is_some() {
            return Vec::new();
        }
        let n = device_count().unwrap_or(0);
        let unusable = compute_libs_usable();
        (0..n)
            .filter_map(|i| device_info(i).ok())
            .map(|mut d| {
                if let Some(why) = &unusable {
                    d.backend = format!("{}; cannot compute: {why}", d.backend);
                }
                d
            })
            .collect()
    }

    fn unavailable(&self) -> Option<String> {
        if let Some(why) = driver_usable() {
            return Some(why);
        }
        match device_count() {
            Err(e) => Some(e),
            Ok(0) => Some("the CUDA driver finds no device".into()),
            Ok(_) => None,
        }
    }

    fn open(&self, index: usize) -> Result<Arc<dyn Backend>, DeviceError> {
        Ok(Arc::new(CudaBackend::open(index)?))
    }
}
