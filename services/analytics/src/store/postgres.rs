//! The production call store: [`SqlCallStore`] on PostgreSQL, its schema managed by versioned
//! migrations (`migrations/postgres/`).

use std::collections::HashSet;

use sqlx::{Postgres, Row, migrate::Migrator};

use super::{CallRow, CallSql, SqlCallStore, StoreError};

/// Connections per process when `DATABASE_MAX_CONNECTIONS` is unset, and this store's weight
/// when the budget is split among the services of one process (`ecoscan up`): one writer task plus the readers of `GetCall` and `Usage`.
pub const MAX_CONNECTIONS: u32 = 10;

/// The analytics schema's migrations, tracked in their own table so services sharing one
/// database (through `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::migrator!("_analytics_migrations")
}

/// [`super::CallStore`] on PostgreSQL.
pub type PgCallStore = SqlCallStore<Postgres>;

impl SqlCallStore<Postgres> {
    /// Connects to `url` with the `DATABASE_*` settings ([`ecoscan_sql::PgSettings`]) and applies any pending migration (concurrent starts wait on the
    /// migrator's advisory lock).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let store = ecoscan_sql::PgStore {
            service: "analytics",
            weight: MAX_CONNECTIONS,
            direct_url: std::env::var("ANALYTICS_DATABASE_DIRECT_URL")
                .ok()
                .filter(|v| !v.trim().is_empty()),
        };
        let pool = ecoscan_sql::connect_postgres(url, &store, None, &migrator()).await?;
        Ok(Self::new(pool))
    }
}

/// The batch as one array per column: the whole batch binds 23 parameters, whatever its size, so
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
    cached_input_tokens: Vec<i64>,
    images: Vec<i64>,
    cost_micros: Vec<Option<i64>>,
    price_version: Vec<String>,
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
            c.cached_input_tokens.push(r.cached_input_tokens);
            c.images.push(r.images);
            c.cost_micros.push(r.cost_micros);
            c.price_version.push(r.price_version.clone());
        }
        c
    }
}

impl CallSql for Postgres {
    /// One `INSERT … SELECT FROM UNNEST` of one array per column.
    async fn insert_calls(
        pool: &ecoscan_sql::Db<Self>,
        rows: &[CallRow],
    ) -> Result<HashSet<String>, sqlx::Error> {
        let mut inserted = HashSet::with_capacity(rows.len());
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
             recorded_at_us, cached_input_tokens, images, cost_micros, price_version) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
             $6::bigint[], $7::bigint[], $8::float8[], $9::float8[], $10::int4[], $11::text[], \
             $12::text[], $13::bigint[], $14::bigint[], $15::bigint[], $16::text[], $17::text[], \
             $18::bigint[], $19::bigint[], $20::bigint[], $21::bigint[], $22::bigint[], \
             $23::text[]) ORDER BY 1 \
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
        .bind(c.cached_input_tokens)
        .bind(c.images)
        .bind(c.cost_micros)
        .bind(c.price_version)
        .fetch_all(pool)
        .await?;
        for id in ids {
            inserted.insert(id.try_get::<String, _>(0)?);
        }
        Ok(inserted)
    }
}
