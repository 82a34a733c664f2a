//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod common;

mod http_choices;
mod http_constrain;
mod http_engine;
mod http_errors;
mod http_extras;
mod http_fields;
mod http_page;
mod http_sampling;
mod http_scripted;
mod http_slots;
