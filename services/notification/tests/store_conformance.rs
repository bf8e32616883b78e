//! One conformance suite for [`NotificationStore`], run against every implementation: SQLite (a
//! file in a temporary directory) and PostgreSQL (a schema of its own on `TEST_DATABASE_URL`).

use ecoscan_notification::store::{CancelOutcome, NotificationRow, NotificationStore, Status};

fn row(
    id: &str,
    user: &str,
    dedupe: Option<&str>,
    status: Status,
    created: i64,
) -> NotificationRow {
    NotificationRow {
        id: id.into(),
        user_id: user.into(),
        kind: "reminder".into(),
        title: "분리배출 하는 날".into(),
        body: "body".into(),
        job_id: "job-1".into(),
        dedupe_key: dedupe.map(Into::into),
        status,
        due_at_us: (status == Status::Scheduled).then_some(created + 1_000),
        created_at_us: created,
        delivered_at_us: (status == Status::Delivered).then_some(created),
        trace_parent: (status == Status::Scheduled)
            .then(|| format!("00-4bf92f3577b34da6a3ce929d0e0e{created:04x}-00f067aa0ba902b7-01")),
    }
}

async fn a_repeated_dedupe_key_returns_the_first_row<S: NotificationStore>(s: S) {
    let first = row("n1", "u", Some("k"), Status::Delivered, 10);

    let (stored, inserted) = s.insert(first.clone()).await.unwrap();
    let (again, again_inserted) = s
        .insert(row("n2", "u", Some("k"), Status::Delivered, 20))
        .await
        .unwrap();
    // The same key for another user, and no key at all twice, are all new.
    let (_, other_user) = s
        .insert(row("n3", "v", Some("k"), Status::Delivered, 30))
        .await
        .unwrap();
    let (_, no_key_1) = s
        .insert(row("n4", "u", None, Status::Delivered, 40))
        .await
        .unwrap();
    let (_, no_key_2) = s
        .insert(row("n5", "u", None, Status::Delivered, 50))
        .await
        .unwrap();

    assert!(inserted && !again_inserted);
    assert_eq!(stored, first);
    assert_eq!(again, first);
    assert!(other_user && no_key_1 && no_key_2);
    let ids: Vec<_> = s
        .list("u", 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, ["n5", "n4", "n1"]);
}

async fn a_scheduled_row_is_delivered_once_and_never_when_cancelled<S: NotificationStore>(s: S) {
    s.insert(row("a", "u", None, Status::Scheduled, 10))
        .await
        .unwrap();
    s.insert(row("b", "u", None, Status::Scheduled, 20))
        .await
        .unwrap();

    let delivered = s.mark_delivered("a", 99).await.unwrap().unwrap();
    let twice = s.mark_delivered("a", 100).await.unwrap();
    let cancelled = s.cancel("b", "u").await.unwrap();
    let after_cancel = s.mark_delivered("b", 101).await.unwrap();
    let unknown = s.mark_delivered("nope", 102).await.unwrap();

    assert_eq!(delivered.status, Status::Delivered);
    assert_eq!(delivered.delivered_at_us, Some(99));
    assert_eq!(twice, None);
    assert!(matches!(cancelled, CancelOutcome::Cancelled(ref r) if r.status == Status::Cancelled));
    assert_eq!(after_cancel, None);
    assert_eq!(unknown, None);
}

