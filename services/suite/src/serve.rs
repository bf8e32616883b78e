//! One service at a time, as `ecoscan serve <service>` and the containers run it: which
//! services there are (and their ports, variables and telemetry names), running one alone from
//! its environment, and migrating the databases of those that have one.

use std::{net::SocketAddr, path::Path};

use anyhow::Context;
use ecoscan_common::CancellationToken;

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
        let p = crate::Ports::DEFAULT;
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
