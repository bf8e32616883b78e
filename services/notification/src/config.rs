//! The notification service's settings and where they come from.

use std::time::Duration;

use anyhow::bail;
use ecoscan_common::config::{env_duration, env_opt, env_or};
/// Default database: a SQLite file under `./data`.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://./data/notification.db?mode=rwc";

/// Configuration of the notification service.
///
/// Environment variables:
/// - `NOTIFICATION_DATABASE_URL`, else `DATABASE_URL`: sqlx database URL (default
///   `sqlite://./data/notification.db?mode=rwc`, the parent directory of a file is created; a
///   `postgres://` URL selects PostgreSQL, whose migrations are applied at start).
/// - `REDIS_URL`: schedule on Redis and deliver to subscribers of every replica through Redis
///   Pub/Sub (unset: an in-memory scheduler and in-process delivery, one replica only). With
///   `REDIS_CLUSTER=true` it names one or more seed nodes of a Redis Cluster.
/// - `NOTIFICATION_REDIS_PREFIX`: prefix of every Redis key and channel (default empty), for
///   deployments or tests sharing one Redis.
/// - `NOTIFICATION_POLL_INTERVAL`: with Redis, the longest the delivery loop waits before looking
///   for entries other replicas scheduled, e.g. `100ms` (default 100 ms).
/// - `NOTIFICATION_SUBSCRIBER_BUFFER`: notifications a live subscriber may fall behind by before
///   its stream is ended with RESOURCE_EXHAUSTED (default 64).
/// - `NOTIFICATION_DELIVERY_LEASE`: how long a claimed due notification stays claimed before
///   another round may retry it, e.g. `30s` (default 30 s).
/// - `NOTIFICATION_RECONCILE_INTERVAL`: with Redis, how often a sweep puts scheduled rows that
///   Redis lost (a failed add, a Redis that came back empty) back on the schedule, e.g. `30s`
///   (default 30 s). A sweep also runs soon after the Redis subscription comes back from a lost
///   connection and soon after an add fails; a failed sweep is retried after 1 s, 2 s, … up to
///   this interval.
/// - `NOTIFICATION_RECONCILE_LIMIT`: scheduled notifications one sweep looks at, earliest due
///   first, in pages of 1,000 (default 10000); later ones are looked at as earlier ones are
///   delivered.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    pub subscriber_buffer: usize,
    pub delivery_lease: Duration,
    /// Redis (one server or a Cluster) for scheduling and cross-replica delivery; `None` keeps
    /// both in this process.
    pub redis: Option<ecoscan_redis::Settings>,
    pub redis_prefix: String,
    pub poll_interval: Duration,
    /// With Redis, the longest time between two reconcile sweeps.
    pub reconcile_interval: Duration,
    /// Scheduled rows one reconcile sweep looks at, earliest due first.
    pub reconcile_limit: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            subscriber_buffer: 64,
            delivery_lease: Duration::from_secs(30),
            redis: None,
            redis_prefix: String::new(),
            poll_interval: Duration::from_millis(100),
            reconcile_interval: Duration::from_secs(30),
            reconcile_limit: 10_000,
        }
    }
}

impl Config {
    /// Reads the configuration from the environment (see the type's docs).
    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        let config = Self {
            database_url: match env_opt("NOTIFICATION_DATABASE_URL") {
                Some(url) => url,
                None => env_or("DATABASE_URL", d.database_url)?,
            },
            subscriber_buffer: env_or("NOTIFICATION_SUBSCRIBER_BUFFER", d.subscriber_buffer)?,
            delivery_lease: env_duration("NOTIFICATION_DELIVERY_LEASE", d.delivery_lease)?,
            redis: ecoscan_redis::Settings::from_env()?,
            redis_prefix: env_opt("NOTIFICATION_REDIS_PREFIX").unwrap_or_default(),
            poll_interval: env_duration("NOTIFICATION_POLL_INTERVAL", d.poll_interval)?,
            reconcile_interval: env_duration(
                "NOTIFICATION_RECONCILE_INTERVAL",
                d.reconcile_interval,
            )?,
            reconcile_limit: env_or("NOTIFICATION_RECONCILE_LIMIT", d.reconcile_limit)?,
        };
        config.validate()?;
        Ok(config)
    }

    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if self.subscriber_buffer == 0 {
            bail!("subscriber_buffer must be at least 1");
        }
        if self.delivery_lease.is_zero() {
            bail!("delivery_lease must be positive");
        }
        if self.poll_interval.is_zero() {
            bail!("poll_interval must be positive");
        }
        if self.reconcile_interval.is_zero() {
            bail!("reconcile_interval must be positive (NOTIFICATION_RECONCILE_INTERVAL)");
        }
        if self.reconcile_limit == 0 {
            bail!("reconcile_limit must be at least 1 (NOTIFICATION_RECONCILE_LIMIT)");
        }
        Ok(())
    }
}

impl Config {
    /// Switches this configuration onto the production stores the environment names, store by
    /// store, and leaves the rest as it is: `NOTIFICATION_DATABASE_URL`/`DATABASE_URL` when it is
    /// a `postgres://` URL (the inbox), `REDIS_URL` and `NOTIFICATION_REDIS_PREFIX` (schedule and
    /// cross-replica delivery), and `NOTIFICATION_RECONCILE_INTERVAL` and
    /// `NOTIFICATION_RECONCILE_LIMIT` (how Redis is kept in line with the rows) when set.
    /// `ecoscan up` builds its own embedded configuration and passes it through here.
    pub fn with_stores_from_env(mut self) -> anyhow::Result<Self> {
        if let Some(url) = env_opt("NOTIFICATION_DATABASE_URL")
            .or_else(|| env_opt("DATABASE_URL"))
            .filter(|u| crate::store::is_postgres(u))
        {
            self.database_url = url;
        }
        if let Some(redis) = ecoscan_redis::Settings::from_env()? {
            self.redis = Some(redis);
        }
        if let Some(prefix) = env_opt("NOTIFICATION_REDIS_PREFIX") {
            self.redis_prefix = prefix;
        }
        self.reconcile_interval =
            env_duration("NOTIFICATION_RECONCILE_INTERVAL", self.reconcile_interval)?;
        self.reconcile_limit = env_or("NOTIFICATION_RECONCILE_LIMIT", self.reconcile_limit)?;
        Ok(self)
    }
}
