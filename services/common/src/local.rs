//! In-process calls between services that share a process (`ecoscan up`).
//!
//! Every service of `ecoscan up` listens on its own loopback port and the others call it with
//! the same gRPC clients as when deployed apart. Between two services of one process, HTTP/2 is
//! pure cost: every message is framed, written into a connection, read back, parsed and routed,
//! with a hop through each side's connection task. Here a call to an address *offered* in this
//! process ([`offer`]) hands its `http::Request` straight to that server's service stack: the
//! same tonic codec (messages are still encoded and decoded), the same layers (a span per RPC,
//! RED metrics, identity assertions, the routes), and what tonic's server adds around them (a
//! deadline from `grpc-timeout`, errors turned into statuses, graceful drain), but no framing,
//! no connection and no task in between. Streams flow through `http_body` frames; dropping a
//! response body cancels the call as a reset stream would.
//!
//! Only addresses offered explicitly take this path, and only in plaintext (a process with
//! `GRPC_TLS_*` set keeps TLS on every call). The TCP listener stays open beside it, so
//! `grpcurl`, probes and callers in other processes reach the service as before.
//! `ECOSCAN_LOCAL_CALLS=tcp` turns the in-process path off (to capture the calls with `tshark`,
//! say).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        LazyLock, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tonic::{ConnectError, TimeoutExpired, body::Body, transport::server::TcpConnectInfo};
use tower::{BoxError, Service, ServiceExt as _, util::BoxCloneSyncService};

/// The variable that turns in-process calls off (`tcp`).
pub const LOCAL_CALLS_VAR: &str = "ECOSCAN_LOCAL_CALLS";

/// How long a call waits for an offered server that has not started serving yet: the connect
/// timeout of every internal endpoint ([`crate::client`]), so a caller sees the same wait.
const START_TIMEOUT: Duration = Duration::from_secs(3);

/// A server's whole service stack, as an in-process caller calls it.
pub type LocalService = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, BoxError>;

/// An offered address: the server's stack once it serves (`None` before), and which offer this
/// is (an address may be offered again after its server stopped).
struct Slot {
    offer: u64,
    server: watch::Sender<Option<Serving>>,
}

/// What a serving server publishes: its stack and the tracker of its in-flight local calls.
#[derive(Clone)]
struct Serving {
    service: LocalService,
    calls: TaskTracker,
}

static SLOTS: LazyLock<Mutex<HashMap<SocketAddr, Slot>>> = LazyLock::new(Default::default);
static OFFERS: AtomicU64 = AtomicU64::new(0);

fn slots() -> std::sync::MutexGuard<'static, HashMap<SocketAddr, Slot>> {
    // A panic while holding the lock leaves the map consistent (every operation is one insert
    // or remove), so a poisoned lock is still usable.
    SLOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether in-process calls are on (`ECOSCAN_LOCAL_CALLS` is not `tcp`).
fn enabled() -> bool {
    crate::config::env_opt(LOCAL_CALLS_VAR).is_none_or(|v| !v.trim().eq_ignore_ascii_case("tcp"))
}

/// Offers the server that will listen on `addr` to callers in this process: from now on a
/// plaintext client of `http://{addr}` made in this process calls that server's stack directly
/// once it serves ([`crate::server`]). Call it before creating the clients (a client decides
/// when it is made). Does nothing when in-process calls are off.
pub fn offer(addr: SocketAddr) {
    if !enabled() {
        return;
    }
    let (server, _) = watch::channel(None);
    slots().insert(
        addr,
        Slot {
            offer: OFFERS.fetch_add(1, Ordering::Relaxed),
            server,
        },
    );
}

/// Whether `addr` was offered ([`offer`]) and is not withdrawn.
pub fn is_offered(addr: SocketAddr) -> bool {
    slots().contains_key(&addr)
}

/// Withdraws `addr`: later calls to it fail, as to a closed port.
pub(crate) fn withdraw(addr: SocketAddr) {
    slots().remove(&addr);
}

/// Starts serving `service` to the in-process callers of `addr`, if it was offered. The
/// returned [`Published`] withdraws the address when dropped or [`Published::drain`]ed.
pub(crate) fn publish(addr: SocketAddr, service: LocalService) -> Option<Published> {
    let slots = slots();
    let slot = slots.get(&addr)?;
    let calls = TaskTracker::new();
    slot.server.send_replace(Some(Serving {
        service,
        calls: calls.clone(),
    }));
    Some(Published {
        addr,
        offer: slot.offer,
        calls,
    })
}

/// A server's in-process side; withdraws its address when dropped.
pub(crate) struct Published {
    addr: SocketAddr,
    offer: u64,
    calls: TaskTracker,
}

impl Published {
    /// Stops taking new calls (they are refused, as by a server that stopped listening) and
    /// waits for the calls in flight to finish, their response streams included: the graceful
    /// drain HTTP/2 gives a server's open streams.
    pub(crate) async fn drain(self) {
        let calls = self.calls.clone();
        drop(self);
        calls.close();
        calls.wait().await;
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        let mut slots = slots();
        // Only this server's slot: the address may have been offered again since.
        if slots.get(&self.addr).is_some_and(|s| s.offer == self.offer) {
            slots.remove(&self.addr);
        }
    }
}

/// A client's way to an offered server: it follows the offer from before the server serves
/// until it is withdrawn.
#[derive(Clone)]
pub(crate) struct LocalClient {
    addr: SocketAddr,
    server: watch::Receiver<Option<Serving>>,
}

