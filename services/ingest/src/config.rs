//! Configuration from the environment.

use std::{path::PathBuf, time::Duration};

use ecoscan_common::config::{env_duration, env_opt, env_or};
use ecoscan_objects::S3Config;

use crate::allowlist::Allowlist;

/// Feed shards unless configured (`INGEST_FEED_SHARDS`): enough to spread jobs over the
/// masters of a Cluster; every hub subscribes to all of them on one connection.
pub const DEFAULT_FEED_SHARDS: u32 = 64;

/// Events kept per job unless configured (`INGEST_EVENT_MAX_LEN`): a bound on a runaway
/// job's memory, not a replay window. It is far above what any job appends (a scan has a few
/// dozen events; with every stage and answer retry running to its deadline and the attempts
/// all used, some ten thousand: answer deltas at most every 250 ms), so a resume from any
/// point of a job's log finds every event after it; a finished job's log goes whole with its
/// TTL (`INGEST_EVENT_TTL`).
pub const DEFAULT_EVENT_MAX_LEN: usize = 100_000;

/// How long the first append of a batch waits for others to join it by default
/// (`INGEST_APPEND_LINGER`): under load many events share one script call, one round trip and
/// one publish; idle, an append waits this long.
pub const DEFAULT_APPEND_LINGER: Duration = Duration::from_millis(5);

/// How the Redis event log is laid out and batches its appends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventLogSettings {
    /// Before every key and channel (`INGEST_REDIS_PREFIX`; `""` in production, a test's own in
    /// tests).
    pub prefix: String,
    /// Events kept per job, about.
    pub max_len: usize,
    /// Feed shards (the same in every process of a deployment).
    pub shards: u32,
    /// How long an append waits for others to share its round trip.
    pub linger: Duration,
}

impl Default for EventLogSettings {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            max_len: DEFAULT_EVENT_MAX_LEN,
            shards: DEFAULT_FEED_SHARDS,
            linger: DEFAULT_APPEND_LINGER,
        }
    }
}

/// Settings of the rows of running jobs kept for `GetResult` ([`crate::pending`]).
#[derive(Clone, Debug)]
pub struct PendingConfig {
    /// The longest an entry is used after its read began; zero keeps nothing.
    pub max_age: Duration,
    /// Entries kept at most.
    pub capacity: usize,
}

impl Default for PendingConfig {
    fn default() -> Self {
        Self {
            max_age: Duration::from_secs(2),
            capacity: 10_000,
        }
    }
}

/// How long a finished job's log is kept (`INGEST_EVENT_TTL`).
pub const DEFAULT_EVENT_TTL: Duration = Duration::from_secs(3600);

/// Tuning of the hub and its watchers.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Messages a watcher may fall behind the hub before it catches up from the log instead.
    pub watcher_buffer: usize,
    /// A watcher that has heard nothing for this long reads the log anyway: a last guard
    /// against any loss the feed could not announce.
    pub idle_check: Duration,
    /// Longest life of one watch stream; the caller reconnects with the last event id.
    pub max_lifetime: Duration,
    /// Rows of running jobs kept for `GetResult` until the feed brings an item of their job.
    pub pending: PendingConfig,
    /// How long a job's log is kept once closed, when a watcher is the one that closes it
    /// (its job finished and the final event never reached the log): `serve` sets it from
    /// `INGEST_EVENT_TTL`, as the workers use.
    pub event_ttl: Duration,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            watcher_buffer: 256,
            idle_check: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(10 * 60),
            pending: PendingConfig::default(),
            event_ttl: DEFAULT_EVENT_TTL,
        }
    }
}

