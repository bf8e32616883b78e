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
#[utoipa::path(
    get,
    path = "/",
    tag = "operations",
    operation_id = "demoPage",
    summary = "The demo page",
    description = "An HTML page that submits a photo and shows its scan's events as they stream.",
    responses(
        (status = 200, description = "The page.", body = String, content_type = "text/html"),
        (status = 503, response = crate::openapi::Unavailable),
    ),
)]
pub(crate) async fn index() -> Html<&'static str> {
    Html(include_str!("../../static/index.html"))
}

pub(crate) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}
