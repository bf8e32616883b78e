//! `ecoscan up`: every service and the gateway in one process, on the embedded stores, each on
//! its own loopback port and talking real gRPC to the others, exactly as they do when deployed
//! apart. This crate is the one place that wires all the services together.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
};

pub mod cli;
pub mod jobs;
pub mod tokens;

pub use ecoscan_gateway::TrustHeader;
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
    /// The gateway's abuse limits (`GATEWAY_SCANS_PER_MINUTE`, `GATEWAY_MAX_SSE_PER_USER`, …).
    pub gateway_limits: ecoscan_gateway::Limits,
    /// The Jaeger UI the demo page links traces to (`GATEWAY_JAEGER_URL`).
    pub gateway_jaeger_url: Option<String>,
    /// Header mode (`GATEWAY_TRUST_USER_HEADER`): off unless asked for.
    pub gateway_trust_header: ecoscan_gateway::TrustHeader,
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
            gateway_limits: ecoscan_gateway::Limits::from_env()?,
            gateway_jaeger_url: ecoscan_common::config::env_opt("GATEWAY_JAEGER_URL"),
            gateway_trust_header: ecoscan_common::config::env_or(
                "GATEWAY_TRUST_USER_HEADER",
                ecoscan_gateway::TrustHeader::Off,
            )?,
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
            gateway_limits: ecoscan_gateway::Limits::default(),
            gateway_jaeger_url: None,
            gateway_trust_header: ecoscan_gateway::TrustHeader::Off,
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
        gateway_limits,
        gateway_jaeger_url,
        gateway_trust_header,
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

    let mut tasks = JoinSet::new();
    let rule_config = ecoscan_rule::Config::default();
    let sd = shutdown.clone();
    tasks.spawn(async move { ("rule", ecoscan_rule::serve(rule_config, rule, sd).await) });

    // A postgres:// ANALYTICS_DATABASE_URL/DATABASE_URL and the S3_* variables move analytics
    // onto the production stores, store by store; unset, it stays embedded.
    let analytics_config = ecoscan_analytics::Config {
        database_url: sqlite("analytics"),
        bodies: ecoscan_analytics::ObjectStoreConfig::Local(data_dir.join("analytics-bodies")),
        ..Default::default()
    }
    .with_stores_from_env()?;
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "analytics",
            ecoscan_analytics::serve(analytics_config, analytics, sd).await,
        )
    });

    let reward_config = ecoscan_reward::Config {
        database_url: sqlite("reward"),
    }
    .with_stores_from_env();
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "reward",
            ecoscan_reward::serve(reward_config, reward, sd).await,
        )
    });

    // A postgres:// NOTIFICATION_DATABASE_URL/DATABASE_URL and REDIS_URL move notification onto
    // the production stores; unset, it stays embedded.
    let notification_config = ecoscan_notification::Config {
        database_url: sqlite("notification"),
        ..Default::default()
    }
    .with_stores_from_env()?;
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
        ..ingest_config
    };
    let sd = shutdown.clone();
    tasks.spawn(async move {
        (
            "ingest",
            ecoscan_ingest::serve(ingest_config, ingest, sd).await,
        )
    });

    let gateway_config = ecoscan_gateway::Config {
        ingest_url: url(addrs.ingest),
        reward_url: url(addrs.reward),
        analytics_url: url(addrs.analytics),
        notification_url: url(addrs.notification),
        // Tokens minted by `ecoscan token` (and the one `ecoscan up` prints) work at once; the
        // header only when asked for.
        auth: ecoscan_gateway::AuthConfig {
            hs256_secret: Some(local_token_secret(&data_dir)?),
            issuer: Some(LOCAL_ISSUER.to_owned()),
            audience: Some(LOCAL_AUDIENCE.to_owned()),
            trust_header: gateway_trust_header,
            ..Default::default()
        },
        limits: gateway_limits,
        jaeger_url: gateway_jaeger_url,
        ..Default::default()
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

/// One service of the suite, for `ecoscan serve <service>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Service {
    Gateway,
    Ingest,
    Vision,
    Rule,
    Answer,
    Reward,
    Analytics,
    Notification,
}

impl Service {
    /// Every service, each listed after the services it calls (a start order).
    pub const ALL: [Self; 8] = [
        Self::Rule,
        Self::Analytics,
        Self::Reward,
        Self::Notification,
        Self::Vision,
        Self::Answer,
        Self::Ingest,
        Self::Gateway,
    ];

