#![allow(dead_code, unused_imports)] // Each test binary uses its own part of these helpers.

//! Test helpers: a private PostgreSQL schema per test (shared with every SQL store), and
//! what this crate's tests need besides.

use std::time::{Duration, SystemTime};

use ecoscan_common::USER_ID_HEADER;
use ecoscan_proto::Timestamp;
use ecoscan_proto::v1::{
    Notification, SubscribeRequest, SubscribeResponse,
    notification_service_client::NotificationServiceClient,
};
use tonic::{Request, Streaming};

pub use ecoscan_sql::testing::PgSchema;

/// Where the tests find Redis unless `TEST_REDIS_URL` says otherwise.
pub const DEFAULT_TEST_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// A key prefix `t_<uuid>:` that one test owns on the Redis `TEST_REDIS_URL` names; every key
/// under it is deleted when the value is dropped, even after a panic.
pub struct RedisPrefix {
    pub url: String,
    pub prefix: String,
}

impl RedisPrefix {
    /// Checks that Redis answers; panics with the way out when it does not, because a skipped
    /// test would pass without testing anything.
    pub async fn create() -> Self {
        let url = std::env::var("TEST_REDIS_URL")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_TEST_REDIS_URL.to_owned());
        let reachable = async {
            let mut conn = redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        }
        .await;
        if let Err(e) = reachable {
            panic!(
                "Redis is not reachable at {url} ({e}); start it with infra/services.sh or point \
                 TEST_REDIS_URL at a server"
            );
        }
        Self {
            url,
            prefix: format!("t_{}:", uuid::Uuid::new_v4().simple()),
        }
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let (url, pattern) = (self.url.clone(), format!("{}*", self.prefix));
        // Drop runs inside the test's runtime, which cannot be blocked on: use a thread of its own.
        let deleted = std::thread::spawn(move || -> redis::RedisResult<()> {
            let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
            let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut conn)?;
            if !keys.is_empty() {
                redis::cmd("DEL").arg(&keys).query::<()>(&mut conn)?;
            }
            Ok(())
        })
        .join();
        if !matches!(deleted, Ok(Ok(()))) {
            eprintln!("failed to delete test keys {}*: {deleted:?}", self.prefix);
        }
    }
}

/// How long a test waits for a notification to arrive.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The service's client, as the tests call it.
pub type Client = NotificationServiceClient<ecoscan_common::client::TracedChannel>;

/// `msg` as a call acting for `user` (the `x-user-id` metadata; empty when `user` is).
pub fn as_user<T>(msg: T, user: &str) -> Request<T> {
    let mut req = Request::new(msg);
    req.metadata_mut()
        .insert(USER_ID_HEADER, user.parse().unwrap());
    req
}

/// A time `ms` milliseconds from now (before now when negative).
pub fn in_ms(ms: i64) -> Timestamp {
    let mut ts = ecoscan_proto::timestamp(SystemTime::now());
    let total = i64::from(ts.nanos) + ms * 1_000_000;
    ts.seconds += total.div_euclid(1_000_000_000);
    ts.nanos = i32::try_from(total.rem_euclid(1_000_000_000)).unwrap();
    ts
}

/// `user`'s live notifications.
pub async fn subscribe(client: &mut Client, user: &str) -> Streaming<SubscribeResponse> {
    client
        .subscribe(as_user(SubscribeRequest {}, user))
        .await
        .unwrap()
        .into_inner()
}

/// The stream's next notification, within [`PATIENCE`].
pub async fn next(stream: &mut Streaming<SubscribeResponse>) -> Notification {
    tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("a notification arrived in time")
        .unwrap()
        .expect("the stream is still open")
        .notification
        .expect("the message carries a notification")
}
