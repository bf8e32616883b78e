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
        model: String::new(),
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
            model: String::new(),
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
    // A table added since (direct uploads) comes with the schema, without an upgrade step.
    assert!(store.get_upload("none").await.unwrap().is_none());
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
    assert_eq!(tables, ["scan_jobs", "scan_uploads"]);
}
