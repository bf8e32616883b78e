//! What goes with a request besides its body: who we are, and our trace context only where it
//! belongs. A `traceparent` names our trace and span ids; a third-party provider has no use for
//! them, so by default they go only to providers inside our own network (a model server on
//! loopback or in the cluster), where a trace that continues into the model server is useful.

use std::net::IpAddr;

/// `User-Agent` of every provider request: providers' logs and rate-limit support can tell
/// ecoscan's traffic apart.
pub(super) const USER_AGENT: &str = concat!("ecoscan/", env!("CARGO_PKG_VERSION"));

/// Whether `url` points inside our own network: a loopback address, `localhost`, or a
/// Kubernetes service name (`*.svc`, `*.svc.cluster.local`, `*.cluster.local`). Decided on the
/// parsed host alone, without resolving it: a public name that resolves to a private address is
/// still someone else's server as far as we can tell.
pub(super) fn is_internal(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return match ip {
            IpAddr::V4(v4) => v4.is_loopback(),
            IpAddr::V6(v6) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        };
    }
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.ends_with(".svc")
        || host.ends_with(".svc.cluster.local")
        || host.ends_with(".cluster.local")
}

/// The trace-context headers of the current span when `propagate`, else none. Empty values are
/// left out: W3C Trace Context says an empty `tracestate` is not sent at all.
pub(super) fn trace_headers(propagate: bool) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    if !propagate {
        return headers;
    }
    ecoscan_common::telemetry::inject_headers(&mut headers);
    let empty: Vec<http::HeaderName> = headers
        .iter()
        .filter(|(_, v)| v.as_bytes().iter().all(u8::is_ascii_whitespace))
        .map(|(k, _)| k.clone())
        .collect();
    for name in empty {
        headers.remove(name);
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn internal(url: &str) -> bool {
        is_internal(&reqwest::Url::parse(url).unwrap())
    }

    #[test]
    fn loopback_and_cluster_service_hosts_are_internal() {
        for url in [
            "http://127.0.0.1:4000/v1",
            "http://127.8.9.10/v1",
            "http://[::1]:8000/v1",
            "http://[::ffff:127.0.0.1]/v1",
            "http://localhost:11434/v1",
            "http://LOCALHOST./v1",
            "http://vllm.models.svc:8000/v1",
            "http://vllm.models.svc.cluster.local:8000/v1",
            "http://litellm.ai.cluster.local/v1",
        ] {
            assert!(internal(url), "{url}");
        }
    }

    #[test]
    fn public_and_private_network_hosts_are_third_parties() {
        for url in [
            "https://api.openai.com/v1",
            "https://example.svc.evil.com/v1",
            "https://localhost.example.com/v1",
            "http://10.0.0.5:8000/v1",
            "http://192.168.1.20/v1",
            "http://[fd00::1]/v1",
            "http://0.0.0.0/v1",
            "https://my-resource.openai.azure.com/openai",
        ] {
            assert!(!internal(url), "{url}");
        }
    }

    #[test]
    fn the_user_agent_names_ecoscan_and_its_version() {
        assert_eq!(USER_AGENT, format!("ecoscan/{}", env!("CARGO_PKG_VERSION")));
    }

    #[test]
    fn nothing_is_injected_when_propagation_is_off() {
        assert!(trace_headers(false).is_empty());
    }
}
