use super::*;
use crate::config::ProxyProtocol;

fn proxies(trusted: &str, header: ForwardedHeader) -> ProxyConfig {
    ProxyConfig {
        trusted: crate::config::parse_trusted(trusted).unwrap(),
        header,
        protocol: ProxyProtocol::Off,
    }
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, v.parse().unwrap());
    }
    h
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn a_peer_that_is_no_trusted_proxy_is_the_client_whatever_it_sends() {
    let p = proxies("10.0.0.0/8", ForwardedHeader::XForwardedFor);
    let h = headers(&[("x-forwarded-for", "203.0.113.9")]);
    assert_eq!(
        client_addr(ip("192.0.2.1"), &h, &p),
        ClientAddr {
            ip: ip("192.0.2.1"),
            proxied: false
        }
    );
}

#[test]
fn the_first_untrusted_hop_from_the_right_is_the_client() {
    let p = proxies("10.0.0.0/8", ForwardedHeader::XForwardedFor);
    // The client forged the first element; the proxies appended the rest, the last one ours.
    let h = headers(&[
        ("x-forwarded-for", "198.51.100.7, 203.0.113.9"),
        ("x-forwarded-for", "10.1.1.1"),
    ]);
    assert_eq!(
        client_addr(ip("10.0.0.2"), &h, &p),
        ClientAddr {
            ip: ip("203.0.113.9"),
            proxied: true
        }
    );
    // Only trusted hops: the leftmost address is as far as anyone vouches.
    let h = headers(&[("x-forwarded-for", "10.9.9.9, 10.1.1.1")]);
    assert_eq!(client_addr(ip("10.0.0.2"), &h, &p).ip, ip("10.9.9.9"));
    // A proxy with nothing to say (its own health check) is the client itself, still proxied.
    assert_eq!(
        client_addr(ip("10.0.0.2"), &HeaderMap::new(), &p),
        ClientAddr {
            ip: ip("10.0.0.2"),
            proxied: true
        }
    );
}

#[test]
fn a_hop_that_is_not_an_address_stops_at_the_last_vouched_one() {
    let p = proxies("10.0.0.0/8", ForwardedHeader::XForwardedFor);
    let h = headers(&[("x-forwarded-for", "203.0.113.9, unknown, 10.1.1.1")]);
    assert_eq!(client_addr(ip("10.0.0.2"), &h, &p).ip, ip("10.1.1.1"));
    // Ports are allowed where proxies add them.
    let h = headers(&[("x-forwarded-for", "203.0.113.9:5123")]);
    assert_eq!(client_addr(ip("10.0.0.2"), &h, &p).ip, ip("203.0.113.9"));
}

#[test]
fn only_the_configured_header_is_read() {
    let xff = proxies("127.0.0.1", ForwardedHeader::XForwardedFor);
    let fwd = proxies("127.0.0.1", ForwardedHeader::Forwarded);
    // A proxy that sets X-Forwarded-For passes a client's own Forwarded through untouched.
    let h = headers(&[
        ("forwarded", "for=198.51.100.7"),
        ("x-forwarded-for", "203.0.113.9"),
    ]);
    assert_eq!(client_addr(ip("127.0.0.1"), &h, &xff).ip, ip("203.0.113.9"));
    assert_eq!(
        client_addr(ip("127.0.0.1"), &h, &fwd).ip,
        ip("198.51.100.7")
    );
}

#[test]
fn forwarded_for_takes_quoted_ipv6_with_ports_and_other_parameters() {
    let p = proxies("127.0.0.1", ForwardedHeader::Forwarded);
    let h = headers(&[(
        "forwarded",
        "for=192.0.2.43;proto=https, For=\"[2001:db8:cafe::17]:4711\";by=127.0.0.1",
    )]);
    assert_eq!(
        client_addr(ip("127.0.0.1"), &h, &p).ip,
        ip("2001:db8:cafe::17")
    );
    let h = headers(&[("forwarded", "for=_hidden, for=\"192.0.2.43:80\"")]);
    assert_eq!(client_addr(ip("127.0.0.1"), &h, &p).ip, ip("192.0.2.43"));
}

#[test]
fn a_proxy_header_names_the_client_or_nobody() {
    use ppp::v2::{Builder, Command, Protocol, Version};
    let client: SocketAddr = "203.0.113.9:40000".parse().unwrap();
    let gateway: SocketAddr = "10.0.0.5:8080".parse().unwrap();
    let header = Builder::with_addresses(
        Version::Two | Command::Proxy,
        Protocol::Stream,
        (client, gateway),
    )
    .build()
    .unwrap();
    assert_eq!(parse_proxy_header(&header).unwrap(), Some(client));
    let local = Builder::with_addresses(
        Version::Two | Command::Local,
        Protocol::Stream,
        ppp::v2::Addresses::Unspecified,
    )
    .build()
    .unwrap();
    assert_eq!(parse_proxy_header(&local).unwrap(), None);
    assert!(parse_proxy_header(b"GET / HTTP/1.1\r\n\r\n").is_err());
}

#[tokio::test]
async fn a_connection_is_read_past_its_proxy_header_and_no_further() {
    use ppp::v2::{Builder, Command, Protocol, Version};
    use tokio::io::AsyncWriteExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client: SocketAddr = "[2001:db8::9]:1234".parse().unwrap();
    let header = Builder::with_addresses(
        Version::Two | Command::Proxy,
        Protocol::Stream,
        (client, "[2001:db8::1]:80".parse::<SocketAddr>().unwrap()),
    )
    .build()
    .unwrap();
    let mut out = TcpStream::connect(addr).await.unwrap();
    out.write_all(&header).await.unwrap();
    out.write_all(b"GET /").await.unwrap();
    let (mut conn, _) = listener.accept().await.unwrap();
    let named = read_proxy_header(&mut conn, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(named, Some(client));
    let mut rest = [0u8; 5];
    conn.read_exact(&mut rest).await.unwrap();
    assert_eq!(&rest, b"GET /");

    // Plain HTTP where a header was due: refused; silence: cut at the deadline.
    let mut out = TcpStream::connect(addr).await.unwrap();
    out.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (mut conn, _) = listener.accept().await.unwrap();
    let err = read_proxy_header(&mut conn, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    let _silent = TcpStream::connect(addr).await.unwrap();
    let (mut conn, _) = listener.accept().await.unwrap();
    let err = read_proxy_header(&mut conn, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
}
