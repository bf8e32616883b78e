//! `gateway-throughput`: the most `GET /api/v1/scan/{id}` per second one gateway serves,
//! beside nginx serving a static file of the same size on the same machine in the same run.
//!
//! Runs the suite in this process and finishes one scan; then 64 HTTP/1.1 keep-alive
//! connections, each sending its next request as soon as the previous answer is read (a closed
//! loop), fetch that scan's result for `--duration` after `--warmup`: a finished result, which
//! the gateway serves from its result cache once ingest has checked the caller owns it. Then
//! the same against a second suite whose model never answers in time, for a scan still
//! running (`202` + `Retry-After`: a call to ingest every time). Then it starts Debian's nginx
//! as a child process (2 workers, the same 2 cores, access log off) serving the gateway's exact
//! finished answer as a file, runs the same load against it, stops it, and reports the rates
//! and the ratios (the design's targets: a finished result at least 50 % of nginx's rate, a
//! pending one at least 25 %). The load generator is a minimal HTTP/1.1 client in this
//! process: it shares the 2 cores with whatever it measures, as `wrk` would.
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin gateway-throughput
//! ```

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::{Figure, Report},
    stats::{Samples, fmt_duration},
    system,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

const USER: &str = "bench-throughput";
/// The design's targets: the gateway's rate for a finished result, and for a pending one, at
/// least these shares of nginx's, in percent.
const FINISHED_TARGET_PERCENT: f64 = 50.0;
const PENDING_TARGET_PERCENT: f64 = 25.0;
/// Longest one request may take before its connection counts an error and reconnects.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Parser, Debug)]
#[command(
    about = "Most GET /api/v1/scan/{id} per second one gateway serves, beside nginx serving a static file"
)]
struct Args {
    /// Concurrent keep-alive connections (closed loop: one request in flight on each).
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Measured time per target (after the warm-up).
    #[arg(long, default_value = "20s", value_parser = ecoscan_bench::parse_duration)]
    duration: Duration,
    /// Load before measuring, per target.
    #[arg(long, default_value = "3s", value_parser = ecoscan_bench::parse_duration)]
    warmup: Duration,
    /// nginx binary (default: `nginx` on PATH, else /usr/sbin/nginx).
    #[arg(long)]
    nginx: Option<PathBuf>,
    /// Fail when nginx is missing instead of installing it with `apt-get install -y nginx`.
    #[arg(long)]
    no_install: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.connections > 0, "--connections must be at least 1");
    ecoscan_bench::init_logs();
    let mut report = Report::new("gateway-throughput");
    // Before the suite starts: an install takes a while and should not overlap the measurement.
    let nginx_bin = find_or_install_nginx(&args).await?;
    let nginx_version = nginx_version(&nginx_bin).await;

    let dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let (running, shutdown) = ecoscan_bench::start_suite(dir.path(), |c| {
        c.llm.mock_latency = Duration::from_millis(20);
    })
    .await?;
    let gateway = running.addrs.gateway;
    let job_id = ecoscan_bench::finished_scan(&reqwest::Client::new(), gateway, USER).await?;

    let path = format!("/api/v1/scan/{job_id}");
    let gateway_request = request(gateway, &path);
    let mut probe = TcpStream::connect(gateway).await?;
    let mut buf = Vec::new();
    let answer = send(&mut probe, &mut buf, &gateway_request).await?;
    anyhow::ensure!(
        answer.status == 200,
        "GET {path} answered {}",
        answer.status
    );
    let body = buf[answer.head..answer.head + answer.body].to_vec();
    drop(probe);

    eprintln!(
        "gateway: {} s of warm-up, {} s measured, {} connections",
        args.warmup.as_secs_f64(),
        args.duration.as_secs_f64(),
        args.connections
    );
    let gw = load(gateway, gateway_request, 200, &args).await?;
    shutdown.cancel();
    drop(running);

    // A scan that stays running for the whole phase: the model takes an hour.
    let pending_dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let (running, shutdown) = ecoscan_bench::start_suite(pending_dir.path(), |c| {
        c.llm.mock_latency = Duration::from_secs(3600);
    })
    .await?;
    let gateway = running.addrs.gateway;
    let pending_id = submitted_scan(gateway).await?;
    let pending_request = request(gateway, &format!("/api/v1/scan/{pending_id}"));
    eprintln!("gateway: a pending scan's result, the same load");
    let pending = load(gateway, pending_request, 202, &args).await?;
    shutdown.cancel();
    drop(running);
    drop(pending_dir);

    let www = tempfile::tempdir().context("failed to create nginx's directory")?;
    let nginx = Nginx::start(&nginx_bin, www.path(), &body).await?;
    eprintln!("nginx: the same load on {}", nginx.addr);
    let ng = load(nginx.addr, request(nginx.addr, "/result.json"), 200, &args).await;
    let nginx_answer = nginx.answer;
    nginx.stop().await;
    let mut ng = ng?;
    drop(www);

    let of_nginx = |t: &Tally| {
        t.rate()
            .zip(ng.rate())
            .filter(|(_, n)| *n > 0.0)
            .map(|(g, n)| g * 100.0 / n)
    };
    let (percent, pending_percent) = (of_nginx(&gw), of_nginx(&pending));
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
    let (mut gw, mut pending) = (gw, pending);
    report
        .measure(Figure::new(
            "gateway GET /api/v1/scan/{id}",
            gw.rate(),
            "req/s",
        ))
        .measure(Figure::new(
            "gateway GET /api/v1/scan/{id}, pending (202)",
            pending.rate(),
            "req/s",
        ))
        .measure(Figure::new(
            "nginx, static file of the same size",
            ng.rate(),
            "req/s",
        ))
        .measure(Figure::new("gateway / nginx", percent, "%").at_least(FINISHED_TARGET_PERCENT))
        .measure(
            Figure::new("gateway pending / nginx", pending_percent, "%")
                .at_least(PENDING_TARGET_PERCENT),
        )
        .measure(Figure::new(
            "gateway latency p50",
            ms(gw.samples.percentile(50.0)),
            "ms",
        ))
        .measure(Figure::new(
            "gateway latency p99",
            ms(gw.samples.percentile(99.0)),
            "ms",
        ))
        .measure(Figure::new(
            "gateway pending latency p99",
            ms(pending.samples.percentile(99.0)),
            "ms",
        ))
        .measure(Figure::new(
            "nginx latency p50",
            ms(ng.samples.percentile(50.0)),
            "ms",
        ))
        .measure(Figure::new(
            "nginx latency p99",
            ms(ng.samples.percentile(99.0)),
            "ms",
        ))
        .header(
            "settings",
            format!(
                "closed loop, {} HTTP/1.1 keep-alive connections, {} s measured after {} s of warm-up per target; the gateway first (the result of one finished scan, header X-User-Id), then a second suite's gateway (a scan still running), then nginx",
                args.connections,
                args.duration.as_secs_f64(),
                args.warmup.as_secs_f64()
            ),
        )
        .header(
            "answers",
            format!(
                "gateway {} B of headers + {} B of JSON; nginx {} B of headers + the same {} B as a file",
                answer.head, answer.body, nginx_answer.head, nginx_answer.body
            ),
        )
        .header(
            "nginx",
            format!(
                "{nginx_version}, {}: worker_processes 2, access_log off, keepalive_requests unbounded, sendfile on",
                nginx_bin.display()
            ),
        )
        .header("stores", system::stores())
        .header(
            "load generator",
            "a minimal HTTP/1.1 client in this process, sharing the 2 cores with the suite (gateway, ingest, stores) in the first phase and with nginx in the second",
        )
        .header("gateway phase", gw.describe())
        .header("gateway pending phase", pending.describe())
        .header("nginx phase", ng.describe());
    if gw.errors + pending.errors + ng.errors > 0 {
        report.note(format!(
            "Errors (unexpected statuses, timeouts, broken connections): gateway {}, pending {}, nginx {}.",
            gw.errors, pending.errors, ng.errors
        ));
    }
    report.print();
    Ok(())
}

