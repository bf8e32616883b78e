//! The embedded job store: [`SqlJobStore`] on a SQLite file (or an in-memory database).
//!
//! The schema (`migrations/0001_init.sql`) is idempotent; what changed since a database was
//! made is applied first, by [`upgrade`], with the schema's version kept in SQLite's own
//! `user_version`.

use std::path::Path;

use sqlx::{Row, Sqlite, SqlitePool};

use super::sql::SqlJobStore;
use crate::error::StoreError;

/// [`super::JobStore`] on SQLite.
pub type SqliteJobStore = SqlJobStore<Sqlite>;

const SCHEMA: &str = include_str!("../../migrations/0001_init.sql");

/// `user_version` of a database in the current layout. 0 is a new database or one made before
/// versions were kept: table `jobs`, times in milliseconds in `*_at_ms` columns, and, in the
/// oldest, no `lease_epoch` or `dead_at_ms` yet. 1: no `end_seq` yet.
const SCHEMA_VERSION: i64 = 2;

impl SqlJobStore<Sqlite> {
    /// Opens (creating when needed) the database at `url`, brings an older layout up to date
    /// and applies the schema.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        // The schema is applied after the upgrade: applied first, it would create the new table
        // beside an old one that the upgrade then could not rename.
        let pool = ecoscan_sql::open_sqlite(url, "").await?;
        upgrade(&pool).await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        Ok(Self::new(pool))
    }

    /// Opens a file database inside `dir` (for tests and the suite).
    pub async fn open_in(dir: &Path) -> Result<Self, StoreError> {
        Self::open(&format!(
            "sqlite://{}?mode=rwc",
            dir.join("ingest.db").display()
        ))
        .await
    }
}

