//! The embedded [`RewardStore`]: a SQLite file (or in-memory database) through sqlx.

use anyhow::Context;
use sqlx::{
    Row,
    sqlite::{SqlitePool, SqliteRow},
};

use super::{Grant, OwnedRow, RewardStore, StoredDecision};

/// [`RewardStore`] on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteRewardStore {
    pool: SqlitePool,
}

impl SqliteRewardStore {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout so concurrent
    /// writers wait instead of failing.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql"))
            .await
            .with_context(|| format!("failed to open the reward database {url:?}"))?;
        Ok(Self { pool })
    }

    /// Closes every connection (so the file can be reopened at once, e.g. by a restarted server).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

const SELECT_DECISION: &str = "SELECT job_id, user_id, eligible, newly_granted, character_code, reason \
     FROM reward_decisions WHERE job_id = ?";

fn decision_from_row(row: &SqliteRow) -> Result<StoredDecision, sqlx::Error> {
    Ok(StoredDecision {
        job_id: row.try_get("job_id")?,
        user_id: row.try_get("user_id")?,
        eligible: row.try_get("eligible")?,
        newly_granted: row.try_get("newly_granted")?,
        character_code: row.try_get("character_code")?,
        reason: row.try_get("reason")?,
    })
}

impl RewardStore for SqliteRewardStore {
    async fn decision(&self, job_id: &str) -> anyhow::Result<Option<StoredDecision>> {
        let row = sqlx::query(SELECT_DECISION)
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await
            .context("failed to read the reward decision")?;
        Ok(row.as_ref().map(decision_from_row).transpose()?)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "INSERT reward_decisions, owned_characters", otel.kind = "client", db.system = "sqlite", db.operation.name = "INSERT", db.collection.name = "reward_decisions", job.id = %g.job_id),
        err
    )]
    async fn grant(&self, g: Grant) -> anyhow::Result<StoredDecision> {
        let mut tx = self.pool.begin().await.context("failed to begin")?;
        // A write comes first, so the transaction holds the write lock from its first statement
        // and concurrent grants are serialised. The NOT EXISTS guard keeps a replayed job (even
        // one replayed with a different classification) from granting anything new.
        let inserted = sqlx::query(
            "INSERT INTO owned_characters (user_id, character_code, job_id, acquired_at_us) \
             SELECT ?1, ?2, ?3, ?4 \
             WHERE NOT EXISTS (SELECT 1 FROM reward_decisions WHERE job_id = ?3) \
             ON CONFLICT (user_id, character_code) DO NOTHING",
        )
        .bind(&g.user_id)
        .bind(&g.character_code)
        .bind(&g.job_id)
        .bind(g.now_us)
        .execute(&mut *tx)
        .await
        .context("failed to insert the ownership")?
        .rows_affected()
            == 1;
        let reason = if inserted { "granted" } else { "already_owned" };
        sqlx::query(
            "INSERT INTO reward_decisions \
             (job_id, user_id, eligible, newly_granted, character_code, reason, decided_at_us) \
             VALUES (?, ?, 1, ?, ?, ?, ?) ON CONFLICT (job_id) DO NOTHING",
        )
        .bind(&g.job_id)
        .bind(&g.user_id)
        .bind(inserted)
        .bind(&g.character_code)
        .bind(reason)
        .bind(g.now_us)
        .execute(&mut *tx)
        .await
        .context("failed to insert the decision")?;
        let row = sqlx::query(SELECT_DECISION)
            .bind(&g.job_id)
            .fetch_one(&mut *tx)
            .await
            .context("failed to read back the decision")?;
        let decision = decision_from_row(&row)?;
        tx.commit().await.context("failed to commit the grant")?;
        Ok(decision)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "SELECT owned_characters", otel.kind = "client", db.system = "sqlite", db.operation.name = "SELECT", db.collection.name = "owned_characters"),
        err
    )]
    async fn list_owned(&self, user_id: &str) -> anyhow::Result<Vec<OwnedRow>> {
        let rows = sqlx::query(
            "SELECT character_code, job_id, acquired_at_us FROM owned_characters \
             WHERE user_id = ? ORDER BY acquired_at_us, character_code",
        )
        .bind(user_id)
        .fetch_all(&self.pool)
        .await
        .context("failed to list owned characters")?;
        rows.iter()
            .map(|r| {
                Ok(OwnedRow {
                    character_code: r.try_get("character_code")?,
                    job_id: r.try_get("job_id")?,
                    acquired_at_us: r.try_get("acquired_at_us")?,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(job: &str, user: &str, code: &str) -> Grant {
        Grant {
            job_id: job.into(),
            user_id: user.into(),
            character_code: code.into(),
            now_us: 1,
        }
    }

    #[tokio::test]
    async fn a_decided_job_grants_nothing_even_with_another_character() {
        let store = SqliteRewardStore::connect("sqlite::memory:").await.unwrap();
        let first = store.grant(grant("j1", "u", "char-petty")).await.unwrap();
        assert!(first.newly_granted);
        let replay = store.grant(grant("j1", "u", "char-glassy")).await.unwrap();
        assert_eq!(replay, first);
        let owned = store.list_owned("u").await.unwrap();
        assert_eq!(owned.len(), 1);
        assert_eq!(owned[0].character_code, "char-petty");
    }
}
