//! Fetching `image_url` against small HTTP servers on loopback only: refused addresses (by IP
//! literal, by host name, after a redirect), the allowlist, redirects, size and time limits,
//! the concurrency limit, and one and the same answer for every failure. Refused fetches are
//! shown to send nothing by the target server's connection count.
//!
//! Every URL here names a loopback address or `localhost` (answered from /etc/hosts), so that
//! even a broken check could only reach loopback; refusals of other ranges (private, link-local,
//! metadata, …) are unit tests over parsed addresses in `src/fetch`.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use ecoscan_common::client::request_as;
use ecoscan_ingest::{
    Config, Error,
    error::IMAGE_FETCH_FAILED,
    fetch::{ImageFetcher, MAX_REDIRECTS},
};
use ecoscan_proto::v1::SubmitRequest;
use support::PNG;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tonic::{Code, Status};

/// Loopback and its IPv6 twin: what the tests allow when they mean to reach their servers.
const ALLOW_LOOPBACK: &str = "127.0.0.1/32,::1";

/// What a test server answers.
#[derive(Clone)]
enum Reply {
    /// A complete response, as bytes.
    Raw(Vec<u8>),
    /// The PNG then zeros forever, chunked (no Content-Length).
    EndlessChunked,
    /// The PNG then zeros forever, delimited by closing the connection (no Content-Length).
    EndlessClose,
    /// Reads the request and never answers.
    StallHead,
    /// Sends the head and the PNG, then nothing more of the 1,000 bytes promised.
    StallBody,
    /// The PNG, then one byte every 50 ms, forever.
    Trickle,
}

fn response(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    let mut raw = head.into_bytes();
    raw.extend_from_slice(body);
    Reply::Raw(raw)
}

fn png() -> Reply {
    response("200 OK", &[("Content-Type", "image/png")], PNG)
}

fn redirect(location: &str) -> Reply {
    response("302 Found", &[("Location", location)], b"")
}

/// A PNG of exactly `len` bytes (the signature, then zeros).
fn png_of(len: usize) -> Vec<u8> {
    let mut body = PNG.to_vec();
    body.resize(len, 0);
    body
}

struct Server {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Connections accepted so far.
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// Serves on `ip` (a loopback address), port 0, answering each request by its path.
async fn serve(ip: &str, reply: impl Fn(&str) -> Reply + Send + Sync + 'static) -> Server {
    let ip: IpAddr = ip.parse().unwrap();
    assert!(ip.is_loopback(), "test servers listen on loopback only");
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let reply = Arc::new(reply);
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut sock = sock;
                if let Some(path) = read_request(&mut sock).await {
                    answer(sock, reply(&path)).await;
                }
            });
        }
    });
    Server { addr, hits }
}

/// The request's path, once its head has been read.
async fn read_request(sock: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 16 * 1024 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    head.split_whitespace().nth(1).map(str::to_owned)
}

async fn answer(mut sock: TcpStream, reply: Reply) {
    let zeros = vec![0u8; 16 * 1024];
    match reply {
        Reply::Raw(raw) => {
            let _ = sock.write_all(&raw).await;
            let _ = sock.shutdown().await;
        }
        Reply::EndlessChunked => {
            let head =
                "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n";
            let mut out = head.as_bytes().to_vec();
            out.extend_from_slice(format!("{:x}\r\n", PNG.len()).as_bytes());
            out.extend_from_slice(PNG);
            out.extend_from_slice(b"\r\n");
            if sock.write_all(&out).await.is_err() {
                return;
            }
            let mut chunk = format!("{:x}\r\n", zeros.len()).into_bytes();
            chunk.extend_from_slice(&zeros);
            chunk.extend_from_slice(b"\r\n");
            while sock.write_all(&chunk).await.is_ok() {}
        }
        Reply::EndlessClose => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n";
            if sock.write_all(head.as_bytes()).await.is_err() || sock.write_all(PNG).await.is_err()
            {
                return;
            }
            while sock.write_all(&zeros).await.is_ok() {}
        }
        Reply::StallHead => tokio::time::sleep(Duration::from_secs(60)).await,
        Reply::StallBody => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n";
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(PNG).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Reply::Trickle => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n";
            if sock.write_all(head.as_bytes()).await.is_err() || sock.write_all(PNG).await.is_err()
            {
                return;
            }
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if sock.write_all(b"\0").await.is_err() {
                    return;
                }
            }
        }
    }
}

