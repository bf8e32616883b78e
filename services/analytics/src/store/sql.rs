//! [`CallStore`] in SQL, written once for every [`Dialect`]: reading calls is the same on SQLite
//! and PostgreSQL; writing a batch is each database's own ([`CallSql`]).

use std::{collections::HashSet, future::Future};

use async_trait::async_trait;
use ecoscan_sql::{Dialect, db_span};
use sqlx::{Decode, Encode, Executor, IntoArguments, Row, Type};

use super::{CallRow, CallStore, StoreError, UsageSample};

/// How a database takes a batch of calls in one transaction (SQLite: multi-row `INSERT`s;
/// PostgreSQL: one `INSERT … SELECT FROM UNNEST` of one array per column). Both skip ids already
/// stored and return the ids they inserted.
pub trait CallSql: Dialect {
    fn insert_calls(
        pool: &ecoscan_sql::Db<Self>,
        rows: &[CallRow],
    ) -> impl Future<Output = Result<HashSet<String>, sqlx::Error>> + Send;
}

ecoscan_sql::sql_store! {
    /// [`CallStore`] on the SQL database `DB`; opened by [`super::sqlite`] or
    /// [`super::postgres`].
    pub struct SqlCallStore<DB> { pool }
}

fn row_to_call<R: Row>(r: &R) -> Result<CallRow, sqlx::Error>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> f64: Decode<'r, R::Database> + Type<R::Database>,
{
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
        cached_input_tokens: r.try_get("cached_input_tokens")?,
        images: r.try_get("images")?,
        cost_micros: r.try_get("cost_micros")?,
        price_version: r.try_get("price_version")?,
    })
}

#[async_trait]
impl<DB> CallStore for SqlCallStore<DB>
where
    DB: CallSql,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB> + Type<DB>,
    for<'r> i32: Decode<'r, DB> + Type<DB>,
    for<'r> f64: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
{
    #[db_span(
        system = DB::SYSTEM,
        op = "INSERT",
        collection = "llm_calls",
        fields(db.rows = rows.len() as i64)
    )]
    async fn insert_batch(&self, rows: &[CallRow]) -> Result<HashSet<String>, StoreError> {
        if rows.is_empty() {
            return Ok(HashSet::new());
        }
        Ok(DB::insert_calls(&self.pool, rows).await?)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "llm_calls")]
    async fn get(&self, call_id: &str) -> Result<Option<CallRow>, StoreError> {
        let row = sqlx::query(DB::sql("SELECT * FROM llm_calls WHERE call_id = $1"))
            .bind(call_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(row_to_call).transpose()?)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "llm_calls")]
    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> Result<Vec<UsageSample>, StoreError> {
        let rows = sqlx::query(DB::sql(
            "SELECT service, model, status, input_tokens, output_tokens, latency_ms, cost_micros \
             FROM llm_calls WHERE started_at_us >= $1 AND started_at_us < $2",
        ))
        .bind(since_us)
        .bind(until_us)
        .fetch_all(&self.pool)
        .await?;
        let samples = rows
            .iter()
            .map(|r| {
                Ok(UsageSample {
                    service: r.try_get("service")?,
                    model: r.try_get("model")?,
                    status: r.try_get("status")?,
                    input_tokens: r.try_get("input_tokens")?,
                    output_tokens: r.try_get("output_tokens")?,
                    latency_ms: r.try_get("latency_ms")?,
                    cost_micros: r.try_get("cost_micros")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(samples)
    }

    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        self.pool.health().cloned()
    }

    fn pool_stats(&self) -> Option<ecoscan_common::store_health::PoolStats> {
        // Only a pool the network stands between (PostgreSQL's; it has a health).
        self.pool.health().map(|_| self.pool.pool_stats())
    }

    async fn close(&self) {
        SqlCallStore::close(self).await;
    }
}
