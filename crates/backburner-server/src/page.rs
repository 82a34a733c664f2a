//! `GET /`: a small chat page (one static HTML file with its script and style inline, no outside resources) that
//! streams from `/v1/chat/completions`. The page itself needs no API key (it holds no data): it asks for one and
//! sends it with its requests, which need it as any `/v1` request does.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page, embedded at build time.
const PAGE: &str = include_str!("page.html");

/// `GET /`: the chat page (`?q=text` sends `text` as the first message on load).
pub(crate) async fn handle() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            // the page only talks to this server, and runs no script but its own; no other site may frame it (it has
            // an API key field: a framing page could overlay it and take clicks or keys)
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
                 frame-ancestors 'none'",
            ),
            // the same for browsers without CSP's `frame-ancestors`
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        PAGE,
    )
        .into_response()
}