/// A fetcher allowing `allow`, with the default limits unless `tweak` changes them.
fn fetcher(allow: &str, tweak: impl FnOnce(&mut Config)) -> ImageFetcher {
    // `TEST_LOG=1` shows each failure's logged reason.
    ecoscan_common::telemetry::init_for_tests();
    let mut config = Config {
        fetch_allow: allow.parse().unwrap(),
        ..Config::default()
    };
    tweak(&mut config);
    ImageFetcher::new(&config)
}

/// The one answer every failed fetch gets: `INVALID_ARGUMENT` with the one message, and
/// nothing about the target in it.
#[track_caller]
fn assert_generic(result: Result<Bytes, Error>, case: &str) {
    let e = match result {
        Err(e) => e,
        Ok(bytes) => panic!("{case}: fetched {} bytes, expected a failure", bytes.len()),
    };
    assert!(matches!(e, Error::ImageFetch), "{case}: {e:?}");
    let status = Status::from(e);
    assert_eq!(status.code(), Code::InvalidArgument, "{case}");
    assert_eq!(status.message(), IMAGE_FETCH_FAILED, "{case}");
    assert!(
        status.metadata().is_empty(),
        "{case}: {:?}",
        status.metadata()
    );
}

#[tokio::test]
async fn a_loopback_server_is_refused_without_the_allowlist_and_fetched_with_it() {
    let server = serve("127.0.0.1", |_| png()).await;
    let by_name = format!("http://localhost:{}/a.png", server.addr.port());

    let strict = fetcher("", |_| {});
    assert_generic(strict.fetch(&server.url("/a.png")).await, "IP literal");
    assert_generic(strict.fetch(&by_name).await, "localhost, resolved");
    let v4_mapped = format!("http://[::ffff:127.0.0.1]:{}/a.png", server.addr.port());
    assert_generic(strict.fetch(&v4_mapped).await, "IPv4-mapped");
    assert_eq!(server.hits(), 0, "a refused fetch never connects");

    let allowed = fetcher(ALLOW_LOOPBACK, |_| {});
    assert_eq!(allowed.fetch(&server.url("/a.png")).await.unwrap(), PNG);
    assert_eq!(allowed.fetch(&by_name).await.unwrap(), PNG);
    assert_eq!(server.hits(), 2);
}

#[tokio::test]
async fn the_allowlist_opens_only_what_it_names() {
    // 127.0.0.2 is loopback too, but outside 127.0.0.1/32.
    let other = serve("127.0.0.2", |_| png()).await;
    let v6 = serve("::1", |_| png()).await;
    let only_v4 = fetcher("127.0.0.1/32", |_| {});
    assert_generic(only_v4.fetch(&other.url("/a.png")).await, "127.0.0.2");
    assert_generic(only_v4.fetch(&v6.url("/a.png")).await, "::1");
    assert_eq!((other.hits(), v6.hits()), (0, 0));

    let wider = fetcher("127.0.0.0/8,::1/128", |_| {});
    assert_eq!(wider.fetch(&other.url("/a.png")).await.unwrap(), PNG);
    assert_eq!(wider.fetch(&v6.url("/a.png")).await.unwrap(), PNG);
}

#[tokio::test]
async fn redirects_are_followed_and_every_hop_is_checked() {
    // Where the redirects point: loopback, but not allowed.
    let inside = serve("127.0.0.2", |_| png()).await;
    let inside_url = inside.url("/a.png");
    let inside_by_v6 = serve("::1", |_| png()).await;
    let inside_v6_url = inside_by_v6.url("/a.png");
    let server = serve("127.0.0.1", move |path| match path {
        "/a.png" => png(),
        "/one" => redirect("/two"),
        "/two" => redirect("three"),
        "/three" => redirect("/a.png"),
        "/four" => redirect("/one"),
        "/loop" => redirect("/loop"),
        "/inside" => redirect(&inside_url),
        "/inside-v6" => redirect(&inside_v6_url),
        "/mapped" => redirect("http://[::ffff:127.0.0.2]/a.png"),
        "/file" => redirect("file:///etc/passwd"),
        "/userinfo" => redirect("http://user:secret@127.0.0.1/a.png"),
        "/no-location" => response("302 Found", &[], b""),
        _ => response("404 Not Found", &[], b"no"),
    })
    .await;
    let fetch = fetcher("127.0.0.1/32", |_| {});

    // Three redirects (relative ones too) are followed...
    assert_eq!(fetch.fetch(&server.url("/one")).await.unwrap(), PNG);
    assert_eq!(server.hits(), 1 + MAX_REDIRECTS);
    // ...a fourth is not.
    let before = server.hits();
    assert_generic(fetch.fetch(&server.url("/four")).await, "four redirects");
    assert_eq!(
        server.hits() - before,
        1 + MAX_REDIRECTS,
        "stops at the limit"
    );
    let before = server.hits();
    assert_generic(fetch.fetch(&server.url("/loop")).await, "a redirect loop");
    assert_eq!(
        server.hits() - before,
        1 + MAX_REDIRECTS,
        "stops at the limit"
    );

    for path in [
        "/inside",
        "/inside-v6",
        "/mapped",
        "/file",
        "/userinfo",
        "/no-location",
    ] {
        assert_generic(fetch.fetch(&server.url(path)).await, path);
    }
    assert_eq!(
        inside.hits(),
        0,
        "a redirect to a refused address never connects"
    );
    assert_eq!(inside_by_v6.hits(), 0);
}

