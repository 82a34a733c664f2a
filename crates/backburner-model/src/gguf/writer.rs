//! A minimal GGUF writer for tests and fixtures (not a converter): it writes exactly what it is given — any key,
//! value type, dims, type id, declared offset — so that tests can build valid files and malformed ones alike.
//!
//! Layout written: header (v3 unless told otherwise; v2 has the same layout), the KV pairs in insertion order, the
//! tensor infos, padding to the alignment, then each tensor's data padded to the alignment. The alignment is
//! `general.alignment` when it is set as a u32 pair, else 32.

use std::path::Path;

use super::metadata::{MetaArray, MetaValue};
use super::types::GgmlType;
use super::GgufFile;
use crate::error::{ModelError, Result};

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct WTensor {
    /// Name.
    pub name: String,
    /// Dims in ggml order (`dims[0]` fastest), written as given.
    pub dims: Vec<u64>,
    /// Type id written.
    pub type_id: u32,
    /// Bytes written into the data section.
    pub data: Vec<u8>,
    /// Zero bytes after `data` (left as a hole by [`GgufWriter::write`], so that tests can describe tensors of real
    /// models' sizes without writing them).
    pub zeros: u64,
    /// Offset to declare instead of the one where the data is written (for malformed files).
    pub declared_offset: Option<u64>,
}

/// Builds a GGUF file in memory.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    /// Version written (2 and 3 share a layout).
    pub version: u32,
    kvs: Vec<(String, Vec<u8>)>,
    alignment: u64,
    /// Tensors, in the order their infos and data are written.
    pub tensors: Vec<WTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter {
            version: 3,
            kvs: Vec::new(),
            alignment: 32,
            tensors: Vec::new(),
        }
    }
}

/// Appends a GGUF string (u64 length + bytes).
pub fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn array_elem_id(a: &MetaArray) -> u32 {
    match a {
        MetaArray::U8(_) => 0,
        MetaArray::I8(_) => 1,
        MetaArray::U16(_) => 2,
        MetaArray::I16(_) => 3,
        MetaArray::U32(_) => 4,
        MetaArray::I32(_) => 5,
        MetaArray::F32(_) => 6,
        MetaArray::Bool(_) => 7,
        MetaArray::Str(_) => 8,
        MetaArray::U64(_) => 10,
        MetaArray::I64(_) => 11,
        MetaArray::F64(_) => 12,
    }
}

fn put_array(buf: &mut Vec<u8>, a: &MetaArray) {
    buf.extend_from_slice(&array_elem_id(a).to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        MetaArray::U8(v) => each!(v),
        MetaArray::I8(v) => each!(v),
        MetaArray::U16(v) => each!(v),
        MetaArray::I16(v) => each!(v),
        MetaArray::U32(v) => each!(v),
        MetaArray::I32(v) => each!(v),
        MetaArray::U64(v) => each!(v),
        MetaArray::I64(v) => each!(v),
        MetaArray::F32(v) => each!(v),
        MetaArray::F64(v) => each!(v),
        MetaArray::Bool(v) => buf.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::Str(v) => v.iter().for_each(|s| put_str(buf, s)),
    }
}

/// Appends a value's encoding without its type id.
pub fn put_value(buf: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => buf.push(u8::from(*x)),
        MetaValue::Str(s) => put_str(buf, s),
        MetaValue::Array(a) => put_array(buf, a),
    }
}

/// Stored bytes of a tensor of these dims and type.
///
/// Panics if the type has no known block size or the dims do not fill whole blocks (a test-writing error).
pub fn size_of(dims: &[u64], t: GgmlType) -> u64 {
    let (blk, bytes) = t.block().expect("a type with a known block size");
    let elems: u64 = dims.iter().product();
    assert!(elems.is_multiple_of(blk as u64), "dims fill whole blocks");
    elems / blk as u64 * bytes as u64
}

fn pad_to(buf: &mut Vec<u8>, align: u64) {
    while !(buf.len() as u64).is_multiple_of(align) {
        buf.push(0);
    }
}