/// Ingest settings. Environment variables (defaults in brackets):
///
/// | variable | meaning |
/// |---|---|
/// | `VISION_URL` `RULE_URL` `ANSWER_URL` `REWARD_URL` `NOTIFICATION_URL` | stage services [`http://127.0.0.1:5005{2,3,4,5,7}`] |
/// | `INGEST_DATABASE_URL`, else `DATABASE_URL` | job rows; `postgres://…` selects PostgreSQL [`sqlite://./data/ingest.db?mode=rwc`] |
/// | `REDIS_URL` | set: event log and dispatch queue on Redis; unset: in memory. For a Cluster, one or more seed nodes, comma-separated |
/// | `REDIS_CLUSTER` | `true`: `REDIS_URL` is a Redis Cluster [false] |
/// | `INGEST_FEED_SHARDS` | feed shards of the event log; the same on every replica [64] |
/// | `INGEST_REDIS_PREFIX` | prefix of every Redis key ingest uses [empty] |
/// | `S3_ENDPOINT` + `S3_BUCKET` (+ `S3_REGION`, `S3_ACCESS_KEY_ID`, `S3_SECRET_ACCESS_KEY`) | set: images in S3; unset: `INGEST_OBJECT_DIR` |
/// | `INGEST_OBJECT_DIR` | image store [`./data/objects`] |
/// | `INGEST_MAX_IN_FLIGHT` | jobs one process runs at once [the backlog limit] |
/// | `INGEST_LEASE` | a claimed job's lease, renewed while it runs [30s] |
/// | `INGEST_MAX_BACKLOG` | jobs waiting or running past which `Submit` sheds load [5000] |
/// | `INGEST_RETRY_AFTER` | retry delay suggested when shedding [5s] |
/// | `INGEST_STAGE_TIMEOUT` | deadline of one stage call, its whole response stream included [120s] |
/// | `INGEST_STAGE_IDLE_TIMEOUT` | longest a stage's stream may stay silent before the call is abandoned (and retried) [90s] |
/// | `INGEST_MAX_ATTEMPTS` | runs of one job (each claim is one: a crash, a lost lease, a store error) before it is failed and dead-lettered [5] |
/// | `INGEST_STAGE_RETRIES` | retries of a stage call that failed transiently [3] |
/// | `INGEST_MAX_IMAGE_BYTES` | largest image accepted, sent or fetched by `image_url` [10485760] |
/// | `INGEST_FETCH_TIMEOUT` | deadline of fetching one `image_url`: every redirect and the whole body [10s] |
/// | `INGEST_FETCH_CONNECT_TIMEOUT` | deadline of resolving and connecting (TCP and TLS) to one `image_url` host [3s] |
/// | `INGEST_FETCH_CONCURRENCY` | `image_url` fetches one process runs at once; past it `Submit` answers `RESOURCE_EXHAUSTED` (retry after 1 s) at once [16] |
/// | `INGEST_FETCH_ALLOW` | comma-separated IPs or CIDR networks an `image_url` may reach although they are refused (loopback, private, link-local, CGNAT, …), e.g. `127.0.0.1/32,::1` [none] |
/// | `INGEST_EVENT_TTL` | how long a finished job's event log is kept [1h] |
/// | `INGEST_EVENT_MAX_LEN` | events kept per job (`XADD MAXLEN ~`): a bound far above any job's events, so a resume always finds what follows its id [100000] |
/// | `INGEST_APPEND_LINGER` | on Redis, how long an event waits for others to share one round trip and publish [5ms] |
/// | `INGEST_DELTA_INTERVAL` | answer text is coalesced into at most one delta event per this interval [250ms] |
/// | `INGEST_WATCH_MAX_LIFETIME` | longest life of one `Watch`/`Scan` stream [10m] |
/// | `INGEST_WATCHER_BUFFER` | events a watcher may fall behind before it reads the log instead [256] |
/// | `INGEST_PENDING_CACHE_MAX_AGE` | a running job's row is kept for `GetResult` until the next event of the job, and used for at most this long after it was read; `0` reads the row every time [2s] |
/// | `INGEST_PENDING_CACHE_ENTRIES` | running jobs' rows kept at most [10000] |
/// | `INGEST_SWEEP_INTERVAL` | how often the sweeper looks for unfinished jobs missing from the queue [30s] |
/// | `INGEST_SWEEP_GRACE` | age below which a job is never swept (it may be between insert and enqueue) [60s] |
/// | `INGEST_DEAD_LETTER_RETRY` | which dead letters are requeued on their own: `off`, or `<kind>:<times>x<backoff>,…` with kinds `attempts` (started too often without finishing) and `store` (a record that cannot be read); the backoff doubles each try [`attempts:3x5m`] |
/// | `INGEST_DEAD_LETTER_INTERVAL` | how often the schedule looks for dead letters due a retry [30s] |
/// | `LLM_MODELS` | the models a scan may choose (`name[=vendor]`, comma-separated; the same list vision and answer read): `Submit` refuses any other [none: no choice] |
/// | `INGEST_UPLOAD_TTL` | how long a direct upload's URL works and the upload may be submitted; one never submitted is then deleted, its object too, at the next sweep (`INGEST_SWEEP_INTERVAL`) [10m] |
#[derive(Clone, Debug)]
pub struct Config {
    pub vision_url: String,
    pub rule_url: String,
    pub answer_url: String,
    pub reward_url: String,
    pub notification_url: String,
    pub database_url: String,
    /// Redis for the event log and the queue; `None` keeps them in memory.
    pub redis: Option<ecoscan_redis::Settings>,
    pub feed_shards: u32,
    pub redis_prefix: String,
    /// S3 for images; `None` uses `object_dir`.
    pub s3: Option<S3Config>,
    pub object_dir: PathBuf,
    /// Jobs this process runs at once.
    pub max_in_flight: usize,
    pub lease: Duration,
    pub max_backlog: u64,
    pub retry_after: Duration,
    pub stage_timeout: Duration,
    /// Longest silence of a stage's response stream.
    pub stage_idle_timeout: Duration,
    pub stage_retries: usize,
    /// Runs of one job before it is dead-lettered.
    pub max_attempts: u32,
    pub max_image_bytes: usize,
    /// Deadline of one `image_url` fetch, redirects and body included.
    pub fetch_timeout: Duration,
    /// Deadline of resolving and connecting to one `image_url` hop.
    pub fetch_connect_timeout: Duration,
    /// `image_url` fetches this process runs at once; more are refused, not queued.
    pub fetch_concurrency: usize,
    /// Addresses an `image_url` may reach although their range is refused (see
    /// [`crate::fetch::addr`]). Empty: only public addresses.
    pub fetch_allow: Allowlist,
    pub event_ttl: Duration,
    pub event_max_len: usize,
    /// How long an event waits for others to share its Redis round trip (`INGEST_APPEND_LINGER`).
    pub append_linger: Duration,
    /// Answer deltas are coalesced into at most one event per interval: each event costs a
    /// log append and a publish, so fewer events cost Redis less, and a person reading cannot
    /// tell 20 updates a second from more.
    pub delta_interval: Duration,
    pub hub: HubConfig,
    pub sweep_interval: Duration,
    pub sweep_grace: Duration,
    /// Which dead letters the schedule requeues, how often and after how long.
    pub dead_letter_retry: crate::retry_policy::RetryPolicy,
    pub dead_letter_interval: Duration,
    /// The models a scan may name (`LLM_MODELS`); empty: none may be named.
    pub offered_models: ecoscan_common::models::OfferedModels,
    /// Life of a direct upload: its URL's expiry, and after it the sweep deletes it.
    pub upload_ttl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            vision_url: "http://127.0.0.1:50052".into(),
            rule_url: "http://127.0.0.1:50053".into(),
            answer_url: "http://127.0.0.1:50054".into(),
            reward_url: "http://127.0.0.1:50055".into(),
            notification_url: "http://127.0.0.1:50057".into(),
            database_url: "sqlite://./data/ingest.db?mode=rwc".into(),
            redis: None,
            feed_shards: DEFAULT_FEED_SHARDS,
            redis_prefix: String::new(),
            s3: None,
            object_dir: PathBuf::from("./data/objects"),
            max_in_flight: 5000,
            lease: Duration::from_secs(30),
            max_backlog: 5000,
            retry_after: Duration::from_secs(5),
            stage_timeout: Duration::from_secs(120),
            stage_idle_timeout: Duration::from_secs(90),
            stage_retries: 3,
            max_attempts: 5,
            max_image_bytes: 10 * 1024 * 1024,
            fetch_timeout: Duration::from_secs(10),
            fetch_connect_timeout: Duration::from_secs(3),
            fetch_concurrency: 16,
            fetch_allow: Allowlist::default(),
            event_ttl: DEFAULT_EVENT_TTL,
            event_max_len: DEFAULT_EVENT_MAX_LEN,
            append_linger: DEFAULT_APPEND_LINGER,
            delta_interval: Duration::from_millis(250),
            hub: HubConfig::default(),
            sweep_interval: Duration::from_secs(30),
            sweep_grace: Duration::from_secs(60),
            dead_letter_retry: crate::retry_policy::RetryPolicy::default_schedule(),
            offered_models: ecoscan_common::models::OfferedModels::default(),
            dead_letter_interval: Duration::from_secs(30),
            upload_ttl: Duration::from_secs(10 * 60),
        }
    }
}

