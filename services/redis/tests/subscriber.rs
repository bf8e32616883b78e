//! The client against real `redis-server` processes: commands and scripts on one server and on
//! a three-master Cluster, and a subscription that says when it may have missed messages.

use std::time::Duration;

use ecoscan_redis::{
    Delivery, Redis, publish_command,
    redis::{self, Script},
    testing::{PrivateCluster, PrivateRedis},
};

/// Appends to a stream and publishes the entry, in one script, as ingest's event log does:
/// both keys share one hash tag, so the script is legal on a Cluster.
const APPEND_AND_PUBLISH: &str = r"
local id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[1])
redis.call(ARGV[2], KEYS[2], id .. ' ' .. ARGV[1])
return id
";

async fn next_message(sub: &mut ecoscan_redis::Subscriber) -> (String, Vec<u8>) {
    loop {
        let got = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("a delivery within 10 s")
            .expect("the subscription is alive");
        if let Delivery::Message { channel, payload } = got {
            return (channel, payload);
        }
    }
}

async fn scripts_and_subscriptions_work(redis: &Redis, tag: &str) {
    let channel = format!("t:{{{tag}}}:feed");
    let mut sub = redis.subscribe(vec![channel.clone()]).await.unwrap();
    // The subscription confirms itself with a resync (nothing before it could be seen).
    let first = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, Delivery::Resync);

    let id: String = Script::new(APPEND_AND_PUBLISH)
        .key(format!("t:{{{tag}}}:stream"))
        .key(&channel)
        .arg("hello")
        .arg(publish_command(redis.is_cluster()))
        .invoke_async(&mut redis.conn())
        .await
        .unwrap();
    let (got_channel, payload) = next_message(&mut sub).await;
    assert_eq!(got_channel, channel);
    assert_eq!(String::from_utf8(payload).unwrap(), format!("{id} hello"));
}

#[tokio::test]
async fn a_script_publishes_to_a_subscriber_on_one_server() {
    let server = PrivateRedis::start().await;
    let redis = Redis::connect(&server.settings(), "test-single")
        .await
        .unwrap();
    scripts_and_subscriptions_work(&redis, "s1").await;
}

#[tokio::test]
async fn a_script_publishes_to_a_sharded_subscriber_on_a_cluster() {
    let cluster = PrivateCluster::start().await;
    let redis = Redis::connect(&cluster.settings(), "test-cluster")
        .await
        .unwrap();
    assert!(redis.is_cluster());
    // Tags that land on different masters: every node serves scripts and subscriptions.
    for tag in ["s0", "s1", "s2", "s3", "s4", "s5"] {
        scripts_and_subscriptions_work(&redis, tag).await;
    }
}

#[tokio::test]
async fn connections_say_whose_they_are() {
    let server = PrivateRedis::start().await;
    let redis = Redis::connect(&server.settings(), "ecoscan-test:me")
        .await
        .unwrap();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut redis.conn())
        .await
        .unwrap();
    assert!(
        list.contains("name=ecoscan-test:me "),
        "CLIENT LIST names the process:\n{list}"
    );
}

#[tokio::test]
async fn a_stalled_subscription_is_replaced_and_says_so() {
    let server = PrivateRedis::start().await;
    let redis = Redis::connect(&server.settings(), "test-stall")
        .await
        .unwrap();
    let mut sub = redis.subscribe(vec!["t:{x}:feed".into()]).await.unwrap();
    assert_eq!(sub.recv().await, Some(Delivery::Resync));

    // The server stops answering but its connections stay open: only the health check can
    // tell. Once it answers again, the subscription is renewed and says it may have lost
    // messages; what is published afterwards arrives.
    server.pause();
    tokio::time::sleep(Duration::from_secs(12)).await;
    server.resume();
    let resync = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if sub.recv().await == Some(Delivery::Resync) {
                return;
            }
        }
    })
    .await;
    assert!(resync.is_ok(), "no resync after the server stalled");
    let mut conn = redis.conn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let _: i64 = redis::cmd("PUBLISH")
            .arg("t:{x}:feed")
            .arg("after")
            .query_async(&mut conn)
            .await
            .unwrap_or(0);
        match tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
            Ok(Some(Delivery::Message { payload, .. })) => {
                assert_eq!(payload, b"after");
                break;
            }
            _ => assert!(
                tokio::time::Instant::now() < deadline,
                "messages published after the stall never arrived"
            ),
        }
    }
}
