//! A shard channel's slot moves to another master of a Redis Cluster while a subscriber
//! listens: Redis tells the subscriber it is unsubscribed (an unrequested `sunsubscribe`),
//! which the subscription takes for a lost feed: it says so (a resync, so its user catches up
//! from the durable copy) and subscribes again, on the slot's new owner. And a master that
//! restarts: the client library's own resubscription left some of ingest's 64 shard channels
//! silent for good; the subscription is made again, every channel confirmed.

use std::time::Duration;

use ecoscan_redis::{Delivery, Redis, publish_command, redis, testing::PrivateCluster};

/// Publishes `message` on `channel` every 100 ms until the subscriber gets it, for at most
/// `within`; panics saying `what` otherwise. Returns whether a resync came first.
async fn published_until_heard(
    redis: &Redis,
    sub: &mut ecoscan_redis::Subscriber,
    channel: &str,
    message: &str,
    within: Duration,
    what: &str,
) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut resynced = false;
    loop {
        redis::cmd(publish_command(true))
            .arg(channel)
            .arg(message)
            .query_async::<i64>(&mut redis.conn())
            .await
            .expect("SPUBLISH (the client follows the slot's move)");
        let until = tokio::time::Instant::now() + Duration::from_millis(100);
        while let Ok(got) = tokio::time::timeout_at(until, sub.recv()).await {
            match got.expect("the subscription is alive") {
                Delivery::Resync => resynced = true,
                Delivery::Message {
                    channel: c,
                    payload,
                } => {
                    if c == channel && payload == message.as_bytes() {
                        return resynced;
                    }
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (waited {within:?})"
        );
    }
}

#[tokio::test]
async fn a_subscription_follows_its_shard_channel_to_the_slots_new_owner() {
    let cluster = PrivateCluster::start().await;
    let redis = Redis::connect(&cluster.settings(), "test-slot-move")
        .await
        .unwrap();
    let moving = "t:{s7}:feed".to_owned();
    let staying = "t:{s0}:feed".to_owned();
    let mut sub = redis
        .subscribe(vec![moving.clone(), staying.clone()])
        .await
        .unwrap();
    published_until_heard(
        &redis,
        &mut sub,
        &moving,
        "before",
        Duration::from_secs(10),
        "the subscription hears its channel",
    )
    .await;

    let (slot, from, to) = cluster.move_slot_of(&moving).await;
    assert_ne!(from, to);
    let resynced = published_until_heard(
        &redis,
        &mut sub,
        &moving,
        "after",
        Duration::from_secs(30),
        &format!("the subscription hears its channel again after slot {slot} moved"),
    )
    .await;
    assert!(
        resynced,
        "the subscription said it may have missed messages while its channel moved"
    );
    published_until_heard(
        &redis,
        &mut sub,
        &staying,
        "still",
        Duration::from_secs(10),
        "the other channel is still heard",
    )
    .await;
}

#[tokio::test]
async fn a_subscription_hears_its_shard_channel_again_after_its_master_restarted_empty() {
    let mut cluster = PrivateCluster::start().await;
    let redis = Redis::connect(&cluster.settings(), "test-node-restart")
        .await
        .unwrap();
    // Every shard channel of ingest's feed, as its hub subscribes them.
    let channels: Vec<String> = (0..64).map(|s| format!("t:{{s{s}}}:feed")).collect();
    let channel = channels[2].clone();
    let mut sub = redis.subscribe(channels).await.unwrap();
    published_until_heard(
        &redis,
        &mut sub,
        &channel,
        "before",
        Duration::from_secs(10),
        "the subscription hears its channel",
    )
    .await;

    // As when the node's data is read one last time before it goes: writes wait a moment.
    for url in cluster.urls() {
        let mut c = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(2000)
            .arg("WRITE")
            .query_async::<()>(&mut c)
            .await
            .unwrap();
    }
    let node = cluster.restart_owner_of_empty(&channel).await;
    let resynced = published_until_heard(
        &redis,
        &mut sub,
        &channel,
        "after",
        Duration::from_secs(10),
        &format!("the subscription hears its channel again after {node} restarted empty"),
    )
    .await;
    assert!(
        resynced,
        "what was published while the node was down is lost: a resync says so"
    );
}
