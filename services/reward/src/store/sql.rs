//! [`RewardStore`] in SQL, written once for every [`Dialect`]: the same statements and the same
//! transaction run on SQLite and on PostgreSQL.

use async_trait::async_trait;
use ecoscan_sql::Dialect;
use ecoscan_sql::db_span;
use sqlx::{Decode, Encode, Executor, IntoArguments, Row, Type};

use super::{Grant, OwnedRow, RewardStore, StoreError, StoredDecision};

/// [`RewardStore`] on the SQL database `DB`; opened by [`super::sqlite`] or [`super::postgres`].
#[derive(Debug)]
pub struct SqlRewardStore<DB: Dialect> {
    pool: ecoscan_sql::Db<DB>,
}

impl<DB: Dialect> Clone for SqlRewardStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<DB: Dialect> SqlRewardStore<DB> {
    pub(super) fn new(pool: impl Into<ecoscan_sql::Db<DB>>) -> Self {
        Self { pool: pool.into() }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The decision `grant` wrote for `g`: granted when the ownership was new to the user.
fn written(g: Grant, newly_granted: bool) -> StoredDecision {
    StoredDecision {
        job_id: g.job_id,
        user_id: g.user_id,
        eligible: true,
        newly_granted,
        character_code: Some(g.character_code),
        reason: if newly_granted {
            "granted"
        } else {
            "already_owned"
        }
        .to_owned(),
    }
}

const SELECT_DECISION: &str = "SELECT job_id, user_id, eligible, newly_granted, character_code, reason \
     FROM reward_decisions WHERE job_id = $1";

fn decision_from_row<R: Row>(row: &R) -> Result<StoredDecision, sqlx::Error>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(StoredDecision {
        job_id: row.try_get("job_id")?,
        user_id: row.try_get("user_id")?,
        eligible: row.try_get("eligible")?,
        newly_granted: row.try_get("newly_granted")?,
        character_code: row.try_get("character_code")?,
        reason: row.try_get("reason")?,
    })
}

#[async_trait]
impl<DB> RewardStore for SqlRewardStore<DB>
where
    DB: Dialect,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
{
    async fn decision(&self, job_id: &str) -> Result<Option<StoredDecision>, StoreError> {
        let row = sqlx::query(DB::sql(SELECT_DECISION))
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(decision_from_row).transpose()?)
    }

    #[db_span(
        system = DB::SYSTEM,
        op = "INSERT",
        collection = "reward_decisions",
        name = "INSERT reward_decisions, owned_characters",
        fields(job.id = %g.job_id)
    )]
    async fn grant(&self, g: Grant) -> Result<StoredDecision, StoreError> {
        // Most scans earn a character the user owns already. That decision is one row and
        // changes nothing else, so it is stored in one statement, outside a transaction, when
        // the ownership is there (committed) as it is written; the decision is true from then
        // on, since nothing takes a character away. Anything else (a character new to the
        // user, a job decided before) stores nothing here and takes the transaction below.
        let already_owned = DB::rows_affected(
            &sqlx::query(DB::sql(
                "INSERT INTO reward_decisions \
                 (job_id, user_id, eligible, newly_granted, character_code, reason, decided_at_us) \
                 SELECT $1, $2, TRUE, FALSE, $3, 'already_owned', $4 WHERE EXISTS \
                 (SELECT 1 FROM owned_characters WHERE user_id = $2 AND character_code = $3) \
                 ON CONFLICT (job_id) DO NOTHING",
            ))
            .bind(g.job_id.as_str())
            .bind(g.user_id.as_str())
            .bind(g.character_code.as_str())
            .bind(g.now_us)
            .execute(&self.pool)
            .await?,
        ) == 1;
        if already_owned {
            return Ok(written(g, false));
        }
        let mut tx = self.pool.begin().await?;
        // The decision is claimed first. On PostgreSQL a concurrent grant for the same job
        // waits on its primary key until this transaction ends, then finds the job decided and
        // grants nothing, whatever character it carried; on SQLite this first write takes the
        // database's write lock, so concurrent grants run one after the other.
        let claimed = DB::rows_affected(
            &sqlx::query(DB::sql(
                "INSERT INTO reward_decisions \
                 (job_id, user_id, eligible, newly_granted, character_code, reason, decided_at_us) \
                 VALUES ($1, $2, TRUE, TRUE, $3, 'granted', $4) ON CONFLICT (job_id) DO NOTHING",
            ))
            .bind(g.job_id.as_str())
            .bind(g.user_id.as_str())
            .bind(g.character_code.as_str())
            .bind(g.now_us)
            .execute(&mut tx)
            .await?,
        ) == 1;
        if claimed {
            // A concurrent grant of the same character (another job) waits on the ownership
            // key and then inserts nothing: one of them says "granted", the others
            // "already_owned".
            let owned = DB::rows_affected(
                &sqlx::query(DB::sql(
                    "INSERT INTO owned_characters (user_id, character_code, job_id, acquired_at_us) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (user_id, character_code) DO NOTHING",
                ))
                .bind(g.user_id.as_str())
                .bind(g.character_code.as_str())
                .bind(g.job_id.as_str())
                .bind(g.now_us)
                .execute(&mut tx)
                .await?,
            ) == 1;
            if !owned {
                sqlx::query(DB::sql(
                    "UPDATE reward_decisions SET newly_granted = FALSE, reason = 'already_owned' \
                     WHERE job_id = $1",
                ))
                .bind(g.job_id.as_str())
                .execute(&mut tx)
                .await?;
            }
            tx.commit().await?;
            // What this transaction wrote is the decision: no statement to read it back.
            return Ok(written(g, owned));
        }
        // The job was decided before (or concurrently, committed first): read that decision,
        // in the same transaction (on PostgreSQL the insert above waited for it to commit).
        let row = sqlx::query(DB::sql(SELECT_DECISION))
            .bind(g.job_id.as_str())
            .fetch_one(&mut tx)
            .await?;
        let decision = decision_from_row(&row)?;
        tx.commit().await?;
        Ok(decision)
    }

    #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "owned_characters")]
    async fn list_owned(&self, user_id: &str) -> Result<Vec<OwnedRow>, StoreError> {
        let rows = sqlx::query(DB::sql(
            "SELECT character_code, job_id, acquired_at_us FROM owned_characters \
             WHERE user_id = $1 ORDER BY acquired_at_us, character_code",
        ))
        .bind(user_id)
        .fetch_all(&self.pool)
        .await?;
        let owned = rows
            .iter()
            .map(|r| {
                Ok(OwnedRow {
                    character_code: r.try_get("character_code")?,
                    job_id: r.try_get("job_id")?,
                    acquired_at_us: r.try_get("acquired_at_us")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(owned)
    }

    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        self.pool.health().cloned()
    }

    fn pool_stats(&self) -> Option<ecoscan_common::store_health::PoolStats> {
        // Only a pool the network stands between (PostgreSQL's; it has a health).
        self.pool.health().map(|_| self.pool.pool_stats())
    }

    async fn close(&self) {
        SqlRewardStore::close(self).await;
    }
}
