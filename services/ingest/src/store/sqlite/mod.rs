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

const SCHEMA: &str = include_str!("../../../migrations/0001_init.sql");

/// `user_version` of a database in the current layout. 0 is a new database or one made before
/// versions were kept: table `jobs`, times in milliseconds in `*_at_ms` columns, and, in the
/// oldest, no `lease_epoch` or `dead_at_ms` yet. 1: no `end_seq` yet.
const SCHEMA_VERSION: i64 = 4;

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
    // Version 3: why a job was dead-lettered and how often the schedule requeued it.
    for (name, ddl) in [
        (
            "dead_reason",
            "ALTER TABLE scan_jobs ADD COLUMN dead_reason TEXT",
        ),
        (
            "auto_requeues",
            "ALTER TABLE scan_jobs ADD COLUMN auto_requeues INTEGER NOT NULL DEFAULT 0",
        ),
    ] {
        if !columns.is_empty() && !columns.iter().any(|c| c == name) {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
    }
    // Version 4: the model a scan chose.
    if !columns.is_empty() && !columns.iter().any(|c| c == "model") {
        sqlx::query("ALTER TABLE scan_jobs ADD COLUMN model TEXT NOT NULL DEFAULT ''")
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
mod tests;
