//! The production stores for tests that run the services as processes: a Redis key prefix, a
//! PostgreSQL schema and an S3 bucket of the test's own on the servers `infra/services.sh`
//! starts (`TEST_REDIS_URL`, `TEST_DATABASE_URL`, `TEST_S3_ENDPOINT`), and a private
//! `redis-server` for tests that must kill Redis or count its clients without disturbing the
//! shared one. Everything is removed when the values are dropped, even after a panic.
//!
//! ```ignore
//! let stores = TestStores::create(None).await;                 // shared Redis, own prefix
//! let cluster = stores.configure(Cluster::builder()).start().await;
//! let pg = stores.pg().await;                                   // query the services' tables
//! ```

#![allow(dead_code)]

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, PgPool, postgres::PgPoolOptions};

use super::processes::ClusterBuilder;

const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const DEFAULT_S3_ENDPOINT: &str = "http://127.0.0.1:9000";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// A Redis prefix, a PostgreSQL schema and an S3 bucket that belong to one test.
pub struct TestStores {
    /// The Redis every service of the test uses: one server, or a private Cluster.
    pub redis: ecoscan_redis::Settings,
    /// Its (first) node's URL.
    pub redis_url: String,
    /// Prefix of every Redis key (ingest and notification).
    pub prefix: String,
    /// The database URL with the test's schema as `search_path`.
    pub database_url: String,
    pub schema: String,
    pub s3_endpoint: String,
    pub bucket: String,
    base_database_url: String,
}

impl TestStores {
    /// Creates the schema (the bucket is created by the services at start). `redis_url`
    /// overrides `TEST_REDIS_URL` (a private server). Panics, saying how to start them, when
    /// PostgreSQL or S3 is unreachable: a skipped test would pass without testing anything.
    pub async fn create(redis_url: Option<String>) -> Self {
        let redis_url = redis_url.unwrap_or_else(|| env_or("TEST_REDIS_URL", DEFAULT_REDIS_URL));
        Self::create_on(ecoscan_redis::Settings::single(redis_url)).await
    }

    /// [`Self::create`] with the services on `redis` (e.g. a [`PrivateCluster`]'s settings).
    pub async fn create_on(redis: ecoscan_redis::Settings) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let redis_url = redis.urls[0].clone();
        let base = env_or("TEST_DATABASE_URL", DEFAULT_DATABASE_URL);
        let s3_endpoint = env_or("TEST_S3_ENDPOINT", DEFAULT_S3_ENDPOINT);
        let schema = format!("t_{id}");

        let mut conn = sqlx::PgConnection::connect(&base)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "PostgreSQL is not reachable at {base} ({e}); start it with infra/services.sh \
                 or point TEST_DATABASE_URL at a server"
                )
            });
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&mut conn)
            .await
            .expect("create the test schema");
        conn.close().await.ok();

        let mut node = redis_connection(&redis_url).await;
        redis::cmd("PING")
            .query_async::<String>(&mut node)
            .await
            .unwrap_or_else(|e| panic!("Redis at {redis_url} does not answer PING: {e}"));

        let probe = reqwest::Client::new()
            .get(&s3_endpoint)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        assert!(
            probe.is_ok(),
            "the S3 endpoint {s3_endpoint} is not reachable ({probe:?}); start it with \
             infra/services.sh or point TEST_S3_ENDPOINT at one"
        );

        let sep = if base.contains('?') { '&' } else { '?' };
        Self {
            redis,
            redis_url,
            prefix: format!("t:{id}:"),
            database_url: format!("{base}{sep}options[search_path]={schema}"),
            schema,
            s3_endpoint,
            bucket: format!("t-{id}"),
            base_database_url: base,
        }
    }

    /// Points every service of `builder` at these stores: Redis (ingest, notification),
    /// PostgreSQL (ingest, reward, analytics, notification) and S3 (ingest's images, analytics'
    /// bodies).
    pub fn configure(&self, builder: ClusterBuilder) -> ClusterBuilder {
        builder
            .env("REDIS_URL", self.redis.urls.join(","))
            .env("REDIS_CLUSTER", self.redis.cluster.to_string())
            .env("INGEST_REDIS_PREFIX", &self.prefix)
            .env("NOTIFICATION_REDIS_PREFIX", &self.prefix)
            .env("INGEST_DATABASE_URL", &self.database_url)
            .env("REWARD_DATABASE_URL", &self.database_url)
            .env("ANALYTICS_DATABASE_URL", &self.database_url)
            .env("NOTIFICATION_DATABASE_URL", &self.database_url)
            .env("S3_ENDPOINT", &self.s3_endpoint)
            .env("S3_BUCKET", &self.bucket)
            .env("S3_ACCESS_KEY_ID", "test")
            .env("S3_SECRET_ACCESS_KEY", "test")
    }

    /// A pool on the test's schema, to read what the services stored.
    pub async fn pg(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.database_url)
            .await
            .expect("connect to the test schema")
    }

    /// A connection to the test's Redis (one server or the Cluster).
    pub async fn redis(&self) -> ecoscan_redis::Conn {
        ecoscan_redis::Redis::connect(&self.redis, "test-observer")
            .await
            .unwrap_or_else(|e| panic!("Redis is not reachable ({:?}): {e}", self.redis.urls))
            .conn()
    }

    /// A plain connection to the test's (single) Redis server, for `CLIENT LIST`.
    pub async fn redis_node(&self) -> redis::aio::MultiplexedConnection {
        redis_connection(&self.redis_url).await
    }
}

async fn redis_connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap_or_else(|e| panic!("bad Redis URL {url}: {e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Redis is not reachable at {url} ({e}); start it with infra/services.sh or \
                 point TEST_REDIS_URL at a server"
            )
        })
}

