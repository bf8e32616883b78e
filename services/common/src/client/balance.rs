//! Client-side load balancing over every replica of a target.
//!
//! A target is a URL (`http://vision:50052`) or a comma-separated list of URLs. Each URL's host
//! is resolved to all of its addresses — a Kubernetes headless Service (`clusterIP: None`)
//! answers with one per ready pod — and the channel keeps one HTTP/2 connection per address,
//! sending each call to the less loaded of two randomly picked ones (tower's
//! power-of-two-choices balancer, inside tonic's balanced [`Channel`]).
//!
//! The set of addresses follows the replicas:
//!
//! - names are resolved again every `GRPC_RESOLVE_INTERVAL` (default 30 s), and shortly after an
//!   address is lost; a failed resolution keeps the addresses found before;
//! - every address is watched with `grpc.health.v1.Health/Watch` (the server's overall status) on
//!   a connection of its own. An address whose connection fails, or that reports `NOT_SERVING`
//!   (a replica draining after SIGTERM), gets no new calls until it reports `SERVING` again;
//!   calls already sent to it finish. A new address gets calls once it reports `SERVING` (the
//!   first calls of a channel wait up to a second for the first answers). A server without the
//!   health service counts as serving. While no address serves, calls go to all of them and
//!   fail fast with `UNAVAILABLE` (as with one connection) instead of waiting.
//!
//! A call already on its way to a replica that dies still fails (`UNAVAILABLE`); callers retry
//! as they would with one connection, and the retry goes to a replica that is up.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt, io,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, bail};
use futures::future::BoxFuture;
use http::Uri;
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tonic::transport::{Channel, Endpoint, channel::Change};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::tls::TlsConfig;

/// How often names are resolved again.
pub const RESOLVE_INTERVAL_VAR: &str = "GRPC_RESOLVE_INTERVAL";
/// The default of [`RESOLVE_INTERVAL_VAR`].
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// How soon names are resolved again after an address is lost (the replica may have moved).
const RESOLVE_AFTER_LOSS: Duration = Duration::from_secs(1);
/// How long one resolution may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Health watches of an address that is down are retried after this, doubling up to
/// [`MAX_WATCH_BACKOFF`].
const MIN_WATCH_BACKOFF: Duration = Duration::from_millis(100);
const MAX_WATCH_BACKOFF: Duration = Duration::from_secs(1);
/// How long the first calls may wait for the first health answers.
const FIRST_HEALTH_WAIT: Duration = Duration::from_secs(1);
/// Endpoint changes queued between the balancer task and the channel.
const CHANGES_CAPACITY: usize = 64;

/// Turns a host name into the addresses behind it. The system's resolver is
/// [`SystemResolver`]; tests swap in their own.
pub trait Resolve: Send + Sync + 'static {
    /// Every address of `host`, with `port`.
    fn resolve(&self, host: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>>;
}

/// The system's resolver (`getaddrinfo`: `/etc/hosts`, then DNS).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, host: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> {
        let host = host.to_owned();
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect())
        })
    }
}

/// How a balanced channel finds its endpoints.
#[derive(Clone)]
pub struct Balancing {
    /// Resolves the targets' host names.
    pub resolver: Arc<dyn Resolve>,
    /// How often names are resolved again.
    pub resolve_interval: Duration,
}

impl Balancing {
    /// The system resolver, every `GRPC_RESOLVE_INTERVAL`.
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            resolver: Arc::new(SystemResolver),
            resolve_interval: crate::config::env_duration(
                RESOLVE_INTERVAL_VAR,
                DEFAULT_RESOLVE_INTERVAL,
            )?,
        })
    }

    /// `resolver`, with the default interval.
    pub fn with_resolver(resolver: impl Resolve) -> Self {
        Self {
            resolver: Arc::new(resolver),
            resolve_interval: DEFAULT_RESOLVE_INTERVAL,
        }
    }
}

impl fmt::Debug for Balancing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balancing")
            .field("resolve_interval", &self.resolve_interval)
            .finish_non_exhaustive()
    }
}

/// One URL of a target.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// The URL as dialled (`https://` under TLS): the `:authority` of calls.
    uri: Uri,
    /// Its host, without the brackets of an IPv6 literal: the name TLS verifies.
    host: String,
    port: u16,
    /// The address, when the host is an IP literal (nothing to resolve).
    ip: Option<IpAddr>,
}

