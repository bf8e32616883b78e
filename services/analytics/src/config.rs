//! The analytics service's settings and where they come from.

use std::{
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use anyhow::bail;
use ecoscan_common::config::{env_duration, env_opt, env_or};
use ecoscan_objects::ObjectStoreConfig;

/// Default database: a SQLite file under `./data`.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://./data/analytics.db?mode=rwc";

/// Default directory for LLM request/response bodies.
pub const DEFAULT_BODY_DIR: &str = "./data/analytics-bodies";

/// Prefix of the body objects' keys in a shared bucket.
pub const BODY_KEY_PREFIX: &str = "analytics-bodies/";

/// The spool directory when the rows are not in a SQLite file (see [`Config::spool_dir`]).
pub const DEFAULT_SPOOL_DIR: &str = "./data/analytics-spool";

/// Name of the spool directory beside a SQLite database file.
const SPOOL_DIR_NAME: &str = "analytics-spool";

/// Configuration of the analytics service.
///
/// Environment variables:
/// - `ANALYTICS_DATABASE_URL`, else `DATABASE_URL`: sqlx database URL (default
///   `sqlite://./data/analytics.db?mode=rwc`, the parent directory of a file is created; a
///   `postgres://` URL selects PostgreSQL, whose migrations are applied at start).
/// - `S3_ENDPOINT` + `S3_BUCKET` (+ `S3_REGION`, `S3_ACCESS_KEY_ID`, `S3_SECRET_ACCESS_KEY`): keep
///   the bodies in S3 under `analytics-bodies/` (see `ecoscan_objects::S3Config`); unset, they go
///   to `ANALYTICS_BODY_DIR` (default `./data/analytics-bodies`).
/// - `ANALYTICS_BATCH_MAX_ROWS`: most calls per group commit (default 500, at most 1000).
/// - `ANALYTICS_BATCH_LINGER`: how long a batch waits for more calls, e.g. `2ms` (default 2 ms).
/// - `ANALYTICS_BATCH_IN_FLIGHT`: full batches written at once under a backlog (default 2, 1 to
///   16; at a steady rate batches form as with 1, so 2 raises the most calls a second by a
///   third without the tail paying for it: see bench/notes/analytics-ingest.md).
/// - `ANALYTICS_QUEUE_CAPACITY`: calls queued for the writer before callers wait (default 4096).
/// - `ANALYTICS_SPOOL_DIR`: where batches go when the stores fail (S3 or SQL), until a background
///   task writes them to the stores (default: `analytics-spool` beside the SQLite database file,
///   i.e. `./data/analytics-spool`; with PostgreSQL `./data/analytics-spool`). One process per
///   directory (it is locked); the spool is replayed at start.
/// - `ANALYTICS_SPOOL_MAX_BYTES`: most bytes the spool may hold (default 1073741824, 1 GiB); past
///   it, while the stores fail, calls are refused with `RESOURCE_EXHAUSTED` and a `retry-after`.
/// - `ANALYTICS_STORE_TIMEOUT`: longest a batch may take to reach the stores before it is spooled
///   instead, e.g. `5s` (default 5 s); also bounds each replay attempt.
/// - `ANALYTICS_SPOOL_RETRY_MAX`: longest pause between replay attempts while the stores keep
///   failing (default `10s`; attempts start 100 ms apart and double); also the `retry-after`
///   suggested when the spool is full (whole seconds, 1 to 60).
/// - `ANALYTICS_PRICES`: the price table each call is priced by, `[<YYYY-MM-DD>=]<path>` entries
///   separated by commas: files in the format of LiteLLM's `model_prices_and_context_window.json`,
///   each in effect from its day (UTC; always, without one). Unset: every call of a real provider
///   is recorded with its cost unknown (the mock's cost 0). See `crate::prices`.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    /// Where the request/response bodies go (one object per batch).
    pub bodies: ObjectStoreConfig,
    pub batch_max_rows: usize,
    pub batch_linger: Duration,
    pub batch_in_flight: usize,
    pub queue_capacity: usize,
    /// The spool directory; `None` picks one (see [`Config::spool_dir`]).
    pub spool_dir: Option<PathBuf>,
    pub spool_max_bytes: u64,
    pub store_timeout: Duration,
    pub spool_retry_max: Duration,
    /// What calls cost (`ANALYTICS_PRICES`).
    pub prices: std::sync::Arc<crate::prices::PriceTable>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            bodies: ObjectStoreConfig::Local(PathBuf::from(DEFAULT_BODY_DIR)),
            batch_max_rows: 500,
            batch_linger: Duration::from_millis(2),
            batch_in_flight: 2,
            queue_capacity: 4096,
            spool_dir: None,
            spool_max_bytes: 1 << 30,
            store_timeout: Duration::from_secs(5),
            spool_retry_max: Duration::from_secs(10),
            prices: std::sync::Arc::default(),
        }
    }
}

