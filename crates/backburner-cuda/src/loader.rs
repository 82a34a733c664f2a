//! Finding the CUDA libraries at run time: the driver (`libcuda.so.1`), NVRTC and cuBLAS.
//!
//! cudarc (built with `dynamic-loading` and the CUDA 13.0 bindings) opens each library on first use by the names
//! `lib{name}.so`, `lib{name}.so.13`, `lib{name}.so.12`, …, `lib{name}.so.1` through the dynamic loader, so the
//! directories of `LD_LIBRARY_PATH` and the system's are searched, and CUDA 12 and 13 libraries are both found. It
//! panics when none opens; this module checks first ([`driver_present`], [`nvrtc_present`], [`cublas_present`]) so
//! that a missing library is a message, never a panic.
//!
//! `BACKBURNER_CUDA_LIB_DIRS` (directories separated by `:`) adds places to look without touching
//! `LD_LIBRARY_PATH` (which the loader reads once, at process start): every `libcuda.so*`, `libnvrtc*.so*`,
//! `libcublasLt.so*` and `libcublas.so*` found there is opened by its full path first; a later open by soname (cudarc's) then finds the
//! library already loaded. `scripts/get_nvrtc.sh` prints such a directory for NVRTC from PyPI.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable naming extra library directories.
pub const LIB_DIRS_ENV: &str = "BACKBURNER_CUDA_LIB_DIRS";

/// What [`preload`] did with the directories of [`LIB_DIRS_ENV`].
#[derive(Debug, Default)]
pub struct Preloaded {
    /// The libraries opened, by full path.
    pub opened: Vec<PathBuf>,
    /// The libraries found that did not open, with the loader's error.
    pub failed: Vec<(PathBuf, String)>,
    /// The directories named that could not be read (missing, not a directory).
    pub unreadable: Vec<PathBuf>,
}

/// Opens, once per process, the CUDA libraries found in the directories of [`LIB_DIRS_ENV`]: what it opened, what
/// failed and why (for messages).
pub fn preload() -> &'static Preloaded {
    static DONE: OnceLock<Preloaded> = OnceLock::new();
    DONE.get_or_init(|| {
        let mut out = Preloaded::default();
        let Some(dirs) = std::env::var_os(LIB_DIRS_ENV) else {
            return out;
        };
        for dir in std::env::split_paths(&dirs) {
            if !dir.is_dir() {
                out.unreadable.push(dir);
                continue;
            }
            // dependencies first: NVRTC's builtins, cuBLASLt before cuBLAS
            for prefix in [
                "libcuda.",
                "libnvrtc-builtins",
                "libnvrtc.",
                "libcublasLt.",
                "libcublas.",
            ] {
                for p in libs_in(&dir, prefix) {
                    // SAFETY: opening a shared library runs its initializers; these are NVIDIA's CUDA libraries,
                    // the same ones cudarc would open by name. The handle is kept for the process's life.
                    match unsafe { libloading::Library::new(&p) } {
                        Ok(lib) => {
                            std::mem::forget(lib);
                            out.opened.push(p);
                        }
                        Err(e) => {
                            // the loader's own words (libloading keeps them as the error's source)
                            let why = match std::error::Error::source(&e) {
                                Some(s) => format!("{e}: {s}"),
                                None => e.to_string(),
                            };
                            out.failed.push((p, why));
                        }
                    }
                }
            }
        }
        out
    })
}

/// What [`preload`] could not do, for a message about library `lib{name}` (empty when nothing failed).
fn preload_problems(name: &str) -> String {
    let p = preload();
    let mut v: Vec<String> = p
        .unreadable
        .iter()
        .map(|d| format!("{} is not a directory", d.display()))
        .collect();
    let prefix = format!("lib{name}.");
    v.extend(
        p.failed
            .iter()
            .filter(|(f, _)| {
                f.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix))
            })
            .map(|(f, e)| format!("{} did not open: {e}", f.display())),
    );
    if v.is_empty() {
        String::new()
    } else {
        format!("; {LIB_DIRS_ENV}: {}", v.join("; "))
    }
}

/// The files `dir/{prefix}*.so*` (regular files and links), sorted.
fn libs_in(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.contains(".so") && !n.contains(".alt."))
        })
        .collect();
    v.sort();
    v
}

