//! The production fan-out on Redis: a delivered notification is published once on
//! `<prefix>{notif}:delivered` (sharded Pub/Sub on a Redis Cluster); each process holds ONE
//! subscription to that channel and hands what arrives to its in-memory [`Hub`], so a
//! subscriber on any replica receives it and the number of Redis connections does not grow
//! with the number of subscribers. Pub/Sub is at-most-once: a subscriber connected while the
//! subscription is down misses live messages, never the inbox — except on the replica that
//! delivers: when Redis says nobody received a publish (its own subscription is being
//! renewed), it hands the notification to its own hub directly.
//!
//! The subscription coming back after a lost connection ([`Delivery::Resync`]) asks the
//! reconcile loop for a sweep ([`Kick`]): a Redis that restarted may have come back empty.

use std::sync::Arc;

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::Notification;
use ecoscan_redis::{Conn, Delivery, Redis, publish_command, redis};
use prost::Message;
use tokio::task::JoinHandle;

use super::Hub;
use crate::{kick::Kick, scheduler::redis::connect_single};

/// Publishes delivered notifications to every replica; see the module docs.
pub struct RedisFanout {
    conn: Conn,
    channel: String,
    publish: &'static str,
    /// This process's hub, for a publish nobody received.
    hub: Arc<Hub>,
}

impl RedisFanout {
    /// Connects to the Redis server at `url`, subscribes this process to
    /// `<prefix>{notif}:delivered`, and hands every notification that arrives there to `hub`
    /// until `stop` is cancelled. Returns once the subscription is active, so a notification
    /// published after it returns reaches this process's subscribers.
    pub async fn start(
        url: &str,
        prefix: &str,
        hub: Arc<Hub>,
        stop: CancellationToken,
    ) -> anyhow::Result<(Self, JoinHandle<()>)> {
        Self::start_with(
            &connect_single(url).await?,
            prefix,
            hub,
            stop,
            Kick::default(),
        )
        .await
    }

    pub(crate) async fn start_with(
        redis: &Redis,
        prefix: &str,
        hub: Arc<Hub>,
        stop: CancellationToken,
        resynced: Kick,
    ) -> anyhow::Result<(Self, JoinHandle<()>)> {
        let channel = format!("{prefix}{{notif}}:delivered");
        let subscriber = redis
            .subscribe(vec![channel.clone()])
            .await
            .with_context(|| format!("failed to subscribe to {channel}"))?;
        let task = tokio::spawn(relay(
            subscriber,
            channel.clone(),
            hub.clone(),
            stop,
            resynced,
        ));
        Ok((
            Self {
                conn: redis.conn(),
                channel,
                publish: publish_command(redis.is_cluster()),
                hub,
            },
            task,
        ))
    }

    /// Sends `n` to the subscribers of every replica; returns how many processes received it.
    ///
    /// When Redis answers that no process received it, not even this one (its subscription is
    /// being renewed after a lost connection), `n` goes to this process's hub directly: nothing
    /// else will bring it there, so its subscribers get it once. Then the count is of those
    /// subscribers. A publish that failed is not handed over: it may still have reached Redis
    /// (a timeout), and this process's subscription with it.
    pub async fn publish(&self, n: &Notification) -> anyhow::Result<usize> {
        let receivers: usize = redis::cmd(self.publish)
            .arg(&self.channel)
            .arg(n.encode_to_vec())
            .query_async(&mut self.conn.clone())
            .await
            .context("failed to publish the notification to redis")?;
        if receivers == 0 {
            let local = self.hub.publish(n);
            tracing::debug!(id = %n.id, local, "no process subscribed in redis; delivered to this process's subscribers directly");
            return Ok(local);
        }
        Ok(receivers)
    }

    /// [`Self::publish`] for many notifications in one round trip (a pipeline); returns the
    /// receivers of each, in order.
    pub async fn publish_many(&self, ns: &[Notification]) -> anyhow::Result<Vec<usize>> {
        if ns.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for n in ns {
            pipe.cmd(self.publish)
                .arg(&self.channel)
                .arg(n.encode_to_vec());
        }
        let receivers: Vec<usize> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .context("failed to publish notifications to redis")?;
        Ok(ns
            .iter()
            .zip(receivers)
            .map(|(n, receivers)| {
                if receivers == 0 {
                    self.hub.publish(n)
                } else {
                    receivers
                }
            })
            .collect())
    }
}

/// The process's one subscription: forwards each message to the hub. The subscription renews
/// itself after a lost connection; what was published meanwhile stays in the inbox. Every
/// resync after the first (the first is the subscription's start, which follows the reload at
/// start) asks `resynced` for a reconcile sweep.
async fn relay(
    mut subscriber: ecoscan_redis::Subscriber,
    channel: String,
    hub: Arc<Hub>,
    stop: CancellationToken,
    resynced: Kick,
) {
    let mut started = false;
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => return,
            d = subscriber.recv() => d,
        };
        match delivery {
            Some(Delivery::Message { payload, .. }) => {
                match Notification::decode(payload.as_slice()) {
                    Ok(n) => {
                        let subscribers = hub.publish(&n);
                        tracing::debug!(id = %n.id, subscribers, "notification relayed from redis");
                    }
                    Err(e) => {
                        tracing::warn!(%channel, error = %e, "undecodable message on the channel")
                    }
                }
            }
            Some(Delivery::Resync) => {
                if started {
                    tracing::info!(%channel, "redis subscription resynced; asking for a reconcile sweep");
                    resynced.sweep_soon();
                } else {
                    tracing::debug!(%channel, "redis subscription established");
                    started = true;
                }
            }
            None => {
                tracing::warn!(%channel, "redis subscription ended");
                return;
            }
        }
    }
}
