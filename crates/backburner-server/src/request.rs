//! Reading OpenAI request bodies field by field, so every malformed value is a 400 naming the field (serde's derive
//! would answer 422 with a generic message), and the generation settings both endpoints share.

use backburner_engine::{EngineError, SamplingParams};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// A request body: a JSON object.
pub struct Body<'a>(pub &'a Map<String, Value>);

/// Parses `bytes` as a JSON object. Errors: 400 for malformed JSON or a non-object.
pub fn parse(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid(
            None,
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::invalid(
            None,
            format!("malformed JSON in the request body: {e}"),
        )),
    }
}

fn wrong(name: &str, want: &str, got: &Value) -> ApiError {
    let kind = backburner_model::chat::json_kind(got);
    ApiError::invalid(Some(name), format!("`{name}` must be {want}, not {kind}"))
}

impl Body<'_> {
    /// The field, `None` when absent or null.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// An optional number.
    pub fn f64(&self, name: &str) -> Result<Option<f64>, ApiError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| wrong(name, "a number", v)))
            .transpose()
    }

    /// An optional integer (negative allowed).
    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_i64()
                    .or_else(|| v.as_u64().map(|u| i64::try_from(u).unwrap_or(i64::MAX)))
                    .ok_or_else(|| wrong(name, "an integer", v))
            })
            .transpose()
    }

    /// An optional integer ≥ `min`, as usize.
    pub fn count(&self, name: &str, min: i64) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            None => Ok(None),
            Some(n) if n < min => Err(ApiError::invalid(
                Some(name),
                format!("`{name}` must be ≥ {min}, not {n}"),
            )),
            Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        }
    }

    /// An optional boolean.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| wrong(name, "a boolean", v)))
            .transpose()
    }

    /// An optional string.
    pub fn str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| wrong(name, "a string", v)))
            .transpose()
    }

    /// An optional object.
    pub fn object(&self, name: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        self.get(name)
            .map(|v| v.as_object().ok_or_else(|| wrong(name, "an object", v)))
            .transpose()
    }

    /// An optional array.
    pub fn array(&self, name: &str) -> Result<Option<&Vec<Value>>, ApiError> {
        self.get(name)
            .map(|v| v.as_array().ok_or_else(|| wrong(name, "an array", v)))
            .transpose()
    }
}

/// The generation settings of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenSettings {
    /// `max_completion_tokens`, else `max_tokens` (`None`: until the context is full).
    pub max_tokens: Option<usize>,
    /// Sampling values (checked by the engine; a bad one is a 400 naming it).
    pub sampling: SamplingParams,
    /// Choices (`n`, 1 … [`backburner_engine::MAX_CHOICES`]): the prompt is prefilled once, choice `i` samples with
    /// seed `seed + i`.
    pub n: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `cache_prompt` (llama-server's field; default true): reuse the slot's cached prefix.
    pub cache_prompt: bool,
    /// `ignore_eos` (llama-server's and vLLM's field; default false): generate past the end-of-sequence tokens, up
    /// to `max_tokens` or a stop string (benchmarks use it for a fixed length).
    pub ignore_eos: bool,
    /// Log-probabilities with this many alternatives per token (set by the endpoint: chat's `logprobs` and
    /// `top_logprobs`, the legacy `logprobs`).
    pub logprobs: Option<usize>,
    /// The grammar the output must follow (set by the endpoint: `response_format`, `json_schema`, `grammar`).
    pub constraint: Option<backburner_engine::constraint::ConstraintSpec>,
}

