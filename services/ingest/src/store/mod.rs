//! Storage behind small traits. Each has an embedded implementation here; production ones
//! (Redis Streams, PostgreSQL, S3) implement the same traits and pass the same conformance tests.
//! The job store is SQL written once ([`sql`]) for SQLite ([`sqlite`]) and PostgreSQL
//! ([`postgres`]).

pub mod events;
pub mod jobs;
pub mod objects;
pub mod postgres;
pub mod queue;
pub mod redis;
pub mod sql;
pub mod sqlite;

pub use events::{EventId, EventLog, Feed, FeedItem, MemoryEventLog, RUN_SPAN};
pub use jobs::{Job, JobStore, NewJob, Upload};
pub use objects::{LocalObjectStore, ObjectStore, ObjectStoreConfig, S3Config};
pub use postgres::PgJobStore;
pub use queue::{Lease, MemoryQueue, Queue, QueueEntry};
pub use redis::{RedisEventLog, RedisQueue};
pub use sql::SqlJobStore;
pub use sqlite::SqliteJobStore;

use std::sync::Arc;

use anyhow::Context;
use ecoscan_common::store_health::{Down, StoreHealth};

use crate::Config;

/// Bytes of recently stored images kept in memory for the vision stage (with S3).
const RECENT_IMAGES_BYTES: usize = 64 * 1024 * 1024;

/// Every store ingest uses.
#[derive(Clone)]
pub struct Stores {
    pub jobs: Arc<dyn JobStore>,
    pub events: Arc<dyn EventLog>,
    pub queue: Arc<dyn Queue>,
    pub objects: Arc<dyn ObjectStore>,
}

impl Stores {
    /// The health of each store reached over the network (PostgreSQL, Redis), each once.
    pub fn healths(&self) -> Vec<StoreHealth> {
        let mut healths: Vec<StoreHealth> = Vec::new();
        let all = [
            self.jobs.health(),
            self.events.health(),
            self.queue.health(),
        ];
        for health in all.into_iter().flatten() {
            if !healths.iter().any(|h| h.same(&health)) {
                healths.push(health);
            }
        }
        healths
    }

    /// Whether a new request that needs the stores (a submit, a new watch) may go ahead:
    /// refused at once with the store that is down while its circuit is open (see
    /// [`ecoscan_common::store_health`]), instead of waiting out its timeout. Work already
    /// accepted (workers, leases, the sweeper) never asks and waits for the store as before.
    pub fn check(&self) -> Result<(), Down> {
        // Each store once: a second look would take the probe the first one let through.
        self.healths().iter().try_for_each(StoreHealth::check)
    }

    /// The embedded stores: SQLite rows, a local object directory, in-memory log and queue.
    pub async fn embedded(config: &Config) -> anyhow::Result<Self> {
        Ok(Self {
            jobs: Arc::new(SqliteJobStore::open(&config.database_url).await?),
            events: Arc::new(MemoryEventLog::new(config.event_max_len)),
            queue: Arc::new(MemoryQueue::new()),
            objects: Arc::new(LocalObjectStore::open(&config.object_dir).await?),
        })
    }

    /// The stores `config` selects, each on its own: PostgreSQL job rows for a `postgres://`
    /// database URL (else SQLite), Redis event log and queue with `redis_url` (else in memory),
    /// S3 images with `s3` (else the object directory).
    pub async fn from_config(config: &Config) -> anyhow::Result<Self> {
        let jobs: Arc<dyn JobStore> = if postgres::is_postgres_url(&config.database_url) {
            tracing::info!("job rows in postgresql");
            Arc::new(
                PgJobStore::connect(&config.database_url)
                    .await
                    .context("failed to open the postgresql job store")?,
            )
        } else {
            Arc::new(
                SqliteJobStore::open(&config.database_url)
                    .await
                    .with_context(|| format!("failed to open {}", config.database_url))?,
            )
        };
        let (events, queue): (Arc<dyn EventLog>, Arc<dyn Queue>) = match &config.redis {
            Some(settings) => {
                tracing::info!(
                    cluster = settings.cluster,
                    "event log and dispatch queue in redis"
                );
                let consumer = redis::consumer_name();
                let redis =
                    ecoscan_redis::Redis::connect(settings, &format!("ecoscan-ingest:{consumer}"))
                        .await
                        .context("failed to connect to redis (REDIS_URL)")?;
                let prefix = &config.redis_prefix;
                (
                    Arc::new(RedisEventLog::with_settings(&redis, &config.event_log())),
                    Arc::new(RedisQueue::open(&redis, prefix, &consumer).await?),
                )
            }
            None => (
                Arc::new(MemoryEventLog::new(config.event_max_len)),
                Arc::new(MemoryQueue::new()),
            ),
        };
        let objects: Arc<dyn ObjectStore> = match &config.s3 {
            Some(s3) => {
                tracing::info!(bucket = %s3.bucket, "images in s3");
                let s3 = ecoscan_objects::s3::open(s3.clone())
                    .await
                    .context("failed to open the s3 object store (S3_ENDPOINT)")?;
                // The vision stage reads back, seconds later and usually in this process, the
                // photo intake just wrote: keep recent ones rather than fetch each twice.
                Arc::new(ecoscan_objects::RecentWrites::new(s3, RECENT_IMAGES_BYTES))
            }
            None => Arc::new(LocalObjectStore::open(&config.object_dir).await?),
        };
        Ok(Self {
            jobs,
            events,
            queue,
            objects,
        })
    }
}