impl Config {
    /// The Redis event log's settings, from the flat variables.
    pub fn event_log(&self) -> EventLogSettings {
        EventLogSettings {
            prefix: self.redis_prefix.clone(),
            max_len: self.event_max_len,
            shards: self.feed_shards,
            linger: self.append_linger,
        }
    }

    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        Self {
            vision_url: env_opt("VISION_URL").unwrap_or(d.vision_url),
            rule_url: env_opt("RULE_URL").unwrap_or(d.rule_url),
            answer_url: env_opt("ANSWER_URL").unwrap_or(d.answer_url),
            reward_url: env_opt("REWARD_URL").unwrap_or(d.reward_url),
            notification_url: env_opt("NOTIFICATION_URL").unwrap_or(d.notification_url),
            database_url: env_opt("INGEST_DATABASE_URL")
                .or_else(|| env_opt("DATABASE_URL"))
                .unwrap_or(d.database_url),
            redis: ecoscan_redis::Settings::from_env()?,
            feed_shards: env_or("INGEST_FEED_SHARDS", d.feed_shards)?.max(1),
            redis_prefix: env_opt("INGEST_REDIS_PREFIX").unwrap_or_default(),
            s3: S3Config::from_env("")?,
            object_dir: env_opt("INGEST_OBJECT_DIR").map_or(d.object_dir, PathBuf::from),
            ..d
        }
        .with_tuning_from_env()?
        .with_fetch_from_env()
    }
}

