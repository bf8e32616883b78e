//! Which addresses a fetch by URL may connect to.
//!
//! [`classify`] puts an address in the special-purpose range it belongs to (IANA's IPv4 and
//! IPv6 special-purpose registries), or says it is ordinary public unicast. IPv6 forms that
//! carry an IPv4 address (IPv4-mapped, IPv4-compatible, IPv4-translated, NAT64 `64:ff9b::/96`
//! and 6to4 `2002::/16`) are judged by the IPv4 address they carry. [`Allowlist`] names the
//! addresses that may be reached anyway (`INGEST_FETCH_ALLOW`).

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

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

    /// Whether a fetch may connect to `ip`: public unicast, or named here.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        match classify(ip) {
            Some(refused) if !self.contains(ip) => Err(refused),
            _ => Ok(()),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn class(s: &str) -> Option<Refused> {
        classify(ip(s))
    }

    #[test]
    fn public_unicast_is_allowed() {
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.215.14",
            "100.63.255.255",  // just below carrier-grade NAT
            "100.128.0.0",     // just above it
            "172.15.255.255",  // just below 172.16/12
            "172.32.0.0",      // just above it
            "192.0.1.1",       // between 192.0.0/24 and TEST-NET-1
            "198.17.255.255",  // below benchmarking
            "198.20.0.0",      // above it
            "223.255.255.255", // last unicast before multicast
            "2606:4700:4700::1111",
            "2a00:1450:4001:80b::200e",
            "2001:200::1", // first allocation after 2001::/23
        ] {
            assert_eq!(class(a), None, "{a} is public");
        }
    }

    #[test]
    fn refused_ipv4_ranges() {
        use Range::*;
        for (a, want) in [
            ("0.0.0.0", Unspecified),
            ("0.1.2.3", ThisNetwork),
            ("10.0.0.1", Private),
            ("10.255.255.255", Private),
            ("100.64.0.1", SharedAddressSpace),
            ("100.127.255.255", SharedAddressSpace),
            ("127.0.0.1", Loopback),
            ("127.255.255.254", Loopback),
            ("169.254.169.254", LinkLocal),
            ("172.16.0.1", Private),
            ("172.31.255.255", Private),
            ("192.0.0.170", IetfProtocol),
            ("192.0.2.1", Documentation),
            ("192.88.99.1", Relay6to4),
            ("192.168.1.1", Private),
            ("198.18.0.1", Benchmarking),
            ("198.19.255.255", Benchmarking),
            ("198.51.100.7", Documentation),
            ("203.0.113.9", Documentation),
            ("224.0.0.1", Multicast),
            ("239.255.255.250", Multicast),
            ("240.0.0.1", Reserved),
            ("255.255.255.254", Reserved),
            ("255.255.255.255", Broadcast),
        ] {
            assert_eq!(class(a), Some(Refused::In(want)), "{a}");
        }
    }

    #[test]
    fn refused_ipv6_ranges() {
        use Range::*;
        for (a, want) in [
            ("::", Unspecified),
            ("::1", Loopback),
            ("fe80::1", LinkLocal),
            ("febf:ffff::1", LinkLocal),
            ("fc00::1", UniqueLocal),
            ("fd12:3456:789a::1", UniqueLocal),
            ("fec0::1", SiteLocal),
            ("ff02::1", Multicast),
            ("ff0e::101", Multicast),
            ("100::1", Discard),
            ("64:ff9b:1::a00:1", Nat64LocalUse),
            ("2001:db8::1", Documentation),
            ("3fff::1", Documentation),
            ("2001:2::1", Benchmarking),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", Teredo),
            ("2001:10::1", IetfProtocol),
            ("2001:1ff::1", IetfProtocol),
            ("5f00::1", NotGlobalUnicast),
            ("4000::1", NotGlobalUnicast),
            ("1::1", NotGlobalUnicast),
            ("::2:0:0:1", NotGlobalUnicast),
        ] {
            assert_eq!(class(a), Some(Refused::In(want)), "{a}");
        }
    }

    #[test]
    fn ipv6_forms_of_ipv4_are_judged_by_the_ipv4_address() {
        use {Embedding::*, Range::*};
        let embeds = |how, v4: &str, range| Some(Refused::Embeds(how, v4.parse().unwrap(), range));
        // Refused IPv4 addresses, in every IPv6 form.
        assert_eq!(
            class("::ffff:127.0.0.1"),
            embeds(Mapped, "127.0.0.1", Loopback)
        );
        assert_eq!(
            class("::ffff:7f00:1"),
            embeds(Mapped, "127.0.0.1", Loopback)
        );
        assert_eq!(
            class("::ffff:10.1.2.3"),
            embeds(Mapped, "10.1.2.3", Private)
        );
        assert_eq!(
            class("::ffff:169.254.169.254"),
            embeds(Mapped, "169.254.169.254", LinkLocal)
        );
        assert_eq!(
            class("::ffff:0.0.0.0"),
            embeds(Mapped, "0.0.0.0", Unspecified)
        );
        assert_eq!(
            class("::127.0.0.1"),
            embeds(Compatible, "127.0.0.1", Loopback)
        );
        assert_eq!(
            class("::192.168.0.1"),
            embeds(Compatible, "192.168.0.1", Private)
        );
        assert_eq!(
            class("::ffff:0:10.0.0.1"),
            embeds(Translated, "10.0.0.1", Private)
        );
        assert_eq!(
            class("64:ff9b::127.0.0.1"),
            embeds(Nat64, "127.0.0.1", Loopback)
        );
        assert_eq!(
            class("64:ff9b::a9fe:a9fe"),
            embeds(Nat64, "169.254.169.254", LinkLocal)
        );
        assert_eq!(
            class("2002:7f00:1::"),
            embeds(SixToFour, "127.0.0.1", Loopback)
        );
        assert_eq!(
            class("2002:c0a8:101::1"),
            embeds(SixToFour, "192.168.1.1", Private)
        );
        assert_eq!(
            class("2002:6440:1::1"),
            embeds(SixToFour, "100.64.0.1", SharedAddressSpace)
        );
        // Public IPv4 addresses: reachable through the forms that really reach them...
        assert_eq!(class("::ffff:8.8.8.8"), None);
        assert_eq!(class("64:ff9b::808:808"), None);
        assert_eq!(class("2002:808:808::1"), None);
        // ...and refused in the deprecated forms nothing serves on.
        assert_eq!(class("::8.8.8.8"), Some(Refused::In(NotGlobalUnicast)));
        assert_eq!(
            class("::ffff:0:8.8.8.8"),
            Some(Refused::In(NotGlobalUnicast))
        );
    }

    #[test]
    fn the_reason_names_the_range_and_the_embedded_address() {
        assert_eq!(class("127.0.0.1").unwrap().to_string(), "loopback");
        assert_eq!(
            class("::ffff:10.0.0.1").unwrap().to_string(),
            "IPv4-mapped form of 10.0.0.1, which is private (RFC 1918)"
        );
    }

    #[test]
    fn allowlist_parses_ips_and_networks() {
        let allow: Allowlist = "127.0.0.1/32, ::1 ,10.1.0.0/16,,192.168.7.9/24"
            .parse()
            .unwrap();
        assert_eq!(
            allow.to_string(),
            "127.0.0.1/32,::1/128,10.1.0.0/16,192.168.7.0/24",
            "bare addresses are host networks; host bits are cleared"
        );
        assert!(Allowlist::from_str("").unwrap().is_empty());
        assert!(Allowlist::from_str(" , ").unwrap().is_empty());
    }

    #[test]
    fn allowlist_rejects_bad_entries() {
        for (input, bad) in [
            ("localhost", "localhost"),
            ("127.0.0.1,nope", "nope"),
            ("10.0.0.0/33", "10.0.0.0/33"),
            ("::1/129", "::1/129"),
            ("10.0.0.0/", "10.0.0.0/"),
            ("/8", "/8"),
            ("10.0.0/8", "10.0.0/8"),
            ("127.0.0.1:80", "127.0.0.1:80"),
            ("[::1]", "[::1]"),
            ("10.0.0.0/-1", "10.0.0.0/-1"),
            ("10.0.0.0/8/8", "10.0.0.0/8/8"),
            ("0x7f000001", "0x7f000001"),
        ] {
            assert_eq!(
                Allowlist::from_str(input),
                Err(BadAllowEntry(bad.into())),
                "{input}"
            );
        }
        let e = Allowlist::from_str("nope").unwrap_err().to_string();
        assert!(e.contains("\"nope\""), "{e}");
    }

    #[test]
    fn allowlist_admits_only_what_it_names() {
        let allow: Allowlist = "127.0.0.1/32,::1,10.1.0.0/16".parse().unwrap();
        for a in [
            "127.0.0.1",
            "::1",
            "10.1.255.255",
            "::ffff:127.0.0.1",
            "8.8.8.8",
        ] {
            assert_eq!(allow.check(ip(a)), Ok(()), "{a}");
        }
        for a in [
            "127.0.0.2",
            "10.2.0.1",
            "169.254.169.254",
            "::ffff:127.0.0.2",
            "64:ff9b::127.0.0.1", // only the mapped form shares an IPv4 entry
            "fe80::1",
            "0.0.0.0",
            "::",
        ] {
            assert!(allow.check(ip(a)).is_err(), "{a}");
        }
        let none = Allowlist::default();
        assert!(none.check(ip("127.0.0.1")).is_err());
        assert!(none.check(ip("8.8.8.8")).is_ok());
        // A network in one family does not admit the other.
        let v6: Allowlist = "::/0".parse().unwrap();
        assert!(v6.check(ip("::1")).is_ok());
        assert!(v6.check(ip("127.0.0.1")).is_err());
    }
}
