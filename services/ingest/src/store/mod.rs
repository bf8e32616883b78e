//! Storage behind small traits. Each has an embedded implementation here; production ones
//! (Redis Streams, PostgreSQL, S3) implement the same traits and pass the same conformance tests.

pub mod events;
pub mod jobs;
pub mod objects;
pub mod postgres;
pub mod queue;
pub mod redis;

pub use events::{EventId, EventLog, Feed, FeedItem, MemoryEventLog};
pub use jobs::{Job, JobStore, NewJob, SqliteJobStore};
pub use objects::{LocalObjectStore, ObjectStore, ObjectStoreConfig, S3Config, S3ObjectStore};
pub use postgres::PgJobStore;
pub use queue::{Lease, MemoryQueue, Queue, QueueEntry};
pub use redis::{RedisEventLog, RedisQueue};
