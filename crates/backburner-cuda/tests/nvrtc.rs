//! Every kernel source compiles with NVRTC to PTX for sm_80 and sm_90 — no GPU needed, only libnvrtc (from a CUDA
//! toolkit, or PyPI's `nvidia-cuda-nvrtc-cu12` wheel: `scripts/get_nvrtc.sh DIR` prints a directory to put in
//! `BACKBURNER_CUDA_LIB_DIRS` or `LD_LIBRARY_PATH`). Without libnvrtc the test prints one `skipped:` line and passes.

use backburner_cuda::compile::{compile, SOURCES};
use backburner_cuda::loader::nvrtc_present;

#[test]
fn every_kernel_source_compiles_for_sm80_and_sm90() {
    if let Some(why) = nvrtc_present() {
        println!("skipped: no libnvrtc ({why})");
        return;
    }
    for (major, minor) in [(8, 0), (9, 0)] {
        for (name, src) in SOURCES {
            let ptx = compile(name, src, major, minor).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            assert!(
                text.contains(&format!(".target sm_{major}{minor}")),
                "{name}.cu: PTX for another target"
            );
            assert!(text.contains(".entry"), "{name}.cu: no kernel in the PTX");
        }
    }
}