#[tokio::test]
async fn oversized_bodies_are_refused_with_or_without_a_content_length() {
    let max = 4096;
    let server = serve("127.0.0.1", move |path| match path {
        "/exact" => response("200 OK", &[], &png_of(max)),
        "/over" => response("200 OK", &[], &png_of(max + 1)),
        "/declared" => Reply::Raw(
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 1u64 << 40)
                .into_bytes()
                .into_iter()
                .chain(PNG.iter().copied())
                .collect(),
        ),
        "/chunked" => Reply::EndlessChunked,
        "/close" => Reply::EndlessClose,
        // Declares 16 bytes and sends more: only the 16 declared are read.
        "/understated" => Reply::Raw(
            b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\nConnection: close\r\n\r\n"
                .iter()
                .copied()
                .chain(png_of(max * 4))
                .collect(),
        ),
        _ => response("404 Not Found", &[], b""),
    })
    .await;
    let fetch = fetcher(ALLOW_LOOPBACK, |c| c.max_image_bytes = max);

    assert_eq!(fetch.fetch(&server.url("/exact")).await.unwrap().len(), max);
    assert_generic(fetch.fetch(&server.url("/over")).await, "one byte over");
    assert_generic(
        fetch.fetch(&server.url("/declared")).await,
        "1 TiB declared",
    );
    let started = Instant::now();
    assert_generic(
        fetch.fetch(&server.url("/chunked")).await,
        "endless, chunked",
    );
    assert_generic(
        fetch.fetch(&server.url("/close")).await,
        "endless, no length",
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cut off at the limit, not at the deadline: {:?}",
        started.elapsed()
    );
    assert_eq!(
        fetch
            .fetch(&server.url("/understated"))
            .await
            .unwrap()
            .len(),
        16
    );
}

#[tokio::test]
async fn a_slow_server_hits_the_deadline() {
    let deadline = Duration::from_millis(400);
    let server = serve("127.0.0.1", |path| match path {
        "/head" => Reply::StallHead,
        "/body" => Reply::StallBody,
        _ => Reply::Trickle,
    })
    .await;
    let fetch = fetcher(ALLOW_LOOPBACK, |c| {
        c.fetch_timeout = deadline;
        c.max_image_bytes = 1024 * 1024;
    });
    for path in ["/head", "/body", "/trickle"] {
        let started = Instant::now();
        assert_generic(fetch.fetch(&server.url(path)).await, path);
        let took = started.elapsed();
        assert!(
            took >= deadline && took < deadline + Duration::from_secs(3),
            "{path}: {took:?}"
        );
    }
}

