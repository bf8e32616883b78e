//! Fetching an image by URL (`image_url`) without letting the URL reach inside.
//!
//! A URL is the caller's choice of where ingest connects, so every connection is checked:
//!
//! - **Addresses.** Only public unicast addresses, or those `INGEST_FETCH_ALLOW` names, are
//!   connected to ([`addr`]). A host name is resolved once, by the client's own resolver
//!   (`CheckedResolver`), which refuses the name when any of its addresses is refused; the
//!   connector then connects to exactly the addresses that resolver returned, so there is no
//!   second lookup to rebind. An IP literal never reaches a resolver (the connector uses it as
//!   it is), so `check_url` checks it before the request is sent. Proxies from the
//!   environment are ignored: through a proxy the check would apply to the proxy, not the URL.
//! - **Redirects** are not followed by the client: [`ImageFetcher`] follows at most
//!   [`MAX_REDIRECTS`] itself and checks each hop's URL (http or https, no user info) and
//!   address again.
//! - **Limits.** One deadline for the whole fetch (every hop and the body,
//!   `INGEST_FETCH_TIMEOUT`), a connect timeout per hop, the image size limit counted while the
//!   body streams in (whatever `Content-Length` says, or without one), and at most
//!   `INGEST_FETCH_CONCURRENCY` fetches at once; past that a fetch is refused at once with
//!   [`Error::FetchBusy`] (`RESOURCE_EXHAUSTED`, retry after 1 s), not queued.
//! - **One answer.** Every refused or failed fetch is [`Error::ImageFetch`], whose message is
//!   the same whatever happened, so the answer tells a caller nothing about what lies behind a
//!   URL (a closed port, an open one, an internal address). The reason goes to the log.

pub mod addr;

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};
use reqwest::{
    StatusCode, Url,
    dns::{Addrs, Name, Resolve, Resolving},
    header,
};
use tokio::sync::Semaphore;

pub use addr::{Allowlist, BadAllowEntry, Refused};

use crate::{Config, error::Error, image};

/// Redirects followed after the first request.
pub const MAX_REDIRECTS: usize = 3;

/// Longest `image_url` accepted (the gateway's limit too).
pub const MAX_URL_LEN: usize = 2048;

/// The retry delay suggested when every fetch slot is taken.
const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Fetches images by URL within the limits of [`Config`] (`fetch_*`, `max_image_bytes`).
#[derive(Clone)]
pub struct ImageFetcher {
    client: reqwest::Client,
    allow: Arc<Allowlist>,
    permits: Arc<Semaphore>,
    concurrency: usize,
    deadline: Duration,
    max_bytes: usize,
}

impl ImageFetcher {
    pub fn new(config: &Config) -> Self {
        let allow = Arc::new(config.fetch_allow.clone());
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(CheckedResolver {
                allow: allow.clone(),
            }))
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .referer(false)
            .connect_timeout(config.fetch_connect_timeout)
            // No idle connections: every fetch resolves and checks its host afresh.
            .pool_max_idle_per_host(0)
            .user_agent(concat!("ecoscan-ingest/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("the image fetch client builds: its settings are fixed");
        let concurrency = config.fetch_concurrency.max(1);
        Self {
            client,
            allow,
            permits: Arc::new(Semaphore::new(concurrency)),
            concurrency,
            deadline: config.fetch_timeout,
            max_bytes: config.max_image_bytes,
        }
    }

    /// The image at `url`: its bytes, at most the size limit, sniffed to be an image.
    ///
    /// Fails with [`Error::ImageFetch`] (one message for every reason, which is logged) or,
    /// when every fetch slot is taken, [`Error::FetchBusy`].
    pub async fn fetch(&self, url: &str) -> Result<Bytes, Error> {
        let Ok(_permit) = self.permits.try_acquire() else {
            tracing::warn!(
                limit = self.concurrency,
                "image_url refused: every fetch slot is taken (INGEST_FETCH_CONCURRENCY)"
            );
            return Err(Error::FetchBusy {
                retry_after: BUSY_RETRY_AFTER,
            });
        };
        let started = Instant::now();
        let mut hop = Hop::default();
        let outcome = tokio::time::timeout(self.deadline, self.fetch_checked(url, &mut hop))
            .await
            .unwrap_or(Err(Failure::Deadline(self.deadline)));
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match outcome {
            Ok(bytes) => {
                tracing::debug!(
                    bytes = bytes.len(),
                    redirects = hop.redirects,
                    host = %hop.host,
                    elapsed_ms,
                    "fetched image_url"
                );
                Ok(bytes)
            }
            Err(reason) => {
                tracing::warn!(
                    %reason,
                    redirects = hop.redirects,
                    host = %hop.host,
                    elapsed_ms,
                    "could not fetch image_url"
                );
                Err(Error::ImageFetch)
            }
        }
    }

    async fn fetch_checked(&self, url: &str, hop: &mut Hop) -> Result<Bytes, Failure> {
        if url.len() > MAX_URL_LEN {
            return Err(Failure::Url(format!("longer than {MAX_URL_LEN} bytes")));
        }
        let mut url = Url::parse(url).map_err(|e| Failure::Url(e.to_string()))?;
        loop {
            hop.host = host_port(&url);
            check_url(&url, &self.allow)?;
            let res = self
                .client
                .get(url.clone())
                .header(header::ACCEPT, "image/*")
                .send()
                .await
                .map_err(Failure::request)?;
            let status = res.status();
            if !status.is_redirection() {
                if !status.is_success() {
                    return Err(Failure::Status(status));
                }
                return read_image(res, self.max_bytes).await;
            }
            if hop.redirects == MAX_REDIRECTS {
                return Err(Failure::TooManyRedirects);
            }
            let location = res
                .headers()
                .get(header::LOCATION)
                .ok_or_else(|| Failure::Redirect(format!("{status} without a Location")))?
                .to_str()
                .map_err(|_| Failure::Redirect("a Location that is not ASCII".into()))?;
            url = url
                .join(location)
                .map_err(|e| Failure::Redirect(format!("a bad Location: {e}")))?;
            hop.redirects += 1;
        }
    }
}

/// Where a fetch got to, for the log.
#[derive(Default)]
struct Hop {
    redirects: usize,
    host: String,
}

fn host_port(url: &Url) -> String {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(host), Some(port)) => format!("{host}:{port}"),
        (Some(host), None) => host.to_owned(),
        (None, _) => String::new(),
    }
}