/// Submits a scan with `POST /api/v1/scan` (answered at once with its id) and returns the id.
async fn submitted_scan(gateway: SocketAddr) -> anyhow::Result<String> {
    let res: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{gateway}/api/v1/scan"))
        .header("content-type", "application/json")
        .header("x-user-id", USER)
        .body(ecoscan_bench::scan_body(2, "plastic bottle"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    res.get("job_id")
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .context("POST /api/v1/scan answered no job_id")
}

/// `GET path` with the header the gateway needs on loopback (nginx ignores it).
fn request(addr: SocketAddr, path: &str) -> Arc<[u8]> {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nX-User-Id: {USER}\r\n\r\n")
        .into_bytes()
        .into()
}

/// What one answer was: its status, the lengths of its head and body, and whether the server
/// closes the connection after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Answer {
    status: u16,
    head: usize,
    body: usize,
    close: bool,
}

/// Parses an answer's head when `buf` holds all of it (`None` until then).
fn parse_head(buf: &[u8]) -> anyhow::Result<Option<Answer>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end]).context("the answer's head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.strip_prefix("HTTP/1.1 "))
        .and_then(|l| l.get(..3)?.parse().ok())
        .with_context(|| format!("not an HTTP/1.1 status line: {head:?}"))?;
    let mut body = None;
    let mut close = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            body = Some(value.parse().context("a bad Content-Length")?);
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            anyhow::bail!("a {value} answer (only Content-Length is read)");
        }
    }
    Ok(Some(Answer {
        status,
        head: end + 4,
        body: body.unwrap_or(0),
        close,
    }))
}

