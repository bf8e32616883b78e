//! Plain words for the statuses tonic writes itself, and the details every error carries. A
//! request larger than a server's [`crate::server::MAX_MESSAGE_BYTES`] is refused by tonic's
//! decoder before any service code runs, as `OUT_OF_RANGE` "Error, decoded message length too
//! large: found … bytes, the limit is: … bytes"; [`PlainStatusLayer`] (one of every server's
//! layers) keeps the code and says what happened and what to do instead. It also gives every
//! error — a trailers-only answer (unary errors, refusals) or a stream's trailers after its
//! messages ([`DetailsBody`]) — the details of [`crate::reasons::with_details_for`]: an
//! `ErrorInfo`, a `RequestInfo` with the call's trace id, a `RetryInfo` on `UNAVAILABLE`, a
//! `LocalizedMessage` when the caller sent `accept-language`.

use std::task::{Context, Poll};

use futures::FutureExt;
use tonic::{Code, Status};

/// What tonic's decoder says of a message over the limit (its message starts so).
const TOO_LARGE: &str = "Error, decoded message length too large";

/// The plain words for tonic's own `status`, when it is one this knows.
pub fn plain(status: &Status) -> Option<Status> {
    if status.code() != Code::OutOfRange || !status.message().starts_with(TOO_LARGE) {
        return None;
    }
    // "… found {len} bytes, the limit is: {limit} bytes"
    let numbers: Vec<u64> = status
        .message()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let words = match numbers.as_slice() {
        [found, limit] => format!(
            "the request is {:.1} MiB, more than the {:.0} MiB a request may be; send a smaller \
             image (at most 10 MiB) or fewer bytes",
            mib(*found),
            mib(*limit)
        ),
        _ => "the request is larger than a request may be; send a smaller image (at most 10 MiB) \
              or fewer bytes"
            .to_owned(),
    };
    let metadata: Vec<(&str, String)> = match numbers.as_slice() {
        [found, limit] => vec![("size", found.to_string()), ("limit", limit.to_string())],
        _ => Vec::new(),
    };
    Some(crate::reasons::status(
        status.code(),
        words,
        crate::reasons::Reason::MessageTooLarge,
        &metadata,
        None,
    ))
}

/// Rewrites the statuses [`plain`] knows in a server's answers (trailers-only answers, which is
/// how tonic refuses a request before its handler runs).
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainStatusLayer;

impl<S> tower::Layer<S> for PlainStatusLayer {
    type Service = PlainStatus<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PlainStatus { inner }
    }
}

#[derive(Clone, Debug)]
pub struct PlainStatus<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for PlainStatus<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<DetailsBody<R>>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The call's span is current here (the trace layer wraps this one).
        let trace_id = crate::telemetry::current_trace_id();
        // The language the caller reads (`LocalizedMessage`).
        let language = req
            .headers()
            .get("accept-language")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.inner
            .call(req)
            .map(move |res| {
                rewrite(res, &trace_id, language.as_deref()).map(|res| {
                    // A stream's status comes in its trailers: the same details there.
                    res.map(|body| DetailsBody {
                        inner: Box::pin(body),
                        trace_id,
                        language,
                    })
                })
            })
            .boxed()
    }
}

/// A response body whose trailers (a stream's status, after its messages) get the details
/// [`rewrite`] gives a trailers-only answer.
pub struct DetailsBody<B> {
    inner: std::pin::Pin<Box<B>>,
    trace_id: String,
    language: Option<String>,
}

impl<B: http_body::Body> http_body::Body for DetailsBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match frame.into_trailers() {
                    Ok(mut trailers) => {
                        enrich(&mut trailers, &this.trace_id, this.language.as_deref());
                        http_body::Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Plain words and the common details for the status `headers` carry, if any.
fn enrich(headers: &mut http::HeaderMap, trace_id: &str, language: Option<&str>) {
    if let Some(status) = Status::from_header_map(headers) {
        let status = plain(&status).unwrap_or(status);
        let status = crate::reasons::with_details_for(status, trace_id, language);
        // Replaces `grpc-status`, `grpc-message` and `grpc-status-details-bin`.
        let _ = status.add_header(headers);
    }
}

fn rewrite<R, E>(
    res: Result<http::Response<R>, E>,
    trace_id: &str,
    language: Option<&str>,
) -> Result<http::Response<R>, E> {
    res.map(|mut res| {
        // A trailers-only answer: the status is in the headers.
        enrich(res.headers_mut(), trace_id, language);
        res
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tonic_s_words_for_a_large_message_become_plain_ones() {
        let tonic_s = Status::out_of_range(
            "Error, decoded message length too large: found 20971533 bytes, the limit is: \
             16777216 bytes",
        );
        let better = plain(&tonic_s).unwrap();
        assert_eq!(better.code(), Code::OutOfRange);
        assert_eq!(
            better.message(),
            "the request is 20.0 MiB, more than the 16 MiB a request may be; send a smaller \
             image (at most 10 MiB) or fewer bytes"
        );
        assert!(plain(&Status::out_of_range("page 9 of 3")).is_none());
        assert!(plain(&Status::invalid_argument(TOO_LARGE)).is_none());
    }

    #[test]
    fn the_answer_s_headers_are_rewritten() {
        let mut res = http::Response::new(());
        Status::out_of_range(
            "Error, decoded message length too large: found 20971533 bytes, the limit is: \
             16777216 bytes",
        )
        .add_header(res.headers_mut())
        .unwrap();
        let res = rewrite::<(), ()>(Ok(res), "4bf92f3577b34da6a3ce929d0e0e4736", None).unwrap();
        let status = Status::from_header_map(res.headers()).unwrap();
        assert_eq!(status.code(), Code::OutOfRange);
        assert!(
            status.message().starts_with("the request is 20.0 MiB"),
            "{status:?}"
        );
    }
}
