//! A Pub/Sub subscription that says when it may have missed messages.
//!
//! Pub/Sub delivers at most once: whatever is published while a connection is down, or while
//! the reader is behind, is gone. A [`Subscriber`] therefore hands out [`Delivery::Resync`]
//! whenever that may have happened — after every (re)subscription, and when its buffer
//! overflowed — so its user can catch up from the durable copy (for ingest: the per-job event
//! log). A connection that stops answering its health `PING` is replaced. A channel the
//! server drops on its own — on a Redis Cluster, the shard channels of a slot that moved to
//! another master get an unrequested `sunsubscribe`, and the client library forgets them — is
//! subscribed to again (on the slot's new owner), with a resync, since what was published
//! meanwhile is lost. On a Cluster, a node's connection that breaks (the node restarted) gets
//! the whole subscription made again, every channel's subscription confirmed.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use redis::{
    Client, PushInfo, PushKind, Value,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{CONNECT_TIMEOUT, Error, Redis};

/// Messages buffered between the connection and the reader; past it they are dropped and the
/// reader is told to resync.
const BUFFER: usize = 65_536;
/// How often the subscription's connection is checked with a `PING`.
const HEALTH_EVERY: Duration = Duration::from_secs(5);
/// A `PING` slower than this (or than the response timeout, when shorter) means the
/// connection is stalled: it is replaced.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// What a subscription delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// A message published to one of the channels.
    Message { channel: String, payload: Vec<u8> },
    /// Messages may have been lost before this point (a reconnect, or a reader too slow):
    /// catch up from the durable copy.
    Resync,
}

/// Where the connection's pushes go: never blocks the connection.
pub(crate) type PushSink = Arc<dyn Fn(PushInfo) -> Result<(), ()> + Send + Sync>;

/// Where a subscription's connection reports: `tx` gets what the user reads; `dropped` the
/// channels the server unsubscribed this connection from without being asked (this
/// subscription never unsubscribes), and `broken` the generation of a connection that broke.
#[derive(Clone)]
struct Sinks {
    tx: mpsc::Sender<Delivery>,
    lost: Arc<AtomicBool>,
    dropped: mpsc::UnboundedSender<String>,
    broken: mpsc::UnboundedSender<u64>,
}

/// The push sink of the subscription's connection number `generation`: a connection replaced
/// since may still report its end, which is then no news.
fn sink(sinks: Sinks, generation: u64) -> PushSink {
    let Sinks {
        tx,
        lost,
        dropped,
        broken,
    } = sinks;
    Arc::new(move |info: PushInfo| {
        let delivery = match info.kind {
            PushKind::Message | PushKind::SMessage => {
                let mut data = info.data.into_iter();
                let (Some(channel), Some(payload)) = (data.next(), data.next()) else {
                    return Ok(());
                };
                let (Some(channel), Some(payload)) = (bytes(channel), bytes(payload)) else {
                    return Ok(());
                };
                Delivery::Message {
                    channel: String::from_utf8_lossy(&channel).into_owned(),
                    payload,
                }
            }
            // A (re)subscription: whatever was published before it took effect was missed.
            PushKind::Subscribe | PushKind::SSubscribe => Delivery::Resync,
            PushKind::Disconnection => {
                let _ = broken.send(generation);
                Delivery::Resync
            }
            // The server dropped a channel (a Cluster slot moved away from this node): the
            // feed of that channel is lost until it is subscribed again.
            PushKind::Unsubscribe | PushKind::SUnsubscribe => {
                if let Some(channel) = info.data.into_iter().next().and_then(bytes) {
                    let channel = String::from_utf8_lossy(&channel).into_owned();
                    let _ = dropped.send(channel);
                }
                Delivery::Resync
            }
            _ => return Ok(()),
        };
        if tx.try_send(delivery).is_err() {
            lost.store(true, Ordering::Relaxed);
        }
        Ok(())
    })
}

fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

/// A live subscription to a fixed set of channels.
pub struct Subscriber {
    rx: mpsc::Receiver<Delivery>,
    lost: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The subscription's connection, whichever kind.
enum SubConn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl SubConn {
    async fn open(redis: &Redis, channels: &[String], push: PushSink) -> Result<Self, Error> {
        if let Some(client) = redis.single_client() {
            // Pushes need RESP3; the shared connections stay on RESP2.
            let info = client.get_connection_info().clone().set_redis_settings(
                client
                    .get_connection_info()
                    .redis_settings()
                    .clone()
                    .set_protocol(redis::ProtocolVersion::RESP3),
            );
            let client = Client::open(info)?;
            let push = push.clone();
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(redis.response_timeout()))
                .set_number_of_retries(3)
                .set_automatic_resubscription()
                .set_push_sender(move |info| push(info));
            let mut conn = client.get_connection_manager_with_config(config).await?;
            crate::set_name(&mut conn, redis.name()).await?;
            conn.subscribe(channels).await?;
            Ok(Self::Single(conn))
        } else {
            let infos = redis
                .cluster_infos()
                .expect("a redis that is not single is a cluster")
                .to_vec();
            let client = crate::cluster_client(infos, redis.response_timeout(), Some(push))?;
            let mut conn = client.get_async_connection().await?;
            // One command per channel: channels of different slots may not share an SSUBSCRIBE.
            for channel in channels {
                conn.ssubscribe(channel).await?;
            }
            Ok(Self::Cluster(conn))
        }
    }

