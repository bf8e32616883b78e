//! The gateway's admin listener (`GATEWAY_ADMIN_ADDR`, `127.0.0.1:8081` by default): `/metrics`,
//! `/readyz` and `/healthz` for the orchestrator's probes and for Prometheus, on a port of their
//! own so that neither the series nor the probes are part of the public API.
//!
//! Readiness is the gateway's own state only (serving, not draining). The backends' health is
//! watched in the background ([`BackendHealth::monitor`]) and shows as the series
//! `gateway_backend_up{backend}` and in `/readyz`'s body, never as a readiness input: when a
//! backend is down, only the routes that need it fail (503 with `Retry-After`), and every
//! gateway replica stays in the Service for the routes that still work.
//!
//! This module holds what the listener serves ([`Admin`]) and serves it; the probes' handlers
//! are in `routes::health` (the API listener answers `/healthz` too), so that the handlers use
//! this module and not the other way round.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use axum::Router;
use ecoscan_common::{
    CancellationToken,
    client::request,
    metrics::{Labels1, Metrics},
};
use prometheus_client::metrics::{family::Family, gauge::Gauge};
use tokio::net::TcpListener;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::Backend;

/// Address of the admin listener when `GATEWAY_ADMIN_ADDR` is unset.
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:8081";

/// How often each backend's health is checked. Alerts wait minutes, so seconds are plenty, and
/// the cost is four small calls per interval whatever the traffic.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// A health check that takes longer than this counts as unreachable (a hung backend).
const PROBE_DEADLINE: Duration = Duration::from_secs(1);

/// What one health check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum BackendState {
    /// Not checked yet.
    Unknown = 0,
    Serving = 1,
    /// It answered, and is not serving (draining, or its service not registered).
    NotServing = 2,
    /// No answer: refused, reset or timed out.
    Unreachable = 3,
}

impl BackendState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Serving,
            2 => Self::NotServing,
            3 => Self::Unreachable,
            _ => Self::Unknown,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Serving => "serving",
            Self::NotServing => "not_serving",
            Self::Unreachable => "unreachable",
        }
    }
}

/// The last known health of every backend, and the series that shows it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct BackendHealth {
    backends: Arc<[Backend]>,
    states: Arc<[AtomicU8]>,
    up: Family<Labels1, Gauge>,
}

impl BackendHealth {
    /// Registers `gateway_backend_up` in `metrics` for `backends`.
    pub(crate) fn register(metrics: &mut Metrics, backends: Arc<[Backend]>) -> Self {
        let up = Family::<Labels1, Gauge>::default();
        metrics.registry().register(
            "gateway_backend_up",
            "1 when the backend answered its last health check (every 5 s) with SERVING, else 0; \
             the routes that need a backend that is down answer 503",
            up.clone(),
        );
        let states = backends
            .iter()
            .map(|_| AtomicU8::new(BackendState::Unknown as u8))
            .collect();
        Self {
            backends,
            states,
            up,
        }
    }

    /// Each backend's last known state, by name.
    pub(crate) fn snapshot(&self) -> BTreeMap<&'static str, &'static str> {
        self.backends
            .iter()
            .zip(self.states.iter())
            .map(|(b, s)| {
                (
                    b.name,
                    BackendState::from_u8(s.load(Ordering::Relaxed)).as_str(),
                )
            })
            .collect()
    }

    /// Checks every backend now, then every [`PROBE_INTERVAL`] until `shutdown`, recording what
    /// it finds and logging each change.
    pub(crate) async fn monitor(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        // A slow round (a backend hanging until the deadline) delays the next, never bunches.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let checks = self.backends.iter().map(check);
            let found = futures::future::join_all(checks).await;
            for ((backend, slot), state) in self.backends.iter().zip(self.states.iter()).zip(found)
            {
                self.record(backend.name, slot, state);
            }
        }
    }

    fn record(&self, name: &'static str, slot: &AtomicU8, state: BackendState) {
        let before = BackendState::from_u8(slot.swap(state as u8, Ordering::Relaxed));
        self.up
            .get_or_create(&[("backend", name.to_owned())])
            .set(i64::from(state == BackendState::Serving));
        if before == state {
            return;
        }
        if state != BackendState::Serving {
            tracing::warn!(
                backend = name,
                state = state.as_str(),
                "backend unavailable; the routes that need it answer 503"
            );
        } else if before != BackendState::Unknown {
            tracing::info!(backend = name, "backend serving again");
        }
    }
}

/// One health check of `backend`, bounded by [`PROBE_DEADLINE`].
async fn check(backend: &Backend) -> BackendState {
    let req = request(
        HealthCheckRequest {
            service: backend.service.to_owned(),
        },
        PROBE_DEADLINE,
    );
    // The connect timeout of the shared channel is longer than the deadline; bound both.
    let mut client = HealthClient::new(backend.channel.clone());
    match tokio::time::timeout(PROBE_DEADLINE, client.check(req)).await {
        Ok(Ok(res)) if res.get_ref().status == ServingStatus::Serving as i32 => {
            BackendState::Serving
        }
        Ok(Ok(_)) => BackendState::NotServing,
        Ok(Err(status)) => {
            tracing::debug!(backend = backend.name, error = %status, "backend health check failed");
            BackendState::Unreachable
        }
        Err(_) => {
            tracing::debug!(backend = backend.name, "backend health check timed out");
            BackendState::Unreachable
        }
    }
}

/// What the admin listener serves: the gateway's registry, its backends' health and whether it
/// drains.
#[derive(Clone)]
pub(crate) struct Admin {
    pub(crate) registry: Arc<Metrics>,
    pub(crate) health: BackendHealth,
    /// The gateway's shutdown token: cancelled, the gateway is not ready.
    pub(crate) shutdown: CancellationToken,
}

impl Admin {
    /// Whether the gateway drains (a signal arrived) or shuts down.
    pub(crate) fn draining(&self) -> bool {
        self.shutdown.is_cancelled() || ecoscan_common::shutdown::draining().is_cancelled()
    }
}

/// Serves `router`, the admin routes (mounted with the API's, in the crate root, over an
/// [`Admin`]), on `listener` until `shutdown`.
pub(crate) async fn serve(
    router: Router,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().context("listener has no address")?;
    tracing::info!(%addr, "gateway admin listening (/metrics, /readyz, /healthz)");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("gateway admin listener failed")
}
