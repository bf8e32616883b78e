//! The faults the checker injects, on the test's own Redis (one private server, or a private
//! three-master Cluster) and processes; never on the shared Redis.

use std::time::{Duration, Instant};

use super::observer::Observer;
use crate::support::{
    processes::{Cluster, Service},
    stores::{PrivateCluster, PrivateRedis},
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Writes paused, the log read, then SIGKILL and a restart empty on the same port: the
    /// one server, or on a Cluster the master that holds a running job's log (its
    /// `nodes.conf` kept, as a real node keeps it).
    RedisRestartEmpty,
    /// `maxmemory` 1 byte with `noeviction`: every write refused with OOM, for a few seconds.
    RedisMaxmemory,
    /// A running job's log key overwritten with a string (`WRONGTYPE` for its writers), then
    /// deleted.
    WrongType,
    /// `CLIENT PAUSE <2.5 leases> ALL` on every node.
    ClientPause,
    /// SIGKILL of ingest, restarted.
    KillIngest,
    /// SIGKILL of the gateway, restarted on its address.
    KillGateway,
    /// A running job's slot moved to another master (`CLUSTER SETSLOT` with `MIGRATE`).
    MoveSlot,
}

impl Fault {
    /// Whether it acts on a running job, and on one that has not reached its answer yet (the
    /// run submits one more scan for it when no such job is free).
    pub fn needs_job(self) -> Option<bool> {
        match self {
            Self::WrongType => Some(false),
            Self::MoveSlot | Self::RedisRestartEmpty => Some(true),
            _ => None,
        }
    }
}

/// Whether a running job is there that no fault has picked yet (`early`: one that has not
/// reached its answer).
pub fn a_job_is_free(observer: &Observer, taken: &[String], early: bool) -> bool {
    observer.all().iter().any(|(j, s)| {
        !taken.contains(j)
            && s.ended_at().is_none()
            && !s.log.is_empty()
            && (!early || !s.answering())
    })
}

/// The nodes of the test's Redis, for commands that go to each (`CONFIG`, `CLIENT PAUSE`,
/// `CLUSTER`).
pub struct Nodes {
    pub urls: Vec<String>,
}

async fn node(url: &str) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
}

/// Runs `cmd` on the node at `url`, within 5 s.
async fn on<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> Result<T, String> {
    let run = async {
        let mut c = node(url).await?;
        cmd.query_async::<T>(&mut c).await
    };
    match tokio::time::timeout(Duration::from_secs(5), run).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{url}: {e}")),
        Err(_) => Err(format!("{url}: no answer within 5 s")),
    }
}

fn cmd(args: &[&str]) -> redis::Cmd {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c
}

/// The faults' targets.
pub struct Targets<'a> {
    pub cluster: &'a mut Cluster,
    pub redis: Option<&'a mut PrivateRedis>,
    pub redis_cluster: Option<&'a mut PrivateCluster>,
    pub nodes: &'a Nodes,
    pub observer: &'a Observer,
    pub lease: Duration,
    /// Jobs a fault picked already: each fault gets a job of its own.
    pub taken: &'a mut Vec<String>,
}

