//! Weight matrices on the device and their products (kernels/matmul.cu, cuBLAS).
//!
//! Layouts (one allocation per plane, 256-byte aligned):
//! - dense bf16: bf16 rows `[n, k]`; dense f32 and f16: f32 rows (f16 widened exactly; an f16 checkpoint takes
//!   twice its file's memory);
//! - Q4_K: the GGUF blocks as they are (144 B per 256, 16-byte aligned);
//! - Q6_K: each 210-byte block's first 208 bytes (`ql`, `qh`, scales: 16-byte aligned), its f16 `d` in a plane of
//!   its own `[n, k/256]`;
//! - Q8_0: the i8 quants `[n, k]` and the f16 scales `[n, k/32]` in two planes.
//!
//! So a matrix takes exactly its GGUF bytes. Other block formats are held dequantized to f32 rows (exact, 4 bytes per
//! weight; [`fallback_formats`] names them).
//!
//! Products: up to 4 rows of x, a GEMV kernel that reads each weight once and dequantizes in registers (f32
//! arithmetic); more rows, cuBLAS `GemmEx` with bf16 inputs and f32 accumulation (x rounded to bf16; block formats
//! dequantized to a bf16 tile of at most 32 Mi elements first) or f32 inputs for f32 weights.

use backburner_kernels::matmul::WeightDtype;
use backburner_kernels::quant::QuantFormat;
use backburner_model::device::{Buf, DeviceError, DeviceMatrix, DeviceResult};
use backburner_model::linear::{Linear, LinearPart};
use cudarc::cublas::sys as cb;

use super::mem::{blocks_for, int, ptr, Arg, DevMem};
use super::CudaBackend;

/// Rows of x up to which a product runs as a GEMV.
pub const GEMV_MAX_ROWS: usize = 4;
/// Elements of the bf16 tile a block-format product dequantizes into.
const TILE_ELEMS: usize = 32 << 20;
/// Host bytes staged per upload copy.
const STAGE_BYTES: usize = 64 << 20;

/// Where a GGUF block's bytes go: (block, first plane's part, second plane's part).
type Splitter = fn(&[u8], &mut [u8], &mut [u8]);

/// Whether block-format segment `q` is held in its own bytes (Q4_K, Q6_K, Q8_0 with a GGUF row encoding); the
/// other formats are held dequantized to f32.
fn native(q: &backburner_kernels::quant::QuantMatrix) -> bool {
    let f = q.format();
    matches!(f, QuantFormat::Q4K | QuantFormat::Q6K | QuantFormat::Q8_0)
        && f.row_bytes(q.k())
            .is_some_and(|rb| q.n() == 0 || q.gguf_row_into(0, &mut vec![0u8; rb]))
}

/// The block formats of `w`'s segments that the CUDA backend holds dequantized to f32 (exact, but 4 bytes per
/// weight: fine for small layers and tests, a real model in such a format is better left on the CPU); empty when
/// every segment is dense or in a format it multiplies natively.
pub fn fallback_formats(w: &Linear) -> Vec<&'static str> {
    w.parts()
        .filter_map(|(_, p)| match p {
            LinearPart::Quant(q) if !native(q) => Some(q.format().name()),
            _ => None,
        })
        .collect()
}

/// A segment's device format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WFmt {
    Bf16,
    F32,
    Q4K,
    Q6K,
    Q8_0,
}

impl WFmt {
    fn name(self) -> &'static str {
        match self {
            WFmt::Bf16 => "bf16",
            WFmt::F32 => "f32",
            WFmt::Q4K => "q4k",
            WFmt::Q6K => "q6k",
            WFmt::Q8_0 => "q8_0",
        }
    }
}

/// One segment: rows `first..first + rows` of W.
pub(super) struct Seg {
    first: usize,
    rows: usize,
    fmt: WFmt,
    p1: DevMem,
    p2: Option<DevMem>,
}

/// A matrix's segments.
pub(super) struct CudaMatrix {
    segs: Vec<Seg>,
}

fn mat(w: &DeviceMatrix) -> &CudaMatrix {
    w.inner.downcast_ref().expect("a CUDA matrix")
}

