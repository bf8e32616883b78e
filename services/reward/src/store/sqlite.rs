//! The embedded reward store: [`SqlRewardStore`] on a SQLite file (or in-memory database).

use sqlx::Sqlite;

use super::{SqlRewardStore, StoreError};

/// [`super::RewardStore`] on SQLite.
pub type SqliteRewardStore = SqlRewardStore<Sqlite>;

impl SqlRewardStore<Sqlite> {
    /// Opens (creating if needed) the database at `url` and applies the schema. File databases
    /// get their parent directory created, WAL journaling and a busy timeout so concurrent
    /// writers wait instead of failing.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool =
            ecoscan_sql::open_sqlite(url, include_str!("../../migrations/0001_init.sql")).await?;
        Ok(Self::new(pool))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Grant, RewardStore};

    fn grant(job: &str, user: &str, code: &str) -> Grant {
        Grant {
            job_id: job.into(),
            user_id: user.into(),
            character_code: code.into(),
            now_us: 1,
        }
    }

    #[tokio::test]
    async fn a_decided_job_grants_nothing_even_with_another_character() {
        let store = SqliteRewardStore::connect("sqlite::memory:").await.unwrap();
        let first = store.grant(grant("j1", "u", "char-petty")).await.unwrap();
        assert!(first.newly_granted);
        let replay = store.grant(grant("j1", "u", "char-glassy")).await.unwrap();
        assert_eq!(replay, first);
        let owned = store.list_owned("u").await.unwrap();
        assert_eq!(owned.len(), 1);
        assert_eq!(owned[0].character_code, "char-petty");
    }
}