impl GenSettings {
    /// Reads the settings shared by `/v1/chat/completions` and `/v1/completions`.
    ///
    /// Defaults as OpenAI's: temperature 1, top_p 1, no top-k or min-p, a random seed.
    pub fn read(b: &Body) -> Result<Self, ApiError> {
        let max_tokens = match b.count("max_completion_tokens", 1)? {
            Some(n) => Some(n),
            None => b.count("max_tokens", 1)?,
        };
        // several choices share the prompt's prefill; choice i samples with seed + i
        let n = b.count("n", 1)?.unwrap_or(1);
        if n > backburner_engine::MAX_CHOICES {
            return Err(ApiError::invalid(
                Some("n"),
                format!(
                    "`n` must be at most {}, not {n}",
                    backburner_engine::MAX_CHOICES
                ),
            ));
        }
        let f = |name: &str, default: f32| -> Result<f32, ApiError> {
            Ok(b.f64(name)?.map_or(default, |v| v as f32))
        };
        let top_k = match b.i64("top_k")? {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::invalid(
                    Some("top_k"),
                    format!("top_k {k} must be ≥ 0 (0 or -1 = off)"),
                ))
            }
        };
        let seed = read_seed(b)?.unwrap_or_else(rand::random);
        let sampling = SamplingParams {
            temperature: f("temperature", 1.0)?,
            top_k,
            top_p: f("top_p", 1.0)?,
            min_p: f("min_p", 0.0)?,
            seed,
            presence_penalty: f("presence_penalty", 0.0)?,
            frequency_penalty: f("frequency_penalty", 0.0)?,
            repetition_penalty: f("repetition_penalty", 1.0)?,
            logit_bias: logit_bias(b)?,
        };
        let stop = match b.get("stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| wrong("stop", "a string or an array of strings", v))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(wrong("stop", "a string or an array of strings", v)),
        };
        // the engine's limits (count and length), as a 400 naming `stop`
        backburner_engine::check_stop_strings(&stop).map_err(|e| match e {
            EngineError::InvalidInput(m) => ApiError::invalid(Some("stop"), m),
            other => ApiError::internal(other.to_string()),
        })?;
        let stream = b.bool("stream")?.unwrap_or(false);
        let include_usage = match b.object("stream_options")? {
            Some(o) => {
                if let Some(k) = o.keys().find(|k| !STREAM_OPTIONS.contains(&k.as_str())) {
                    return Err(ApiError::invalid(
                        Some("stream_options"),
                        format!(
                            "unrecognized field `{k}` in `stream_options` (known: {})",
                            STREAM_OPTIONS.join(", ")
                        ),
                    ));
                }
                let o = Body(o);
                // OpenAI pads each streamed chunk with an `obfuscation` string of random length (on by default
                // there) so that an observer of the encrypted traffic cannot tell tokens by their sizes; this server
                // sends no padding, so `true` asks for nothing it does and `false` for what it does anyway
                o.bool("include_obfuscation")
                    .map_err(|e| e.nested("stream_options"))?;
                o.bool("include_usage")
                    .map_err(|e| e.nested("stream_options"))?
                    .unwrap_or(false)
            }
            None => false,
        };
        let cache_prompt = b.bool("cache_prompt")?.unwrap_or(true);
        let ignore_eos = b.bool("ignore_eos")?.unwrap_or(false);
        Ok(GenSettings {
            ignore_eos,
            n,
            logprobs: None,
            constraint: None,
            cache_prompt,
            max_tokens,
            sampling,
            stop,
            stream,
            include_usage,
        })
    }
}

/// The keys `stream_options` may have (the `openai` SDK's).
const STREAM_OPTIONS: &[&str] = &["include_usage", "include_obfuscation"];

/// `seed`: any integer 0 … 2^64 − 1, each its own seed (the sampler's seed is a u64; choice `i` of `n` samples with
/// `seed + i`, wrapping); -1 (llama-server's) or absent is `None`, a random seed. Errors: 400 naming `seed` for
/// another negative value (OpenAI's seed is an int64, but a negative one would have to alias a seed ≥ 2^63 here, and
/// distinct seeds must sample differently) or a value that is not an integer in that range.
fn read_seed(b: &Body) -> Result<Option<u64>, ApiError> {
    let Some(v) = b.get("seed") else {
        return Ok(None);
    };
    match (v.as_u64(), v.as_i64()) {
        (Some(s), _) => Ok(Some(s)),
        (None, Some(-1)) => Ok(None),
        _ => Err(ApiError::invalid(
            Some("seed"),
            format!(
                "`seed` must be an integer from 0 to {} (or -1: random), not {v}",
                u64::MAX
            ),
        )),
    }
}

