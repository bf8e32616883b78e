//! One conformance suite for [`RewardStore`], run against every implementation: SQLite (a file
//! in a temporary directory) and PostgreSQL (a schema of its own on `TEST_DATABASE_URL`).

use ecoscan_reward::store::{Grant, RewardStore, StoredDecision};

fn grant(job: &str, user: &str, code: &str, now_us: i64) -> Grant {
    Grant {
        job_id: job.into(),
        user_id: user.into(),
        character_code: code.into(),
        now_us,
    }
}

async fn first_grant_is_granted_and_stored_as_the_jobs_decision<S: RewardStore + Clone>(s: S) {
    assert_eq!(s.decision("j1").await.unwrap(), None);

    let d = s.grant(grant("j1", "u", "char-petty", 10)).await.unwrap();

    let expected = StoredDecision {
        job_id: "j1".into(),
        user_id: "u".into(),
        eligible: true,
        newly_granted: true,
        character_code: Some("char-petty".into()),
        reason: "granted".into(),
    };
    assert_eq!(d, expected);
    assert_eq!(s.decision("j1").await.unwrap(), Some(expected));
}

async fn a_second_job_for_an_owned_character_is_already_owned<S: RewardStore + Clone>(s: S) {
    s.grant(grant("j1", "u", "char-petty", 10)).await.unwrap();

    let d = s.grant(grant("j2", "u", "char-petty", 20)).await.unwrap();

    assert!(d.eligible && !d.newly_granted);
    assert_eq!(d.reason, "already_owned");
    assert_eq!(s.decision("j2").await.unwrap(), Some(d));
    let owned = s.list_owned("u").await.unwrap();
    assert_eq!(owned.len(), 1);
    assert_eq!(owned[0].job_id, "j1");
}

async fn a_decided_job_grants_nothing_even_with_another_character<S: RewardStore + Clone>(s: S) {
    let first = s.grant(grant("j1", "u", "char-petty", 10)).await.unwrap();

    let replay = s.grant(grant("j1", "u", "char-glassy", 20)).await.unwrap();

    assert_eq!(replay, first);
    let codes: Vec<_> = s
        .list_owned("u")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.character_code)
        .collect();
    assert_eq!(codes, ["char-petty"]);
}

/// A job whose character the user owns (by this job or another) is decided in one statement;
/// replaying a decided job, before or after that, still returns its first decision.
async fn a_decided_job_replayed_once_its_character_is_owned_returns_its_first_decision<
    S: RewardStore + Clone,
>(
    s: S,
) {
    let granted = s.grant(grant("j1", "u", "char-petty", 10)).await.unwrap();
    assert!(granted.newly_granted);
    // The character is owned now; the replay must not become "already_owned".
    assert_eq!(
        s.grant(grant("j1", "u", "char-petty", 20)).await.unwrap(),
        granted
    );

    let owned = s.grant(grant("j2", "u", "char-petty", 30)).await.unwrap();
    assert_eq!(owned.reason, "already_owned");
    // Twelve concurrent replays of the already-owned job: one decision, stored once.
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.grant(grant("j2", "u", "char-petty", 40 + i)).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), owned);
    }
    assert_eq!(s.decision("j2").await.unwrap(), Some(owned));
    // Another user's ownership decides nothing for this one.
    let other = s.grant(grant("j3", "v", "char-petty", 50)).await.unwrap();
    assert!(other.newly_granted, "{other:?}");
    let owned = s.list_owned("u").await.unwrap();
    assert_eq!(owned.len(), 1);
    assert_eq!(owned[0].job_id, "j1");
}

async fn concurrent_grants_of_one_job_store_one_decision_and_one_character<
    S: RewardStore + Clone,
>(
    s: S,
) {
    let codes = ["char-a", "char-b", "char-c", "char-d"];
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.grant(grant("job", "u", codes[i % 4], 10)).await })
        })
        .collect();
    let mut decisions = Vec::new();
    for t in tasks {
        decisions.push(t.await.unwrap().unwrap());
    }

    assert!(
        decisions.iter().all(|d| d == &decisions[0]),
        "{decisions:?}"
    );
    assert!(decisions[0].newly_granted);
    assert_eq!(s.list_owned("u").await.unwrap().len(), 1);
}

async fn concurrent_jobs_grant_a_character_exactly_once<S: RewardStore + Clone>(s: S) {
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.grant(grant(&format!("job-{i}"), "u", "char-a", i)).await })
        })
        .collect();
    let mut decisions = Vec::new();
    for t in tasks {
        decisions.push(t.await.unwrap().unwrap());
    }

    assert_eq!(decisions.iter().filter(|d| d.newly_granted).count(), 1);
    assert_eq!(
        decisions
            .iter()
            .filter(|d| d.reason == "already_owned")
            .count(),
        11
    );
    let owned = s.list_owned("u").await.unwrap();
    assert_eq!(owned.len(), 1);
    let winner = decisions.iter().find(|d| d.newly_granted).unwrap();
    assert_eq!(owned[0].job_id, winner.job_id);
}

async fn list_owned_is_oldest_first_and_per_user<S: RewardStore + Clone>(s: S) {
    s.grant(grant("j3", "u", "char-c", 30)).await.unwrap();
    s.grant(grant("j1", "u", "char-a", 10)).await.unwrap();
    s.grant(grant("j2", "other", "char-b", 20)).await.unwrap();

    let owned = s.list_owned("u").await.unwrap();

    let summary: Vec<_> = owned
        .iter()
        .map(|o| {
            (
                o.character_code.as_str(),
                o.job_id.as_str(),
                o.acquired_at_us,
            )
        })
        .collect();
    assert_eq!(summary, [("char-a", "j1", 10), ("char-c", "j3", 30)]);
    assert!(s.list_owned("nobody").await.unwrap().is_empty());
}

ecoscan_sql::store_conformance! {
    sqlite: ecoscan_reward::store::SqliteRewardStore, "reward.db";
    postgres: ecoscan_reward::store::PgRewardStore;
    cases:
    first_grant_is_granted_and_stored_as_the_jobs_decision,
    a_second_job_for_an_owned_character_is_already_owned,
    a_decided_job_grants_nothing_even_with_another_character,
    a_decided_job_replayed_once_its_character_is_owned_returns_its_first_decision,
    concurrent_grants_of_one_job_store_one_decision_and_one_character,
    concurrent_jobs_grant_a_character_exactly_once,
    list_owned_is_oldest_first_and_per_user,
}
