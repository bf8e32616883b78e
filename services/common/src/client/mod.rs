//! Clients: one lazily connected, shared channel per target, balanced over its replicas
//! ([`balance`]) and over TLS when the process has internal TLS configured, a trace-context
//! interceptor, and per-call deadlines. Every endpoint gets the same settings ([`dial`]).

pub mod balance;
mod dial;

use std::time::Duration;

use opentelemetry::propagation::Injector;
use tonic::{
    Request, Status,
    metadata::{MetadataKey, MetadataMap, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Channel, Endpoint},
};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use self::{balance::Balancing, dial::configure};
use crate::tls::TlsConfig;

/// A channel that carries the caller's trace context on every call.
pub type TracedChannel = InterceptedService<Transport, TraceContext>;

/// How a channel's calls travel: HTTP/2 over a connection (TCP or TLS, balanced over replicas),
/// or, to a server of this very process, straight into its service stack ([`crate::local`]).
#[derive(Clone, Debug)]
pub struct Transport(Route);

#[derive(Clone, Debug)]
enum Route {
    Remote(Channel),
    Local(crate::local::LocalClient),
}

impl From<Channel> for Transport {
    fn from(channel: Channel) -> Self {
        Self(Route::Remote(channel))
    }
}

type RemoteFuture = futures::future::MapErr<
    tonic::transport::channel::ResponseFuture,
    fn(tonic::transport::Error) -> tower::BoxError,
>;

impl tower::Service<http::Request<tonic::body::Body>> for Transport {
    type Response = http::Response<tonic::body::Body>;
    type Error = tower::BoxError;
    type Future = futures::future::Either<
        RemoteFuture,
        futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        match &mut self.0 {
            Route::Remote(channel) => channel.poll_ready(cx).map_err(Into::into),
            // Always ready: a call waits for its server (or is refused) when it is made.
            Route::Local(_) => std::task::Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        use futures::FutureExt as _;
        match &mut self.0 {
            Route::Remote(channel) => futures::future::Either::Left(
                futures::TryFutureExt::map_err(channel.call(req), Into::into as fn(_) -> _),
            ),
            Route::Local(local) => futures::future::Either::Right(local.clone().call(req).boxed()),
        }
    }
}

/// Injects the current span's W3C trace context (and baggage) into outgoing metadata, and turns
/// the acting user (`x-user-id`, `x-user-roles`) into a signed assertion for the service called
/// ([`crate::assertion`]): no service believes them plain.
#[derive(Clone, Copy, Debug, Default)]
pub struct TraceContext;

impl Interceptor for TraceContext {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let cx = tracing::Span::current().context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(req.metadata_mut()));
        });
        // Generated clients name the method they call; the assertion is for that service only.
        let service = req
            .extensions()
            .get::<tonic::GrpcMethod>()
            .map(|m| m.service().to_owned())
            .unwrap_or_default();
        crate::assertion::attach(req.metadata_mut(), &service);
        Ok(req)
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// A shared channel to `uri` (`http://vision:50052`). It connects on first use and reconnects
/// by itself, so services may start in any order. Clone it freely: clones share its connections.
///
/// Calls are balanced over every replica of the target ([`balance`]): the host name is
/// resolved to all its addresses (a headless Service in Kubernetes), one connection is kept per
/// address, and the set follows the replicas (re-resolved every `GRPC_RESOLVE_INTERVAL`; an
/// address that fails or drains gets no new calls). `uri` may also list several URLs, separated
/// by commas. A single IP address (`http://127.0.0.1:50052`) has nothing to balance and gets
/// one connection.
///
/// Internal TLS follows the process's `GRPC_TLS_*` variables ([`crate::tls`]): when they are set,
/// the channel uses TLS (mutual TLS with `GRPC_TLS_CA`) and an `http://` URL is dialled as
/// `https://`; when they are not, an `https://` URL is an error.
pub fn channel(uri: &str) -> anyhow::Result<TracedChannel> {
    channel_with_tls(uri, crate::tls::TlsConfig::global()?)
}

/// [`channel`] with an explicit TLS configuration instead of the `GRPC_TLS_*` variables (`None`:
/// plaintext).
pub fn channel_with_tls(uri: &str, tls: Option<&TlsConfig>) -> anyhow::Result<TracedChannel> {
    channel_with(uri, tls, &Balancing::from_env()?)
}

/// [`channel_with_tls`] with explicit balancing settings (a resolver of the test's own, say)
/// instead of the system resolver and `GRPC_RESOLVE_INTERVAL`.
pub fn channel_with(
    uri: &str,
    tls: Option<&TlsConfig>,
    balancing: &Balancing,
) -> anyhow::Result<TracedChannel> {
    let targets = balance::parse_targets(uri, tls.is_some())?;
    // A server of this very process (`ecoscan up`): its service stack, no connection.
    let local = balance::Target::single_socket_addr(&targets)
        .filter(|_| tls.is_none())
        .and_then(crate::local::client);
    let transport = if let Some(local) = local {
        Transport(Route::Local(local))
    } else if let Some(uri) = balance::Target::single_address(&targets) {
        configure(Endpoint::from(uri.clone()), tls, None)?
            .connect_lazy()
            .into()
    } else {
        balance::channel(targets, tls, balancing).into()
    };
    Ok(InterceptedService::new(transport, TraceContext))
}

/// The endpoint of one URL (no balancing), for callers that connect it themselves.
pub fn endpoint(uri: &str, tls: Option<&TlsConfig>) -> anyhow::Result<Endpoint> {
    let uri = crate::tls::dial_uri(uri, tls.is_some())?;
    configure(Endpoint::from_shared(uri)?, tls, None)
}

/// A request with a deadline (sent as `grpc-timeout`, enforced by the server too).
pub fn request<T>(message: T, deadline: Duration) -> Request<T> {
    let mut req = Request::new(message);
    req.set_timeout(deadline);
    req
}

/// A request acting with the admin role (`x-user-roles: admin`), for the calls that read every
/// user's data (`AnalyticsService.Usage`, `GetCall`).
pub fn as_admin<T>(message: T) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut().insert(
        crate::identity::ROLES_HEADER,
        MetadataValue::from_static("admin"),
    );
    req
}

/// `req`, made by the ecoscan service `actor` on its own account (the assertion's `act` claim;
/// see [`crate::identity::ACTOR_HEADER`]).
pub fn by_actor<T>(mut req: Request<T>, actor: &'static str) -> Request<T> {
    req.metadata_mut().insert(
        crate::identity::ACTOR_HEADER,
        MetadataValue::from_static(actor),
    );
    req
}

/// A request with a deadline that acts on behalf of `user_id`.
pub fn request_as<T>(message: T, deadline: Duration, user_id: &str) -> Request<T> {
    let mut req = request(message, deadline);
    if let Ok(v) = MetadataValue::try_from(user_id) {
        req.metadata_mut().insert(crate::USER_ID_HEADER, v);
    }
    req
}
