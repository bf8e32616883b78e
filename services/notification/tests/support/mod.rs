#![allow(dead_code, unused_imports)] // Each test binary uses its own part of these helpers.

//! Test helpers: a private PostgreSQL schema per test (shared with every SQL store), and
//! what this crate's tests need besides.

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