#[tokio::test]
async fn every_failure_gives_the_same_answer() {
    // A port nothing listens on: bound, then closed.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let server = serve("127.0.0.1", |path| match path {
        "/a.png" => png(),
        "/404" => response("404 Not Found", &[], b"not here"),
        "/500" => response("500 Internal Server Error", &[], b"boom"),
        "/html" => response(
            "200 OK",
            &[("Content-Type", "image/png")],
            b"<!doctype html><title>login</title>",
        ),
        "/empty" => response("200 OK", &[("Content-Type", "image/png")], b""),
        "/short" => response("200 OK", &[], &PNG[..3]),
        "/garbage" => Reply::Raw(b"SSH-2.0-OpenSSH_9.6\r\n".to_vec()),
        "/big" => response("200 OK", &[], &png_of(2048)),
        "/slow" => Reply::StallHead,
        _ => redirect("/loop"),
    })
    .await;
    let fetch = fetcher("127.0.0.1/32", |c| {
        c.max_image_bytes = 1024;
        c.fetch_timeout = Duration::from_millis(300);
    });
    let strict = fetcher("", |_| {});
    let port = server.addr.port();

    let mut cases = vec![
        (
            "a closed port".to_owned(),
            fetch
                .fetch(&format!("http://127.0.0.1:{closed}/a.png"))
                .await,
        ),
        (
            "a refused address".to_owned(),
            strict.fetch(&server.url("/a.png")).await,
        ),
        (
            "a refused name".to_owned(),
            strict
                .fetch(&format!("http://localhost:{port}/a.png"))
                .await,
        ),
        ("not a URL".to_owned(), fetch.fetch("not a url").await),
        (
            "another scheme".to_owned(),
            fetch.fetch("ftp://127.0.0.1/a.png").await,
        ),
        (
            "user info".to_owned(),
            fetch
                .fetch(&format!("http://u:p@127.0.0.1:{port}/a.png"))
                .await,
        ),
        (
            "a too long URL".to_owned(),
            fetch
                .fetch(&server.url(&format!("/{}", "a".repeat(3000))))
                .await,
        ),
    ];
    for path in [
        "/404", "/500", "/html", "/empty", "/short", "/garbage", "/big", "/slow", "/loop",
    ] {
        cases.push((path.to_owned(), fetch.fetch(&server.url(path)).await));
    }
    for (case, result) in cases {
        assert_generic(result, &case);
    }
    // And a success through the same fetcher, so the failures above are the server's doing.
    assert_eq!(fetch.fetch(&server.url("/a.png")).await.unwrap(), PNG);
}

#[tokio::test]
async fn past_the_concurrency_limit_a_fetch_is_refused_at_once() {
    let server = serve("127.0.0.1", |path| match path {
        "/slow" => Reply::StallHead,
        _ => png(),
    })
    .await;
    let fetch = fetcher(ALLOW_LOOPBACK, |c| {
        c.fetch_concurrency = 1;
        c.fetch_timeout = Duration::from_secs(30);
    });
    let busy = {
        let fetch = fetch.clone();
        let url = server.url("/slow");
        tokio::spawn(async move { fetch.fetch(&url).await })
    };
    while server.hits() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let started = Instant::now();
    let refused = fetch.fetch(&server.url("/a.png")).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused at once"
    );
    assert!(matches!(refused, Error::FetchBusy { .. }), "{refused:?}");
    let status = Status::from(refused);
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
    assert_eq!(server.hits(), 1, "the refused fetch did not connect");

    // The slot comes back when the fetch holding it ends.
    busy.abort();
    let _ = busy.await;
    assert_eq!(fetch.fetch(&server.url("/a.png")).await.unwrap(), PNG);
}

#[tokio::test]
async fn submit_by_url_fetches_an_allowed_image_and_refuses_the_rest_alike() {
    let server = serve("127.0.0.1", |path| match path {
        "/a.png" => png(),
        _ => response("404 Not Found", &[], b""),
    })
    .await;
    let inside = serve("127.0.0.2", |_| png()).await;
    let env = support::start(None, |c| c.fetch_allow = "127.0.0.1/32".parse().unwrap()).await;
    let submit = |url: String| {
        let mut ingest = env.ingest.clone();
        async move {
            ingest
                .submit(request_as(
                    SubmitRequest {
                        image_url: url,
                        ..Default::default()
                    },
                    Duration::from_secs(20),
                    "u1",
                ))
                .await
        }
    };

    let job = submit(server.url("/a.png")).await.unwrap().into_inner();
    let events = support::watch_all(&env, &job.job_id).await;
    assert_eq!(
        events.last().unwrap().status,
        ecoscan_proto::v1::EventStatus::Completed as i32,
        "the fetched image went through the pipeline: {events:?}"
    );

    for url in [inside.url("/a.png"), server.url("/missing")] {
        let status = submit(url.clone()).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{url}");
        assert_eq!(status.message(), IMAGE_FETCH_FAILED, "{url}");
    }
    assert_eq!(inside.hits(), 0);
}
