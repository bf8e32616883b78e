use super::*;

#[test]
fn urls_follow_the_tls_configuration() {
    assert_eq!(
        dial_uri("http://rule:50053", true).unwrap(),
        "https://rule:50053"
    );
    assert_eq!(
        dial_uri("HTTP://rule:50053", true).unwrap(),
        "https://rule:50053"
    );
    assert_eq!(
        dial_uri("https://rule:50053", true).unwrap(),
        "https://rule:50053"
    );
    assert_eq!(
        dial_uri("http://rule:50053", false).unwrap(),
        "http://rule:50053"
    );
    let err = dial_uri("https://rule:50053", false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("GRPC_TLS_CERT") && err.contains("GRPC_TLS_KEY"),
        "{err}"
    );
}

#[test]
fn nothing_set_is_plaintext() {
    assert!(TlsConfig::from_vars(None, None, None).unwrap().is_none());
}

#[test]
fn half_a_configuration_is_refused() {
    let err = TlsConfig::from_vars(Some("/c.pem"), None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("GRPC_TLS_CERT is set but GRPC_TLS_KEY is not"),
        "{err}"
    );
    let err = TlsConfig::from_vars(None, Some("/k.pem"), Some("/ca.pem"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("GRPC_TLS_KEY is set but GRPC_TLS_CERT is not"),
        "{err}"
    );
    let err = TlsConfig::from_vars(None, None, Some("/ca.pem"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("GRPC_TLS_CA is set but GRPC_TLS_CERT and GRPC_TLS_KEY are not"),
        "{err}"
    );
}

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// A CA, a leaf it signed (`cert.pem`, `key.pem`, `ca.pem`), an unrelated key and a
    /// file that is not PEM.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = crate::testing::pki::TestCa::new("ecoscan test CA");
        let leaf = ca.issue(&["localhost"]);
        let other = ca.issue(&["localhost"]);
        for (name, pem) in [
            ("ca.pem", ca.pem()),
            ("cert.pem", leaf.cert.as_str()),
            ("key.pem", leaf.key.as_str()),
            ("other-key.pem", other.key.as_str()),
            ("junk.pem", "not a certificate\n"),
        ] {
            std::fs::write(dir.path().join(name), pem).unwrap();
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn load(&self, cert: &str, key: &str, ca: Option<&str>) -> anyhow::Result<TlsConfig> {
        let ca = ca.map(|c| self.path(c));
        TlsConfig::from_vars(Some(&self.path(cert)), Some(&self.path(key)), ca.as_deref())
            .map(|c| c.expect("configured"))
    }
}

#[test]
fn files_load_with_and_without_a_ca() {
    let pki = Pki::new();
    assert!(
        pki.load("cert.pem", "key.pem", Some("ca.pem"))
            .unwrap()
            .is_mutual()
    );
    // Without a CA, clients trust the system store; CI and developer machines have one.
    if let Ok(tls) = pki.load("cert.pem", "key.pem", None) {
        assert!(!tls.is_mutual());
    }
}

#[test]
fn unreadable_and_invalid_files_name_the_variable_and_the_file() {
    let pki = Pki::new();
    let missing = pki.path("missing.pem");
    let err = format!(
        "{:#}",
        pki.load("missing.pem", "key.pem", Some("ca.pem"))
            .unwrap_err()
    );
    assert!(
        err.starts_with(&format!("cannot read GRPC_TLS_CERT file {missing}: ")),
        "{err}"
    );
    let err = format!(
        "{:#}",
        pki.load("cert.pem", "key.pem", Some("missing.pem"))
            .unwrap_err()
    );
    assert!(
        err.starts_with(&format!("cannot read GRPC_TLS_CA file {missing}: ")),
        "{err}"
    );

    let junk = pki.path("junk.pem");
    let err = format!(
        "{:#}",
        pki.load("junk.pem", "key.pem", Some("ca.pem")).unwrap_err()
    );
    assert_eq!(
        err,
        format!("GRPC_TLS_CERT file {junk} holds no PEM certificate")
    );
    let err = format!(
        "{:#}",
        pki.load("cert.pem", "junk.pem", Some("ca.pem"))
            .unwrap_err()
    );
    assert!(
        err.starts_with(&format!(
            "GRPC_TLS_KEY file {junk} holds no usable PEM private key"
        )),
        "{err}"
    );
    let err = format!(
        "{:#}",
        pki.load("cert.pem", "key.pem", Some("junk.pem"))
            .unwrap_err()
    );
    assert_eq!(
        err,
        format!("GRPC_TLS_CA file {junk} holds no PEM certificate")
    );

    let err = format!(
        "{:#}",
        pki.load("cert.pem", "other-key.pem", Some("ca.pem"))
            .unwrap_err()
    );
    assert_eq!(
        err,
        format!(
            "GRPC_TLS_KEY file {} is not the private key of the certificate in \
             GRPC_TLS_CERT file {}",
            pki.path("other-key.pem"),
            pki.path("cert.pem")
        )
    );
}

/// The plain-HTTP side of a server under mutual TLS, over a real loopback socket: the
/// orchestrator's probes (`/healthz`, `/readyz`) answer without a client certificate, and over
/// HTTP/1.1 (ALPN); `GET /metrics` needs one, like every RPC.
mod http_under_mutual_tls {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::{
        self, ClientConfig, RootCertStore,
        pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject},
    };
    use tonic::{service::Routes, transport::Certificate};

    use crate::{
        metrics::Metrics,
        server::serve_with_tls,
        testing::{Spawned, pki::TestCa, spawn},
    };

    async fn start(ca: &TestCa) -> Spawned {
        let tls = ca.tls_config(&ca.issue(&["localhost", "127.0.0.1"]), true);
        spawn(move |listener, shutdown| {
            serve_with_tls(
                Routes::default(),
                &[],
                Metrics::default(),
                listener,
                Some(tls),
                shutdown,
            )
        })
        .await
    }

    /// `GET path` over HTTP/1.1 in TLS, trusting `ca`, with the client certificate `cert` if any:
    /// the status line.
    async fn get(server: &Spawned, ca: &TestCa, cert: Option<(&str, &str)>, path: &str) -> String {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
            .unwrap();
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots);
        let mut config = match cert {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    CertificateDer::pem_slice_iter(cert.as_bytes())
                        .collect::<Result<_, _>>()
                        .unwrap(),
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .expect("TLS handshake");
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        tls.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut raw = Vec::new();
        // The server may close without close_notify once the response is sent.
        let _ = tls.read_to_end(&mut raw).await;
        let raw = String::from_utf8_lossy(&raw);
        raw.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn probes_answer_without_a_client_certificate_and_metrics_do_not() {
        let ca = TestCa::new("ecoscan test CA");
        let server = start(&ca).await;

        assert_eq!(get(&server, &ca, None, "/healthz").await, "HTTP/1.1 200 OK");
        assert_eq!(get(&server, &ca, None, "/readyz").await, "HTTP/1.1 200 OK");
        assert_eq!(
            get(&server, &ca, None, "/metrics").await,
            "HTTP/1.1 403 Forbidden"
        );

        let cert = ca.issue(&["ecoscan-prometheus"]);
        assert_eq!(
            get(&server, &ca, Some((&cert.cert, &cert.key)), "/metrics").await,
            "HTTP/1.1 200 OK"
        );

        server.stop().await.expect("clean shutdown");
    }

    #[tokio::test]
    async fn health_needs_a_client_certificate_like_every_rpc() {
        let ca = TestCa::new("ecoscan test CA");
        let server = start(&ca).await;
        let url = format!("https://{}", server.addr);
        let connect = |tls: tonic::transport::ClientTlsConfig| {
            let endpoint = tonic::transport::Endpoint::from_shared(url.clone())
                .unwrap()
                .tls_config(tls)
                .unwrap();
            async move { endpoint.connect().await }
        };
        let trusting = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca.pem()));

        let anonymous = connect(trusting.clone()).await.expect("handshake");
        let status = tonic_health::pb::health_client::HealthClient::new(anonymous)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect_err("health without a client certificate");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");

        let cert = ca.issue(&["ecoscan-probe"]);
        let channel =
            connect(trusting.identity(tonic::transport::Identity::from_pem(&cert.cert, &cert.key)))
                .await
                .expect("handshake with a client certificate");
        let status = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect("health with a client certificate")
            .into_inner()
            .status;
        assert_eq!(status, tonic_health::ServingStatus::Serving as i32);

        server.stop().await.expect("clean shutdown");
    }
}
