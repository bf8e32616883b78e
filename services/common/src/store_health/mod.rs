//! Whether a store (Redis, PostgreSQL) answers, per store instance: the calls made on it report
//! into one [`StoreHealth`] (`ok()`, or `fault(kind)` for a transport fault), which
//!
//! - trips a circuit when the store has stopped answering: [`Settings::trip_after`] faults in
//!   a row, or a fault after [`Settings::silence`] without a single answer. While it is open,
//!   [`StoreHealth::check`] refuses at once (the entry points — a submit, a new watch — answer
//!   `UNAVAILABLE` with a retry delay instead of waiting out the store's timeout), except for
//!   one probe call every [`Settings::probe_interval`] (half-open); any call that gets an answer
//!   closes it again. Callers that must wait for the store (workers, leases, the sweeper) never
//!   ask it and go on as before;
//! - logs the transitions, once each: a `warn` line when the store stops answering (the store,
//!   its address without credentials, the fault, what waits on it) and an `info` line when it
//!   is back (how long it was out). Single faults are `debug` lines;
//! - is a metric: `store_up{store,address}` (1/0) and `store_faults_total{store,kind}`
//!   ([`register`]), with the open connections of a pool beside them when one is given.
//!
//! Only transport faults count ([`FaultKind`]: timed out, refused, reset, name not resolved):
//! an answer that is an error (a fenced write, a constraint violation, `OOM`) is an answer, and
//! reported as `ok()`. Each store crate classifies its own errors (`ecoscan_redis::fault_kind`,
//! `ecoscan_sql::fault_kind`); [`FaultKind::of_io`] is what they share.

use std::{
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use tokio::time::Instant;

use crate::metrics::Metrics;

/// A transport fault: the store did not answer. Its name is the `kind` label of
/// `store_faults_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// No answer within the call's timeout (a stalled server, a blackholed path).
    TimedOut,
    /// Nothing listens at the address (the server is stopped).
    Refused,
    /// The connection was reset or closed under the call.
    Reset,
    /// The store's host name did not resolve.
    NameNotResolved,
    /// Any other failure to reach the store (no route, a TLS failure, …).
    Other,
}

impl FaultKind {
    /// Every kind, in the order of the metric's series.
    pub const ALL: [FaultKind; 5] = [
        FaultKind::TimedOut,
        FaultKind::Refused,
        FaultKind::Reset,
        FaultKind::NameNotResolved,
        FaultKind::Other,
    ];

    /// The kind as a label value and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::TimedOut => "timed_out",
            FaultKind::Refused => "refused",
            FaultKind::Reset => "reset",
            FaultKind::NameNotResolved => "name_not_resolved",
            FaultKind::Other => "other",
        }
    }

    /// The kind of a socket error. A failed host name lookup has no kind of its own in
    /// `std::io` and is told by its message (getaddrinfo's, as tokio reports it).
    pub fn of_io(e: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::TimedOut | K::WouldBlock => Self::TimedOut,
            K::ConnectionRefused => Self::Refused,
            K::ConnectionReset
            | K::ConnectionAborted
            | K::BrokenPipe
            | K::UnexpectedEof
            | K::NotConnected => Self::Reset,
            _ => Self::of_message(&e.to_string()),
        }
    }

    /// The kind of a failure to reach a store known only by its message: a failed host name
    /// lookup (getaddrinfo's words, as tokio reports them) or [`Self::Other`].
    pub fn of_message(message: &str) -> Self {
        let message = message.to_ascii_lowercase();
        let unresolved = [
            "failed to lookup address",
            "name or service not known",
            "nodename nor servname",
            "no address associated",
            "temporary failure in name resolution",
        ];
        if unresolved.iter().any(|m| message.contains(m)) {
            Self::NameNotResolved
        } else {
            Self::Other
        }
    }

    fn index(self) -> usize {
        match self {
            FaultKind::TimedOut => 0,
            FaultKind::Refused => 1,
            FaultKind::Reset => 2,
            FaultKind::NameNotResolved => 3,
            FaultKind::Other => 4,
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultKind::TimedOut => "timed out",
            FaultKind::Refused => "connection refused",
            FaultKind::Reset => "connection reset",
            FaultKind::NameNotResolved => "name not resolved",
            FaultKind::Other => "unreachable",
        })
    }
}

/// When the circuit trips and how often it probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Faults in a row, with no answer between them, that trip the circuit (a refused
    /// connection fails at once: a few in a row say the store is down).
    pub trip_after: u32,
    /// A fault this long after the last answer trips the circuit at once: a call that timed
    /// out while nothing else got an answer either (a stalled store fails its calls one
    /// response timeout apart, never several in a row).
    pub silence: Duration,
    /// While open, one call every this long is let through as a probe; the retry delay the
    /// refused ones are given (rounded up to whole seconds).
    pub probe_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            trip_after: 3,
            silence: Duration::from_secs(5),
            probe_interval: Duration::from_secs(1),
        }
    }
}

/// A refusal of [`StoreHealth::check`]: the store is known to be down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Down {
    /// `redis`, `postgres`.
    pub store: &'static str,
    /// The fault that opened the circuit.
    pub fault: FaultKind,
    /// When to try again: the probe interval, in whole seconds (at least one).
    pub retry_after: Duration,
}

