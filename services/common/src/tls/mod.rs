//! Internal gRPC over TLS, and mutual TLS when a CA is given: one configuration per process,
//! read once from the environment, used by every gRPC server ([`crate::server`]) and every
//! internal client channel ([`crate::client`]) of the process.
//!
//! | variables | servers | clients |
//! |---|---|---|
//! | none | plaintext (HTTP/2 cleartext), as before | plaintext |
//! | `GRPC_TLS_CERT` + `GRPC_TLS_KEY` | TLS with this certificate | TLS; the server is verified against the system's trust store |
//! | … + `GRPC_TLS_CA` | mutual TLS: a client certificate signed by the CA is required | mutual TLS: the server is verified against the CA (only), this certificate is presented |
//!
//! All three are paths of PEM files. `GRPC_TLS_CERT` is this process's certificate (its chain,
//! leaf first), used both as the server certificate and, when calling, as the client
//! certificate; `GRPC_TLS_KEY` its private key (PKCS#8, PKCS#1 or SEC1). Servers verify client
//! certificates against `GRPC_TLS_CA` (chain and validity; any certificate the CA signed is
//! accepted, so give internal gRPC a CA of its own), and clients verify the server's certificate
//! against it, including the name they dialled (a DNS name or an IP address in the
//! certificate's subject alternative names).
//!
//! With TLS configured, a client dials `http://host:port` service URLs over TLS as if they were
//! `https://` (the `*_URL` variables need not change, and nothing is ever sent in plaintext);
//! without it, an `https://` URL is refused with a message naming these variables.
//!
//! With mutual TLS, `GET /healthz` and `GET /readyz` (the orchestrator's probes, which carry no
//! client certificate) answer without one; everything else on the port — every RPC, health and
//! reflection included, and `GET /metrics` — is refused without one (`UNAUTHENTICATED` for gRPC,
//! 403 for plain HTTP). A client certificate that does not verify against the CA fails the
//! handshake itself.
//!
//! Certificates are read once, at startup: a renewed certificate takes effect when the process
//! restarts (connections already open keep the session they negotiated).

use std::{fmt, path::Path, sync::Arc, sync::OnceLock, time::Duration};

use anyhow::{Context, anyhow, bail};
use tokio_rustls::rustls::{
    self, RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// This process's certificate chain (PEM file).
pub const CERT_VAR: &str = "GRPC_TLS_CERT";
/// The private key of [`CERT_VAR`] (PEM file).
pub const KEY_VAR: &str = "GRPC_TLS_KEY";
/// The CA of internal gRPC (PEM file): mutual TLS when set.
pub const CA_VAR: &str = "GRPC_TLS_CA";

/// How long a TLS handshake may take, on either side.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS settings of one process: a server configuration and a client configuration built
/// from the same certificate, key and (optional) CA. Cheap to clone.
#[derive(Clone)]
pub struct TlsConfig {
    server: Arc<ServerConfig>,
    client: ClientTlsConfig,
    mutual: bool,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

/// A PEM document and how to name it in errors.
struct Pem {
    what: String,
    bytes: Vec<u8>,
}

impl Pem {
    fn read(var: &str, path: &str) -> anyhow::Result<Self> {
        let bytes = std::fs::read(Path::new(path))
            .with_context(|| format!("cannot read {var} file {path}"))?;
        Ok(Self {
            what: format!("{var} file {path}"),
            bytes,
        })
    }

    fn given(what: &str, bytes: &[u8]) -> Self {
        Self {
            what: what.to_owned(),
            bytes: bytes.to_vec(),
        }
    }

    fn certificates(&self) -> anyhow::Result<Vec<CertificateDer<'static>>> {
        let certs = CertificateDer::pem_slice_iter(&self.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow!("{} is not valid PEM: {e}", self.what))?;
        if certs.is_empty() {
            bail!("{} holds no PEM certificate", self.what);
        }
        Ok(certs)
    }

    fn private_key(&self) -> anyhow::Result<PrivateKeyDer<'static>> {
        PrivateKeyDer::from_pem_slice(&self.bytes).map_err(|e| {
            anyhow!(
                "{} holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
                self.what
            )
        })
    }
}

impl TlsConfig {
    /// Reads `GRPC_TLS_CERT`, `GRPC_TLS_KEY` and `GRPC_TLS_CA` (see the module documentation):
    /// `None` when none is set (plaintext). An error names the variable and file at fault.
    pub fn from_env() -> anyhow::Result<Option<Self>> {
        let cert = crate::config::env_opt(CERT_VAR);
        let key = crate::config::env_opt(KEY_VAR);
        let ca = crate::config::env_opt(CA_VAR);
        Self::from_vars(cert.as_deref(), key.as_deref(), ca.as_deref())
    }

    /// [`TlsConfig::from_env`] with the variables' values given (file paths; `None`: unset).
    pub fn from_vars(
        cert: Option<&str>,
        key: Option<&str>,
        ca: Option<&str>,
    ) -> anyhow::Result<Option<Self>> {
        let (cert, key) = match (cert, key) {
            (None, None) => {
                if ca.is_some() {
                    bail!(
                        "{CA_VAR} is set but {CERT_VAR} and {KEY_VAR} are not: mutual TLS needs \
                         this process's certificate and key too (set all three, or none for \
                         plaintext)"
                    );
                }
                return Ok(None);
            }
            (Some(_), None) => bail!(
                "{CERT_VAR} is set but {KEY_VAR} is not: internal gRPC TLS needs both the \
                 certificate and its private key (set both, or neither for plaintext)"
            ),
            (None, Some(_)) => bail!(
                "{KEY_VAR} is set but {CERT_VAR} is not: internal gRPC TLS needs both the \
                 certificate and its private key (set both, or neither for plaintext)"
            ),
            (Some(cert), Some(key)) => (cert, key),
        };
        let cert = Pem::read(CERT_VAR, cert)?;
        let key = Pem::read(KEY_VAR, key)?;
        let ca = ca.map(|ca| Pem::read(CA_VAR, ca)).transpose()?;
        Self::build(&cert, &key, ca.as_ref()).map(Some)
    }

