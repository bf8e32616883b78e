//! The embedded call store: [`SqlCallStore`] on a SQLite file (or in-memory database).

use std::collections::HashSet;

use sqlx::{QueryBuilder, Row, Sqlite};

use super::{CallRow, CallSql, SqlCallStore, StoreError};

/// Columns bound per row; SQLite allows 32,766 bound parameters per statement.
const COLUMNS: usize = 23;

/// Most rows one multi-row INSERT can carry within SQLite's bound-parameter limit.
pub const MAX_ROWS_PER_STATEMENT: usize = 32_766 / COLUMNS;

/// [`super::CallStore`] on SQLite.
pub type SqliteCallStore = SqlCallStore<Sqlite>;

impl SqlCallStore<Sqlite> {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool =
            ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql")).await?;
        add_missing_columns(&pool).await?;
        Ok(Self::new(pool))
    }
}

/// Columns added since the first layout, for a database an earlier version made (the schema's
/// `CREATE TABLE IF NOT EXISTS` leaves an existing table as it is). Its rows keep their values:
/// no cached tokens, no images, cost unknown.
const ADDED_COLUMNS: [(&str, &str); 4] = [
    ("cached_input_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("images", "INTEGER NOT NULL DEFAULT 0"),
    ("cost_micros", "INTEGER"),
    ("price_version", "TEXT NOT NULL DEFAULT ''"),
];

async fn add_missing_columns(pool: &sqlx::SqlitePool) -> Result<(), StoreError> {
    let columns: Vec<String> = sqlx::query("SELECT name FROM pragma_table_info('llm_calls')")
        .fetch_all(pool)
        .await?
        .iter()
        .map(|r| r.try_get::<String, _>(0))
        .collect::<Result<_, _>>()?;
    for (name, ddl) in ADDED_COLUMNS {
        if !columns.iter().any(|c| c == name) {
            // Names and types are constants, not input.
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE llm_calls ADD COLUMN {name} {ddl}"
            )))
            .execute(pool)
            .await?;
        }
    }
    Ok(())
}

impl CallSql for Sqlite {
    /// Multi-row `INSERT`s of as many rows as SQLite's parameter limit allows, in one
    /// transaction.
    async fn insert_calls(
        pool: &ecoscan_sql::Db<Self>,
        rows: &[CallRow],
    ) -> Result<HashSet<String>, sqlx::Error> {
        let mut inserted = HashSet::with_capacity(rows.len());
        let mut tx = pool.begin().await?;
        for chunk in rows.chunks(MAX_ROWS_PER_STATEMENT) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO llm_calls (call_id, service, provider, model, operation, \
                 input_tokens, output_tokens, latency_ms, ttft_ms, status, error, body_key, \
                 body_offset, request_len, response_len, job_id, trace_id, started_at_us, \
                 recorded_at_us, cached_input_tokens, images, cost_micros, price_version) ",
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
                    .push_bind(r.recorded_at_us)
                    .push_bind(r.cached_input_tokens)
                    .push_bind(r.images)
                    .push_bind(r.cost_micros)
                    .push_bind(r.price_version.clone());
            });
            // RETURNING lists only the rows actually inserted, so duplicates are told apart
            // without a second query.
            q.push(" ON CONFLICT (call_id) DO NOTHING RETURNING call_id");
            for id in q.build().fetch_all(&mut tx).await? {
                inserted.insert(id.try_get::<String, _>(0)?);
            }
        }
        tx.commit().await?;
        Ok(inserted)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::store::{CallRow, CallStore};

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
            cached_input_tokens: 0,
            images: 0,
            cost_micros: Some(42),
            price_version: "always/abc".into(),
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