impl GgufWriter {
    /// An empty v3 file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a key–value pair (a u32 `general.alignment` also sets the alignment used for writing).
    pub fn kv(&mut self, key: &str, v: MetaValue) -> &mut Self {
        if let (Some("general.alignment"), MetaValue::U32(a)) = (Some(key), &v) {
            if a.is_power_of_two() {
                self.alignment = u64::from(*a);
            }
        }
        let mut raw = type_id(&v).to_le_bytes().to_vec();
        put_value(&mut raw, &v);
        self.kvs.push((key.to_string(), raw));
        self
    }

    /// Removes every pair of this key.
    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    /// Adds a pair whose type id and value bytes are written as given (for malformed files).
    pub fn kv_raw(&mut self, key: &str, type_id: u32, value: &[u8]) -> &mut Self {
        let mut raw = type_id.to_le_bytes().to_vec();
        raw.extend_from_slice(value);
        self.kvs.push((key.to_string(), raw));
        self
    }

    /// Adds a tensor with the given bytes.
    pub fn tensor(&mut self, name: &str, dims: &[u64], t: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push(WTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: t.id(),
            data,
            zeros: 0,
            declared_offset: None,
        });
        self
    }

    /// Removes every tensor of this name.
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.name != name);
        self
    }

    /// Adds a tensor of the right size for its dims and type whose bytes are all zero (a hole in the written file).
    ///
    /// Panics if the type has no known block size or the dims do not fill whole blocks (a test-writing error).
    pub fn tensor_zeroed(&mut self, name: &str, dims: &[u64], t: GgmlType) -> &mut Self {
        let n = size_of(dims, t);
        self.tensor(name, dims, t, Vec::new());
        if let Some(last) = self.tensors.last_mut() {
            last.zeros = n;
        }
        self
    }

    /// Adds a tensor of the right size for its dims and type, filled with a byte pattern derived from `seed`.
    ///
    /// Panics if the type has no known block size or the dims do not fill whole blocks (a test-writing error).
    pub fn tensor_filled(&mut self, name: &str, dims: &[u64], t: GgmlType, seed: u8) -> &mut Self {
        let n = size_of(dims, t) as usize;
        let data = (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        self.tensor(name, dims, t, data)
    }

    /// The header: everything before the data section, padded to the alignment.
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut buf = b"GGUF".to_vec();
        buf.extend_from_slice(&self.version.to_le_bytes());
        buf.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        buf.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, raw) in &self.kvs {
            put_str(&mut buf, k);
            buf.extend_from_slice(raw);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut buf, &t.name);
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.type_id.to_le_bytes());
            buf.extend_from_slice(&t.declared_offset.unwrap_or(offset).to_le_bytes());
            offset = (offset + t.data.len() as u64 + t.zeros).next_multiple_of(self.alignment);
        }
        if !self.tensors.is_empty() {
            pad_to(&mut buf, self.alignment);
        }
        buf
    }

    /// The file's bytes (zeroed tensors written out).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut buf = self.header_bytes();
        for t in &self.tensors {
            buf.extend_from_slice(&t.data);
            buf.resize(buf.len() + t.zeros as usize, 0);
            pad_to(&mut buf, self.alignment);
        }
        buf
    }

    /// Writes the file; zeroed tensors are left as holes (a sparse file where the file system allows).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(path)?;
        let header = self.header_bytes();
        f.write_all(&header)?;
        let mut len = header.len() as u64;
        for t in &self.tensors {
            f.write_all(&t.data)?;
            len = (len + t.data.len() as u64 + t.zeros).next_multiple_of(self.alignment);
            f.seek(SeekFrom::Start(len))?;
        }
        f.set_len(len)
    }
}

/// Keys (after `{arch}.`) that llama.cpp reads per block when they are arrays: [`restack_layers`] reorders them with
/// the blocks.
const PER_BLOCK_KEYS: &[&str] = &[
    "attention.recurrent_layers",
    "attention.head_count",
    "attention.head_count_kv",
    "feed_forward_length",
];

