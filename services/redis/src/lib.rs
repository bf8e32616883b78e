//! How ecoscan services reach Redis, single server or Cluster alike.
//!
//! - [`Redis`] is a process's handle: one shared multiplexed connection ([`Conn`]) for commands
//!   that answer at once, dedicated connections for blocking commands, and [`Subscriber`]s
//!   for Pub/Sub. Connections per process stay constant whatever the load.
//! - Every connection has a connect timeout, a response timeout ([`Settings::response_timeout`];
//!   blocking connections: their block time plus it), TCP keepalive and `TCP_USER_TIMEOUT`
//!   no longer than the response timeout. A command that gets no answer in time fails, and its
//!   connection is replaced ([`Conn`]) and aborted, not closed: `SO_LINGER` 0 makes the close a
//!   reset that discards what the kernel had not sent yet, so a command its caller gave up on
//!   cannot reach the server later, when the path heals;
//!   a subscription's connection is checked with a `PING` and replaced likewise. So a peer
//!   that stops answering — a paused server, a proxy that stopped forwarding, a half-open
//!   path — costs its callers one timeout, never a hang.
//! - Every connection carries the process's name, so `CLIENT LIST` tells an operator whose
//!   connections they are: on one server as its `name=` (`CLIENT SETNAME`, set again every few
//!   seconds so a reconnected connection gets it back), and as its library name (`CLIENT
//!   SETINFO LIB-NAME`, Redis 7.2 and later) on every connection, Cluster nodes included.
//!
//! - Every command on a [`Conn`] reports its outcome into the handle's [`StoreHealth`]
//!   ([`Redis::health`]): an answer, or a transport fault ([`fault_kind`]), so the process
//!   knows when Redis has stopped answering (a circuit its entry points check, a metric, one
//!   log line each way).
//!
//! Single server or Cluster is a setting ([`Settings::cluster`]); callers use [`Conn`] the
//! same way for both. Keys that one command or script uses together must share a hash tag
//! (`{…}`), which the stores take care of.

mod conn;
mod subscriber;
#[cfg(feature = "testing")]
pub mod testing;

use std::time::Duration;

use ecoscan_common::store_health::{FaultKind, StoreHealth};
use redis::{
    Client, ErrorKind, ProtocolVersion, RedisError,
    aio::{ConnectionLike, ConnectionManagerConfig},
    cluster::{ClusterClient, ClusterClientBuilder},
    io::tcp::{TcpSettings, socket2::TcpKeepalive},
};

pub use conn::Conn;
use conn::Opener;
pub use redis;
pub use subscriber::{Delivery, Subscriber};

/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default of [`Settings::response_timeout`] (`REDIS_RESPONSE_TIMEOUT`).
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle time before TCP keepalive probes start, the interval between probes, and how many
/// unanswered probes drop the connection: a dead peer is noticed within ~25 s even on a
/// connection that only waits for pushes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;
/// The least `TCP_USER_TIMEOUT`, whatever the response timeout: a shorter one would drop
/// connections on an ordinary retransmission.
const MIN_USER_TIMEOUT: Duration = Duration::from_secs(1);

/// Where Redis is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `redis://host:port[/db]` of the server; for a Cluster, one or more seed nodes.
    pub urls: Vec<String>,
    /// Talk Redis Cluster (slots, redirects) instead of one server.
    pub cluster: bool,
    /// How long a command may wait for its answer before it fails and its connection is
    /// replaced; blocking commands get their block time on top ([`Redis::blocking`]).
    pub response_timeout: Duration,
}

