//! The gateway's connections: a cap on how many are open, in all and per address; a deadline on
//! a new connection's first byte (before hyper even looks at whether it speaks HTTP/1 or
//! HTTP/2), on each request's headers, and on a connection with no request in flight (HTTP/2
//! included, with keep-alive pings that must be answered); and graceful shutdown. Every request
//! carries the connection's two addresses ([`Peer`]) for the edge's per-request decisions.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::Request,
    response::Response,
};
use ecoscan_common::CancellationToken;
use futures::future::BoxFuture;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto::Builder,
    service::TowerToHyperService,
};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tower::ServiceExt as _;

use crate::{
    auth::Peer,
    config::{Limits, ProxyConfig, ProxyProtocol},
    limits::{ConnectionsPerIp, IpSlot},
    proxy::{self, ClientAddr},
};

/// How long open connections may take to finish after shutdown begins.
const DRAIN: Duration = Duration::from_secs(30);
/// The largest request line and headers accepted (hyper's minimum buffer size).
pub(crate) const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// Serves `app` on `listener` until `shutdown`, with the connection limits of `limits`, behind
/// the proxies of `proxies`.
pub(crate) async fn serve(
    app: Router,
    listener: TcpListener,
    limits: &Limits,
    proxies: ProxyConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let max = limits.max_connections;
    let slots = Arc::new(Semaphore::new(max));
    let per_ip = ConnectionsPerIp::new(limits.max_connections_per_ip);
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Starts whenever the connection waits for a request's head: slow headers and idle
        // keep-alive connections are both cut after it.
        .header_read_timeout(limits.header_timeout)
        // Request heads of at most 8 KiB (hyper answers 431 beyond), which also keeps each
        // connection's read buffer at 8 KiB: with hyper's default the buffer of every
        // connection doubles to 16 KiB on the second read of its first request (the version
        // sniffing above hands hyper the first bytes as a short read of their own), and an
        // idle SSE connection holds it for its whole life.
        .max_buf_size(MAX_REQUEST_HEAD);
    builder
        .http2()
        .timer(TokioTimer::new())
        // A peer that stops answering pings is gone (or pretends to be there): closed.
        .keep_alive_interval(Some(limits.h2_keepalive_interval))
        .keep_alive_timeout(limits.h2_keepalive_timeout)
        .max_concurrent_streams(256);
    let conn = Arc::new(ConnLimits {
        builder,
        first_byte: limits.first_byte_timeout,
        first_request: limits.header_timeout,
        idle: limits.idle_timeout,
        per_ip,
        proxies: Arc::new(proxies),
    });
    loop {
        // At the cap, stop accepting: new connections wait in the listen backlog until one
        // closes, and open connections keep their service.
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let (stream, remote) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted.
                    tracing::warn!(error = %e, "failed to accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // One address may not hold the connections everyone needs: past its cap, closed at
        // once (the peer sees a reset or an immediate end). A trusted proxy holds the
        // connections of many clients: it is held to the total only (its clients, when its
        // PROXY header names them, to their own caps).
        let ip_slot = if conn.proxies.trusts(remote.ip()) {
            None
        } else {
            let Some(slot) = conn.per_ip.take(remote.ip()) else {
                tracing::debug!(%remote, "closing a connection past its address's cap");
                continue;
            };
            Some(slot)
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        // Without TCP_NODELAY small responses wait for delayed ACKs (~40 ms each).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "failed to set TCP_NODELAY");
        }
        let peer = Peer {
            remote,
            local,
            via: None,
        };
        tokio::spawn(serve_connection(
            conn.clone(),
            stream,
            peer,
            app.clone(),
            shutdown.clone(),
            (permit, ip_slot),
        ));
    }
    drop(listener);
    // Every open connection holds a permit: all of them back means all have ended.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("connections still open {DRAIN:?} after shutdown began; closing them");
    }
    Ok(())
}

/// What every connection is served with.
struct ConnLimits {
    builder: Builder<TokioExecutor>,
    first_byte: Duration,
    /// From the first byte to the first whole request (an HTTP/1 head, or an HTTP/2 preface,
    /// settings and request headers): what hyper's header timeout does for HTTP/1 alone.
    first_request: Duration,
    idle: Duration,
    per_ip: ConnectionsPerIp,
    proxies: Arc<ProxyConfig>,
}