async fn a_batch_delivers_only_the_scheduled_rows_once<S: NotificationStore>(s: S) {
    for (id, created) in [("a", 10), ("b", 20), ("c", 30), ("d", 40)] {
        s.insert(row(id, "u", None, Status::Scheduled, created))
            .await
            .unwrap();
    }
    s.cancel("c", "u").await.unwrap();
    s.mark_delivered("d", 50).await.unwrap();
    let ids: Vec<String> = ["a", "b", "c", "d", "nope"].map(String::from).into();

    let mut delivered = s.mark_delivered_many(&ids, 99).await.unwrap();
    let again = s.mark_delivered_many(&ids, 100).await.unwrap();
    let none = s.mark_delivered_many(&[], 101).await.unwrap();

    delivered.sort_by(|x, y| x.id.cmp(&y.id));
    let got: Vec<_> = delivered
        .iter()
        .map(|r| (r.id.as_str(), r.status, r.delivered_at_us))
        .collect();
    assert_eq!(
        got,
        [
            ("a", Status::Delivered, Some(99)),
            ("b", Status::Delivered, Some(99))
        ]
    );
    assert!(again.is_empty(), "{again:?}");
    assert!(none.is_empty());
    // Each delivered row carries the trace context it was scheduled in, for the delivery's
    // span to link to.
    for (r, created) in delivered.iter().zip([10, 20]) {
        assert_eq!(
            r.trace_parent,
            row(&r.id, "u", None, Status::Scheduled, created).trace_parent
        );
    }
    // The rows as stored agree: cancelled stays cancelled, `d` keeps its first delivery time.
    let mut stored = s.list("u", 10).await.unwrap();
    stored.sort_by(|x, y| x.id.cmp(&y.id));
    let stored: Vec<_> = stored
        .iter()
        .map(|r| (r.id.as_str(), r.status, r.delivered_at_us))
        .collect();
    assert_eq!(
        stored,
        [
            ("a", Status::Delivered, Some(99)),
            ("b", Status::Delivered, Some(99)),
            ("c", Status::Cancelled, None),
            ("d", Status::Delivered, Some(50)),
        ]
    );
}

/// A batch larger than one statement carries (the store splits it) delivers every row once.
async fn a_batch_of_thousands_delivers_each_row_once<S: NotificationStore>(s: S) {
    let ids: Vec<String> = (0..2_500).map(|i| format!("n{i:05}")).collect();
    for (i, id) in ids.iter().enumerate() {
        s.insert(row(id, "u", None, Status::Scheduled, i as i64))
            .await
            .unwrap();
    }
    let delivered = s.mark_delivered_many(&ids, 7).await.unwrap();
    let mut got: Vec<&str> = delivered.iter().map(|r| r.id.as_str()).collect();
    got.sort_unstable();
    assert_eq!(got, ids.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(delivered.iter().all(|r| r.status == Status::Delivered));
    assert!(s.mark_delivered_many(&ids, 8).await.unwrap().is_empty());
    assert!(s.pending().await.unwrap().is_empty());
}

async fn concurrent_batches_over_the_same_rows_deliver_each_once<S: NotificationStore + Clone>(
    s: S,
) {
    let ids: Vec<String> = (0..200).map(|i| format!("n{i:03}")).collect();
    for (i, id) in ids.iter().enumerate() {
        s.insert(row(id, "u", None, Status::Scheduled, i as i64))
            .await
            .unwrap();
    }

    // Overlapping batches in opposite orders, as two replicas whose leases crossed would send.
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let s = s.clone();
            let mut batch = ids.clone();
            if i % 2 == 1 {
                batch.reverse();
            }
            tokio::spawn(async move { s.mark_delivered_many(&batch, 100 + i).await })
        })
        .collect();
    let mut delivered = Vec::new();
    for t in tasks {
        delivered.extend(t.await.unwrap().unwrap().into_iter().map(|r| r.id));
    }

    delivered.sort();
    assert_eq!(delivered, ids, "every row delivered by exactly one batch");
}

async fn cancel_tells_every_outcome_apart<S: NotificationStore>(s: S) {
    s.insert(row("a", "u", None, Status::Scheduled, 10))
        .await
        .unwrap();
    s.insert(row("d", "u", None, Status::Delivered, 20))
        .await
        .unwrap();
    s.cancel("a", "u").await.unwrap();

    assert!(
        matches!(s.cancel("a", "u").await.unwrap(), CancelOutcome::AlreadyCancelled(r) if r.id == "a")
    );
    assert!(
        matches!(s.cancel("d", "u").await.unwrap(), CancelOutcome::AlreadyDelivered(r) if r.id == "d")
    );
    // Another user's notification is indistinguishable from an unknown one.
    assert_eq!(
        s.cancel("a", "someone-else").await.unwrap(),
        CancelOutcome::NotFound
    );
    assert_eq!(s.cancel("zzz", "u").await.unwrap(), CancelOutcome::NotFound);
}

