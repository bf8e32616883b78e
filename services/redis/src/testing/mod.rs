//! For tests: `redis-server` processes of the test's own, on free loopback ports, without
//! persistence — a single server a test may kill, pause or count the clients of, and a
//! three-master Redis Cluster. They panic, saying what to install, when `redis-server` or
//! `redis-cli` is missing: a skipped test would pass without testing anything. And a loopback
//! forwarder in front of one that a test switches to a blackhole ([`Blackhole`]).

mod blackhole;

pub use blackhole::Blackhole;

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::Settings;

/// A free loopback port: bind port 0, note it, release it. Another process may take it before
/// the server binds; callers retry then.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// One `redis-server` process.
struct Server {
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Server {
    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("redis-{}.log", self.port))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts it and waits until it answers `PING`; false when it exited (port taken).
    async fn spawn(&mut self) -> bool {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the redis log");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log file"))
            .stderr(log)
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed; this test runs a private Redis of its own. \
                 Install it (`apt-get install redis-server`, or run infra/services.sh)"
            ),
            Err(e) => panic!("failed to start redis-server: {e}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = redis::Client::open(self.url()).expect("valid URL");
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
            {
                self.child = Some(child);
                return true;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "private redis-server did not answer within 10 s; its log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts a server on a free port (a few tries).
    async fn start(dir: &Path, extra: &[&str]) -> Self {
        for _ in 0..5 {
            let mut server = Self {
                port: free_port(),
                dir: dir.to_owned(),
                extra: extra.iter().map(|s| (*s).to_owned()).collect(),
                child: None,
            };
            if server.spawn().await {
                return server;
            }
        }
        panic!("could not start a private redis-server on a free port (5 tries)");
    }

    fn signal(&self, signal: &str) {
        let Some(child) = &self.child else {
            panic!("the private redis-server is not running");
        };
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} of the private redis-server failed");
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A `redis-server` of the test's own: it can be killed and restarted empty, paused
/// (`SIGSTOP`) and resumed, and its `CLIENT LIST` shows only the test's clients.
pub struct PrivateRedis {
    server: Server,
    _dir: tempfile::TempDir,
}

impl PrivateRedis {
    /// Starts it; panics, saying what to install, when `redis-server` is not on `PATH`.
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(dir.path(), &[]).await;
        Self { server, _dir: dir }
    }

    pub fn port(&self) -> u16 {
        self.server.port
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn settings(&self) -> Settings {
        Settings::single(self.url())
    }

    /// SIGKILL: the server and everything it held are gone.
    pub fn kill(&mut self) {
        self.server.stop();
    }

    /// Starts it again, empty, on the same port.
    pub async fn start_again(&mut self) {
        assert!(self.server.child.is_none(), "kill it first");
        // The port was ours a moment ago; a restart that loses it is a test failure.
        assert!(
            self.server.spawn().await,
            "redis-server could not start again on port {}; its log:\n{}",
            self.server.port,
            self.server.log()
        );
    }

    /// SIGSTOP: the server stops answering but keeps its connections open (a stalled peer).
    pub fn pause(&self) {
        self.server.signal("STOP");
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&self) {
        self.server.signal("CONT");
    }
}

/// A Redis Cluster of three masters (no replicas) of the test's own, every slot assigned.
pub struct PrivateCluster {
    servers: Vec<Server>,
    _dir: tempfile::TempDir,
}

impl PrivateCluster {
    /// Starts three `redis-server --cluster-enabled yes` processes and joins them with
    /// `redis-cli --cluster create`; returns once the cluster answers `cluster_state:ok`.
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut servers = Vec::new();
        for i in 0..3 {
            let conf = format!("nodes-{i}.conf");
            servers.push(
                Server::start(
                    dir.path(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &conf,
                        "--cluster-node-timeout",
                        "5000",
                    ],
                )
                .await,
            );
        }
        let nodes: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output();
        match created {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-cli is not installed; this test builds a private Redis Cluster. Install \
                 it (`apt-get install redis-tools`, or run infra/services.sh)"
            ),
            Err(e) => panic!("failed to run redis-cli: {e}"),
        }
        let cluster = Self { servers, _dir: dir };
        cluster.wait_ok().await;
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` (slots assigned and agreed).
    async fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for server in &self.servers {
            let client = redis::Client::open(server.url()).expect("valid URL");
            loop {
                let info: Option<String> = match client.get_multiplexed_async_connection().await {
                    Ok(mut c) => redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut c)
                        .await
                        .ok(),
                    Err(_) => None,
                };
                if info.is_some_and(|i| i.contains("cluster_state:ok")) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the private cluster did not reach cluster_state:ok within 30 s; node log:\n{}",
                    server.log()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The nodes' URLs (seeds for a cluster client).
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(Server::url).collect()
    }

    /// `REDIS_URL` for this cluster: its nodes, comma-separated (with `REDIS_CLUSTER=true`).
    pub fn redis_url(&self) -> String {
        self.urls().join(",")
    }

    pub fn settings(&self) -> Settings {
        Settings::cluster(self.urls())
    }

    /// SIGKILLs the master that owns the slot of `key` and starts it again on the same port
    /// with its cluster configuration (`nodes.conf` survives, as it does on a real node) but
    /// no data, as a master without persistence comes back after a crash; returns once the
    /// cluster answers `cluster_state:ok` again, with the node's URL.
    pub async fn restart_owner_of_empty(&mut self, key: &str) -> String {
        let (mut conns, ids) = self.masters().await;
        let (_, i) = owner(&mut conns, &ids, key).await;
        drop(conns);
        let server = &mut self.servers[i];
        server.stop();
        assert!(
            server.spawn().await,
            "cluster node could not start again on port {}; its log:\n{}",
            server.port,
            server.log()
        );
        self.wait_ok().await;
        self.servers[i].url()
    }

    /// Moves the slot of `key` (a key or a shard channel) to another master, as an operator
    /// resharding does (`redis-cli --cluster reshard` runs the same steps): `CLUSTER SETSLOT
    /// … IMPORTING` on the target, `… MIGRATING` on the owner, `MIGRATE` of the slot's keys,
    /// then `CLUSTER SETSLOT … NODE` on every master. Redis then tells the owner's subscribers
    /// of the slot's shard channels that they are unsubscribed (`sunsubscribe`). Returns the
    /// slot and the URLs of its old and new owner.
    pub async fn move_slot_of(&self, key: &str) -> (u16, String, String) {
        let (mut conns, ids) = self.masters().await;
        let (slot, from) = owner(&mut conns, &ids, key).await;
        let to = (from + 1) % conns.len();
        let setslot = |state: &str, id: &str| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(state).arg(id);
            cmd
        };
        setslot("IMPORTING", &ids[from])
            .query_async::<()>(&mut conns[to])
            .await
            .expect("CLUSTER SETSLOT IMPORTING");
        setslot("MIGRATING", &ids[to])
            .query_async::<()>(&mut conns[from])
            .await
            .expect("CLUSTER SETSLOT MIGRATING");
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query_async(&mut conns[from])
                .await
                .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.servers[to].port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query_async::<()>(&mut conns[from])
                .await
                .expect("MIGRATE");
        }
        // The target first, then the old owner, then the rest (the order resharding uses).
        let mut order = vec![to, from];
        order.extend((0..conns.len()).filter(|i| *i != to && *i != from));
        for i in order {
            // A busy machine may answer late on the cluster bus; a node that refuses at first
            // (its view of the slot not settled yet) is asked again.
            let mut tries = 0;
            while let Err(e) = setslot("NODE", &ids[to])
                .query_async::<()>(&mut conns[i])
                .await
            {
                tries += 1;
                assert!(
                    tries < 50,
                    "CLUSTER SETSLOT {slot} NODE on {}: {e}",
                    self.servers[i].url()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        (slot, self.servers[from].url(), self.servers[to].url())
    }
}

impl PrivateCluster {
    /// A connection to each master, and each master's id (`CLUSTER MYID`), in order.
    async fn masters(&self) -> (Vec<redis::aio::MultiplexedConnection>, Vec<String>) {
        let mut conns = Vec::new();
        let mut ids = Vec::new();
        for server in &self.servers {
            let client = redis::Client::open(server.url()).expect("valid URL");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("connect to a cluster node");
            let id: String = redis::cmd("CLUSTER")
                .arg("MYID")
                .query_async(&mut conn)
                .await
                .expect("CLUSTER MYID");
            conns.push(conn);
            ids.push(id);
        }
        (conns, ids)
    }
}

/// The slot of `key` and the index (in `ids`) of the master that owns it.
async fn owner(
    conns: &mut [redis::aio::MultiplexedConnection],
    ids: &[String],
    key: &str,
) -> (u16, usize) {
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut conns[0])
        .await
        .expect("CLUSTER KEYSLOT");
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conns[0])
        .await
        .expect("CLUSTER SLOTS");
    let owner = owner_of(&slots, slot).expect("a master owns the slot");
    let i = ids
        .iter()
        .position(|id| *id == owner)
        .expect("the owner is one of the cluster's nodes");
    (slot, i)
}

/// The id of the node serving `slot` in a `CLUSTER SLOTS` reply.
fn owner_of(slots: &redis::Value, slot: u16) -> Option<String> {
    let redis::Value::Array(ranges) = slots else {
        return None;
    };
    ranges.iter().find_map(|range| {
        let redis::Value::Array(fields) = range else {
            return None;
        };
        let start: u16 = redis::from_redis_value_ref(fields.first()?).ok()?;
        let end: u16 = redis::from_redis_value_ref(fields.get(1)?).ok()?;
        if !(start..=end).contains(&slot) {
            return None;
        }
        let redis::Value::Array(master) = fields.get(2)? else {
            return None;
        };
        redis::from_redis_value_ref(master.get(2)?).ok()
    })
}
