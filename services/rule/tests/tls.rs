//! RuleService over TLS and mutual TLS on a real loopback socket, with certificates made here:
//! clients that trust the CA get answers; plaintext clients, clients that trust another CA and
//! (under mutual TLS) clients without a certificate, or with one from another CA, do not; health
//! and reflection work over TLS as they do without. The `ecoscan-rule` binary takes its
//! certificates from `GRPC_TLS_*` files, and refuses to start when they do not fit together.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::Duration,
};

use ecoscan_common::{
    client,
    metrics::Metrics,
    server::serve_with_tls,
    testing::{
        Spawned, assert_health_and_reflection_over,
        pki::{TestCa, TestCert},
        spawn,
    },
    tls::TlsConfig,
};
use ecoscan_proto::v1::{
    ListCategoriesRequest, rule_service_client::RuleServiceClient,
    rule_service_server::RuleServiceServer,
};
use ecoscan_rule::{Dataset, RuleApi, SERVICE_NAME};
use tonic::{
    Code,
    service::Routes,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
};

/// The names a loopback server is dialled by.
const LOOPBACK: &[&str] = &["localhost", "127.0.0.1"];

/// The rule service on `127.0.0.1:<ephemeral>`, over `tls`.
async fn start(tls: TlsConfig) -> Spawned {
    spawn(move |listener, shutdown| async move {
        let api = RuleApi::new(Arc::new(Dataset::embedded()?));
        serve_with_tls(
            Routes::new(RuleServiceServer::new(api)),
            &[SERVICE_NAME],
            Metrics::default(),
            listener,
            Some(tls),
            shutdown,
        )
        .await
    })
    .await
}

/// `ListCategories` over `channel`: how many categories came back, or why not.
async fn list_categories(channel: Channel) -> Result<usize, tonic::Status> {
    let mut client = RuleServiceClient::new(channel);
    let call = client.list_categories(ListCategoriesRequest {});
    let res = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| tonic::Status::deadline_exceeded("no answer within 10 s"))??;
    Ok(res.into_inner().categories.len())
}

/// Connects to `https://<addr>` with `tls` (tonic's own client, not ecoscan's) and calls
/// `ListCategories`; an error (connection or call) as text.
async fn call_with(addr: std::net::SocketAddr, tls: ClientTlsConfig) -> Result<usize, String> {
    let endpoint = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .tls_config(tls)
        .map_err(|e| format!("tls config: {e:?}"))?;
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    list_categories(channel)
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

fn trusting(ca: &TestCa) -> ClientTlsConfig {
    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.pem()))
}

fn identity(cert: &TestCert) -> Identity {
    Identity::from_pem(&cert.cert, &cert.key)
}

#[tokio::test]
async fn tls_serves_clients_that_trust_the_ca() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), false)).await;

    // tonic's client, trusting the CA; no client certificate needed without a CA on the server.
    let n = call_with(server.addr, trusting(&ca))
        .await
        .expect("TLS call");
    assert!(n > 0, "categories over TLS");
    // Verified by name too: `localhost` is in the certificate.
    let by_name = Endpoint::from_shared(format!("https://localhost:{}", server.addr.port()))
        .unwrap()
        .tls_config(trusting(&ca))
        .unwrap()
        .connect()
        .await
        .expect("connect by name");
    assert!(list_categories(by_name).await.is_ok());

    // ecoscan's client dials the `http://` URL over TLS once TLS is configured.
    let ours = ca.tls_config(&ca.issue(LOOPBACK), true);
    let channel = client::endpoint(&server.uri(), Some(&ours))
        .unwrap()
        .connect()
        .await
        .expect("ecoscan client connects over TLS");
    assert!(list_categories(channel.clone()).await.is_ok());
    assert_health_and_reflection_over(channel, SERVICE_NAME).await;

    server.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_plaintext_client_to_a_tls_server_fails_at_once() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), false)).await;

    // The server drops the connection on the first byte that is not a TLS handshake, so the
    // client fails at once (not by waiting out its deadline).
    let result = match Endpoint::from_shared(server.uri()).unwrap().connect().await {
        Ok(channel) => list_categories(channel).await.map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(format!("connect: {e:?}"))),
    };
    let status = result.expect_err("plaintext call to a TLS server");
    assert!(
        matches!(
            status.code(),
            Code::Unavailable | Code::Unknown | Code::Internal
        ),
        "{status:?}"
    );

    // A process without TLS refuses `https://` URLs, naming the variables to set, instead of
    // failing at every call.
    let Err(err) = client::channel_with_tls(&format!("https://{}", server.addr), None) else {
        panic!("https without TLS configured");
    };
    let err = err.to_string();
    assert!(err.contains("GRPC_TLS_CERT"), "{err}");

    server.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_client_that_trusts_another_ca_refuses_the_server() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), false)).await;

    let stranger = TestCa::new("another CA");
    let err = call_with(server.addr, trusting(&stranger))
        .await
        .expect_err("server certificate from an untrusted CA");
    assert!(err.contains("UnknownIssuer"), "{err}");

    // ecoscan's client too, when its GRPC_TLS_CA is another CA.
    let theirs = stranger.tls_config(&stranger.issue(LOOPBACK), true);
    let traced = client::channel_with_tls(&server.uri(), Some(&theirs)).unwrap();
    let status = RuleServiceClient::new(traced)
        .list_categories(ListCategoriesRequest {})
        .await
        .expect_err("server certificate from an untrusted CA");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");

    server.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), true)).await;

    // The handshake completes (so the orchestrator's probes reach /readyz), but every RPC is
    // refused.
    let err = call_with(server.addr, trusting(&ca))
        .await
        .expect_err("a client without a certificate");
    assert!(
        err.starts_with("Unauthenticated: a client certificate signed by the internal gRPC CA"),
        "{err}"
    );

    server.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_certificate_from_another_ca() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), true)).await;

    let stranger = TestCa::new("another CA");
    let err = call_with(
        server.addr,
        trusting(&ca).identity(identity(&stranger.issue(LOOPBACK))),
    )
    .await
    .expect_err("a client certificate from another CA");
    // Refused in the handshake (the server's alert), not per request.
    assert!(!err.starts_with("Unauthenticated:"), "{err}");
    assert!(!err.starts_with("Ok"), "{err}");

    server.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn mutual_tls_serves_clients_with_a_certificate_the_ca_signed() {
    let ca = TestCa::new("ecoscan test CA");
    let server = start(ca.tls_config(&ca.issue(LOOPBACK), true)).await;

    let cert = ca.issue(LOOPBACK);
    let n = call_with(server.addr, trusting(&ca).identity(identity(&cert)))
        .await
        .expect("mutual TLS call");
    assert!(n > 0);

    // ecoscan's own client: the traced channel the services use, and health and reflection.
    let ours = ca.tls_config(&cert, true);
    let traced = client::channel_with_tls(&server.uri(), Some(&ours)).unwrap();
    let res = RuleServiceClient::new(traced)
        .list_categories(ListCategoriesRequest {})
        .await
        .expect("ecoscan client over mutual TLS");
    assert!(!res.into_inner().categories.is_empty());
    let channel = client::endpoint(&server.uri(), Some(&ours))
        .unwrap()
        .connect()
        .await
        .expect("connect over mutual TLS");
    assert_health_and_reflection_over(channel, SERVICE_NAME).await;

    server.stop().await.expect("clean shutdown");
}

