//! The deadline a gRPC caller sets on its call (`grpc-timeout`), read the same way by every
//! server and by the in-process calls of [`crate::local`].

use std::time::Duration;

/// The `grpc-timeout` of a request's headers, as a duration from now.
pub(crate) fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    timeout_value(headers.get("grpc-timeout")?.to_str().ok()?)
}

fn timeout_value(value: &str) -> Option<Duration> {
    // At most 8 digits and one unit letter, by the gRPC spec.
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long before the caller's deadline the server answers `DEADLINE_EXCEEDED` itself: tonic's
/// server bounds the call by the same `grpc-timeout` from a moment earlier (outside every layer
/// of ours) and answers `CANCELLED` "Timeout expired" there, which neither the RPC span nor the
/// metrics see; the caller's own timer started earlier still. Ending first, a little ahead,
/// the answer is ours: `DEADLINE_EXCEEDED` on the wire, in the metric and in the span.
const AHEAD: Duration = Duration::from_millis(5);

/// Tells a call's two ends that are no failure of the server apart, for the RPC span, the
/// metrics and the caller:
///
/// - a `grpc-timeout` that runs out before the response begins, wherever the handler is
///   (reading the request's body included), is answered `DEADLINE_EXCEEDED` with the reason;
/// - a request body that breaks (the caller reset its stream or dropped the connection while
///   its request was read) ends the call `CANCELLED`, whatever the handler made of the broken
///   body (tonic says `INTERNAL` or `UNKNOWN`, which would count as the server failing).
///
/// A response that began is the handler's to end: a server stream bounds itself
/// ([`crate::server::call_timeout`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CallEndLayer;

impl<S> tower::Layer<S> for CallEndLayer {
    type Service = CallEnd<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallEnd { inner }
    }
}

/// The service [`CallEndLayer`] makes.
#[derive(Clone, Debug)]
pub(crate) struct CallEnd<S> {
    inner: S,
}

impl<S, B, ResB> tower::Service<http::Request<B>> for CallEnd<S>
where
    S: tower::Service<http::Request<CallerBody<B>>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
    ResB: Default,
{
    type Response = http::Response<ResB>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let timeout = grpc_timeout(req.headers());
        let left = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let req = req.map(|body| CallerBody {
            body: Box::pin(body),
            left: left.clone(),
        });
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = match timeout {
                None => response.await?,
                Some(timeout) => {
                    match tokio::time::timeout(timeout.saturating_sub(AHEAD), response).await {
                        Ok(response) => response?,
                        Err(_) => {
                            return Ok(tonic::Status::deadline_exceeded(format!(
                                "the call's deadline ({} ms) ran out before it was answered",
                                timeout.as_millis()
                            ))
                            .into_http());
                        }
                    }
                }
            };
            let failed = response
                .headers()
                .get("grpc-status")
                .is_some_and(|v| v.as_bytes() != b"0");
            if failed && left.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(tonic::Status::cancelled(
                    "the caller left before its request arrived whole",
                )
                .into_http());
            }
            Ok(response)
        })
    }
}

/// A request body that notes whether it broke (see [`CallEndLayer`]).
pub(crate) struct CallerBody<B> {
    body: std::pin::Pin<Box<B>>,
    left: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<B: http_body::Body> http_body::Body for CallerBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = self.body.as_mut().poll_frame(cx);
        if let std::task::Poll::Ready(Some(Err(_))) = &frame {
            self.left.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tower::{Layer as _, ServiceExt as _};

    use super::{CallEndLayer, CallerBody};

    /// A handler that answers `OK` after `delay` (still reading its request, say).
    fn slow(
        delay: Duration,
    ) -> impl tower::Service<
        http::Request<CallerBody<()>>,
        Response = http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
        Future = impl Future + Send + 'static,
    > + Clone {
        tower::service_fn(move |_req: http::Request<CallerBody<()>>| async move {
            tokio::time::sleep(delay).await;
            Ok::<_, std::convert::Infallible>(tonic::Status::ok("").into_http())
        })
    }

    fn request(timeout: Option<&str>) -> http::Request<()> {
        let mut req = http::Request::new(());
        if let Some(t) = timeout {
            req.headers_mut()
                .insert("grpc-timeout", http::HeaderValue::from_str(t).unwrap());
        }
        req
    }

    fn status(res: &http::Response<tonic::body::Body>) -> tonic::Status {
        tonic::Status::from_header_map(res.headers()).expect("a grpc-status")
    }

    #[tokio::test]
    async fn a_deadline_that_runs_out_is_deadline_exceeded_with_a_reason() {
        let started = Instant::now();
        let res = CallEndLayer
            .layer(slow(Duration::from_secs(5)))
            .oneshot(request(Some("100m")))
            .await
            .unwrap();
        let status = status(&res);
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().contains("100 ms"), "{status:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(90) && took < Duration::from_millis(100),
            "ahead of the caller's deadline: {took:?}"
        );
    }

    #[tokio::test]
    async fn a_call_within_its_deadline_or_without_one_is_the_handlers() {
        for timeout in [Some("5S"), None] {
            let res = CallEndLayer
                .layer(slow(Duration::from_millis(20)))
                .oneshot(request(timeout))
                .await
                .unwrap();
            assert_eq!(status(&res).code(), tonic::Code::Ok, "{timeout:?}");
        }
    }

    type Broken = http_body_util::StreamBody<
        futures::stream::Iter<
            std::vec::IntoIter<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>,
        >,
    >;

    fn body(frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>) -> Broken {
        http_body_util::StreamBody::new(futures::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_caller_that_left_while_its_request_was_read_is_cancelled() {
        use http_body_util::BodyExt as _;
        // A handler as tonic's: a body that breaks is its INTERNAL; what it read, its verdict.
        let handler = tower::service_fn(|req: http::Request<CallerBody<Broken>>| async move {
            let status = match req.into_body().collect().await {
                Ok(_) => tonic::Status::invalid_argument("not an image"),
                Err(e) => tonic::Status::internal(e.to_string()),
            };
            Ok::<_, std::convert::Infallible>(status.into_http::<tonic::body::Body>())
        });
        let part = || Ok(http_body::Frame::data(bytes::Bytes::from_static(b"\0\0\0")));
        let reset = Err(std::io::Error::other("stream reset"));
        let left = CallEndLayer
            .layer(handler)
            .oneshot(http::Request::new(body(vec![part(), reset])))
            .await
            .unwrap();
        assert_eq!(status(&left).code(), tonic::Code::Cancelled);
        let whole = CallEndLayer
            .layer(handler)
            .oneshot(http::Request::new(body(vec![part()])))
            .await
            .unwrap();
        assert_eq!(status(&whole).code(), tonic::Code::InvalidArgument);
    }
}
