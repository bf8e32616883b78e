//! Which addresses a fetch by URL may connect to.
//!
//! [`classify`] puts an address in the special-purpose range it belongs to (IANA's IPv4 and
//! IPv6 special-purpose registries), or says it is ordinary public unicast. IPv6 forms that
//! carry an IPv4 address (IPv4-mapped, IPv4-compatible, IPv4-translated, NAT64 `64:ff9b::/96`
//! and 6to4 `2002::/16`) are judged by the IPv4 address they carry. [`Allowlist`] names the
//! addresses that may be reached anyway (`INGEST_FETCH_ALLOW`).

pub use crate::allowlist::{Allowlist, BadAllowEntry};
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{Ipv4Net, Ipv6Net};

/// A special-purpose range a fetch may not reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Range {
    /// `0.0.0.0`, `::`: on Linux a connect to it reaches this host.
    Unspecified,
    /// `0.0.0.0/8`, "this network".
    ThisNetwork,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// RFC 1918: `10/8`, `172.16/12`, `192.168/16`.
    Private,
    /// RFC 6598 carrier-grade NAT, `100.64/10`.
    SharedAddressSpace,
    /// `169.254/16` (cloud metadata services live here), `fe80::/10`.
    LinkLocal,
    /// `192.0.0.0/24`, `2001::/23` (IETF protocol assignments, DS-Lite, ORCHID, …).
    IetfProtocol,
    /// `2001::/32`, Teredo: carries arbitrary IPv4 addresses, obfuscated.
    Teredo,
    /// TEST-NET-1/2/3, `2001:db8::/32`, `3fff::/20`.
    Documentation,
    /// `198.18/15`, `2001:2::/48`.
    Benchmarking,
    /// `192.88.99.0/24`, the deprecated 6to4 relay anycast.
    Relay6to4,
    /// `224/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `240/4`, reserved for future use.
    Reserved,
    /// `fc00::/7`, unique local (the IPv6 private range).
    UniqueLocal,
    /// `fec0::/10`, deprecated site-local.
    SiteLocal,
    /// `100::/64`, discard-only.
    Discard,
    /// `64:ff9b:1::/48`, NAT64 for local use: the operator decides what it translates to.
    Nat64LocalUse,
    /// Outside `2000::/3`, the only IPv6 space allocated for global unicast.
    NotGlobalUnicast,
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Unspecified => "unspecified",
            Self::ThisNetwork => "\"this network\" (0.0.0.0/8)",
            Self::Loopback => "loopback",
            Self::Private => "private (RFC 1918)",
            Self::SharedAddressSpace => "carrier-grade NAT (100.64.0.0/10)",
            Self::LinkLocal => "link-local",
            Self::IetfProtocol => "IETF protocol assignment",
            Self::Teredo => "Teredo (2001::/32)",
            Self::Documentation => "documentation",
            Self::Benchmarking => "benchmarking",
            Self::Relay6to4 => "6to4 relay anycast (192.88.99.0/24)",
            Self::Multicast => "multicast",
            Self::Broadcast => "broadcast",
            Self::Reserved => "reserved (240.0.0.0/4)",
            Self::UniqueLocal => "unique local (fc00::/7)",
            Self::SiteLocal => "site-local (fec0::/10)",
            Self::Discard => "discard-only (100::/64)",
            Self::Nat64LocalUse => "local-use NAT64 (64:ff9b:1::/48)",
            Self::NotGlobalUnicast => "outside IPv6 global unicast (2000::/3)",
        })
    }
}

/// How an IPv6 address carries an IPv4 one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Embedding {
    /// `::ffff:a.b.c.d`: a dual-stack socket connects to the IPv4 address itself.
    Mapped,
    /// `::a.b.c.d`, deprecated.
    Compatible,
    /// `::ffff:0:a.b.c.d` (SIIT).
    Translated,
    /// `64:ff9b::a.b.c.d`, the NAT64 well-known prefix.
    Nat64,
    /// `2002:aabb:ccdd::/48`, 6to4.
    SixToFour,
}

impl fmt::Display for Embedding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Mapped => "IPv4-mapped",
            Self::Compatible => "IPv4-compatible",
            Self::Translated => "IPv4-translated",
            Self::Nat64 => "NAT64",
            Self::SixToFour => "6to4",
        })
    }
}

/// Why an address is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The address is in this range.
    In(Range),
    /// An IPv6 address carrying an IPv4 address that is in this range.
    Embeds(Embedding, Ipv4Addr, Range),
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::In(range) => write!(f, "{range}"),
            Self::Embeds(how, v4, range) => write!(f, "{how} form of {v4}, which is {range}"),
        }
    }
}

const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8) -> Ipv4Net {
    Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len)
}

const fn v6(s: [u16; 8], len: u8) -> Ipv6Net {
    Ipv6Net::new_assert(
        Ipv6Addr::new(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]),
        len,
    )
}

