//! Paged KV cache of one full-attention layer (DESIGN.md §3.3, §4).
//!
//! A [`PagedKvCache`] is a list of [`KvPage`]s of a fixed capacity (`page_size` positions); only the last
//! page may be partly filled. K and V rows go in and come out as `[len, n_kv_heads, head_dim]` in a [`KvDtype`]
//! (f16 → f32 is exact); inside a page they are stored in the attention kernel's block layout.

mod cache;
mod packed;
pub(crate) mod page;
mod view;

use std::fmt;
use std::str::FromStr;

pub use cache::{KvError, PagedKvCache};
pub use packed::PackedPage;
pub use page::KvPage;
pub use view::{PageLayout, PageView, PageViewError, RowsRef};

/// Positions per storage block of a page: the attention kernel reads one block of one KV head as one contiguous
/// run of keys (transposed) and one of values (see [`KvPage`]).
pub const KV_BLOCK: usize = 64;

/// Storage dtype of KV rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE 754 binary16; f32 inputs are rounded to nearest even on append.
    F16,
    /// IEEE 754 binary32; stored as given.
    F32,
}

impl KvDtype {
    /// Bytes per stored element: 2 for [`KvDtype::F16`], 4 for [`KvDtype::F32`].
    pub fn size_of(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// The lowercase name, `"f16"` or `"f32"` (what [`FromStr`] accepts and [`fmt::Display`] prints).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error of parsing a [`KvDtype`] from a string other than `"f16"` or `"f32"`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV dtype {0:?} (expected \"f16\" or \"f32\")")]
pub struct ParseKvDtypeError(pub String);

impl FromStr for KvDtype {
    type Err = ParseKvDtypeError;

    /// Parses `"f16"` or `"f32"` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            _ => Err(ParseKvDtypeError(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_round_trips_through_its_name() {
        for d in [KvDtype::F16, KvDtype::F32] {
            assert_eq!(d.to_string().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!("F16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert_eq!(
            "bf16".parse::<KvDtype>(),
            Err(ParseKvDtypeError("bf16".into()))
        );
        assert_eq!(KvDtype::F16.size_of(), 2);
        assert_eq!(KvDtype::F32.size_of(), 4);
    }
}