impl Settings {
    /// One server at `url`.
    pub fn single(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            cluster: false,
            response_timeout: RESPONSE_TIMEOUT,
        }
    }

    /// A Cluster reached through `seeds`.
    pub fn cluster(seeds: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            urls: seeds.into_iter().map(Into::into).collect(),
            cluster: true,
            response_timeout: RESPONSE_TIMEOUT,
        }
    }

    /// These settings with another [`Self::response_timeout`].
    #[must_use]
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// From the environment: `REDIS_URL` (for a Cluster, a comma-separated list of seed
    /// nodes), `REDIS_CLUSTER` (`true`/`1` for a Cluster) and `REDIS_RESPONSE_TIMEOUT` (`10s`
    /// unless set; `ms`, `s` or `m`, a bare number is milliseconds). `None` when `REDIS_URL`
    /// is unset.
    pub fn from_env() -> Result<Option<Self>, Error> {
        let Some(url) = std::env::var("REDIS_URL")
            .ok()
            .filter(|v| !v.trim().is_empty())
        else {
            return Ok(None);
        };
        let cluster = match std::env::var("REDIS_CLUSTER")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .as_str()
        {
            "" | "0" | "false" | "no" => false,
            "1" | "true" | "yes" => true,
            other => {
                return Err(Error::Config(format!(
                    "REDIS_CLUSTER={other:?} is not a boolean; use true or false"
                )));
            }
        };
        let mut settings = Self::parse(&url, cluster)?;
        if let Some(v) = std::env::var("REDIS_RESPONSE_TIMEOUT")
            .ok()
            .filter(|v| !v.trim().is_empty())
        {
            settings.response_timeout = parse_timeout(&v).ok_or_else(|| {
                Error::Config(format!(
                    "REDIS_RESPONSE_TIMEOUT={v:?} is not a positive duration; use e.g. 10s or 2500ms"
                ))
            })?;
        }
        Ok(Some(settings))
    }

    /// `urls` as `REDIS_URL` writes them: one URL, or comma-separated seeds for a Cluster.
    pub fn parse(urls: &str, cluster: bool) -> Result<Self, Error> {
        let urls: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        if urls.is_empty() {
            return Err(Error::Config("REDIS_URL names no server".into()));
        }
        if !cluster && urls.len() > 1 {
            return Err(Error::Config(
                "REDIS_URL lists several servers; that is a Redis Cluster: set REDIS_CLUSTER=true"
                    .into(),
            ));
        }
        for url in &urls {
            redis::parse_redis_url(url).ok_or_else(|| {
                Error::Config(format!(
                    "REDIS_URL entry {url:?} is not a redis:// URL (e.g. redis://127.0.0.1:6379)"
                ))
            })?;
        }
        Ok(Self {
            urls,
            cluster,
            response_timeout: RESPONSE_TIMEOUT,
        })
    }
}

/// A positive duration as the services' settings write them: `250ms`, `2s`, `1m`, or a bare
/// number of milliseconds.
fn parse_timeout(v: &str) -> Option<Duration> {
    let v = v.trim();
    let (num, unit) = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((v, "ms"), |i| v.split_at(i));
    let n: f64 = num.parse().ok()?;
    let ms = match unit {
        "ms" => n,
        "s" => n * 1_000.0,
        "m" => n * 60_000.0,
        _ => return None,
    };
    (ms.is_finite() && ms >= 1.0).then(|| Duration::from_secs_f64(ms / 1_000.0))
}

/// Failures of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Redis(#[from] RedisError),
}

/// Whether `e` means Redis did not answer (and how), or `None` when Redis answered with an
/// error (`OOM`, `WRONGTYPE`, a script's refusal), which is an answer like any other.
pub fn fault_kind(e: &RedisError) -> Option<FaultKind> {
    if e.is_timeout() {
        Some(FaultKind::TimedOut)
    } else if e.is_connection_refusal() {
        Some(FaultKind::Refused)
    } else if e.is_connection_dropped() {
        Some(FaultKind::Reset)
    } else if matches!(
        e.kind(),
        ErrorKind::Io | ErrorKind::ClusterConnectionNotFound
    ) {
        Some(FaultKind::of_message(&e.to_string()))
    } else {
        None
    }
}

enum Clients {
    Single(Client),
    Cluster(Vec<redis::ConnectionInfo>),
}

/// A process's access to Redis. Clones share everything.
#[derive(Clone)]
pub struct Redis {
    inner: std::sync::Arc<Inner>,
}

struct Inner {
    clients: Clients,
    shared: Conn,
    name: String,
    settings: Settings,
    /// Whether Redis answers, reported into by every command on every connection.
    health: StoreHealth,
    /// Single-server connections whose name is set again now and then (a reconnect loses it).
    named: std::sync::Mutex<Vec<conn::WeakConn>>,
}

/// How often single-server connections get their name set again.
const RENAME_EVERY: Duration = Duration::from_secs(5);

/// `CLIENT SETNAME name` on `conn`.
pub(crate) async fn set_name<C: ConnectionLike>(
    conn: &mut C,
    name: &str,
) -> redis::RedisResult<()> {
    redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query_async(conn)
        .await
}

