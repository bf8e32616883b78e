//! One conformance suite for [`Scheduler`], run against every implementation: in memory, and on
//! Redis (a key prefix of its own on `TEST_REDIS_URL`). Each case gets two handles on one
//! schedule: the same scheduler twice in memory, two connected replicas on Redis.

mod support;

use std::{collections::HashSet, sync::Arc, time::Duration};

use ecoscan_notification::scheduler::Scheduler;

const LEASE: Duration = Duration::from_secs(30);

async fn only_due_entries_are_claimed_in_due_order<S: Scheduler>(s: Arc<S>, _: Arc<S>) {
    s.add("late".into(), 300).await.unwrap();
    s.add("early".into(), 100).await.unwrap();
    s.add("mid".into(), 200).await.unwrap();

    assert_eq!(s.claim_due(250, 10, LEASE).await.unwrap(), ["early", "mid"]);
    assert!(s.claim_due(250, 10, LEASE).await.unwrap().is_empty());
    assert_eq!(s.claim_due(300, 10, LEASE).await.unwrap(), ["late"]);
}

async fn an_unacknowledged_claim_comes_back_after_its_lease<S: Scheduler>(a: Arc<S>, b: Arc<S>) {
    a.add("acked".into(), 0).await.unwrap();
    a.add("lost".into(), 0).await.unwrap();
    let lease = Duration::from_micros(1_000);

    let first = a.claim_due(10, 10, lease).await.unwrap();
    a.ack("acked").await.unwrap();

    assert_eq!(first, ["acked", "lost"]);
    assert!(b.claim_due(500, 10, lease).await.unwrap().is_empty());
    // The replica that claimed it "died": once the lease ends, another replica gets it.
    assert_eq!(b.claim_due(1_010, 10, lease).await.unwrap(), ["lost"]);
    b.ack("lost").await.unwrap();
    assert!(a.claim_due(1_000_000, 10, lease).await.unwrap().is_empty());
}

async fn a_batch_ack_forgets_claimed_entries_and_those_whose_lease_ran_out<S: Scheduler>(
    a: Arc<S>,
    b: Arc<S>,
) {
    for (due, id) in ["x", "y", "z", "late", "later"].into_iter().enumerate() {
        a.add(id.into(), due as i64).await.unwrap();
    }
    let lease = Duration::from_micros(1_000);
    assert_eq!(a.claim_due(10, 3, lease).await.unwrap(), ["x", "y", "z"]);
    assert_eq!(b.claim_due(20, 1, lease).await.unwrap(), ["late"]);

    // The lease of `late` ran out and it waits again (nobody claimed it since): acknowledging
    // it removes it all the same (its delivery was made, only late).
    a.ack_many(&["x".into(), "z".into()]).await.unwrap();
    assert_eq!(
        a.backlog().await.unwrap(),
        3,
        "y and late claimed, later waiting"
    );
    b.claim_due(2_000, 0, lease).await.unwrap();
    b.ack_many(&["late".into()]).await.unwrap();
    a.ack_many(&[]).await.unwrap();

    // Past the lease only the unacknowledged `y` comes back, with `later`, never claimed.
    let mut back = b.claim_due(5_000, 10, lease).await.unwrap();
    back.sort();
    assert_eq!(back, ["later", "y"]);
    assert_eq!(a.backlog().await.unwrap(), 2);
}

