//! Scheduled notifications that Redis lost are put back and delivered once: Redis down during
//! `Schedule`, Redis restarted empty, and `FLUSHALL` with notifications pending. Each test runs a
//! `redis-server` of its own (killed, restarted and flushed at will) and a PostgreSQL schema of
//! its own on `TEST_DATABASE_URL`.

mod support;

use std::{
    collections::HashSet,
    time::{Duration, SystemTime},
};

use ecoscan_common::{
    USER_ID_HEADER,
    testing::{Spawned, sample, scrape, spawn},
};
use ecoscan_notification::{Config, serve};
use ecoscan_proto::{
    Timestamp,
    v1::{
        ListRequest, Notification, NotificationStatus, NotifyRequest, ScheduleRequest,
        SubscribeRequest, SubscribeResponse,
        notification_service_client::NotificationServiceClient,
    },
};
use ecoscan_redis::testing::PrivateRedis;
use support::PgSchema;
use tonic::{Request, Streaming};

/// Generous bound for anything that should happen promptly (a Redis reconnect included); never
/// a synchronisation sleep.
const PATIENCE: Duration = Duration::from_secs(30);
/// No periodic sweep within a test: what gets delivered was put back by a kick (an add that
/// failed, the subscription coming back) or by a retried `Schedule`.
const NO_PERIODIC_SWEEP: Duration = Duration::from_secs(3_600);
/// The index of waiting segments of the empty key prefix (each segment a sorted set of its own).
const WAITING_KEY: &str = "{notif}:waiting";

type Client = NotificationServiceClient<ecoscan_common::client::TracedChannel>;

struct Backends {
    pg: PgSchema,
    redis: PrivateRedis,
}

impl Backends {
    async fn create() -> Self {
        Self {
            pg: PgSchema::create().await,
            redis: PrivateRedis::start().await,
        }
    }

    async fn replica(&self, reconcile_interval: Duration) -> (Spawned, Client) {
        let config = Config {
            database_url: self.pg.url.clone(),
            // A stopped Redis costs a call two seconds at most, not the default ten.
            redis: Some(
                self.redis
                    .settings()
                    .with_response_timeout(Duration::from_secs(2)),
            ),
            redis_prefix: String::new(),
            poll_interval: Duration::from_millis(50),
            reconcile_interval,
            ..Config::default()
        };
        let server = spawn(|l, s| serve(config, l, s)).await;
        let mut client =
            NotificationServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
        // Answered once the server has started (Redis connected, the schedule reloaded): a
        // test may stop Redis after this.
        client
            .list(as_user(ListRequest { limit: 1 }, "nobody"))
            .await
            .unwrap();
        (server, client)
    }

    async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Entries waiting: the members of every segment the waiting index lists.
    async fn due_len(&self) -> usize {
        redis::Script::new(
            "local n = 0 \
             for _, seg in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do \
               n = n + redis.call('ZCARD', seg) \
             end \
             return n",
        )
        .key(WAITING_KEY)
        .invoke_async(&mut self.redis().await)
        .await
        .unwrap()
    }

    /// `FLUSHALL` on this test's own Redis.
    async fn flushall(&self) {
        redis::cmd("FLUSHALL")
            .query_async::<()>(&mut self.redis().await)
            .await
            .unwrap();
    }
}

fn as_user<T>(msg: T, user: &str) -> Request<T> {
    let mut req = Request::new(msg);
    req.metadata_mut()
        .insert(USER_ID_HEADER, user.parse().unwrap());
    req
}

fn in_ms(ms: i64) -> Timestamp {
    let mut ts = ecoscan_proto::timestamp(SystemTime::now());
    let total = i64::from(ts.nanos) + ms * 1_000_000;
    ts.seconds += total.div_euclid(1_000_000_000);
    ts.nanos = i32::try_from(total.rem_euclid(1_000_000_000)).unwrap();
    ts
}

async fn schedule(
    client: &mut Client,
    user: &str,
    title: &str,
    due_in_ms: i64,
    key: &str,
) -> Notification {
    client
        .schedule(as_user(
            ScheduleRequest {
                kind: "reminder".into(),
                title: title.into(),
                body: "분리배출 하는 날이에요".into(),
                due_at: Some(in_ms(due_in_ms)),
                dedupe_key: key.into(),
            },
            user,
        ))
        .await
        .expect("a stored schedule succeeds whatever the state of redis")
        .into_inner()
        .notification
        .unwrap()
}