/// The TCP settings of every connection, for commands answering within `response_timeout`.
///
/// - `TCP_USER_TIMEOUT` = the response timeout: data the kernel could not get acknowledged by
///   then drops the connection. Longer (it was 30 s), a connection its caller had given up on
///   after the response timeout kept retransmitting its unsent commands, and after a short
///   network fault Redis ran them late: lease extensions of jobs already abandoned among them.
///   (It counts only unacknowledged data: a blocking command whose bytes were acknowledged waits
///   as long as it blocks.)
/// - `SO_LINGER` 0: closing a connection (replaced after a timeout, or at shutdown) resets it and
///   discards its unsent bytes rather than leaving the kernel to deliver them.
fn tcp_settings(response_timeout: Duration) -> TcpSettings {
    TcpSettings::default()
        .set_linger_time(Duration::ZERO)
        .set_nodelay(true)
        .set_keepalive(
            TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_RETRIES),
        )
        .set_user_timeout(response_timeout.max(MIN_USER_TIMEOUT))
}

/// `url`'s connection info with our TCP settings, protocol and library name.
fn connection_info(
    url: &str,
    name: &str,
    protocol: ProtocolVersion,
    response_timeout: Duration,
) -> Result<redis::ConnectionInfo, Error> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info()?;
    let redis_settings = info
        .redis_settings()
        .clone()
        .set_protocol(protocol)
        .set_lib_name(name, env!("CARGO_PKG_VERSION"));
    Ok(info
        .set_tcp_settings(tcp_settings(response_timeout))
        .set_redis_settings(redis_settings))
}

impl Redis {
    /// Connects to what `settings` names. `name` (no spaces) labels this process's connections.
    pub async fn connect(settings: &Settings, name: &str) -> Result<Self, Error> {
        let clients = if settings.cluster {
            let infos = settings
                .urls
                .iter()
                .map(|u| {
                    connection_info(u, name, ProtocolVersion::RESP3, settings.response_timeout)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Clients::Cluster(infos)
        } else {
            let info = connection_info(
                &settings.urls[0],
                name,
                ProtocolVersion::RESP2,
                settings.response_timeout,
            )?;
            Clients::Single(Client::open(info)?)
        };
        let health = StoreHealth::new("redis", &settings.urls.join(","));
        let shared = Conn::open(
            opener(&clients, name, settings.response_timeout),
            health.clone(),
        )
        .await?;
        let named = if settings.cluster {
            Vec::new()
        } else {
            vec![shared.downgrade()]
        };
        let redis = Self {
            inner: std::sync::Arc::new(Inner {
                clients,
                shared,
                name: name.to_owned(),
                settings: settings.clone(),
                health,
                named: std::sync::Mutex::new(named),
            }),
        };
        if !settings.cluster {
            tokio::spawn(rename_periodically(std::sync::Arc::downgrade(&redis.inner)));
        }
        Ok(redis)
    }

    /// The shared connection, for commands that answer at once. Never block on it: a
    /// blocking command would stall every command queued behind it.
    pub fn conn(&self) -> Conn {
        self.inner.shared.clone()
    }

    /// Whether this is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.settings.cluster
    }

    /// The label of this process's connections.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A connection of its own for blocking commands (`BLOCK` up to `longest_block`): its
    /// response timeout is the block plus [`Settings::response_timeout`], so a server that
    /// stops answering fails the command instead of hanging it, and the connection is
    /// replaced ([`Conn`]). It also reconnects by itself after a broken socket.
    pub async fn blocking(&self, longest_block: Duration) -> Result<Conn, Error> {
        let timeout = longest_block + self.inner.settings.response_timeout;
        let conn = Conn::open(
            opener(&self.inner.clients, &self.inner.name, timeout),
            self.inner.health.clone(),
        )
        .await?;
        if !self.is_cluster() {
            self.inner
                .named
                .lock()
                .expect("names lock poisoned")
                .push(conn.downgrade());
        }
        Ok(conn)
    }

    /// Whether Redis answers: every command of this handle's connections reports into it.
    pub fn health(&self) -> &StoreHealth {
        &self.inner.health
    }

    /// How long a command may wait for its answer ([`Settings::response_timeout`]).
    pub fn response_timeout(&self) -> Duration {
        self.inner.settings.response_timeout
    }

    /// Subscribes to `channels` on a connection of its own: sharded Pub/Sub (`SSUBSCRIBE`) on
    /// a Cluster, where each channel lives on the node of its slot, plain `SUBSCRIBE` on one
    /// server. Publishers must use the matching command ([`publish_command`]).
    pub async fn subscribe(&self, channels: Vec<String>) -> Result<Subscriber, Error> {
        Subscriber::start(self.clone(), channels).await
    }

    fn single_client(&self) -> Option<&Client> {
        match &self.inner.clients {
            Clients::Single(c) => Some(c),
            Clients::Cluster(_) => None,
        }
    }

    fn cluster_infos(&self) -> Option<&[redis::ConnectionInfo]> {
        match &self.inner.clients {
            Clients::Single(_) => None,
            Clients::Cluster(infos) => Some(infos),
        }
    }
}

/// Sets the name of every single-server connection again, until the handle is gone: a
/// connection that reconnected has none. Cheap (one command per connection every few seconds),
/// and it never waits behind a blocking command for longer than that command's block.
async fn rename_periodically(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(RENAME_EVERY).await;
        let Some(inner) = inner.upgrade() else { return };
        let conns: Vec<Conn> = {
            let mut named = inner.named.lock().expect("names lock poisoned");
            // Connections nobody holds any more are closed: forget them.
            named.retain(|c| c.upgrade().is_some());
            named.iter().filter_map(conn::WeakConn::upgrade).collect()
        };
        for mut conn in conns {
            if let Err(e) = set_name(&mut conn, &inner.name).await {
                tracing::debug!(error = %e, "cannot name a redis connection now");
            }
        }
    }
}

