//! Header mode: believing `X-User-Id` without a token, for a developer's own machine (or a
//! gateway behind an authenticating proxy, with `force`).
//!
//! Off unless asked for. When asked for (`loopback`), it is decided per request from what the
//! connection shows, never from the address the gateway listens on: the peer must be a loopback
//! address; the request must carry no forwarding header and must not be HTTP/1.0 (what a proxy
//! on the same host adds, or speaks upstream by default: such a proxy would otherwise turn every
//! remote caller into a loopback peer); and its `Host` must name the listener itself by a
//! loopback name (a page on another site that resolves its own name to 127.0.0.1 — DNS
//! rebinding — sends its own name). Roles are never taken from a header in that mode: an admin
//! needs a token.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, header, request::Parts};

use super::{AuthError, Caller};

/// Header naming the acting user in header mode.
pub const USER_HEADER: &str = "x-user-id";
/// Header granting roles in header mode with `force` only.
pub const ROLES_HEADER: &str = "x-user-roles";

/// Whether (and from whom) `X-User-Id` is believed (`GATEWAY_TRUST_USER_HEADER`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TrustHeader {
    /// Never (the default): every caller proves who it is with a token.
    #[default]
    Off,
    /// From a direct loopback peer only, without forwarding headers, with a `Host` naming the
    /// listener; roles never.
    Loopback,
    /// From anyone, with roles: only for a gateway that nothing but an authenticating proxy can
    /// reach (that proxy sets the headers itself).
    Force,
}

impl std::str::FromStr for TrustHeader {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "false" | "off" | "no" | "0" => Ok(Self::Off),
            "loopback" | "true" | "on" | "yes" | "1" => Ok(Self::Loopback),
            "force" => Ok(Self::Force),
            other => Err(format!("{other:?} is not one of off, loopback, force")),
        }
    }
}

/// The two ends of the connection a request came on, attached by the server to every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Who connected.
    pub remote: SocketAddr,
    /// The address it connected to (this listener's, as the peer dialled it).
    pub local: SocketAddr,
}

/// Headers a proxy adds: a request carrying one came through something that may have
/// connected on behalf of anyone.
fn forwarded_by(headers: &HeaderMap) -> Option<String> {
    headers.keys().find_map(|name| {
        let n = name.as_str();
        (n == "forwarded" || n == "via" || n == "x-real-ip" || n.starts_with("x-forwarded-"))
            .then(|| n.to_owned())
    })
}

/// Whether `authority` (`Host`, or HTTP/2's `:authority`) names the listener at `local` by a
/// loopback name: `localhost`, or a loopback IP literal, with the listener's port.
pub(super) fn names_listener(authority: &str, local: SocketAddr) -> bool {
    let Ok(auth) = authority.parse::<axum::http::uri::Authority>() else {
        return false;
    };
    let port = auth.port_u16().unwrap_or(80);
    if port != local.port() {
        return false;
    }
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The caller a header names, if `mode` believes it for this request: `Ok(None)` when the
/// request names nobody, an error saying why when it names someone who is not believed.
pub(super) fn identify(mode: TrustHeader, parts: &Parts) -> Result<Option<Caller>, AuthError> {
    let Some(value) = parts.headers.get(USER_HEADER) else {
        return Ok(None);
    };
    match mode {
        TrustHeader::Off => return Ok(None),
        TrustHeader::Force => {}
        TrustHeader::Loopback => {
            let peer = parts.extensions.get::<Peer>();
            let Some(peer) = peer.filter(|p| p.remote.ip().is_loopback()) else {
                return Err(AuthError::HeaderRefused(
                    "the caller is not on this machine".into(),
                ));
            };
            // What a proxy speaks upstream by default (nginx, for one); no browser or curl
            // sends it.
            if parts.version < axum::http::Version::HTTP_11 {
                return Err(AuthError::HeaderRefused(
                    "HTTP/1.0 is what proxies speak upstream".into(),
                ));
            }
            if let Some(name) = forwarded_by(&parts.headers) {
                return Err(AuthError::HeaderRefused(format!(
                    "the request came through a proxy ({name})"
                )));
            }
            let authority = parts
                .uri
                .authority()
                .map(|a| a.as_str().to_owned())
                .or_else(|| {
                    parts
                        .headers
                        .get(header::HOST)
                        .and_then(|h| h.to_str().ok())
                        .map(str::to_owned)
                });
            if !authority.is_some_and(|a| names_listener(&a, peer.local)) {
                return Err(AuthError::HeaderRefused(
                    "its Host does not name this gateway by a loopback name".into(),
                ));
            }
        }
    }
    let user = value.to_str().unwrap_or_default();
    if !ecoscan_common::identity::valid_user_id(user) {
        return Err(AuthError::BadUserHeader);
    }
    // Roles from a header only where a proxy that authenticates sets them.
    let admin = mode == TrustHeader::Force
        && parts
            .headers
            .get(ROLES_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|roles| roles.split(',').any(|r| r.trim() == "admin"));
    Ok(Some(Caller {
        user: user.to_owned(),
        admin,
    }))
}

#[cfg(test)]
mod tests {
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
}