impl fmt::Display for Down {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is not answering ({}); try again in {} s",
            self.store,
            self.fault,
            self.retry_after.as_secs()
        )
    }
}

impl std::error::Error for Down {}

/// The health of one store instance, shared by every handle of it: clones report into the
/// same circuit.
#[derive(Clone)]
pub struct StoreHealth(Arc<Inner>);

struct Inner {
    store: &'static str,
    /// Where the store is, credentials and query removed ([`redact_url`]).
    address: String,
    settings: Settings,
    /// What waits on the store in this process, for the line that says it stopped answering.
    waiting: Mutex<&'static str>,
    state: Mutex<State>,
    /// `!open`, readable without the lock (the metric).
    up: AtomicBool,
    faults: [AtomicU64; 5],
}

struct State {
    /// Faults since the last answer.
    in_a_row: u32,
    last_ok: Instant,
    open: Option<Open>,
}

struct Open {
    /// The last answer before the circuit opened: when the store stopped answering, as far
    /// as anyone can tell.
    last_answer: Instant,
    fault: FaultKind,
    next_probe: Instant,
}

impl fmt::Debug for StoreHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreHealth")
            .field("store", &self.0.store)
            .field("address", &self.0.address)
            .field("up", &self.is_up())
            .finish()
    }
}

impl StoreHealth {
    /// The health of `store` (`redis`, `postgres`) at `address` (a URL: credentials are
    /// removed), with the default [`Settings`].
    pub fn new(store: &'static str, address: &str) -> Self {
        Self::with_settings(store, address, Settings::default())
    }

    /// [`Self::new`] with `settings`.
    pub fn with_settings(store: &'static str, address: &str, settings: Settings) -> Self {
        Self(Arc::new(Inner {
            store,
            address: redact_url(address),
            settings,
            waiting: Mutex::new("the calls that need it fail or wait"),
            state: Mutex::new(State {
                in_a_row: 0,
                last_ok: Instant::now(),
                open: None,
            }),
            up: AtomicBool::new(true),
            faults: Default::default(),
        }))
    }

    /// Says what waits on the store in this process, for the line logged when it stops
    /// answering (`"new scans and watches are refused; running scans wait"`).
    pub fn set_waiting(&self, what: &'static str) {
        *self.0.waiting.lock().unwrap_or_else(|e| e.into_inner()) = what;
    }

    /// `redis`, `postgres`.
    pub fn store(&self) -> &'static str {
        self.0.store
    }

    /// The store's address without credentials.
    pub fn address(&self) -> &str {
        &self.0.address
    }

    /// Whether the circuit is closed (the store answers, as far as anyone knows).
    pub fn is_up(&self) -> bool {
        self.0.up.load(Ordering::Relaxed)
    }

    /// Whether the circuit is open: the store has stopped answering.
    pub fn is_open(&self) -> bool {
        !self.is_up()
    }

    /// Faults of `kind` reported so far.
    pub fn faults(&self, kind: FaultKind) -> u64 {
        self.0.faults[kind.index()].load(Ordering::Relaxed)
    }

    /// Whether both are handles of the same store.
    pub fn same(&self, other: &StoreHealth) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call got an answer (an error the store answered with included): the circuit closes.
    pub fn ok(&self) {
        let now = Instant::now();
        let reopened = {
            let mut state = self.state();
            state.in_a_row = 0;
            state.last_ok = now;
            let open = state.open.take();
            if open.is_some() {
                self.0.up.store(true, Ordering::Relaxed);
            }
            open
        };
        if let Some(open) = reopened {
            let out = now.saturating_duration_since(open.last_answer);
            tracing::info!(
                store = self.0.store,
                address = %self.0.address,
                out_for_s = out.as_secs_f64(),
                "{} at {} answers again, {:.1} s after its last answer",
                self.0.store,
                self.0.address,
                out.as_secs_f64()
            );
        }
    }

    /// A call failed without an answer: `kind` says how. May open the circuit.
    pub fn fault(&self, kind: FaultKind) {
        self.0.faults[kind.index()].fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let settings = self.0.settings;
        let tripped = {
            let mut state = self.state();
            state.in_a_row = state.in_a_row.saturating_add(1);
            if state.open.is_some() {
                false
            } else if state.in_a_row >= settings.trip_after
                || now.saturating_duration_since(state.last_ok) >= settings.silence
            {
                state.open = Some(Open {
                    last_answer: state.last_ok,
                    fault: kind,
                    next_probe: now + settings.probe_interval,
                });
                self.0.up.store(false, Ordering::Relaxed);
                true
            } else {
                false
            }
        };
        if tripped {
            let waiting = *self.0.waiting.lock().unwrap_or_else(|e| e.into_inner());
            tracing::warn!(
                store = self.0.store,
                address = %self.0.address,
                fault = kind.as_str(),
                waiting,
                "{} at {} stopped answering ({kind})",
                self.0.store,
                self.0.address,
            );
        } else {
            tracing::debug!(
                store = self.0.store,
                fault = kind.as_str(),
                "store call failed"
            );
        }
    }

    /// Reports the outcome of a call: `None` is an answer (success or an error the store
    /// answered with), `Some(kind)` a transport fault.
    pub fn report(&self, fault: Option<FaultKind>) {
        match fault {
            None => self.ok(),
            Some(kind) => self.fault(kind),
        }
    }

    /// Whether a new request that needs the store may go ahead: at once while the circuit is
    /// closed; while it is open, one call per probe interval (the probe), the others refused
    /// with [`Down`].
    pub fn check(&self) -> Result<(), Down> {
        if self.is_up() {
            return Ok(());
        }
        let now = Instant::now();
        let mut state = self.state();
        let probe_interval = self.0.settings.probe_interval;
        match state.open.as_mut() {
            None => Ok(()),
            Some(open) if now >= open.next_probe => {
                open.next_probe = now + probe_interval;
                Ok(())
            }
            Some(open) => Err(Down {
                store: self.0.store,
                fault: open.fault,
                retry_after: Duration::from_secs(
                    probe_interval.as_secs_f64().ceil().max(1.0) as u64
                ),
            }),
        }
    }
}