impl Target {
    /// The URL of a target given as one IP address, which has nothing to balance.
    pub(crate) fn single_address(targets: &[Target]) -> Option<&Uri> {
        match targets {
            [t] if t.ip.is_some() => Some(&t.uri),
            _ => None,
        }
    }

    /// The socket address of a target given as one IP address.
    pub(crate) fn single_socket_addr(targets: &[Target]) -> Option<std::net::SocketAddr> {
        match targets {
            [t] => t.ip.map(|ip| std::net::SocketAddr::new(ip, t.port)),
            _ => None,
        }
    }
}

/// Parses `http://a:1` or `http://a:1,http://b:2`, dialled over TLS or not.
pub(crate) fn parse_targets(uris: &str, tls: bool) -> anyhow::Result<Vec<Target>> {
    let mut targets = Vec::new();
    for uri in uris.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let dialled = crate::tls::dial_uri(uri, tls)?;
        let parsed: Uri = dialled
            .parse()
            .with_context(|| format!("invalid service URL {uri:?}"))?;
        let Some(host) = parsed.host() else {
            bail!("service URL {uri:?} has no host");
        };
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = parsed
            .port_u16()
            .unwrap_or(if parsed.scheme_str() == Some("https") {
                443
            } else {
                80
            });
        targets.push(Target {
            ip: host.parse().ok(),
            uri: parsed,
            host,
            port,
        });
    }
    if targets.is_empty() {
        bail!("no service URL in {uris:?}");
    }
    Ok(targets)
}

/// A channel balanced over every address of `targets`, following changes (see the module
/// docs). It must be created inside a Tokio runtime; its task ends when the last clone of the
/// channel is dropped.
pub(crate) fn channel(
    targets: Vec<Target>,
    tls: Option<&TlsConfig>,
    balancing: &Balancing,
) -> Channel {
    let (channel, changes) = Channel::balance_channel(CHANGES_CAPACITY);
    let balancer = Balancer {
        targets,
        tls: tls.cloned(),
        resolver: balancing.resolver.clone(),
        interval: balancing.resolve_interval,
        changes,
        known: BTreeMap::new(),
        inserted: BTreeSet::new(),
    };
    tokio::spawn(balancer.run());
    channel
}

/// What an address's health watch last saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Health {
    /// Not heard from yet: calls go there only while no address serves.
    Unknown,
    Up,
    Down,
}

/// An address some target resolved to.
struct Known {
    target: usize,
    health: Health,
    /// The health watch, stopped when the address goes away.
    watch: JoinHandle<()>,
}

impl Drop for Known {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// The task behind a balanced channel: resolves, watches health, and tells the channel which
/// endpoints to balance over.
struct Balancer {
    targets: Vec<Target>,
    tls: Option<TlsConfig>,
    resolver: Arc<dyn Resolve>,
    interval: Duration,
    changes: mpsc::Sender<Change<Key, Endpoint>>,
    /// Every address the targets resolved to.
    known: BTreeMap<SocketAddr, Known>,
    /// The endpoints the channel balances over.
    inserted: BTreeSet<Key>,
}

/// An endpoint of the channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Key {
    /// One resolved address.
    Addr(SocketAddr),
    /// Target `i` dialled by name, while no address of any target is known (its name does not
    /// resolve yet): calls fail fast, as they would with one connection, instead of waiting.
    Unresolved(usize),
}

impl Balancer {
    async fn run(mut self) {
        let (health_tx, mut health_rx) = mpsc::unbounded_channel();
        // First calls wait (briefly) for the first health answers, so they do not go to an
        // address nothing listens on (`localhost` is often 127.0.0.1 and ::1).
        self.resolve(&health_tx).await;
        let mut next_resolve = Instant::now() + self.interval;
        let first_answers = Instant::now() + FIRST_HEALTH_WAIT;
        while self.known.values().any(|k| k.health == Health::Unknown) {
            match tokio::time::timeout_at(first_answers, health_rx.recv()).await {
                Ok(Some((addr, health))) => {
                    self.set_health(addr, health, &mut next_resolve);
                }
                _ => break,
            }
        }
        loop {
            if !self.update().await {
                return;
            }
            tokio::select! {
                // Every clone of the channel is gone.
                () = self.changes.closed() => return,
                () = tokio::time::sleep_until(next_resolve) => {
                    self.resolve(&health_tx).await;
                    next_resolve = Instant::now() + self.interval;
                }
                Some((addr, health)) = health_rx.recv() => {
                    self.set_health(addr, health, &mut next_resolve);
                }
            }
        }
    }

