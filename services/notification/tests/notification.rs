//! NotificationService over a real socket, on a SQLite file in a temporary directory.

mod support;

use std::time::{Duration, SystemTime};

use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_notification::{Config, serve};
use ecoscan_proto::{
    Timestamp,
    v1::{
        CancelRequest, ListRequest, Notification, NotificationStatus, NotifyRequest,
        ScheduleRequest, SubscribeRequest, notification_service_client::NotificationServiceClient,
    },
};
use support::{Client, PATIENCE, as_user, in_ms, next, subscribe};
use tempfile::TempDir;
use tonic::{Code, Request};

/// Generous bound for anything that should happen promptly; never a synchronisation sleep.
fn config(dir: &TempDir) -> Config {
    Config {
        database_url: format!(
            "sqlite://{}/db/notification.db?mode=rwc",
            dir.path().display()
        ),
        ..Config::default()
    }
}

async fn start_on(dir: &TempDir) -> (Spawned, Client) {
    let config = config(dir);
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client =
        NotificationServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    (server, client)
}

/// The notification `Notify` answers `req` with.
async fn notify(client: &mut Client, req: Request<NotifyRequest>) -> Notification {
    client
        .notify(req)
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap()
}

fn notify_req(user: &str, title: &str, dedupe: &str) -> Request<NotifyRequest> {
    as_user(notify_body(title, dedupe), user)
}

fn notify_body(title: &str, dedupe: &str) -> NotifyRequest {
    NotifyRequest {
        kind: "scan_completed".into(),
        title: title.into(),
        body: "페트병은 라벨을 떼고 버려 주세요".into(),
        job_id: "job-1".into(),
        dedupe_key: dedupe.into(),
    }
}

fn schedule_req(user: &str, title: &str, due_at: Option<Timestamp>) -> Request<ScheduleRequest> {
    as_user(
        ScheduleRequest {
            kind: "reminder".into(),
            title: title.into(),
            body: "분리배출 하는 날이에요".into(),
            due_at,
            dedupe_key: String::new(),
        },
        user,
    )
}

async fn list(client: &mut Client, user: &str, limit: u32) -> Vec<Notification> {
    client
        .list(as_user(ListRequest { limit }, user))
        .await
        .unwrap()
        .into_inner()
        .notifications
}

#[tokio::test]
async fn a_notification_appears_in_the_inbox_and_on_an_open_stream() {
    let dir = TempDir::new().unwrap();
    let (server, mut client) = start_on(&dir).await;
    let mut stream = subscribe(&mut client, "alice").await;
    let mut other = subscribe(&mut client, "bob").await;

    let sent = notify(&mut client, notify_req("alice", "scan done", "")).await;
    let streamed = next(&mut stream).await;
    let inbox = list(&mut client, "alice", 0).await;

    assert_eq!(sent.status, NotificationStatus::Delivered as i32);
    assert!(sent.delivered_at.is_some() && sent.created_at.is_some());
    assert_eq!(sent.job_id, "job-1");
    assert_eq!(streamed, sent);
    assert_eq!(inbox, [sent]);
    // Bob's stream stays quiet: his next message is the one sent to him afterwards.
    let for_bob = notify(&mut client, notify_req("bob", "for bob", "")).await;
    assert_eq!(next(&mut other).await, for_bob);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_repeated_dedupe_key_returns_the_first_notification_and_is_not_republished() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let mut stream = subscribe(&mut client, "alice").await;

    let first = notify(&mut client, notify_req("alice", "first", "job-1:done")).await;
    let repeat = notify(&mut client, notify_req("alice", "second", "job-1:done")).await;
    let other_user = notify(&mut client, notify_req("bob", "bob's", "job-1:done")).await;
    let marker = notify(&mut client, notify_req("alice", "marker", "")).await;

    assert_eq!(repeat, first);
    assert_ne!(other_user.id, first.id);
    assert_eq!(next(&mut stream).await, first);
    // The repeat was not published: the next message on the stream is the marker.
    assert_eq!(next(&mut stream).await, marker);
    assert_eq!(list(&mut client, "alice", 0).await.len(), 2);
}

