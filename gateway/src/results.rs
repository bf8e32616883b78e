//! Finished scans' results, kept ready to serve. A succeeded scan's result never changes (its
//! job is never run again), so the gateway keeps its JSON and a strong `ETag` in a bounded
//! in-memory cache and serves it without calling ingest: `Cache-Control: private, max-age=…,
//! immutable` lets the caller's own browser keep it too, and `If-None-Match` is answered with
//! `304`. An entry is keyed by (user, job) and filled only from an answer ingest gave that
//! user, so a hit is exactly what ingest would answer the same caller: nobody reads from the
//! cache what they could not read from ingest.
//!
//! A failed result is not kept: an operator may requeue a dead-lettered job, after which it
//! runs again. It still carries an `ETag` (`no-cache`: revalidate every time), and a pending
//! one keeps its `202` + `Retry-After`.

use std::{
    hash::{Hash, Hasher},
    sync::Arc,
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

/// A finished result as served: its JSON and its `ETag`.
pub(crate) struct Finished {
    body: Bytes,
    etag: HeaderValue,
}

impl Finished {
    pub(crate) fn new(body: Bytes) -> Self {
        let etag = etag_of(&body);
        Self { body, etag }
    }
}

/// Succeeded results by (user, job), bounded by their bytes.
#[derive(Clone)]
pub(crate) struct ResultCache {
    entries: moka::future::Cache<(String, String), Arc<Finished>>,
    /// `Cache-Control` of a kept result: how long a browser may keep it, as we do.
    cache_control: HeaderValue,
}

impl ResultCache {
    /// At most `max_bytes` of results (keys included), each kept at most `ttl`.
    pub(crate) fn new(max_bytes: u64, ttl: Duration) -> Self {
        let entries = moka::future::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|(user, job): &(String, String), v: &Arc<Finished>| {
                u32::try_from(user.len() + job.len() + v.body.len()).unwrap_or(u32::MAX)
            })
            .time_to_live(ttl)
            .build();
        let cache_control =
            HeaderValue::from_str(&format!("private, max-age={}, immutable", ttl.as_secs()))
                .expect("a valid header value");
        Self {
            entries,
            cache_control,
        }
    }

    /// The kept result of `job` for `user`, if any.
    pub(crate) async fn get(&self, user: &str, job: &str) -> Option<Arc<Finished>> {
        self.entries.get(&(user.to_owned(), job.to_owned())).await
    }

    /// Keeps a succeeded result that ingest gave `user`.
    pub(crate) async fn keep(&self, user: &str, job: &str, finished: Arc<Finished>) {
        self.entries
            .insert((user.to_owned(), job.to_owned()), finished)
            .await;
    }

    /// The answer for a kept (succeeded) result: `200` with it, or `304` when the caller's
    /// `If-None-Match` names it.
    pub(crate) fn answer(&self, finished: &Finished, request: &HeaderMap) -> Response {
        answer(finished, request, self.cache_control.clone())
    }
}

/// The answer for a failed result, which is not kept: revalidated on every use.
pub(crate) fn answer_uncached(finished: &Finished, request: &HeaderMap) -> Response {
    answer(
        finished,
        request,
        HeaderValue::from_static("private, no-cache"),
    )
}

/// The answer for what is the same for every caller (the taxonomy): `200`, or `304` when the
/// caller's `If-None-Match` names it; shared caches may keep it for `cache_control`.
pub(crate) fn answer_public(
    finished: &Finished,
    request: &HeaderMap,
    cache_control: HeaderValue,
) -> Response {
    respond(finished, request, cache_control, None)
}

fn answer(finished: &Finished, request: &HeaderMap, cache_control: HeaderValue) -> Response {
    // Per caller: a browser that switches accounts must not reuse another's answer.
    let vary = HeaderValue::from_static("authorization");
    respond(finished, request, cache_control, Some(vary))
}

fn respond(
    finished: &Finished,
    request: &HeaderMap,
    cache_control: HeaderValue,
    vary: Option<HeaderValue>,
) -> Response {
    let mut headers = HeaderMap::new();
    headers.insert(header::ETAG, finished.etag.clone());
    headers.insert(header::CACHE_CONTROL, cache_control);
    if let Some(vary) = vary {
        headers.insert(header::VARY, vary);
    }
    if matches_etag(request, &finished.etag) {
        return (StatusCode::NOT_MODIFIED, headers).into_response();
    }
    let mut res = (StatusCode::OK, headers, Body::from(finished.body.clone())).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// Whether `If-None-Match` names `etag` (or is `*`): a list of entity tags, weak ones compared
/// weakly, as RFC 9110 says for `If-None-Match`.
fn matches_etag(request: &HeaderMap, etag: &HeaderValue) -> bool {
    let ours = etag.as_bytes();
    request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .any(|tag| tag == "*" || tag.trim_start_matches("W/").as_bytes() == ours)
}

/// A strong `ETag` of `body`: its length and a 64-bit hash of its bytes (the same bytes give
/// the same tag in every gateway replica; SipHash with fixed keys is stable across processes).
fn etag_of(body: &[u8]) -> HeaderValue {
    #[allow(
        deprecated,
        reason = "SipHasher is the stable, keyed-by-zero hash we want here"
    )]
    let mut hasher = std::hash::SipHasher::new();
    body.hash(&mut hasher);
    HeaderValue::from_str(&format!("\"{:016x}-{:x}\"", hasher.finish(), body.len()))
        .expect("hex digits are a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_if_none_match(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn the_etag_is_strong_stable_and_names_the_bytes() {
        let a = etag_of(b"{\"a\":1}");
        assert_eq!(a, etag_of(b"{\"a\":1}"));
        assert_ne!(a, etag_of(b"{\"a\":2}"));
        let text = a.to_str().unwrap();
        assert!(text.starts_with('"') && text.ends_with('"') && !text.starts_with("W/"));
    }

    #[test]
    fn if_none_match_is_a_list_and_weak_tags_compare_weakly() {
        let etag = etag_of(b"x");
        let tag = etag.to_str().unwrap().to_owned();
        assert!(matches_etag(&with_if_none_match(&tag), &etag));
        assert!(matches_etag(
            &with_if_none_match(&format!("\"other\", {tag}")),
            &etag
        ));
        assert!(matches_etag(
            &with_if_none_match(&format!("W/{tag}")),
            &etag
        ));
        assert!(matches_etag(&with_if_none_match("*"), &etag));
        assert!(!matches_etag(&with_if_none_match("\"other\""), &etag));
        assert!(!matches_etag(&HeaderMap::new(), &etag));
    }
}