impl std::fmt::Debug for LocalClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalClient")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// A client of the server offered at `addr`, or `None` when nothing is offered there.
pub(crate) fn client(addr: SocketAddr) -> Option<LocalClient> {
    let slots = slots();
    let slot = slots.get(&addr)?;
    Some(LocalClient {
        addr,
        server: slot.server.subscribe(),
    })
}

impl LocalClient {
    /// The serving server, waiting for it to start when it was offered but is not serving yet.
    async fn serving(&mut self) -> Result<Serving, BoxError> {
        if self.server.has_changed().is_err() {
            // Withdrawn. The address may have been offered again (a restarted server).
            match client(self.addr) {
                Some(again) => *self = again,
                None => return Err(refused(self.addr)),
            }
        }
        let wait = self.server.wait_for(Option::is_some);
        match tokio::time::timeout(START_TIMEOUT, wait).await {
            Ok(Ok(serving)) => Ok(serving.clone().expect("waited for a serving server")),
            Ok(Err(_)) => Err(refused(self.addr)),
            Err(_) => Err(ConnectError(
                format!("the server offered at {} did not start serving", self.addr).into(),
            )
            .into()),
        }
    }

    /// Calls the server's stack with `req`, as its HTTP/2 connection would.
    pub(crate) async fn call(
        mut self,
        mut req: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let serving = self.serving().await?;
        // A closed tracker is a server that stopped: refused, like a new stream after GOAWAY.
        let call = serving.calls.token();
        if serving.calls.is_closed() {
            return Err(refused(self.addr));
        }
        // What the server sees of the connection is what an HTTP/2 server would give it: no
        // extension of the caller's (tonic's client keeps its own there), the connection's
        // info (no peer address: the peer is this process).
        let deadline = crate::deadline::grpc_timeout(req.headers());
        *req.extensions_mut() = http::Extensions::new();
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: None,
        });
        let response = serving.service.oneshot(req);
        // tonic's server and client both bound a call by its `grpc-timeout` until the response
        // headers; one bound does it here.
        let response = match deadline {
            Some(deadline) => tokio::time::timeout(deadline, response)
                .await
                .map_err(|_| TimeoutExpired(()))??,
            None => response.await?,
        };
        Ok(response.map(|body| {
            Body::new(InFlight {
                body,
                call: Some(call),
            })
        }))
    }
}

/// A response body that keeps its call in flight (for the server's drain) until the stream
/// ends, fails or is dropped: what an HTTP/2 stream's end is to a server, whether or not the
/// caller keeps the finished stream's object.
struct InFlight {
    body: Body,
    call: Option<tokio_util::task::task_tracker::TaskTrackerToken>,
}

impl http_body::Body for InFlight {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        let ended = match &frame {
            std::task::Poll::Ready(None | Some(Err(_))) => true,
            std::task::Poll::Ready(Some(Ok(frame))) => frame.is_trailers(),
            std::task::Poll::Pending => false,
        };
        if ended {
            self.call = None;
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

fn refused(addr: SocketAddr) -> BoxError {
    ConnectError(
        std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!("no server of this process is serving {addr} any more"),
        )
        .into(),
    )
    .into()
}

/// Boxes a server's stack for in-process callers.
pub(crate) fn boxed<S, B>(service: S) -> LocalService
where
    S: Service<http::Request<Body>, Response = http::Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(
        service
            .map_response(|response: http::Response<B>| response.map(Body::new))
            .map_err(Into::into),
    )
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    fn echo() -> LocalService {
        boxed(tower::service_fn(|req: http::Request<Body>| async move {
            Ok::<_, std::convert::Infallible>(http::Response::new(req.into_body()))
        }))
    }

    fn request() -> http::Request<Body> {
        http::Request::new(Body::empty())
    }

    #[tokio::test]
    async fn a_call_waits_for_an_offered_server_to_start_and_is_refused_after_it_stops() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        offer(addr);
        let early = client(addr).expect("offered");
        let call = tokio::spawn(early.clone().call(request()));
        tokio::task::yield_now().await;
        let published = publish(addr, echo()).expect("offered");
        call.await
            .unwrap()
            .expect("the call made before the server started is served");

        published.drain().await;
        assert!(!is_offered(addr));
        let err = early.call(request()).await.unwrap_err();
        assert!(err.is::<ConnectError>(), "{err:?}");

        // Offered again (a restarted server): the old client follows the new offer.
        offer(addr);
        let again = publish(addr, echo()).expect("offered");
        client(addr)
            .unwrap()
            .call(request())
            .await
            .expect("the new offer serves");
        drop(again);
        assert!(!is_offered(addr));
    }

    #[tokio::test]
    async fn a_server_drains_the_streams_it_is_answering() {
        let addr: SocketAddr = "127.0.0.1:2".parse().unwrap();
        offer(addr);
        let published = publish(addr, echo()).expect("offered");
        let (tx, frames) = tokio::sync::mpsc::channel::<Result<_, BoxError>>(1);
        let body =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(frames));
        let response = client(addr)
            .unwrap()
            .call(http::Request::new(Body::new(body)))
            .await
            .unwrap();
        let drained = tokio::spawn(published.drain());
        tokio::task::yield_now().await;
        assert!(!drained.is_finished(), "drained while a stream was open");
        tx.send(Ok(http_body::Frame::data(bytes::Bytes::from_static(b"x"))))
            .await
            .unwrap();
        drop(tx);
        // Read to its end, the stream is over for the server even though the caller keeps it.
        let mut body = response.into_body();
        let mut read = Vec::new();
        while let Some(frame) = body.frame().await {
            read.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        assert_eq!(read, b"x");
        drained.await.unwrap();
        drop(body);
    }
}
