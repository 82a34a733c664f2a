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
        // -1, as in llama-server, is a random seed too
        let seed = match b.i64("seed")? {
            Some(-1) | None => rand::random(),
            Some(s) => u64::from_le_bytes(s.to_le_bytes()),
        };
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
            Some(o) if o.keys().any(|k| k != "include_usage") => {
                let k = o.keys().find(|k| *k != "include_usage").expect("found");
                return Err(ApiError::invalid(
                    Some("stream_options"),
                    format!("unrecognized field `{k}` in `stream_options` (only `include_usage`)"),
                ));
            }
            Some(o) => Body(o)
                .bool("include_usage")
                .map_err(|e| e.nested("stream_options"))?
                .unwrap_or(false),
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
