//! Certificates for tests of internal TLS, generated on the spot (`rcgen`, feature `test-pki`):
//! a CA, and certificates it signs for loopback names.
//!
//! ```ignore
//! let ca = TestCa::new("ecoscan test CA");
//! let server = ca.issue(&["localhost", "127.0.0.1"]);
//! let tls = ca.tls_config(&server, true); // mutual TLS: this CA verifies the peers
//! ```

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::tls::TlsConfig;

/// A certificate authority that lives as long as the test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

/// A certificate and its private key, in PEM.
#[derive(Clone, Debug)]
pub struct TestCert {
    pub cert: String,
    pub key: String,
}

impl TestCa {
    /// A self-signed CA with the common name `name`.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("self-signed CA");
        Self {
            issuer: Issuer::new(params, key),
            pem: cert.pem(),
        }
    }

    /// The CA certificate (PEM).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for `names` (DNS names or IP addresses, as subject alternative names),
    /// signed by this CA; usable by servers and clients alike.
    pub fn issue(&self, names: &[&str]) -> TestCert {
        let key = KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("certificate params");
        params
            .distinguished_name
            .push(DnType::CommonName, "ecoscan test");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        TestCert {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// `cert` as a process's [`TlsConfig`]; with `mutual`, this CA verifies the peers (servers
    /// require client certificates), else TLS only.
    pub fn tls_config(&self, cert: &TestCert, mutual: bool) -> TlsConfig {
        TlsConfig::from_pem(
            cert.cert.as_bytes(),
            cert.key.as_bytes(),
            mutual.then_some(self.pem.as_bytes()),
        )
        .expect("a valid TLS configuration")
    }
}
