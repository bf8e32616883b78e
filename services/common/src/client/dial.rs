//! The settings every internal gRPC endpoint is dialled with: timeouts, HTTP/2 keepalives and
//! internal TLS. One place, for the single-address channels of [`super`] and the per-replica
//! connections of [`super::balance`].

use std::time::Duration;

use tonic::transport::Endpoint;

use crate::tls::TlsConfig;

/// The settings of every internal endpoint; `tls_name` is the name TLS verifies when it is not
/// the host dialled (an address the name resolved to).
pub(crate) fn configure(
    endpoint: Endpoint,
    tls: Option<&TlsConfig>,
    tls_name: Option<&str>,
) -> anyhow::Result<Endpoint> {
    let mut endpoint = endpoint
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    if let Some(tls) = tls {
        let mut config = tls.client_config();
        if let Some(name) = tls_name {
            config = config.domain_name(name);
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| anyhow::anyhow!("{}", crate::tls::error_chain(&e)))?;
    }
    Ok(endpoint)
}