impl Config {
    /// Reads the configuration from the environment (see the type's docs).
    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        let config = Self {
            database_url: match env_opt("ANALYTICS_DATABASE_URL") {
                Some(url) => url,
                None => env_or("DATABASE_URL", d.database_url)?,
            },
            bodies: ObjectStoreConfig::from_env(
                env_or("ANALYTICS_BODY_DIR", PathBuf::from(DEFAULT_BODY_DIR))?,
                BODY_KEY_PREFIX,
            )?,
            batch_max_rows: env_or("ANALYTICS_BATCH_MAX_ROWS", d.batch_max_rows)?,
            batch_linger: env_duration("ANALYTICS_BATCH_LINGER", d.batch_linger)?,
            batch_in_flight: env_or("ANALYTICS_BATCH_IN_FLIGHT", d.batch_in_flight)?,
            queue_capacity: env_or("ANALYTICS_QUEUE_CAPACITY", d.queue_capacity)?,
            spool_dir: env_opt("ANALYTICS_SPOOL_DIR").map(PathBuf::from),
            spool_max_bytes: env_or("ANALYTICS_SPOOL_MAX_BYTES", d.spool_max_bytes)?,
            store_timeout: env_duration("ANALYTICS_STORE_TIMEOUT", d.store_timeout)?,
            spool_retry_max: env_duration("ANALYTICS_SPOOL_RETRY_MAX", d.spool_retry_max)?,
            prices: std::sync::Arc::new(crate::prices::PriceTable::from_env()?),
        };
        config.validate()?;
        Ok(config)
    }

    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if !(1..=1000).contains(&self.batch_max_rows) {
            bail!(
                "batch_max_rows must be between 1 and 1000, got {}",
                self.batch_max_rows
            );
        }
        if !(1..=16).contains(&self.batch_in_flight) {
            bail!(
                "batch_in_flight must be between 1 and 16, got {}",
                self.batch_in_flight
            );
        }
        if self.queue_capacity == 0 {
            bail!("queue_capacity must be at least 1");
        }
        if self.spool_max_bytes == 0 {
            bail!("spool_max_bytes must be at least 1");
        }
        if self.store_timeout.is_zero() {
            bail!("store_timeout must be longer than 0");
        }
        if self.spool_retry_max.is_zero() {
            bail!("spool_retry_max must be longer than 0");
        }
        Ok(())
    }

    /// The spool directory: `spool_dir` when set, else `analytics-spool` beside the SQLite
    /// database file (so every embedded suite keeps its spool with its data), else
    /// [`DEFAULT_SPOOL_DIR`].
    pub fn spool_dir(&self) -> PathBuf {
        if let Some(dir) = &self.spool_dir {
            return dir.clone();
        }
        sqlite_file(&self.database_url)
            .and_then(|file| file.parent().map(|dir| dir.join(SPOOL_DIR_NAME)))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SPOOL_DIR))
    }

    /// The retry delay suggested to callers refused because the spool is full.
    pub(crate) fn full_retry_after(&self) -> Duration {
        Duration::from_secs(self.spool_retry_max.as_secs_f64().ceil().clamp(1.0, 60.0) as u64)
    }
}

/// The file of a SQLite database URL, if it names one.
fn sqlite_file(url: &str) -> Option<PathBuf> {
    if crate::store::is_postgres(url) || url.contains(":memory:") || url.contains("mode=memory") {
        return None;
    }
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
    Some(Path::new(options.get_filename()).to_path_buf())
}

impl Config {
    /// Switches this configuration onto the production stores the environment names, store by
    /// store, and leaves the rest as it is: `ANALYTICS_DATABASE_URL`/`DATABASE_URL` when it is a
    /// `postgres://` URL (call rows), the `S3_*` variables (bodies), `ANALYTICS_SPOOL_DIR` (the
    /// spool; unset, it stays where the embedded configuration puts it, beside its SQLite file,
    /// even when the rows move to PostgreSQL). `ecoscan up` builds its own embedded configuration
    /// and passes it through here.
    pub fn with_stores_from_env(mut self) -> anyhow::Result<Self> {
        if let Some(dir) = env_opt("ANALYTICS_SPOOL_DIR") {
            self.spool_dir = Some(PathBuf::from(dir));
        }
        if let Some(url) = env_opt("ANALYTICS_DATABASE_URL")
            .or_else(|| env_opt("DATABASE_URL"))
            .filter(|u| crate::store::is_postgres(u))
        {
            self.spool_dir = Some(self.spool_dir());
            self.database_url = url;
        }
        if let Some(s3) = ecoscan_objects::S3Config::from_env(BODY_KEY_PREFIX)? {
            self.bodies = ObjectStoreConfig::S3(s3);
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spool_sits_beside_the_sqlite_file_unless_named() {
        let on = |url: &str| Config {
            database_url: url.into(),
            ..Config::default()
        };
        assert_eq!(
            Config::default().spool_dir(),
            Path::new("./data/analytics-spool")
        );
        assert_eq!(
            on("sqlite:///srv/suite/analytics.db?mode=rwc").spool_dir(),
            Path::new("/srv/suite/analytics-spool")
        );
        assert_eq!(
            on("postgres://u@h/db").spool_dir(),
            Path::new(DEFAULT_SPOOL_DIR)
        );
        assert_eq!(
            on("sqlite::memory:").spool_dir(),
            Path::new(DEFAULT_SPOOL_DIR)
        );
        let named = Config {
            spool_dir: Some("/var/spool/a".into()),
            ..on("sqlite:///srv/x.db")
        };
        assert_eq!(named.spool_dir(), Path::new("/var/spool/a"));
        assert_eq!(
            Config::default().full_retry_after(),
            Duration::from_secs(10)
        );
        let quick = Config {
            spool_retry_max: Duration::from_millis(200),
            ..Config::default()
        };
        assert_eq!(quick.full_retry_after(), Duration::from_secs(1));
    }

    #[test]
    fn batches_in_flight_are_between_1_and_16() {
        for (n, valid) in [(0, false), (1, true), (2, true), (16, true), (17, false)] {
            let config = Config {
                batch_in_flight: n,
                ..Config::default()
            };
            assert_eq!(config.validate().is_ok(), valid, "{n}");
        }
    }
}
