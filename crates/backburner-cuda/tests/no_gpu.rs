//! What runs without a GPU: the provider's answers on any machine, and every kernel source compiling with NVRTC to PTX for sm_80 and sm_90 — no GPU needed, only libnvrtc (from a CUDA
//! toolkit, or PyPI's `nvidia-cuda-nvrtc-cu12` wheel: `scripts/get_nvrtc.sh DIR` prints a directory to put in
//! `BACKBURNER_CUDA_LIB_DIRS` or `LD_LIBRARY_PATH`). Without libnvrtc the test prints one `skipped:` line and passes.

use backburner_cuda::compile::{compile, entries, launched_kernels, SOURCES};
use backburner_cuda::loader::nvrtc_present;
use backburner_cuda::{CudaBackend, CudaProvider};
use backburner_model::device::{BackendKind, DeviceError, Provider, Registry};

#[test]
fn the_provider_answers_without_panicking_whether_or_not_a_driver_exists() {
    let p = CudaProvider;
    assert_eq!(p.kind(), BackendKind::Cuda);
    let devices = p.devices();
    match p.unavailable() {
        Some(why) => {
            println!("no CUDA device here: {why}");
            assert!(devices.is_empty());
            assert!(!why.is_empty());
        }
        None => assert!(!devices.is_empty()),
    }
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d.id.index, i);
        assert!(d.memory_bytes > 0 && d.backend.contains("sm_"), "{d:?}");
    }
    let beyond = devices.len();
    let e = CudaBackend::open(beyond).unwrap_err();
    assert!(
        matches!(e, DeviceError::NotFound(id, _) if id.index == beyond),
        "{e}"
    );
    let reg = Registry::cpu_only().with(Box::new(CudaProvider));
    assert!(reg.has(BackendKind::Cuda));
    let (list, missing) = reg.list();
    assert_eq!(list.len(), 1 + devices.len());
    assert_eq!(missing.len(), usize::from(devices.is_empty()));
}

#[test]
fn every_kernel_source_compiles_for_sm80_and_sm90() {
    if let Some(why) = nvrtc_present() {
        println!("skipped: no libnvrtc ({why})");
        return;
    }
    // the NVRTC that loads has every function the compile calls
    assert_eq!(backburner_cuda::loader::nvrtc_usable(), None);
    for (major, minor) in [(8, 0), (9, 0)] {
        let mut names = Vec::new();
        for (name, src) in SOURCES {
            let ptx = compile(name, src, major, minor).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            assert!(
                text.contains(&format!(".target sm_{major}{minor}")),
                "{name}.cu: PTX for another target"
            );
            assert!(text.contains(".entry"), "{name}.cu: no kernel in the PTX");
            names.extend(entries(&text));
        }
        for k in launched_kernels() {
            assert!(
                names.contains(&k),
                "kernel {k} is launched but not compiled"
            );
        }
    }
}