/// Checks one hop's URL before it is requested: http(s), no user info, a host, and an IP
/// literal host that may be connected to. (A host name is checked when it is resolved.)
fn check_url(url: &Url, allow: &Allowlist) -> Result<(), Failure> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Failure::Scheme(url.scheme().to_owned()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Failure::UserInfo);
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| Failure::Url("no host".into()))?;
    // The connector's own test: a host that parses as an IP address, brackets removed, is
    // connected to as it is, without asking the resolver.
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        allow
            .check(ip)
            .map_err(|refused| Failure::Address { ip, refused })?;
    }
    Ok(())
}

/// Reads the body, counting bytes as they come, and checks it is an image.
async fn read_image(mut res: reqwest::Response, max_bytes: usize) -> Result<Bytes, Failure> {
    let declared = res.content_length();
    if let Some(len) = declared
        && len > max_bytes as u64
    {
        return Err(Failure::TooLarge {
            declared,
            max_bytes,
        });
    }
    // What the server declares is not trusted for more than a modest first allocation.
    let mut body = BytesMut::with_capacity(declared.unwrap_or(0).min(256 * 1024) as usize);
    let mut sniffed = false;
    while let Some(chunk) = res
        .chunk()
        .await
        .map_err(|e| Failure::Body(chain(&e.without_url())))?
    {
        if body.len() + chunk.len() > max_bytes {
            return Err(Failure::TooLarge {
                declared,
                max_bytes,
            });
        }
        body.extend_from_slice(&chunk);
        // Enough bytes to recognise every accepted format: stop early on anything else.
        if !sniffed && body.len() >= 12 {
            if image::sniff(&body).is_none() {
                return Err(Failure::NotAnImage);
            }
            sniffed = true;
        }
    }
    if body.is_empty() {
        return Err(Failure::Empty);
    }
    if image::sniff(&body).is_none() {
        return Err(Failure::NotAnImage);
    }
    Ok(body.freeze())
}

/// Why a fetch failed: for the log only. The caller always gets [`Error::ImageFetch`].
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("the URL is not valid: {0}")]
    Url(String),
    #[error("the scheme {0:?} is not http or https")]
    Scheme(String),
    #[error("the URL carries user info")]
    UserInfo,
    #[error("the address {ip} is {refused}")]
    Address { ip: IpAddr, refused: Refused },
    /// Resolving (a refused address, a failed lookup), connecting, TLS, or the response head.
    #[error("the request failed: {0}")]
    Request(String),
    #[error("the server answered {0}")]
    Status(StatusCode),
    #[error("the server redirected with {0}")]
    Redirect(String),
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
    #[error("the body is larger than {max_bytes} bytes (Content-Length: {declared:?})")]
    TooLarge {
        declared: Option<u64>,
        max_bytes: usize,
    },
    #[error("reading the body failed: {0}")]
    Body(String),
    #[error("the body is empty")]
    Empty,
    #[error("the body is not a JPEG, PNG, WebP or GIF image")]
    NotAnImage,
    #[error("the fetch took longer than its deadline of {0:?}")]
    Deadline(Duration),
}

impl Failure {
    fn request(e: reqwest::Error) -> Self {
        Self::Request(chain(&e.without_url()))
    }
}

/// An error and its sources, `: `-separated (the resolver's reason is a source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The fetch client's resolver: looks a host name up once and returns its addresses only
/// when every one of them may be connected to.
struct CheckedResolver {
    allow: Arc<Allowlist>,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow = self.allow.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0))
                .await
                .map_err(|error| ResolveError::Lookup {
                    host: host.clone(),
                    error,
                })?;
            let addrs = check_resolved(&host, found.collect(), &allow)?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum ResolveError {
    #[error("looking up {host} failed: {error}")]
    Lookup { host: String, error: std::io::Error },
    #[error("{host} has no addresses")]
    NoAddresses { host: String },
    #[error("{host} resolves to {ip}, which is {refused}")]
    Refused {
        host: String,
        ip: IpAddr,
        refused: Refused,
    },
}

/// The addresses `host` resolved to, when there are some and none is refused. One refused
/// address refuses the name: a name that points inside is not a public image host.
fn check_resolved(
    host: &str,
    addrs: Vec<SocketAddr>,
    allow: &Allowlist,
) -> Result<Vec<SocketAddr>, ResolveError> {
    if addrs.is_empty() {
        return Err(ResolveError::NoAddresses {
            host: host.to_owned(),
        });
    }
    for a in &addrs {
        allow
            .check(a.ip())
            .map_err(|refused| ResolveError::Refused {
                host: host.to_owned(),
                ip: a.ip(),
                refused,
            })?;
    }
    Ok(addrs)
}

#[cfg(test)]
mod tests;
