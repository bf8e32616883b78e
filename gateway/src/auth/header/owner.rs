//! Whose process holds the other end of a loopback connection: header mode `loopback` believes
//! `X-User-Id` only from a process of the gateway's own user. Address and headers cannot tell a
//! developer's `curl` from a proxy on the same machine that forwards anyone (HAProxy passes the
//! client's `Host` and adds no header unless told to); the owner of the connecting socket can:
//! Debian's HAProxy and nginx run as users of their own.
//!
//! The kernel answers "who owns the TCP socket with these two ends" over netlink (`sock_diag`,
//! one hash lookup; see [`diag`]); the peer's socket is the one whose local address is the
//! connection's remote end and whose remote address is the gateway's end. Where netlink is not
//! available the same answer is read from `/proc/net/tcp` and `/proc/net/tcp6`, which list
//! every socket of the network namespace: that costs time in proportion to all connections,
//! paid on every request, and a gateway holding a thousand connections would spend its
//! workers formatting and parsing those tables (it did: a fast client waited 10 s behind a
//! thousand slow ones).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::unix::fs::MetadataExt as _,
};

/// Whether the process at the other end of `remote` → `local` (a loopback connection) runs as
/// the gateway's own user; an error says why that cannot be told (then nothing is believed).
pub(super) fn same_user(remote: SocketAddr, local: SocketAddr) -> Result<bool, String> {
    let own = std::fs::metadata("/proc/self")
        .map_err(|e| format!("cannot read this process's user ({e})"))?
        .uid();
    let peer = peer_uid(remote, local)?;
    Ok(peer == own)
}

/// The uid owning the socket bound at `remote` and connected to `local`.
fn peer_uid(remote: SocketAddr, local: SocketAddr) -> Result<u32, String> {
    let (remote, local) = (canonical(remote), canonical(local));
    match diag::uid(remote, local) {
        Ok(Some(uid)) => return Ok(uid),
        Ok(None) => return Err("the kernel lists no socket at the connection's other end".into()),
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag is not available; reading /proc/net/tcp");
        }
    }
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table)
            .map_err(|e| format!("cannot read {table} to see who connected ({e})"))?;
        if let Some(uid) = find(&text, remote, local) {
            return Ok(uid);
        }
    }
    Err("the connecting socket is not in /proc/net/tcp".into())
}

/// An IPv4 address a dual-stack listener sees as `::ffff:a.b.c.d` is listed as IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// The uid of the line of `table` (`/proc/net/tcp` format) whose local address is `local_end`
/// and remote address `remote_end`.
fn find(table: &str, local_end: SocketAddr, remote_end: SocketAddr) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid …
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (l, r, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
        (parse_addr(l)? == local_end && parse_addr(r)? == remote_end)
            .then(|| uid.parse().ok())
            .flatten()
    })
}

/// `0100007F:1F90` (127.0.0.1:8080) or the 32-digit IPv6 form: the address as the kernel
/// prints it, in 32-bit words of host byte order, and the port in hex.
fn parse_addr(field: &str) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes)).to_canonical()
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// `sock_diag` over netlink: the kernel's own lookup of one TCP socket by its two ends
/// (`inet_diag_req_v2` without `NLM_F_DUMP`), answered with its `inet_diag_msg`, which holds
/// the owner's uid. Layouts from `linux/netlink.h` and `linux/inet_diag.h` (stable ABI).
mod diag {
    use std::{
        io,
        net::{IpAddr, SocketAddr},
    };

    use rustix::net::{
        AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType, netlink, recv, sendto,
        socket_with,
    };

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLMSG_ERROR: u16 = 2;
    const NLM_F_REQUEST: u16 = 1;
    const HEADER: usize = 16;
    /// `nlmsghdr` and `inet_diag_req_v2` (family, protocol, ext, pad, states, sockid).
    const REQUEST: usize = HEADER + 8 + SOCKID;
    /// `inet_diag_sockid`: ports, two 16-byte addresses, interface, cookie.
    const SOCKID: usize = 2 + 2 + 16 + 16 + 4 + 8;
    /// Where the uid sits in a reply: after the header, `inet_diag_msg`'s family, state,
    /// timer, retrans, sockid, expires, rqueue and wqueue.
    const UID_AT: usize = HEADER + 4 + SOCKID + 12;
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;
    const IPPROTO_TCP: u8 = 6;

