//! NotificationService on its production stores, over real sockets: the inbox in PostgreSQL (a
//! schema of its own on `TEST_DATABASE_URL`), the schedule and the delivery fan-out in Redis (a
//! key prefix of its own on `TEST_REDIS_URL`), with two replicas sharing both.

mod support;

use std::time::Duration;

use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_notification::{Config, serve};
use ecoscan_proto::v1::{
    ListRequest, NotificationStatus, NotifyRequest, ScheduleRequest,
    notification_service_client::NotificationServiceClient,
};
use support::{Client, PATIENCE, PgSchema, RedisPrefix, as_user, in_ms, next, subscribe};
use tonic::Request;

/// Generous bound for anything that should happen promptly; never a synchronisation sleep.
struct Backends {
    pg: PgSchema,
    redis: RedisPrefix,
    /// A private Redis Cluster to run on instead of the shared server.
    cluster: Option<ecoscan_redis::testing::PrivateCluster>,
}

impl Backends {
    async fn create() -> Self {
        Self {
            pg: PgSchema::create().await,
            redis: RedisPrefix::create().await,
            cluster: None,
        }
    }

    async fn on_a_cluster() -> Self {
        Self {
            cluster: Some(ecoscan_redis::testing::PrivateCluster::start().await),
            ..Self::create().await
        }
    }

    fn config(&self) -> Config {
        let redis = match &self.cluster {
            Some(c) => c.settings(),
            None => ecoscan_redis::Settings::single(&self.redis.url),
        };
        Config {
            database_url: self.pg.url.clone(),
            redis: Some(redis),
            redis_prefix: self.redis.prefix.clone(),
            poll_interval: Duration::from_millis(50),
            ..Config::default()
        }
    }

    async fn replica(&self) -> (Spawned, Client) {
        let config = self.config();
        let server = spawn(|l, s| serve(config, l, s)).await;
        let client =
            NotificationServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
        (server, client)
    }
}

fn notify_req(user: &str, title: &str) -> Request<NotifyRequest> {
    as_user(
        NotifyRequest {
            kind: "scan_completed".into(),
            title: title.into(),
            body: "페트병은 라벨을 떼고 버려 주세요".into(),
            job_id: "job-1".into(),
            dedupe_key: String::new(),
        },
        user,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_on_one_replica_receives_what_another_replica_delivers() {
    replicas_share_delivery(Backends::create().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_delivery_on_a_redis_cluster() {
    replicas_share_delivery(Backends::on_a_cluster().await).await;
}

async fn replicas_share_delivery(backends: Backends) {
    let (a, mut client_a) = backends.replica().await;
    let (b, mut client_b) = backends.replica().await;
    let mut on_b = subscribe(&mut client_b, "alice").await;
    let mut on_a = subscribe(&mut client_a, "alice").await;

    let sent = client_a
        .notify(notify_req("alice", "scan done"))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    let scheduled = client_a
        .schedule(as_user(
            ScheduleRequest {
                kind: "reminder".into(),
                title: "later".into(),
                body: "분리배출 하는 날이에요".into(),
                due_at: Some(in_ms(300)),
                dedupe_key: String::new(),
            },
            "alice",
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();

    // Both replicas' subscribers get both, each exactly in the order delivered.
    let b_first = next(&mut on_b).await;
    let b_second = next(&mut on_b).await;
    let a_first = next(&mut on_a).await;
    let a_second = next(&mut on_a).await;
    assert_eq!(b_first, sent);
    assert_eq!(a_first, sent);
    assert_eq!(b_second.id, scheduled.id);
    assert_eq!(b_second.status, NotificationStatus::Delivered as i32);
    assert_eq!(a_second, b_second);
    // Delivered once: the next thing B's subscriber sees is a later notification, not a repeat.
    let marker = client_b
        .notify(notify_req("alice", "marker"))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    assert_eq!(next(&mut on_b).await, marker);
    // The inbox is shared: B lists what A created, delivered once.
    let inbox = client_b
        .list(as_user(ListRequest { limit: 0 }, "alice"))
        .await
        .unwrap()
        .into_inner()
        .notifications;
    assert_eq!(inbox.len(), 3);
    assert!(
        inbox
            .iter()
            .all(|n| n.status == NotificationStatus::Delivered as i32)
    );
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_survives_a_restart_that_finds_redis_emptied() {
    let backends = Backends::create().await;
    let (server, mut client) = backends.replica().await;
    let scheduled = client
        .schedule(as_user(
            ScheduleRequest {
                kind: "reminder".into(),
                title: "after the restart".into(),
                body: String::new(),
                due_at: Some(in_ms(500)),
                dedupe_key: String::new(),
            },
            "bob",
        ))
        .await
        .unwrap()
        .into_inner()
        .notification
        .unwrap();
    server.stop().await.unwrap();
    // Redis restarted without persistence: the schedule is gone from it, not from PostgreSQL.
    let mut conn = redis::Client::open(backends.redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", backends.redis.prefix))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!keys.is_empty(), "the schedule was in redis");
    redis::cmd("DEL")
        .arg(&keys)
        .query_async::<()>(&mut conn)
        .await
        .unwrap();

    let (server, mut client) = backends.replica().await;

    // The restarted replica reloads the schedule from PostgreSQL into Redis and delivers it.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let delivered = loop {
        let inbox = client
            .list(as_user(ListRequest { limit: 0 }, "bob"))
            .await
            .unwrap()
            .into_inner()
            .notifications;
        assert_eq!(inbox.len(), 1);
        if inbox[0].status == NotificationStatus::Delivered as i32 {
            break inbox[0].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the schedule was not delivered after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(delivered.id, scheduled.id);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn serves_health_and_reflection_on_the_production_stores() {
    let backends = Backends::create().await;
    let (server, _) = backends.replica().await;
    assert_health_and_reflection(&server.uri(), "ecoscan.v1.NotificationService").await;
    server.stop().await.unwrap();
}