/// `url` without what an operator must not see in a log: the user and password, and the query
/// (PostgreSQL URLs may carry `?password=`). Several comma-separated URLs (a Cluster's seeds)
/// are each redacted.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            let one = one.split(['?', '#']).next().unwrap_or_default();
            let (scheme, rest) = match one.find("://") {
                Some(i) => one.split_at(i + 3),
                None => ("", one),
            };
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            let host = authority.rsplit('@').next().unwrap_or_default();
            format!("{scheme}{host}{path}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Connections of a pool, read at scrape time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Open connections, in use or idle.
    pub open: u32,
    /// Open connections waiting in the pool.
    pub idle: u32,
}

/// A pool's connections, read when scraped.
pub type PoolReader = Box<dyn Fn() -> PoolStats + Send + Sync>;

/// Registers the gauges of a service's SQL store ([`register`]) when it is reached over the
/// network (it has a health), telling the health what waits on it in this process.
pub fn register_sql(
    metrics: &mut Metrics,
    health: Option<StoreHealth>,
    waiting: &'static str,
    pool_stats: impl Fn() -> Option<PoolStats> + Send + Sync + 'static,
) {
    let Some(health) = health else { return };
    health.set_waiting(waiting);
    let pool: PoolReader = Box::new(move || pool_stats().unwrap_or_default());
    register(metrics, &[health], vec![(STORE_POSTGRES, pool)]);
}

/// The `store` label of PostgreSQL.
pub const STORE_POSTGRES: &str = "postgres";

/// Registers `store_up{store,address}` and `store_faults_total{store,kind}` for `healths` (each
/// store once, however many handles name it), and `store_pool_connections{store,state}`
/// (`state` = `open` or `idle`) for each of `pools`.
pub fn register(
    metrics: &mut Metrics,
    healths: &[StoreHealth],
    pools: Vec<(&'static str, PoolReader)>,
) {
    let mut distinct: Vec<StoreHealth> = Vec::new();
    for h in healths {
        if !distinct.iter().any(|d| d.same(h)) {
            distinct.push(h.clone());
        }
    }
    metrics
        .registry()
        .register_collector(Box::new(HealthCollector {
            healths: distinct,
            pools,
        }));
}

struct HealthCollector {
    healths: Vec<StoreHealth>,
    pools: Vec<(&'static str, PoolReader)>,
}

impl fmt::Debug for HealthCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthCollector")
            .field("healths", &self.healths)
            .field("pools", &self.pools.len())
            .finish()
    }
}

impl Collector for HealthCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        if !self.healths.is_empty() {
            let gauge = ConstGauge::new(0i64);
            let mut family = encoder.encode_descriptor(
                "store_up",
                "Whether the store answers (0 while its circuit is open: requests that need it are refused at once), by store and address",
                None,
                gauge.metric_type(),
            )?;
            for h in &self.healths {
                let labels = [("store", h.store()), ("address", h.address())];
                ConstGauge::new(i64::from(h.is_up())).encode(family.encode_family(&labels)?)?;
            }
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(
                "store_faults",
                "Calls to a store that got no answer, by store and kind (timed_out, refused, reset, name_not_resolved, other)",
                None,
                counter.metric_type(),
            )?;
            for h in &self.healths {
                for kind in FaultKind::ALL {
                    let labels = [("store", h.store()), ("kind", kind.as_str())];
                    ConstCounter::new(h.faults(kind)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        if !self.pools.is_empty() {
            let gauge = ConstGauge::new(0i64);
            let mut family = encoder.encode_descriptor(
                "store_pool_connections",
                "Connections of a store's pool, by store and state (open: all of them, idle: waiting in the pool)",
                None,
                gauge.metric_type(),
            )?;
            for (store, read) in &self.pools {
                let stats = read();
                for (state, n) in [("open", stats.open), ("idle", stats.idle)] {
                    let labels = [("store", *store), ("state", state)];
                    ConstGauge::new(i64::from(n)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
