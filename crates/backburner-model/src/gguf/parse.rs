//! The bounded parser of one GGUF file (v2 or v3, little-endian) held in memory (a map of the file).
//!
//! Layout: magic `GGUF`, u32 version, u64 tensor count, u64 KV count, the KV pairs (u64-length strings; a u32 value
//! type; arrays as u32 element type + u64 count + elements), the tensor infos (name, u32 n_dims, u64 dims, u32 ggml
//! type, u64 offset relative to the data section), padding to `general.alignment` (default 32), the data section.
//!
//! Nothing read is trusted: every length is checked against the bytes left before anything is allocated, all size
//! arithmetic is checked, and every tensor must lie inside the file, aligned, without overlapping another.

use super::metadata::{MetaArray, MetaValue, Metadata, StrArray};
use super::types::GgmlType;

/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Longest single string (key, value or array entry).
pub const MAX_STRING: u64 = 256 << 20;
/// Most elements in one array.
pub const MAX_ARRAY_LEN: u64 = 1 << 28;
/// Longest tensor name (llama.cpp allows 63 bytes).
pub const MAX_TENSOR_NAME: u64 = 256;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

// Smallest possible encodings, used to bound counts by the bytes left before allocating.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // key len + type + u8 value (an empty key is refused later, by name)
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 8 + 4 + 8; // name + n_dims + one dim + type + offset

/// One tensor as described by the header, its place resolved to absolute file offsets.
#[derive(Clone, Debug)]
pub(crate) struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

/// A parsed and validated file header.
#[derive(Debug)]
pub(crate) struct ParsedPart {
    pub version: u32,
    pub metadata: Metadata,
    pub alignment: u64,
    /// Absolute offset of the data section.
    #[cfg_attr(not(test), allow(dead_code))]
    pub data_start: u64,
    pub tensors: Vec<RawTensor>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

type PResult<T> = std::result::Result<T, String>;

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> PResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "{what} at byte {} needs {n} bytes but only {} are left (truncated file?)",
                self.pos,
                self.remaining()
            ));
        }
        // n <= remaining <= usize::MAX
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> PResult<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> PResult<&'a str> {
        let at = self.pos;
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(format!(
                "{what} at byte {at} claims {n} bytes, more than the {MAX_STRING} a string may have"
            ));
        }
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes).map_err(|e| format!("{what} at byte {at} is not UTF-8: {e}"))
    }
}

/// GGUF value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STR: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// Encoded size of one element (for strings: the least, the u64 length of an empty one).
fn elem_size(t: u32) -> Option<u64> {
    Some(match t {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STR => 8,
        _ => return None,
    })
}

fn scalar(cur: &mut Cursor<'_>, t: u32, what: &str) -> PResult<MetaValue> {
    Ok(match t {
        T_U8 => MetaValue::U8(u8::from_le_bytes(cur.array(what)?)),
        T_I8 => MetaValue::I8(i8::from_le_bytes(cur.array(what)?)),
        T_U16 => MetaValue::U16(u16::from_le_bytes(cur.array(what)?)),
        T_I16 => MetaValue::I16(i16::from_le_bytes(cur.array(what)?)),
        T_U32 => MetaValue::U32(u32::from_le_bytes(cur.array(what)?)),
        T_I32 => MetaValue::I32(i32::from_le_bytes(cur.array(what)?)),
        T_U64 => MetaValue::U64(u64::from_le_bytes(cur.array(what)?)),
        T_I64 => MetaValue::I64(i64::from_le_bytes(cur.array(what)?)),
        T_F32 => MetaValue::F32(f32::from_le_bytes(cur.array(what)?)),
        T_F64 => MetaValue::F64(f64::from_le_bytes(cur.array(what)?)),
        T_BOOL => MetaValue::Bool(cur.array::<1>(what)?[0] != 0),
        T_STR => MetaValue::Str(cur.string(what)?.to_string()),
        T_ARRAY => MetaValue::Array(array(cur, what)?),
        other => return Err(format!("{what} has unknown value type {other}")),
    })
}

/// Reads `n` fixed-size little-endian elements.
fn fixed<T, const N: usize>(
    cur: &mut Cursor<'_>,
    n: u64,
    what: &str,
    f: impl Fn([u8; N]) -> T,
) -> PResult<Vec<T>> {
    let bytes = cur.take(n * N as u64, what)?; // n * N <= remaining, checked by the caller
    Ok(bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect())
}

