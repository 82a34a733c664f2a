//! Random-weight GGUF files of any config and per-tensor type mix, written straight to disk with bounded memory:
//! real-size files (the full 64-layer 27B shape) for benchmarks, without converting a 54 GB checkpoint.
//!
//! # What is written
//! A `qwen35`, `qwen35moe` or `qwen3next` file (the architecture of the config, [`crate::arch::arch_of`]) holding
//! every tensor of the architecture's table ([`crate::arch`]) under llama.cpp's names and dims, the metadata llama.cpp's
//! converter writes and [`crate::gguf::config_from_gguf`] reads (which gives back [`Generator::config`]), a tokenizer
//! section ([`Vocab`]), and provenance keys `backburner.random.seed` / `backburner.random.types`.
//!
//! Shapes (ggml order, row length first): matrices `[cols, rows]`; the routed experts one `[cols, rows, experts]`
//! tensor per kind (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`); the conv kernel `[kernel, conv_dim]`; the
//! shared expert's gate `[H]`; norms and the other vectors `[n]`. A `qwen3next` file stores the Gated DeltaNet input
//! projections as llama.cpp's current converter does (`attn_qkv`, `attn_gate`, `ssm_ba`).
//!
//! # Types
//! A [`TypeRule`] gives every tensor llama-quantize would quantize a type (a default, overrides by name pattern);
//! vectors, the conv kernel and the MoE router stay F32. A tensor whose rows are not a whole number of its type's
//! blocks falls back as llama-quantize's does ([`Fallback`], [`Generator::fallbacks`]). Every type of
//! [`GENERATED_TYPES`] is written as random valid blocks: finite, non-zero scales chosen so that dequantized
//! projection weights have an RMS of about 0.02 (the architecture table's draw, [`crate::arch::Init`]); float tensors
//! are drawn as N(mean, std) values, norm gains stored as `1 + w` (near 1.0), the decay `A` as `−exp(A_log)`.
//!
//! # Streaming
//! The header (metadata and tensor infos: every size is known up front) is built in memory; then each tensor's data
//! is generated into one buffer of a fixed size (default [`DEFAULT_BUFFER_BYTES`]), which is written out whenever it
//! is full, so memory does not grow with the model. The data are cut into segments of [`SEGMENT_ELEMS`] elements,
//! each drawn from its own generator seeded by the seed, the tensor's name and the segment's index: the bytes depend
//! on neither the buffer size nor the number of threads (segments are generated in parallel on the rayon pool), and a
//! tensor is the same in every file of the same seed that has it (an 8-layer file's first layers are a 64-layer
//! file's).

mod blocks;
mod plan;
mod rule;
mod vocab;

#[cfg(test)]
mod tests;

use std::io::Write;
use std::path::Path;

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf::{GgmlType, DEFAULT_ALIGNMENT};
use crate::synthetic::SplitMix;

pub use blocks::{Draw, ValueMap};
pub use plan::PlannedTensor;
pub use rule::{is_float, parse_type, pattern_matches, Fallback, TypeRule, GENERATED_TYPES};
pub use vocab::{GgufVocab, Vocab};

/// Elements per random stream (whole blocks of every type: a multiple of 256).
pub const SEGMENT_ELEMS: usize = 4096;
/// The default data buffer: 4 MiB.
pub const DEFAULT_BUFFER_BYTES: usize = 4 << 20;
/// The smallest data buffer (a smaller request is raised to it): 64 KiB, which holds a segment of any type.
pub const MIN_BUFFER_BYTES: usize = 64 << 10;

/// A planned random GGUF file: its config, tensors and header, ready to be written.
#[derive(Debug)]
pub struct Generator {
    config: ModelConfig,
    tensors: Vec<PlannedTensor>,
    header: Vec<u8>,
    seed: u64,
}

/// What [`Generator::write_to`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Bytes written (the file's size).
    pub bytes: u64,
    /// Calls to `write_all`.
    pub writes: u64,
    /// The largest of them (bytes): at most the buffer size.
    pub largest_write: usize,
}

/// Tensors of one type in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeCount {
    /// The type.
    pub ggml_type: GgmlType,
    /// Tensors of it.
    pub tensors: usize,
    /// Their stored bytes.
    pub bytes: u64,
}

impl Generator {
    /// Plans the file of `config` (any layout and architecture this build runs) with tensor types from `rule`, the
    /// tokenizer `vocab`, and random data from `seed`.
    ///
    /// Errors: [`ModelError::InvalidConfig`] when the vocabulary does not fit the config's vocab size (see [`Vocab`])
    /// or a tensor of the table has no GGUF name.
    pub fn new(config: &ModelConfig, rule: &TypeRule, vocab: &Vocab, seed: u64) -> Result<Self> {
        let (mut config, arch) = plan::gguf_view(config);
        // llama.cpp's loaders require the MRoPE sections; for text they act as plain RoPE, so a config without them
        // gets a split of the rotary pairs in three (Qwen's [11, 11, 10] of 32), which the file then describes.
        if config.rope.mrope_section.is_none() {
            let pairs = config.rotary_dim() / 2;
            let t = (pairs + 1) / 3;
            config.rope.mrope_section = Some(vec![t, t, pairs - 2 * t]);
        }
        let tensors = plan::tensors(&config, arch, rule)?;
        let (w, eos) = plan::header(&config, arch, &tensors, vocab, seed, rule)?;
        config.eos_token_ids = eos;
        Ok(Generator {
            config,
            tensors,
            header: w.header_bytes(),
            seed,
        })
    }

