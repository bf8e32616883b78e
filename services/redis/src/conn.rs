//! [`Conn`]: a connection that is replaced when it stops answering.
//!
//! A response timeout fails the command, but redis-rs keeps the connection: it reconnects only
//! when the socket reports an error, and a stalled peer (a paused server, a proxy or NAT that
//! stopped forwarding, a half-open path whose kernel still acknowledges keepalive probes)
//! reports none, so every later command would time out too. Here the first command that times
//! out has a new connection opened in the background; commands sent meanwhile still go to the
//! old one (which may yet answer), and once the new one is up every clone of the [`Conn`] uses
//! it. A command that timed out may still have run on the server: callers treat the error as
//! "unknown outcome", as with any other lost reply.

use std::{
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use redis::{
    Client, RedisFuture, RedisResult, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster_async::ClusterConnection,
};

use ecoscan_common::store_health::{FaultKind, StoreHealth};

use crate::Error;

/// Pause between attempts to open a replacement when one failed (the server is still down).
const REOPEN_PAUSE: Duration = Duration::from_secs(1);

/// The redis-rs connection underneath: one server's (reconnects by itself when the socket
/// fails) or a Cluster's (one connection per node, routed by slot).
#[derive(Clone)]
enum Raw {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Raw {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// How to open the connection, the first time and after a stall.
#[expect(
    clippy::large_enum_variant,
    reason = "one per connection, made once: its size does not matter"
)]
pub(crate) enum Opener {
    Single {
        client: Client,
        config: ConnectionManagerConfig,
        /// Set with `CLIENT SETNAME` on every connection opened.
        name: String,
    },
    Cluster {
        infos: Vec<redis::ConnectionInfo>,
        response_timeout: Duration,
        name: String,
    },
}

impl Opener {
    async fn open(&self) -> Result<Raw, Error> {
        match self {
            Self::Single {
                client,
                config,
                name,
            } => {
                let mut conn = client
                    .get_connection_manager_with_config(config.clone())
                    .await?;
                crate::set_name(&mut conn, name).await?;
                Ok(Raw::Single(conn))
            }
            Self::Cluster {
                infos,
                response_timeout,
                ..
            } => {
                let client = crate::cluster_client(infos.clone(), *response_timeout, None)?;
                Ok(Raw::Cluster(client.get_async_connection().await?))
            }
        }
    }

    fn name(&self) -> &str {
        match self {
            Self::Single { name, .. } | Self::Cluster { name, .. } => name,
        }
    }
}

/// The connection in use and which one it is.
struct Slot {
    raw: Raw,
    /// Counts replacements: a timeout replaces only the connection it happened on.
    generation: u64,
    /// A replacement is being opened; more timeouts meanwhile open no other.
    replacing: bool,
}

struct Inner {
    slot: Mutex<Slot>,
    opener: Opener,
    /// Told the outcome of every command.
    health: StoreHealth,
}

/// A connection usable for any command: one server's, or a Cluster's (which routes each
/// command to the node owning its keys and follows redirects). Clones share the connection.
/// A command that gets no answer within the response timeout fails with a timeout error
/// ([`redis::RedisError::is_timeout`]), and the connection is replaced (see the module docs).
#[derive(Clone)]
pub struct Conn(Arc<Inner>);

impl Conn {
    pub(crate) async fn open(opener: Opener, health: StoreHealth) -> Result<Self, Error> {
        let raw = opener.open().await?;
        Ok(Self(Arc::new(Inner {
            slot: Mutex::new(Slot {
                raw,
                generation: 0,
                replacing: false,
            }),
            opener,
            health,
        })))
    }

    pub(crate) fn downgrade(&self) -> WeakConn {
        WeakConn(Arc::downgrade(&self.0))
    }

    /// How many times the connection has been replaced after a stall.
    pub fn replacements(&self) -> u64 {
        self.0
            .slot
            .lock()
            .expect("connection slot poisoned")
            .generation
    }

    fn current(&self) -> (u64, Raw) {
        let slot = self.0.slot.lock().expect("connection slot poisoned");
        (slot.generation, slot.raw.clone())
    }

    /// After a command on connection `generation`: the store's health learns whether Redis
    /// answered, and a timeout means that connection stalled.
    fn observe<T>(&self, generation: u64, result: &RedisResult<T>) {
        self.0.health.mark_span();
        match result {
            Ok(_) => self.0.health.ok(),
            Err(e) => {
                let fault = crate::fault_kind(e);
                self.0.health.report(fault);
                mark_span_failed(e, fault);
                if e.is_timeout() {
                    self.replace(generation);
                }
            }
        }
    }

    fn replace(&self, generation: u64) {
        {
            let mut slot = self.0.slot.lock().expect("connection slot poisoned");
            if slot.generation != generation || slot.replacing {
                return;
            }
            slot.replacing = true;
        }
        tracing::warn!(
            connection = self.0.opener.name(),
            "redis connection stopped answering; opening a new one"
        );
        tokio::spawn(reopen(Arc::downgrade(&self.0)));
    }
}

/// Marks the store operation's span (`#[db_span]`, named `db`) this command ran in as failed
/// with the error (`error.type`: the fault's kind, or `redis_error` for an error Redis
/// answered): the span's record of it, without a log line per failed command.
fn mark_span_failed(e: &redis::RedisError, fault: Option<FaultKind>) {
    let span = tracing::Span::current();
    if span.metadata().is_some_and(|m| m.name() == "db") {
        let kind = fault.map_or("redis_error", FaultKind::as_str);
        ecoscan_common::telemetry::record_error(&span, kind, &e.to_string());
    }
}

/// Opens the replacement, retrying until it is up or every handle of the connection is gone.
async fn reopen(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else { return };
        match inner.opener.open().await {
            Ok(raw) => {
                let mut slot = inner.slot.lock().expect("connection slot poisoned");
                // The stalled connection is dropped here; its requests fail or drain.
                slot.raw = raw;
                slot.generation += 1;
                slot.replacing = false;
                tracing::info!(
                    connection = inner.opener.name(),
                    "redis connection replaced"
                );
                return;
            }
            // Every second of an outage, for every connection: one line per interval, the
            // others counted (the store's health says once that Redis stopped answering).
            Err(e) => {
                if let Some(suppressed) = ecoscan_common::log_limit::admit("redis reopen failed") {
                    tracing::warn!(
                        connection = inner.opener.name(),
                        error = %e,
                        suppressed,
                        "cannot open a new redis connection yet; retrying every {} s (at most one \
                         such line per {} s; `suppressed` counts the others)",
                        REOPEN_PAUSE.as_secs(),
                        ecoscan_common::log_limit::INTERVAL.as_secs()
                    );
                }
            }
        }
        drop(inner);
        tokio::time::sleep(REOPEN_PAUSE).await;
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut raw) = self.current();
            let result = raw.req_packed_command(cmd).await;
            self.observe(generation, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut raw) = self.current();
            let result = raw.req_packed_commands(pipeline, offset, count).await;
            self.observe(generation, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().1.get_db()
    }
}

/// A [`Conn`] that does not keep it open.
pub(crate) struct WeakConn(Weak<Inner>);

impl WeakConn {
    pub(crate) fn upgrade(&self) -> Option<Conn> {
        self.0.upgrade().map(Conn)
    }
}
