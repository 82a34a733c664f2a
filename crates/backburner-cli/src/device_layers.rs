//! `--device-layers N|all|-1|auto` (llama.cpp's `-ngl`), `auto`'s sizing against the device's free memory (the
//! computation of `plan --device`: weights, KV or state at the command's context, the reserve), and the sizes
//! `--device-memory` takes (a bare number under 1 MiB is refused as a forgotten unit).

use std::path::Path;
use std::sync::Arc;

use backburner_engine::plan::{fit_layers, DeviceLoad, FitStop, ModelCosts};
use backburner_model::device::{Backend, DeviceId};

use crate::device_args::{gib, DeviceFlagError};

/// How many of the model's first layers `--device-layers` puts on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceLayers {
    /// The first N (more than the model has: all of them; 0: none).
    Count(usize),
    /// Every layer: `all`, or llama.cpp's `-1`.
    All,
    /// As many leading layers as fit the device's free memory with their KV or state at the command's context and
    /// the device's reserve ([`auto_layers`]), chosen once the device is open and the model's config known.
    Auto,
}

/// Why a `--device-layers` value is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceLayersError {
    /// A negative count other than -1.
    #[error(
        "{0} is not a layer count: -1 (as llama.cpp's -ngl -1) or `all` puts every layer on the device; give N ≥ 0, \
         all, -1 or auto"
    )]
    Negative(String),
    /// Anything else that is not a count, `all`, `-1` or `auto`.
    #[error(
        "{0:?} is not a layer count: give N (the first N layers), all or -1 (every layer) or auto (as many as fit \
         the device's free memory)"
    )]
    NotACount(String),
}

/// Parses `--device-layers`: `N` (≥ 0), `all` or `-1` (every layer), `auto`; case-insensitive.
///
/// Errors: [`DeviceLayersError::Negative`] for another negative number, [`DeviceLayersError::NotACount`] for the
/// rest (a count past `usize` included).
pub fn parse_device_layers(s: &str) -> Result<DeviceLayers, DeviceLayersError> {
    let t = s.trim();
    match t.to_ascii_lowercase().as_str() {
        "all" | "-1" => return Ok(DeviceLayers::All),
        "auto" => return Ok(DeviceLayers::Auto),
        _ => {}
    }
    if let Some(neg) = t.strip_prefix('-') {
        if !neg.is_empty() && neg.bytes().all(|b| b.is_ascii_digit()) {
            return Err(DeviceLayersError::Negative(t.to_string()));
        }
    }
    t.parse::<usize>()
        .map(DeviceLayers::Count)
        .map_err(|_| DeviceLayersError::NotACount(s.to_string()))
}

/// The smallest byte size `--device-memory` takes without a unit: below it a bare number is a forgotten unit.
pub const BARE_BYTES_MIN: u64 = 1 << 20;

/// Why a `--device-memory` value is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMemoryError {
    /// A number without a unit below [`BARE_BYTES_MIN`].
    #[error(
        "{n} without a unit is {n} bytes, too little for a device: give a unit, e.g. {n}G ({n} GiB) or {n}GB \
         ({n}·10^9 bytes)"
    )]
    BareNumber {
        /// The number given.
        n: u64,
    },
    /// Not a byte size (`backburner_engine::offload::parse_bytes`'s message).
    #[error("{0}")]
    NotASize(String),
}

/// Parses a device's memory: a byte size as `--max-memory` takes it (`80G`, `80GiB`, `141GB`, `512M`, …;
/// `backburner_engine::offload::parse_bytes`), refusing a bare number under [`BARE_BYTES_MIN`] (`80` is 80 bytes,
/// almost surely a forgotten `G`). Errors: [`DeviceMemoryError`].
pub fn parse_device_memory(s: &str) -> Result<u64, DeviceMemoryError> {
    let b = backburner_engine::offload::parse_bytes(s).map_err(DeviceMemoryError::NotASize)?;
    let t = s.trim();
    if b < BARE_BYTES_MIN && !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit()) {
        return Err(DeviceMemoryError::BareNumber { n: b });
    }
    Ok(b)
}

