//! Header mode: believing `X-User-Id` without a token, for a developer's own machine (or a
//! gateway behind an authenticating proxy, with `force`).
//!
//! Off unless asked for. When asked for (`loopback`), it is decided per request by the
//! connection, never by anything the client sends: the peer must be a loopback address, not a
//! trusted proxy and not one that sent a PROXY header, and the process holding its socket must
//! run as the gateway's own user ([`owner`]: a proxy on the same machine — HAProxy, nginx — runs
//! as a user of its own, and would otherwise turn every remote caller into a loopback peer).
//! What the client sends can only make it refuse: a forwarding header or HTTP/1.0 (what a proxy
//! adds, or speaks upstream by default), or a `Host` that does not name the listener by a
//! loopback name (a page on another site that resolves its own name to 127.0.0.1 — DNS
//! rebinding — sends its own name). Roles are never taken from a header in that mode: an admin
//! needs a token.

mod owner;

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, header, request::Parts};

use super::{AuthError, Caller};
use crate::{config::TrustHeader, proxy::ClientAddr};

/// Header naming the acting user in header mode.
pub const USER_HEADER: &str = "x-user-id";
/// Header granting roles in header mode with `force` only.
pub const ROLES_HEADER: &str = "x-user-roles";

/// The two ends of the connection a request came on, attached by the server to every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Who connected.
    pub remote: SocketAddr,
    /// The address it connected to (this listener's, as the peer dialled it).
    pub local: SocketAddr,
    /// The trusted proxy that connected and named `remote` in a PROXY header; `None` for a
    /// direct connection (then `remote` is the TCP peer).
    pub via: Option<SocketAddr>,
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
    identify_with(mode, parts, owner::same_user)
}

/// [`identify`], with `same_user` telling whether the peer's process runs as the gateway's
/// user (tests decide it for connections that do not exist).
fn identify_with(
    mode: TrustHeader,
    parts: &Parts,
    same_user: impl Fn(SocketAddr, SocketAddr) -> Result<bool, String>,
) -> Result<Option<Caller>, AuthError> {
    let Some(value) = parts.headers.get(USER_HEADER) else {
        return Ok(None);
    };
    match mode {
        TrustHeader::Off => return Ok(None),
        TrustHeader::Force => {}
        TrustHeader::Loopback => {
            let peer = parts.extensions.get::<Peer>();
            let Some(peer) = peer.filter(|p| p.remote.ip().to_canonical().is_loopback()) else {
                return Err(AuthError::HeaderRefused(
                    "the caller is not on this machine".into(),
                ));
            };
            let proxied = parts
                .extensions
                .get::<ClientAddr>()
                .is_none_or(|c| c.proxied);
            if peer.via.is_some() || proxied {
                return Err(AuthError::HeaderRefused(
                    "the request came through a trusted proxy".into(),
                ));
            }
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
            match same_user(peer.remote, peer.local) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(AuthError::HeaderRefused(
                        "the connecting process runs as another user than the gateway, as a \
                         proxy on this machine does"
                            .into(),
                    ));
                }
                Err(why) => return Err(AuthError::HeaderRefused(why)),
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
mod tests;