    /// `ingest`, `vision`, …: the `<service>` of `service.name = ecoscan-<service>`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gateway => "gateway",
            Self::Ingest => "ingest",
            Self::Vision => "vision",
            Self::Rule => "rule",
            Self::Answer => "answer",
            Self::Reward => "reward",
            Self::Analytics => "analytics",
            Self::Notification => "notification",
        }
    }

    /// The crate whose spans are this service's (the first segment of their target).
    pub fn crate_name(self) -> &'static str {
        match self {
            Self::Gateway => "ecoscan_gateway",
            Self::Ingest => "ecoscan_ingest",
            Self::Vision => "ecoscan_vision",
            Self::Rule => "ecoscan_rule",
            Self::Answer => "ecoscan_answer",
            Self::Reward => "ecoscan_reward",
            Self::Analytics => "ecoscan_analytics",
            Self::Notification => "ecoscan_notification",
        }
    }

    /// The gRPC services it serves (their server spans are this service's).
    pub fn grpc_services(self) -> &'static [&'static str] {
        use ecoscan_proto::v1::{
            analytics_service_server, answer_service_server, notification_service_server,
            reward_service_server, rule_service_server, scan_admin_service_server,
            scan_service_server, vision_service_server,
        };
        match self {
            Self::Gateway => &[],
            Self::Ingest => &[
                scan_service_server::SERVICE_NAME,
                scan_admin_service_server::SERVICE_NAME,
            ],
            Self::Vision => &[vision_service_server::SERVICE_NAME],
            Self::Rule => &[rule_service_server::SERVICE_NAME],
            Self::Answer => &[answer_service_server::SERVICE_NAME],
            Self::Reward => &[reward_service_server::SERVICE_NAME],
            Self::Analytics => &[analytics_service_server::SERVICE_NAME],
            Self::Notification => &[notification_service_server::SERVICE_NAME],
        }
    }

    /// The variable holding the listen address (`INGEST_ADDR`, …).
    pub fn addr_var(self) -> &'static str {
        match self {
            Self::Gateway => "GATEWAY_ADDR",
            Self::Ingest => "INGEST_ADDR",
            Self::Vision => "VISION_ADDR",
            Self::Rule => "RULE_ADDR",
            Self::Answer => "ANSWER_ADDR",
            Self::Reward => "REWARD_ADDR",
            Self::Analytics => "ANALYTICS_ADDR",
            Self::Notification => "NOTIFICATION_ADDR",
        }
    }

    /// The documented default port.
    pub fn default_port(self) -> u16 {
        let p = Ports::DEFAULT;
        match self {
            Self::Gateway => p.gateway,
            Self::Ingest => p.ingest,
            Self::Vision => p.vision,
            Self::Rule => p.rule,
            Self::Answer => p.answer,
            Self::Reward => p.reward,
            Self::Analytics => p.analytics,
            Self::Notification => p.notification,
        }
    }
}

/// How `ecoscan up` tells its services' spans apart, so that each exports under its own
/// resource (`service.name = ecoscan-<service>`) though they share the process: by crate, and
/// for the server span of each RPC by the gRPC service called.
pub fn telemetry_routes() -> ecoscan_common::telemetry::ServiceRoutes {
    Service::ALL
        .iter()
        .fold(Default::default(), |routes, s: &Service| {
            routes.service(s.name(), &[s.crate_name()], s.grpc_services())
        })
}

/// `ecoscan migrate`: every service with a database (ingest, reward, analytics, notification)
/// brings its schema up to date, each configured from its environment as when it serves
/// (`<SERVICE>_DATABASE_URL`, else `DATABASE_URL`), then returns. Each service's migrations
/// are tracked in a table of its own, so services may share one database, and running it again
/// changes nothing. Returns the services migrated, in order.
pub async fn migrate_all() -> anyhow::Result<Vec<&'static str>> {
    migrate(&[]).await
}

/// The services with a database, in the order [`migrate`] takes them.
pub const WITH_DATABASE: [Service; 4] = [
    Service::Ingest,
    Service::Reward,
    Service::Analytics,
    Service::Notification,
];