/// Brings a database made by an earlier version to [`SCHEMA_VERSION`], in one transaction that
/// takes the write lock first (`BEGIN IMMEDIATE`), so two processes opening one file upgrade
/// it once. Rows keep their ids, checkpoints and states; times become microseconds.
async fn upgrade(pool: &SqlitePool) -> Result<(), StoreError> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let version: i64 = sqlx::query("PRAGMA user_version")
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
    if version >= SCHEMA_VERSION {
        return Ok(());
    }
    let old_table =
        sqlx::query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'")
            .fetch_optional(&mut *tx)
            .await?
            .is_some();
    if old_table {
        let columns: Vec<String> = sqlx::query("SELECT name FROM pragma_table_info('jobs')")
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<_, _>>()?;
        for (name, ddl) in [
            (
                "lease_epoch",
                "ALTER TABLE jobs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0",
            ),
            (
                "dead_at_ms",
                "ALTER TABLE jobs ADD COLUMN dead_at_ms INTEGER",
            ),
        ] {
            if !columns.iter().any(|c| c == name) {
                sqlx::query(ddl).execute(&mut *tx).await?;
            }
        }
        // The old indexes go with their old names; the schema makes them again under the
        // table's new name.
        sqlx::raw_sql(
            "DROP INDEX IF EXISTS jobs_idempotency;
             DROP INDEX IF EXISTS jobs_unfinished;
             DROP INDEX IF EXISTS jobs_dead;
             ALTER TABLE jobs RENAME TO scan_jobs;
             ALTER TABLE scan_jobs RENAME COLUMN created_at_ms TO created_at_us;
             ALTER TABLE scan_jobs RENAME COLUMN updated_at_ms TO updated_at_us;
             ALTER TABLE scan_jobs RENAME COLUMN finished_at_ms TO finished_at_us;
             ALTER TABLE scan_jobs RENAME COLUMN dead_at_ms TO dead_at_us;
             UPDATE scan_jobs SET created_at_us = created_at_us * 1000,
                 updated_at_us = updated_at_us * 1000,
                 finished_at_us = finished_at_us * 1000,
                 dead_at_us = dead_at_us * 1000;",
        )
        .execute(&mut *tx)
        .await?;
    }
    // Version 2: the final event's seq on the row (a table the schema has not made yet gets
    // it from the schema).
    let columns: Vec<String> = sqlx::query("SELECT name FROM pragma_table_info('scan_jobs')")
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| r.try_get::<String, _>(0))
        .collect::<Result<_, _>>()?;
    if !columns.is_empty() && !columns.iter().any(|c| c == "end_seq") {
        sqlx::query("ALTER TABLE scan_jobs ADD COLUMN end_seq INTEGER")
            .execute(&mut *tx)
            .await?;
    }
    // The version is a constant, not input.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "PRAGMA user_version = {SCHEMA_VERSION}"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use ecoscan_proto::v1::{JobStatus, Stage};

    use super::*;
    use crate::store::{JobStore, NewJob};

    /// The layout of every embedded database made before `user_version` was kept (its first
    /// release, without the fencing and dead-letter columns added later).
    const FIRST_LAYOUT: &str = "
        CREATE TABLE jobs (
            id TEXT PRIMARY KEY, user_id TEXT NOT NULL, status INTEGER NOT NULL,
            stage INTEGER NOT NULL, image_key TEXT NOT NULL, content_type TEXT NOT NULL,
            hint TEXT NOT NULL, locale TEXT NOT NULL, idempotency_key TEXT,
            trace_carrier TEXT NOT NULL, classification BLOB, rules BLOB, answer BLOB,
            reward BLOB, error BLOB, attempts INTEGER NOT NULL DEFAULT 0,
            created_at_ms INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL,
            finished_at_ms INTEGER);
        CREATE UNIQUE INDEX jobs_idempotency
            ON jobs (user_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
        CREATE INDEX jobs_unfinished ON jobs (status) WHERE status IN (1, 2);
        INSERT INTO jobs (id, user_id, status, stage, image_key, content_type, hint, locale,
            idempotency_key, trace_carrier, attempts, created_at_ms, updated_at_ms, finished_at_ms)
        VALUES
            ('done', 'u1', 3, 6, 'k1', 'image/png', '', 'ko-KR', 'key-1', '{}', 1,
             1764640800123, 1764640801000, 1764640809456),
            ('waiting', 'u1', 1, 1, 'k2', 'image/png', '', 'ko-KR', NULL, '{}', 0,
             1764640900000, 1764640900000, NULL);";

    fn at_ms(ms: u64) -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn a_database_of_the_first_layout_is_upgraded_with_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("old.db").display());
        let old = ecoscan_sql::open_sqlite(&url, FIRST_LAYOUT).await.unwrap();
        old.close().await;

        let store = SqliteJobStore::open(&url).await.unwrap();
        let done = store.get("done").await.unwrap().unwrap();
        assert_eq!(done.status, JobStatus::Succeeded);
        assert_eq!(done.created_at, at_ms(1_764_640_800_123));
        assert_eq!(done.finished_at, Some(at_ms(1_764_640_809_456)));
        assert_eq!(
            done.lease_epoch, 0,
            "the fencing column came with its default"
        );
        assert_eq!(done.dead_at, None);
        // The idempotency key still finds the old job, and still refuses a second one.
        let again = NewJob {
            id: "new".into(),
            user_id: "u1".into(),
            image_key: "k3".into(),
            content_type: "image/png".into(),
            hint: String::new(),
            locale: "ko-KR".into(),
            idempotency_key: Some("key-1".into()),
            trace_carrier: Default::default(),
        };
        let (job, created) = store.insert(again).await.unwrap();
        assert!(!created);
        assert_eq!(job.id, "done");
        // The sweeper's query sees the old unfinished job at its old time.
        let unfinished = store
            .unfinished(at_ms(1_764_640_900_001), 10)
            .await
            .unwrap();
        assert_eq!(unfinished.len(), 1);
        assert_eq!(unfinished[0].id, "waiting");
        assert_eq!(unfinished[0].stage, Stage::Queued);
        store.close().await;

        // Opening again changes nothing (the upgrade ran once).
        let reopened = SqliteJobStore::open(&url).await.unwrap();
        assert_eq!(reopened.get("done").await.unwrap().unwrap(), done);
    }

    #[tokio::test]
    async fn a_database_of_version_1_gets_the_end_position_column_with_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("v1.db").display());
        // Version 1 is today's table without `end_seq`.
        let store = SqliteJobStore::open(&url).await.unwrap();
        let (job, _) = store
            .insert(NewJob {
                id: "kept".into(),
                user_id: "u1".into(),
                image_key: "k".into(),
                content_type: "image/png".into(),
                hint: String::new(),
                locale: "ko".into(),
                idempotency_key: None,
                trace_carrier: Default::default(),
            })
            .await
            .unwrap();
        sqlx::raw_sql(
            "ALTER TABLE scan_jobs DROP COLUMN end_seq;
             PRAGMA user_version = 1;",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        store.close().await;

        let store = SqliteJobStore::open(&url).await.unwrap();
        let got = store.get(&job.id).await.unwrap().unwrap();
        assert_eq!(got.end_seq, None);
        assert_eq!(got.user_id, job.user_id);
        let version: i64 = sqlx::query("PRAGMA user_version")
            .fetch_one(&store.pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(version, SCHEMA_VERSION);
    }

    #[tokio::test]
    async fn a_new_database_gets_the_current_layout() {
        let store = SqliteJobStore::open("sqlite::memory:").await.unwrap();
        let version: i64 = sqlx::query("PRAGMA user_version")
            .fetch_one(&store.pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(version, SCHEMA_VERSION);
        let tables: Vec<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                .fetch_all(&store.pool)
                .await
                .unwrap();
        assert_eq!(tables, ["scan_jobs"]);
    }
}
