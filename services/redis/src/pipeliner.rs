//! Group sending: commands from many tasks go to Redis as pipelines.
//!
//! A busy process sends thousands of small commands a second. Each one sent alone costs Redis a
//! read, a reply write and an event-loop turn, which on a small machine cost more than most
//! commands themselves. Here, while one pipeline is on its way, the commands that arrive meanwhile
//! gather into the next one: no linger, no added latency when idle, and under load many commands
//! per round trip (a Redis server spends about half the CPU per command at four per pipeline,
//! measured with `redis-benchmark -P`). A Cluster takes a pipeline only within one slot, so
//! commands carry a routing group (their hash tag) and each group is its own pipeline.
//!
//! Commands sent this way should not fail by themselves: a pipeline that fails (a dropped
//! connection) fails every command in it.

use std::collections::HashMap;

use redis::{Cmd, FromRedisValue, RedisError, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

use crate::Conn;

/// Commands gathered into one pipeline at most.
const MAX_BATCH: usize = 512;

struct Request {
    group: String,
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// Sends commands in pipelines; see the module docs. Clones share the sender task, which ends
/// when the last clone is dropped.
#[derive(Clone)]
pub struct Pipeliner {
    tx: mpsc::Sender<Request>,
}

impl Pipeliner {
    /// Starts the sender on `conn`.
    pub fn new(conn: Conn) -> Self {
        let (tx, rx) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(run(conn, rx));
        Self { tx }
    }

    /// Sends `cmd` in the next pipeline of `group` (commands of one group must be legal in one
    /// pipeline: on a Cluster, one hash slot) and returns its reply.
    pub async fn query<T: FromRedisValue>(&self, group: &str, cmd: Cmd) -> RedisResult<T> {
        let (reply, rx) = oneshot::channel();
        let request = Request {
            group: group.to_owned(),
            cmd,
            reply,
        };
        let gone = || RedisError::from(std::io::Error::other("the redis pipeline sender stopped"));
        self.tx.send(request).await.map_err(|_| gone())?;
        let value = rx.await.map_err(|_| gone())??;
        T::from_redis_value(value).map_err(Into::into)
    }
}

async fn run(conn: Conn, mut rx: mpsc::Receiver<Request>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let mut groups: HashMap<String, Vec<Request>> = HashMap::new();
        for request in batch.drain(..) {
            groups
                .entry(request.group.clone())
                .or_default()
                .push(request);
        }
        let sends = groups.into_values().map(|requests| {
            let mut conn = conn.clone();
            async move {
                let mut pipe = redis::pipe();
                for r in &requests {
                    pipe.add_command(r.cmd.clone());
                }
                match pipe.query_async::<Vec<Value>>(&mut conn).await {
                    Ok(values) => {
                        for (r, v) in requests.into_iter().zip(values) {
                            let _ = r.reply.send(Ok(v));
                        }
                    }
                    Err(e) => {
                        for r in requests {
                            let _ = r.reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        });
        futures::future::join_all(sends).await;
    }
}
