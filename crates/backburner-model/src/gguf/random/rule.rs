//! The per-tensor type rule (a default type and `pattern=TYPE` overrides, as llama-quantize's `--tensor-type`) and
//! llama-quantize's fallbacks for tensors a type does not fit.

use crate::error::{ModelError, Result};
use crate::gguf::GgmlType;

/// Every type the generator writes: the float types and every block type ggml quantizes to.
pub const GENERATED_TYPES: &[GgmlType] = {
    use GgmlType::*;
    &[
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Iq2Xxs, Iq2Xs,
        Iq3Xxs, Iq1S, Iq4Nl, Iq3S, Iq2S, Iq4Xs, Iq1M, Tq1_0, Tq2_0, Mxfp4,
    ]
};

/// Whether `t` is a float type (stored element by element).
pub fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// The type named `s` as llama.cpp spells it (`Q4_K`, `IQ2_XS`, `f16`, case-insensitive; `Q4_K_M`-style presets are
/// not types), if the generator writes it.
pub fn parse_type(s: &str) -> Option<GgmlType> {
    GENERATED_TYPES
        .iter()
        .copied()
        .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
}

fn type_err(s: &str) -> ModelError {
    let names: Vec<String> = GENERATED_TYPES.iter().map(|t| t.name()).collect();
    ModelError::InvalidConfig(format!(
        "unknown tensor type {s:?}; one of {}",
        names.join(", ")
    ))
}

/// Whether an override's pattern matches a tensor name: it occurs in the name, as a regular expression without
/// special characters would, except that a leading `^` anchors it at the start and a trailing `$` at the end
/// (`^output.weight$` is the output head alone; `output` also matches `attn_output.weight`, as in llama-quantize).
/// Other characters are literal (`.` is a dot).
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    let (start, p) = match pattern.strip_prefix('^') {
        Some(p) => (true, p),
        None => (false, pattern),
    };
    let (end, p) = match p.strip_suffix('$') {
        Some(p) => (true, p),
        None => (false, p),
    };
    match (start, end) {
        (true, true) => name == p,
        (true, false) => name.starts_with(p),
        (false, true) => name.ends_with(p),
        (false, false) => name.contains(p),
    }
}

/// Which type each tensor is written in: `default` for every tensor llama-quantize would quantize, unless the
/// first override whose pattern matches the tensor's GGUF name ([`pattern_matches`]: a substring with optional `^` /
/// `$` anchors, where llama-quantize takes a regular expression) says otherwise. Tensors llama-quantize leaves alone (vectors, the conv kernel, the MoE
/// router) stay F32 unless an override gives them F16 or BF16.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeRule {
    /// The type of quantizable tensors no override names.
    pub default: GgmlType,
    /// `(pattern, type)` overrides, the first match wins.
    pub overrides: Vec<(String, GgmlType)>,
}

impl TypeRule {
    /// Every quantizable tensor in `default`.
    ///
    /// Errors: [`ModelError::InvalidConfig`] for a type the generator does not write (Q8_K, unknown ids).
    pub fn new(default: GgmlType) -> Result<Self> {
        if !GENERATED_TYPES.contains(&default) {
            return Err(type_err(&default.name()));
        }
        Ok(TypeRule {
            default,
            overrides: Vec::new(),
        })
    }

    /// A rule from a default type name and `PATTERN=TYPE` overrides (`ssm_alpha=F32`, `token_embd=Q8_0`).
    ///
    /// Errors: [`ModelError::InvalidConfig`] for an unknown type name, an override without `=` or with an empty
    /// pattern.
    pub fn parse(default: &str, overrides: &[String]) -> Result<Self> {
        let t = parse_type(default).ok_or_else(|| type_err(default))?;
        let mut rule = TypeRule::new(t)?;
        for o in overrides {
            let (pat, ty) = o.rsplit_once('=').ok_or_else(|| {
                ModelError::InvalidConfig(format!("tensor type override {o:?} is not PATTERN=TYPE"))
            })?;
            if pat.is_empty() {
                return Err(ModelError::InvalidConfig(format!(
                    "tensor type override {o:?} has an empty pattern"
                )));
            }
            let t = parse_type(ty).ok_or_else(|| type_err(ty))?;
            rule.overrides.push((pat.to_string(), t));
        }
        Ok(rule)
    }

    /// The type the first matching override gives `name`, if any (see [`pattern_matches`]).
    pub fn explicit(&self, name: &str) -> Option<GgmlType> {
        self.overrides
            .iter()
            .find(|(p, _)| pattern_matches(p, name))
            .map(|&(_, t)| t)
    }

    /// The rule as `DEFAULT[,PATTERN=TYPE…]` (recorded in the file's metadata).
    pub fn describe(&self) -> String {
        let mut s = self.default.name();
        for (p, t) in &self.overrides {
            s.push_str(&format!(",{p}={t}"));
        }
        s
    }
}

/// Why a tensor is not in the type its rule asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Its rows (`cols` elements) are not a whole number of the requested type's `block`-element blocks: the type
    /// llama-quantize substitutes, or F16 when that does not fit either.
    RowLength {
        /// Elements per row (`dims[0]`).
        cols: u64,
        /// Elements per block of the requested type.
        block: usize,
    },
    /// A tensor llama-quantize does not quantize (a vector, the conv kernel, the MoE router) named by an override
    /// with a quantized type: kept F32.
    NotQuantizable,
}

/// The type llama-quantize substitutes for `t` on rows that are not a whole number of its blocks (its
/// `convert_incompatible_tensor` cases); `None` where it gives up (the 32-element types: F16 here).
fn llama_quantize_substitute(t: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    match t {
        Tq1_0 | Tq2_0 => Some(Q4_0),
        Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S | Iq1S | Iq1M | Q2K | Q3K | Iq4Xs => Some(Iq4Nl),
        Q4K => Some(Q5_0),
        Q5K => Some(Q5_1),
        Q6K => Some(Q8_0),
        _ => None,
    }
}

fn fits(t: GgmlType, cols: u64) -> bool {
    t.block()
        .is_some_and(|(b, _)| cols.is_multiple_of(b as u64))
}

/// `(requested, written, fallback)` for a tensor named `name` with rows of `cols` elements; `quantizable` as
/// llama-quantize decides.
pub(super) fn choose(
    rule: &TypeRule,
    name: &str,
    cols: u64,
    quantizable: bool,
) -> (GgmlType, GgmlType, Option<Fallback>) {
    let explicit = rule.explicit(name);
    if !quantizable {
        return match explicit {
            Some(t) if is_float(t) => (t, t, None),
            Some(t) => (t, GgmlType::F32, Some(Fallback::NotQuantizable)),
            None => (GgmlType::F32, GgmlType::F32, None),
        };
    }
    let requested = explicit.unwrap_or(rule.default);
    if fits(requested, cols) {
        return (requested, requested, None);
    }
    let block = requested.block().map_or(1, |(b, _)| b);
    let written = llama_quantize_substitute(requested)
        .filter(|&s| fits(s, cols))
        .unwrap_or(GgmlType::F16);
    (
        requested,
        written,
        Some(Fallback::RowLength { cols, block }),
    )
}