/// Rows per GEMV warp for `nr` rows of x (matmul.cu's GEMV_ALL).
fn rows_per_warp(nr: usize) -> usize {
    if nr == 1 {
        4
    } else {
        2
    }
}

impl CudaBackend {
    /// Uploads rows of `rows` rows × `row_bytes` made by `fill(row, out)` into a new allocation, staging through
    /// host chunks.
    fn upload_rows(
        &self,
        rows: usize,
        row_bytes: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> DeviceResult<DevMem> {
        let m = self.alloc(rows * row_bytes, "weights")?;
        let per = (STAGE_BYTES / row_bytes.max(1)).max(1);
        let mut stage = vec![0u8; per.min(rows) * row_bytes];
        let mut r0 = 0;
        while r0 < rows {
            let nr = per.min(rows - r0);
            for (i, out) in stage[..nr * row_bytes]
                .chunks_exact_mut(row_bytes)
                .enumerate()
            {
                fill(r0 + i, out);
            }
            self.htod(m.at(r0 * row_bytes), &stage[..nr * row_bytes])?;
            r0 += nr;
        }
        self.sync()?;
        Ok(m)
    }

    fn upload_dense(
        &self,
        w: &backburner_kernels::matmul::PackedMatrix,
    ) -> DeviceResult<(WFmt, DevMem)> {
        let (n, k) = (w.n(), w.k());
        let mut row = vec![0.0f32; k];
        if w.dtype() == WeightDtype::Bf16 {
            let m = self.upload_rows(n, 2 * k, &mut |r, out| {
                w.row_into(r, &mut row);
                for (o, v) in out.chunks_exact_mut(2).zip(&row) {
                    o.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
                }
            })?;
            return Ok((WFmt::Bf16, m));
        }
        let m = self.upload_rows(n, 4 * k, &mut |r, out| {
            w.row_into(r, &mut row);
            for (o, v) in out.chunks_exact_mut(4).zip(&row) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        })?;
        Ok((WFmt::F32, m))
    }

    /// A block-format segment: its format and planes (f32 rows for a format without a kernel).
    fn upload_quant(
        &self,
        w: &backburner_kernels::quant::QuantMatrix,
    ) -> DeviceResult<(WFmt, DevMem, Option<DevMem>)> {
        let (n, k, f) = (w.n(), w.k(), w.format());
        let unsupported = || DeviceError::Unsupported(self.id, format!("weights in {}", f.name()));
        if !native(w) {
            let mut row = vec![0.0f32; k];
            let m = self.upload_rows(n, 4 * k, &mut |r, out| {
                w.row_into(r, &mut row);
                for (o, v) in out.chunks_exact_mut(4).zip(&row) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            })?;
            return Ok((WFmt::F32, m, None));
        }
        let fmt = match f {
            QuantFormat::Q4K => WFmt::Q4K,
            QuantFormat::Q6K => WFmt::Q6K,
            _ => WFmt::Q8_0,
        };
        let rb = f.row_bytes(k).ok_or_else(unsupported)?;
        let (bb, nb) = (f.block_bytes(), k / f.block_elems());
        // (bytes of the first plane's row, of the second's; where each block's bytes go)
        let (l1, l2, split): (usize, usize, Splitter) = match fmt {
            WFmt::Q4K => (rb, 0, |b, a, _| a.copy_from_slice(b)),
            WFmt::Q6K => (208 * nb, 2 * nb, |b, a, d| {
                a.copy_from_slice(&b[..208]);
                d.copy_from_slice(&b[208..210]);
            }),
            _ => (32 * nb, 2 * nb, |b, q, d| {
                d.copy_from_slice(&b[..2]);
                q.copy_from_slice(&b[2..34]);
            }),
        };
        let (e1, e2) = (l1 / nb.max(1), l2 / nb.max(1));
        let fill = |plane: usize| {
            let mut g = vec![0u8; rb];
            move |r: usize, out: &mut [u8]| {
                w.gguf_row_into(r, &mut g);
                let mut scratch = [0u8; 256];
                for (i, b) in g.chunks_exact(bb).enumerate() {
                    let (a, d) = scratch.split_at_mut(e1);
                    split(b, a, &mut d[..e2]);
                    let (src, e) = if plane == 0 {
                        (&scratch[..e1], e1)
                    } else {
                        (&scratch[e1..e1 + e2], e2)
                    };
                    out[i * e..(i + 1) * e].copy_from_slice(src);
                }
            }
        };
        let p1 = self.upload_rows(n, l1, &mut fill(0))?;
        let p2 = if l2 > 0 {
            Some(self.upload_rows(n, l2, &mut fill(1))?)
        } else {
            None
        };
        Ok((fmt, p1, p2))
    }

    pub(super) fn upload_matrix_op(&self, w: &Linear) -> DeviceResult<DeviceMatrix> {
        self.bind()?;
        let (n, k) = (w.out_features(), w.in_features());
        if n > i32::MAX as usize || k > i32::MAX as usize || k == 0 {
            return Err(DeviceError::Unsupported(
                self.id,
                format!("a [{n}, {k}] matrix"),
            ));
        }
        let mut segs = Vec::new();
        let mut bytes = 0u64;
        for (first, part) in w.parts() {
            let (rows, fmt, p1, p2) = match part {
                LinearPart::Dense(d) => {
                    let (f, m) = self.upload_dense(d)?;
                    (d.n(), f, m, None)
                }
                LinearPart::Quant(q) => {
                    let (f, a, b) = self.upload_quant(q)?;
                    (q.n(), f, a, b)
                }
            };
            bytes += (p1.bytes + p2.as_ref().map_or(0, |m| m.bytes)) as u64;
            segs.push(Seg {
                first,
                rows,
                fmt,
                p1,
                p2,
            });
        }
        Ok(DeviceMatrix {
            n,
            k,
            bytes,
            inner: Box::new(CudaMatrix { segs }),
        })
    }

    pub(super) fn matmul_op(
        &self,
        x: &Buf,
        n_rows: usize,
        w: &DeviceMatrix,
        y: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        assert_eq!(x.len(), n_rows * w.k, "matmul: x is not [n_rows, k]");
        let yp = self.ensure(y, n_rows * w.n)?;
        if n_rows == 0 || w.n == 0 {
            return Ok(());
        }
        let m = mat(w);
        if n_rows <= GEMV_MAX_ROWS {
            for s in &m.segs {
                let rpw = rows_per_warp(n_rows);
                let name = format!("gemv_{}_{n_rows}", s.fmt.name());
                let grid = s.rows.div_ceil(8 * rpw) as u32;
                let args = [
                    Arg::P(s.p1.ptr),
                    Arg::P(s.p2.as_ref().map_or(0, |m| m.ptr)),
                    Arg::P(ptr(x)),
                    Arg::P(yp + 4 * s.first as u64),
                    int(s.rows),
                    int(w.k),
                    int(w.n),
                ];
                self.run(&name, (grid, 1), 256, &args)?;
            }
            return Ok(());
        }
        self.gemm(ptr(x), n_rows, w, m, yp)
    }

    /// The product for many rows of x through cuBLAS.
    fn gemm(
        &self,
        x: u64,
        n_rows: usize,
        w: &DeviceMatrix,
        m: &CudaMatrix,
        y: u64,
    ) -> DeviceResult<()> {
        let k = w.k;
        let mut sc = self.scratch();
        let x16 = if m.segs.iter().any(|s| s.fmt != WFmt::F32) {
            let p = self.scratch_at(&mut sc.x16, 2 * n_rows * k, "the bf16 copy of x")?;
            let n = n_rows * k;
            self.run(
                "f32_to_bf16_rows",
                (blocks_for(n), 1),
                256,
                &[Arg::P(x), Arg::P(p), Arg::N(n as u64)],
            )?;
            p
        } else {
            0
        };
        for s in &m.segs {
            let out = y + 4 * s.first as u64;
            match s.fmt {
                WFmt::F32 => self.gemm_ex(s.p1.ptr, x, out, s.rows, n_rows, k, w.n, false)?,
                WFmt::Bf16 => self.gemm_ex(s.p1.ptr, x16, out, s.rows, n_rows, k, w.n, true)?,
                f => {
                    let tile_rows = (TILE_ELEMS / k).clamp(1, s.rows);
                    let tile = self.scratch_at(
                        &mut sc.tile,
                        2 * tile_rows * k,
                        "a dequantized weight tile",
                    )?;
                    let name = format!("deq_{}_bf16", f.name());
                    let mut r0 = 0;
                    while r0 < s.rows {
                        let nr = tile_rows.min(s.rows - r0);
                        let n = nr * k;
                        let p2 = s.p2.as_ref().map_or(0, |m| m.ptr);
                        let args = [
                            Arg::P(s.p1.ptr),
                            Arg::P(p2),
                            Arg::P(0),
                            int(r0),
                            int(k),
                            Arg::P(tile),
                            Arg::N(n as u64),
                        ];
                        self.run(&name, (blocks_for(n), 1), 256, &args)?;
                        self.gemm_ex(tile, x16, out + 4 * r0 as u64, nr, n_rows, k, w.n, true)?;
                        r0 += nr;
                    }
                }
            }
        }
        Ok(())
    }

    /// `Y[:, 0..rows] = X·Wᵀ` in row-major terms: W `[rows, k]` (bf16 or f32), X `[n_rows, k]` (the same type), Y
    /// f32 with row stride `ldy`; as column-major cuBLAS: `C (rows × n_rows, ldc = ldy) = Wᵀᵀ·X`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ex(
        &self,
        w: u64,
        x: u64,
        y: u64,
        rows: usize,
        n_rows: usize,
        k: usize,
        ldy: usize,
        bf16: bool,
    ) -> DeviceResult<()> {
        let ty = if bf16 {
            cb::cudaDataType::CUDA_R_16BF
        } else {
            cb::cudaDataType::CUDA_R_32F
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let i = |v: usize| i32::try_from(v).expect("a dimension above i32::MAX");
        // SAFETY: W holds rows·k, X n_rows·k elements of `ty`, Y n_rows rows of stride ldy ≥ rows f32 (the callers'
        // allocations); alpha and beta are host f32 (the handle's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                i(rows),
                i(n_rows),
                i(k),
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                ty,
                i(k),
                x as *const std::ffi::c_void,
                ty,
                i(k),
                (&beta as *const f32).cast(),
                y as *mut std::ffi::c_void,
                cb::cudaDataType::CUDA_R_32F,
                i(ldy),
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| super::mem::driver_err(self.id, "cuBLAS GemmEx", e))
    }

