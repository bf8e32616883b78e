//! `ecoscan up` as a child process: every service in one process, each on a free port, with
//! the data in a temporary directory. The child is killed when [`Up`] is dropped.

#![allow(dead_code)]

use std::{
    fs::File,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The running suite.
pub struct Up {
    dir: tempfile::TempDir,
    child: Child,
    /// `http://127.0.0.1:PORT` of the gateway.
    pub gateway: String,
}

impl Up {
    /// Starts `ecoscan up` with `env` on top of a clean environment (no `OTEL_`, `LLM_`, store
    /// or `ECOSCAN_` variable of the developer's), and waits until it says it is up.
    pub async fn start(env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = File::create(dir.path().join("up.log")).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ecoscan"));
        cmd.arg("up").arg("--data-dir").arg(dir.path().join("data"));
        for (key, _) in std::env::vars_os() {
            let Some(name) = key.to_str() else { continue };
            if ["OTEL_", "LLM_", "S3_", "REDIS_", "ECOSCAN_", "GRPC_TLS_"]
                .iter()
                .any(|p| name.starts_with(p))
                || name.ends_with("_URL")
            {
                cmd.env_remove(&key);
            }
        }
        for port in [
            "GATEWAY",
            "GATEWAY_ADMIN",
            "INGEST",
            "VISION",
            "RULE",
            "ANSWER",
            "REWARD",
            "ANALYTICS",
            "NOTIFICATION",
        ] {
            cmd.env(format!("ECOSCAN_{port}_PORT"), "0");
        }
        cmd.env("RUST_LOG", "info")
            .env("LLM_PROVIDER", "mock")
            .env("LLM_MOCK_LATENCY", "150ms")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone log file"))
            .stderr(out);
        let child = cmd.spawn().expect("spawn ecoscan up");
        let mut up = Self {
            dir,
            child,
            gateway: String::new(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let log = up.logs();
            if let Some(url) = log
                .lines()
                .find_map(|l| l.trim().strip_prefix("gateway"))
                .and_then(|rest| rest.split_whitespace().next())
                .filter(|_| log.contains("ecoscan is up"))
            {
                up.gateway = url.to_owned();
                return up;
            }
            if let Ok(Some(status)) = up.child.try_wait() {
                panic!("ecoscan up exited ({status}):\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "ecoscan up did not start in time:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A URL on the gateway.
    pub fn gateway_url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway)
    }

    /// The data directory (`--data-dir`): what `ecoscan token` needs to mint for this suite.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `host:port` of `service` (`ingest`, `rule`, …) as the start-up lines print it.
    pub fn service_addr(&self, service: &str) -> String {
        let log = self.logs();
        log.lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(service))
                    .then(|| words.next())
                    .flatten()
            })
            .unwrap_or_else(|| panic!("ecoscan up printed no address for {service}:\n{log}"))
            .to_owned()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("up.log")
    }

    /// What it has printed and logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