impl Drop for TestStores {
    fn drop(&mut self) {
        // A private Cluster goes with its processes; keys on a shared server are deleted.
        let redis_url = (!self.redis.cluster).then(|| self.redis_url.clone());
        let prefix = self.prefix.clone();
        let base = self.base_database_url.clone();
        let schema = self.schema.clone();
        let s3 = ecoscan_objects::S3Config {
            endpoint: self.s3_endpoint.clone(),
            bucket: self.bucket.clone(),
            region: "us-east-1".into(),
            credentials: Some(("test".into(), "test".into())),
            key_prefix: String::new(),
        };
        // Drop runs inside the test's runtime, which cannot be blocked on: use a thread of its own.
        let cleaned = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let mut problems = Vec::new();
                if let Some(redis_url) = &redis_url
                    && let Err(e) = delete_redis_keys(redis_url, &prefix).await
                {
                    problems.push(format!("redis keys {prefix}*: {e}"));
                }
                let dropped = async {
                    let mut conn = sqlx::PgConnection::connect(&base).await?;
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "DROP SCHEMA IF EXISTS {schema} CASCADE"
                    )))
                    .execute(&mut conn)
                    .await?;
                    conn.close().await
                };
                if let Err(e) = dropped.await {
                    problems.push(format!("schema {schema}: {e}"));
                }
                // The services create the bucket at start; a test that failed before may not have.
                let bucket = s3.bucket.clone();
                match ecoscan_objects::S3ObjectStore::connect(s3).await {
                    Ok(store) => {
                        if let Err(e) = store.delete_bucket().await {
                            problems.push(format!("bucket {bucket}: {e}"));
                        }
                    }
                    Err(e) => problems.push(format!("bucket {bucket}: {e}")),
                }
                if problems.is_empty() {
                    Ok(())
                } else {
                    Err(problems.join("; "))
                }
            })
        })
        .join();
        match cleaned {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("test stores were not all removed: {e}"),
            Err(_) => eprintln!("test store cleanup panicked"),
        }
    }
}

/// The name of every client connected to the server `conn` talks to (`""` when unnamed),
/// except `conn` itself, by `CLIENT LIST`.
pub async fn client_names<C: redis::aio::ConnectionLike>(conn: &mut C) -> Vec<String> {
    let me: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(conn)
        .await
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(conn)
        .await
        .expect("CLIENT LIST");
    let me = format!("id={me}");
    list.lines()
        .filter(|line| line.split(' ').next() != Some(me.as_str()))
        .map(|line| {
            line.split(' ')
                .find_map(|f| f.strip_prefix("name="))
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

/// Deletes every key under `prefix`.
async fn delete_redis_keys(url: &str, prefix: &str) -> redis::RedisResult<()> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    ecoscan_redis::unlink_prefixed(&mut conn, prefix).await?;
    Ok(())
}

impl TestStores {
    /// Every event in `job_id`'s log as ingest stored it in Redis (under this test's prefix).
    pub async fn event_log(
        &self,
        redis: &mut ecoscan_redis::Conn,
        job_id: &str,
    ) -> Vec<ecoscan_proto::v1::ScanEvent> {
        use ecoscan_ingest::store::redis::{DEFAULT_FEED_SHARDS, shard_of};
        let shard = shard_of(job_id, DEFAULT_FEED_SHARDS);
        let key = format!("{}scan:{{s{shard}}}:{job_id}:events", self.prefix);
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .query_async(redis)
            .await
            .expect("XRANGE");
        reply
            .ids
            .iter()
            .map(|e| logged_event(&e.get::<Vec<u8>>("ev").expect("event body")))
            .collect()
    }
}

/// The status of every job row (`JobStatus` values).
pub async fn job_statuses(pg: &PgPool) -> Vec<i32> {
    use sqlx::Row;
    sqlx::query("SELECT status FROM scan_jobs")
        .fetch_all(pg)
        .await
        .expect("statuses")
        .iter()
        .map(|r| r.get("status"))
        .collect()
}

/// Reward's stored decisions by job: `(user, eligible, newly granted, character code)`.
pub async fn reward_decisions(
    pg: &PgPool,
) -> std::collections::HashMap<String, (String, bool, bool, Option<String>)> {
    use sqlx::Row;
    sqlx::query(
        "SELECT job_id, user_id, eligible, newly_granted, character_code FROM reward_decisions",
    )
    .fetch_all(pg)
    .await
    .expect("read reward decisions")
    .iter()
    .map(|r| {
        (
            r.get("job_id"),
            (
                r.get("user_id"),
                r.get("eligible"),
                r.get("newly_granted"),
                r.get("character_code"),
            ),
        )
    })
    .collect()
}

/// An event as ingest's Redis log stores it: `<job>\n<id>\n<seq>\n<protobuf body>`.
pub fn logged_event(bytes: &[u8]) -> ecoscan_proto::v1::ScanEvent {
    use prost::Message;
    let mut parts = bytes.splitn(4, |b| *b == b'\n');
    let (Some(job), Some(id), Some(seq), Some(body)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        panic!("a logged event has a header");
    };
    let mut event = ecoscan_proto::v1::ScanEvent::decode(body).expect("a ScanEvent");
    event.job_id = String::from_utf8_lossy(job).into_owned();
    event.event_id = String::from_utf8_lossy(id).into_owned();
    event.seq = String::from_utf8_lossy(seq).parse().expect("a seq");
    event
}

#[allow(unused_imports)] // Each test binary uses its own part of these.
pub use ecoscan_redis::testing::{PrivateCluster, PrivateRedis};