    pub(super) fn matmul_swiglu_op(
        &self,
        x: &Buf,
        n_rows: usize,
        w: &DeviceMatrix,
        gu: &mut Buf,
        act: &mut Buf,
    ) -> DeviceResult<()> {
        assert!(
            w.n.is_multiple_of(2),
            "matmul_swiglu: {} outputs are not [gate | up]",
            w.n
        );
        self.matmul_op(x, n_rows, w, gu)?;
        let inter = w.n / 2;
        let a = self.ensure(act, n_rows * inter)?;
        self.silu_mul_at(ptr(gu), a, n_rows, inter)
    }

    pub(super) fn embed_op(
        &self,
        w: &DeviceMatrix,
        ids: &[u32],
        out: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        for &id in ids {
            assert!((id as usize) < w.n, "embed: id {id} of a table of {}", w.n);
        }
        let op = self.ensure(out, ids.len() * w.k)?;
        if ids.is_empty() {
            return Ok(());
        }
        let mut sc = self.scratch();
        for s in &mat(w).segs {
            let rows: Vec<i32> = ids
                .iter()
                .map(|&id| {
                    let id = id as usize;
                    if id >= s.first && id < s.first + s.rows {
                        (id - s.first) as i32
                    } else {
                        -1
                    }
                })
                .collect();
            if rows.iter().all(|&r| r < 0) {
                continue;
            }
            let rp = self.scratch_at(&mut sc.rows, 4 * rows.len(), "the embedding's rows")?;
            self.htod(rp, &rows)?;
            let n = ids.len() * w.k;
            let p2 = s.p2.as_ref().map_or(0, |m| m.ptr);
            let name = format!("deq_{}_f32", s.fmt.name());
            let args = [
                Arg::P(s.p1.ptr),
                Arg::P(p2),
                Arg::P(rp),
                int(0),
                int(w.k),
                Arg::P(op),
                Arg::N(n as u64),
            ];
            self.run(&name, (blocks_for(n), 1), 256, &args)?;
        }
        Ok(())
    }
}
