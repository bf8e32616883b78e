//! The production [`CallStore`]: PostgreSQL through sqlx, schema managed by versioned migrations
//! (`migrations/postgres/`).

use std::collections::HashSet;

use anyhow::Context;
use sqlx::{
    Row,
    migrate::Migrator,
    postgres::{PgPool, PgRow},
};

use super::{CallRow, CallStore, UsageSample};

/// Connections per process: one writer task plus the readers of `GetCall` and `Usage`.
const MAX_CONNECTIONS: u32 = 10;

/// The analytics schema's migrations, tracked in their own table so services sharing one
/// database (through `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::tracked_in(
        "_analytics_migrations",
        sqlx::migrate!("./migrations/postgres"),
    )
}

/// [`CallStore`] on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgCallStore {
    pool: PgPool,
}

impl PgCallStore {
    /// Connects to `url` and applies any pending migration (concurrent starts wait on the
    /// migrator's advisory lock).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::connect_postgres(url, MAX_CONNECTIONS, &migrator())
            .await
            .context("failed to open the analytics database on postgresql")?;
        Ok(Self { pool })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

fn row_to_call(r: &PgRow) -> Result<CallRow, sqlx::Error> {
    Ok(CallRow {
        call_id: r.try_get("call_id")?,
        service: r.try_get("service")?,
        provider: r.try_get("provider")?,
        model: r.try_get("model")?,
        operation: r.try_get("operation")?,
        input_tokens: r.try_get("input_tokens")?,
        output_tokens: r.try_get("output_tokens")?,
        latency_ms: r.try_get("latency_ms")?,
        ttft_ms: r.try_get("ttft_ms")?,
        status: r.try_get("status")?,
        error: r.try_get("error")?,
        body_key: r.try_get("body_key")?,
        body_offset: r.try_get("body_offset")?,
        request_len: r.try_get("request_len")?,
        response_len: r.try_get("response_len")?,
        job_id: r.try_get("job_id")?,
        trace_id: r.try_get("trace_id")?,
        started_at_us: r.try_get("started_at_us")?,
        recorded_at_us: r.try_get("recorded_at_us")?,
    })
}

/// The batch as one array per column: the whole batch binds 19 parameters, whatever its size, so
/// one statement carries it and PostgreSQL plans it once.
#[derive(Default)]
struct Columns {
    call_id: Vec<String>,
    service: Vec<String>,
    provider: Vec<String>,
    model: Vec<String>,
    operation: Vec<String>,
    input_tokens: Vec<i64>,
    output_tokens: Vec<i64>,
    latency_ms: Vec<f64>,
    ttft_ms: Vec<f64>,
    status: Vec<i32>,
    error: Vec<String>,
    body_key: Vec<String>,
    body_offset: Vec<i64>,
    request_len: Vec<i64>,
    response_len: Vec<i64>,
    job_id: Vec<String>,
    trace_id: Vec<String>,
    started_at_us: Vec<i64>,
    recorded_at_us: Vec<i64>,
}

impl Columns {
    fn of(rows: &[CallRow]) -> Self {
        let mut c = Self::default();
        for r in rows {
            c.call_id.push(r.call_id.clone());
            c.service.push(r.service.clone());
            c.provider.push(r.provider.clone());
            c.model.push(r.model.clone());
            c.operation.push(r.operation.clone());
            c.input_tokens.push(r.input_tokens);
            c.output_tokens.push(r.output_tokens);
            c.latency_ms.push(r.latency_ms);
            c.ttft_ms.push(r.ttft_ms);
            c.status.push(r.status);
            c.error.push(r.error.clone());
            c.body_key.push(r.body_key.clone());
            c.body_offset.push(r.body_offset);
            c.request_len.push(r.request_len);
            c.response_len.push(r.response_len);
            c.job_id.push(r.job_id.clone());
            c.trace_id.push(r.trace_id.clone());
            c.started_at_us.push(r.started_at_us);
            c.recorded_at_us.push(r.recorded_at_us);
        }
        c
    }
}

impl CallStore for PgCallStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT llm_calls", otel.kind = "client", db.system = "postgresql", db.operation.name = "INSERT", db.collection.name = "llm_calls", db.rows = rows.len() as i64),
        err
    )]
    async fn insert_batch(&self, rows: &[CallRow]) -> anyhow::Result<HashSet<String>> {
        let mut inserted = HashSet::with_capacity(rows.len());
        if rows.is_empty() {
            return Ok(inserted);
        }
        let c = Columns::of(rows);
        // One statement, so it is one implicit transaction: the caller is acknowledged after
        // it returns, i.e. after COMMIT. RETURNING lists only the rows actually inserted (a
        // repeat within the batch conflicts with its first occurrence and is skipped too).
        // Rows go in call_id order, so concurrent batches sharing ids (two replicas given the
        // same retried call) wait on each other's keys in one order and never deadlock.
        let ids = sqlx::query(
            "INSERT INTO llm_calls (call_id, service, provider, model, operation, \
             input_tokens, output_tokens, latency_ms, ttft_ms, status, error, body_key, \
             body_offset, request_len, response_len, job_id, trace_id, started_at_us, \
             recorded_at_us) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
             $6::bigint[], $7::bigint[], $8::float8[], $9::float8[], $10::int4[], $11::text[], \
             $12::text[], $13::bigint[], $14::bigint[], $15::bigint[], $16::text[], $17::text[], \
             $18::bigint[], $19::bigint[]) ORDER BY 1 \
             ON CONFLICT (call_id) DO NOTHING RETURNING call_id",
        )
        .bind(c.call_id)
        .bind(c.service)
        .bind(c.provider)
        .bind(c.model)
        .bind(c.operation)
        .bind(c.input_tokens)
        .bind(c.output_tokens)
        .bind(c.latency_ms)
        .bind(c.ttft_ms)
        .bind(c.status)
        .bind(c.error)
        .bind(c.body_key)
        .bind(c.body_offset)
        .bind(c.request_len)
        .bind(c.response_len)
        .bind(c.job_id)
        .bind(c.trace_id)
        .bind(c.started_at_us)
        .bind(c.recorded_at_us)
        .fetch_all(&self.pool)
        .await
        .context("failed to insert llm calls")?;
        for id in ids {
            inserted.insert(id.try_get::<String, _>(0)?);
        }
        Ok(inserted)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT llm_calls", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "llm_calls"),
        err
    )]
    async fn get(&self, call_id: &str) -> anyhow::Result<Option<CallRow>> {
        let row = sqlx::query("SELECT * FROM llm_calls WHERE call_id = $1")
            .bind(call_id)
            .fetch_optional(&self.pool)
            .await
            .context("failed to read llm call")?;
        Ok(row.as_ref().map(row_to_call).transpose()?)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT llm_calls", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "llm_calls"),
        err
    )]
    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> anyhow::Result<Vec<UsageSample>> {
        let rows = sqlx::query(
            "SELECT service, model, status, input_tokens, output_tokens, latency_ms \
             FROM llm_calls WHERE started_at_us >= $1 AND started_at_us < $2",
        )
        .bind(since_us)
        .bind(until_us)
        .fetch_all(&self.pool)
        .await
        .context("failed to read usage")?;
        rows.iter()
            .map(|r| {
                Ok(UsageSample {
                    service: r.try_get("service")?,
                    model: r.try_get("model")?,
                    status: r.try_get("status")?,
                    input_tokens: r.try_get("input_tokens")?,
                    output_tokens: r.try_get("output_tokens")?,
                    latency_ms: r.try_get("latency_ms")?,
                })
            })
            .collect()
    }
}
