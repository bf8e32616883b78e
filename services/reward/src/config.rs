//! The reward service's settings and where they come from.

use ecoscan_common::config::{env_opt, env_or};

/// Default database: a SQLite file under `./data`.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://./data/reward.db?mode=rwc";

/// Configuration of the reward service.
///
/// Environment variables:
/// - `REWARD_DATABASE_URL`, else `DATABASE_URL`: sqlx database URL (default
///   `sqlite://./data/reward.db?mode=rwc`; `sqlite::memory:` for a throw-away database; a
///   `postgres://` URL selects PostgreSQL, whose migrations are applied at start). The parent
///   directory of a SQLite file is created.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where grants and decisions are stored.
    pub database_url: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
        }
    }
}

impl Config {
    /// Reads the configuration from the environment (see the type's docs).
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            database_url: match env_opt("REWARD_DATABASE_URL") {
                Some(url) => url,
                None => env_or("DATABASE_URL", DEFAULT_DATABASE_URL.to_owned())?,
            },
        })
    }
}

impl Config {
    /// Switches this configuration onto PostgreSQL when `REWARD_DATABASE_URL` (else
    /// `DATABASE_URL`) is a `postgres://` URL, and leaves it as it is otherwise. `ecoscan up`
    /// builds its own embedded configuration and passes it through here.
    pub fn with_stores_from_env(mut self) -> Self {
        if let Some(url) = env_opt("REWARD_DATABASE_URL")
            .or_else(|| env_opt("DATABASE_URL"))
            .filter(|u| crate::store::is_postgres(u))
        {
            self.database_url = url;
        }
        self
    }
}
