//! Who the client is when a proxy stands in front: the address the gateway's per-address
//! limits, logs and spans use ([`ClientAddr`]). A connection's peer is the client unless it is
//! a trusted proxy (`GATEWAY_TRUSTED_PROXIES`); then the client is named by the proxy — in a
//! PROXY protocol v2 header at the start of the connection ([`read_proxy_header`]), or in the
//! configured forwarding header of each request ([`client_addr`]), read from the right: each
//! trusted hop passes the word on, and the first untrusted one is the client. Nothing a client
//! sends can name another address: headers from any other peer are ignored.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use axum::http::{HeaderMap, HeaderName, header::FORWARDED};
use tokio::{io::AsyncReadExt as _, net::TcpStream};

use crate::config::{ForwardedHeader, ProxyConfig};

/// The client of a request as the gateway believes it, attached to every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr {
    pub ip: IpAddr,
    /// The connection came from a trusted proxy (which named the client in a PROXY header or a
    /// forwarding header, or named nobody: then `ip` is the proxy's own).
    pub proxied: bool,
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The client of a request that came from `peer` (the connection's client: its TCP peer, or
/// the address a trusted proxy's PROXY header named) with `headers`.
pub(crate) fn client_addr(peer: IpAddr, headers: &HeaderMap, proxies: &ProxyConfig) -> ClientAddr {
    if !proxies.trusts(peer) {
        return ClientAddr {
            ip: peer,
            proxied: false,
        };
    }
    let hops = match proxies.header {
        ForwardedHeader::XForwardedFor => forwarded_for(headers, &X_FORWARDED_FOR, xff_hop),
        ForwardedHeader::Forwarded => forwarded_for(headers, &FORWARDED, forwarded_hop),
    };
    // From the right: the hop a trusted proxy added last is the nearest. A hop that is not an
    // address (`unknown`, an obfuscated name, garbage a client sent) ends the walk at the last
    // address a trusted proxy vouched for.
    let mut client = ClientAddr {
        ip: peer,
        proxied: true,
    };
    for hop in hops.iter().rev() {
        let Some(ip) = *hop else { break };
        client = ClientAddr { ip, proxied: true };
        if !proxies.trusts(ip) {
            break;
        }
    }
    client
}

/// Every hop the `name` headers list, left to right, over all the header's lines.
fn forwarded_for(
    headers: &HeaderMap,
    name: &HeaderName,
    parse: fn(&str) -> Option<IpAddr>,
) -> Vec<Option<IpAddr>> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("\u{0}").split(','))
        .map(|hop| parse(hop.trim()))
        .collect()
}

/// An `X-Forwarded-For` element: an address, sometimes with a port.
fn xff_hop(hop: &str) -> Option<IpAddr> {
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<SocketAddr>().ok().map(|a| a.ip()))
}

/// A `Forwarded` element's `for=` (RFC 7239): `for=192.0.2.60`, `for="[2001:db8::1]:4711"`.
fn forwarded_hop(element: &str) -> Option<IpAddr> {
    let value = element.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        k.trim().eq_ignore_ascii_case("for").then_some(v.trim())
    })?;
    let value = value.trim_matches('"');
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    xff_hop(value)
}

/// The signature every PROXY protocol v2 header begins with.
const SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// The longest header accepted: the addresses and a few TLVs (HAProxy sends at most a few
/// hundred bytes); a longer one is refused rather than buffered.
const MAX_HEADER: usize = 1024;

/// Reads the PROXY protocol v2 header a trusted proxy opens `stream` with, within `deadline`:
/// the client's address (`None` for a `LOCAL` header: the proxy's own health check). Anything
/// else is an error, and the connection is closed: a proxy configured to send the header always
/// does, so a connection without one did not come through it.
pub(crate) async fn read_proxy_header(
    stream: &mut TcpStream,
    deadline: Duration,
) -> io::Result<Option<SocketAddr>> {
    let read = async {
        let mut buf = vec![0u8; 16];
        stream.read_exact(&mut buf).await?;
        if buf[..12] != SIGNATURE[..] {
            return Err(invalid(
                "the connection does not begin with a PROXY v2 header",
            ));
        }
        let len = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        if 16 + len > MAX_HEADER {
            return Err(invalid("the PROXY header is longer than 1 KiB"));
        }
        buf.resize(16 + len, 0);
        stream.read_exact(&mut buf[16..]).await?;
        parse_proxy_header(&buf)
    };
    tokio::time::timeout(deadline, read)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no PROXY header in time"))?
}

/// The client a whole PROXY v2 header names (`ppp` parses it).
fn parse_proxy_header(buf: &[u8]) -> io::Result<Option<SocketAddr>> {
    use ppp::v2::{Addresses, Command, Header};
    let header = Header::try_from(buf).map_err(|e| invalid(&format!("bad PROXY header: {e}")))?;
    if header.command == Command::Local {
        return Ok(None);
    }
    match header.addresses {
        Addresses::IPv4(a) => Ok(Some(SocketAddr::new(
            a.source_address.into(),
            a.source_port,
        ))),
        Addresses::IPv6(a) => Ok(Some(SocketAddr::new(
            a.source_address.into(),
            a.source_port,
        ))),
        // A proxy reached over a Unix socket or naming no family: no address to hold limits to.
        Addresses::Unix(_) | Addresses::Unspecified => Ok(None),
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

#[cfg(test)]
mod tests;
