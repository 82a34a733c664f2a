//! [`CudaBackend`]: one CUDA device's context, stream, kernels and cuBLAS handle, and the [`Backend`] ops on them.
//! Every op is queued on the backend's one stream (so ops run in call order); `download` and `top_k` wait for it.

mod api;
mod attn;
mod gdn;
mod matrix;
pub use matrix::{fallback_formats, GEMV_MAX_ROWS};
pub mod mem;
mod offload;
mod ops;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use backburner_model::device::{BackendKind, Buf, DeviceError, DeviceId, DeviceInfo, DeviceResult};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, CudaContext, CudaFunction, CudaStream};

use mem::{driver_err, ptr, Arg, DevBuf, DevMem};

/// Scratch memory of the ops that need some (the bf16 copy of x and the dequantized weight tile of a prefill
/// product, the decode step's conv output, the embedding's row list), grown as needed and kept.
#[derive(Default)]
struct Scratch {
    x16: Option<DevMem>,
    tile: Option<DevMem>,
    conv: Option<DevMem>,
    rows: Option<DevMem>,
    rope: Vec<(Vec<f32>, DevMem)>,
}

/// One NVIDIA GPU as a [`Backend`]. Made by [`crate::CudaProvider::open`] (or [`CudaBackend::open`]).
pub struct CudaBackend {
    id: DeviceId,
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<String, CudaFunction>,
    scratch: Mutex<Scratch>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({}: {})", self.id, self.info.name)
    }
}

impl CudaBackend {
    /// Opens CUDA device `index`: its primary context, a stream, the kernels compiled by NVRTC for its compute
    /// capability, a cuBLAS handle.
    ///
    /// Errors: [`DeviceError::NotFound`] when the driver, NVRTC or cuBLAS cannot be loaded or the index is out of
    /// range; [`DeviceError::Driver`] for a failed compile, module load or handle creation.
    pub fn open(index: usize) -> DeviceResult<Self> {
        let id = DeviceId {
            kind: BackendKind::Cuda,
            index,
        };
        // the driver and the index first (a wrong index is named as such), then the compiler and cuBLAS
        let info = crate::provider::device_info(index).map_err(|e| DeviceError::NotFound(id, e))?;
        if let Some(why) = crate::loader::compute_libs_usable() {
            return Err(DeviceError::NotFound(id, why));
        }
        crate::loader::guarded("opening the device", || {
            Self::open_inner(id, info).map_err(|e| e.to_string())
        })
        .map_err(|e| DeviceError::Driver(id, e))
    }

    fn open_inner(id: DeviceId, info: DeviceInfo) -> DeviceResult<Self> {
        let ctx =
            CudaContext::new(id.index).map_err(|e| driver_err(id, "creating the context", e))?;
        // One stream: the safe API's per-buffer event tracking is not needed.
        // SAFETY: no buffer of this context is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err(id, "creating a stream", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_err(id, "compute capability", e))?;
        let mut kernels = HashMap::new();
        for ptx in
            crate::compile::compile_all(major, minor).map_err(|e| DeviceError::Driver(id, e))?
        {
            let names = crate::compile::entries(&ptx.to_src());
            let module = ctx.load_module(ptx).map_err(|e| {
                driver_err(
                    id,
                    "loading the kernels (a PTX from an NVRTC newer than the driver does not load: put an NVRTC no \
                     newer than the driver first on the loader's path)",
                    e,
                )
            })?;
            for n in names {
                let f = module
                    .load_function(&n)
                    .map_err(|e| driver_err(id, &n, e))?;
                kernels.insert(n, f);
            }
        }
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| driver_err(id, "creating a cuBLAS handle", e))?;
        Ok(CudaBackend {
            id,
            info,
            ctx,
            stream,
            blas,
            kernels,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// Binds the context to the calling thread (every op starts with it: callers may come from any thread).
    fn bind(&self) -> DeviceResult<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err(self.id, "binding the context", e))
    }

    /// Launches kernel `name`.
    fn run(&self, name: &str, grid: (u32, u32), block: u32, args: &[Arg]) -> DeviceResult<()> {
        let f = self
            .kernels
            .get(name)
            .ok_or_else(|| DeviceError::Driver(self.id, format!("no kernel {name}")))?;
        mem::launch(&self.stream, self.id, name, f, grid, block, args)
    }

    /// An allocation of `bytes` for `what`.
    fn alloc(&self, bytes: usize, what: &str) -> DeviceResult<DevMem> {
        DevMem::alloc(&self.stream, self.id, bytes, what)
    }

    /// Sets `b` to `len` f32 (its contents undefined where it grows) and returns its address.
    fn ensure(&self, b: &mut Buf, len: usize) -> DeviceResult<u64> {
        let need = len * 4;
        let d = b.get_mut::<DevBuf>();
        if len > 0 && d.mem.as_ref().is_none_or(|m| m.bytes < need) {
            d.mem = None;
            d.mem = Some(self.alloc(need, "a buffer")?);
        }
        b.set_len(len);
        Ok(ptr(b))
    }

    /// A scratch allocation of at least `bytes` in `slot`, its address.
    fn scratch_at(&self, slot: &mut Option<DevMem>, bytes: usize, what: &str) -> DeviceResult<u64> {
        if slot.as_ref().is_none_or(|m| m.bytes < bytes) {
            *slot = None;
            *slot = Some(self.alloc(bytes, what)?);
        }
        Ok(slot.as_ref().map_or(0, |m| m.ptr))
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copies host `src` to device address `dst`.
    fn htod<T>(&self, dst: u64, src: &[T]) -> DeviceResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is an allocation of at least `size_of_val(src)` bytes (callers size it); pageable host
        // memory is staged before the call returns, so `src` may be dropped after.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_err(self.id, "a copy to the device", e))
    }

    /// Copies `out.len()` elements from device address `src` and waits for them.
    fn dtoh<T>(&self, src: u64, out: &mut [T]) -> DeviceResult<()> {
        if !out.is_empty() {
            // SAFETY: `src` holds at least `size_of_val(out)` bytes; the stream is synchronized before return.
            unsafe { result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
                .map_err(|e| driver_err(self.id, "a copy to the host", e))?;
        }
        self.sync()
    }

    /// Device-to-device copy of `bytes`.
    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> DeviceResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie in live allocations of this context (callers size them).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_err(self.id, "a device copy", e))
    }

    /// Waits for every queued op (reports a kernel's failure).
    pub fn sync(&self) -> DeviceResult<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_err(self.id, "running the queued kernels", e))
    }

    /// The device's id.
    pub fn id(&self) -> DeviceId {
        self.id
    }

    /// The stream every op runs on (for the benchmark's timings).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A new allocation of `bytes` on this device (the benchmark's copy test).
    ///
    /// Errors: out of memory; the driver's.
    pub fn alloc_bytes(&self, bytes: usize) -> DeviceResult<DevMem> {
        self.bind()?;
        self.alloc(bytes, "an allocation")
    }

    /// Queues a device-to-device copy of `bytes` from `src` to `dst` (the benchmark's copy test).
    ///
    /// Errors: the driver's.
    pub fn copy_bytes(&self, dst: &DevMem, src: &DevMem, bytes: usize) -> DeviceResult<()> {
        assert!(
            bytes <= dst.bytes && bytes <= src.bytes,
            "copy_bytes: past an allocation"
        );
        self.bind()?;
        self.dtod(dst.ptr, src.ptr, bytes)
    }
}
