//! `ecoscan.v1.AnalyticsService`: records every LLM call (rows in SQL, bodies in an object store)
//! through one group-commit writer, and answers usage aggregates. A batch the stores fail to take
//! goes to a bounded on-disk [`spool`] and is written to them when they recover, so an
//! acknowledged call is never lost to a store outage.

mod error;
pub mod spool;
pub mod store;
pub mod writer;

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, bail};
use ecoscan_common::{
    CancellationToken,
    config::{env_duration, env_opt, env_or},
};
use ecoscan_proto::v1::{
    CallStatus, GetCallRequest, GetCallResponse, LlmCall, RecordRequest, RecordResponse,
    RecordStreamRequest, RecordStreamResponse, UsageRequest, UsageResponse, UsageRow,
    analytics_service_server::{AnalyticsService, AnalyticsServiceServer},
};
use tokio::{net::TcpListener, sync::oneshot};
use tonic::{Request, Response, Status, Streaming};

use ecoscan_objects::ObjectStore;
pub use ecoscan_objects::ObjectStoreConfig;
pub use error::Error;
use spool::{ReplayOptions, Spool, SpoolMetrics};
use store::{AnyCallStore, CallRow, CallStore, UsageSample};
use writer::{Accepted, Ack, BatchOptions, NewCall, Refused, Writer};