    /// Records what `addr`'s health watch saw; losing an address brings the next resolution
    /// forward (the replica may have moved).
    fn set_health(&mut self, addr: SocketAddr, health: Health, next_resolve: &mut Instant) {
        let Some(known) = self.known.get_mut(&addr) else {
            return;
        };
        if health == Health::Down && known.health != Health::Down {
            tracing::debug!(%addr, "endpoint down");
            *next_resolve = (*next_resolve).min(Instant::now() + RESOLVE_AFTER_LOSS);
        }
        known.health = health;
    }

    /// Resolves every target again and starts or stops health watches to match.
    async fn resolve(&mut self, health_tx: &mpsc::UnboundedSender<(SocketAddr, Health)>) {
        let mut found: BTreeMap<SocketAddr, usize> = BTreeMap::new();
        for (i, target) in self.targets.iter().enumerate() {
            let addrs = match target.ip {
                Some(ip) => Ok(vec![SocketAddr::new(ip, target.port)]),
                None => tokio::time::timeout(
                    RESOLVE_TIMEOUT,
                    self.resolver.resolve(&target.host, target.port),
                )
                .await
                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            };
            match addrs {
                Ok(addrs) if !addrs.is_empty() => {
                    for addr in addrs {
                        found.entry(addr).or_insert(i);
                    }
                }
                result => {
                    let error = result.err().map(|e| e.to_string());
                    tracing::warn!(
                        target = %target.uri,
                        error = error.as_deref().unwrap_or("no address"),
                        "failed to resolve service, keeping its known addresses"
                    );
                    for (addr, known) in &self.known {
                        if known.target == i {
                            found.entry(*addr).or_insert(i);
                        }
                    }
                }
            }
        }
        self.known.retain(|addr, _| found.contains_key(addr));
        for (addr, i) in found {
            if self.known.contains_key(&addr) {
                continue;
            }
            let Some(endpoint) = self.endpoint(i, addr) else {
                continue;
            };
            tracing::debug!(target = %self.targets[i].uri, %addr, "new endpoint");
            let watch = tokio::spawn(watch_health(endpoint, addr, health_tx.clone()));
            self.known.insert(
                addr,
                Known {
                    target: i,
                    health: Health::Unknown,
                    watch,
                },
            );
        }
    }

    /// Tells the channel to balance over the addresses that serve; while none does, over
    /// those not heard from yet, else over all of them (calls then fail fast), else — no name
    /// resolved — over the targets dialled by name. Returns false when the channel is gone.
    async fn update(&mut self) -> bool {
        let with = |health: Option<Health>| -> BTreeSet<Key> {
            self.known
                .iter()
                .filter(|(_, k)| health.is_none_or(|h| k.health == h))
                .map(|(addr, _)| Key::Addr(*addr))
                .collect()
        };
        let mut wanted = with(Some(Health::Up));
        if wanted.is_empty() {
            wanted = with(Some(Health::Unknown));
        }
        if wanted.is_empty() {
            wanted = with(None);
        }
        if wanted.is_empty() {
            wanted = (0..self.targets.len()).map(Key::Unresolved).collect();
        }
        let gone: Vec<Key> = self.inserted.difference(&wanted).copied().collect();
        for key in gone {
            self.inserted.remove(&key);
            if self.changes.send(Change::Remove(key)).await.is_err() {
                return false;
            }
        }
        let new: Vec<Key> = wanted.difference(&self.inserted).copied().collect();
        for key in new {
            let endpoint = match key {
                Key::Addr(addr) => self
                    .known
                    .get(&addr)
                    .and_then(|k| self.endpoint(k.target, addr)),
                Key::Unresolved(i) => self.endpoint_by_name(i),
            };
            let Some(endpoint) = endpoint else { continue };
            self.inserted.insert(key);
            if self
                .changes
                .send(Change::Insert(key, endpoint))
                .await
                .is_err()
            {
                return false;
            }
        }
        true
    }