/// Why a library cannot be used, or `None` when it opens.
fn check(name: &str, present: unsafe fn() -> bool) -> Option<String> {
    preload();
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names.
    let ok = std::panic::catch_unwind(|| unsafe { present() }).unwrap_or(false);
    if ok {
        None
    } else {
        Some(format!(
            "cannot load lib{name} (searched lib{name}.so, .so.13, .so.12, .so.1 … on the loader's path; set \
             LD_LIBRARY_PATH or {LIB_DIRS_ENV}){}",
            preload_problems(name)
        ))
    }
}

/// `None` when the CUDA driver library loads, else why not.
pub fn driver_present() -> Option<String> {
    check("cuda", cudarc::driver::sys::is_culib_present)
}

/// `None` when NVRTC loads, else why not.
pub fn nvrtc_present() -> Option<String> {
    check("nvrtc", cudarc::nvrtc::sys::is_culib_present)
}

/// `None` when cuBLAS loads, else why not.
pub fn cublas_present() -> Option<String> {
    check("cublas", cudarc::cublas::sys::is_culib_present)
}

/// The driver functions the backend reaches through cudarc (those the stand-in driver of `emu/fake_cuda.cpp`
/// defines, less NVRTC's own `cuGetExportTable`): cudarc looks each up on first call and panics when it is missing.
pub const DRIVER_SYMBOLS: [&str; 28] = [
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceTotalMem_v2",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuLaunchKernel",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemGetInfo_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemsetD8Async",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
];

/// NVRTC's functions that the kernels' compilation calls.
pub const NVRTC_SYMBOLS: [&str; 7] = [
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcDestroyProgram",
];

/// cuBLAS's functions the dense products call.
pub const CUBLAS_SYMBOLS: [&str; 4] = [
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasGemmEx",
    "cublasSetStream_v2",
];

/// The names of `names` that `lib` does not define.
fn lacking(lib: &libloading::Library, names: &[&str]) -> Vec<String> {
    names
        .iter()
        // SAFETY: only looks a symbol up; it is not called.
        .filter(|n| unsafe { lib.get::<*const ()>(n.as_bytes()) }.is_err())
        .map(|n| n.to_string())
        .collect()
}

/// Why a library that opened cannot serve: the functions of `names` it lacks (an install older than CUDA 12, or a
/// partial one), or `None` when it has them all. Call after the `*_present` check of the same library.
fn symbols_check(
    lib_name: &str,
    culib: unsafe fn() -> &'static libloading::Library,
    names: &[&str],
) -> Option<String> {
    // SAFETY: the library was found by the presence check; `culib` opens it once (and panics, caught, if it cannot).
    let missing = std::panic::catch_unwind(|| lacking(unsafe { culib() }, names))
        .unwrap_or_else(|_| vec!["(the library did not open)".into()]);
    (!missing.is_empty()).then(|| {
        format!(
            "lib{lib_name} lacks {} (an install older than CUDA 12, or a partial one: the backend needs CUDA 12 or \
             13)",
            missing.join(", ")
        )
    })
}

/// `None` when the driver library loads and has every function of [`DRIVER_SYMBOLS`], else why not.
pub fn driver_usable() -> Option<String> {
    driver_present().or_else(|| symbols_check("cuda", cudarc::driver::sys::culib, &DRIVER_SYMBOLS))
}

/// `None` when NVRTC loads and has every function of [`NVRTC_SYMBOLS`], else why not.
pub fn nvrtc_usable() -> Option<String> {
    nvrtc_present().or_else(|| symbols_check("nvrtc", cudarc::nvrtc::sys::culib, &NVRTC_SYMBOLS))
}

/// `None` when NVRTC and cuBLAS load with every function the backend calls, else why not (the driver checked
/// apart: [`driver_usable`]).
pub fn compute_libs_usable() -> Option<String> {
    nvrtc_usable()
        .or_else(cublas_present)
        .or_else(|| symbols_check("cublas", cudarc::cublas::sys::culib, &CUBLAS_SYMBOLS))
}

/// Runs `f`, turning a panic (cudarc panics on a missing symbol) into an error message.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            Err(format!("{what}: {msg}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lacking_names_the_functions_a_library_does_not_define() {
        // SAFETY: the C library is loaded in every process already.
        let libc = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        assert_eq!(
            lacking(&libc, &["malloc", "cuInit", "free", "cublasGemmEx"]),
            ["cuInit", "cublasGemmEx"]
        );
        assert!(lacking(&libc, &["malloc", "free"]).is_empty());
    }
}
