//! Whose process holds the other end of a loopback connection: header mode `loopback` believes
//! `X-User-Id` only from a process of the gateway's own user. Address and headers cannot tell a
//! developer's `curl` from a proxy on the same machine that forwards anyone (HAProxy passes the
//! client's `Host` and adds no header unless told to); the owner of the connecting socket can:
//! Debian's HAProxy and nginx run as users of their own.
//!
//! Linux lists every TCP socket of the network namespace with its owner's uid in
//! `/proc/net/tcp` and `/proc/net/tcp6`; the peer's socket is the one whose local address is
//! the connection's remote end and whose remote address is the gateway's end.

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
}
