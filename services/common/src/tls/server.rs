//! The accepting side of internal TLS, for [`crate::server`]: TLS handshakes off the accept
//! loop, and under mutual TLS the per-request check that a client certificate was presented.

use std::task::{Context, Poll};

use futures::future::Either;
use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// Paths answered without a client certificate under mutual TLS: the orchestrator's probes,
/// which cannot present one, and which say nothing but "ok" and "ready".
const OPEN_PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// Under mutual TLS, refuses every request that came without a verified client certificate
/// (the handshake already refused certificates the CA did not sign), but the probes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientCertLayer {
    pub(crate) required: bool,
}

impl<S> tower::Layer<S> for ClientCertLayer {
    type Service = ClientCert<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientCert {
            inner,
            required: self.required,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct ClientCert<S> {
    inner: S,
    required: bool,
}

impl<S, B> tower::Service<http::Request<B>> for ClientCert<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !self.required || OPEN_PATHS.contains(&req.uri().path()) || has_client_cert(&req) {
            return Either::Right(self.inner.call(req));
        }
        const MESSAGE: &str = "a client certificate signed by the internal gRPC CA is required";
        let grpc = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let res = if grpc {
            tonic::Status::unauthenticated(MESSAGE).into_http()
        } else {
            let mut res =
                http::Response::new(tonic::body::Body::new(axum::body::Body::from(MESSAGE)));
            *res.status_mut() = http::StatusCode::FORBIDDEN;
            res
        };
        Either::Left(std::future::ready(Ok(res)))
    }
}

/// Whether the request's connection presented a client certificate (verified in the handshake).
fn has_client_cert<B>(req: &http::Request<B>) -> bool {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(TlsConnectInfo::peer_certs)
        .is_some_and(|certs| !certs.is_empty())
}

/// Accepted connections after their TLS handshake, with `TCP_NODELAY`. Handshakes run
/// concurrently (one slow client holds up no other) and are bounded by
/// [`crate::tls::HANDSHAKE_TIMEOUT`]; a failed one is logged and dropped. Dropping the stream
/// (shutdown) closes the listener and abandons handshakes in progress.
pub(crate) fn incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
) -> impl tokio_stream::Stream<Item = std::io::Result<TlsStream<TcpStream>>> {
    type Handshakes = JoinSet<Option<TlsStream<TcpStream>>>;
    let state: (TcpListener, Handshakes, TlsAcceptor) = (listener, JoinSet::new(), acceptor);
    futures::stream::unfold(state, |(listener, mut handshakes, acceptor)| async move {
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (conn, peer) = match accepted {
                        Ok(accepted) => accepted,
                        Err(e) => return Some((Err(e), (listener, handshakes, acceptor))),
                    };
                    if let Err(e) = conn.set_nodelay(true) {
                        tracing::debug!(error = %e, "failed to set TCP_NODELAY");
                    }
                    let acceptor = acceptor.clone();
                    handshakes.spawn(handshake(acceptor, conn, peer));
                }
                Some(done) = handshakes.join_next() => {
                    if let Ok(Some(tls)) = done {
                        return Some((Ok(tls), (listener, handshakes, acceptor)));
                    }
                }
            }
        }
    })
}

/// The first byte of every TLS connection: a handshake record (the ClientHello).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// One connection's TLS handshake, within [`crate::tls::HANDSHAKE_TIMEOUT`]: the stream, or
/// `None` (logged) when it failed.
async fn handshake(
    acceptor: TlsAcceptor,
    conn: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<TlsStream<TcpStream>> {
    let handshake = async {
        // A plaintext client (one without `GRPC_TLS_*`) would otherwise show up as a corrupt
        // TLS record; say what it is.
        let mut first = [0u8; 1];
        if conn.peek(&mut first).await? == 1 && first[0] != TLS_HANDSHAKE_RECORD {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                PlaintextClient,
            ));
        }
        acceptor.accept(conn).await
    };
    match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(e)) => {
            // A plaintext client, a TLS alert or a certificate the CA did not sign: worth
            // seeing; a connection reset before the handshake is not.
            let worth_seeing = e.get_ref().is_some_and(|inner| {
                inner.is::<PlaintextClient>() || inner.is::<tokio_rustls::rustls::Error>()
            });
            if worth_seeing {
                tracing::warn!(%peer, error = %e, "TLS handshake failed");
            } else {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
            }
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

/// A client that spoke plaintext to a TLS port.
#[derive(Debug, thiserror::Error)]
#[error(
    "the client sent plaintext, not a TLS handshake: this port requires TLS; give the client \
     {CERT_VAR} and {KEY_VAR} too (and {CA_VAR} for mutual TLS)",
    CERT_VAR = crate::tls::CERT_VAR,
    KEY_VAR = crate::tls::KEY_VAR,
    CA_VAR = crate::tls::CA_VAR
)]
struct PlaintextClient;