/// A running job no fault has picked yet, waiting up to 5 s for one: `early`, one that has
/// not reached its answer (so it streams for a while after the fault), else one writing its
/// answer now; failing those, any unfinished job with a log.
async fn running_job(observer: &Observer, taken: &mut Vec<String>, early: bool) -> Option<String> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let all = observer.all();
        let free = |job: &String| !taken.contains(job);
        let running = |s: &super::observer::Seen| s.ended_at().is_none() && !s.log.is_empty();
        let wanted = all
            .iter()
            .find(|(j, s)| free(j) && running(s) && s.answering() != early);
        let any = all.iter().find(|(j, s)| free(j) && running(s));
        let late = Instant::now() > until;
        if let Some((job, _)) = wanted.or(if late { any } else { None }) {
            taken.push(job.clone());
            return Some(job.clone());
        }
        if late {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Injects `fault`; returns what it did (for the timeline) and, for a process killed, the
/// window it was down.
pub async fn inject(
    fault: Fault,
    t: &mut Targets<'_>,
) -> Result<(String, Option<(Instant, Instant)>), String> {
    match fault {
        Fault::RedisRestartEmpty if t.redis_cluster.is_some() => {
            let job = running_job(t.observer, t.taken, true)
                .await
                .ok_or("no running job")?;
            let key = t.observer.log_key(&job);
            for url in &t.nodes.urls {
                on::<()>(url, &cmd(&["CLIENT", "PAUSE", "2000", "WRITE"])).await?;
            }
            t.observer.read_logs(true).await;
            let cluster = t.redis_cluster.as_deref_mut().expect("checked above");
            let url = cluster.restart_owner_of_empty(&key).await;
            Ok((
                format!("job {job}: its master {url} killed and restarted empty"),
                None,
            ))
        }
        Fault::RedisRestartEmpty => {
            let redis = t
                .redis
                .as_deref_mut()
                .ok_or("no private server to restart")?;
            // Writes wait while the log is read one last time, so nothing it held goes unseen.
            on::<()>(&redis.url(), &cmd(&["CLIENT", "PAUSE", "2000", "WRITE"])).await?;
            t.observer.read_logs(true).await;
            redis.kill();
            tokio::time::sleep(Duration::from_millis(700)).await;
            redis.start_again().await;
            Ok(("killed and restarted empty".into(), None))
        }
        Fault::RedisMaxmemory => {
            for url in &t.nodes.urls {
                on::<()>(
                    url,
                    &cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
                )
                .await?;
                on::<()>(url, &cmd(&["CONFIG", "SET", "maxmemory", "1"])).await?;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            for url in &t.nodes.urls {
                on::<()>(url, &cmd(&["CONFIG", "SET", "maxmemory", "0"])).await?;
            }
            Ok(("maxmemory 1 byte for 3 s".into(), None))
        }
        Fault::WrongType => {
            let job = running_job(t.observer, t.taken, false)
                .await
                .ok_or("no running job")?;
            let key = t.observer.log_key(&job);
            let mut conn = t.observer_redis();
            // Read and overwritten in one step, so every event the log held is seen.
            let mut overwrite = redis::cmd("EVAL");
            overwrite
                .arg(
                    "local held = redis.call('XRANGE', KEYS[1], '-', '+') \
                     redis.call('SET', KEYS[1], ARGV[1]) return held",
                )
                .arg(1)
                .arg(&key)
                .arg("not a stream");
            let held = overwrite.query_async::<redis::streams::StreamRangeReply>(&mut conn);
            let held = tokio::time::timeout(Duration::from_secs(5), held)
                .await
                .map_err(|_| "the overwrite timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            t.observer.absorb(&job, &held);
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut del = redis::cmd("DEL");
            del.arg(&key);
            let del = del.query_async::<()>(&mut conn);
            let _ = tokio::time::timeout(Duration::from_secs(5), del).await;
            Ok((format!("log of job {job} a string for 2 s"), None))
        }
        Fault::ClientPause => {
            let pause = t.lease * 5 / 2;
            let ms = pause.as_millis().to_string();
            for url in &t.nodes.urls {
                on::<()>(url, &cmd(&["CLIENT", "PAUSE", &ms, "ALL"])).await?;
            }
            tokio::time::sleep(pause).await;
            Ok((format!("CLIENT PAUSE {ms} ms ALL"), None))
        }
        Fault::KillIngest | Fault::KillGateway => {
            let service = if fault == Fault::KillIngest {
                Service::Ingest
            } else {
                Service::Gateway
            };
            let from = Instant::now();
            t.cluster.kill(service);
            tokio::time::sleep(Duration::from_millis(500)).await;
            t.cluster.restart(service).await;
            Ok((
                format!("{} SIGKILLed and restarted", service.name()),
                Some((from, Instant::now())),
            ))
        }
        Fault::MoveSlot => {
            let job = running_job(t.observer, t.taken, true)
                .await
                .ok_or("no running job")?;
            let key = t.observer.log_key(&job);
            move_slot(&t.nodes.urls, &key)
                .await
                .map(|d| (format!("job {job}: {d}"), None))
        }
    }
}

impl Targets<'_> {
    fn observer_redis(&self) -> ecoscan_redis::Conn {
        self.observer.redis_conn()
    }
}

/// Moves the slot of `key` from its master to the next one: `IMPORTING` on the target,
/// `MIGRATING` on the source, `MIGRATE` of its keys in batches, then `NODE` on every master.
async fn move_slot(urls: &[String], key: &str) -> Result<String, String> {
    let slot: i64 = on(&urls[0], &cmd(&["CLUSTER", "KEYSLOT", key])).await?;
    let slot_s = slot.to_string();
    let mut ids = Vec::new();
    for url in urls {
        ids.push(on::<String>(url, &cmd(&["CLUSTER", "MYID"])).await?);
    }
    // CLUSTER SLOTS: [[start, end, [host, port, id], …], …]
    let slots: Vec<redis::Value> = on(&urls[0], &cmd(&["CLUSTER", "SLOTS"])).await?;
    let mut owner = None;
    for range in slots {
        let redis::Value::Array(items) = range else {
            continue;
        };
        let (Some(redis::Value::Int(lo)), Some(redis::Value::Int(hi))) =
            (items.first(), items.get(1))
        else {
            continue;
        };
        if (*lo..=*hi).contains(&slot)
            && let Some(redis::Value::Array(master)) = items.get(2)
            && let Some(id) = master.get(2)
        {
            owner = redis::from_redis_value::<String>(id.clone()).ok();
        }
    }
    let owner = owner.ok_or_else(|| format!("no owner of slot {slot}"))?;
    let from = ids
        .iter()
        .position(|i| *i == owner)
        .ok_or("owner is not one of ours")?;
    let to = (from + 1) % urls.len();
    let (src, dst) = (&urls[from], &urls[to]);
    let dst_port = dst.rsplit(':').next().unwrap_or_default().to_owned();
    on::<()>(
        dst,
        &cmd(&["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &ids[from]]),
    )
    .await?;
    on::<()>(
        src,
        &cmd(&["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &ids[to]]),
    )
    .await?;
    let mut moved = 0;
    loop {
        let keys: Vec<String> = on(src, &cmd(&["CLUSTER", "GETKEYSINSLOT", &slot_s, "50"])).await?;
        if keys.is_empty() {
            break;
        }
        let mut migrate = cmd(&[
            "MIGRATE",
            "127.0.0.1",
            &dst_port,
            "",
            "0",
            "5000",
            "REPLACE",
            "KEYS",
        ]);
        for k in &keys {
            migrate.arg(k);
        }
        on::<redis::Value>(src, &migrate).await?;
        moved += keys.len();
        // Writers meanwhile are redirected (ASK) to the target for the keys already moved.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for url in [dst, src] {
        on::<()>(
            url,
            &cmd(&["CLUSTER", "SETSLOT", &slot_s, "NODE", &ids[to]]),
        )
        .await?;
    }
    for (i, url) in urls.iter().enumerate() {
        if i != from && i != to {
            on::<()>(
                url,
                &cmd(&["CLUSTER", "SETSLOT", &slot_s, "NODE", &ids[to]]),
            )
            .await?;
        }
    }
    Ok(format!(
        "slot {slot} ({moved} keys) moved from node {from} to node {to}"
    ))
}
