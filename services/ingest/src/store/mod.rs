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
pub use jobs::{Job, JobStore, NewJob};
pub use objects::{LocalObjectStore, ObjectStore, ObjectStoreConfig, S3Config, S3ObjectStore};
pub use postgres::PgJobStore;
pub use queue::{Lease, MemoryQueue, Queue, QueueEntry};
pub use redis::{RedisEventLog, RedisQueue};
pub use sql::SqlJobStore;
pub use sqlite::SqliteJobStore;
