//! A Redis that stops answering without closing its connections — a proxy that stopped
//! forwarding, a paused server — fails commands within the response timeout instead of hanging
//! them, the stalled connection is replaced, and a stream reader resumes from its last id
//! without losing an event.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use ecoscan_redis::{
    Conn, Redis, Settings,
    redis::{self, RedisResult, streams::StreamReadReply},
    testing::PrivateRedis,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpListener, TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::watch,
    task::JoinHandle,
    time::Instant,
};

/// The response timeout of these tests' connections: short, so a stall is noticed quickly.
const TIMEOUT: Duration = Duration::from_secs(1);
/// The block of the reader's `XREAD`.
const BLOCK: Duration = Duration::from_millis(500);
/// Scheduling slack on top of a timeout.
const SLACK: Duration = Duration::from_secs(2);
const STREAM: &str = "t:stall:events";

/// A TCP proxy on a loopback port of its own in front of `upstream`. [`Self::freeze`] makes
/// every connection it has stop forwarding bytes, both ways, while keeping them open (what a
/// stalled peer looks like to a client); connections accepted afterwards are forwarded.
struct FreezingProxy {
    addr: SocketAddr,
    /// Bumped by `freeze`; each connection stops forwarding at the first change it sees, and
    /// closes once the proxy is gone (the sender dropped).
    freezes: watch::Sender<u64>,
    accepted: Arc<AtomicUsize>,
    accept_loop: JoinHandle<()>,
}

