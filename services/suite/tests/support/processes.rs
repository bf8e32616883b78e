//! Every service as its own OS process (`ecoscan serve <service>`), the way they run when
//! deployed apart: one telemetry resource per process, real crashes (SIGKILL) and restarts.
//!
//! ```ignore
//! let cluster = Cluster::builder().env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint).start().await;
//! let url = cluster.gateway_url("/api/v1/scan/completion");
//! cluster.kill(Service::Ingest);            // SIGKILL, no goodbye
//! cluster.restart(Service::Ingest).await;   // same address, same data
//! ```
//!
//! Each service binds port 0 and writes the address it got to a file (`ECOSCAN_ADDR_FILE`), so
//! no port is guessed and nothing races; services start in dependency order, each told the
//! addresses of those it calls. Data lives in a temporary directory; children are killed when
//! the [`Cluster`] is dropped. A child's stdout and stderr go to `<data dir>/<service>.log`
//! ([`Cluster::logs`]), printed when a service fails to start.

#![allow(dead_code)]

use std::{
    collections::HashMap,
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub use ecoscan::Service;

/// How long a service may take to start serving.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The `ecoscan` binary, built by Cargo for this package's tests.
fn binary() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_ecoscan"));
    assert!(
        path.exists(),
        "{} does not exist; build it with `cargo build -p ecoscan --bins` (cargo test builds it)",
        path.display()
    );
    path
}

/// What to start.
#[derive(Default)]
pub struct ClusterBuilder {
    env: Vec<(String, String)>,
    service_env: Vec<(Service, String, String)>,
    /// Only these (with what they call), when set.
    only: Option<Vec<Service>>,
}

/// The key every process of a test cluster signs and verifies identity assertions with; the
/// test process uses it too, so its direct gRPC calls (`request_as`) are believed. The same key
/// as `common::TestSuite`'s, so a test binary that starts both works either way.
pub const IDENTITY_KEY: &str = "suite-tests-identity-key-0123456789-abcdefghij";

/// Makes this test process sign with [`IDENTITY_KEY`] (before its first call). A second cluster
/// of the same test binary finds the key set already, which is fine: it is the same key.
pub fn use_identity_key() {
    let _ = ecoscan_common::assertion::set_key(IDENTITY_KEY);
}

impl ClusterBuilder {
    /// Sets a variable for every service.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets a variable for one service (after the shared ones, so it wins).
    pub fn service_env(
        mut self,
        service: Service,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        self.service_env.push((service, key.into(), value.into()));
        self
    }

    /// Starts only `services` instead of all; they must include every service they call.
    pub fn only(mut self, services: &[Service]) -> Self {
        self.only = Some(services.to_vec());
        self
    }

    /// Starts every service, dependencies first, and waits until each serves.
    pub async fn start(self) -> Cluster {
        use_identity_key();
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cluster = Cluster {
            dir,
            procs: HashMap::new(),
            replicas: HashMap::new(),
            addrs: HashMap::new(),
            builder: self,
        };
        for service in Service::ALL {
            if cluster
                .builder
                .only
                .as_ref()
                .is_none_or(|only| only.contains(&service))
            {
                cluster.spawn(service, "127.0.0.1:0").await;
            }
        }
        cluster
    }
}

/// The running services.
pub struct Cluster {
    dir: tempfile::TempDir,
    procs: HashMap<Service, Child>,
    /// Further processes of a service, by label (see [`Cluster::start_replica`]).
    replicas: HashMap<String, (Child, SocketAddr)>,
    /// Each service's address, kept after it stops so a restart binds the same one.
    addrs: HashMap<Service, SocketAddr>,
    builder: ClusterBuilder,
}

impl Cluster {
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// Where `service` listens.
    pub fn addr(&self, service: Service) -> SocketAddr {
        *self
            .addrs
            .get(&service)
            .unwrap_or_else(|| panic!("{} was never started", service.name()))
    }