/// How to open a connection to what `clients` names, answering within `response_timeout`.
fn opener(clients: &Clients, name: &str, response_timeout: Duration) -> Opener {
    match clients {
        Clients::Single(client) => Opener::Single {
            client: client.clone(),
            config: ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(response_timeout))
                .set_number_of_retries(3),
            name: name.to_owned(),
        },
        Clients::Cluster(infos) => Opener::Cluster {
            infos: infos.clone(),
            response_timeout,
            name: name.to_owned(),
        },
    }
}

/// The command that publishes to channels [`Redis::subscribe`] listens on: `SPUBLISH` on a
/// Cluster (the message stays on the channel's shard), `PUBLISH` on one server.
pub fn publish_command(cluster: bool) -> &'static str {
    if cluster { "SPUBLISH" } else { "PUBLISH" }
}

fn cluster_client(
    infos: Vec<redis::ConnectionInfo>,
    response_timeout: Duration,
    push: Option<subscriber::PushSink>,
) -> Result<ClusterClient, Error> {
    let mut builder = ClusterClientBuilder::new(infos)
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(response_timeout)
        .tcp_settings(tcp_settings(response_timeout))
        .use_protocol(ProtocolVersion::RESP3)
        .retries(3);
    if let Some(push) = push {
        builder = builder.push_sender(move |info| push(info));
    }
    Ok(builder.build()?)
}

/// Unlinks every key matching `prefix*` on one server, walking it with `SCAN` (never `KEYS`,
/// which would stall a server others use); returns how many keys there were. For tests,
/// benchmarks and tools that keep their keys under a prefix of their own.
pub async fn unlink_prefixed<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
) -> redis::RedisResult<usize> {
    let mut cursor: u64 = 0;
    let mut removed = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            removed += keys.len();
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<()>(conn)
                .await?;
        }
        if next == 0 {
            return Ok(removed);
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_single_and_cluster_urls() {
        let s = Settings::parse("redis://127.0.0.1:6379", false).unwrap();
        assert_eq!(s, Settings::single("redis://127.0.0.1:6379"));
        let c = Settings::parse("redis://127.0.0.1:7000, redis://127.0.0.1:7001", true).unwrap();
        assert_eq!(c.urls.len(), 2);
        assert!(c.cluster);
    }

    #[test]
    fn settings_refuse_what_would_silently_misbehave() {
        let several = Settings::parse("redis://a:1,redis://b:2", false).unwrap_err();
        assert!(several.to_string().contains("REDIS_CLUSTER=true"));
        assert!(Settings::parse(" , ", true).is_err());
        assert!(Settings::parse("http://x", false).is_err());
    }

    #[test]
    fn response_timeouts_read_like_the_other_durations_and_must_be_positive() {
        assert_eq!(parse_timeout("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_timeout("2500ms"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_timeout("750"), Some(Duration::from_millis(750)));
        assert_eq!(parse_timeout("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_timeout("0"), None);
        assert_eq!(parse_timeout("5h"), None);
        assert_eq!(parse_timeout("soon"), None);
        assert_eq!(
            Settings::parse("redis://127.0.0.1:6379", false)
                .unwrap()
                .response_timeout,
            RESPONSE_TIMEOUT
        );
    }
}