    /// The endpoint of `addr`, one of target `i`'s addresses: it dials `addr` and presents
    /// itself as the target (the `:authority` of calls and the name TLS verifies stay the
    /// target's).
    fn endpoint(&self, i: usize, addr: SocketAddr) -> Option<Endpoint> {
        let target = &self.targets[i];
        let scheme = target.uri.scheme_str().unwrap_or("http");
        Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(anyhow::Error::from)
            .and_then(|e| {
                super::dial::configure(
                    e.origin(target.uri.clone()),
                    self.tls.as_ref(),
                    Some(&target.host),
                )
            })
            .inspect_err(
                |e| tracing::warn!(target = %target.uri, %addr, error = %e, "unusable endpoint"),
            )
            .ok()
    }

    /// Target `i`, dialled by name.
    fn endpoint_by_name(&self, i: usize) -> Option<Endpoint> {
        let target = &self.targets[i];
        super::dial::configure(Endpoint::from(target.uri.clone()), self.tls.as_ref(), None)
            .inspect_err(|e| tracing::warn!(target = %target.uri, error = %e, "unusable endpoint"))
            .ok()
    }
}

/// Watches the health of `addr` on a connection of its own, reporting every change, for as
/// long as the task runs.
async fn watch_health(
    endpoint: Endpoint,
    addr: SocketAddr,
    report: mpsc::UnboundedSender<(SocketAddr, Health)>,
) {
    let mut backoff = MIN_WATCH_BACKOFF;
    loop {
        let served = watch_once(&endpoint, addr, &report).await;
        let _ = report.send((addr, Health::Down));
        if served {
            backoff = MIN_WATCH_BACKOFF;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_WATCH_BACKOFF);
    }
}

/// One health watch, until the connection fails or the server stops serving; returns whether
/// it saw the server serving.
async fn watch_once(
    endpoint: &Endpoint,
    addr: SocketAddr,
    report: &mpsc::UnboundedSender<(SocketAddr, Health)>,
) -> bool {
    let Ok(channel) = endpoint.connect().await else {
        return false;
    };
    let mut client = HealthClient::new(channel);
    let request = HealthCheckRequest {
        service: String::new(),
    };
    let mut stream = match client.watch(request).await {
        Ok(response) => response.into_inner(),
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            // No health service: serving while it answers at all. Check again later.
            let _ = report.send((addr, Health::Up));
            tokio::time::sleep(DEFAULT_RESOLVE_INTERVAL).await;
            return true;
        }
        Err(_) => return false,
    };
    let mut served = false;
    // Anything but SERVING ends the watch and closes its connection, so a draining server is
    // not held open by it.
    while let Ok(Some(message)) = stream.message().await {
        if message.status() != ServingStatus::Serving {
            break;
        }
        served = true;
        let _ = report.send((addr, Health::Up));
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_from_one_url_or_a_list() {
        let one = parse_targets("http://vision:50052", false).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(
            (one[0].host.as_str(), one[0].port, one[0].ip),
            ("vision", 50052, None)
        );
        assert!(Target::single_address(&one).is_none());

        let list = parse_targets("http://127.0.0.2:7, http://[::1]:8,", false).unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].ip, Some("127.0.0.2".parse().unwrap()));
        assert_eq!(list[1].ip, Some("::1".parse().unwrap()));
        assert_eq!(list[1].host, "::1");

        assert!(
            Target::single_address(&parse_targets("http://127.0.0.1:9", false).unwrap()).is_some()
        );
        assert_eq!(parse_targets("https://vision", true).unwrap()[0].port, 443);
        assert!(parse_targets(" , ", false).is_err());
    }

    #[tokio::test]
    async fn a_name_with_one_address_works_over_tls_verified_against_the_name() {
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
        // The certificate names `localhost` only: verifying the address dialled would fail.
        let ca = crate::testing::pki::TestCa::new("balance test CA");
        let cert = ca.issue(&["localhost"]);
        let tls = ca.tls_config(&cert, true);
        let server = crate::testing::spawn({
            let tls = tls.clone();
            move |listener, shutdown| async move {
                crate::server::serve_with_tls(
                    tonic::service::Routes::default(),
                    &[],
                    crate::metrics::Metrics::default(),
                    listener,
                    Some(tls),
                    shutdown,
                )
                .await
            }
        })
        .await;

        let uri = format!("http://localhost:{}", server.addr.port());
        let channel = crate::client::channel_with_tls(&uri, Some(&tls)).expect("balanced channel");
        for _ in 0..5 {
            HealthClient::new(channel.clone())
                .check(HealthCheckRequest::default())
                .await
                .expect("call over TLS succeeds");
        }
        server.stop().await.expect("server stops");
    }
}
