use super::*;

fn check(url: &str, allow: &str) -> Result<(), Failure> {
    check_url(&Url::parse(url).unwrap(), &allow.parse().unwrap())
}

#[test]
fn urls_need_http_or_https_and_no_user_info() {
    assert!(check("http://8.8.8.8/a.png", "").is_ok());
    assert!(check("https://8.8.8.8:8443/a.png", "").is_ok());
    assert!(check("https://images.example.com/a.png", "").is_ok());
    for bad in [
        "ftp://8.8.8.8/a.png",
        "file:///etc/passwd",
        "gopher://8.8.8.8:70/_",
        "data:image/png;base64,AAAA",
        "http://user@8.8.8.8/a.png",
        "http://user:pw@8.8.8.8/a.png",
        "http://:pw@8.8.8.8/a.png",
    ] {
        assert!(check(bad, "").is_err(), "{bad}");
    }
}

#[test]
fn ip_literal_hosts_are_checked_in_every_spelling() {
    for bad in [
        "http://127.0.0.1/",
        "http://127.1/",
        "http://2130706433/",
        "http://0x7f.0.0.1/",
        "http://0177.0.0.1/",
        "http://0.0.0.0:8080/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/",
        "http://100.64.1.1/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://[64:ff9b::10.0.0.1]/",
        "http://[2002:a00:1::]/",
        "http://[fe80::1]/",
        "http://[fd00::1]/",
        "http://[::]/",
    ] {
        match check(bad, "") {
            Err(Failure::Address { .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
    // The allowlist opens exactly what it names, in any spelling.
    assert!(check("http://127.1:9/", "127.0.0.1/32").is_ok());
    assert!(check("http://[::ffff:127.0.0.1]:9/", "127.0.0.1/32").is_ok());
    assert!(check("http://127.0.0.2:9/", "127.0.0.1/32").is_err());
    assert!(check("http://[::1]:9/", "127.0.0.1/32").is_err());
    assert!(check("http://[::1]:9/", "::1").is_ok());
}

#[test]
fn resolved_addresses_are_refused_if_any_is_refused() {
    let sa = |s: &str| -> SocketAddr { s.parse().unwrap() };
    let none = Allowlist::default();
    let public = vec![sa("8.8.8.8:0"), sa("[2606:4700::1111]:0")];
    assert_eq!(check_resolved("x", public.clone(), &none).unwrap(), public);
    let mixed = vec![sa("8.8.8.8:0"), sa("10.0.0.1:0")];
    let e = check_resolved("evil.example", mixed, &none).unwrap_err();
    assert_eq!(
        e.to_string(),
        "evil.example resolves to 10.0.0.1, which is private (RFC 1918)"
    );
    assert!(matches!(
        check_resolved("x", vec![], &none),
        Err(ResolveError::NoAddresses { .. })
    ));
    let loopback = vec![sa("127.0.0.1:0"), sa("[::1]:0")];
    assert!(check_resolved("localhost", loopback.clone(), &none).is_err());
    let only_v4: Allowlist = "127.0.0.1/32".parse().unwrap();
    assert!(check_resolved("localhost", loopback.clone(), &only_v4).is_err());
    let both: Allowlist = "127.0.0.1/32,::1".parse().unwrap();
    assert_eq!(
        check_resolved("localhost", loopback.clone(), &both).unwrap(),
        loopback
    );
}

#[test]
fn the_log_reason_carries_the_sources() {
    let inner = ResolveError::Refused {
        host: "h".into(),
        ip: "127.0.0.1".parse().unwrap(),
        refused: Refused::In(addr::Range::Loopback),
    };
    #[derive(Debug, thiserror::Error)]
    #[error("connect failed")]
    struct Outer(#[source] ResolveError);
    assert_eq!(
        chain(&Outer(inner)),
        "connect failed: h resolves to 127.0.0.1, which is loopback"
    );
}