/// Waits until every notification of `user` is delivered; returns the inbox.
async fn all_delivered(client: &mut Client, user: &str, expected: usize) -> Vec<Notification> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let inbox = client
            .list(as_user(ListRequest { limit: 0 }, user))
            .await
            .unwrap()
            .into_inner()
            .notifications;
        assert_eq!(inbox.len(), expected, "{inbox:?}");
        if inbox
            .iter()
            .all(|n| n.status == NotificationStatus::Delivered as i32)
        {
            return inbox;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every scheduled notification was delivered: {inbox:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `reminder` deliveries this replica made, and scheduled notifications it put back.
async fn counters(server: &Spawned) -> (f64, f64) {
    let text = scrape(server.addr).await;
    (
        sample(
            &text,
            "notification_delivered_total",
            &[("kind", "reminder")],
        )
        .unwrap_or(0.0),
        sample(&text, "notification_reconciled_total", &[]).unwrap_or(0.0),
    )
}

async fn next(stream: &mut Streaming<SubscribeResponse>) -> Notification {
    tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("a notification arrived in time")
        .unwrap()
        .expect("the stream is still open")
        .notification
        .expect("the message carries a notification")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_scheduled_while_redis_is_down_are_delivered_once_when_it_is_back() {
    let mut backends = Backends::create().await;
    let (server, mut client) = backends.replica(NO_PERIODIC_SWEEP).await;
    backends.redis.kill();

    let first = schedule(&mut client, "carol", "one", 300, "").await;
    let second = schedule(&mut client, "carol", "two", 300, "").await;
    let keyed = schedule(&mut client, "carol", "three", 300, "k1").await;
    // The caller retries (it cannot tell the row was stored): the same notification, once.
    let retried = schedule(&mut client, "carol", "three", 300, "k1").await;
    assert_eq!(retried.id, keyed.id);
    // Redis comes back empty, as after a restart without persistence.
    backends.redis.start_again().await;

    let inbox = all_delivered(&mut client, "carol", 3).await;

    let ids: HashSet<_> = inbox.iter().map(|n| n.id.clone()).collect();
    assert_eq!(ids, HashSet::from([first.id, second.id, keyed.id]));
    let (delivered, reconciled) = counters(&server).await;
    assert_eq!(delivered, 3.0, "each notification is delivered once");
    assert!(reconciled >= 3.0, "reconciled {reconciled}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_pending_through_a_redis_restart_are_delivered_once() {
    let mut backends = Backends::create().await;
    let (server, mut client) = backends.replica(NO_PERIODIC_SWEEP).await;
    for i in 0..3 {
        schedule(&mut client, "dave", &format!("n{i}"), 1_500, "").await;
    }
    assert_eq!(backends.due_len().await, 3);

    // Killed and restarted empty: only the sweep after the subscription comes back restores.
    backends.redis.kill();
    backends.redis.start_again().await;

    all_delivered(&mut client, "dave", 3).await;
    let (delivered, reconciled) = counters(&server).await;
    assert_eq!(delivered, 3.0, "each notification is delivered once");
    assert!(reconciled >= 3.0, "reconciled {reconciled}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_pending_through_a_flushall_are_delivered_once() {
    let backends = Backends::create().await;
    let (server, mut client) = backends.replica(Duration::from_millis(300)).await;
    let mut stream = client
        .subscribe(as_user(SubscribeRequest {}, "erin"))
        .await
        .unwrap()
        .into_inner();
    let mut scheduled = HashSet::new();
    for i in 0..5 {
        scheduled.insert(
            schedule(&mut client, "erin", &format!("n{i}"), 2_000, "")
                .await
                .id,
        );
    }
    assert_eq!(backends.due_len().await, 5);

    backends.flushall().await;

    all_delivered(&mut client, "erin", 5).await;
    // The live stream got each one once: five distinct ids, then a later notification.
    let mut received = HashSet::new();
    for _ in 0..5 {
        let n = next(&mut stream).await;
        assert!(received.insert(n.id.clone()), "{} delivered twice", n.id);
    }
    assert_eq!(received, scheduled);
    let marker = client
        .notify(as_user(
            NotifyRequest {
                kind: "scan_completed".into(),
                title: "marker".into(),
                body: String::new(),
                job_id: "job-1".into(),
                dedupe_key: String::new(),
            },
            "erin",
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    assert_eq!(next(&mut stream).await.id, marker.id);
    let (delivered, reconciled) = counters(&server).await;
    assert_eq!(delivered, 5.0, "each notification is delivered once");
    assert!(reconciled >= 5.0, "reconciled {reconciled}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_schedule_puts_back_a_notification_redis_lost() {
    let backends = Backends::create().await;
    let (server, mut client) = backends.replica(NO_PERIODIC_SWEEP).await;
    let first = schedule(&mut client, "frank", "later", 1_000, "k2").await;
    backends.flushall().await;
    assert_eq!(backends.due_len().await, 0);

    // Nothing else would restore it within the test: no periodic sweep, no reconnect.
    let retried = schedule(&mut client, "frank", "later", 1_000, "k2").await;

    assert_eq!(retried.id, first.id);
    assert_eq!(backends.due_len().await, 1);
    let inbox = all_delivered(&mut client, "frank", 1).await;
    assert_eq!(inbox[0].id, first.id);
    let (delivered, reconciled) = counters(&server).await;
    assert_eq!(delivered, 1.0);
    assert_eq!(reconciled, 1.0);
    // A further retry, once delivered, adds nothing back.
    schedule(&mut client, "frank", "later", 1_000, "k2").await;
    assert_eq!(backends.due_len().await, 0);
    server.stop().await.unwrap();
}
