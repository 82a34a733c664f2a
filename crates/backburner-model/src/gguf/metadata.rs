//! GGUF key–value metadata: typed values, compact string arrays (a 248k-token vocabulary is one buffer plus offsets,
//! not 248k `String`s) and typed getters.

use std::collections::HashMap;

/// An array of strings stored as one UTF-8 buffer and the end offset of each entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StrArray {
    data: String,
    ends: Vec<usize>,
}

impl StrArray {
    /// Bytes of text of all the entries together.
    pub fn text_bytes(&self) -> usize {
        self.data.len()
    }

    /// An empty array with room for `n` entries and `bytes` bytes of text.
    pub fn with_capacity(n: usize, bytes: usize) -> Self {
        StrArray {
            data: String::with_capacity(bytes),
            ends: Vec::with_capacity(n),
        }
    }

    /// Appends one entry.
    pub fn push(&mut self, s: &str) {
        self.data.push_str(s);
        self.ends.push(self.data.len());
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Entry `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.data.get(start..end)
    }

    /// The entries in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(move |i| self.get(i).unwrap_or(""))
    }
}

/// The elements of an array value, one variant per element type (arrays of arrays are refused when parsing, as
/// llama.cpp does).
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    Str(StrArray),
}

impl MetaArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
        }
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as signed integers, for any integer element type (`None` for floats, bools, strings, or a u64
    /// past `i64::MAX`).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            MetaArray::U8(v) => conv(v, |x| Some(x.into())),
            MetaArray::I8(v) => conv(v, |x| Some(x.into())),
            MetaArray::U16(v) => conv(v, |x| Some(x.into())),
            MetaArray::I16(v) => conv(v, |x| Some(x.into())),
            MetaArray::U32(v) => conv(v, |x| Some(x.into())),
            MetaArray::I32(v) => conv(v, |x| Some(x.into())),
            MetaArray::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            MetaArray::I64(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// The GGUF name of the element type (`u32`, `str`, …), for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaArray::U8(_) => "u8",
            MetaArray::I8(_) => "i8",
            MetaArray::U16(_) => "u16",
            MetaArray::I16(_) => "i16",
            MetaArray::U32(_) => "u32",
            MetaArray::I32(_) => "i32",
            MetaArray::U64(_) => "u64",
            MetaArray::I64(_) => "i64",
            MetaArray::F32(_) => "f32",
            MetaArray::F64(_) => "f64",
            MetaArray::Bool(_) => "bool",
            MetaArray::Str(_) => "str",
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(MetaArray),
}

impl MetaValue {
    /// The value as a signed integer, for any integer type (`None` otherwise, or for a u64 past `i64::MAX`).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(x) => Some(x.into()),
            MetaValue::I8(x) => Some(x.into()),
            MetaValue::U16(x) => Some(x.into()),
            MetaValue::I16(x) => Some(x.into()),
            MetaValue::U32(x) => Some(x.into()),
            MetaValue::I32(x) => Some(x.into()),
            MetaValue::U64(x) => i64::try_from(x).ok(),
            MetaValue::I64(x) => Some(x),
            _ => None,
        }
    }

    /// The value as an unsigned integer, for any integer type holding a value ≥ 0.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U64(x) => Some(x),
            _ => self.as_i64().and_then(|x| u64::try_from(x).ok()),
        }
    }

    /// The value of an f32 or f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(x) => Some(x.into()),
            MetaValue::F64(x) => Some(x),
            _ => None,
        }
    }

    /// The GGUF name of the type (`u32`, `str`, `arr[str]`, …), for messages.
    pub fn type_name(&self) -> String {
        let s = match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "str",
            MetaValue::Array(a) => return format!("arr[{}]", a.type_name()),
        };
        s.to_string()
    }
}

/// The key–value pairs of a GGUF file (of its first part, for a split set). Keys are unique (a file with a
/// repeated key is refused).
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    map: HashMap<String, MetaValue>,
    /// Keys in file order.
    order: Vec<String>,
}

impl Metadata {
    /// Adds a pair; returns `false` (and keeps the first) when the key is already present.
    pub(crate) fn insert(&mut self, key: String, value: MetaValue) -> bool {
        if self.map.contains_key(&key) {
            return false;
        }
        self.order.push(key.clone());
        self.map.insert(key, value);
        true
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.map.get(key)
    }

    /// All keys, in file order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.order.iter().map(String::as_str)
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// A string value (`None` if absent or not a string).
    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An integer value of any integer type that is ≥ 0 (`None` if absent, negative or not an integer).
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// An integer value of any integer type that fits an i64.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// An f32 or f64 value.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.get(key)? {
            MetaValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// An array value of any element type.
    pub fn get_array(&self, key: &str) -> Option<&MetaArray> {
        match self.get(key)? {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Option<&StrArray> {
        match self.get_array(key)? {
            MetaArray::Str(a) => Some(a),
            _ => None,
        }
    }

    /// An array of any integer type whose elements all fit an i32.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get_array(key)?
            .to_i64_vec()?
            .into_iter()
            .map(|x| i32::try_from(x).ok())
            .collect()
    }

    /// An array of any integer type whose elements are all ≥ 0.
    pub fn get_u64_array(&self, key: &str) -> Option<Vec<u64>> {
        if let MetaArray::U64(v) = self.get_array(key)? {
            return Some(v.clone());
        }
        self.get_array(key)?
            .to_i64_vec()?
            .into_iter()
            .map(|x| u64::try_from(x).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_metadata_getters_convert_between_integer_types() {
        let mut m = Metadata::default();
        assert!(m.insert("a".into(), MetaValue::I32(5)));
        assert!(m.insert("neg".into(), MetaValue::I8(-1)));
        assert!(m.insert("big".into(), MetaValue::U64(u64::MAX)));
        assert!(m.insert("f".into(), MetaValue::F32(1.5)));
        assert!(
            !m.insert("a".into(), MetaValue::U8(1)),
            "duplicate key kept"
        );
        assert_eq!(m.get_u64("a"), Some(5));
        assert_eq!(m.get_u64("neg"), None);
        assert_eq!(m.get_i64("neg"), Some(-1));
        assert_eq!(m.get_u64("big"), Some(u64::MAX));
        assert_eq!(m.get_i64("big"), None);
        assert_eq!(m.get_f64("f"), Some(1.5));
        assert_eq!(m.get_f64("a"), None);
        assert_eq!(m.get_str("a"), None);
        assert_eq!(m.keys().collect::<Vec<_>>(), ["a", "neg", "big", "f"]);
        let mut s = StrArray::with_capacity(2, 4);
        s.push("ab");
        s.push("");
        s.push("ü");
        assert_eq!(s.iter().collect::<Vec<_>>(), ["ab", "", "ü"]);
        assert_eq!(s.get(3), None);
        assert!(m.insert("s".into(), MetaValue::Array(MetaArray::Str(s))));
        assert_eq!(m.get_str_array("s").map(|a| a.len()), Some(3));
        assert!(m.insert(
            "ints".into(),
            MetaValue::Array(MetaArray::U8(vec![1, 2, 255]))
        ));
        assert_eq!(m.get_i32_array("ints"), Some(vec![1, 2, 255]));
        assert_eq!(m.get_u64_array("ints"), Some(vec![1, 2, 255]));
        assert_eq!(m.get_i32_array("s"), None);
    }
}