/// One connection, from its first byte to its end; `held` (its slots) is released with it.
async fn serve_connection(
    limits: Arc<ConnLimits>,
    mut stream: TcpStream,
    mut peer: Peer,
    app: Router,
    shutdown: CancellationToken,
    mut held: (OwnedSemaphorePermit, Option<IpSlot>),
) {
    // Nothing is allocated for a connection that never speaks: hyper's version detection and
    // header timeout start only with bytes to read.
    let mut first = [0u8; 1];
    match tokio::time::timeout(limits.first_byte, stream.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        Ok(_) => return,
        Err(_) => {
            tracing::debug!(remote = %peer.remote, "closing a connection that sent nothing");
            return;
        }
    }
    if limits.proxies.protocol == ProxyProtocol::V2 && limits.proxies.trusts(peer.remote.ip()) {
        match proxy::read_proxy_header(&mut stream, limits.first_request).await {
            Ok(None) => {}
            Ok(Some(client)) => {
                // The client's own connection cap, now that its address is known.
                let Some(slot) = limits.per_ip.take(client.ip()) else {
                    tracing::debug!(%client, "closing a proxied connection past its address's cap");
                    return;
                };
                held.1 = Some(slot);
                peer.via = Some(peer.remote);
                peer.remote = client;
            }
            Err(e) => {
                tracing::warn!(proxy = %peer.remote, error = %e, "closing a connection from a trusted proxy without a valid PROXY header (GATEWAY_PROXY_PROTOCOL=v2)");
                return;
            }
        }
    }
    let _held = held;
    let activity = Arc::new(Activity::default());
    let service = TowerToHyperService::new(ConnService {
        app,
        peer,
        proxies: limits.proxies.clone(),
        activity: activity.clone(),
    });
    let connection = limits
        .builder
        .serve_connection_with_upgrades(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let mut closing = false;
    let first_request_by = tokio::time::Instant::now() + limits.first_request;
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep_until(first_request_by), if !activity.started() => {
                // (A request that arrived while this branch waited: go on without it.)
                if activity.started() {
                    continue;
                }
                // A partial HTTP/2 preface or settings that stop: nothing to shut down
                // gracefully, the connection is dropped.
                tracing::debug!(remote = %peer.remote, "closing a connection that sent no whole request in time");
                return;
            }
            () = shutdown.cancelled(), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            () = activity.idle_for(limits.idle), if !closing => {
                // HTTP/1 idles are cut by the header timeout already; this is what ends an
                // HTTP/2 connection that opened and then holds no stream.
                tracing::debug!(remote = %peer.remote, "closing an idle connection");
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
}

/// Requests in flight on one connection, and when the last one ended.
struct Activity {
    in_flight: AtomicUsize,
    last_end: Mutex<Instant>,
    /// A whole request has arrived on the connection.
    started: AtomicBool,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            last_end: Mutex::new(Instant::now()),
            started: AtomicBool::new(false),
        }
    }
}

impl Activity {
    fn begin(self: &Arc<Self>) -> InFlight {
        self.started.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    /// Resolves once the connection has had no request in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let wait = if self.in_flight.load(Ordering::Relaxed) == 0 {
                let since = self
                    .last_end
                    .lock()
                    .expect("activity lock poisoned")
                    .elapsed();
                match idle.checked_sub(since) {
                    None | Some(Duration::ZERO) => return,
                    Some(left) => left,
                }
            } else {
                idle
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// A request (until its response body ends).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.last_end.lock().expect("activity lock poisoned") = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The app as one connection serves it: every request carries the connection's [`Peer`], and
/// counts as in flight until its response body is done.
#[derive(Clone)]
struct ConnService {
    app: Router,
    peer: Peer,
    proxies: Arc<ProxyConfig>,
    activity: Arc<Activity>,
}

impl tower::Service<hyper::Request<Incoming>> for ConnService {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // A router is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: hyper::Request<Incoming>) -> Self::Future {
        let mut req: Request = req.map(Body::new);
        let mut client: ClientAddr =
            proxy::client_addr(self.peer.remote.ip(), req.headers(), &self.proxies);
        // A PROXY header named the connection's client already.
        client.proxied |= self.peer.via.is_some();
        req.extensions_mut().insert(self.peer);
        req.extensions_mut().insert(client);
        let in_flight = self.activity.begin();
        let app = self.app.clone();
        Box::pin(async move {
            let res = app.oneshot(req).await?;
            Ok(res.map(|body| {
                Body::new(Tracked {
                    body,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// A response body that keeps its request in flight until it ends.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
