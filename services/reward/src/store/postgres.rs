//! The production [`RewardStore`]: PostgreSQL through sqlx, schema managed by versioned
//! migrations (`migrations/postgres/`).

use anyhow::Context;
use sqlx::{
    Row,
    migrate::Migrator,
    postgres::{PgPool, PgRow},
};

use super::{Grant, OwnedRow, RewardStore, StoredDecision};

/// Connections per process: grants are short transactions, so a few go a long way.
const MAX_CONNECTIONS: u32 = 10;

/// The reward schema's migrations, tracked in their own table so services sharing one database
/// (through `DATABASE_URL`) never mistake each other's versions for theirs.
pub fn migrator() -> Migrator {
    ecoscan_sql::tracked_in(
        "_reward_migrations",
        sqlx::migrate!("./migrations/postgres"),
    )
}

/// [`RewardStore`] on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgRewardStore {
    pool: PgPool,
}

impl PgRewardStore {
    /// Connects to `url` and applies any pending migration (concurrent starts wait on the
    /// migrator's advisory lock, so one applies and the others find it done).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let pool = ecoscan_sql::connect_postgres(url, MAX_CONNECTIONS, &migrator())
            .await
            .context("failed to open the reward database on postgresql")?;
        Ok(Self { pool })
    }

    /// Closes every connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

const SELECT_DECISION: &str = "SELECT job_id, user_id, eligible, newly_granted, character_code, reason \
     FROM reward_decisions WHERE job_id = $1";

fn decision_from_row(row: &PgRow) -> Result<StoredDecision, sqlx::Error> {
    Ok(StoredDecision {
        job_id: row.try_get("job_id")?,
        user_id: row.try_get("user_id")?,
        eligible: row.try_get("eligible")?,
        newly_granted: row.try_get("newly_granted")?,
        character_code: row.try_get("character_code")?,
        reason: row.try_get("reason")?,
    })
}

impl RewardStore for PgRewardStore {
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
        fields(otel.name = "INSERT reward_decisions, owned_characters", otel.kind = "client", db.system = "postgresql", db.operation.name = "INSERT", db.collection.name = "reward_decisions", job.id = %g.job_id),
        err
    )]
    async fn grant(&self, g: Grant) -> anyhow::Result<StoredDecision> {
        let mut tx = self.pool.begin().await.context("failed to begin")?;
        // The decision is claimed first: a concurrent grant for the same job waits on its
        // primary key until this transaction ends, then finds the job decided and grants
        // nothing, whatever character it carried.
        let claimed = sqlx::query(
            "INSERT INTO reward_decisions \
             (job_id, user_id, eligible, newly_granted, character_code, reason, decided_at_us) \
             VALUES ($1, $2, TRUE, TRUE, $3, 'granted', $4) ON CONFLICT (job_id) DO NOTHING",
        )
        .bind(&g.job_id)
        .bind(&g.user_id)
        .bind(&g.character_code)
        .bind(g.now_us)
        .execute(&mut *tx)
        .await
        .context("failed to insert the decision")?
        .rows_affected()
            == 1;
        if claimed {
            // A concurrent grant of the same character (another job) waits on the ownership key
            // and then inserts nothing: one of them says "granted", the others "already_owned".
            let owned = sqlx::query(
                "INSERT INTO owned_characters (user_id, character_code, job_id, acquired_at_us) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (user_id, character_code) DO NOTHING",
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
            if !owned {
                sqlx::query(
                    "UPDATE reward_decisions SET newly_granted = FALSE, reason = 'already_owned' \
                     WHERE job_id = $1",
                )
                .bind(&g.job_id)
                .execute(&mut *tx)
                .await
                .context("failed to record an already owned character")?;
            }
        }
        // Read in the same transaction: it sees this transaction's rows, or (when the job was
        // decided before) the committed decision that made the insert above do nothing.
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
        fields(otel.name = "SELECT owned_characters", otel.kind = "client", db.system = "postgresql", db.operation.name = "SELECT", db.collection.name = "owned_characters"),
        err
    )]
    async fn list_owned(&self, user_id: &str) -> anyhow::Result<Vec<OwnedRow>> {
        let rows = sqlx::query(
            "SELECT character_code, job_id, acquired_at_us FROM owned_characters \
             WHERE user_id = $1 ORDER BY acquired_at_us, character_code",
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