async fn list_is_newest_first_limited_and_pending_lists_the_scheduled<S: NotificationStore>(s: S) {
    for i in 0..5 {
        let status = if i % 2 == 0 {
            Status::Scheduled
        } else {
            Status::Delivered
        };
        s.insert(row(&format!("n{i}"), "u", None, status, i))
            .await
            .unwrap();
    }
    s.insert(row("other", "v", None, Status::Scheduled, 100))
        .await
        .unwrap();
    s.cancel("n4", "u").await.unwrap();

    let listed: Vec<_> = s
        .list("u", 3)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    let mut pending = s.pending().await.unwrap();
    pending.sort();

    assert_eq!(listed, ["n4", "n3", "n2"]);
    assert_eq!(
        pending,
        [
            ("n0".to_owned(), 1_000),
            ("n2".to_owned(), 1_002),
            ("other".to_owned(), 1_100)
        ]
    );
    assert!(s.list("nobody", 10).await.unwrap().is_empty());
}

async fn concurrent_inserts_of_one_dedupe_key_store_one_row<S: NotificationStore + Clone>(s: S) {
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                s.insert(row(
                    &format!("n{i}"),
                    "u",
                    Some("once"),
                    Status::Delivered,
                    i,
                ))
                .await
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap().unwrap());
    }

    assert_eq!(results.iter().filter(|(_, inserted)| *inserted).count(), 1);
    let winner = &results.iter().find(|(_, inserted)| *inserted).unwrap().0;
    assert!(results.iter().all(|(r, _)| r == winner));
    assert_eq!(s.list("u", 50).await.unwrap().len(), 1);
}

async fn concurrent_deliveries_of_one_row_succeed_once<S: NotificationStore + Clone>(s: S) {
    s.insert(row("a", "u", None, Status::Scheduled, 10))
        .await
        .unwrap();

    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.mark_delivered("a", 100 + i).await })
        })
        .collect();
    let mut delivered = 0;
    for t in tasks {
        delivered += usize::from(t.await.unwrap().unwrap().is_some());
    }

    assert_eq!(delivered, 1);
}

async fn scheduled_pages_walk_the_scheduled_rows_in_due_order_without_gaps<S: NotificationStore>(
    s: S,
) {
    // Seven scheduled rows, two of them due at the same time, between delivered and cancelled ones.
    let due = [
        ("s1", 500),
        ("s2", 100),
        ("s3", 300),
        ("s4", 300),
        ("s5", 700),
        ("s6", 200),
        ("s7", 600),
    ];
    for (i, (id, due_at)) in due.iter().enumerate() {
        let mut r = row(id, "u", None, Status::Scheduled, i as i64);
        r.due_at_us = Some(*due_at);
        s.insert(r).await.unwrap();
    }
    s.insert(row("d", "u", None, Status::Delivered, 50))
        .await
        .unwrap();
    s.insert(row("c", "u", None, Status::Scheduled, 60))
        .await
        .unwrap();
    s.cancel("c", "u").await.unwrap();
    s.mark_delivered("s5", 1).await.unwrap();

    let mut walked = Vec::new();
    let mut after: Option<(i64, String)> = None;
    loop {
        let page = s
            .scheduled_page(after.as_ref().map(|(d, id)| (*d, id.as_str())), 2)
            .await
            .unwrap();
        assert!(page.len() <= 2);
        let Some((id, due)) = page.last().cloned() else {
            break;
        };
        walked.extend(page);
        after = Some((due, id));
    }

    let expected: Vec<(String, i64)> = [
        ("s2", 100),
        ("s6", 200),
        ("s3", 300),
        ("s4", 300),
        ("s1", 500),
        ("s7", 600),
    ]
    .iter()
    .map(|(id, d)| ((*id).to_owned(), *d))
    .collect();
    assert_eq!(walked, expected);
    assert_eq!(s.scheduled_page(None, 100).await.unwrap(), expected);
}

ecoscan_sql::store_conformance! {
    sqlite: ecoscan_notification::store::SqliteNotificationStore, "n.db";
    postgres: ecoscan_notification::store::PgNotificationStore;
    cases:
    a_repeated_dedupe_key_returns_the_first_row,
    a_scheduled_row_is_delivered_once_and_never_when_cancelled,
    a_batch_delivers_only_the_scheduled_rows_once,
    a_batch_of_thousands_delivers_each_row_once,
    concurrent_batches_over_the_same_rows_deliver_each_once,
    cancel_tells_every_outcome_apart,
    list_is_newest_first_limited_and_pending_lists_the_scheduled,
    concurrent_inserts_of_one_dedupe_key_store_one_row,
    concurrent_deliveries_of_one_row_succeed_once,
    scheduled_pages_walk_the_scheduled_rows_in_due_order_without_gaps,
}
