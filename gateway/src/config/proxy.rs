//! Who stands between the gateway and its clients: the proxies whose word about a client's
//! address the gateway takes (`GATEWAY_TRUSTED_PROXIES`), the header they say it in
//! (`GATEWAY_TRUSTED_PROXY_HEADER`), and whether their connections open with a PROXY protocol
//! header instead (`GATEWAY_PROXY_PROTOCOL`).

use std::{net::IpAddr, str::FromStr};

use anyhow::ensure;
use ipnet::IpNet;

/// Which header a trusted proxy names the client in. Only one is read: a client can send the
/// other one itself, and a proxy that sets one passes the other through untouched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For` (HAProxy's `option forwardfor`, nginx's `$proxy_add_x_forwarded_for`).
    #[default]
    XForwardedFor,
    /// `Forwarded` (RFC 7239), its `for=` parameters.
    Forwarded,
}

impl FromStr for ForwardedHeader {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "x-forwarded-for" => Ok(Self::XForwardedFor),
            "forwarded" => Ok(Self::Forwarded),
            other => Err(format!(
                "{other:?} is not one of x-forwarded-for, forwarded"
            )),
        }
    }
}

/// Whether connections from a trusted proxy begin with a PROXY protocol header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProxyProtocol {
    /// No: a trusted proxy names the client in a header.
    #[default]
    Off,
    /// Version 2 (binary; HAProxy's `send-proxy-v2`, nginx stream's `proxy_protocol on` sends
    /// v1 and is not accepted): required on every connection from a trusted proxy.
    V2,
}

impl FromStr for ProxyProtocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "off" | "false" | "no" | "0" => Ok(Self::Off),
            "v2" => Ok(Self::V2),
            other => Err(format!("{other:?} is not one of off, v2")),
        }
    }
}

/// The proxy settings (see the gateway's `Config` for the variables).
#[derive(Clone, Debug, Default)]
pub struct ProxyConfig {
    /// Addresses of the proxies in front of the gateway. Empty (the default): nobody's word
    /// about another address is taken, and every forwarding header is ignored.
    pub trusted: Vec<IpNet>,
    pub header: ForwardedHeader,
    pub protocol: ProxyProtocol,
}

impl ProxyConfig {
    /// Whether `ip` is a trusted proxy. An IPv4 address mapped into IPv6 (a dual-stack
    /// listener's view of an IPv4 peer) is judged as the IPv4 address it is.
    pub fn trusts(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    pub(super) fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            self.protocol == ProxyProtocol::Off || !self.trusted.is_empty(),
            "GATEWAY_PROXY_PROTOCOL=v2 needs GATEWAY_TRUSTED_PROXIES: the addresses of the \
             proxies that send the header (a PROXY header from anyone else is never believed)"
        );
        Ok(())
    }
}

/// Parses `GATEWAY_TRUSTED_PROXIES`: comma-separated addresses (`10.0.0.7`) or networks
/// (`10.0.0.0/8`, `fd00::/8`).
pub(crate) fn parse_trusted(value: &str) -> anyhow::Result<Vec<IpNet>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    anyhow::anyhow!(
                        "GATEWAY_TRUSTED_PROXIES: {s:?} is not an IP address or a network such \
                         as 10.0.0.0/8"
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_proxies_are_addresses_and_networks() {
        let proxies = ProxyConfig {
            trusted: parse_trusted(" 10.0.0.0/8, 127.0.0.1 ,fd00::/8,").unwrap(),
            ..ProxyConfig::default()
        };
        assert!(proxies.trusts("10.1.2.3".parse().unwrap()));
        assert!(proxies.trusts("127.0.0.1".parse().unwrap()));
        assert!(!proxies.trusts("127.0.0.2".parse().unwrap()));
        assert!(proxies.trusts("fd00::1".parse().unwrap()));
        // A dual-stack listener sees an IPv4 proxy as ::ffff:10.0.0.1.
        assert!(proxies.trusts("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!proxies.trusts("192.0.2.1".parse().unwrap()));
        let err = parse_trusted("10.0.0.0/8,proxy.example").unwrap_err();
        assert!(err.to_string().contains("\"proxy.example\""), "{err}");
    }

    #[test]
    fn the_proxy_protocol_needs_trusted_proxies() {
        let mut c = ProxyConfig {
            protocol: ProxyProtocol::V2,
            ..ProxyConfig::default()
        };
        assert!(c.validate().is_err());
        c.trusted = parse_trusted("127.0.0.1").unwrap();
        c.validate().unwrap();
        assert!("v1".parse::<ProxyProtocol>().is_err());
        assert_eq!(
            "Forwarded".parse::<ForwardedHeader>(),
            Ok(ForwardedHeader::Forwarded)
        );
    }
}