#[tokio::test]
async fn a_scheduled_notification_is_delivered_to_a_subscriber_at_its_due_time() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let mut stream = subscribe(&mut client, "alice").await;

    let scheduled = client
        .schedule(schedule_req(
            "alice",
            "take out the bottles",
            Some(in_ms(200)),
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    assert_eq!(scheduled.status, NotificationStatus::Scheduled as i32);
    assert!(scheduled.delivered_at.is_none());

    let delivered = next(&mut stream).await;

    assert_eq!(delivered.id, scheduled.id);
    assert_eq!(delivered.status, NotificationStatus::Delivered as i32);
    let due = ecoscan_proto::to_system_time(scheduled.due_at.as_ref().unwrap());
    let at = ecoscan_proto::to_system_time(delivered.delivered_at.as_ref().unwrap());
    assert!(at >= due, "delivered before its due time");
    assert_eq!(list(&mut client, "alice", 0).await, [delivered]);
}

#[tokio::test]
async fn a_past_due_schedule_is_delivered_at_once() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let mut stream = subscribe(&mut client, "alice").await;

    let n = client
        .schedule(schedule_req("alice", "late", Some(in_ms(-60_000))))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();

    assert_eq!(n.status, NotificationStatus::Delivered as i32);
    assert_eq!(next(&mut stream).await, n);
}

#[tokio::test]
async fn a_notification_cancelled_before_its_due_time_is_never_delivered() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let mut stream = subscribe(&mut client, "alice").await;
    let doomed = client
        .schedule(schedule_req("alice", "cancelled", Some(in_ms(300))))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    let later = client
        .schedule(schedule_req("alice", "kept", Some(in_ms(600))))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();

    let cancelled = client
        .cancel(as_user(
            CancelRequest {
                id: doomed.id.clone(),
            },
            "alice",
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();

    assert_eq!(cancelled.status, NotificationStatus::Cancelled as i32);
    // The kept one, due after the cancelled one, is the first thing the stream carries.
    assert_eq!(next(&mut stream).await.id, later.id);
    let inbox = list(&mut client, "alice", 0).await;
    let statuses: Vec<_> = inbox.iter().map(|n| (n.id.clone(), n.status)).collect();
    assert_eq!(
        statuses,
        [
            (later.id, NotificationStatus::Delivered as i32),
            (doomed.id, NotificationStatus::Cancelled as i32),
        ]
    );
}

#[tokio::test]
async fn cancel_answers_not_found_for_others_and_failed_precondition_once_delivered() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let scheduled = client
        .schedule(schedule_req("alice", "later", Some(in_ms(3_600_000))))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    let delivered = notify(&mut client, notify_req("alice", "now", "")).await;
    let cancel = |id: &str, user: &str| as_user(CancelRequest { id: id.into() }, user);

    let other = client
        .cancel(cancel(&scheduled.id, "mallory"))
        .await
        .unwrap_err();
    let unknown = client
        .cancel(cancel("01890000-0000-7000-8000-000000000000", "alice"))
        .await
        .unwrap_err();
    let done = client
        .cancel(cancel(&delivered.id, "alice"))
        .await
        .unwrap_err();

    assert_eq!(other.code(), Code::NotFound);
    assert_eq!(unknown.code(), Code::NotFound);
    assert_eq!(done.code(), Code::FailedPrecondition);
    assert!(
        done.message().contains("already delivered"),
        "{}",
        done.message()
    );
    // Mallory's attempt changed nothing.
    let inbox = list(&mut client, "alice", 0).await;
    let still = inbox.iter().find(|n| n.id == scheduled.id).unwrap();
    assert_eq!(still.status, NotificationStatus::Scheduled as i32);
}

