//! The store health's series: `store_up`, `store_faults_total`, `store_pool_connections`.

use std::fmt;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

use super::{FaultKind, StoreHealth};
use crate::metrics::Metrics;

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