async fn the_backlog_counts_waiting_and_claimed_entries_until_acknowledged<S: Scheduler>(
    a: Arc<S>,
    b: Arc<S>,
) {
    for i in 0..10 {
        a.add(format!("n{i}"), i).await.unwrap();
    }
    let first = a.claim_due(100, 3, LEASE).await.unwrap();
    let second = b.claim_due(100, 4, LEASE).await.unwrap();
    assert_eq!((first.len(), second.len()), (3, 4));
    assert_eq!(a.backlog().await.unwrap(), 10, "3 + 4 claimed, 3 waiting");

    // One acknowledgement may span claims made by different replicas.
    let mixed: Vec<String> = [&first[..2], &second[..]].concat();
    b.ack_many(&mixed).await.unwrap();
    assert_eq!(b.backlog().await.unwrap(), 4, "one claimed, three waiting");
    a.ack(&first[2]).await.unwrap();
    assert_eq!(
        a.claim_due(100, 10, LEASE).await.unwrap(),
        ["n7", "n8", "n9"]
    );
    a.ack_many(&["n7".into(), "n8".into(), "n9".into()])
        .await
        .unwrap();
    assert_eq!(a.backlog().await.unwrap(), 0);
    // Nothing comes back after the leases: every claim was acknowledged in full.
    assert!(
        b.claim_due(i64::MAX / 2, 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn a_claim_takes_at_most_2000_and_the_next_one_the_rest<S: Scheduler>(a: Arc<S>, b: Arc<S>) {
    // 1,500 due in the first second, 1,000 in the next (due order is kept to the second: within
    // a crowded one, Redis spreads the entries over segments by id).
    for i in 0..2_500 {
        let due = if i < 1_500 { i } else { 1_000_000 + i };
        a.add(format!("n{i:05}"), due).await.unwrap();
    }
    let lease = Duration::from_secs(10);
    let now = 2_000_000;

    let first = a.claim_due(now, 2_000, lease).await.unwrap();
    let second = b.claim_due(now, 2_000, lease).await.unwrap();
    let third = a.claim_due(now, 2_000, lease).await.unwrap();

    assert_eq!(first.len(), 2_000);
    assert_eq!(second.len(), 500);
    assert!(third.is_empty());
    // The earliest due go first: all of the first second, then some of the next.
    assert_eq!(first[0], "n00000");
    let in_first_second = first.iter().filter(|id| id.as_str() < "n01500").count();
    assert_eq!(in_first_second, 1_500);
    let all: HashSet<_> = first.iter().chain(&second).cloned().collect();
    assert_eq!(all.len(), 2_500);
    // Nothing was acknowledged: after the lease every entry comes back, 2,000 at a time.
    let after = now + 10_000_000;
    let again = a.claim_due(after, 2_000, lease).await.unwrap();
    let rest = b.claim_due(after, 2_000, lease).await.unwrap();
    assert_eq!(again.len(), 2_000);
    assert_eq!(rest.len(), 500);
    let back: HashSet<_> = again.into_iter().chain(rest).collect();
    assert_eq!(back, all);
}

/// Due times spread over many seconds, dense and sparse, and the current second partly due:
/// every claim takes `max` while that many are due, in due order by second, and each entry is
/// claimed once (on Redis: whole seconds renamed into parts, small ones and the partly due second
/// copied, more seconds than a claim has parts).
async fn a_claim_spanning_many_seconds_takes_max_and_each_entry_once<S: Scheduler>(
    a: Arc<S>,
    b: Arc<S>,
) {
    const SECOND: i64 = 1_000_000;
    let mut entries = Vec::new();
    // 60 seconds of 40 entries, then 30 seconds of 3 (sparse), then 500 in second 100.
    for s in 0..60 {
        for j in 0..40 {
            entries.push((format!("{s:03}-dense-{j:02}"), s * SECOND + j));
        }
    }
    for s in 60..90 {
        for j in 0..3 {
            entries.push((format!("{s:03}-sparse-{j:02}"), s * SECOND + j));
        }
    }
    for j in 0..500 {
        entries.push((format!("100-part-{j:03}"), 100 * SECOND + j * 1_000));
    }
    assert_eq!(a.add_missing(&entries).await.unwrap(), entries.len());
    assert_eq!(a.add_missing(&entries).await.unwrap(), 0);
    // Half of second 100 is due.
    let now = 100 * SECOND + 249_500;

    let first = a.claim_due(now, 2_000, LEASE).await.unwrap();
    let second = b.claim_due(now, 2_000, LEASE).await.unwrap();
    let third = a.claim_due(now, 2_000, LEASE).await.unwrap();

    assert_eq!(first.len(), 2_000);
    // 2,400 + 90 sparse + 250 of second 100 were due.
    assert_eq!(second.len(), 740);
    assert!(third.is_empty());
    let seconds =
        |ids: &[String]| -> Vec<String> { ids.iter().map(|id| id[..3].to_owned()).collect() };
    let (s1, s2) = (seconds(&first), seconds(&second));
    assert!(s1.is_sorted(), "the first claim is in due order by second");
    assert!(s2.is_sorted(), "the second claim is in due order by second");
    assert!(
        s1.last() <= s2.first(),
        "the second claim follows the first"
    );
    let all: HashSet<_> = first.iter().chain(&second).cloned().collect();
    assert_eq!(all.len(), 2_740, "no entry was claimed twice");
    assert_eq!(a.backlog().await.unwrap(), entries.len() as u64);

    // The rest of second 100 falls due; acknowledged, everything is gone.
    let rest = b.claim_due(101 * SECOND, 2_000, LEASE).await.unwrap();
    assert_eq!(rest.len(), 250);
    for ids in [&first, &second, &rest] {
        a.ack_many(ids).await.unwrap();
    }
    assert_eq!(b.backlog().await.unwrap(), 0);
    assert!(
        a.claim_due(i64::MAX / 2, 2_000, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A campaign: 20,000 entries due at the same microsecond (on Redis a crowded second, spread over
/// several levels of segments as it fills). Each claim takes 2,000 while that many are due, every
/// entry is claimed once, and a restore of the whole campaign midway finds every entry, waiting or
/// claimed, and adds nothing.
async fn a_crowded_second_is_claimed_2000_at_a_time_and_each_entry_once<S: Scheduler>(
    a: Arc<S>,
    b: Arc<S>,
) {
    let due = 5_000_000;
    let entries: Vec<(String, i64)> = (0..20_000).map(|i| (format!("c{i:05}"), due)).collect();
    assert_eq!(a.add_missing(&entries).await.unwrap(), 20_000);

    let mut claimed = HashSet::new();
    for round in 0..10 {
        let s = if round % 2 == 0 { &a } else { &b };
        let got = s.claim_due(due + 1, 2_000, LEASE).await.unwrap();
        assert_eq!(got.len(), 2_000, "claim {round}");
        claimed.extend(got);
        if round == 4 {
            assert_eq!(b.add_missing(&entries).await.unwrap(), 0);
        }
    }
    assert_eq!(claimed.len(), 20_000, "no entry was claimed twice");
    assert!(a.claim_due(due + 1, 2_000, LEASE).await.unwrap().is_empty());
    assert_eq!(a.add_missing(&entries).await.unwrap(), 0);
    assert_eq!(b.backlog().await.unwrap(), 20_000);
}

async fn concurrent_claimers_never_share_an_entry<S: Scheduler>(a: Arc<S>, b: Arc<S>) {
    for i in 0..600 {
        a.add(format!("n{i}"), i).await.unwrap();
    }

    let claimers: Vec<_> = (0..6)
        .map(|i| {
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let got = s.claim_due(1_000, 37, LEASE).await.unwrap();
                    if got.is_empty() {
                        return mine;
                    }
                    mine.extend(got);
                }
            })
        })
        .collect();
    let mut total = 0;
    let mut seen = HashSet::new();
    for c in claimers {
        let mine = c.await.unwrap();
        total += mine.len();
        seen.extend(mine);
    }

    assert_eq!(total, 600);
    assert_eq!(seen.len(), 600);
}

async fn wait_returns_promptly_once_an_entry_is_due<S: Scheduler>(a: Arc<S>, _: Arc<S>) {
    let due = now_us() + 50_000;
    a.add("soon".into(), due).await.unwrap();

    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        // Looping is what the delivery loop does: a wait may end early (a wake-up), never late.
        loop {
            let claimed = a.claim_due(now_us(), 10, LEASE).await.unwrap();
            if !claimed.is_empty() {
                return claimed;
            }
            a.wait(Duration::from_secs(3_600)).await;
        }
    })
    .await
    .expect("the due entry was claimed long before the hour-long wait cap");

    assert_eq!(waited, ["soon"]);
}

fn now_us() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

async fn add_missing_adds_only_what_is_neither_waiting_nor_claimed<S: Scheduler>(
    a: Arc<S>,
    b: Arc<S>,
) {
    a.add("waiting".into(), 100).await.unwrap();
    a.add("claimed".into(), 50).await.unwrap();
    assert_eq!(a.claim_due(60, 10, LEASE).await.unwrap(), ["claimed"]);

    // Another replica restores a page holding all three: only the lost one is added, and the
    // waiting one keeps its due time.
    let page = [
        ("claimed".to_owned(), 50),
        ("waiting".to_owned(), 900),
        ("lost".to_owned(), 200),
    ];
    let added = b.add_missing(&page).await.unwrap();
    let again = a.add_missing(&page).await.unwrap();

    assert_eq!(added, 1);
    assert_eq!(again, 0, "restoring twice adds nothing");
    assert_eq!(
        b.claim_due(250, 10, LEASE).await.unwrap(),
        ["waiting", "lost"]
    );
    // The claimed one was not handed out a second time while its lease runs.
    assert!(a.claim_due(1_000, 10, LEASE).await.unwrap().is_empty());
    // Once acknowledged, it is gone, and restoring it adds it again (the row would say whether
    // that was right: the reconcile sweep only restores rows still scheduled).
    a.ack("claimed").await.unwrap();
    assert_eq!(a.add_missing(&page[..1]).await.unwrap(), 1);
    assert_eq!(b.claim_due(1_000, 10, LEASE).await.unwrap(), ["claimed"]);
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use std::sync::Arc;
            use ecoscan_notification::scheduler::MemoryScheduler;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let s = Arc::new(MemoryScheduler::new());
                    super::$case(s.clone(), s).await;
                }
            )*
        }
        mod redis {
            use std::{sync::Arc, time::Duration};
            use ecoscan_notification::scheduler::RedisScheduler;
            use crate::support::RedisPrefix;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let p = RedisPrefix::create().await;
                    let poll = Duration::from_millis(100);
                    let a = RedisScheduler::connect(&p.url, &p.prefix, poll).await.unwrap();
                    let b = RedisScheduler::connect(&p.url, &p.prefix, poll).await.unwrap();
                    super::$case(Arc::new(a), Arc::new(b)).await;
                }
            )*
        }
        mod redis_cluster {
            use std::{sync::Arc, time::Duration};
            use ecoscan_notification::scheduler::RedisScheduler;
            use ecoscan_redis::{Redis, testing::PrivateCluster};
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let cluster = PrivateCluster::start().await;
                    let poll = Duration::from_millis(100);
                    let a = Redis::connect(&cluster.settings(), "a").await.unwrap();
                    let b = Redis::connect(&cluster.settings(), "b").await.unwrap();
                    let a = RedisScheduler::new(&a, "", poll);
                    let b = RedisScheduler::new(&b, "", poll);
                    super::$case(Arc::new(a), Arc::new(b)).await;
                }
            )*
        }
    };
}

conformance!(
    a_batch_ack_forgets_claimed_entries_and_those_whose_lease_ran_out,
    a_claim_spanning_many_seconds_takes_max_and_each_entry_once,
    a_crowded_second_is_claimed_2000_at_a_time_and_each_entry_once,
    the_backlog_counts_waiting_and_claimed_entries_until_acknowledged,
    only_due_entries_are_claimed_in_due_order,
    an_unacknowledged_claim_comes_back_after_its_lease,
    a_claim_takes_at_most_2000_and_the_next_one_the_rest,
    concurrent_claimers_never_share_an_entry,
    wait_returns_promptly_once_an_entry_is_due,
    add_missing_adds_only_what_is_neither_waiting_nor_claimed,
);