/// Fully-qualified gRPC service name.
pub const SERVICE_NAME: &str = "ecoscan.v1.AnalyticsService";

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
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    /// Where the request/response bodies go (one object per batch).
    pub bodies: ObjectStoreConfig,
    pub batch_max_rows: usize,
    pub batch_linger: Duration,
    pub queue_capacity: usize,
    /// The spool directory; `None` picks one (see [`Config::spool_dir`]).
    pub spool_dir: Option<PathBuf>,
    pub spool_max_bytes: u64,
    pub store_timeout: Duration,
    pub spool_retry_max: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            bodies: ObjectStoreConfig::Local(PathBuf::from(DEFAULT_BODY_DIR)),
            batch_max_rows: 500,
            batch_linger: Duration::from_millis(2),
            queue_capacity: 4096,
            spool_dir: None,
            spool_max_bytes: 1 << 30,
            store_timeout: Duration::from_secs(5),
            spool_retry_max: Duration::from_secs(10),
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
            queue_capacity: env_or("ANALYTICS_QUEUE_CAPACITY", d.queue_capacity)?,
            spool_dir: env_opt("ANALYTICS_SPOOL_DIR").map(PathBuf::from),
            spool_max_bytes: env_or("ANALYTICS_SPOOL_MAX_BYTES", d.spool_max_bytes)?,
            store_timeout: env_duration("ANALYTICS_STORE_TIMEOUT", d.store_timeout)?,
            spool_retry_max: env_duration("ANALYTICS_SPOOL_RETRY_MAX", d.spool_retry_max)?,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if !(1..=1000).contains(&self.batch_max_rows) {
            bail!(
                "batch_max_rows must be between 1 and 1000, got {}",
                self.batch_max_rows
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
    fn full_retry_after(&self) -> Duration {
        Duration::from_secs(self.spool_retry_max.as_secs_f64().ceil().clamp(1.0, 60.0) as u64)
    }
}

/// The file of a SQLite database URL, if it names one.
fn sqlite_file(url: &str) -> Option<PathBuf> {
    if store::is_postgres(url) || url.contains(":memory:") || url.contains("mode=memory") {
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
            .filter(|u| store::is_postgres(u))
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

/// Brings the database's schema up to date and returns (`ecoscan-analytics migrate`); `serve`
/// does the same at start.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = AnyCallStore::connect(&config.database_url)
        .await
        .context("failed to migrate the analytics database")?;
    store.close().await;
    Ok(())
}

/// Serves `ecoscan.v1.AnalyticsService` (with health and reflection) on `listener` until
/// `shutdown` is cancelled; calls accepted before shutdown are committed (or spooled) before it
/// returns.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    config.validate()?;
    let mut embedded = Vec::new();
    if !store::is_postgres(&config.database_url) {
        embedded.push((
            "call rows in SQLite",
            "ANALYTICS_DATABASE_URL or DATABASE_URL to a postgres:// URL",
        ));
    }
    if matches!(config.bodies, ObjectStoreConfig::Local(_)) {
        embedded.push((
            "call bodies in a local directory",
            "S3_ENDPOINT and S3_BUCKET",
        ));
    }
    ecoscan_common::config::require_production_stores("analytics", &embedded)?;
    let store = Arc::new(
        AnyCallStore::connect(&config.database_url)
            .await
            .context("failed to open the analytics database")?,
    );
    let bodies = config
        .bodies
        .open()
        .await
        .context("failed to open the analytics body store")?;
    let result = serve_with_stores(config, store.clone(), bodies, listener, shutdown).await;
    store.close().await;
    result
}

/// Like [`serve`], on stores opened by the caller (`config.database_url` and `config.bodies` are
/// not used): tests wrap the stores to inject failures. Opens the spool (replaying what it holds)
/// and leaves the stores open.
pub async fn serve_with_stores<S: CallStore>(
    config: Config,
    store: Arc<S>,
    bodies: Arc<dyn ObjectStore>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    config.validate()?;
    let mut metrics = ecoscan_common::metrics::Metrics::new("analytics");
    let writer_metrics = writer::WriterMetrics::register(&mut metrics);
    let spool_metrics = SpoolMetrics::register(&mut metrics);
    let spool_dir = config.spool_dir();
    let spool = Arc::new(
        Spool::open(&spool_dir, config.spool_max_bytes, spool_metrics.clone())
            .await
            .with_context(|| {
                format!("failed to open the analytics spool {}", spool_dir.display())
            })?,
    );
    let stop_writer = CancellationToken::new();
    let (writer, writer_task) = Writer::spawn(
        store.clone(),
        bodies.clone(),
        spool.clone(),
        BatchOptions {
            max_rows: config.batch_max_rows,
            linger: config.batch_linger,
            queue_capacity: config.queue_capacity,
            store_timeout: config.store_timeout,
            full_retry_after: config.full_retry_after(),
        },
        writer_metrics.clone(),
        spool_metrics,
        stop_writer.clone(),
    );
    let stop_replayer = CancellationToken::new();
    let replayer = spool::spawn_replayer(
        spool,
        store.clone(),
        bodies.clone(),
        ReplayOptions {
            store_timeout: config.store_timeout,
            retry_max: config.spool_retry_max,
            max_rows: config.batch_max_rows.max(1000),
        },
        writer_metrics,
        stop_replayer.clone(),
    );
    let svc = AnalyticsServiceServer::new(Analytics::new(store, bodies, writer))
        .max_decoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    tracing::info!(spool = %spool_dir.display(), "analytics service ready");
    let result = ecoscan_common::server::serve_with_metrics(
        tonic::service::Routes::new(svc),
        &[SERVICE_NAME],
        metrics,
        listener,
        shutdown,
    )
    .await;
    // In-flight RPCs are done: write (or spool) what the writer still holds, then stop the
    // replayer; what the spool still holds is replayed at the next start.
    stop_writer.cancel();
    if let Err(e) = writer_task.await {
        tracing::error!(error = %e, "analytics writer task failed");
    }
    stop_replayer.cancel();
    if let Err(e) = replayer.await {
        tracing::error!(error = %e, "analytics spool replayer failed");
    }
    result
}

/// The AnalyticsService implementation over any [`CallStore`] and object store.
pub struct Analytics<S> {
    store: Arc<S>,
    bodies: Arc<dyn ObjectStore>,
    writer: Writer,
}

/// Acks a record stream may leave outstanding before it waits for the oldest: bounds a long
/// stream's memory while keeping enough calls in flight to fill batches.
const MAX_UNACKED_PER_STREAM: usize = 2048;

impl<S: CallStore> Analytics<S> {
    /// A service reading from `store` and `bodies` and writing through `writer`.
    pub fn new(store: Arc<S>, bodies: Arc<dyn ObjectStore>, writer: Writer) -> Self {
        Self {
            store,
            bodies,
            writer,
        }
    }

    async fn submit(&self, call: NewCall) -> Result<oneshot::Receiver<Ack>, Error> {
        self.writer
            .submit(call)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Records one call and returns after it is committed, or — when the stores fail — after it
    /// is durably spooled (then `duplicate` is false: whether it repeats a stored id is not known
    /// yet). Refused with [`Error::SpoolFull`] when the stores fail and the spool is full.
    pub async fn record(&self, call: Option<LlmCall>) -> Result<RecordResponse, Error> {
        let call = validate(call.ok_or(Error::MissingCall)?)?;
        let call_id = call.row.call_id.clone();
        let duplicate = settle(self.submit(call).await?).await?;
        Ok(RecordResponse { call_id, duplicate })
    }

    /// Records a stream of calls; see [`AnalyticsService::record_stream`].
    pub async fn record_stream(
        &self,
        mut stream: Streaming<RecordStreamRequest>,
    ) -> Result<RecordStreamResponse, Status> {
        let mut unacked = VecDeque::new();
        let mut counts = RecordStreamResponse::default();
        let mut index = 0_u64;
        let outcome = loop {
            match stream.message().await {
                Ok(Some(item)) => match item.call.ok_or(Error::MissingCall).and_then(validate) {
                    Ok(call) => {
                        tracing::info!(index, call_id = %call.row.call_id, "call received");
                        unacked.push_back(self.submit(call).await?);
                        if unacked.len() > MAX_UNACKED_PER_STREAM
                            && let Some(oldest) = unacked.pop_front()
                        {
                            count(&mut counts, settle(oldest).await?);
                        }
                    }
                    Err(e) => {
                        break Err(Status::from(Error::InvalidStreamItem {
                            index,
                            source: Box::new(e),
                        }));
                    }
                },
                Ok(None) => break Ok(()),
                // The client broke the stream; what it sent before is committed anyway.
                Err(status) => break Err(status),
            }
            index += 1;
        };
        // Every call accepted before the end (or the bad one) is committed before answering, so
        // the error message can promise it.
        for rx in unacked {
            count(&mut counts, settle(rx).await?);
        }
        tracing::info!(
            recorded = counts.recorded,
            duplicates = counts.duplicates,
            "record stream settled"
        );
        outcome.map(|()| counts)
    }

    /// Aggregates per (service, model) over the window; see [`UsageRequest`].
    pub async fn usage(&self, req: UsageRequest) -> Result<UsageResponse, Error> {
        let until = req.until.map_or_else(now_us, |t| ts_to_us(&t));
        let since = req
            .since
            .map_or(until.saturating_sub(24 * 3600 * 1_000_000), |t| {
                ts_to_us(&t)
            });
        if since > until {
            return Err(Error::InvalidWindow);
        }
        let samples = self
            .store
            .usage_samples(since, until)
            .await
            .map_err(Error::Internal)?;
        Ok(UsageResponse {
            since: Some(us_to_ts(since)),
            until: Some(us_to_ts(until)),
            rows: aggregate(samples),
        })
    }

    /// The call with `call_id`, bodies included.
    pub async fn get_call(&self, call_id: &str) -> Result<LlmCall, Error> {
        let call_id = canonical_call_id(call_id)?;
        let row = self
            .store
            .get(&call_id)
            .await
            .map_err(Error::Internal)?
            .ok_or_else(|| Error::NotFound(call_id.clone()))?;
        let (request_body, response_body) = if row.body_key.is_empty() {
            (String::new(), String::new())
        } else {
            let object = self
                .bodies
                .get(&row.body_key)
                .await
                .map_err(|e| Error::Internal(e.into()))?
                .ok_or_else(|| {
                    Error::Internal(anyhow::anyhow!("body object {} is missing", row.body_key))
                })?;
            split_bodies(&object, &row).map_err(Error::Internal)?
        };
        Ok(row_to_call(row, request_body, response_body))
    }
}

fn count(counts: &mut RecordStreamResponse, duplicate: bool) {
    if duplicate {
        counts.duplicates += 1;
    } else {
        counts.recorded += 1;
    }
}

/// Waits for the call's acknowledgement: `Ok(duplicate)` once it is committed or spooled (a
/// spooled call is not known to be a repeat, so it counts as recorded).
async fn settle(rx: oneshot::Receiver<Ack>) -> Result<bool, Error> {
    match rx.await {
        Ok(Ok(Accepted::Committed { duplicate })) => Ok(duplicate),
        Ok(Ok(Accepted::Spooled)) => Ok(false),
        Ok(Err(Refused::SpoolFull {
            used,
            max,
            retry_after,
        })) => Err(Error::SpoolFull {
            used,
            max,
            retry_after,
        }),
        Ok(Err(Refused::Unavailable)) => Err(Error::Unavailable),
        Err(_) => Err(Error::ShuttingDown),
    }
}

fn canonical_call_id(id: &str) -> Result<String, Error> {
    let id = id.trim();
    if id.is_empty() {
        return Err(Error::EmptyCallId);
    }
    // One spelling per id, so "ABC…" and "abc…" are the same call.
    uuid::Uuid::parse_str(id)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| Error::InvalidCallId(id.to_owned()))
}

fn valid_duration(field: &'static str, ms: f64) -> Result<f64, Error> {
    if ms.is_finite() && ms >= 0.0 {
        Ok(ms)
    } else {
        Err(Error::InvalidDuration { field })
    }
}

fn validate(call: LlmCall) -> Result<NewCall, Error> {
    let call_id = canonical_call_id(&call.call_id)?;
    if call.service.trim().is_empty() {
        return Err(Error::EmptyService);
    }
    if call.model.trim().is_empty() {
        return Err(Error::EmptyModel);
    }
    // PostgreSQL text cannot hold NUL; refused here, such a call can never fail a batch (the
    // bodies go to the object store and may hold anything).
    for (field, value) in [
        ("service", &call.service),
        ("provider", &call.provider),
        ("model", &call.model),
        ("operation", &call.operation),
        ("error", &call.error),
        ("job_id", &call.job_id),
        ("trace_id", &call.trace_id),
    ] {
        if value.contains('\0') {
            return Err(Error::NulInField { field });
        }
    }
    let latency_ms = valid_duration("latency_ms", call.latency_ms)?;
    let ttft_ms = valid_duration("ttft_ms", call.ttft_ms)?;
    if CallStatus::try_from(call.status).is_err() {
        return Err(Error::InvalidStatus(call.status));
    }
    let now = now_us();
    Ok(NewCall {
        row: CallRow {
            call_id,
            service: call.service,
            provider: call.provider,
            model: call.model,
            operation: call.operation,
            input_tokens: i64::from(call.input_tokens),
            output_tokens: i64::from(call.output_tokens),
            latency_ms,
            ttft_ms,
            status: call.status,
            error: call.error,
            body_key: String::new(),
            body_offset: 0,
            request_len: 0,
            response_len: 0,
            job_id: call.job_id,
            trace_id: call.trace_id,
            // A call without a start time is counted as starting when it was recorded.
            started_at_us: call.started_at.map_or(now, |t| ts_to_us(&t)),
            recorded_at_us: now,
        },
        request_body: call.request_body,
        response_body: call.response_body,
    })
}

fn split_bodies(object: &[u8], row: &CallRow) -> anyhow::Result<(String, String)> {
    let start = usize::try_from(row.body_offset)?;
    let mid = start + usize::try_from(row.request_len)?;
    let end = mid + usize::try_from(row.response_len)?;
    let (Some(request), Some(response)) = (object.get(start..mid), object.get(mid..end)) else {
        bail!(
            "body object {} is shorter than the call's bodies ({end} > {} bytes)",
            row.body_key,
            object.len()
        );
    };
    Ok((
        String::from_utf8(request.to_vec())?,
        String::from_utf8(response.to_vec())?,
    ))
}

fn row_to_call(row: CallRow, request_body: String, response_body: String) -> LlmCall {
    LlmCall {
        call_id: row.call_id,
        service: row.service,
        provider: row.provider,
        model: row.model,
        operation: row.operation,
        input_tokens: u32::try_from(row.input_tokens).unwrap_or(u32::MAX),
        output_tokens: u32::try_from(row.output_tokens).unwrap_or(u32::MAX),
        latency_ms: row.latency_ms,
        ttft_ms: row.ttft_ms,
        status: row.status,
        error: row.error,
        request_body,
        response_body,
        job_id: row.job_id,
        trace_id: row.trace_id,
        started_at: Some(us_to_ts(row.started_at_us)),
    }
}

#[derive(Default)]
struct Group {
    calls: u64,
    errors: u64,
    input_tokens: u64,
    output_tokens: u64,
    latencies: Vec<f64>,
}

/// Sums and nearest-rank latency percentiles per (service, model), sorted by service then model.
fn aggregate(samples: Vec<UsageSample>) -> Vec<UsageRow> {
    let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
    for s in samples {
        let g = groups.entry((s.service, s.model)).or_default();
        g.calls += 1;
        g.errors += u64::from(s.status == CallStatus::Error as i32);
        g.input_tokens += u64::try_from(s.input_tokens).unwrap_or(0);
        g.output_tokens += u64::try_from(s.output_tokens).unwrap_or(0);
        g.latencies.push(s.latency_ms);
    }
    groups
        .into_iter()
        .map(|((service, model), mut g)| {
            g.latencies.sort_by(f64::total_cmp);
            UsageRow {
                service,
                model,
                calls: g.calls,
                errors: g.errors,
                input_tokens: g.input_tokens,
                output_tokens: g.output_tokens,
                latency_p50_ms: nearest_rank(&g.latencies, 50),
                latency_p95_ms: nearest_rank(&g.latencies, 95),
            }
        })
        .collect()
}

/// The `percent`th percentile of ascending `sorted` by the nearest-rank method: the value at rank
/// ⌈percent/100 · n⌉ (1-based). 0 for no values.
fn nearest_rank(sorted: &[f64], percent: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (percent * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

use ecoscan_proto::{now_us, timestamp_from_us as us_to_ts, timestamp_us as ts_to_us};

#[tonic::async_trait]
impl<S: CallStore> AnalyticsService for Analytics<S> {
    #[tracing::instrument(skip_all, fields(
        call_id = %request.get_ref().call.as_ref().map_or("", |c| c.call_id.as_str()),
        service = %request.get_ref().call.as_ref().map_or("", |c| c.service.as_str()),
    ))]
    async fn record(
        &self,
        request: Request<RecordRequest>,
    ) -> Result<Response<RecordResponse>, Status> {
        let res = Analytics::record(self, request.into_inner().call).await?;
        tracing::info!(duplicate = res.duplicate, "call recorded");
        Ok(Response::new(res))
    }

    /// Items are validated as they arrive; an invalid one ends the stream with INVALID_ARGUMENT
    /// naming its index, and every call received before it is committed (the message says so).
    #[tracing::instrument(skip_all)]
    async fn record_stream(
        &self,
        request: Request<Streaming<RecordStreamRequest>>,
    ) -> Result<Response<RecordStreamResponse>, Status> {
        Analytics::record_stream(self, request.into_inner())
            .await
            .map(Response::new)
    }

    #[tracing::instrument(skip_all)]
    async fn usage(
        &self,
        request: Request<UsageRequest>,
    ) -> Result<Response<UsageResponse>, Status> {
        require_admin(&request)?;
        let res = Analytics::usage(self, request.into_inner()).await?;
        tracing::info!(rows = res.rows.len(), "usage aggregated");
        Ok(Response::new(res))
    }

    #[tracing::instrument(skip_all, fields(call_id = %request.get_ref().call_id))]
    async fn get_call(
        &self,
        request: Request<GetCallRequest>,
    ) -> Result<Response<GetCallResponse>, Status> {
        require_admin(&request)?;
        let call = Analytics::get_call(self, &request.into_inner().call_id).await?;
        Ok(Response::new(GetCallResponse { call: Some(call) }))
    }
}

/// `Usage` and `GetCall` read every user's calls: only an admin may.
fn require_admin<T>(request: &Request<T>) -> Result<(), Error> {
    if ecoscan_common::identity::is_admin(request.metadata()) {
        Ok(())
    } else {
        Err(Error::NotAdmin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_picks_the_ceiling_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 50), 5.0);
        assert_eq!(nearest_rank(&v, 95), 10.0);
        assert_eq!(nearest_rank(&[7.0], 50), 7.0);
        assert_eq!(nearest_rank(&[], 95), 0.0);
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 95), 19.0);
    }

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
    fn call_ids_are_canonicalised_and_checked() {
        let id = "6F9619FF-8B86-D011-B42D-00C04FC964FF";
        assert_eq!(
            canonical_call_id(id).unwrap(),
            "6f9619ff-8b86-d011-b42d-00c04fc964ff"
        );
        assert!(matches!(canonical_call_id(" "), Err(Error::EmptyCallId)));
        assert!(matches!(
            canonical_call_id("nope"),
            Err(Error::InvalidCallId(_))
        ));
    }
}