/// Refused IPv4 ranges, most specific first.
const V4_REFUSED: &[(Ipv4Net, Range)] = &[
    (v4(0, 0, 0, 0, 32), Range::Unspecified),
    (v4(0, 0, 0, 0, 8), Range::ThisNetwork),
    (v4(10, 0, 0, 0, 8), Range::Private),
    (v4(100, 64, 0, 0, 10), Range::SharedAddressSpace),
    (v4(127, 0, 0, 0, 8), Range::Loopback),
    (v4(169, 254, 0, 0, 16), Range::LinkLocal),
    (v4(172, 16, 0, 0, 12), Range::Private),
    (v4(192, 0, 0, 0, 24), Range::IetfProtocol),
    (v4(192, 0, 2, 0, 24), Range::Documentation),
    (v4(192, 88, 99, 0, 24), Range::Relay6to4),
    (v4(192, 168, 0, 0, 16), Range::Private),
    (v4(198, 18, 0, 0, 15), Range::Benchmarking),
    (v4(198, 51, 100, 0, 24), Range::Documentation),
    (v4(203, 0, 113, 0, 24), Range::Documentation),
    (v4(224, 0, 0, 0, 4), Range::Multicast),
    (v4(255, 255, 255, 255, 32), Range::Broadcast),
    (v4(240, 0, 0, 0, 4), Range::Reserved),
];

/// Refused IPv6 ranges, most specific first; everything outside `2000::/3` is refused too.
const V6_REFUSED: &[(Ipv6Net, Range)] = &[
    (v6([0, 0, 0, 0, 0, 0, 0, 0], 128), Range::Unspecified),
    (v6([0, 0, 0, 0, 0, 0, 0, 1], 128), Range::Loopback),
    (v6([0x100, 0, 0, 0, 0, 0, 0, 0], 64), Range::Discard),
    (
        v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48),
        Range::Nat64LocalUse,
    ),
    (v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32), Range::Teredo),
    (v6([0x2001, 2, 0, 0, 0, 0, 0, 0], 48), Range::Benchmarking),
    (v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23), Range::IetfProtocol),
    (
        v6([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32),
        Range::Documentation,
    ),
    (v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20), Range::Documentation),
    (v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7), Range::UniqueLocal),
    (v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), Range::LinkLocal),
    (v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), Range::SiteLocal),
    (v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), Range::Multicast),
];

const GLOBAL_UNICAST: Ipv6Net = v6([0x2000, 0, 0, 0, 0, 0, 0, 0], 3);

/// The refused range `ip` is in, or `None` for an ordinary public unicast address.
pub fn classify(ip: IpAddr) -> Option<Refused> {
    match ip {
        IpAddr::V4(ip) => classify_v4(ip).map(Refused::In),
        IpAddr::V6(ip) => classify_v6(ip),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Range> {
    V4_REFUSED
        .iter()
        .find(|(net, _)| net.contains(&ip))
        .map(|&(_, range)| range)
}

fn classify_v6(ip: Ipv6Addr) -> Option<Refused> {
    if let Some((how, v4)) = embedded_v4(ip) {
        match (classify_v4(v4), how) {
            (Some(range), _) => return Some(Refused::Embeds(how, v4, range)),
            // These reach the public IPv4 address they carry (a dual-stack socket, a DNS64
            // network's NAT64 gateway, a 6to4 relay).
            (None, Embedding::Mapped | Embedding::Nat64 | Embedding::SixToFour) => return None,
            // Deprecated forms nothing serves on: refused below as outside 2000::/3.
            (None, Embedding::Compatible | Embedding::Translated) => {}
        }
    }
    if let Some(&(_, range)) = V6_REFUSED.iter().find(|(net, _)| net.contains(&ip)) {
        return Some(Refused::In(range));
    }
    (!GLOBAL_UNICAST.contains(&ip)).then_some(Refused::In(Range::NotGlobalUnicast))
}

/// The IPv4 address an IPv6 address carries, and how.
fn embedded_v4(ip: Ipv6Addr) -> Option<(Embedding, Ipv4Addr)> {
    let s = ip.segments();
    let low = Ipv4Addr::from(u128::from(ip) as u32);
    match s {
        [0, 0, 0, 0, 0, 0xffff, _, _] => Some((Embedding::Mapped, low)),
        // `::` and `::1` are themselves, not IPv4-compatible forms of 0.0.0.0 and 0.0.0.1.
        [0, 0, 0, 0, 0, 0, 0, 0 | 1] => None,
        [0, 0, 0, 0, 0, 0, _, _] => Some((Embedding::Compatible, low)),
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some((Embedding::Translated, low)),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some((Embedding::Nat64, low)),
        [0x2002, hi, lo, ..] => Some((
            Embedding::SixToFour,
            Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo)),
        )),
        _ => None,
    }
}

impl Allowlist {
    /// Whether a fetch may connect to `ip`: public unicast, or named here.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        match classify(ip) {
            Some(refused) if !self.contains(ip) => Err(refused),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