    /// The uid owning the TCP socket bound at `own` and connected to `peer`; `None` when the
    /// kernel has no such socket; an error when netlink cannot be asked.
    pub(super) fn uid(own: SocketAddr, peer: SocketAddr) -> io::Result<Option<u32>> {
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::SOCK_DIAG),
        )?;
        // An IPv4 connection is held by an IPv4 socket, or by a dual-stack IPv6 one whose
        // addresses are IPv4-mapped.
        let families: &[u8] = match own.ip() {
            IpAddr::V4(_) => &[AF_INET, AF_INET6],
            IpAddr::V6(_) => &[AF_INET6],
        };
        for &family in families {
            sendto(
                &fd,
                &request(family, own, peer),
                SendFlags::empty(),
                &netlink::SocketAddrNetlink::new(0, 0),
            )?;
            let mut reply = [0u8; 1024];
            let n = recv(&fd, &mut reply, RecvFlags::empty())?.0;
            if let Some(uid) = answer(&reply[..n.min(reply.len())])? {
                return Ok(Some(uid));
            }
        }
        Ok(None)
    }

    fn request(family: u8, own: SocketAddr, peer: SocketAddr) -> [u8; REQUEST] {
        let mut m = [0u8; REQUEST];
        m[0..4].copy_from_slice(&(REQUEST as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        m[16] = family;
        m[17] = IPPROTO_TCP;
        // Every state: the lookup is by address, whatever the connection is doing.
        m[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
        let id = 24;
        m[id..id + 2].copy_from_slice(&own.port().to_be_bytes());
        m[id + 2..id + 4].copy_from_slice(&peer.port().to_be_bytes());
        m[id + 4..id + 20].copy_from_slice(&address(family, own.ip()));
        m[id + 20..id + 36].copy_from_slice(&address(family, peer.ip()));
        // Interface 0 (any), then INET_DIAG_NOCOOKIE.
        m[id + 40..id + 48].fill(0xff);
        m
    }

    /// An address as `inet_diag_sockid` holds it: network order, IPv4 in the first word (or
    /// IPv4-mapped for an IPv6 socket).
    fn address(family: u8, ip: IpAddr) -> [u8; 16] {
        let mut out = [0u8; 16];
        match (family, ip) {
            (AF_INET, IpAddr::V4(v4)) => out[..4].copy_from_slice(&v4.octets()),
            (_, IpAddr::V4(v4)) => out = v4.to_ipv6_mapped().octets(),
            (_, IpAddr::V6(v6)) => out = v6.octets(),
        }
        out
    }

    /// The uid in a reply; `None` for "no such socket" (ENOENT).
    fn answer(reply: &[u8]) -> io::Result<Option<u32>> {
        let word = |at: usize| -> io::Result<[u8; 4]> {
            reply
                .get(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| io::Error::other("short sock_diag reply"))
        };
        let kind = reply
            .get(4..6)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
            .ok_or_else(|| io::Error::other("short sock_diag reply"))?;
        match kind {
            SOCK_DIAG_BY_FAMILY => Ok(Some(u32::from_ne_bytes(word(UID_AT)?))),
            NLMSG_ERROR => match -i32::from_ne_bytes(word(HEADER)?) {
                2 => Ok(None),
                errno => Err(io::Error::from_raw_os_error(errno)),
            },
            other => Err(io::Error::other(format!(
                "unexpected sock_diag reply type {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_table_is_read_for_both_families() {
        // Two lines as a little-endian x86 kernel prints them: 127.0.0.1:41234 → 127.0.0.1:8080
        // owned by uid 108, and a dual-stack socket ::ffff:127.0.0.1:8080 → :41234 of uid 0.
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                  0: 0100007F:A112 0100007F:1F90 01 00000000:00000000 00:00000000 00000000   108        0 4242 1 0\n";
        let end = |s: &str| s.parse::<SocketAddr>().unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(
                find(v4, end("127.0.0.1:41234"), end("127.0.0.1:8080")),
                Some(108)
            );
            assert_eq!(
                find(v4, end("127.0.0.1:41235"), end("127.0.0.1:8080")),
                None
            );
            let v6 = "header\n   0: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000100007F:A112 01 0:0 0:0 0     0 0 1\n";
            assert_eq!(
                find(v6, end("127.0.0.1:8080"), end("127.0.0.1:41234")),
                Some(0)
            );
        }
        assert_eq!(parse_addr("nonsense"), None);
    }

    #[test]
    fn a_connection_of_this_process_is_its_own_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, remote) = listener.accept().unwrap();
        assert_eq!(remote, client.local_addr().unwrap());
        assert_eq!(same_user(remote, server.local_addr().unwrap()), Ok(true));
        // A connection that does not exist cannot be vouched for.
        let gone: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(same_user(gone, server.local_addr().unwrap()).is_err());
    }

    #[test]
    fn netlink_and_the_proc_table_name_the_same_owner() {
        let own = std::fs::metadata("/proc/self").unwrap().uid();
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let listener = std::net::TcpListener::bind(host).unwrap();
            let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, remote) = listener.accept().unwrap();
            let local = server.local_addr().unwrap();
            assert_eq!(diag::uid(remote, local).unwrap(), Some(own), "{host}");
            let table = if remote.is_ipv4() {
                "/proc/net/tcp"
            } else {
                "/proc/net/tcp6"
            };
            let text = std::fs::read_to_string(table).unwrap();
            assert_eq!(find(&text, remote, local), Some(own), "{host}");
            // The lookup is by both ends: the server's socket answers for its own ends, and
            // swapped ends that no socket has answer nothing.
            assert_eq!(diag::uid(local, remote).unwrap(), Some(own), "{host}");
            let other = SocketAddr::new(remote.ip(), 1);
            assert_eq!(diag::uid(other, local).unwrap(), None, "{host}");
            drop(client);
        }
    }

    #[test]
    fn a_dual_stack_listener_sees_ipv4_peers_through_netlink_too() {
        // A listener on [::] sees an IPv4 peer as ::ffff:127.0.0.1; the peer's socket is an
        // IPv4 one.
        let Ok(listener) = std::net::TcpListener::bind("[::]:0") else {
            return;
        };
        let port = listener.local_addr().unwrap().port();
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, remote) = listener.accept().unwrap();
        assert!(remote.is_ipv6(), "{remote}");
        let local = server.local_addr().unwrap();
        let own = std::fs::metadata("/proc/self").unwrap().uid();
        assert_eq!(
            diag::uid(canonical(remote), canonical(local)).unwrap(),
            Some(own)
        );
        assert_eq!(same_user(remote, local), Ok(true));
    }
}
