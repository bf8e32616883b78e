//! Request handlers, one module per area.

pub(crate) mod account;
pub(crate) mod catalogue;
pub(crate) mod health;
pub(crate) mod scan;
pub(crate) mod uploads;

use axum::{
    extract::State,
    http::{Method, Uri},
    response::Html,
};

use crate::{AppState, error::ApiError, schema::Unavailable};

/// The demo page: pick a photo, watch the scan stream in (`gateway/static/index.html`).
#[utoipa::path(
    get,
    path = "/",
    tag = "operations",
    operation_id = "demoPage",
    summary = "The demo page",
    description = "A self-contained HTML page, in Korean and English, that submits a photo and \
                   shows its scan as it streams (stages, answer, classification, disposal rules, \
                   the character granted), the caller's collection and notifications live.",
    responses(
        (status = 200, description = "The page.", body = String, content_type = "text/html"),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn index(State(state): State<AppState>) -> Html<String> {
    Html(render_index(state.config.jaeger_url.as_deref()))
}

/// The page's placeholder for the Jaeger UI's address, filled from `GATEWAY_JAEGER_URL`.
const JAEGER_META: &str = r#"<meta name="ecoscan-jaeger-url" content="">"#;

/// The demo page with the deployment's settings filled in.
fn render_index(jaeger_url: Option<&str>) -> String {
    let page = include_str!("../../static/index.html");
    match jaeger_url {
        Some(url) => page.replacen(
            JAEGER_META,
            &format!(
                r#"<meta name="ecoscan-jaeger-url" content="{}">"#,
                escape_attribute(url)
            ),
            1,
        ),
        None => page.to_owned(),
    }
}

/// `value` safe inside a double-quoted HTML attribute.
fn escape_attribute(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    out
}

pub(crate) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_the_jaeger_placeholder_it_fills() {
        assert!(include_str!("../../static/index.html").contains(JAEGER_META));
        assert!(render_index(None).contains(JAEGER_META));
    }

    #[test]
    fn render_index_puts_the_jaeger_url_in_the_page_escaped() {
        let page = render_index(Some("http://jaeger.example:16686/?a=1&b=\"<x>"));
        assert!(page.contains(
            r#"<meta name="ecoscan-jaeger-url" content="http://jaeger.example:16686/?a=1&amp;b=&quot;&lt;x&gt;">"#
        ));
        assert!(!page.contains(JAEGER_META));
    }
}
