//! `ecoscan up`: every service and the gateway in one process, on the embedded stores, each on
//! its own loopback port and talking real gRPC to the others as they do when deployed apart,
//! though among themselves a call goes straight into the called server's service stack rather
//! than over HTTP/2 on a loopback socket ([`ecoscan_common::local`]). This crate is the one place that wires all the services
//! together.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
};

pub mod cli;
pub mod command;
pub mod jobs;
mod serve;
pub mod tokens;

pub use ecoscan_gateway::TrustHeader;
pub use serve::{
    ADDR_FILE_VAR, ADMIN_ADDR_FILE_VAR, Service, WITH_DATABASE, migrate, migrate_all, serve_one,
    telemetry_routes,
};
pub use tokens::{
    LOCAL_AUDIENCE, LOCAL_ISSUER, LOCAL_TOKEN_TTL, LOCAL_USER, local_identity_key, local_token,
    local_token_secret, read_local_token, use_local_identity_key, write_local_token,
};

use anyhow::Context;
use ecoscan_common::CancellationToken;
use ecoscan_llm::LlmConfig;
use tokio::{net::TcpListener, task::JoinSet};

/// A port per service; 0 picks a free one.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub gateway: u16,
    /// The gateway's admin listener (`/metrics`, `/readyz`), always on loopback.
    pub gateway_admin: u16,
    pub ingest: u16,
    pub vision: u16,
    pub rule: u16,
    pub answer: u16,
    pub reward: u16,
    pub analytics: u16,
    pub notification: u16,
}

impl Ports {
    /// The documented default ports.
    pub const DEFAULT: Self = Self {
        gateway: 8080,
        gateway_admin: 8081,
        ingest: 50051,
        vision: 50052,
        rule: 50053,
        answer: 50054,
        reward: 50055,
        analytics: 50056,
        notification: 50057,
    };

    /// Every service on a free port (tests).
    pub const EPHEMERAL: Self = Self {
        gateway: 0,
        gateway_admin: 0,
        ingest: 0,
        vision: 0,
        rule: 0,
        answer: 0,
        reward: 0,
        analytics: 0,
        notification: 0,
    };
}

/// What `ecoscan up` runs.
#[derive(Clone)]
pub struct SuiteConfig {
    /// Address the gateway binds (loopback by default); the services always bind loopback.
    pub host: IpAddr,
    pub ports: Ports,
    /// SQLite files, images and LLM bodies live here.
    pub data_dir: PathBuf,
    /// The model provider for vision and answer (`LLM_*` variables; `mock` by default).
    pub llm: LlmConfig,
    /// Jobs ingest runs at once (`INGEST_MAX_IN_FLIGHT`); `None`: ingest's default, the
    /// backlog limit.
    pub ingest_max_in_flight: Option<usize>,
    /// What analytics prices calls by (`ANALYTICS_PRICES`; empty: every real call's cost
    /// unknown).
    pub analytics_prices: std::sync::Arc<ecoscan_analytics::prices::PriceTable>,
    /// The gateway's settings (every `GATEWAY_*` variable: limits, lifetimes, header mode,
    /// CORS, the Jaeger link, …); the suite sets the services' addresses and its local tokens
    /// itself.
    pub gateway: ecoscan_gateway::Config,
}

impl SuiteConfig {
    /// Defaults plus the `LLM_*` and `INGEST_MAX_IN_FLIGHT` variables.
    pub fn from_env(data_dir: &Path, host: IpAddr, ports: Ports) -> anyhow::Result<Self> {
        Ok(Self {
            host,
            ports,
            data_dir: data_dir.to_path_buf(),
            llm: LlmConfig::from_env()?,
            ingest_max_in_flight: ecoscan_common::config::env_opt("INGEST_MAX_IN_FLIGHT")
                .map(|v| {
                    v.trim()
                        .parse()
                        .with_context(|| format!("invalid INGEST_MAX_IN_FLIGHT {v:?}"))
                })
                .transpose()?,
            analytics_prices: std::sync::Arc::new(
                ecoscan_analytics::prices::PriceTable::from_env()?
            ),
            gateway: ecoscan_gateway::Config::read_env()?,
        })
    }

    /// Every service on a free loopback port, the mock model, data under `data_dir` (tests).
    pub fn ephemeral(data_dir: &Path) -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            ports: Ports::EPHEMERAL,
            data_dir: data_dir.to_path_buf(),
            llm: LlmConfig::default(),
            ingest_max_in_flight: None,
            analytics_prices: std::sync::Arc::default(),
            gateway: ecoscan_gateway::Config::default(),
        }
    }
}

