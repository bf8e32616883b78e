//! The embedded [`CallStore`]: a SQLite file (or in-memory database) through sqlx.

use std::collections::HashSet;

use anyhow::Context;
use sqlx::{
    QueryBuilder, Row, Sqlite,
    sqlite::{SqlitePool, SqliteRow},
};

use super::{CallRow, CallStore, UsageSample};

/// Columns bound per row; SQLite allows 32,766 bound parameters per statement.
const COLUMNS: usize = 19;

/// Most rows one multi-row INSERT can carry within SQLite's bound-parameter limit.
pub const MAX_ROWS_PER_STATEMENT: usize = 32_766 / COLUMNS;

/// [`CallStore`] on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteCallStore {
    pool: SqlitePool,
}

impl SqliteCallStore {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql"))
            .await
            .with_context(|| format!("failed to open the analytics database {url:?}"))?;
        Ok(Self { pool })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

fn row_to_call(r: &SqliteRow) -> Result<CallRow, sqlx::Error> {
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

impl CallStore for SqliteCallStore {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT llm_calls", otel.kind = "client", db.system = "sqlite", db.operation.name = "INSERT", db.collection.name = "llm_calls", db.rows = rows.len() as i64),
        err
    )]
    async fn insert_batch(&self, rows: &[CallRow]) -> anyhow::Result<HashSet<String>> {
        let mut inserted = HashSet::with_capacity(rows.len());
        if rows.is_empty() {
            return Ok(inserted);
        }
        let mut tx = self.pool.begin().await.context("failed to begin")?;
        for chunk in rows.chunks(MAX_ROWS_PER_STATEMENT) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO llm_calls (call_id, service, provider, model, operation, \
                 input_tokens, output_tokens, latency_ms, ttft_ms, status, error, body_key, \
                 body_offset, request_len, response_len, job_id, trace_id, started_at_us, \
                 recorded_at_us) ",
            );
            q.push_values(chunk, |mut b, r| {
                b.push_bind(r.call_id.clone())
                    .push_bind(r.service.clone())
                    .push_bind(r.provider.clone())
                    .push_bind(r.model.clone())
                    .push_bind(r.operation.clone())
                    .push_bind(r.input_tokens)
                    .push_bind(r.output_tokens)
                    .push_bind(r.latency_ms)
                    .push_bind(r.ttft_ms)
                    .push_bind(r.status)
                    .push_bind(r.error.clone())
                    .push_bind(r.body_key.clone())
                    .push_bind(r.body_offset)
                    .push_bind(r.request_len)
                    .push_bind(r.response_len)
                    .push_bind(r.job_id.clone())
                    .push_bind(r.trace_id.clone())
                    .push_bind(r.started_at_us)
                    .push_bind(r.recorded_at_us);
            });
            // RETURNING lists only the rows actually inserted, so duplicates are told apart
            // without a second query.
            q.push(" ON CONFLICT (call_id) DO NOTHING RETURNING call_id");
            let ids = q
                .build()
                .fetch_all(&mut *tx)
                .await
                .context("failed to insert llm calls")?;
            for id in ids {
                inserted.insert(id.try_get::<String, _>(0)?);
            }
        }
        tx.commit().await.context("failed to commit llm calls")?;
        Ok(inserted)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT llm_calls", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "llm_calls"),
        err
    )]
    async fn get(&self, call_id: &str) -> anyhow::Result<Option<CallRow>> {
        let row = sqlx::query("SELECT * FROM llm_calls WHERE call_id = ?")
            .bind(call_id)
            .fetch_optional(&self.pool)
            .await
            .context("failed to read llm call")?;
        Ok(row.as_ref().map(row_to_call).transpose()?)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT llm_calls", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "llm_calls"),
        err
    )]
    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> anyhow::Result<Vec<UsageSample>> {
        let rows = sqlx::query(
            "SELECT service, model, status, input_tokens, output_tokens, latency_ms \
             FROM llm_calls WHERE started_at_us >= ? AND started_at_us < ?",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> CallRow {
        CallRow {
            call_id: id.into(),
            service: "vision".into(),
            provider: "mock".into(),
            model: "m".into(),
            operation: "classify".into(),
            input_tokens: 1,
            output_tokens: 2,
            latency_ms: 3.0,
            ttft_ms: 0.0,
            status: 1,
            error: String::new(),
            body_key: String::new(),
            body_offset: 0,
            request_len: 0,
            response_len: 0,
            job_id: String::new(),
            trace_id: String::new(),
            started_at_us: 10,
            recorded_at_us: 11,
        }
    }

    #[tokio::test]
    async fn a_batch_reports_only_the_ids_it_inserted() {
        let store = SqliteCallStore::connect("sqlite::memory:").await.unwrap();
        let first = store.insert_batch(&[row("a"), row("b")]).await.unwrap();
        let second = store
            .insert_batch(&[row("b"), row("c"), row("c")])
            .await
            .unwrap();
        assert_eq!(first, HashSet::from(["a".to_owned(), "b".to_owned()]));
        assert_eq!(second, HashSet::from(["c".to_owned()]));
        assert_eq!(store.get("c").await.unwrap().unwrap(), row("c"));
        assert_eq!(store.usage_samples(0, 100).await.unwrap().len(), 3);
        assert!(store.usage_samples(11, 100).await.unwrap().is_empty());
    }
}
