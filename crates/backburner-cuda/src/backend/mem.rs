//! Device memory: stream-ordered allocations (`cuMemAllocAsync` / `cuMemFreeAsync` on the backend's one stream, so
//! freeing a buffer a queued kernel still reads is safe), the f32 buffers behind [`Buf`], and launching kernels.

use std::sync::Arc;

use backburner_model::device::{Buf, DeviceError, DeviceId, DeviceResult};
use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};

/// One device allocation of `bytes` bytes (256-byte aligned), freed on drop in stream order.
pub struct DevMem {
    /// The device address.
    pub ptr: u64,
    /// Its size in bytes.
    pub bytes: usize,
    stream: Arc<CudaStream>,
}

impl DevMem {
    /// Allocates `bytes` (> 0) on `stream`'s device, uninitialized.
    ///
    /// Errors: [`DeviceError::OutOfMemory`] (for `what`); the driver's.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        id: DeviceId,
        bytes: usize,
        what: &str,
    ) -> DeviceResult<DevMem> {
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(|e| driver_err(id, what, e))?;
        // SAFETY: a plain allocation on a live stream of a context bound to this thread.
        let ptr =
            unsafe { result::malloc_async(stream.cu_stream(), bytes.max(1)) }.map_err(|e| {
                if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    DeviceError::OutOfMemory {
                        device: id,
                        what: what.to_string(),
                        need: bytes as u64,
                    }
                } else {
                    driver_err(id, what, e)
                }
            })?;
        Ok(DevMem {
            ptr,
            bytes,
            stream: stream.clone(),
        })
    }

    /// The address `off` bytes in.
    pub fn at(&self, off: usize) -> u64 {
        debug_assert!(off <= self.bytes);
        self.ptr + off as u64
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let ctx: &Arc<CudaContext> = self.stream.context();
        if ctx.bind_to_thread().is_ok() {
            // SAFETY: the pointer came from malloc_async on this stream and is freed once; work queued before on
            // the stream that reads it completes first (stream order). An error here is a sticky context error
            // that the next operation reports.
            let _ = unsafe { result::free_async(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// A [`DeviceError::Driver`] for `what`.
pub fn driver_err(id: DeviceId, what: &str, e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Driver(id, format!("{what}: {e:?}"))
}

/// The storage of a CUDA [`Buf`]: an allocation of at least `len` f32, or none while the buffer is empty.
#[derive(Default)]
pub struct DevBuf {
    /// The allocation (its capacity may exceed the buffer's length).
    pub mem: Option<DevMem>,
}

/// The storage of a buffer of this backend (panics for another backend's: caller bug).
pub fn dev(b: &Buf) -> &DevBuf {
    b.get::<DevBuf>()
}

/// The device address of `b`'s first element (0 when it holds none).
pub fn ptr(b: &Buf) -> u64 {
    dev(b).mem.as_ref().map_or(0, |m| m.ptr)
}

/// An element kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address (`T*`).
    P(u64),
    /// An `int`.
    I(i32),
    /// An `unsigned long long` count.
    N(u64),
    /// A `float`.
    F(f32),
}

/// `n` as a kernel's `int` (shapes above 2³¹ − 1 elements are refused before they reach a kernel).
pub fn int(n: usize) -> Arg {
    Arg::I(i32::try_from(n).expect("a dimension above i32::MAX"))
}

/// Launches `f` with `grid` blocks of `block` threads on `stream`.
///
/// Errors: the driver's launch error (a bad configuration, a sticky error of an earlier kernel).
pub fn launch(
    stream: &CudaStream,
    id: DeviceId,
    name: &str,
    f: &CudaFunction,
    grid: (u32, u32),
    block: u32,
    args: &[Arg],
) -> DeviceResult<()> {
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::P(p) | Arg::N(p) => b.arg(p),
            Arg::I(i) => b.arg(i),
            Arg::F(x) => b.arg(x),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameter list (each call site follows its .cu signature) and every
    // address points into a live allocation of this context, sized by the caller for the launch's shape.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| driver_err(id, name, e))
}

/// Blocks of 256 threads for `n` elements in a grid-stride loop (at most 2²⁰ blocks).
pub fn blocks_for(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 1 << 20) as u32
}