    /// The config the file describes: what [`crate::gguf::config_from_gguf`] reads back from it.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[PlannedTensor] {
        &self.tensors
    }

    /// The tensors written in another type than their rule asked for.
    pub fn fallbacks(&self) -> impl Iterator<Item = &PlannedTensor> {
        self.tensors.iter().filter(|t| t.fallback.is_some())
    }

    /// Bytes of the header (metadata and tensor infos, padded to the alignment).
    pub fn header_bytes(&self) -> u64 {
        self.header.len() as u64
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        self.tensors.iter().fold(self.header_bytes(), |a, t| {
            a + t.n_bytes.next_multiple_of(DEFAULT_ALIGNMENT)
        })
    }

    /// Tensors and bytes per type, by type id.
    pub fn type_counts(&self) -> Vec<TypeCount> {
        let mut out: Vec<TypeCount> = Vec::new();
        for t in &self.tensors {
            match out.iter_mut().find(|c| c.ggml_type == t.ggml_type) {
                Some(c) => {
                    c.tensors += 1;
                    c.bytes += t.n_bytes;
                }
                None => out.push(TypeCount {
                    ggml_type: t.ggml_type,
                    tensors: 1,
                    bytes: t.n_bytes,
                }),
            }
        }
        out.sort_by_key(|c| c.ggml_type.id());
        out
    }

    /// Writes the file to `out` through one buffer of `buffer_bytes` (at least [`MIN_BUFFER_BYTES`]): no write is
    /// larger, and nothing else grows with the model. `progress` is called after each write with the bytes written
    /// so far.
    ///
    /// Errors: those of `out`.
    pub fn write_to(
        &self,
        out: &mut dyn Write,
        buffer_bytes: usize,
        progress: &mut dyn FnMut(u64),
    ) -> std::io::Result<WriteStats> {
        let mut sink = Sink {
            buf: vec![0u8; buffer_bytes.max(MIN_BUFFER_BYTES)],
            len: 0,
            out,
            stats: WriteStats::default(),
            progress,
        };
        sink.put(&self.header)?;
        for t in &self.tensors {
            self.write_tensor(t, &mut sink)?;
            let pad = t.n_bytes.next_multiple_of(DEFAULT_ALIGNMENT) - t.n_bytes;
            sink.put(&[0u8; DEFAULT_ALIGNMENT as usize][..pad as usize])?;
        }
        sink.flush()?;
        debug_assert_eq!(sink.stats.bytes, self.file_bytes());
        Ok(sink.stats)
    }

    /// One tensor's data into `sink`, as many segments at a time as the buffer has room for.
    fn write_tensor(&self, t: &PlannedTensor, sink: &mut Sink<'_>) -> std::io::Result<()> {
        let quant = blocks::quant(t.ggml_type);
        let (be, bb) = t
            .ggml_type
            .block()
            .expect("a generated type has a block size");
        let seg_bytes = (SEGMENT_ELEMS / be).max(1) * bb;
        let n_segs = t.n_bytes.div_ceil(seg_bytes as u64);
        let tensor_seed = xxhash_rust::xxh3::xxh3_64_with_seed(t.name.as_bytes(), self.seed);
        let mut seg = 0u64;
        while seg < n_segs {
            let room = (sink.buf.len() - sink.len) / seg_bytes;
            if room == 0 {
                sink.flush()?;
                continue;
            }
            let k = (room as u64).min(n_segs - seg);
            let bytes = (k * seg_bytes as u64).min(t.n_bytes - seg * seg_bytes as u64) as usize;
            let dst = &mut sink.buf[sink.len..sink.len + bytes];
            dst.par_chunks_mut(seg_bytes)
                .enumerate()
                .for_each(|(j, c)| {
                    let mut rng = SplitMix(tensor_seed ^ SplitMix(seg + j as u64).next_u64());
                    match &quant {
                        Some(q) => blocks::fill_quant(t.ggml_type, q, c, t.draw.std, &mut rng),
                        None => blocks::fill_floats(t.ggml_type, c, &t.draw, &mut rng),
                    }
                });
            sink.len += bytes;
            seg += k;
        }
        Ok(())
    }

    /// [`Generator::write_to`] a new file at `path` (replaced if it exists; removed again if writing fails).
    ///
    /// Errors: [`ModelError::Io`].
    pub fn write_file(
        &self,
        path: &Path,
        buffer_bytes: usize,
        progress: &mut dyn FnMut(u64),
    ) -> Result<WriteStats> {
        let written = std::fs::File::create(path).and_then(|mut f| {
            let stats = self.write_to(&mut f, buffer_bytes, progress)?;
            f.flush()?;
            Ok(stats)
        });
        written.map_err(|e| {
            let _ = std::fs::remove_file(path);
            ModelError::io(path, e)
        })
    }
}

/// The one buffer the data goes through.
struct Sink<'a> {
    buf: Vec<u8>,
    len: usize,
    out: &'a mut dyn Write,
    stats: WriteStats,
    progress: &'a mut dyn FnMut(u64),
}

impl Sink<'_> {
    fn flush(&mut self) -> std::io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.out.write_all(&self.buf[..self.len])?;
        self.stats.bytes += self.len as u64;
        self.stats.writes += 1;
        self.stats.largest_write = self.stats.largest_write.max(self.len);
        self.len = 0;
        (self.progress)(self.stats.bytes);
        Ok(())
    }

    /// Copies `bytes` in, flushing whenever the buffer is full.
    fn put(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            if self.len == self.buf.len() {
                self.flush()?;
            }
            let n = bytes.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
            self.len += n;
            bytes = &bytes[n..];
        }
        Ok(())
    }
}