impl Config {
    /// Switches this configuration onto the production stores the environment names, store by
    /// store, and leaves the rest as it is: `REDIS_URL` (event log and queue),
    /// `INGEST_DATABASE_URL`/`DATABASE_URL` when it is a `postgres://` URL (job rows), the
    /// `S3_*` variables (images). `ecoscan up` builds its own embedded configuration and passes
    /// it through here.
    pub fn with_stores_from_env(mut self) -> anyhow::Result<Self> {
        if let Some(url) = env_opt("INGEST_DATABASE_URL")
            .or_else(|| env_opt("DATABASE_URL"))
            .filter(|u| ecoscan_sql::is_postgres(u))
        {
            self.database_url = url;
        }
        if let Some(redis) = ecoscan_redis::Settings::from_env()? {
            self.redis = Some(redis);
        }
        self.feed_shards = env_or("INGEST_FEED_SHARDS", self.feed_shards)?.max(1);
        if let Some(prefix) = env_opt("INGEST_REDIS_PREFIX") {
            self.redis_prefix = prefix;
        }
        if let Some(s3) = S3Config::from_env("")? {
            self.s3 = Some(s3);
        }
        Ok(self)
    }

    /// Applies the tuning variables (leases, limits, timeouts, retries, the event log's bounds,
    /// the hub, the sweeper) over this configuration. `ecoscan up` passes its configuration
    /// through here too, so every setting works there as in `ecoscan serve ingest`.
    pub fn with_tuning_from_env(mut self) -> anyhow::Result<Self> {
        let backlog_set = env_opt("INGEST_MAX_BACKLOG").is_some();
        self.max_backlog = env_or("INGEST_MAX_BACKLOG", self.max_backlog)?;
        // A job waiting on a model is a cheap task: by default a process may run every job the
        // backlog admits.
        let in_flight = if backlog_set {
            usize::try_from(self.max_backlog).unwrap_or(usize::MAX)
        } else {
            self.max_in_flight
        };
        self.max_in_flight = env_or("INGEST_MAX_IN_FLIGHT", in_flight)?.max(1);
        self.lease = env_duration("INGEST_LEASE", self.lease)?;
        self.retry_after = env_duration("INGEST_RETRY_AFTER", self.retry_after)?;
        self.stage_timeout = env_duration("INGEST_STAGE_TIMEOUT", self.stage_timeout)?;
        self.stage_idle_timeout =
            env_duration("INGEST_STAGE_IDLE_TIMEOUT", self.stage_idle_timeout)?;
        self.stage_retries = env_or("INGEST_STAGE_RETRIES", self.stage_retries)?;
        self.max_attempts = env_or("INGEST_MAX_ATTEMPTS", self.max_attempts)?.max(1);
        self.max_image_bytes = env_or("INGEST_MAX_IMAGE_BYTES", self.max_image_bytes)?;
        self.event_ttl = env_duration("INGEST_EVENT_TTL", self.event_ttl)?;
        self.event_max_len = env_or("INGEST_EVENT_MAX_LEN", self.event_max_len)?.max(1);
        self.append_linger = env_duration("INGEST_APPEND_LINGER", self.append_linger)?;
        self.delta_interval = env_duration("INGEST_DELTA_INTERVAL", self.delta_interval)?;
        self.hub.watcher_buffer = env_or("INGEST_WATCHER_BUFFER", self.hub.watcher_buffer)?.max(1);
        self.hub.max_lifetime = env_duration("INGEST_WATCH_MAX_LIFETIME", self.hub.max_lifetime)?;
        self.hub.pending.max_age =
            env_duration("INGEST_PENDING_CACHE_MAX_AGE", self.hub.pending.max_age)?;
        self.hub.pending.capacity =
            env_or("INGEST_PENDING_CACHE_ENTRIES", self.hub.pending.capacity)?;
        self.sweep_interval = env_duration("INGEST_SWEEP_INTERVAL", self.sweep_interval)?;
        self.sweep_grace = env_duration("INGEST_SWEEP_GRACE", self.sweep_grace)?;
        if let Some(v) = env_opt("INGEST_DEAD_LETTER_RETRY") {
            self.dead_letter_retry = v
                .parse()
                .map_err(|e| anyhow::anyhow!("INGEST_DEAD_LETTER_RETRY: {e}"))?;
        }
        self.dead_letter_interval =
            env_duration("INGEST_DEAD_LETTER_INTERVAL", self.dead_letter_interval)?;
        self.offered_models = ecoscan_common::models::OfferedModels::from_env()?;
        self.upload_ttl = env_duration("INGEST_UPLOAD_TTL", self.upload_ttl)?;
        // S3 refuses a presigned URL that lives over 7 days; a zero one would never work.
        anyhow::ensure!(
            !self.upload_ttl.is_zero() && self.upload_ttl <= Duration::from_secs(7 * 24 * 3600),
            "INGEST_UPLOAD_TTL must be above 0 and at most 7 days (S3's longest presigned URL)"
        );
        Ok(self)
    }

    /// Applies the `INGEST_FETCH_*` variables (fetching images by URL) over this configuration;
    /// `ecoscan up` passes its configuration through here too, so `INGEST_FETCH_ALLOW` works
    /// there as in `ecoscan serve ingest`.
    pub fn with_fetch_from_env(mut self) -> anyhow::Result<Self> {
        self.fetch_timeout = env_duration("INGEST_FETCH_TIMEOUT", self.fetch_timeout)?;
        self.fetch_connect_timeout =
            env_duration("INGEST_FETCH_CONNECT_TIMEOUT", self.fetch_connect_timeout)?;
        self.fetch_concurrency = env_or("INGEST_FETCH_CONCURRENCY", self.fetch_concurrency)?.max(1);
        self.fetch_allow = env_or("INGEST_FETCH_ALLOW", self.fetch_allow)?;
        Ok(self)
    }
}
