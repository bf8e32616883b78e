//! Balanced channels on real sockets: two replicas listen on the same port of two loopback
//! addresses (127.0.0.2 and 127.0.0.3) behind one name, resolved by the test's own resolver.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use ecoscan_common::{
    balance::{Balancing, Resolve},
    client::{TracedChannel, channel_with},
};
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic_health::{
    ServingStatus,
    pb::{HealthCheckRequest, health_client::HealthClient},
    server::HealthReporter,
};

/// Resolves every name to the given addresses.
struct Fixed(Vec<IpAddr>);

impl Resolve for Fixed {
    fn resolve(&self, _host: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> {
        let addrs = self.0.iter().map(|ip| SocketAddr::new(*ip, port)).collect();
        Box::pin(async move { Ok(addrs) })
    }
}

/// A server answering `grpc.health.v1`, counting the `Check` calls it gets.
struct Replica {
    checks: Arc<AtomicUsize>,
    reporter: HealthReporter,
    shutdown: CancellationToken,
}

impl Replica {
    async fn start(addr: SocketAddr) -> (Self, SocketAddr) {
        let listener = ecoscan_common::server::listen(addr).expect("bind replica");
        let addr = listener.local_addr().unwrap();
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        let checks = Arc::new(AtomicUsize::new(0));
        let counted = checks.clone();
        let count = tower::ServiceBuilder::new().map_request(
            move |req: http::Request<tonic::body::Body>| {
                if req.uri().path() == "/grpc.health.v1.Health/Check" {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
                req
            },
        );
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(
            Server::builder()
                .layer(count)
                .add_service(health)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                ),
        );
        (
            Self {
                checks,
                reporter,
                shutdown,
            },
            addr,
        )
    }

    fn checks(&self) -> usize {
        self.checks.load(Ordering::Relaxed)
    }
}

/// Two replicas on the same port of 127.0.0.2 and 127.0.0.3, and a channel to a name that
/// resolves to both.
async fn two_replicas() -> (Replica, Replica, TracedChannel) {
    let (a, addr) = Replica::start(([127, 0, 0, 2], 0).into()).await;
    let (b, _) = Replica::start(([127, 0, 0, 3], addr.port()).into()).await;
    let balancing =
        Balancing::with_resolver(Fixed(vec![[127, 0, 0, 2].into(), [127, 0, 0, 3].into()]));
    let uri = format!("http://replicas.test:{}", addr.port());
    let channel = channel_with(&uri, None, &balancing).expect("balanced channel");
    (a, b, channel)
}

async fn check(channel: &TracedChannel) -> Result<(), tonic::Status> {
    HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(drop)
}

#[tokio::test]
async fn calls_spread_over_every_address_of_a_name() {
    let (a, b, channel) = two_replicas().await;

    for _ in 0..200 {
        check(&channel).await.expect("call succeeds");
    }

    let (a, b) = (a.checks(), b.checks());
    assert_eq!(a + b, 200);
    for n in [a, b] {
        assert!((70..=130).contains(&n), "uneven split: {a} / {b}");
    }
}

#[tokio::test]
async fn a_list_of_urls_is_balanced_like_a_name() {
    let (a, addr) = Replica::start(([127, 0, 0, 2], 0).into()).await;
    let (b, _) = Replica::start(([127, 0, 0, 3], addr.port()).into()).await;
    let port = addr.port();
    let uri = format!("http://127.0.0.2:{port},http://127.0.0.3:{port}");
    let channel = ecoscan_common::client::channel_with_tls(&uri, None).expect("balanced channel");

    for _ in 0..100 {
        check(&channel).await.expect("call succeeds");
    }

    assert!(
        a.checks() > 0 && b.checks() > 0,
        "{} / {}",
        a.checks(),
        b.checks()
    );
}

#[tokio::test]
async fn a_replica_that_is_not_serving_gets_no_new_calls_until_it_serves_again() {
    let (a, b, channel) = two_replicas().await;
    check(&channel).await.expect("call succeeds");

    a.reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    // The health watch reports it at once; let the change reach the balancer.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = a.checks();
    for _ in 0..50 {
        check(&channel).await.expect("call succeeds");
    }
    assert_eq!(a.checks(), before, "the draining replica got new calls");

    a.reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while a.checks() == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica never came back"
        );
        check(&channel).await.expect("call succeeds");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(b);
}

#[tokio::test]
async fn calls_go_on_when_one_replica_shuts_down() {
    let (a, b, channel) = two_replicas().await;
    check(&channel).await.expect("call succeeds");

    // As an ecoscan server shuts down: NOT_SERVING first, then the listener closes.
    a.reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    a.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = b.checks();
    for _ in 0..50 {
        check(&channel).await.expect("call succeeds");
    }
    assert_eq!(b.checks(), before + 50);
}