/// Sends `request` and reads the answer into `buf` (head and body, nothing else: one request
/// in flight per connection).
async fn send(stream: &mut TcpStream, buf: &mut Vec<u8>, request: &[u8]) -> anyhow::Result<Answer> {
    buf.clear();
    stream.write_all(request).await?;
    let mut answer = None;
    loop {
        if answer.is_none() {
            answer = parse_head(buf)?;
        }
        if let Some(a) = answer
            && buf.len() >= a.head + a.body
        {
            return Ok(a);
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        if stream.read_buf(buf).await? == 0 {
            anyhow::bail!("the server closed the connection mid-answer");
        }
    }
}

/// What the connections of one phase counted.
#[derive(Default)]
struct Tally {
    /// Answers of the expected status that completed in the measured window.
    ok: usize,
    errors: usize,
    reconnects: usize,
    samples: Samples,
    window: Duration,
    /// CPU time of this process (suite + load generator, or the load generator alone).
    cpu: Option<Duration>,
    busy: Option<f64>,
}

impl Tally {
    #[allow(clippy::cast_precision_loss)]
    fn rate(&self) -> Option<f64> {
        (self.ok > 0 && !self.window.is_zero()).then(|| self.ok as f64 / self.window.as_secs_f64())
    }

    fn describe(&self) -> String {
        format!(
            "{} answers in {:.1} s, {} errors, {} reconnects; this process's CPU {} ({:.0} % of a core), machine CPU busy {}",
            self.ok,
            self.window.as_secs_f64(),
            self.errors,
            self.reconnects,
            self.cpu.map_or_else(|| "?".to_owned(), fmt_duration),
            self.cpu.map_or(0.0, |c| c.as_secs_f64() * 100.0
                / self.window.as_secs_f64().max(1e-9)),
            self.busy
                .map_or_else(|| "?".to_owned(), |b| format!("{b:.0} %"))
        )
    }
}

/// The closed loop against `addr`: `args.connections` connections for the warm-up and the
/// measured window; answers of status `expect` count.
async fn load(
    addr: SocketAddr,
    request: Arc<[u8]>,
    expect: u16,
    args: &Args,
) -> anyhow::Result<Tally> {
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    // CPU readings at the window's edges, taken by a timer rather than by the connections.
    let edges = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let before = (system::cpu_time(), system::machine_cpu());
        tokio::time::sleep_until(end.into()).await;
        let after = (system::cpu_time(), system::machine_cpu());
        (
            after.0.zip(before.0).map(|(a, b)| a.saturating_sub(b)),
            after
                .1
                .zip(before.1)
                .and_then(|(a, b)| system::busy_percent(b, a)),
        )
    });
    let tasks: Vec<_> = (0..args.connections)
        .map(|_| {
            let request = request.clone();
            tokio::spawn(connection(addr, request, expect, measure_from, end))
        })
        .collect();
    let mut total = Tally {
        window: args.duration,
        ..Tally::default()
    };
    for t in tasks {
        let t = t.await??;
        total.ok += t.ok;
        total.errors += t.errors;
        total.reconnects += t.reconnects;
        total.samples.extend(t.samples.into_values());
    }
    (total.cpu, total.busy) = edges.await?;
    anyhow::ensure!(
        total.ok > 0,
        "no request to {addr} succeeded in the measured window ({} errors)",
        total.errors
    );
    Ok(total)
}

/// One connection's closed loop until `end`; answers completing from `measure_from` on count.
async fn connection(
    addr: SocketAddr,
    request: Arc<[u8]>,
    expect: u16,
    measure_from: Instant,
    end: Instant,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut stream = None;
    while Instant::now() < end {
        let s = match stream.as_mut() {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(addr)
                    .await
                    .with_context(|| format!("failed to connect to {addr}"))?;
                s.set_nodelay(true)?;
                stream.insert(s)
            }
        };
        let t = Instant::now();
        let outcome = tokio::time::timeout(REQUEST_TIMEOUT, send(s, &mut buf, &request)).await;
        let done = Instant::now();
        let counted = done >= measure_from && done <= end;
        match outcome {
            Ok(Ok(a)) if a.status == expect => {
                if counted {
                    tally.ok += 1;
                    tally.samples.push(done - t);
                }
                if a.close {
                    stream = None;
                    tally.reconnects += 1;
                }
            }
            Ok(Ok(a)) => {
                tally.errors += usize::from(counted);
                if a.close {
                    stream = None;
                    tally.reconnects += 1;
                }
            }
            Ok(Err(_)) | Err(_) => {
                tally.errors += usize::from(counted);
                stream = None;
                tally.reconnects += 1;
            }
        }
    }
    Ok(tally)
}

