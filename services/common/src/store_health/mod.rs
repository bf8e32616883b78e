//! Whether a store (Redis, PostgreSQL) answers, per store instance: the calls made on it report
//! into one [`StoreHealth`] (`ok()`, or `fault(kind)` for a transport fault), which
//!
//! - trips a circuit when the store has stopped answering: [`Settings::trip_after`] faults in
//!   a row, or a fault after [`Settings::silence`] without a single answer. While it is open,
//!   [`StoreHealth::check`] refuses at once (the entry points — a submit, a new watch — answer
//!   `UNAVAILABLE` with a retry delay instead of waiting out the store's timeout), except for
//!   one probe call once [`Settings::probe_interval`] has passed without a fault (half-open),
//!   never two at once ([`Settings::probe_hold`]);
//!   any call that gets an answer closes it again. Callers that must wait for the store (workers, leases, the sweeper) never
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

use tokio::time::Instant;

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
    /// While open, a call is let through as a probe once this long has passed since the last
    /// probe and the last fault; the retry delay the refused ones are given (rounded up to whole
    /// seconds).
    pub probe_interval: Duration,
    /// Once a probe is let through, no other is until an answer closes the circuit or this
    /// long has passed (a fault cannot say whether it was the probe's): its caller may have
    /// given up on it without a word (a deadline dropped the call), and a probe per interval
    /// while the first still waits made every caller a quarter second apart wait out a timeout.
    pub probe_hold: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            trip_after: 3,
            silence: Duration::from_secs(5),
            // Short: once the store is back, the first call after it (a resuming watcher's,
            // say) gets through within a quarter second; one probe at a time while it is not.
            probe_interval: Duration::from_millis(250),
            // The stores' default timeouts (the Redis response timeout, the PostgreSQL acquire
            // timeout): by then a probe has its answer or its fault.
            probe_hold: Duration::from_secs(10),
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
    /// Its host and port, for `server.address` / `server.port` on store spans.
    server: Option<(String, i64)>,
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
    /// A probe is out, until then (see [`Settings::probe_hold`]).
    probing_until: Option<Instant>,
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
            server: server_of(address),
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

    /// Records where the store is (`server.address`, `server.port`, the conventions' client
    /// attributes) on the store operation's span the caller runs in (`#[db_span]`, named `db`),
    /// so a slow statement's span says which server it waited on; nothing outside one.
    pub fn mark_span(&self) {
        let span = tracing::Span::current();
        if let Some((host, port)) = &self.0.server
            && span.metadata().is_some_and(|m| m.name() == "db")
        {
            span.record("server.address", host.as_str());
            span.record("server.port", *port);
        }
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
            if let Some(open) = state.open.as_mut() {
                // A failed call (a probe that waited out its timeout, say) restarts the
                // interval: the caller right after it is refused, not made the next probe.
                // Not the end of a probe out: the fault may be any other call's (a worker's
                // that waited since before the probe), and ending the hold on it let a second
                // probe out beside the first (services/suite/tests/partition.rs).
                open.next_probe = open.next_probe.max(now + settings.probe_interval);
                false
            } else if state.in_a_row >= settings.trip_after
                || now.saturating_duration_since(state.last_ok) >= settings.silence
            {
                state.open = Some(Open {
                    last_answer: state.last_ok,
                    fault: kind,
                    next_probe: now + settings.probe_interval,
                    probing_until: None,
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
    /// closed; while it is open, one call per probe interval without a fault (the probe), one
    /// at a time, the others refused with [`Down`].
    pub fn check(&self) -> Result<(), Down> {
        if self.is_up() {
            return Ok(());
        }
        let now = Instant::now();
        let mut state = self.state();
        let probe_interval = self.0.settings.probe_interval;
        match state.open.as_mut() {
            None => Ok(()),
            Some(open) if now >= open.next_probe && open.probing_until.is_none_or(|t| now >= t) => {
                open.next_probe = now + probe_interval;
                open.probing_until = Some(now + self.0.settings.probe_hold);
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

/// The host and port of the (first) server a store URL names, its scheme's default port when
/// it names none: `redis://u:p@[::1]/0` → (`::1`, 6379).
pub fn server_of(url: &str) -> Option<(String, i64)> {
    let first = url.split(',').next()?.trim();
    let (scheme, rest) = first.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit('@').next()?;
    let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match host_port.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        }
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => match scheme {
            "postgres" | "postgresql" => 5432,
            "redis" | "rediss" | "redis+cluster" => 6379,
            _ => return None,
        },
    };
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

mod fault;
mod metrics;

pub use fault::FaultKind;
pub use metrics::{PoolReader, PoolStats, STORE_POSTGRES, register, register_sql};

#[cfg(test)]
mod tests;
