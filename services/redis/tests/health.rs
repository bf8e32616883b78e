//! Every command reports into the handle's store health: Redis answering (errors included)
//! keeps it up; a path that stops answering opens its circuit after a few timed-out
//! commands, and the first answer after the path heals closes it.

use std::time::Duration;

use ecoscan_common::store_health::FaultKind;
use ecoscan_redis::{
    Redis, Settings, fault_kind,
    redis::{self, RedisResult},
    testing::{Blackhole, PrivateRedis},
};
use tokio::time::Instant;

/// The response timeout of this test's connections: short, so a stall is noticed quickly.
const TIMEOUT: Duration = Duration::from_secs(1);

async fn set(redis: &Redis, key: &str) -> RedisResult<()> {
    redis::cmd("SET")
        .arg(key)
        .arg("v")
        .query_async(&mut redis.conn())
        .await
}

#[tokio::test]
async fn redis_that_stops_answering_opens_the_circuit_and_an_answer_closes_it() {
    let server = PrivateRedis::start().await;
    let path = Blackhole::start(([127, 0, 0, 1], server.port()).into()).await;
    let redis = Redis::connect(
        &Settings::single(path.redis_url()).with_response_timeout(TIMEOUT),
        "health-test",
    )
    .await
    .unwrap();
    let health = redis.health().clone();
    assert_eq!(health.store(), "redis");

    // Answers, errors among them, are answers.
    set(&redis, "t:health:k").await.unwrap();
    for _ in 0..5 {
        let wrong: RedisResult<i64> = redis::cmd("LPUSH")
            .arg("t:health:k")
            .arg("x")
            .query_async(&mut redis.conn())
            .await;
        let e = wrong.unwrap_err();
        assert_eq!(fault_kind(&e), None, "WRONGTYPE is an answer: {e}");
    }
    assert!(health.is_up());
    assert!(FaultKind::ALL.iter().all(|k| health.faults(*k) == 0));

    path.blackhole();
    for _ in 0..3 {
        let e = set(&redis, "t:health:k").await.unwrap_err();
        assert_eq!(fault_kind(&e), Some(FaultKind::TimedOut), "{e}");
    }
    assert!(health.is_open(), "three timeouts in a row open the circuit");
    assert!(health.faults(FaultKind::TimedOut) >= 3);
    let down = health.check().unwrap_err();
    assert_eq!(down.store, "redis");
    assert_eq!(down.fault, FaultKind::TimedOut);

    path.heal();
    let deadline = Instant::now() + Duration::from_secs(30);
    while set(&redis, "t:health:k").await.is_err() {
        assert!(
            Instant::now() < deadline,
            "redis answers within 30 s of the path healing"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(health.is_up(), "the first answer closes the circuit");
    assert_eq!(health.check(), Ok(()));
}
