//! Which request fields each endpoint honours. A field this server does not know, or one whose value asks for
//! something it does not do, is a 400 naming it — never silently ignored (OpenAI answers an unrecognized argument
//! the same way). Fields that only identify or label a request (`user`, `metadata`, `safety_identifier`,
//! `prompt_cache_key`) are accepted: they change nothing in an answer, here as at OpenAI.

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::Body;

/// Fields both endpoints honour (OpenAI's, and the llama-server / vLLM sampling extensions).
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "cache_prompt",
    "ignore_eos",
    "user",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "store",
    "service_tier",
    "json_schema",
    "grammar",
];

/// `/v1/chat/completions`'s own.
const CHAT: &[&str] = &[
    "messages",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "response_format",
    "modalities",
];

/// `/v1/completions`'s own.
const COMPLETIONS: &[&str] = &[
    "prompt",
    "echo",
    "best_of",
    "suffix",
    "return_token_ids",
    "response_format",
];

/// Checks a chat request's fields. Errors: 400 naming the first field not honoured.
pub fn check_chat(b: &Body) -> Result<(), ApiError> {
    known(b, CHAT)?;
    common_values(b)?;
    crate::nested::check(b.array("messages")?, b.array("tools")?)?;
    crate::nested::check_tool_choice(b.get("tool_choice"))?;
    // `response_format` is read by `constrain`
    only(
        b,
        "tool_choice",
        |v| v == "none" || v == "auto" || v == "required" || v.is_object(),
        "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}",
    )?;
    only(
        b,
        "parallel_tool_calls",
        |v| v == true,
        "only true is supported (the model may call several tools in one answer)",
    )?;
    only(
        b,
        "modalities",
        |v| v == &json!(["text"]),
        "only [\"text\"] is supported",
    )
}

/// Checks a completions request's fields. Errors: 400 naming the first field not honoured.
pub fn check_completions(b: &Body) -> Result<(), ApiError> {
    known(b, COMPLETIONS)?;
    common_values(b)?;
    only(
        b,
        "echo",
        |v| v == false,
        "only false is supported (the prompt is not echoed)",
    )?;
    only(
        b,
        "best_of",
        |v| v == 1,
        "only 1 is supported (no server-side best-of selection); use `n` for several sequences",
    )?;
    only(
        b,
        "suffix",
        |v| v == "",
        "`suffix` (fill in the middle) is not supported",
    )
}

/// Every field of the body is among `COMMON` and `own`.
fn known(b: &Body, own: &[&str]) -> Result<(), ApiError> {
    match b
        .0
        .keys()
        .find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        Some(k) => Err(ApiError::invalid(
            Some(k),
            format!(
                "unrecognized request field `{k}` (not supported by this server){}",
                hint(k)
            ),
        )),
        None => Ok(()),
    }
}

/// The common fields whose values can ask for what is not done.
fn common_values(b: &Body) -> Result<(), ApiError> {
    only(
        b,
        "store",
        |v| v == false,
        "only false is supported (nothing is stored)",
    )?;
    only(
        b,
        "prompt_cache_retention",
        |v| v == "in-memory",
        "only \"in-memory\" is supported (the prompt cache lives in the slots' memory)",
    )?;
    only(
        b,
        "service_tier",
        |v| v == "auto" || v == "default",
        "only \"auto\" and \"default\" are supported",
    )
}

/// A present, non-null `name` must satisfy `ok`; else a 400 naming it with `why`.
fn only(b: &Body, name: &str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<(), ApiError> {
    match b.get(name) {
        Some(v) if !ok(v) => Err(ApiError::invalid(
            Some(name),
            format!("`{name}`: {why}; got {v}"),
        )),
        _ => Ok(()),
    }
}

/// What a client that sent `k` most likely meant.
fn hint(k: &str) -> &'static str {
    match k {
        "prompt" => "; `prompt` belongs to /v1/completions (chat takes `messages`)",
        "messages" => "; `messages` belong to /v1/chat/completions (completions take `prompt`)",
        "repeat_penalty" => "; use `repetition_penalty`",
        "n_predict" | "max_token" | "max_new_tokens" => "; use `max_tokens`",
        "n_probs" => "; use `logprobs` (and `top_logprobs` on chat)",
        "temprature" | "temp" => "; use `temperature`",
        "top_logprobs" => "; on /v1/completions `logprobs` takes the number of alternatives",
        _ => "",
    }
}
