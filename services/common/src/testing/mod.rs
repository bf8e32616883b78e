//! Helpers for tests: spawn a server on an ephemeral loopback port, and check that a server
//! answers health and reflection the way every ecoscan server must; with the feature `test-pki`,
//! certificates for internal TLS ([`pki`]).

#[cfg(any(test, feature = "test-pki"))]
pub mod pki;

use std::{future::Future, net::SocketAddr};

use tokio::{net::TcpListener, task::JoinHandle};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

/// A server running on `127.0.0.1:<ephemeral>`; cancelled and awaited on `shutdown()`.
pub struct Spawned {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<anyhow::Result<()>>,
}

impl Spawned {
    /// `http://127.0.0.1:PORT`
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Cancels the server and waits for it to stop, returning its result.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.handle.await?
    }
}

/// Binds `127.0.0.1:0` first, then spawns `serve(listener, shutdown)`: the address is known
/// before the server runs, so tests never sleep or race.
pub async fn spawn<F, Fut>(serve: F) -> Spawned
where
    F: FnOnce(TcpListener, CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    crate::telemetry::init_for_tests();
    let listener = crate::server::listen(([127, 0, 0, 1], 0).into())
        .expect("failed to bind an ephemeral port");
    let addr = listener
        .local_addr()
        .expect("bound listener has an address");
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(serve(listener, shutdown.clone()));
    Spawned {
        addr,
        shutdown,
        handle,
    }
}

/// Established TCP connections with `port` at either end, from the kernel's own tables
/// (`/proc/net/tcp` and `tcp6`): how a test tells whether calls crossed a socket.
pub fn established_tcp(port: u16) -> usize {
    let port = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .map(|table| {
            table
                .lines()
                .skip(1)
                .filter(|line| {
                    // sl, local_address, rem_address, st (01 = ESTABLISHED), …
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    fields.len() > 3
                        && fields[3] == "01"
                        && (fields[1].ends_with(&port) || fields[2].ends_with(&port))
                })
                .count()
        })
        .sum()
}

/// Asserts that the server at `uri` reports `service` SERVING over `grpc.health.v1` and lists it
/// over reflection v1.
pub async fn assert_health_and_reflection(uri: &str, service: &str) {
    let channel = tonic::transport::Endpoint::from_shared(uri.to_owned())
        .expect("valid uri")
        .connect()
        .await
        .expect("server accepts connections");
    assert_health_and_reflection_over(channel, service).await;
}

/// [`assert_health_and_reflection`] over a channel of the caller's (over TLS, say).
pub async fn assert_health_and_reflection_over(channel: tonic::transport::Channel, service: &str) {
    let status = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .expect("health check answers")
        .into_inner()
        .status;
    assert_eq!(
        status,
        ServingStatus::Serving as i32,
        "{service} is not SERVING"
    );

    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .expect("reflection answers")
        .into_inner();
    let Some(Ok(res)) = stream.next().await else {
        panic!("reflection returned no answer");
    };
    let Some(MessageResponse::ListServicesResponse(list)) = res.message_response else {
        panic!("reflection did not answer a list request with a list");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == service),
        "{service} not in reflection list {names:?}"
    );
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "health not in reflection list {names:?}"
    );
}

/// `GET /metrics` of the server at `addr` over plain HTTP/1.1; panics unless it answers 200.
pub async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .expect("server accepts connections");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .await
        .expect("request sent");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.expect("response read");
    let raw = String::from_utf8(raw).expect("metrics are utf-8");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an http response");
    assert!(head.starts_with("HTTP/1.1 200"), "GET /metrics: {head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain"),
        "GET /metrics: {head}"
    );
    body.to_owned()
}

/// The value of the sample `name{labels}` in a Prometheus text scrape, matching the given labels
/// whatever their order (other labels of the sample are ignored); `None` when absent.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, rest)) => (m, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            // Label values here never contain `",`, so splitting on it is enough.
            let pairs: Vec<(&str, &str)> = rest
                .split("\",")
                .filter(|p| !p.is_empty())
                .filter_map(|p| {
                    let (k, v) = p.split_once("=\"")?;
                    Some((k, v.trim_end_matches('"')))
                })
                .collect();
            labels
                .iter()
                .all(|want| pairs.contains(want))
                .then(|| value.parse().ok())?
        })
}

/// A loopback TCP proxy in front of `target` that a test takes down and brings back. Down, it
/// cuts every open connection and closes every new one at once, before a byte passes: an
/// endpoint that stopped (S3, say), whose data is still there when it comes back.
pub struct CuttingProxy {
    addr: SocketAddr,
    up: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl CuttingProxy {
    /// Listens on a free loopback port, forwarding to `target`; up.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let (up, watching) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut watching = watching.clone();
                if !*watching.borrow() {
                    drop(inbound);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watching.wait_for(|up| !up) => {}
                    }
                });
            }
        });
        Self { addr, up, task }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Takes the endpoint down (`false`: open connections are cut, new ones closed) or up.
    pub fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