    /// Subscribes again to `channel`, which the server dropped: on a Cluster the command goes
    /// to the channel's slot's owner now (the client follows the redirect).
    async fn resubscribe(&mut self, channel: &str) -> Result<(), redis::RedisError> {
        match self {
            Self::Single(c) => c.subscribe(channel).await,
            Self::Cluster(c) => c.ssubscribe(channel).await,
        }
    }

    /// A round trip that proves the connection alive; on one server it also (re)names the
    /// connection, which a reconnect leaves unnamed.
    async fn check(&mut self, name: &str) -> Result<(), redis::RedisError> {
        match self {
            Self::Single(c) => crate::set_name(c, name).await,
            Self::Cluster(c) => redis::cmd("PING").query_async::<()>(c).await,
        }
    }
}

impl Subscriber {
    pub(crate) async fn start(redis: Redis, channels: Vec<String>) -> Result<Self, Error> {
        let (tx, rx) = mpsc::channel(BUFFER);
        let lost = Arc::new(AtomicBool::new(false));
        let (dropped_tx, dropped) = mpsc::unbounded_channel();
        let (broken_tx, broken) = mpsc::unbounded_channel();
        let sinks = Sinks {
            tx: tx.clone(),
            lost: lost.clone(),
            dropped: dropped_tx,
            broken: broken_tx,
        };
        let conn = SubConn::open(&redis, &channels, sink(sinks.clone(), 0)).await?;
        let stop = CancellationToken::new();
        tokio::spawn(watch_health(
            Watched {
                redis,
                channels,
                sinks,
                generation: 0,
                tx,
                dropped,
                broken,
            },
            conn,
            stop.clone(),
        ));
        Ok(Self { rx, lost, stop })
    }

    /// The next delivery; `None` once the subscription has stopped for good.
    pub async fn recv(&mut self) -> Option<Delivery> {
        if self.lost.swap(false, Ordering::Relaxed) {
            return Some(Delivery::Resync);
        }
        let delivery = self.rx.recv().await;
        if self.lost.swap(false, Ordering::Relaxed) {
            // Dropped messages came before this one or after it: catch up before going on.
            return Some(Delivery::Resync);
        }
        delivery
    }
}

/// What [`watch_health`] keeps a subscription's connection with.
struct Watched {
    redis: Redis,
    channels: Vec<String>,
    sinks: Sinks,
    /// The number of the connection in use.
    generation: u64,
    tx: mpsc::Sender<Delivery>,
    /// Channels the server dropped (see [`sink`]), to subscribe to again.
    dropped: mpsc::UnboundedReceiver<String>,
    /// A connection of the subscription broke (see [`sink`]): its generation.
    broken: mpsc::UnboundedReceiver<u64>,
}

/// Pings the subscription's connection; one that does not answer is replaced by a new one,
/// subscribed to the same channels (which itself announces a resync). Subscribes again to
/// every channel the server dropped; should that fail, the connection is replaced too.
async fn watch_health(mut w: Watched, mut conn: SubConn, stop: CancellationToken) {
    let redis = w.redis.clone();
    loop {
        let healthy = tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(HEALTH_EVERY) => matches!(
                tokio::time::timeout(
                    HEALTH_TIMEOUT.min(redis.response_timeout()),
                    conn.check(redis.name())
                )
                .await,
                Ok(Ok(()))
            ),
            // On a Cluster the client library reconnects a node's connection by itself and
            // subscribes again to the node's channels, but takes no answer from it: a master
            // that just restarted refuses commands (CLUSTERDOWN) until it has spoken with the
            // others, and its channels stay silent, without a word, until this process
            // restarts. The whole subscription is made again instead, each SSUBSCRIBE
            // checked, until every one is confirmed. (One server's connection manager checks
            // its own resubscription.)
            Some(generation) = w.broken.recv(), if matches!(conn, SubConn::Cluster(_)) => {
                generation != w.generation
            }
            Some(channel) = w.dropped.recv() => {
                tracing::warn!(connection = redis.name(), channel = %channel, "redis dropped a subscribed channel (its slot moved); subscribing again");
                match tokio::time::timeout(redis.response_timeout(), conn.resubscribe(&channel)).await {
                    Ok(Ok(())) => true,
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, channel = %channel, "cannot subscribe again to a dropped channel; replacing the connection");
                        false
                    }
                    Err(_) => false,
                }
            }
        };
        if healthy {
            continue;
        }
        tracing::warn!(
            connection = redis.name(),
            "redis subscription lost; replacing its connection"
        );
        // Tell the reader at once: messages are being lost from now until the new
        // subscription is in place (its confirmation says so again).
        let _ = w.tx.try_send(Delivery::Resync);
        loop {
            w.generation += 1;
            let push = sink(w.sinks.clone(), w.generation);
            match SubConn::open(&redis, &w.channels, push).await {
                Ok(fresh) => {
                    conn = fresh;
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot subscribe again yet; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }
}
