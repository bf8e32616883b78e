//! The addresses a fetch by URL may reach although they are in a refused range
//! (`INGEST_FETCH_ALLOW`): a setting ([`crate::config`]) that the fetcher ([`crate::fetch`])
//! judges by. A leaf of its own, so that the two use it without using each other.

use std::{fmt, net::IpAddr, str::FromStr};

use ipnet::IpNet;

/// Addresses a fetch may reach although they are in a refused range (`INGEST_FETCH_ALLOW`):
/// IPs and CIDR networks, written comma-separated, e.g. `127.0.0.1/32,::1,10.1.0.0/16`.
/// An IPv4 entry also admits the IPv4-mapped IPv6 form of its addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowlist(Vec<IpNet>);

impl Allowlist {
    /// The networks, as parsed (host bits cleared).
    pub fn networks(&self) -> &[IpNet] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an entry names `ip` (or the IPv4 address of an IPv4-mapped `ip`).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let canonical = ip.to_canonical();
        self.0
            .iter()
            .any(|net| net.contains(&ip) || net.contains(&canonical))
    }
}

/// An `INGEST_FETCH_ALLOW` entry that is neither an IP address nor a CIDR network.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an IP address or a CIDR network (such as 127.0.0.1/32 or ::1)")]
pub struct BadAllowEntry(pub String);

impl FromStr for Allowlist {
    type Err = BadAllowEntry;

    /// Comma-separated entries; blanks around them and empty entries are ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let net = if entry.contains('/') {
                    entry.parse::<IpNet>().ok().map(|net| net.trunc())
                } else {
                    entry.parse::<IpAddr>().ok().map(IpNet::from)
                };
                net.ok_or_else(|| BadAllowEntry(entry.to_owned()))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }
}

impl fmt::Display for Allowlist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, net) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{net}")?;
        }
        Ok(())
    }
}