fn array(cur: &mut Cursor<'_>, what: &str) -> PResult<MetaArray> {
    let t = cur.u32(what)?;
    let at = cur.pos;
    let n = cur.u64(what)?;
    if t == T_ARRAY {
        return Err(format!(
            "{what} is an array of arrays, which GGUF readers do not support"
        ));
    }
    let size =
        elem_size(t).ok_or_else(|| format!("{what} is an array of unknown value type {t}"))?;
    let need = n.saturating_mul(size);
    if n > MAX_ARRAY_LEN || need > cur.remaining() {
        return Err(format!(
            "{what} at byte {at} claims {n} elements, which cannot fit the {} bytes left",
            cur.remaining()
        ));
    }
    Ok(match t {
        T_U8 => MetaArray::U8(fixed(cur, n, what, u8::from_le_bytes)?),
        T_I8 => MetaArray::I8(fixed(cur, n, what, i8::from_le_bytes)?),
        T_U16 => MetaArray::U16(fixed(cur, n, what, u16::from_le_bytes)?),
        T_I16 => MetaArray::I16(fixed(cur, n, what, i16::from_le_bytes)?),
        T_U32 => MetaArray::U32(fixed(cur, n, what, u32::from_le_bytes)?),
        T_I32 => MetaArray::I32(fixed(cur, n, what, i32::from_le_bytes)?),
        T_U64 => MetaArray::U64(fixed(cur, n, what, u64::from_le_bytes)?),
        T_I64 => MetaArray::I64(fixed(cur, n, what, i64::from_le_bytes)?),
        T_F32 => MetaArray::F32(fixed(cur, n, what, f32::from_le_bytes)?),
        T_F64 => MetaArray::F64(fixed(cur, n, what, f64::from_le_bytes)?),
        T_BOOL => MetaArray::Bool(fixed(cur, n, what, |b: [u8; 1]| b[0] != 0)?),
        _ => {
            // Grown as entries are read (each consumes >= 8 bytes of the file), not sized by the claimed count.
            let mut s = StrArray::with_capacity(n.min(1 << 16) as usize, 0);
            for _ in 0..n {
                s.push(cur.string(what)?);
            }
            MetaArray::Str(s)
        }
    })
}

fn header(cur: &mut Cursor<'_>) -> PResult<(u32, u64, u64)> {
    let magic = cur.take(4, "the magic")?;
    if magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file (magic {:?}, expected \"GGUF\")",
            String::from_utf8_lossy(magic)
        ));
    }
    let version = cur.u32("the version")?;
    if version != 0 && version & 0xFFFF == 0 {
        return Err(format!(
            "version field {version:#010x} looks byte-swapped: a big-endian GGUF file, which this reader does not \
             support (convert it with llama.cpp's gguf-py for a little-endian machine)"
        ));
    }
    match version {
        2 | 3 => {}
        1 => return Err("GGUF v1 is not supported (only v2 and v3)".into()),
        v => {
            return Err(format!(
                "GGUF version {v} is not supported (only v2 and v3)"
            ))
        }
    }
    let n_tensors = cur.u64("the tensor count")?;
    let n_kv = cur.u64("the key-value count")?;
    if n_kv > cur.remaining() / MIN_KV_BYTES {
        return Err(format!(
            "header claims {n_kv} key-value pairs, which cannot fit the {} bytes of the file (truncated file?)",
            cur.buf.len()
        ));
    }
    if n_tensors > cur.remaining() / MIN_TENSOR_INFO_BYTES {
        return Err(format!(
            "header claims {n_tensors} tensors, which cannot fit the {} bytes of the file (truncated file?)",
            cur.buf.len()
        ));
    }
    Ok((version, n_tensors, n_kv))
}

fn key_values(cur: &mut Cursor<'_>, n_kv: u64) -> PResult<Metadata> {
    let mut md = Metadata::default();
    for i in 0..n_kv {
        let key = cur.string(&format!("key of pair {i}"))?;
        if key.is_empty() {
            return Err(format!("key of pair {i} is empty"));
        }
        let what = format!("value of {key:?}");
        let t = cur.u32(&what)?;
        let value = scalar(cur, t, &what)?;
        if !md.insert(key.to_string(), value) {
            return Err(format!("key {key:?} appears twice"));
        }
    }
    Ok(md)
}

fn alignment(md: &Metadata) -> PResult<u64> {
    match md.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(MetaValue::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(MetaValue::U32(a)) => Err(format!("general.alignment = {a} is not a power of two")),
        Some(v) => Err(format!(
            "general.alignment has type {}, expected u32",
            v.type_name()
        )),
    }
}

