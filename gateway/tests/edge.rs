//! The public edge over real sockets: who may call (JWT bearer tokens, HS256 and a JWKS on a
//! loopback server), what each caller may do (admin), and the abuse limits (rates, SSE caps,
//! slow clients).

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use ecoscan_gateway::{AuthConfig, Config, Limits, TrustHeader};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::*;
use tokio::io::AsyncWriteExt as _;

const SECRET: &str = "a-test-secret-that-is-long-enough-0123456789";
const ISSUER: &str = "https://id.example.test";
const AUDIENCE: &str = "ecoscan-edge-test";

/// A P-256 key made for this test only (its public half is [`JWK_X`], [`JWK_Y`]).
const ES256_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgjT8+O46oD24yrucX
B7uG32xr2g7Fa+MdMSKUV7xJiq+hRANCAAQg5aHsEVfMcXPWG/FVtkW+ZyMoS2DT
AFneaeKIfToNr7YSp9OtzUWgBK2KQ++wQjaNM4+FRoUU52uQ0zSnp15F
-----END PRIVATE KEY-----
";
const JWK_X: &str = "IOWh7BFXzHFz1hvxVbZFvmcjKEtg0wBZ3mniiH06Da8";
const JWK_Y: &str = "thKn063NRaAErYpD77BCNo0zj4VGhRTna5DTNKenXkU";

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Claims valid for an hour for `sub`, with `extra` merged in.
fn claims(sub: &str, extra: Value) -> Value {
    let mut c = json!({
        "sub": sub, "iss": ISSUER, "aud": AUDIENCE, "iat": now(), "exp": now() + 3600,
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn hs256(claims: &Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

fn es256(claims: &Value, kid: &str) -> String {
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(
        &header,
        claims,
        &EncodingKey::from_ec_pem(ES256_KEY.as_bytes()).unwrap(),
    )
    .unwrap()
}

/// A gateway that believes tokens only (as on a public address).
fn token_auth(c: Config) -> Config {
    Config {
        auth: AuthConfig {
            hs256_secret: Some(SECRET.into()),
            issuer: Some(ISSUER.into()),
            audience: Some(AUDIENCE.into()),
            trust_header: TrustHeader::Off,
            ..AuthConfig::default()
        },
        ..c
    }
}

async fn get(env: &Env, path: &str, token: Option<&str>) -> reqwest::Response {
    let mut req = env.http.get(env.url(path));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap()
}

async fn json_of(res: reqwest::Response) -> Value {
    res.json().await.unwrap()
}

#[tokio::test]
async fn a_valid_token_names_the_caller_and_anything_else_is_401() {
    let env = start_with(token_auth).await;

    // No token: 401 that says how to authenticate.
    let res = get(&env, "/api/v1/characters/me", None).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        res.headers()["www-authenticate"],
        r#"Bearer realm="ecoscan""#
    );
    let body = json_of(res).await;
    assert_eq!(body["code"], "UNAUTHENTICATED");
    assert!(
        body["message"].as_str().unwrap().contains("Bearer"),
        "{body}"
    );

    // The header is not believed here, with or without a token.
    let res = env
        .http
        .get(env.url("/api/v1/characters/me"))
        .header("x-user-id", "mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let alice = hs256(&claims("alice", json!({})), SECRET);
    let res = env
        .http
        .get(env.url("/api/v1/characters/me"))
        .bearer_auth(&alice)
        .header("x-user-id", "mallory")
        .header("x-user-roles", "admin")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(env.calls.user_of("list_owned").as_deref(), Some("alice"));

    // Every way a token can be wrong is a 401 with error="invalid_token", and none reaches a
    // backend.
    let before = env.calls.user_of("list_owned");
    let expired = claims("bob", json!({"exp": now() - 3600, "iat": now() - 7200}));
    let not_yet = claims("bob", json!({"nbf": now() + 3600}));
    let other_aud = claims("bob", json!({"aud": "someone-else"}));
    let other_iss = claims("bob", json!({"iss": "https://evil.example.test"}));
    let no_exp = json!({"sub": "bob", "iss": ISSUER, "aud": AUDIENCE});
    let bad_sub = claims("bob smith/../", json!({}));
    let unsigned = {
        // alg "none" with the signature stripped.
        let t = hs256(&claims("bob", json!({})), SECRET);
        let mut parts: Vec<&str> = t.split('.').collect();
        let header = base64_url(br#"{"alg":"none","typ":"JWT"}"#);
        parts[0] = &header;
        format!("{}.{}.", parts[0], parts[1])
    };
    for (what, token) in [
        ("expired", hs256(&expired, SECRET)),
        ("not yet valid", hs256(&not_yet, SECRET)),
        ("other audience", hs256(&other_aud, SECRET)),
        ("other issuer", hs256(&other_iss, SECRET)),
        ("no exp", hs256(&no_exp, SECRET)),
        ("unusable sub", hs256(&bad_sub, SECRET)),
        (
            "other secret",
            hs256(
                &claims("bob", json!({})),
                "another-secret-that-is-long-enough-000",
            ),
        ),
        ("unsigned", unsigned),
        (
            "ES256 without a JWKS",
            es256(&claims("bob", json!({})), "k1"),
        ),
        ("garbage", "not.a.token".to_owned()),
    ] {
        let res = get(&env, "/api/v1/characters/me", Some(&token)).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{what}");
        assert_eq!(
            res.headers()["www-authenticate"],
            r#"Bearer realm="ecoscan", error="invalid_token""#,
            "{what}"
        );
        let body = json_of(res).await;
        assert_eq!(body["code"], "UNAUTHENTICATED", "{what}: {body}");
    }
    assert_eq!(env.calls.user_of("list_owned"), before);

    // A token a little past `exp`, within the allowed skew, still works.
    let skewed = claims("carol", json!({"exp": now() - 5}));
    let res = get(&env, "/api/v1/characters/me", Some(&hs256(&skewed, SECRET))).await;
    assert_eq!(res.status(), StatusCode::OK);
}

fn base64_url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[tokio::test]
async fn usage_needs_the_admin_claim() {
    let env = start_with(token_auth).await;
    let path = "/api/v1/analytics/usage?since=2026-01-01T00:00:00Z";
    let user = hs256(&claims("alice", json!({})), SECRET);
    let res = get(&env, path, Some(&user)).await;
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    assert!(res.headers().get("www-authenticate").is_none());
    assert_eq!(json_of(res).await["code"], "PERMISSION_DENIED");
    assert!(env.calls.last_usage.lock().unwrap().is_none());

    for admin in [
        json!({"roles": ["reader", "admin"]}),
        json!({"roles": "admin"}),
        json!({"roles": true}),
    ] {
        let token = hs256(&claims("root", admin.clone()), SECRET);
        let res = get(&env, path, Some(&token)).await;
        assert_eq!(res.status(), StatusCode::OK, "{admin}");
    }
    let res = get(
        &env,
        path,
        Some(&hs256(
            &claims("alice", json!({"roles": ["reader"]})),
            SECRET,
        )),
    )
    .await;
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn sse_routes_take_a_stream_bound_ticket_or_the_cookie_and_never_a_token_in_the_url() {
    let env = start_with(token_auth).await;
    let dave = hs256(&claims("dave", json!({})), SECRET);

    // A ticket, asked for with the token in the header, opens one stream as its caller.
    let res = env
        .http
        .post(env.url("/api/v1/sse-tickets"))
        .bearer_auth(&dave)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = json_of(res).await;
    assert_eq!(body["expires_in"], 60);
    let ticket = body["ticket"].as_str().unwrap().to_owned();
    let stream_url = env.url(&format!("/api/v1/notifications/stream?ticket={ticket}"));
    let res = env.http.get(&stream_url).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    assert_eq!(env.calls.user_of("subscribe").as_deref(), Some("dave"));
    // Bound to that stream: the EventSource's own reconnect (the same URL) is accepted, as
    // the same caller; another stream is refused, with a message saying what to do.
    let res = env.http.get(&stream_url).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    assert_eq!(env.calls.user_of("subscribe").as_deref(), Some("dave"));
    let other = env.url(&format!("/api/v1/scan/{DONE_JOB}/events?ticket={ticket}"));
    let res = env.http.get(&other).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let message = json_of(res).await["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("another stream") && message.contains("/api/v1/sse-tickets"),
        "{message}"
    );
    // Bound at issue with `?stream=`: good for that stream only, from the first use.
    let res = env
        .http
        .post(env.url("/api/v1/sse-tickets?stream=/api/v1/notifications/stream"))
        .bearer_auth(&dave)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = json_of(res).await;
    assert_eq!(body["stream"], "/api/v1/notifications/stream");
    let bound = body["ticket"].as_str().unwrap().to_owned();
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events?ticket={bound}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let res = env
        .http
        .post(env.url("/api/v1/sse-tickets?stream=/api/v1/characters/me"))
        .bearer_auth(&dave)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // A ticket is not a bearer token, and no ticket comes without one.
    let res = get(&env, "/api/v1/characters/me", Some(&ticket)).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let res = env
        .http
        .post(env.url("/api/v1/sse-tickets"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);

    let erin = hs256(&claims("erin", json!({})), SECRET);
    let res = env
        .http
        .get(env.url("/api/v1/notifications/stream"))
        .header("cookie", format!("theme=dark; ecoscan_token={erin}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    assert_eq!(env.calls.user_of("subscribe").as_deref(), Some("erin"));

    // A token in the URL is refused everywhere, the SSE routes included: URLs end up in proxy
    // logs and browser histories.
    for path in [
        format!("/api/v1/characters/me?access_token={dave}"),
        format!("/api/v1/notifications/stream?access_token={dave}"),
    ] {
        let res = get(&env, &path, None).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{path}");
        let message = json_of(res).await["message"].as_str().unwrap().to_owned();
        assert!(message.contains("sse-tickets"), "{message}");
    }
}

/// A JWKS endpoint on loopback that counts its fetches.
async fn jwks_server(fetches: Arc<AtomicUsize>) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/jwks.json",
        axum::routing::get(move || {
            let fetches = fetches.clone();
            async move {
                fetches.fetch_add(1, Ordering::SeqCst);
                axum::Json(json!({"keys": [{
                    "kty": "EC", "crv": "P-256", "kid": "k1", "use": "sig", "alg": "ES256",
                    "x": JWK_X, "y": JWK_Y,
                }]}))
            }
        }),
    );
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (format!("http://{addr}/jwks.json"), task)
}

#[tokio::test]
async fn jwks_tokens_are_verified_and_unknown_keys_refetch_at_a_bounded_rate() {
    let fetches = Arc::new(AtomicUsize::new(0));
    let (url, _server) = jwks_server(fetches.clone()).await;
    let env = start_with(|c| Config {
        auth: AuthConfig {
            jwks_url: Some(url),
            issuer: Some(ISSUER.into()),
            audience: Some(AUDIENCE.into()),
            trust_header: TrustHeader::Off,
            ..AuthConfig::default()
        },
        ..c
    })
    .await;

    let token = es256(&claims("frank", json!({})), "k1");
    for _ in 0..3 {
        let res = get(&env, "/api/v1/characters/me", Some(&token)).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(env.calls.user_of("list_owned").as_deref(), Some("frank"));
    // Cached: one fetch for three requests.
    assert_eq!(fetches.load(Ordering::SeqCst), 1);

    // Unknown `kid`s may make the gateway look again, but not on every request.
    for kid in ["k2", "k3", "k4", "k5"] {
        let res = get(
            &env,
            "/api/v1/characters/me",
            Some(&es256(&claims("frank", json!({})), kid)),
        )
        .await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{kid}");
    }
    assert_eq!(fetches.load(Ordering::SeqCst), 1);

    // An HS256 token is not accepted by a gateway configured for a JWKS only (no algorithm
    // confusion with the public key).
    let res = get(
        &env,
        "/api/v1/characters/me",
        Some(&hs256(&claims("frank", json!({})), SECRET)),
    )
    .await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn scans_past_the_rate_are_429_with_retry_after_and_other_users_go_on() {
    let env = start_with(|c| Config {
        limits: Limits {
            scans_per_minute: 2,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let submit = |user: &'static str| {
        let env = &env;
        async move {
            env.http
                .post(env.url("/api/v1/scan"))
                .header("x-user-id", user)
                .json(&json!({"image_base64": "/9j/4AAQ", "hint": "can"}))
                .send()
                .await
                .unwrap()
        }
    };
    assert_eq!(submit("alice").await.status(), StatusCode::ACCEPTED);
    assert_eq!(submit("alice").await.status(), StatusCode::ACCEPTED);
    let res = submit("alice").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry), "retry-after {retry}");
    let body = json_of(res).await;
    assert_eq!(body["code"], "RESOURCE_EXHAUSTED");
    assert_eq!(env.calls.submits(), 2);

    assert_eq!(submit("bob").await.status(), StatusCode::ACCEPTED);
}

#[tokio::test]
async fn notifications_scheduled_past_the_rate_are_429() {
    let env = start_with(|c| Config {
        limits: Limits {
            schedules_per_minute: 1,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let schedule = || {
        env.http
            .post(env.url("/api/v1/notifications"))
            .json(&json!({"title": "x", "delay_seconds": 60}))
            .send()
    };
    assert_eq!(schedule().await.unwrap().status(), StatusCode::CREATED);
    let res = schedule().await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
}

#[tokio::test]
async fn open_streams_are_capped_per_user_and_overall() {
    let env = start_with(|c| Config {
        limits: Limits {
            max_sse_per_user: 2,
            max_sse: 3,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let open = |user: &'static str| {
        env.http
            .get(env.url("/api/v1/notifications/stream"))
            .header("x-user-id", user)
            .send()
    };
    let a1 = open("alice").await.unwrap();
    let a2 = open("alice").await.unwrap();
    assert_eq!(a1.status(), StatusCode::OK);
    assert_eq!(a2.status(), StatusCode::OK);
    let a3 = open("alice").await.unwrap();
    assert_eq!(a3.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(a3.headers().contains_key("retry-after"));
    assert!(
        json_of(a3).await["message"]
            .as_str()
            .unwrap()
            .contains("streams")
    );

    let b1 = open("bob").await.unwrap();
    assert_eq!(b1.status(), StatusCode::OK);
    // Three open in all: the global cap refuses anyone.
    assert_eq!(
        open("carol").await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // A closed stream gives its slot back (once the gateway notices the client left).
    drop(a1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let res = open("carol").await.unwrap();
        if res.status() == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "the slot never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((a2, b1));
}

/// 1,030 connections that send headers and trickle their bodies (more than the gateway's 1,024
/// concurrency slots) and 100 more that trickle their headers: they are cut within ~30 s, and a
/// fast client's requests succeed the whole time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_and_cannot_starve_the_others() {
    let env = start_with(|c| Config {
        limits: Limits {
            header_timeout: Duration::from_secs(5),
            // All of them come from 127.0.0.1; the per-address cap has a test of its own.
            max_connections_per_ip: 4096,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();

    let started = Instant::now();
    let mut slow = tokio::task::JoinSet::new();
    for i in 0..1130 {
        let addr = addr.clone();
        slow.spawn(async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let head = if i < 1030 {
                // The whole head, then a 1 MiB body one byte a second.
                format!(
                    "POST /api/v1/scan HTTP/1.1\r\nhost: {addr}\r\nx-user-id: slow{i}\r\n\
                     content-type: application/json\r\ncontent-length: 1048576\r\n\r\n"
                )
            } else {
                // Half a head, then a header byte a second.
                format!("GET /api/v1/characters/me HTTP/1.1\r\nhost: {addr}\r\n")
            };
            s.write_all(head.as_bytes()).await.unwrap();
            let mut response = Vec::new();
            loop {
                let byte: &[u8] = if i < 1030 { b" " } else { b"x" };
                if let Err(e) = s.write_all(byte).await {
                    response.extend_from_slice(format!("<write: {e}>").as_bytes());
                    break;
                }
                // Read whatever the gateway answered; EOF means it closed the connection.
                let mut buf = [0u8; 1024];
                match tokio::time::timeout(Duration::from_secs(1), async {
                    use tokio::io::AsyncReadExt as _;
                    s.read(&mut buf).await
                })
                .await
                {
                    Ok(Ok(0)) => break,
                    Ok(Err(e)) => {
                        response.extend_from_slice(format!("<read: {e}>").as_bytes());
                        break;
                    }
                    Ok(Ok(n)) => response.extend_from_slice(&buf[..n]),
                    Err(_) => {}
                }
                if started.elapsed() > Duration::from_secs(90) {
                    panic!("slow connection {i} still open after 90 s");
                }
            }
            (
                i,
                started.elapsed(),
                String::from_utf8_lossy(&response).into_owned(),
            )
        });
    }

    // Meanwhile a fast client keeps working.
    let mut fast_ok = 0;
    while !slow.is_empty() && started.elapsed() < Duration::from_secs(60) {
        let res = env
            .http
            .get(env.url("/api/v1/characters/me"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the fast client's request failed");
        assert_eq!(res.status(), StatusCode::OK);
        fast_ok += 1;
        tokio::select! {
            Some(done) = slow.join_next() => {
                let (i, took, response) = done.unwrap();
                check_cut(i, took, &response);
            }
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    while let Some(done) = slow.join_next().await {
        let (i, took, response) = done.unwrap();
        check_cut(i, took, &response);
    }
    assert!(fast_ok >= 5, "only {fast_ok} fast requests ran");
}

fn check_cut(i: usize, took: Duration, response: &str) {
    // Cut within ~30 s of opening (generous for a busy machine), with a 408 where the gateway
    // could still answer (the body readers) and a close for slow heads.
    assert!(
        took < Duration::from_secs(45),
        "slow connection {i} was held {took:?}"
    );
    if i < 1030 {
        assert!(
            response.starts_with("HTTP/1.1 408"),
            "slow body {i} got {response:?} after {took:?}"
        );
    }
}

#[tokio::test]
async fn request_heads_over_8_kib_are_431_and_the_others_are_served() {
    let env = start().await;
    let with_header = |bytes: usize| {
        env.http
            .get(env.url("/api/v1/characters/me"))
            .header("x-user-id", "alice")
            .header("x-padding", "p".repeat(bytes))
            .send()
    };
    // A long head that fits (a large token or cookie) is served as usual.
    let res = with_header(7 * 1024).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Past 8 KiB hyper answers 431 itself, before any route runs.
    let res = with_header(9 * 1024).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    // And the gateway goes on serving others.
    let res = with_header(16).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// Sends `head` on a fresh connection and returns what the gateway answers within 5 s.
async fn answer_to(addr: &str, head: &str) -> String {
    use tokio::io::AsyncReadExt as _;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer from the headers alone, without the body")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test]
async fn a_body_is_read_only_from_an_authenticated_caller_and_within_its_share() {
    let env = start_with(|c| Config {
        limits: Limits {
            bodies_per_caller: 1,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();

    // A public or unknown route takes no body: refused from the headers, nothing is read (the
    // 10 MB never come).
    for path in ["/", "/nope"] {
        let got = answer_to(
            &addr,
            &format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: 10000000\r\n\r\n"),
        )
        .await;
        assert!(got.starts_with("HTTP/1.1 413"), "{path}: {got}");
    }

    // One caller's share (one full-size body here): while mallory's first upload trickles in,
    // her second is 429; another caller's upload is read as usual.
    let mut first = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let big = 8 << 20;
    first
        .write_all(
            format!(
                "POST /api/v1/scan HTTP/1.1\r\nhost: {addr}\r\nx-user-id: mallory\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                big + 1
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    first.write_all(&vec![b' '; big]).await.unwrap();
    let body = vec![b' '; 6 << 20];
    let deadline = Instant::now() + Duration::from_secs(20);
    let second = loop {
        let res = env
            .http
            .post(env.url("/api/v1/scan"))
            .header("x-user-id", "mallory")
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        // Until the first body's bytes have reached the gateway, the second may fit.
        if res.status() == StatusCode::TOO_MANY_REQUESTS || Instant::now() > deadline {
            break res;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(second.headers().contains_key("retry-after"));
    let other = env
        .http
        .post(env.url("/api/v1/scan"))
        .header("x-user-id", "trent")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_ne!(other.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_ne!(other.status(), StatusCode::PAYLOAD_TOO_LARGE);
    drop(first);
}

#[tokio::test]
async fn a_connection_that_stops_inside_its_http2_preface_is_closed_within_the_header_timeout() {
    use tokio::io::AsyncReadExt as _;
    let env = start_with(|c| Config {
        limits: Limits {
            header_timeout: Duration::from_secs(2),
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();
    // Half a preface; then the whole preface and SETTINGS but no request. Neither is a
    // request, and neither may hold a connection until the idle timeout (a minute).
    let mut settings = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    settings.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    for sent in [b"PRI * HTTP/2.0\r\n".to_vec(), settings] {
        let started = Instant::now();
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(&sent).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(15), async {
            let mut buf = [0u8; 1024];
            // The server's own SETTINGS may come first; then the end.
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "a connection that sent {} bytes and no request was still open after 15 s",
            sent.len()
        );
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "closed only after its time"
        );
    }
}

/// A minimal HTTP/2 client over a raw socket, for what a library client cannot be made to do
/// (leave pings unanswered): the preface, empty SETTINGS, and one `GET` as a HEADERS frame.
mod raw_h2 {
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::TcpStream,
    };

    pub const PING: u8 = 6;
    pub const GOAWAY: u8 = 7;
    const HEADERS: u8 = 1;
    const SETTINGS: u8 = 4;

    /// A frame as read: its type, flags and payload.
    pub struct Frame {
        pub kind: u8,
        pub flags: u8,
        pub stream: u32,
        pub payload: Vec<u8>,
    }

    pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Connects, and sends the preface, SETTINGS and `GET path` on stream 1.
    pub async fn get(addr: &str, path: &str) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(SETTINGS, 0, 0, &[]));
        // HPACK without Huffman: :method GET, :scheme http (static table), :path and
        // :authority as literals with an indexed name.
        let mut block = vec![0x82, 0x86, 0x44, path.len() as u8];
        block.extend_from_slice(path.as_bytes());
        block.extend([0x41, addr.len() as u8]);
        block.extend_from_slice(addr.as_bytes());
        // END_STREAM | END_HEADERS
        out.extend(frame(HEADERS, 0x5, 1, &block));
        s.write_all(&out).await.unwrap();
        s
    }

    /// The next frame, or `None` at the connection's end (or a reset).
    pub async fn next(s: &mut TcpStream) -> Option<Frame> {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).await.ok()?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.ok()?;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        // The server's SETTINGS are acknowledged, as any client does.
        if head[3] == SETTINGS && head[4] & 1 == 0 {
            s.write_all(&frame(SETTINGS, 1, 0, &[])).await.ok()?;
        }
        Some(Frame {
            kind: head[3],
            flags: head[4],
            stream,
            payload,
        })
    }

    /// Reads until the response's HEADERS on stream 1; false if the connection ends first.
    pub async fn response(s: &mut TcpStream) -> bool {
        while let Some(f) = next(s).await {
            if f.kind == HEADERS && f.stream == 1 {
                return true;
            }
        }
        false
    }
}

/// Reads frames until the connection ends, answering PINGs when `answer_pings`; returns
/// whether a GOAWAY came first, or `None` if it was still open after `within`.
async fn until_closed(
    s: &mut tokio::net::TcpStream,
    answer_pings: bool,
    within: Duration,
) -> Option<bool> {
    let read = async {
        let mut goaway = false;
        while let Some(f) = raw_h2::next(s).await {
            goaway |= f.kind == raw_h2::GOAWAY;
            if answer_pings && f.kind == raw_h2::PING && f.flags & 1 == 0 {
                let ack = raw_h2::frame(raw_h2::PING, 1, 0, &f.payload);
                if s.write_all(&ack).await.is_err() {
                    break;
                }
            }
        }
        goaway
    };
    tokio::time::timeout(within, read).await.ok()
}

#[tokio::test]
async fn an_http2_connection_that_holds_no_stream_is_closed_after_the_idle_timeout() {
    let env = start_with(|c| Config {
        limits: Limits {
            idle_timeout: Duration::from_secs(2),
            // No ping can end it first.
            h2_keepalive_interval: Duration::from_secs(600),
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();
    let mut s = raw_h2::get(&addr, "/healthz").await;
    assert!(raw_h2::response(&mut s).await, "no answer to the request");

    // Then nothing more: a connection that answers every ping, and is still closed.
    let closed = until_closed(&mut s, true, Duration::from_secs(30)).await;
    assert_eq!(
        closed,
        Some(true),
        "an idle HTTP/2 connection was not sent away (GOAWAY, then the end) within 30 s"
    );
}

#[tokio::test]
async fn an_http2_peer_that_stops_answering_pings_is_closed() {
    let env = start_with(|c| Config {
        limits: Limits {
            // Idle is not what ends it here.
            idle_timeout: Duration::from_secs(600),
            h2_keepalive_interval: Duration::from_secs(1),
            h2_keepalive_timeout: Duration::from_secs(2),
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();
    let mut s = raw_h2::get(&addr, "/healthz").await;
    assert!(raw_h2::response(&mut s).await, "no answer to the request");

    let closed = until_closed(&mut s, false, Duration::from_secs(30)).await;
    assert!(
        closed.is_some(),
        "a peer that answered no ping still held its connection after 30 s"
    );
}

#[tokio::test]
async fn connections_past_an_addresss_cap_are_closed_at_once_and_the_others_keep_their_service() {
    use tokio::io::AsyncReadExt as _;
    let env = start_with(|c| Config {
        limits: Limits {
            max_connections_per_ip: 3,
            ..Limits::default()
        },
        ..c
    })
    .await;
    let addr = env.base.trim_start_matches("http://").to_owned();
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    // One request on a kept-alive connection: the status line of its answer.
    async fn ask(s: &mut tokio::net::TcpStream, request: &str) -> String {
        if s.write_all(request.as_bytes()).await.is_err() {
            return String::new();
        }
        let mut buf = vec![0u8; 4096];
        let read = tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf)).await;
        match read {
            Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n])
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned(),
            Ok(Err(_)) => String::new(),
            Err(_) => "(no answer within 15 s)".into(),
        }
    }

    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        assert_eq!(ask(&mut s, &request).await, "HTTP/1.1 200 OK");
        held.push(s);
    }
    // A fourth from the same address, with a whole request: closed unanswered.
    let mut extra = tokio::net::TcpStream::connect(&addr).await.unwrap();
    assert_eq!(
        ask(&mut extra, &request).await,
        "",
        "past the cap, yet answered"
    );

    // The three keep their service, and a closed one frees its place.
    for s in &mut held {
        assert_eq!(ask(s, &request).await, "HTTP/1.1 200 OK");
    }
    drop(held.pop());
    let mut next = None;
    for _ in 0..50 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if ask(&mut s, &request).await == "HTTP/1.1 200 OK" {
            next = Some(s);
            break;
        }
        // The server notices the closed connection on its next read.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        next.is_some(),
        "a place freed by a closed connection was never given again"
    );
}

#[tokio::test]
async fn a_slow_key_set_refresh_never_holds_up_tokens_whose_key_is_known() {
    use tokio::sync::Notify;
    let fetches = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(Notify::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/jwks.json",
        axum::routing::get({
            let (fetches, release) = (fetches.clone(), release.clone());
            move || {
                let (fetches, release) = (fetches.clone(), release.clone());
                async move {
                    // Every fetch after the first hangs until the test lets it go.
                    if fetches.fetch_add(1, Ordering::SeqCst) > 0 {
                        release.notified().await;
                    }
                    axum::Json(json!({"keys": [{
                        "kty": "EC", "crv": "P-256", "kid": "k1", "use": "sig", "alg": "ES256",
                        "x": JWK_X, "y": JWK_Y,
                    }]}))
                }
            }
        }),
    );
    let _server = tokio::spawn(async move { axum::serve(listener, app).await });
    let env = start_with(|c| Config {
        auth: AuthConfig {
            jwks_url: Some(url),
            issuer: Some(ISSUER.into()),
            audience: Some(AUDIENCE.into()),
            trust_header: TrustHeader::Off,
            jwks_max_age: Duration::from_millis(200),
            jwks_min_refresh: Duration::from_millis(100),
            ..AuthConfig::default()
        },
        ..c
    })
    .await;
    let known = es256(&claims("grace", json!({})), "k1");
    assert_eq!(
        get(&env, "/api/v1/characters/me", Some(&known))
            .await
            .status(),
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A token naming an unknown key starts a refresh, which hangs at the provider.
    let unknown = es256(&claims("grace", json!({})), "k9");
    let waiting = {
        let (http, url) = (env.http.clone(), env.url("/api/v1/characters/me"));
        tokio::spawn(async move { http.get(url).bearer_auth(unknown).send().await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while fetches.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < deadline,
            "the unknown key started no refresh"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Meanwhile a token with a known key is answered, the refresh still hanging: taken from
    // the keys in hand, not from behind the fetch.
    let asked = Instant::now();
    let res = get(&env, "/api/v1/characters/me", Some(&known)).await;
    assert_eq!(res.status(), StatusCode::OK);
    // A fetch gives up after 5 s: an answer that waited for it would come after that.
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        !waiting.is_finished(),
        "the refresh ended before the known key's answer: this test proved nothing"
    );
    release.notify_waiters();
    let refused = waiting.await.unwrap().unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
}
