use super::*;

fn parts(headers: &[(&str, &str)], remote: &str, local: &str) -> Parts {
    let mut req = axum::http::Request::builder().uri("/api/v1/characters/me");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut parts = req.body(()).unwrap().into_parts().0;
    let remote: std::net::SocketAddr = remote.parse().unwrap();
    parts.extensions.insert(Peer {
        remote,
        local: local.parse().unwrap(),
        via: None,
    });
    parts.extensions.insert(ClientAddr {
        ip: remote.ip(),
        proxied: false,
    });
    parts
}

/// The peer's process runs as the gateway's user.
fn own(_: SocketAddr, _: SocketAddr) -> Result<bool, String> {
    Ok(true)
}

const LOCAL: &str = "127.0.0.1:8080";

fn user(
    mode: TrustHeader,
    headers: &[(&str, &str)],
    remote: &str,
) -> Result<Option<Caller>, AuthError> {
    identify_with(mode, &parts(headers, remote, LOCAL), own)
}

#[test]
fn modes_parse_and_bad_ones_are_named() {
    assert_eq!("".parse::<TrustHeader>(), Ok(TrustHeader::Off));
    assert_eq!("TRUE".parse::<TrustHeader>(), Ok(TrustHeader::Loopback));
    assert_eq!("loopback".parse::<TrustHeader>(), Ok(TrustHeader::Loopback));
    assert_eq!("off".parse::<TrustHeader>(), Ok(TrustHeader::Off));
    assert_eq!("force".parse::<TrustHeader>(), Ok(TrustHeader::Force));
    assert!("auto".parse::<TrustHeader>().unwrap_err().contains("auto"));
}

#[test]
fn off_believes_nobody() {
    let h = [("x-user-id", "mallory"), ("host", LOCAL)];
    assert_eq!(user(TrustHeader::Off, &h, "127.0.0.1:5000"), Ok(None));
}

#[test]
fn loopback_believes_a_direct_local_peer_that_names_the_listener_but_never_its_roles() {
    let ok = |host: &str| {
        user(
            TrustHeader::Loopback,
            &[
                ("x-user-id", "ann"),
                ("x-user-roles", "admin"),
                ("host", host),
            ],
            "127.0.0.1:5000",
        )
    };
    for host in [
        "127.0.0.1:8080",
        "localhost:8080",
        "LOCALHOST:8080",
        "127.0.0.2:8080",
        "[::1]:8080",
    ] {
        assert_eq!(
            ok(host),
            Ok(Some(Caller {
                user: "ann".into(),
                admin: false
            })),
            "{host}"
        );
    }
    // DNS rebinding: another site's name, or the right name on another port.
    for host in [
        "evil.example:8080",
        "127.0.0.1:9090",
        "127.0.0.1",
        "localhost.evil.example:8080",
        "10.0.0.1:8080",
        "",
    ] {
        assert!(
            matches!(ok(host), Err(AuthError::HeaderRefused(_))),
            "{host:?}"
        );
    }
}

#[test]
fn loopback_refuses_remote_peers_and_anything_forwarded() {
    let base = [("x-user-id", "ann"), ("host", LOCAL)];
    assert!(matches!(
        user(TrustHeader::Loopback, &base, "192.0.2.7:5000"),
        Err(AuthError::HeaderRefused(_))
    ));
    for fwd in [
        "x-forwarded-for",
        "X-Forwarded-Host",
        "x-forwarded-proto",
        "forwarded",
        "x-real-ip",
        "via",
    ] {
        let mut h = base.to_vec();
        h.push((fwd, "203.0.113.9"));
        let e = user(TrustHeader::Loopback, &h, "127.0.0.1:5000").unwrap_err();
        assert!(e.to_string().contains("proxy"), "{fwd}: {e}");
    }
    // HTTP/1.0, as nginx proxies by default: refused.
    let mut p = parts(&base, "127.0.0.1:5000", LOCAL);
    p.version = axum::http::Version::HTTP_10;
    assert!(
        identify_with(TrustHeader::Loopback, &p, own)
            .unwrap_err()
            .to_string()
            .contains("HTTP/1.0")
    );
    // No connection information at all (a router used without the server): refused.
    let mut p = parts(&base, "127.0.0.1:1", LOCAL);
    p.extensions.clear();
    assert!(identify_with(TrustHeader::Loopback, &p, own).is_err());
}

#[test]
fn force_believes_anyone_with_roles() {
    let h = [
        ("x-user-id", "ops"),
        ("x-user-roles", "reader, admin"),
        ("x-forwarded-for", "203.0.113.9"),
    ];
    assert_eq!(
        user(TrustHeader::Force, &h, "192.0.2.7:5000"),
        Ok(Some(Caller {
            user: "ops".into(),
            admin: true
        }))
    );
    assert_eq!(
        user(
            TrustHeader::Force,
            &[("x-user-id", "a b")],
            "192.0.2.7:5000"
        ),
        Err(AuthError::BadUserHeader)
    );
}

#[test]
fn loopback_refuses_a_proxy_however_it_connects_and_another_users_process() {
    let base = [("x-user-id", "ann"), ("host", LOCAL)];
    // A trusted proxy's request, named client or not.
    let mut p = parts(&base, "127.0.0.1:5000", LOCAL);
    p.extensions.insert(ClientAddr {
        ip: "127.0.0.1".parse().unwrap(),
        proxied: true,
    });
    let e = identify_with(TrustHeader::Loopback, &p, own).unwrap_err();
    assert!(e.to_string().contains("trusted proxy"), "{e}");
    // A connection whose PROXY header named a loopback client.
    let mut p = parts(&base, "127.0.0.1:5000", LOCAL);
    p.extensions.insert(Peer {
        remote: "127.0.0.1:5000".parse().unwrap(),
        local: LOCAL.parse().unwrap(),
        via: Some("127.0.0.1:6000".parse().unwrap()),
    });
    assert!(identify_with(TrustHeader::Loopback, &p, own).is_err());
    // A same-host proxy that adds nothing and passes the forged Host: its user gives it away.
    let p = parts(&base, "127.0.0.1:5000", LOCAL);
    let e = identify_with(TrustHeader::Loopback, &p, |_, _| Ok(false)).unwrap_err();
    assert!(e.to_string().contains("another user"), "{e}");
    // Not knowing who it is believes nobody.
    let e = identify_with(TrustHeader::Loopback, &p, |_, _| Err("no /proc".into())).unwrap_err();
    assert!(e.to_string().contains("no /proc"), "{e}");
    // A dual-stack listener's view of an IPv4 loopback peer is loopback too.
    let p = parts(&base, "[::ffff:127.0.0.1]:5000", LOCAL);
    assert!(
        identify_with(TrustHeader::Loopback, &p, own)
            .unwrap()
            .is_some()
    );
}