/// What `--device-layers auto` sizes the device's layers for.
#[derive(Clone, Copy, Debug)]
pub struct AutoSizing<'a> {
    /// The model (directory or GGUF file): its config and stored tensor sizes are read, not its weights.
    pub dir: &'a Path,
    /// The KV cache's dtype.
    pub kv: backburner_kernels::kv::KvDtype,
    /// The command's context in tokens (`None`: the model's `max_position_embeddings`).
    pub ctx: Option<usize>,
    /// Sequences held at once, each with its own KV and state (`serve`'s `--parallel`; 1 otherwise).
    pub sequences: usize,
    /// Tokens per prefill ubatch (the reserve's activations).
    pub ubatch: usize,
}

/// `auto`'s choice: how many layers, and the line that says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoChoice {
    /// Leading layers on the device.
    pub layers: usize,
    /// `--device-layers auto: 41 of 64 layers fit cuda:0's 22.10 GiB free at 8192 positions (…)`.
    pub line: String,
}

/// How many leading layers fit `free` bytes of `device` (the computation of `plan --device`: each layer's weights
/// plus, per sequence, its KV at the context or its state, after the device's reserve), and the line saying so.
///
/// Errors: [`DeviceFlagError::Auto`] when the model's sizes cannot be read.
pub fn auto_layers(
    device: DeviceId,
    free: u64,
    s: &AutoSizing,
) -> Result<AutoChoice, DeviceFlagError> {
    let (config, costs) = ModelCosts::from_dir(s.dir, s.kv).map_err(|e| DeviceFlagError::Auto {
        device,
        why: format!("cannot size the model in {}: {e}", s.dir.display()),
    })?;
    let positions = s
        .ctx
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings);
    let load = DeviceLoad {
        config: &config,
        costs: &costs,
        memory: free,
        positions,
        sequences: s.sequences.max(1),
        ubatch: s.ubatch,
    };
    let n = costs.n_layers();
    let f = fit_layers(&load, 0..n);
    let k = f.layers.len();
    let slots = match s.sequences {
        0 | 1 => String::new(),
        q => format!(" × {q} slots"),
    };
    let how = if k == n {
        format!("all {n} layers fit")
    } else {
        format!("{k} of {n} layers fit")
    };
    let head = if f.head_bytes > 0 {
        format!(" with the head's {}", gib(f.head_bytes))
    } else {
        String::new()
    };
    let mut line = format!(
        "--device-layers auto: {how} {device}'s {} free at {positions} positions{slots} (weights {}{head}, KV and \
         state {}, reserve {} for the runtime and a ubatch's activations",
        gib(free),
        gib(f.weight_bytes.saturating_add(f.head_bytes)),
        gib(f.kv_bytes.saturating_add(f.state_bytes)),
        gib(f.reserve_bytes)
    );
    match f.stop {
        FitStop::AllFit => line.push(')'),
        FitStop::Moe { layer } => line.push_str(&format!(
            "; layer {layer} is a mixture-of-experts layer, which does not run on a device yet)"
        )),
        FitStop::Head { need, left } => line.push_str(&format!(
            "; every layer fits but not the output head that goes with them ({} needed, {} left): the last layer \
             and the head stay on the CPU)",
            gib(need),
            gib(left)
        )),
        FitStop::Memory { .. } if f.reserve_bytes >= free => {
            line.push_str("; the reserve alone takes all of it)")
        }
        FitStop::Memory { layer, need, left } => {
            // a shorter context frees KV only where an attention layer is among those placed or the next
            let kv = config
                .layer_types
                .iter()
                .take(layer.saturating_add(1))
                .any(|k| *k == backburner_model::LayerKind::FullAttention);
            let hint = if kv {
                "; a shorter context leaves room for more"
            } else {
                ""
            };
            line.push_str(&format!(
                "; layer {layer} needs {}, {} left{hint})",
                gib(need),
                gib(left)
            ))
        }
    }
    if k == 0 {
        line.push_str(": every layer runs on the CPU");
    }
    Ok(AutoChoice { layers: k, line })
}