    /// A configuration from PEM text: this process's certificate chain and key, and the CA for
    /// mutual TLS (`None`: TLS only, servers verified against the system's trust store).
    pub fn from_pem(cert: &[u8], key: &[u8], ca: Option<&[u8]>) -> anyhow::Result<Self> {
        let ca = ca.map(|ca| Pem::given("the CA", ca));
        Self::build(
            &Pem::given("the certificate", cert),
            &Pem::given("the private key", key),
            ca.as_ref(),
        )
    }

    /// The process-wide configuration: [`TlsConfig::from_env`], read on first use and kept (an
    /// error too, returned to every caller).
    pub fn global() -> anyhow::Result<Option<&'static Self>> {
        static GLOBAL: OnceLock<Result<Option<TlsConfig>, String>> = OnceLock::new();
        let loaded = GLOBAL.get_or_init(|| {
            let loaded = Self::from_env().map_err(|e| format!("{e:#}"));
            if let Ok(Some(tls)) = &loaded {
                tracing::info!(
                    mode = if tls.mutual { "mutual TLS" } else { "TLS" },
                    cert = crate::config::env_opt(CERT_VAR),
                    ca = crate::config::env_opt(CA_VAR),
                    "internal gRPC over TLS"
                );
            }
            loaded
        });
        match loaded {
            Ok(tls) => Ok(tls.as_ref()),
            Err(e) => Err(anyhow!("{e}")),
        }
    }

    /// Whether servers require client certificates (a CA is configured).
    pub fn is_mutual(&self) -> bool {
        self.mutual
    }

    /// The client side: this certificate as the client's identity, servers verified against
    /// the CA (or the system's trust store without one).
    pub fn client_config(&self) -> ClientTlsConfig {
        self.client.clone()
    }

    /// The server side, for a `tokio_rustls` acceptor. It offers HTTP/2 and HTTP/1.1 (for
    /// `GET /metrics`, `/healthz`, `/readyz`); with mutual TLS, a client certificate is verified
    /// against the CA when presented, and [`crate::server`] refuses requests without one.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    fn build(cert: &Pem, key: &Pem, ca: Option<&Pem>) -> anyhow::Result<Self> {
        let chain = cert.certificates()?;
        let private_key = key.private_key()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("no TLS protocol version available")?;
        let builder = match ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for der in ca.certificates()? {
                    roots
                        .add(der)
                        .map_err(|e| anyhow!("{} holds an invalid CA certificate: {e}", ca.what))?;
                }
                // Presented certificates are verified in the handshake; requests without one
                // are refused per request, so the orchestrator's probes can still connect.
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| anyhow!("{} cannot verify clients: {e}", ca.what))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut server = builder
            .with_single_cert(chain, private_key)
            .map_err(|e| match e {
                rustls::Error::InconsistentKeys(_) => anyhow!(
                    "{} is not the private key of the certificate in {}",
                    key.what,
                    cert.what
                ),
                e => anyhow!("{} with {}: unusable: {e}", cert.what, key.what),
            })?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];

        let client = ClientTlsConfig::new()
            .identity(Identity::from_pem(&cert.bytes, &key.bytes))
            .timeout(HANDSHAKE_TIMEOUT);
        let client = match ca {
            Some(ca) => client.ca_certificate(Certificate::from_pem(&ca.bytes)),
            None => client.with_native_roots(),
        };
        // Built here once, so a client configuration that cannot work (no system trust store)
        // stops startup instead of failing every call.
        Endpoint::from_static("https://localhost")
            .tls_config(client.clone())
            .map_err(|e| {
                anyhow!(
                    "internal gRPC clients cannot use TLS: {}",
                    crate::tls::error_chain(&e)
                )
            })
            .with_context(|| {
                if ca.is_none() {
                    format!(
                        "without {CA_VAR}, clients verify servers against the system's trust store"
                    )
                } else {
                    format!("{CA_VAR} with {CERT_VAR} and {KEY_VAR}")
                }
            })?;

        Ok(Self {
            server: Arc::new(server),
            client,
            mutual: ca.is_some(),
        })
    }
}

/// `error: source: source…`, for errors whose `Display` leaves out their cause.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The URL a client dials for `uri`: with TLS, `http://` becomes `https://` (internal traffic
/// is never sent in plaintext once TLS is configured); without it, `https://` is refused.
pub(crate) fn dial_uri(uri: &str, tls: bool) -> anyhow::Result<String> {
    let scheme = |s: &str| {
        uri.get(..s.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(s))
    };
    if tls && scheme("http://") {
        return Ok(format!("https://{}", &uri["http://".len()..]));
    }
    if !tls && scheme("https://") {
        bail!(
            "{uri} is an https:// URL, but internal gRPC TLS is not configured: set {CERT_VAR} \
             and {KEY_VAR} (and {CA_VAR} for mutual TLS), or use http://"
        );
    }
    Ok(uri.to_owned())
}

pub(crate) mod server;

#[cfg(test)]
mod tests;