    /// Whether `service`'s process is still running.
    pub fn is_running(&mut self, service: Service) -> bool {
        self.procs
            .get_mut(&service)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// `http://127.0.0.1:PORT` of `service`.
    pub fn uri(&self, service: Service) -> String {
        format!("http://{}", self.addr(service))
    }

    /// A URL on the gateway.
    pub fn gateway_url(&self, path: &str) -> String {
        format!("{}{path}", self.uri(Service::Gateway))
    }

    /// A URL on the gateway's admin listener (`/metrics`, `/readyz`).
    pub fn gateway_admin_url(&self, path: &str) -> String {
        let addr = read_addr(&self.admin_addr_file(Service::Gateway.name()))
            .expect("the gateway wrote its admin address");
        format!("http://{addr}{path}")
    }

    /// Where the process labelled `label` writes its admin listener's address (the gateway).
    fn admin_addr_file(&self, label: &str) -> PathBuf {
        self.dir.path().join(format!("{label}.admin-addr"))
    }

    /// The directory holding every service's data and logs.
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// What `service` has logged so far.
    pub fn logs(&self, service: Service) -> String {
        std::fs::read_to_string(self.log_path(service)).unwrap_or_default()
    }

    /// Kills `service` with SIGKILL (no shutdown, no flush) and reaps it.
    pub fn kill(&mut self, service: Service) {
        if let Some(mut child) = self.procs.remove(&service) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Asks `service` to stop with SIGTERM and waits up to `timeout` for it to exit; returns
    /// whether it exited successfully in time (it is killed otherwise).
    pub async fn terminate(&mut self, service: Service, timeout: Duration) -> bool {
        let Some(mut child) = self.procs.remove(&service) else {
            return true;
        };
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        let deadline = Instant::now() + timeout;
        while sent && Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Starts `service` again on the address it had, with the same environment and data (after
    /// [`Cluster::kill`] or [`Cluster::terminate`]).
    pub async fn restart(&mut self, service: Service) {
        self.kill(service);
        let previous = self.addr(service);
        self.spawn(service, &previous.to_string()).await;
    }

    fn log_path(&self, service: Service) -> PathBuf {
        self.label_log_path(service.name())
    }

    fn label_log_path(&self, label: &str) -> PathBuf {
        self.dir.path().join(format!("{label}.log"))
    }

    /// Starts another process of `service` (a replica) labelled `label`, with the service's
    /// usual environment plus `overrides`; returns its address.
    pub async fn start_replica(
        &mut self,
        service: Service,
        label: &str,
        overrides: &[(&str, String)],
    ) -> SocketAddr {
        let (child, addr) = self
            .spawn_process(service, label, "127.0.0.1:0", overrides)
            .await;
        self.replicas.insert(label.to_owned(), (child, addr));
        addr
    }

    /// [`Cluster::start_replica`] on `listen` instead of `127.0.0.1:0`: replicas may share a
    /// port on different loopback addresses (`127.0.0.2:PORT`, `127.0.0.3:PORT`), as pods
    /// behind one name do, and a killed replica restarts on the address it had.
    pub async fn start_replica_on(
        &mut self,
        service: Service,
        label: &str,
        listen: &str,
        overrides: &[(&str, String)],
    ) -> SocketAddr {
        let (child, addr) = self.spawn_process(service, label, listen, overrides).await;
        self.replicas.insert(label.to_owned(), (child, addr));
        addr
    }

    /// `http://ADDR` of the replica `label`.
    pub fn replica_uri(&self, label: &str) -> String {
        let (_, addr) = self
            .replicas
            .get(label)
            .unwrap_or_else(|| panic!("no replica {label}"));
        format!("http://{addr}")
    }

    /// What the replica `label` has logged so far.
    pub fn replica_logs(&self, label: &str) -> String {
        std::fs::read_to_string(self.label_log_path(label)).unwrap_or_default()
    }

    /// Kills the replica `label` with SIGKILL.
    pub fn kill_replica(&mut self, label: &str) {
        if let Some((mut child, _)) = self.replicas.remove(label) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn sqlite(&self, name: &str) -> String {
        format!(
            "sqlite://{}?mode=rwc",
            self.dir.path().join(format!("{name}.db")).display()
        )
    }

    /// The variables `service` needs: its data paths and the addresses of what it calls.
    fn service_vars(&self, service: Service) -> Vec<(&'static str, String)> {
        let url = |s: Service| self.uri(s);
        let dir = self.dir.path();
        match service {
            Service::Rule => vec![],
            Service::Analytics => vec![
                ("ANALYTICS_DATABASE_URL", self.sqlite("analytics")),
                (
                    "ANALYTICS_BODY_DIR",
                    dir.join("analytics-bodies").display().to_string(),
                ),
            ],
            Service::Reward => vec![("REWARD_DATABASE_URL", self.sqlite("reward"))],
            Service::Notification => {
                vec![("NOTIFICATION_DATABASE_URL", self.sqlite("notification"))]
            }
            Service::Vision => vec![
                ("RULE_URL", url(Service::Rule)),
                ("ANALYTICS_URL", url(Service::Analytics)),
            ],
            Service::Answer => vec![("ANALYTICS_URL", url(Service::Analytics))],
            Service::Ingest => vec![
                ("INGEST_DATABASE_URL", self.sqlite("ingest")),
                (
                    "INGEST_OBJECT_DIR",
                    dir.join("objects").display().to_string(),
                ),
                ("INGEST_MAX_IN_FLIGHT", "8".to_owned()),
                ("VISION_URL", url(Service::Vision)),
                ("RULE_URL", url(Service::Rule)),
                ("ANSWER_URL", url(Service::Answer)),
                ("REWARD_URL", url(Service::Reward)),
                ("NOTIFICATION_URL", url(Service::Notification)),
            ],
            Service::Gateway => vec![
                // These tests name their users in X-User-Id: header mode, explicitly.
                ("GATEWAY_TRUST_USER_HEADER", "loopback".to_owned()),
                // Every client of these tests is 127.0.0.1: hundreds of streams at once.
                ("GATEWAY_MAX_CONNECTIONS_PER_IP", "4096".to_owned()),
                ("INGEST_URL", url(Service::Ingest)),
                ("REWARD_URL", url(Service::Reward)),
                ("ANALYTICS_URL", url(Service::Analytics)),
                ("NOTIFICATION_URL", url(Service::Notification)),
            ],
        }
    }

    async fn spawn(&mut self, service: Service, listen: &str) {
        let (child, addr) = self
            .spawn_process(service, service.name(), listen, &[])
            .await;
        self.procs.insert(service, child);
        self.addrs.insert(service, addr);
    }

    /// Starts one process of `service`, its files named after `label`, and waits until it
    /// serves.
    async fn spawn_process(
        &self,
        service: Service,
        label: &str,
        listen: &str,
        overrides: &[(&str, String)],
    ) -> (Child, SocketAddr) {
        let name = service.name();
        let addr_file = self.dir.path().join(format!("{label}.addr"));
        let _ = std::fs::remove_file(&addr_file);
        let admin_file = self.admin_addr_file(label);
        let _ = std::fs::remove_file(&admin_file);
        let log_path = self.label_log_path(label);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open log file");
        let mut cmd = Command::new(binary());
        cmd.arg("serve").arg(name);
        // Nothing from the developer's environment may redirect a test's services.
        for (key, _) in std::env::vars_os() {
            let Some(name) = key.to_str() else { continue };
            if ["OTEL_", "LLM_", "S3_", "REDIS_", "ECOSCAN_"]
                .iter()
                .any(|p| name.starts_with(p))
                || name.ends_with("_URL")
            {
                cmd.env_remove(&key);
            }
        }
        cmd.env("RUST_LOG", "info")
            // The key every process of the cluster signs and verifies identity with.
            .env(ecoscan_common::assertion::KEY_VAR, IDENTITY_KEY)
            .env("LLM_PROVIDER", "mock")
            .env("LLM_MOCK_LATENCY", "150ms")
            .envs(self.service_vars(service))
            .envs(self.builder.env.iter().map(|(k, v)| (k, v)))
            .envs(
                self.builder
                    .service_env
                    .iter()
                    .filter(|(s, _, _)| *s == service)
                    .map(|(_, k, v)| (k, v)),
            )
            .envs(overrides.iter().map(|(k, v)| (k, v)))
            .env(service.addr_var(), listen)
            .env(ecoscan::ADDR_FILE_VAR, &addr_file)
            // The gateway's admin listener on a free port too, named in a file of its own.
            .env("GATEWAY_ADMIN_ADDR", "127.0.0.1:0")
            .env(ecoscan::ADMIN_ADDR_FILE_VAR, &admin_file)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log file"))
            .stderr(log);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("failed to start `ecoscan serve {name}`: {e}"));

        let deadline = Instant::now() + START_TIMEOUT;
        let addr = loop {
            if let Some(addr) = read_addr(&addr_file) {
                break addr;
            }
            still_starting(&mut child, deadline, &log_path, name, label, "listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // Listening is not serving: a service binds first, then opens its stores (a database
        // migration, a Redis connection) and only then answers. Every service serves `GET
        // /metrics` on its port once it does, the gateway on its admin listener.
        let http = reqwest::Client::new();
        loop {
            let metrics = match service {
                Service::Gateway => read_addr(&admin_file).map(|a| format!("http://{a}/metrics")),
                _ => Some(format!("http://{addr}/metrics")),
            };
            let answered = match metrics {
                Some(url) => http
                    .get(&url)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success()),
                None => false,
            };
            if answered {
                break;
            }
            still_starting(&mut child, deadline, &log_path, name, label, "serve");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (child, addr)
    }
}

/// The address in `path`, once the process has written it.
fn read_addr(path: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, (mut child, _)) in self.replicas.drain() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for (_, mut child) in self.procs.drain() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Panics, with the process's log, when `child` exited or `deadline` passed before it began
/// to `what` (listen, serve).
fn still_starting(
    child: &mut Child,
    deadline: Instant,
    log_path: &std::path::Path,
    name: &str,
    label: &str,
    what: &str,
) {
    let log = || std::fs::read_to_string(log_path).unwrap_or_default();
    if let Ok(Some(status)) = child.try_wait() {
        panic!(
            "`ecoscan serve {name}` ({label}) exited with {status} before it began to {what}; \
             its log:\n{}",
            log()
        );
    }
    if Instant::now() > deadline {
        let _ = child.kill();
        panic!(
            "`ecoscan serve {name}` ({label}) did not {what} within {START_TIMEOUT:?}; its log:\n{}",
            log()
        );
    }
}