/// nginx on PATH or in /usr/sbin; installed with apt-get when missing (unless `--no-install`).
async fn find_or_install_nginx(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.nginx {
        anyhow::ensure!(p.is_file(), "--nginx {} does not exist", p.display());
        return Ok(p.clone());
    }
    let find = || {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .chain([PathBuf::from("/usr/sbin")])
            .map(|d| d.join("nginx"))
            .find(|p| p.is_file())
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    const HOW: &str = "install it with `apt-get install -y nginx` (as root) or pass --nginx PATH";
    anyhow::ensure!(!args.no_install, "nginx is not installed: {HOW}");
    eprintln!(
        "nginx (the yardstick) is not installed: running `apt-get install -y nginx` (Debian's package; \
         the service is not started, this benchmark runs its own nginx)"
    );
    let status = tokio::process::Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends", "nginx"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .await;
    match status {
        Ok(s) if s.success() => find().context("apt-get installed nginx but it is not on PATH"),
        Ok(s) => anyhow::bail!("`apt-get install -y nginx` exited with {s}: {HOW}"),
        Err(e) => anyhow::bail!("failed to run apt-get ({e}): {HOW}"),
    }
}

/// `nginx/1.22.1` (from `nginx -v`, which prints on stderr).
async fn nginx_version(bin: &Path) -> String {
    let out = tokio::process::Command::new(bin)
        .arg("-v")
        .stdin(Stdio::null())
        .output()
        .await;
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stderr)
                .trim()
                .strip_prefix("nginx version: ")
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "nginx (version unknown)".to_owned())
}

/// nginx as a child process of this one, serving `/result.json` from its own directory.
struct Nginx {
    child: Option<tokio::process::Child>,
    addr: SocketAddr,
    /// Its answer to the first request.
    answer: Answer,
}

impl Nginx {
    async fn start(bin: &Path, dir: &Path, body: &[u8]) -> anyhow::Result<Self> {
        use std::os::unix::fs::PermissionsExt as _;
        // Workers run as `nobody` when nginx starts as root: they must be able to read the file.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let www = dir.join("www");
        std::fs::create_dir(&www)?;
        std::fs::write(www.join("result.json"), body)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let d = dir.display();
        let conf = format!(
            "worker_processes 2;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000000;
    keepalive_timeout 75s;
    default_type application/json;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {www};
    }}
}}
",
            www = www.display()
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf)?;
        let child = tokio::process::Command::new(bin)
            .arg("-p")
            .arg(dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(&conf_path)
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("failed to start {}", bin.display()))?;
        let mut nginx = Self {
            child: Some(child),
            addr,
            answer: Answer {
                status: 0,
                head: 0,
                body: 0,
                close: false,
            },
        };
        let request = request(addr, "/result.json");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = nginx
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
                anyhow::bail!("nginx exited with {status}: {}", log.trim());
            }
            let mut buf = Vec::new();
            if let Ok(mut s) = TcpStream::connect(addr).await
                && let Ok(a) = send(&mut s, &mut buf, &request).await
            {
                anyhow::ensure!(
                    a.status == 200 && buf[a.head..a.head + a.body] == *body,
                    "nginx answered {} with {} B instead of the {} B file",
                    a.status,
                    a.body,
                    body.len()
                );
                nginx.answer = a;
                return Ok(nginx);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "nginx did not answer on {addr} within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Fast shutdown (SIGTERM to the master, which stops its workers); SIGKILL after 5 s.
    async fn stop(mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = tokio::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(5), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

impl Drop for Nginx {
    /// On an early return: SIGTERM so the master takes its workers down (a SIGKILL, which
    /// `kill_on_drop` sends after this, would orphan them).
    fn drop(&mut self) {
        if let Some(pid) = self.child.as_ref().and_then(tokio::process::Child::id) {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_head_gives_the_status_and_lengths() {
        let text =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(parse_head(&text[..20]).unwrap(), None);
        let a = parse_head(text).unwrap().unwrap();
        assert_eq!(
            a,
            Answer {
                status: 200,
                head: text.len() - 5,
                body: 5,
                close: false
            }
        );
        let close =
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\ncontent-length: 0\r\n\r\n";
        let a = parse_head(close).unwrap().unwrap();
        assert_eq!((a.status, a.body, a.close), (503, 0, true));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
    }
}