impl crate::ModelArgs {
    /// The count of layers [`crate::device_args::place`] puts on `backend` (`None`: all) for the model in `dir`:
    /// `--device-layers N` is N, `all`, `-1` and no flag all; `auto` is sized by [`auto_layers`] against the
    /// device's free memory (`--device-free-memory` when given, else what the backend reports, else its memory) at
    /// `ctx` (`None`: the model's context) for `sequences` sequences, and its line printed on stderr. Without a
    /// backend (`--device cpu`) nothing is placed: `None`.
    ///
    /// Errors: [`DeviceFlagError::Auto`] when the model's sizes cannot be read.
    pub fn device_layer_count(
        &self,
        backend: Option<&Arc<dyn Backend>>,
        dir: &Path,
        ctx: Option<usize>,
        sequences: usize,
    ) -> Result<Option<usize>, DeviceFlagError> {
        let Some(b) = backend else {
            return Ok(None);
        };
        match self.device.device_layers {
            Some(DeviceLayers::Count(n)) => Ok(Some(n)),
            None | Some(DeviceLayers::All) => Ok(None),
            Some(DeviceLayers::Auto) => {
                let info = b.info();
                let free = self
                    .device
                    .device_free_memory
                    .unwrap_or(info.free_bytes.unwrap_or(info.memory_bytes));
                let sizing = AutoSizing {
                    dir,
                    kv: self.kv_dtype,
                    ctx,
                    sequences,
                    ubatch: self.ubatch,
                };
                let choice = auto_layers(info.id, free, &sizing)?;
                eprintln!("{}", choice.line);
                Ok(Some(choice.layers))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_layers_take_counts_all_minus_one_and_auto() {
        assert_eq!(parse_device_layers("99"), Ok(DeviceLayers::Count(99)));
        assert_eq!(parse_device_layers("0"), Ok(DeviceLayers::Count(0)));
        assert_eq!(parse_device_layers("all"), Ok(DeviceLayers::All));
        assert_eq!(parse_device_layers("ALL"), Ok(DeviceLayers::All));
        assert_eq!(parse_device_layers("-1"), Ok(DeviceLayers::All));
        assert_eq!(parse_device_layers("auto"), Ok(DeviceLayers::Auto));
        assert_eq!(
            parse_device_layers("-2"),
            Err(DeviceLayersError::Negative("-2".into()))
        );
        let e = parse_device_layers("-2").unwrap_err().to_string();
        assert!(
            e.starts_with("-2 is not a layer count: -1 (as llama.cpp's -ngl -1) or `all`"),
            "{e}"
        );
        for bad in ["x", "", "1.5", "-", "--1", "99999999999999999999999"] {
            assert_eq!(
                parse_device_layers(bad),
                Err(DeviceLayersError::NotACount(bad.into())),
                "{bad}"
            );
        }
        let e = parse_device_layers("x").unwrap_err().to_string();
        assert_eq!(
            e,
            "\"x\" is not a layer count: give N (the first N layers), all or -1 (every layer) or auto (as many as \
             fit the device's free memory)"
        );
    }

    #[test]
    fn device_memory_refuses_a_bare_small_number_and_keeps_units() {
        assert_eq!(
            parse_device_memory("80"),
            Err(DeviceMemoryError::BareNumber { n: 80 })
        );
        assert_eq!(
            parse_device_memory("80").unwrap_err().to_string(),
            "80 without a unit is 80 bytes, too little for a device: give a unit, e.g. 80G (80 GiB) or 80GB \
             (80·10^9 bytes)"
        );
        assert_eq!(
            parse_device_memory("1048575"),
            Err(DeviceMemoryError::BareNumber { n: 1_048_575 })
        );
        assert_eq!(parse_device_memory("1048576"), Ok(1 << 20));
        assert_eq!(parse_device_memory("80G"), Ok(80 << 30));
        assert_eq!(parse_device_memory("80GiB"), Ok(80 << 30));
        assert_eq!(parse_device_memory("141GB"), Ok(141_000_000_000));
        assert_eq!(parse_device_memory("512m"), Ok(512 << 20));
        // a unit says the bytes are meant
        assert_eq!(parse_device_memory("80B"), Ok(80));
        assert!(matches!(
            parse_device_memory("80 XB"),
            Err(DeviceMemoryError::NotASize(_))
        ));
    }
}