/// `logit_bias`: an object from token ids (as strings, OpenAI's shape) to biases; the values are checked by the
/// engine (−100 … 100, ids inside the vocabulary). Errors: 400 naming `logit_bias` for a key that is not an id or a
/// value that is not a number.
fn logit_bias(b: &Body) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(o) = b.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    o.iter()
        .map(|(k, v)| {
            // canonical decimal ids only (`"5"`, not `" 5"`, `"+5"` or `"05"`)
            let canonical = !k.is_empty()
                && k.bytes().all(|c| c.is_ascii_digit())
                && (k == "0" || !k.starts_with('0'));
            let id = canonical
                .then(|| k.parse::<u32>().ok())
                .flatten()
                .ok_or_else(|| {
                    ApiError::invalid(
                        Some("logit_bias"),
                        format!("`logit_bias` keys must be token ids, not {k:?}"),
                    )
                })?;
            let bias = v
                .as_f64()
                .ok_or_else(|| wrong("logit_bias", "an object of numbers", v))?;
            Ok((id, bias as f32))
        })
        .collect()
}

/// Chat's `logprobs` (boolean) and `top_logprobs` (0 … 20, only with `logprobs`), as the alternatives per token.
pub fn chat_logprobs(b: &Body) -> Result<Option<usize>, ApiError> {
    let top = b.count("top_logprobs", 0)?;
    match (b.bool("logprobs")?.unwrap_or(false), top) {
        (_, Some(n)) if n > backburner_engine::MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            Some("top_logprobs"),
            format!("`top_logprobs` must be at most 20, not {n}"),
        )),
        (false, Some(_)) => Err(ApiError::invalid(
            Some("top_logprobs"),
            "`top_logprobs` needs `logprobs` set to true",
        )),
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

/// The legacy completions `logprobs` (0 … 20 alternatives per token; OpenAI allows 5, vLLM more).
pub fn legacy_logprobs(b: &Body) -> Result<Option<usize>, ApiError> {
    match b.count("logprobs", 0)? {
        Some(n) if n > backburner_engine::MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            Some("logprobs"),
            format!("`logprobs` must be at most 20, not {n}"),
        )),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GenSettings::read` of the JSON object `body`.
    fn read(body: &str) -> Result<GenSettings, ApiError> {
        GenSettings::read(&Body(&parse(body.as_bytes()).unwrap()))
    }

    #[test]
    fn every_u64_seed_is_its_own() {
        for (text, want) in [
            ("0", 0),
            ("7", 7),
            ("9223372036854775807", (1 << 63) - 1),
            ("9223372036854775808", 1 << 63),
            ("18446744073709551614", u64::MAX - 1),
            ("18446744073709551615", u64::MAX),
        ] {
            let g = read(&format!(r#"{{"seed": {text}}}"#)).unwrap();
            assert_eq!(g.sampling.seed, want, "{text}");
        }
        // -1 (llama-server's) and no seed: random, so two requests differ (all but surely)
        for body in [r#"{"seed": -1}"#, "{}", r#"{"seed": null}"#] {
            assert_ne!(
                read(body).unwrap().sampling.seed,
                read(body).unwrap().sampling.seed,
                "{body}"
            );
        }
        // other negatives (they would alias seeds ≥ 2^63), 2^64 and non-integers: 400 naming `seed`
        for text in [
            "-2",
            "-9223372036854775808",
            "18446744073709551616",
            "1.5",
            "1e3",
            "\"7\"",
        ] {
            let e = read(&format!(r#"{{"seed": {text}}}"#)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("seed"), "{text}");
            assert!(
                e.message
                    .starts_with("`seed` must be an integer from 0 to 18446744073709551615 (or -1: random), not "),
                "{text}: {}",
                e.message
            );
        }
    }

    #[test]
    fn stream_options_take_the_sdks_keys() {
        for (opts, usage) in [
            (
                r#"{"include_usage": true, "include_obfuscation": false}"#,
                true,
            ),
            (
                r#"{"include_usage": false, "include_obfuscation": true}"#,
                false,
            ),
            (r#"{"include_obfuscation": true}"#, false),
            (
                r#"{"include_usage": true, "include_obfuscation": null}"#,
                true,
            ),
        ] {
            let g = read(&format!(r#"{{"stream": true, "stream_options": {opts}}}"#)).unwrap();
            assert_eq!(g.include_usage, usage, "{opts}");
        }
        let e = read(r#"{"stream_options": {"include_obfuscation": "no"}}"#).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("stream_options.include_obfuscation")
        );
        let e = read(r#"{"stream_options": {"include_usage": true, "pad": 1}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        assert_eq!(
            e.message,
            "unrecognized field `pad` in `stream_options` (known: include_usage, include_obfuscation)"
        );
    }
}
