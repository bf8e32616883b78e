use super::*;

fn parts(headers: &[(&str, &str)], remote: &str, local: &str) -> Parts {
    let mut req = axum::http::Request::builder().uri("/api/v1/characters/me");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut parts = req.body(()).unwrap().into_parts().0;
    parts.extensions.insert(Peer {
        remote: remote.parse().unwrap(),
        local: local.parse().unwrap(),
    });
    parts
}

const LOCAL: &str = "127.0.0.1:8080";

fn user(
    mode: TrustHeader,
    headers: &[(&str, &str)],
    remote: &str,
) -> Result<Option<Caller>, AuthError> {
    identify(mode, &parts(headers, remote, LOCAL))
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
        identify(TrustHeader::Loopback, &p)
            .unwrap_err()
            .to_string()
            .contains("HTTP/1.0")
    );
    // No connection information at all (a router used without the server): refused.
    let mut p = parts(&base, "127.0.0.1:1", LOCAL);
    p.extensions.clear();
    assert!(identify(TrustHeader::Loopback, &p).is_err());
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
