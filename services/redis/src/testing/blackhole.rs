//! [`Blackhole`]: a path to a server that a test can make stop answering, on loopback, without
//! network namespaces or privileges.

use std::net::SocketAddr;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// A TCP forwarder on a loopback port of its own in front of `upstream`. [`Self::blackhole`]
/// makes it accept and read but never answer, on the connections it has and on new ones (a
/// stalled path: a proxy or NAT that stopped forwarding, a partition without resets);
/// [`Self::heal`] forwards again on new connections and closes the ones that saw the blackhole
/// (what a client meets after a NAT forgot them).
pub struct Blackhole {
    addr: SocketAddr,
    /// `true` while blackholed; each connection follows it, and closes once the forwarder is
    /// gone (the sender dropped).
    holed: watch::Sender<bool>,
    accept_loop: JoinHandle<()>,
}

impl Blackhole {
    /// Starts forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the forwarder");
        let addr = listener.local_addr().expect("the forwarder's address");
        let (holed, watching) = watch::channel(false);
        let accept_loop = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, upstream, watching.clone()));
            }
        });
        Self {
            addr,
            holed,
            accept_loop,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A `redis://` URL of the forwarder.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Stops answering: bytes from clients are read and dropped, nothing comes back.
    pub fn blackhole(&self) {
        self.holed.send_replace(true);
    }

    /// Forwards again (the connections that saw the blackhole are closed).
    pub fn heal(&self) {
        self.holed.send_replace(false);
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

/// One client connection: forwarded both ways while the path is open; while it is blackholed,
/// the client's bytes are read and dropped and nothing is sent back; healed, a connection that
/// saw the blackhole ends.
async fn forward(mut client: TcpStream, upstream: SocketAddr, mut holed: watch::Receiver<bool>) {
    let mut server: Option<TcpStream> = None;
    let mut saw_blackhole = false;
    let (mut from_client, mut from_server) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let blackholed = *holed.borrow_and_update();
        if blackholed {
            saw_blackhole = true;
        } else if saw_blackhole {
            return;
        } else if server.is_none() {
            match TcpStream::connect(upstream).await {
                Ok(s) => server = Some(s),
                Err(_) => return,
            }
        }
        let open = if blackholed { None } else { server.as_mut() };
        match open {
            Some(server) => {
                tokio::select! {
                    read = client.read(&mut from_client) => match read {
                        Ok(n) if n > 0 => {
                            if server.write_all(&from_client[..n]).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                    read = server.read(&mut from_server) => match read {
                        Ok(n) if n > 0 => {
                            if client.write_all(&from_server[..n]).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                    changed = holed.changed() => if changed.is_err() { return },
                }
            }
            None => {
                tokio::select! {
                    read = client.read(&mut from_client) => match read {
                        Ok(n) if n > 0 => {}
                        _ => return,
                    },
                    changed = holed.changed() => if changed.is_err() { return },
                }
            }
        }
    }
}