#[tokio::test]
async fn a_pending_schedule_is_delivered_after_a_restart_on_the_same_database() {
    let dir = TempDir::new().unwrap();
    let (first, mut client) = start_on(&dir).await;
    let scheduled = client
        .schedule(schedule_req(
            "alice",
            "survives restarts",
            Some(in_ms(1_500)),
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    drop(client);
    first.stop().await.unwrap();
    let pending = list_status_after_restart_check(&dir, &scheduled.id).await;
    assert_eq!(pending, NotificationStatus::Scheduled as i32);

    let restarted_at = SystemTime::now();
    let (_second, mut client) = start_on(&dir).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let delivered = loop {
        let inbox = list(&mut client, "alice", 0).await;
        let n = inbox.into_iter().find(|n| n.id == scheduled.id).unwrap();
        if n.status == NotificationStatus::Delivered as i32 {
            break n;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not redelivered in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    let at = ecoscan_proto::to_system_time(delivered.delivered_at.as_ref().unwrap());
    assert!(
        at >= restarted_at,
        "delivered by the first server, not after the restart"
    );
}

/// Reads the notification's status straight from the database file while no server runs.
async fn list_status_after_restart_check(dir: &TempDir, id: &str) -> i32 {
    use ecoscan_notification::store::{NotificationStore, SqliteNotificationStore, Status};
    let store = SqliteNotificationStore::connect(&config(dir).database_url)
        .await
        .unwrap();
    let rows = store.list("alice", 10).await.unwrap();
    store.close().await;
    let row = rows.into_iter().find(|r| r.id == id).unwrap();
    match row.status {
        Status::Scheduled => NotificationStatus::Scheduled as i32,
        Status::Delivered => NotificationStatus::Delivered as i32,
        Status::Cancelled => NotificationStatus::Cancelled as i32,
    }
}

#[tokio::test]
async fn list_is_newest_first_with_every_status_and_clamps_its_limit() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let n = client
            .notify(notify_req("alice", &format!("n{i}"), ""))
            .await
            .unwrap()
            .into_inner()
            .notification
            .unwrap();
        ids.push(n.id);
    }
    let scheduled = client
        .schedule(schedule_req("alice", "later", Some(in_ms(3_600_000))))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    ids.push(scheduled.id);
    ids.reverse();

    let all: Vec<_> = list(&mut client, "alice", 0)
        .await
        .into_iter()
        .map(|n| n.id)
        .collect();
    let two: Vec<_> = list(&mut client, "alice", 2)
        .await
        .into_iter()
        .map(|n| n.id)
        .collect();
    let huge = list(&mut client, "alice", 100_000).await;

    assert_eq!(all, ids);
    assert_eq!(two, ids[..2]);
    assert_eq!(huge.len(), 6);
    assert_eq!(huge[0].status, NotificationStatus::Scheduled as i32);
    assert!(list(&mut client, "nobody", 0).await.is_empty());
}

#[tokio::test]
async fn bad_input_is_rejected_with_invalid_argument_and_stores_nothing() {
    let dir = TempDir::new().unwrap();
    let (_server, mut client) = start_on(&dir).await;
    let far = Timestamp {
        seconds: in_ms(0).seconds + 366 * 24 * 3600,
        nanos: 0,
    };

    let errors = [
        client.notify(notify_req("", "t", "")).await.unwrap_err(),
        client
            .notify(notify_req("alice", " ", ""))
            .await
            .unwrap_err(),
        client
            .schedule(schedule_req("alice", "t", None))
            .await
            .unwrap_err(),
        client
            .schedule(schedule_req("alice", "t", Some(far)))
            .await
            .unwrap_err(),
        client
            .schedule(schedule_req("", "t", Some(in_ms(1000))))
            .await
            .unwrap_err(),
        client
            .schedule(schedule_req("alice", "", Some(in_ms(1000))))
            .await
            .unwrap_err(),
        client
            .cancel(as_user(CancelRequest { id: String::new() }, "alice"))
            .await
            .unwrap_err(),
        client
            .cancel(as_user(CancelRequest { id: "x".into() }, ""))
            .await
            .unwrap_err(),
        client
            .list(as_user(ListRequest { limit: 0 }, ""))
            .await
            .unwrap_err(),
        client
            .subscribe(Request::new(SubscribeRequest {}))
            .await
            .unwrap_err(),
    ];

    let messages: Vec<_> = errors.iter().map(|e| e.message().to_owned()).collect();
    // The acting user comes from the identity assertion: a call without one is
    // UNAUTHENTICATED (a missing credential), a bad field INVALID_ARGUMENT.
    let identity = (Code::Unauthenticated, "needs an identity");
    for (i, (code, needle)) in [
        identity,
        (Code::InvalidArgument, "title"),
        (Code::InvalidArgument, "due_at is missing"),
        (Code::InvalidArgument, "more than a year"),
        identity,
        (Code::InvalidArgument, "title"),
        (Code::InvalidArgument, "id is empty"),
        identity,
        identity,
        identity,
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(errors[i].code(), *code, "{i}: {}", messages[i]);
        assert!(messages[i].contains(needle), "{i}: {}", messages[i]);
    }
    assert!(list(&mut client, "alice", 0).await.is_empty());
}

#[tokio::test]
async fn serves_health_and_reflection() {
    let dir = TempDir::new().unwrap();
    let (server, _client) = start_on(&dir).await;
    assert_health_and_reflection(&server.uri(), "ecoscan.v1.NotificationService").await;
}