/// Reads one tensor info; `offset` is still relative to the data section.
fn tensor_info(cur: &mut Cursor<'_>, i: u64, align: u64) -> PResult<RawTensor> {
    let at = cur.pos;
    let name = cur.string(&format!("name of tensor {i}"))?;
    if name.is_empty() || name.len() as u64 > MAX_TENSOR_NAME {
        return Err(format!(
            "tensor {i} at byte {at} has a name of {} bytes (must be 1..={MAX_TENSOR_NAME})",
            name.len()
        ));
    }
    let what = format!("tensor {name:?}");
    let n_dims = cur.u32(&what)?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(format!(
            "{what} has {n_dims} dimensions (must be 1..={MAX_DIMS})"
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    let mut elems: u64 = 1;
    for d in 0..n_dims {
        let n = cur.u64(&what)?;
        if n == 0 || n > i64::MAX as u64 {
            return Err(format!("{what} has dimension {d} of size {n}"));
        }
        elems = elems
            .checked_mul(n)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| format!("{what}: the product of its dimensions overflows"))?;
        dims.push(n);
    }
    let id = cur.u32(&what)?;
    let ggml_type = GgmlType::from_u32(id);
    let (blk, blk_bytes) = ggml_type
        .block()
        .ok_or_else(|| format!("{what} has unknown ggml type id {id}"))?;
    if dims[0] % blk as u64 != 0 {
        return Err(format!(
            "{what} of type {ggml_type} has rows of {} elements, not a multiple of its block of {blk}",
            dims[0]
        ));
    }
    let n_bytes = (elems / blk as u64)
        .checked_mul(blk_bytes as u64)
        .ok_or_else(|| format!("{what}: its size in bytes overflows"))?;
    let offset = cur.u64(&what)?;
    if offset % align != 0 {
        return Err(format!(
            "{what} has offset {offset}, not a multiple of the alignment {align}"
        ));
    }
    Ok(RawTensor {
        name: name.to_string(),
        dims,
        ggml_type,
        offset,
        n_bytes,
    })
}

/// Resolves offsets to absolute ones and checks that every tensor lies inside the file and none overlap.
fn place_tensors(tensors: &mut [RawTensor], data_start: u64, file_len: u64) -> PResult<()> {
    for t in tensors.iter_mut() {
        let start = data_start.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => t.offset = s,
            _ => {
                return Err(format!(
                    "tensor {:?} ({} bytes at data offset {}) lies past the end of the file ({file_len} bytes; data \
                     section at {data_start})",
                    t.name, t.n_bytes, t.offset
                ))
            }
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.offset + a.n_bytes > b.offset {
            return Err(format!(
                "tensors {:?} and {:?} overlap (bytes {}..{} and {}..{})",
                a.name,
                b.name,
                a.offset,
                a.offset + a.n_bytes,
                b.offset,
                b.offset + b.n_bytes
            ));
        }
    }
    Ok(())
}

/// Parses and validates the header of a whole GGUF file. Errors are messages (the caller adds the path).
///
/// A header with no key-value pairs is a file without `general.architecture` (every GGUF model has it, first): when
/// the rest then fails to parse, most likely because its pairs are read as tensor infos, the error says so first
/// rather than naming a "tensor" that is a key.
pub(crate) fn parse(buf: &[u8]) -> PResult<ParsedPart> {
    let mut cur = Cursor { buf, pos: 0 };
    let (version, n_tensors, n_kv) = header(&mut cur)?;
    body(cur, version, n_tensors, n_kv).map_err(|m| {
        if n_kv == 0 {
            format!(
                "the header's key-value count is 0: the file has no metadata (no general.architecture), and what \
                 follows the header is not valid tensor infos: {m}"
            )
        } else {
            m
        }
    })
}

/// Everything after the header: the pairs, the tensor infos and the placement of the data.
fn body(mut cur: Cursor<'_>, version: u32, n_tensors: u64, n_kv: u64) -> PResult<ParsedPart> {
    let buf = cur.buf;
    let metadata = key_values(&mut cur, n_kv)?;
    let align = alignment(&metadata)?;
    // Grown as infos are read, not sized by the claimed count.
    let mut tensors = Vec::with_capacity(n_tensors.min(4096) as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let t = tensor_info(&mut cur, i, align)?;
        if !seen.insert(t.name.clone()) {
            return Err(format!("tensor name {:?} appears twice", t.name));
        }
        tensors.push(t);
    }
    let file_len = buf.len() as u64;
    let pos = cur.pos as u64;
    let data_start = if n_tensors == 0 {
        pos
    } else {
        pos.checked_next_multiple_of(align)
            .filter(|&d| d <= file_len)
            .ok_or_else(|| {
                format!(
                    "the data section (at byte {pos} rounded up to {align}) starts past the end of the file ({file_len} bytes)"
                )
            })?
    };
    place_tensors(&mut tensors, data_start, file_len)?;
    Ok(ParsedPart {
        version,
        metadata,
        alignment: align,
        data_start,
        tensors,
    })
}
