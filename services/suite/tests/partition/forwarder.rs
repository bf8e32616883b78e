//! A TCP forwarder whose listening socket lives inside the test's network namespace and whose
//! connections to the store are made from the root namespace: the services reach the store at
//! `<namespace address>:<port>` across the veth pair, so the namespace's nftables rules act on
//! every packet between them and the store.
//!
//! It can also add latency: a delay line in its userspace copy loop (each chunk read is
//! written `mean ± jitter` after it was read, in order). This kernel has neither `sch_netem`
//! nor NFQUEUE (`nft … queue` fails with "No such file or directory"), so latency cannot be
//! added to the packets themselves; packet loss still is, by nft in the namespace.

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
    time::Instant,
};

use super::netns::Namespace;

/// Binds a listener on `addr:0` inside network namespace `ns` (a thread of its own enters the
/// namespace and ends there: a socket keeps the namespace it was made in).
fn bind_in(ns: &str, addr: Ipv4Addr) -> std::net::TcpListener {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        // setns affects only this thread, which ends right after binding.
        rustix::thread::move_into_link_name_space(
            fd.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| format!("setns({path}): {e}"))?;
        let listener = std::net::TcpListener::bind((addr, 0)).map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        Ok::<_, String>(listener)
    })
    .join()
    .expect("the namespace thread")
    .unwrap_or_else(|e| panic!("could not listen inside namespace {ns}: {e}"))
}

/// The delay line's setting: mean and jitter in milliseconds (0: none).
#[derive(Default)]
struct Delay {
    mean_ms: AtomicU64,
    jitter_ms: AtomicU64,
    draws: AtomicU64,
}

impl Delay {
    /// The delay for the next chunk: uniform in mean ± jitter (splitmix64 of a counter).
    fn next(&self) -> Duration {
        let mean = self.mean_ms.load(Ordering::Relaxed);
        if mean == 0 {
            return Duration::ZERO;
        }
        let jitter = self.jitter_ms.load(Ordering::Relaxed);
        let mut z = self
            .draws
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let spread = z % (2 * jitter + 1);
        Duration::from_millis(mean - jitter.min(mean) + spread)
    }
}

/// The forwarder; stops accepting when dropped (open connections end with the runtime).
pub struct Forwarder {
    addr: SocketAddr,
    delay: Arc<Delay>,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards `<ns.addr>:<a free port>` in `ns` to `upstream` (reached from the root
    /// namespace).
    pub fn start(ns: &Namespace, upstream: SocketAddr) -> Self {
        let listener = TcpListener::from_std(bind_in(&ns.name, ns.addr)).expect("tokio listener");
        let addr = listener.local_addr().expect("listener address");
        let delay = Arc::new(Delay::default());
        let line = delay.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let line = line.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // Either direction failing (a reset) ends both.
                    tokio::select! {
                        _ = pipe(cr, sw, line.clone()) => {}
                        _ = pipe(sr, cw, line) => {}
                    }
                });
            }
        });
        Self { addr, delay, task }
    }

    /// Where the services connect: inside the namespace.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every chunk from now on delayed `mean ± jitter` in each direction (zero: none).
    pub fn set_delay(&self, mean: Duration, jitter: Duration) {
        self.delay
            .jitter_ms
            .store(jitter.as_millis() as u64, Ordering::Relaxed);
        self.delay
            .mean_ms
            .store(mean.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` through the delay line: a reader stamps each chunk with when it is
/// due (never before the previous one: TCP keeps order), a writer sends it then. Returns when
/// either side closes or fails.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<Delay>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut last_due = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let due = (Instant::now() + delay.next()).max(last_due);
                    last_due = due;
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    // The writer drains what the reader queued before the reader's end; a failed write ends
    // the pipe at once.
    tokio::pin!(reader, writer);
    let mut read_all = false;
    loop {
        tokio::select! {
            () = &mut reader, if !read_all => read_all = true,
            () = &mut writer => return,
        }
    }
}