/// Where each service listens.
#[derive(Clone, Copy, Debug)]
pub struct Addrs {
    pub gateway: SocketAddr,
    /// `/metrics` and `/readyz` of the gateway.
    pub gateway_admin: SocketAddr,
    pub ingest: SocketAddr,
    pub vision: SocketAddr,
    pub rule: SocketAddr,
    pub answer: SocketAddr,
    pub reward: SocketAddr,
    pub analytics: SocketAddr,
    pub notification: SocketAddr,
}

impl Addrs {
    /// The seven gRPC services, by name (the gateway's listeners are not among them).
    pub fn services(&self) -> [(&'static str, SocketAddr); 7] {
        [
            ("ingest", self.ingest),
            ("vision", self.vision),
            ("rule", self.rule),
            ("answer", self.answer),
            ("reward", self.reward),
            ("analytics", self.analytics),
            ("notification", self.notification),
        ]
    }
}

/// The running suite.
pub struct Running {
    pub addrs: Addrs,
    tasks: JoinSet<(&'static str, anyhow::Result<()>)>,
    shutdown: CancellationToken,
}

impl Running {
    /// Waits until every service has stopped. If one stops with an error, the others are shut
    /// down too and that error is returned.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let mut first_error = None;
        while let Some(joined) = self.tasks.join_next().await {
            let (name, result) = joined.context("a service task panicked")?;
            if let Err(e) = result {
                tracing::error!(
                    service = name,
                    error = format!("{e:#}"),
                    "service stopped with an error"
                );
                self.shutdown.cancel();
                first_error.get_or_insert(e.context(format!("{name} failed")));
            } else if !self.shutdown.is_cancelled() {
                tracing::error!(service = name, "service stopped unexpectedly");
                self.shutdown.cancel();
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

async fn bind(host: IpAddr, port: u16, name: &str) -> anyhow::Result<TcpListener> {
    ecoscan_common::server::listen(SocketAddr::new(host, port))
        .with_context(|| format!("failed to bind {name} on {host}:{port}; is another ecoscan running? (override with --{name}-port)"))
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// Binds every port first (so every address is known before anything runs), then starts each
/// service on its own listener. Everything stops when `shutdown` is cancelled.
pub async fn start(config: SuiteConfig, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let SuiteConfig {
        host,
        ports,
        data_dir,
        llm,
        ingest_max_in_flight,
        analytics_prices,
        gateway: gateway_settings,
    } = config;
    // Every service serves and calls over TLS when GRPC_TLS_* is set: a bad file stops the
    // start here, once, rather than in each service.
    ecoscan_common::tls::TlsConfig::global()?;
    tokio::fs::create_dir_all(&data_dir)
        .await
        .with_context(|| format!("failed to create data directory {}", data_dir.display()))?;
    let sqlite = |name: &str| {
        format!(
            "sqlite://{}?mode=rwc",
            data_dir.join(format!("{name}.db")).display()
        )
    };

    // Only the gateway is exposed on `host`: the services' gRPC ports act for whoever their
    // metadata names, so they stay on this machine's loopback whatever `host` is.
    let inside = if host.is_ipv6() {
        IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
    } else {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    };
    let gateway = bind(host, ports.gateway, "gateway").await?;
    // Loopback whatever `host` is: the series and probes are the operator's, not the network's.
    let gateway_admin = bind(inside, ports.gateway_admin, "gateway-admin").await?;
    let ingest = bind(inside, ports.ingest, "ingest").await?;
    let vision = bind(inside, ports.vision, "vision").await?;
    let rule = bind(inside, ports.rule, "rule").await?;
    let answer = bind(inside, ports.answer, "answer").await?;
    let reward = bind(inside, ports.reward, "reward").await?;
    let analytics = bind(inside, ports.analytics, "analytics").await?;
    let notification = bind(inside, ports.notification, "notification").await?;
    let addrs = Addrs {
        gateway: gateway.local_addr()?,
        gateway_admin: gateway_admin.local_addr()?,
        ingest: ingest.local_addr()?,
        vision: vision.local_addr()?,
        rule: rule.local_addr()?,
        answer: answer.local_addr()?,
        reward: reward.local_addr()?,
        analytics: analytics.local_addr()?,
        notification: notification.local_addr()?,
    };

    // The services call each other in memory ([`ecoscan_common::local`]): same gRPC, same
    // server stack, no HTTP/2 and no loopback socket between them. Offered before any client is made; their
    // TCP ports stay open for grpcurl and for callers outside this process.
    for (_, addr) in addrs.services() {
        ecoscan_common::local::offer(addr);
    }

    // A postgres:// ANALYTICS_DATABASE_URL/DATABASE_URL and the S3_* variables move analytics
    // onto the production stores, store by store; unset, it stays embedded.
    let analytics_config = ecoscan_analytics::Config {
        database_url: sqlite("analytics"),
        bodies: ecoscan_analytics::ObjectStoreConfig::Local(data_dir.join("analytics-bodies")),
        prices: analytics_prices,
        ..Default::default()
    }
    .with_stores_from_env()?;

    let reward_config = ecoscan_reward::Config {
        database_url: sqlite("reward"),
    }
    .with_stores_from_env();

    // A postgres:// NOTIFICATION_DATABASE_URL/DATABASE_URL and REDIS_URL move notification onto
    // the production stores; unset, it stays embedded.
    let notification_config = ecoscan_notification::Config {
        database_url: sqlite("notification"),
        ..Default::default()
    }
    .with_stores_from_env()?;

    let ingest_config = ecoscan_ingest::Config {
        vision_url: url(addrs.vision),
        rule_url: url(addrs.rule),
        answer_url: url(addrs.answer),
        reward_url: url(addrs.reward),
        notification_url: url(addrs.notification),
        database_url: sqlite("ingest"),
        object_dir: data_dir.join("objects"),
        ..Default::default()
    }
    // REDIS_URL, a postgres:// INGEST_DATABASE_URL/DATABASE_URL and the S3_* variables move
    // ingest onto the production stores, store by store; unset, it stays embedded. The INGEST_*
    // tuning variables apply as in `ecoscan serve ingest`.
    .with_stores_from_env()?
    .with_tuning_from_env()?
    .with_fetch_from_env()?;
    let ingest_config = ecoscan_ingest::Config {
        max_in_flight: ingest_max_in_flight.unwrap_or(ingest_config.max_in_flight),
        // The models vision and answer offer are the ones a scan may name.
        offered_models: llm.offered.clone(),
        ..ingest_config
    };

    // The services on PostgreSQL split the process's connection budget
    // (DATABASE_MAX_CONNECTIONS) by their weights, the connections each opens when it is unset.
    ecoscan_sql::share_connections(
        [
            (
                "ingest",
                &ingest_config.database_url,
                ecoscan_ingest::store::postgres::MAX_CONNECTIONS,
            ),
            (
                "reward",
                &reward_config.database_url,
                ecoscan_reward::store::postgres::MAX_CONNECTIONS,
            ),
            (
                "analytics",
                &analytics_config.database_url,
                ecoscan_analytics::store::postgres::MAX_CONNECTIONS,
            ),
            (
                "notification",
                &notification_config.database_url,
                ecoscan_notification::store::postgres::MAX_CONNECTIONS,
            ),
        ]
        .into_iter()
        .filter(|(_, url, _)| ecoscan_sql::is_postgres(url))
        .map(|(service, _, weight)| (service, weight))
        .collect(),
    );

    let mut tasks = JoinSet::new();
    let rule_config = ecoscan_rule::Config::default();
    let sd = shutdown.clone();
    tasks.spawn(async move { ("rule", ecoscan_rule::serve(rule_config, rule, sd).await) });

    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "analytics",
            ecoscan_analytics::serve(analytics_config, analytics, sd).await,
        )
    });

    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "reward",
            ecoscan_reward::serve(reward_config, reward, sd).await,
        )
    });

    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "notification",
            ecoscan_notification::serve(notification_config, notification, sd).await,
        )
    });

    let vision_config = ecoscan_vision::Config {
        rule_url: url(addrs.rule),
        analytics_url: Some(url(addrs.analytics)),
        llm: llm.clone(),
    };
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "vision",
            ecoscan_vision::serve(vision_config, vision, sd).await,
        )
    });

    let answer_config = ecoscan_answer::Config {
        analytics_url: Some(url(addrs.analytics)),
        llm,
    };
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "answer",
            ecoscan_answer::serve(answer_config, answer, sd).await,
        )
    });

    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "ingest",
            ecoscan_ingest::serve(ingest_config, ingest, sd).await,
        )
    });

    let gateway_config = ecoscan_gateway::Config {
        ingest_url: url(addrs.ingest),
        rule_url: url(addrs.rule),
        reward_url: url(addrs.reward),
        analytics_url: url(addrs.analytics),
        notification_url: url(addrs.notification),
        // Tokens minted by `ecoscan token` (and the one `ecoscan up` prints) work at once; the
        // header only when asked for.
        auth: ecoscan_gateway::AuthConfig {
            hs256_secret: Some(local_token_secret(&data_dir)?),
            issuer: Some(LOCAL_ISSUER.to_owned()),
            audience: Some(LOCAL_AUDIENCE.to_owned()),
            trust_header: gateway_settings.auth.trust_header,
            ..Default::default()
        },
        ..gateway_settings
    };
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "gateway",
            ecoscan_gateway::serve_with_admin(gateway_config, gateway, Some(gateway_admin), sd)
                .await,
        )
    });

    Ok(Running {
        addrs,
        tasks,
        shutdown,
    })
}
