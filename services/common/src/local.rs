//! In-process connections between services that share a process (`ecoscan up`).
//!
//! Every service of `ecoscan up` listens on its own loopback port and the others call it with
//! the same gRPC clients as when deployed apart. Over loopback TCP, every HTTP/2 frame between
//! two of them is a system call on each side and a pass through the kernel's TCP stack. Here a
//! connection to an address *offered* in this process ([`offer`]) is an in-memory pipe
//! ([`tokio::io::duplex`]) instead, handed straight to that server's accept loop: the same
//! HTTP/2, the same server stack (tracing, metrics, identity assertions, deadlines, graceful
//! drain), no socket. What it saves in CPU per scan was within the `capacity` benchmark's noise
//! when measured (see the README); it removes the sockets' work, not the HTTP/2 framing.
//!
//! Only addresses offered explicitly take this path, and only in plaintext (a process with
//! `GRPC_TLS_*` set keeps TLS on every call). The TCP listener stays open beside it, so
//! `grpcurl`, probes and callers in other processes reach the service as before.
//! `ECOSCAN_LOCAL_CALLS=tcp` turns the in-process path off (to capture the calls with `tshark`,
//! say).

use std::{
    collections::HashMap,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{LazyLock, Mutex},
    task::{Context, Poll},
};

use tokio::{
    io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf},
    net::TcpStream,
    sync::mpsc,
};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The variable that turns in-process calls off (`tcp`).
pub const LOCAL_CALLS_VAR: &str = "ECOSCAN_LOCAL_CALLS";

/// Bytes a pipe buffers in each direction before the writer waits: a few HTTP/2 frames (the
/// default frame is 16 KiB), like a socket's buffer; larger messages simply flow through.
const PIPE_BYTES: usize = 256 * 1024;

/// An offered address: the queue of connections not yet accepted (like a listen backlog, so a
/// client may connect before the server's accept loop runs) and whether a server took it.
struct Slot {
    queue: mpsc::UnboundedSender<DuplexStream>,
    pending: Option<mpsc::UnboundedReceiver<DuplexStream>>,
}

static SLOTS: LazyLock<Mutex<HashMap<SocketAddr, Slot>>> = LazyLock::new(Default::default);

fn slots() -> std::sync::MutexGuard<'static, HashMap<SocketAddr, Slot>> {
    // A panic while holding the lock leaves the map consistent (every operation is one insert
    // or remove), so a poisoned lock is still usable.
    SLOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether in-process calls are on (`ECOSCAN_LOCAL_CALLS` is not `tcp`).
fn enabled() -> bool {
    crate::config::env_opt(LOCAL_CALLS_VAR).is_none_or(|v| !v.trim().eq_ignore_ascii_case("tcp"))
}

/// Offers the server that will listen on `addr` to callers in this process: from now on a
/// plaintext client of `http://{addr}` made in this process connects in memory, and the server
/// serving that listener ([`crate::server`]) accepts those connections beside its TCP ones.
/// Call it before creating the clients (a client decides when it is made). Does nothing when
/// in-process calls are off.
pub fn offer(addr: SocketAddr) {
    if !enabled() {
        return;
    }
    let (queue, pending) = mpsc::unbounded_channel();
    slots().insert(
        addr,
        Slot {
            queue,
            pending: Some(pending),
        },
    );
}

/// Whether `addr` was offered ([`offer`]) and is not withdrawn.
pub fn is_offered(addr: SocketAddr) -> bool {
    slots().contains_key(&addr)
}

/// Withdraws `addr`: later connections to it fail, as to a closed port.
pub(crate) fn withdraw(addr: SocketAddr) {
    slots().remove(&addr);
}

/// The in-process connections of the server listening on `addr`, if it was offered; the
/// address is withdrawn when the returned [`Accepted`] is dropped (the server stopped).
pub(crate) fn accept(addr: SocketAddr) -> Option<Accepted> {
    let mut slots = slots();
    let slot = slots.get_mut(&addr)?;
    let pending = slot.pending.take()?;
    Some(Accepted {
        addr,
        queue: slot.queue.clone(),
        pending,
    })
}

/// What a server accepts in memory; withdraws its address when dropped.
pub(crate) struct Accepted {
    addr: SocketAddr,
    queue: mpsc::UnboundedSender<DuplexStream>,
    pending: mpsc::UnboundedReceiver<DuplexStream>,
}

impl Accepted {
    /// The next connection (`None` never comes while the address stays offered: the slot keeps
    /// a sender).
    pub(crate) async fn next(&mut self) -> Option<DuplexStream> {
        self.pending.recv().await
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        let mut slots = slots();
        // Only this server's slot: the address may have been offered again since.
        if slots
            .get(&self.addr)
            .is_some_and(|slot| slot.queue.same_channel(&self.queue))
        {
            slots.remove(&self.addr);
        }
    }
}

/// Connects to the in-process server offered at `addr`: the client's half of a new pipe, the
/// server's half queued for its accept loop. Fails like a refused TCP connection when nothing
/// is offered there (any more).
pub(crate) fn connect(addr: SocketAddr) -> io::Result<DuplexStream> {
    let queue = slots()
        .get(&addr)
        .map(|slot| slot.queue.clone())
        .ok_or_else(|| refused(addr))?;
    let (client, server) = tokio::io::duplex(PIPE_BYTES);
    queue.send(server).map_err(|_| refused(addr))?;
    Ok(client)
}

fn refused(addr: SocketAddr) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionRefused,
        format!("no server of this process is serving {addr} any more"),
    )
}

/// A connection a server accepted: over TCP, or in memory from this process.
pub enum Conn {
    Tcp(TcpStream),
    Local(DuplexStream),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Self::Tcp(stream) => stream.connect_info(),
            // No peer address: the peer is this process.
            Self::Local(_) => TcpConnectInfo {
                local_addr: None,
                remote_addr: None,
            },
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Local(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Local(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Local(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Local(s) => Pin::new(s).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Local(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(s) => s.is_write_vectored(),
            Self::Local(s) => s.is_write_vectored(),
        }
    }
}
