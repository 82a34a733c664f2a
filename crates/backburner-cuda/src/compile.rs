//! The kernels' CUDA C sources and their compilation with NVRTC: every source in `src/kernels/*.cu`, each preceded
//! by `common.cuh`, is one program compiled to PTX for the device's compute capability (`compute_XY`), which the
//! driver then loads (JIT to the device's code). Sources need no CUDA header, so no toolkit is needed.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

/// The helpers every source starts with.
const COMMON: &str = include_str!("kernels/common.cuh");

/// The kernel sources: (name, CUDA C).
pub const SOURCES: [(&str, &str); 4] = [
    ("rowops", include_str!("kernels/rowops.cu")),
    ("gdn", include_str!("kernels/gdn.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("matmul", include_str!("kernels/matmul.cu")),
];

/// Compiles source `name` (`src` without the common header) to PTX for compute capability `major.minor`.
///
/// Errors: NVRTC's message and log (a missing library is checked by [`crate::loader::nvrtc_usable`] first; this
/// turns a panic of the loader into an error too).
pub fn compile(name: &str, src: &str, major: i32, minor: i32) -> Result<Ptx, String> {
    let full = format!("{COMMON}\n{src}");
    let opts = CompileOptions {
        // the IEEE forms of division and square root, no flush to zero (the CPU kernels' arithmetic)
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--std=c++17".into(),
        ],
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    crate::loader::guarded("NVRTC", || {
        compile_ptx_with_opts(&full, opts).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                format!("{name}.cu: {nvrtc:?}\n{}", log.to_string_lossy())
            }
            other => format!("{name}.cu: {other}"),
        })
    })
}

/// Compiles every source for `major.minor`: their PTX in [`SOURCES`]' order.
///
/// Errors: the first failure's message.
pub fn compile_all(major: i32, minor: i32) -> Result<Vec<Ptx>, String> {
    SOURCES
        .iter()
        .map(|(name, src)| compile(name, src, major, minor))
        .collect()
}

/// The kernel names (`.visible .entry`) of a PTX text.
pub fn entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .filter_map(|l| l.split('(').next())
        .map(|s| s.trim().to_string())
        .collect()
}

/// Every kernel the backend launches (the compile test checks each is in the PTX).
pub fn launched_kernels() -> Vec<String> {
    let mut v: Vec<String> = [
        "rms_norm",
        "gated_rms_norm",
        "l2_norm_scaled",
        "sigmoid_mul",
        "add_assign",
        "silu_mul_halves",
        "take_cols",
        "rope",
        "gdn_gates",
        "f32_to_bf16_rows",
        "conv_out",
        "conv_state",
        "delta_rule",
    ]
    .map(String::from)
    .into();
    for dt in ["f32", "f16", "bf16"] {
        v.push(format!("kv_store_{dt}"));
        v.push(format!("attend_{dt}"));
    }
    for f in ["bf16", "f32", "q4k", "q6k", "q8_0"] {
        for nr in 1..=crate::GEMV_MAX_ROWS {
            v.push(format!("gemv_{f}_{nr}"));
        }
        v.push(format!("deq_{f}_f32"));
        v.push(format!("deq_{f}_bf16"));
    }
    v
}
