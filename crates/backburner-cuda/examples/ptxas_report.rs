//! Registers, shared memory and spills of every kernel as ptxas reports them for sm_90 (NVRTC compiles to SASS with
//! `--ptxas-options=-v`): no GPU needed, only libnvrtc (`BACKBURNER_CUDA_LIB_DIRS`, see `scripts/get_nvrtc.sh`).
//! `cargo run --release -p backburner-cuda --example ptxas_report [sm_XY]`

use std::ffi::{CStr, CString};

fn main() {
    if let Some(why) = backburner_cuda::loader::nvrtc_present() {
        eprintln!("{why}");
        std::process::exit(1);
    }
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    let common = include_str!("../src/kernels/common.cuh");
    for (name, src) in backburner_cuda::compile::SOURCES {
        let full = CString::new(format!("{common}\n{src}")).expect("no NUL in the sources");
        let n = CString::new(name).expect("no NUL in the name");
        let prog = cudarc::nvrtc::result::create_program(&full, Some(&n)).expect("a program");
        let opts = [
            format!("--gpu-architecture={arch}"),
            "--ptxas-options=-v".into(),
            "--std=c++17".into(),
        ];
        // SAFETY: a program just created, compiled once, its log read after.
        let r = unsafe { cudarc::nvrtc::result::compile_program(prog, &opts) };
        let log = unsafe { cudarc::nvrtc::result::get_program_log(prog) }.expect("a log");
        // SAFETY: NVRTC's log is NUL-terminated.
        let log = unsafe { CStr::from_ptr(log.as_ptr()) }
            .to_string_lossy()
            .to_string();
        println!("== {name}.cu: {r:?}");
        let mut func = String::new();
        for l in log.lines() {
            if l.contains("Compiling entry function") {
                func = l.split('\'').nth(1).unwrap_or("").to_string();
            } else if l.contains("Used") || l.contains("spill") {
                println!("{func}: {}", l.trim().trim_start_matches("ptxas").trim());
            }
        }
    }
}