impl FreezingProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let (freezes, watching) = watch::channel(0);
        let accepted = Arc::new(AtomicUsize::new(0));
        let accept_loop = tokio::spawn({
            let accepted = accepted.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    // Only freezes from now on concern this connection.
                    let mut frozen = watching.clone();
                    frozen.mark_unchanged();
                    let (client_rx, client_tx) = client.into_split();
                    let (server_rx, server_tx) = server.into_split();
                    tokio::spawn(forward(client_rx, server_tx, frozen.clone()));
                    tokio::spawn(forward(server_rx, client_tx, frozen));
                }
            }
        });
        Self {
            addr,
            freezes,
            accepted,
            accept_loop,
        }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Existing connections stop forwarding; new ones still work.
    fn freeze(&self) {
        self.freezes.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

/// Copies `from` to `to` until the connection ends or is frozen; frozen, holds both open and
/// forwards nothing until the proxy is gone.
async fn forward(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut frozen: watch::Receiver<u64>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        tokio::select! {
            biased;
            _ = frozen.changed() => break,
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
    while frozen.changed().await.is_ok() {}
    drop((from, to));
}

/// Appends an event; returns its id.
async fn append(conn: &mut impl redis::aio::ConnectionLike, value: &str) -> RedisResult<String> {
    redis::cmd("XADD")
        .arg(STREAM)
        .arg("*")
        .arg("v")
        .arg(value)
        .query_async(conn)
        .await
}

/// One blocking read of the events after `last`: their ids and values.
async fn read_after(conn: &mut Conn, last: &str) -> RedisResult<Vec<(String, String)>> {
    let reply: Option<StreamReadReply> = redis::cmd("XREAD")
        .arg("COUNT")
        .arg(100)
        .arg("BLOCK")
        .arg(BLOCK.as_millis() as u64)
        .arg("STREAMS")
        .arg(STREAM)
        .arg(last)
        .query_async(conn)
        .await?;
    Ok(reply
        .into_iter()
        .flat_map(|r| r.keys)
        .flat_map(|k| k.ids)
        .map(|e| {
            let v = e.get::<String>("v").unwrap_or_default();
            (e.id, v)
        })
        .collect())
}

/// A stream reader's loop: reads after `last`, moves `last` past what it got, and on an error
/// tries again from the same id, until it has `want` events or `within` has passed. Every
/// read, failed or not, must return within its block plus the response timeout.
async fn read_events(
    conn: &mut Conn,
    last: &mut String,
    want: usize,
    within: Duration,
) -> Vec<(String, String)> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < want {
        assert!(
            Instant::now() < deadline,
            "the reader got {got:?} of {want} events within {within:?}"
        );
        let started = Instant::now();
        let read = read_after(conn, last).await;
        assert!(
            started.elapsed() < BLOCK + TIMEOUT + SLACK,
            "a read took {:?}",
            started.elapsed()
        );
        match read {
            Ok(events) => {
                if let Some((id, _)) = events.last() {
                    last.clone_from(id);
                }
                got.extend(events);
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    got
}

/// Sends `PING` until it is answered: each try must end within the response timeout.
async fn ping_until_answered(conn: &mut Conn, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let started = Instant::now();
        let pong = redis::cmd("PING").query_async::<String>(conn).await;
        assert!(
            started.elapsed() < TIMEOUT + SLACK,
            "a PING took {:?}",
            started.elapsed()
        );
        if pong.is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no PING answered within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_read_on_a_frozen_connection_fails_in_time_and_the_reader_resumes_on_a_new_one() {
    // Arrange: the service reaches Redis through the proxy; the test writes to it directly.
    let server = PrivateRedis::start().await;
    let proxy = FreezingProxy::start(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    let settings = Settings::single(proxy.url()).with_response_timeout(TIMEOUT);
    let redis = Redis::connect(&settings, "test-freeze").await.unwrap();
    let mut reader = redis.blocking(BLOCK).await.unwrap();
    let mut writer = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let first = append(&mut writer, "first").await.unwrap();
    let mut last = "0".to_owned();
    let got = read_events(&mut reader, &mut last, 1, Duration::from_secs(5)).await;
    assert_eq!(got, vec![(first, "first".to_owned())]);
    let connections_before = proxy.accepted();

    // Act: every open connection stalls; events keep coming.
    proxy.freeze();
    let during = append(&mut writer, "during").await.unwrap();
    let started = Instant::now();
    let stalled = read_after(&mut reader, &last).await;
    let waited = started.elapsed();
    let after = append(&mut writer, "after").await.unwrap();
    let resumed = read_events(&mut reader, &mut last, 2, Duration::from_secs(20)).await;

    // Assert: the stalled read failed with a timeout after its block plus the response
    // timeout, and the reader then got, on a new connection, every event after its last id.
    let err = stalled.expect_err("a read on a frozen connection cannot succeed");
    assert!(err.is_timeout(), "not a timeout: {err}");
    assert!(
        waited >= BLOCK + TIMEOUT - Duration::from_millis(100) && waited < BLOCK + TIMEOUT + SLACK,
        "the stalled read failed after {waited:?}"
    );
    assert_eq!(
        resumed,
        vec![(during, "during".to_owned()), (after, "after".to_owned())]
    );
    assert!(reader.replacements() >= 1, "the frozen connection was kept");
    assert!(
        proxy.accepted() > connections_before,
        "no new connection was opened"
    );
    // The shared connection stalled as well and is replaced the same way.
    ping_until_answered(&mut redis.conn(), Duration::from_secs(20)).await;
}

#[tokio::test]
async fn a_paused_server_fails_commands_in_time_and_serves_them_again_once_resumed() {
    // Arrange
    let server = PrivateRedis::start().await;
    let settings = server.settings().with_response_timeout(TIMEOUT);
    let redis = Redis::connect(&settings, "test-pause").await.unwrap();
    let mut reader = redis.blocking(BLOCK).await.unwrap();
    let first = append(&mut redis.conn(), "first").await.unwrap();
    let mut last = "0".to_owned();
    let got = read_events(&mut reader, &mut last, 1, Duration::from_secs(5)).await;
    assert_eq!(got, vec![(first, "first".to_owned())]);

    // Act: SIGSTOP — the kernel keeps the connections open, nobody answers.
    server.pause();
    let started = Instant::now();
    let stalled_read = read_after(&mut reader, &last).await;
    let read_waited = started.elapsed();
    let started = Instant::now();
    let stalled_append = append(&mut redis.conn(), "lost?").await;
    let append_waited = started.elapsed();
    server.resume();

    // Assert: both failed with a timeout instead of hanging…
    let err = stalled_read.expect_err("a paused server cannot answer");
    assert!(err.is_timeout(), "not a timeout: {err}");
    assert!(
        read_waited < BLOCK + TIMEOUT + SLACK,
        "the read failed after {read_waited:?}"
    );
    let err = stalled_append.expect_err("a paused server cannot answer");
    assert!(err.is_timeout(), "not a timeout: {err}");
    assert!(
        append_waited < TIMEOUT + SLACK,
        "the append failed after {append_waited:?}"
    );
    // …and once the server runs again, commands are served and the reader goes on from its
    // last id. The append that timed out may still have happened (its outcome is unknown).
    ping_until_answered(&mut redis.conn(), Duration::from_secs(30)).await;
    let next = append(&mut redis.conn(), "next").await.unwrap();
    let mut resumed = Vec::new();
    while resumed.last().map(|(id, _): &(String, String)| id) != Some(&next) {
        resumed.extend(read_events(&mut reader, &mut last, 1, Duration::from_secs(30)).await);
    }
    let values: Vec<&str> = resumed.iter().map(|(_, v)| v.as_str()).collect();
    assert!(
        values == ["next"] || values == ["lost?", "next"],
        "after the pause the reader got {values:?}"
    );
}

/// How each client connection of a [`DiscardingProxy`] ended, once frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// A FIN: a graceful close, after which the kernel still delivers what was unsent.
    Closed,
    /// A reset: the connection aborted, its unsent bytes discarded.
    Reset,
}

/// Like [`FreezingProxy`], but a frozen connection keeps reading (and dropping) what the client
/// sends, so that how the client ends it — a close or a reset — shows.
async fn discarding_proxy(
    upstream: SocketAddr,
) -> (
    SocketAddr,
    watch::Sender<bool>,
    Arc<std::sync::Mutex<Vec<End>>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (freeze, frozen) = watch::channel(false);
    let ends = Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = ends.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let mut frozen = frozen.clone();
            let ends = recorded.clone();
            tokio::spawn(async move {
                let (mut a, mut b) = (vec![0_u8; 16 * 1024], vec![0_u8; 16 * 1024]);
                loop {
                    if *frozen.borrow() {
                        break;
                    }
                    tokio::select! {
                        _ = frozen.changed() => {}
                        r = client.read(&mut a) => match r {
                            Ok(0) | Err(_) => return,
                            Ok(n) => { let _ = server.write_all(&a[..n]).await; }
                        },
                        r = server.read(&mut b) => match r {
                            Ok(0) | Err(_) => return,
                            Ok(n) => { let _ = client.write_all(&b[..n]).await; }
                        },
                    }
                }
                loop {
                    match client.read(&mut a).await {
                        Ok(0) => break ends.lock().unwrap().push(End::Closed),
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                            break ends.lock().unwrap().push(End::Reset);
                        }
                        Err(_) => break,
                    }
                }
            });
        }
    });
    (addr, freeze, ends)
}

/// A command its caller gave up on must not reach Redis later (issue 52): the connection it
/// stalled on is aborted with a reset, which discards what the kernel had not sent, never
/// closed gracefully, which would leave the kernel delivering it once the path heals.
#[tokio::test]
async fn a_connection_replaced_after_a_timeout_is_reset_not_closed() {
    let server = PrivateRedis::start().await;
    let (addr, freeze, ends) =
        discarding_proxy(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    let settings = Settings::single(format!("redis://{addr}")).with_response_timeout(TIMEOUT);
    let redis = Redis::connect(&settings, "test-abort").await.unwrap();
    let mut conn = redis.conn();
    append(&mut conn, "first").await.unwrap();

    freeze.send(true).unwrap();
    let err = append(&mut conn, "stalled")
        .await
        .expect_err("a frozen connection cannot answer");
    assert!(err.is_timeout(), "not a timeout: {err}");
    // The next command goes out on a new connection (the proxy forwards new ones as frozen
    // too, so it fails as well); the stalled one is dropped meanwhile.
    let deadline = Instant::now() + Duration::from_secs(20);
    while ends.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the stalled connection was not ended within 20 s"
        );
        let _ = append(&mut conn, "again").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((conn, redis));
    let ends = ends.lock().unwrap().clone();
    assert!(
        ends.iter().all(|e| *e == End::Reset),
        "every connection given up on was reset, none closed: {ends:?}"
    );
}
