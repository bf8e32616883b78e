//! Request handlers, one module per area.

pub(crate) mod account;
pub(crate) mod health;
pub(crate) mod scan;

use axum::{
    http::{Method, Uri},
    response::Html,
};

use crate::error::ApiError;

/// The demo page: pick a photo, watch the scan stream in.
pub(crate) async fn index() -> Html<&'static str> {
    Html(include_str!("../../static/index.html"))
}

pub(crate) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}