/// Writes a CA, a certificate it signed for loopback and that certificate's key (`ca.pem`,
/// `cert.pem`, `key.pem`) into `dir`, plus the key of another certificate (`other-key.pem`).
fn write_pki(dir: &Path, ca: &TestCa) -> TestCert {
    let cert = ca.issue(LOOPBACK);
    for (name, pem) in [
        ("ca.pem", ca.pem().to_owned()),
        ("cert.pem", cert.cert.clone()),
        ("key.pem", cert.key.clone()),
        ("other-key.pem", ca.issue(LOOPBACK).key),
    ] {
        std::fs::write(dir.join(name), pem).unwrap();
    }
    cert
}

/// `ecoscan-rule` on `127.0.0.1:0`, with `GRPC_TLS_*` naming `cert`, `key` and `ca` in `dir`;
/// JSON logs on stdout.
fn rule_binary(dir: &Path, cert: &str, key: &str, ca: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ecoscan-rule"))
        .env_clear()
        .env("RULE_ADDR", "127.0.0.1:0")
        .env("LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .env("GRPC_TLS_CERT", dir.join(cert))
        .env("GRPC_TLS_KEY", dir.join(key))
        .env("GRPC_TLS_CA", dir.join(ca))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ecoscan-rule")
}

/// What `ecoscan-rule` writes to stderr when it refuses to start with the test PKI written to
/// `dir` and `GRPC_TLS_*` naming `cert`, `key` and `ca` there.
fn refusal(dir: &Path, cert: &str, key: &str, ca: &str) -> String {
    write_pki(dir, &TestCa::new("ecoscan test CA"));
    let out = rule_binary(dir, cert, key, ca).wait_with_output().unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Kills the child when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_serves_mutual_tls_with_the_files_the_variables_name() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ecoscan test CA");
    let cert = write_pki(dir.path(), &ca);
    let mut child = rule_binary(dir.path(), "cert.pem", "key.pem", "ca.pem");
    let stdout = child.stdout.take().unwrap();
    let child = KillOnDrop(child);

    // The bound address, from the "listening" log line.
    let addr = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout).lines().find_map(|line| {
            let line: serde_json::Value = serde_json::from_str(&line.ok()?).ok()?;
            let fields = line.get("fields")?;
            (fields.get("message")?.as_str()? == "listening").then(|| {
                fields
                    .get("addr")?
                    .as_str()?
                    .parse::<std::net::SocketAddr>()
                    .ok()
            })?
        })
    });
    let addr = tokio::time::timeout(Duration::from_secs(30), addr)
        .await
        .expect("ecoscan-rule logs its address")
        .unwrap()
        .expect("a listening line with the address");

    let n = call_with(addr, trusting(&ca).identity(identity(&cert)))
        .await
        .expect("mutual TLS call to the binary");
    assert!(n > 0);
    let err = call_with(addr, trusting(&ca))
        .await
        .expect_err("a client without a certificate");
    assert!(err.starts_with("Unauthenticated:"), "{err}");
    drop(child);
}

#[test]
fn the_binary_refuses_to_start_with_a_key_that_is_not_its_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = refusal(dir.path(), "cert.pem", "other-key.pem", "ca.pem");
    let expected = format!(
        "GRPC_TLS_KEY file {} is not the private key of the certificate in GRPC_TLS_CERT file {}",
        dir.path().join("other-key.pem").display(),
        dir.path().join("cert.pem").display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}

#[test]
fn the_binary_refuses_to_start_with_an_unreadable_ca() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = refusal(dir.path(), "cert.pem", "key.pem", "missing-ca.pem");
    let expected = format!(
        "cannot read GRPC_TLS_CA file {}",
        dir.path().join("missing-ca.pem").display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}