/// `ecoscan migrate SERVICE…`: [`migrate_all`] for `services` only (all of them when empty).
/// Each runs under its migrator's PostgreSQL advisory lock (pods starting together wait, one
/// applies, the others find it done) and fails on a schema newer than this binary knows, so
/// an older release never serves against a newer schema.
pub async fn migrate(services: &[Service]) -> anyhow::Result<Vec<&'static str>> {
    if let Some(s) = services.iter().find(|s| !WITH_DATABASE.contains(s)) {
        anyhow::bail!(
            "{} has no database to migrate (services with one: ingest, reward, analytics, \
             notification)",
            s.name()
        );
    }
    let mut done = Vec::new();
    for service in WITH_DATABASE {
        if !services.is_empty() && !services.contains(&service) {
            continue;
        }
        match service {
            Service::Ingest => {
                ecoscan_ingest::migrate(&ecoscan_ingest::Config::from_env()?).await?
            }
            Service::Reward => {
                ecoscan_reward::migrate(&ecoscan_reward::Config::from_env()?).await?
            }
            Service::Analytics => {
                ecoscan_analytics::migrate(&ecoscan_analytics::Config::from_env()?).await?
            }
            Service::Notification => {
                ecoscan_notification::migrate(&ecoscan_notification::Config::from_env()?).await?
            }
            _ => unreachable!("only services with a database are listed"),
        }
        tracing::info!(service = service.name(), "migrated");
        done.push(service.name());
    }
    Ok(done)
}

/// Variable naming a file to which [`serve_one`] writes the address it bound (`127.0.0.1:PORT`)
/// once it listens: scripts and tests start services on port 0 and read the port from there.
pub const ADDR_FILE_VAR: &str = "ECOSCAN_ADDR_FILE";
/// The same for the gateway's admin listener (`GATEWAY_ADMIN_ADDR`).
pub const ADMIN_ADDR_FILE_VAR: &str = "ECOSCAN_ADMIN_ADDR_FILE";

/// Runs one service alone, configured from its environment exactly as its own binary
/// (`ecoscan-<service>`) is: `<SERVICE>_ADDR` to listen on and the service's own variables.
/// This is what `ecoscan serve <service>` runs, one process per service (containers, tests).
pub async fn serve_one(service: Service, shutdown: CancellationToken) -> anyhow::Result<()> {
    let addr = ecoscan_common::config::env_addr(
        service.addr_var(),
        &format!("127.0.0.1:{}", service.default_port()),
    )?;
    // A bad GRPC_TLS_* file, or identity key, stops the start before the port is bound.
    ecoscan_common::tls::TlsConfig::global()?;
    ecoscan_common::assertion::check_env()?;
    let listener = ecoscan_common::server::listen(addr)
        .with_context(|| format!("failed to bind {} on {addr}", service.name()))?;
    let bound = listener
        .local_addr()
        .context("bound listener has no address")?;
    tracing::info!(service = service.name(), addr = %bound, "listening");
    if let Some(path) = ecoscan_common::config::env_opt(ADDR_FILE_VAR) {
        write_addr_file(Path::new(&path), bound)
            .with_context(|| format!("failed to write the bound address to {path}"))?;
    }
    match service {
        Service::Gateway => {
            let config = ecoscan_gateway::Config::from_env()?;
            let admin = ecoscan_common::binary::bind(
                "gateway admin",
                "GATEWAY_ADMIN_ADDR",
                ecoscan_gateway::DEFAULT_ADMIN_ADDR,
            )
            .await?;
            if let Some(path) = ecoscan_common::config::env_opt(ADMIN_ADDR_FILE_VAR) {
                let bound = admin
                    .local_addr()
                    .context("bound listener has no address")?;
                write_addr_file(Path::new(&path), bound)
                    .with_context(|| format!("failed to write the admin address to {path}"))?;
            }
            ecoscan_gateway::serve_with_admin(config, listener, Some(admin), shutdown).await
        }
        Service::Ingest => {
            ecoscan_ingest::serve(ecoscan_ingest::Config::from_env()?, listener, shutdown).await
        }
        Service::Vision => {
            ecoscan_vision::serve(ecoscan_vision::Config::from_env()?, listener, shutdown).await
        }
        Service::Rule => {
            ecoscan_rule::serve(ecoscan_rule::Config::from_env()?, listener, shutdown).await
        }
        Service::Answer => {
            ecoscan_answer::serve(ecoscan_answer::Config::from_env()?, listener, shutdown).await
        }
        Service::Reward => {
            ecoscan_reward::serve(ecoscan_reward::Config::from_env()?, listener, shutdown).await
        }
        Service::Analytics => {
            ecoscan_analytics::serve(ecoscan_analytics::Config::from_env()?, listener, shutdown)
                .await
        }
        Service::Notification => {
            ecoscan_notification::serve(
                ecoscan_notification::Config::from_env()?,
                listener,
                shutdown,
            )
            .await
        }
    }
}

/// Writes `addr` to `path` in one step (a temporary file renamed over it), so a reader never
/// sees a partial address.
fn write_addr_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, addr.to_string())?;
    std::fs::rename(&tmp, path)
}
