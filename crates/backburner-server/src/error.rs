//! Errors in the OpenAI error shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that
//! OpenAI's API uses for each kind.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use backburner_engine::serve::SubmitError;
use backburner_engine::EngineError;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// Human-readable message.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, `invalid_api_key`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// With a code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The same error about a field of the object `parent` (`param` `x` becomes `parent.x`).
    pub fn nested(mut self, parent: &str) -> Self {
        self.param = Some(match self.param.take() {
            Some(p) => format!("{parent}.{p}"),
            None => parent.to_string(),
        });
        self
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: "invalid or missing API key (send `Authorization: Bearer <key>`)".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404: a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "the model `{asked}` does not exist here; this server serves `{served}`"
            ),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 503: busy or shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("server_busy"),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        ApiError::unavailable(e.to_string())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match &e {
            EngineError::ContextOverflow { .. } => {
                ApiError::invalid(Some("messages"), e.to_string())
                    .with_code("context_length_exceeded")
            }
            EngineError::InvalidInput(m) => {
                let param = [
                    "temperature",
                    "top_p",
                    "min_p",
                    "top_k",
                    "stop",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                    "logit_bias",
                    "token id",
                ]
                .into_iter()
                .find(|p| m.starts_with(p))
                .map(|p| if p == "token id" { "prompt" } else { p });
                ApiError::invalid(param, e.to_string())
            }
            EngineError::EmptyPrompt => ApiError::invalid(Some("prompt"), e.to_string()),
            EngineError::ShuttingDown => ApiError::unavailable(e.to_string()),
            // A worker the request needs (its layers, experts or pages) is gone after its retry: a 503 that says so,
            // not `server_busy` (waiting does not help until the worker is back), and not a 500 (nothing is broken here).
            // `KvBudget`: no KV-offload worker could take the pages the request must move (the session keeps its
            // tokens, as after a lost layer-split worker)
            EngineError::ExpertsLost { .. }
            | EngineError::WorkerLost { .. }
            | EngineError::WorkerUnavailable { .. }
            | EngineError::KvBudget { .. } => {
                ApiError::unavailable(e.to_string()).with_code("worker_unavailable")
            }
            _ => ApiError::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_the_request_needs_is_a_503_worker_unavailable() {
        let kv = EngineError::KvBudget {
            budget: 128,
            need: 200,
            why: "worker 10.0.0.2:50060: connection refused".into(),
        };
        let e = ApiError::from(kv);
        assert_eq!(
            (e.status, e.kind, e.code),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("worker_unavailable")
            )
        );
        assert_eq!(
            e.message,
            "KV budget exceeded: 200 positions of KV cache would be on this host but --kv-budget allows 128: \
             worker 10.0.0.2:50060: connection refused"
        );
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
