use std::str::FromStr;

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