impl GgufWriter {
    /// A writer holding a copy of the single-file model `f`: its metadata pairs in file order and its tensors (in
    /// name order) with their bytes, to be edited and written again.
    ///
    /// Errors: [`ModelError::InvalidConfig`] for a split set (its `split.*` keys describe the parts).
    pub fn copy_of(f: &GgufFile) -> Result<Self> {
        if f.paths().len() != 1 {
            return Err(ModelError::InvalidConfig(format!(
                "{}: a split set ({} files); copy_of takes a single file",
                f.paths()[0].display(),
                f.paths().len()
            )));
        }
        let mut w = GgufWriter::new();
        w.version = f.version();
        for k in f.metadata().keys() {
            let v = f.metadata().get(k).expect("a key of this metadata");
            w.kv(k, v.clone());
        }
        for name in f.tensor_names() {
            let info = f.tensor(name).expect("a tensor of this file");
            w.tensor(name, &info.dims, info.ggml_type, f.data(name)?.to_vec());
        }
        Ok(w)
    }
}

/// A copy of the single-file model `f` whose decoder block `i` is `f`'s block `layers[i]` (tensors `blk.N.*` renamed,
/// `{arch}.block_count` and the per-block arrays rewritten; everything else as stored). For tests that need more
/// layers than a small file has, e.g. a split point in a quantized model of one layer cycle.
///
/// Errors: those of [`GgufWriter::copy_of`]; [`ModelError::InvalidConfig`] when `f` has no `block_count`, an index
/// of `layers` is not one of its blocks, or it has MTP blocks (`nextn_predict_layers`).
pub fn restack_layers(f: &GgufFile, layers: &[usize]) -> Result<GgufWriter> {
    let bad = |m: String| ModelError::InvalidConfig(format!("{}: {m}", f.paths()[0].display()));
    let arch = f
        .architecture()
        .ok_or_else(|| bad("no general.architecture".into()))?
        .to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let n = f
        .metadata()
        .get_u64(&key("block_count"))
        .ok_or_else(|| bad("no block_count".into()))?;
    if f.metadata().get(&key("nextn_predict_layers")).is_some() {
        return Err(bad("MTP blocks are not restacked".into()));
    }
    if let Some(&l) = layers.iter().find(|&&l| l as u64 >= n) {
        return Err(bad(format!("block {l} is not one of its {n} blocks")));
    }
    let src = GgufWriter::copy_of(f)?;
    let mut w = GgufWriter {
        version: src.version,
        kvs: Vec::new(),
        alignment: src.alignment,
        tensors: Vec::new(),
    };
    for k in f.metadata().keys() {
        let v = f.metadata().get(k).expect("a key of this metadata");
        let v = if k == key("block_count") {
            match v {
                MetaValue::U64(_) => MetaValue::U64(layers.len() as u64),
                MetaValue::I32(_) => MetaValue::I32(layers.len() as i32),
                MetaValue::I64(_) => MetaValue::I64(layers.len() as i64),
                _ => MetaValue::U32(layers.len() as u32),
            }
        } else if let (true, MetaValue::Array(a)) = (PER_BLOCK_KEYS.iter().any(|p| k == key(p)), v)
        {
            macro_rules! pick {
                ($variant:ident, $xs:expr) => {
                    MetaArray::$variant(layers.iter().map(|&l| $xs[l].clone()).collect())
                };
            }
            if a.len() as u64 != n {
                return Err(bad(format!("{k} has {} entries for {n} blocks", a.len())));
            }
            MetaValue::Array(match a {
                MetaArray::Bool(x) => pick!(Bool, x),
                MetaArray::U8(x) => pick!(U8, x),
                MetaArray::I8(x) => pick!(I8, x),
                MetaArray::U16(x) => pick!(U16, x),
                MetaArray::I16(x) => pick!(I16, x),
                MetaArray::U32(x) => pick!(U32, x),
                MetaArray::I32(x) => pick!(I32, x),
                MetaArray::U64(x) => pick!(U64, x),
                MetaArray::I64(x) => pick!(I64, x),
                other => return Err(bad(format!("{k} is an array of {}", other.type_name()))),
            })
        } else {
            v.clone()
        };
        w.kv(k, v);
    }
    for t in &src.tensors {
        let block = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)));
        match block {
            None => w.tensors.push(t.clone()),
            Some((i, rest)) => {
                for (j, _) in layers.iter().enumerate().filter(|(_, &l)| l == i) {
                    let mut c = t.clone();
                    c.name = format!("blk.{j}.{rest}");
                    w.tensors.push(c);
                }
            }
        }
    }
    Ok(w)
}
