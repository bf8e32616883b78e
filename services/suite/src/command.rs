//! The `ecoscan` command line: `up`, `serve`, `token`, `jobs`, the client commands and
//! `migrate`. It lives in the library, not in `main.rs`, so that its code is compiled once: a
//! binary crate re-instantiates the async bodies and generics it reaches, and doing that for a
//! command line that reaches every service cost the first command's build 22 s more (63 s for
//! the binary against 28 s for the library, 69 s for both now; `--timings` on a 2-core machine).

use std::{net::IpAddr, path::PathBuf};

use crate::{Ports, Service, SuiteConfig};
use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ecoscan",
    version,
    about = "AI scan pipeline suite: seven gRPC services and an HTTP gateway"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run every service and the gateway in one process on the embedded stores.
    Up(UpArgs),
    /// Run one service alone, configured by its environment variables like its own binary
    /// (one process per service: containers, tests). `ECOSCAN_ADDR_FILE` receives the bound
    /// address.
    Serve(ServeArgs),
    /// Print a bearer token that `ecoscan up` (with the same data directory) accepts, for curl
    /// and scripts: `curl -H "Authorization: Bearer $(ecoscan token --user alice)" …`.
    Token(TokenArgs),
    /// Operate on scan jobs over ingest's admin API (gRPC, internal port).
    Jobs(JobsArgs),
    /// Scan a photo through a gateway: a progress bar per stage, the answer as it streams, the
    /// character at the end (exit status 1 when the scan fails).
    Scan(ScanArgs),
    /// Follow a scan's events to its end (reconnecting with Last-Event-ID when dropped).
    Watch(WatchArgs),
    /// The characters you own.
    Characters(ListArgs),
    /// Your notifications, newest first; `--follow` prints new ones as they arrive.
    Notifications(NotificationsArgs),
    /// Bring the database schema of the named services (ingest, reward, analytics,
    /// notification; all four when none is named) up to date, then exit: the init container of
    /// each Kubernetes Deployment with a database. Safe to run again and at once from many pods
    /// (PostgreSQL advisory lock); fails on a schema newer than this binary knows. Each service
    /// reads its database URL as when it serves: `INGEST_DATABASE_URL`, `REWARD_DATABASE_URL`,
    /// `ANALYTICS_DATABASE_URL`, `NOTIFICATION_DATABASE_URL`, else `DATABASE_URL`.
    Migrate(MigrateArgs),
}

#[derive(clap::Args)]
struct MigrateArgs {
    /// The services to migrate (default: every one with a database).
    #[arg(value_enum)]
    services: Vec<Service>,
}

/// Where the gateway is and who the client acts for.
#[derive(clap::Args)]
struct ClientArgs {
    /// The gateway's base URL.
    #[arg(
        long,
        env = "ECOSCAN_GATEWAY_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    gateway: String,
    /// A bearer token (`ecoscan token` mints one for the local suite). Without one, the token
    /// `ecoscan up` left in the data directory, or one minted there for `--user`.
    #[arg(long, env = "ECOSCAN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Without a token: act as this user, with a token minted from the local suite's secret in
    /// the data directory.
    #[arg(long)]
    user: Option<String>,
    /// The data directory of the local `ecoscan up` (its token and secret live there).
    #[arg(long, env = "ECOSCAN_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// One JSON object per line instead of the human view.
    #[arg(long)]
    json: bool,
}

impl ClientArgs {
    fn client(&self) -> anyhow::Result<crate::cli::Client> {
        let token = match (&self.token, &self.user) {
            (Some(t), _) => t.clone(),
            // Long enough for a `--follow` session; it never leaves this process.
            (None, Some(user)) => crate::local_token(
                &self.data_dir,
                user,
                false,
                std::time::Duration::from_secs(24 * 3600),
            )?,
            (None, None) => crate::read_local_token(&self.data_dir)?,
        };
        crate::cli::Client::new(&self.gateway, crate::cli::Auth::Bearer(token))
    }
}

#[derive(clap::Args)]
struct ScanArgs {
    /// The photo (JPEG, PNG, WebP, …).
    photo: PathBuf,
    /// What it is, in your words (helps the model).
    #[arg(long)]
    hint: Option<String>,
    /// `ko` or `en`.
    #[arg(long)]
    locale: Option<String>,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(clap::Args)]
struct WatchArgs {
    /// The scan's job id.
    job_id: String,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(clap::Args)]
struct ListArgs {
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(clap::Args)]
struct NotificationsArgs {
    /// At most this many (1–500).
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// After the list, print new notifications as they arrive (until interrupted).
    #[arg(long)]
    follow: bool,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(clap::Args)]
struct JobsArgs {
    /// Ingest's gRPC address (its internal port, not the gateway).
    #[arg(
        long,
        env = "ECOSCAN_INGEST_URL",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    ingest: String,
    /// The data directory of the local `ecoscan up`: its services' identity key signs the admin
    /// role these calls need (`ECOSCAN_IDENTITY_KEY` instead, when set).
    #[arg(
        long,
        env = "ECOSCAN_DATA_DIR",
        default_value = "./data",
        global = true
    )]
    data_dir: PathBuf,
    #[command(subcommand)]
    command: JobsCommand,
}

#[derive(Subcommand)]
enum JobsCommand {
    /// Jobs given up and set aside (failed too often, or a stored record could not be read).
    #[command(subcommand, name = "dead-letter")]
    DeadLetter(DeadLetterCommand),
}

#[derive(Subcommand)]
enum DeadLetterCommand {
    /// List dead-lettered jobs, newest first.
    List {
        /// At most this many (ingest caps it at 1000).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Only those set aside before this RFC 3339 time (to page back).
        #[arg(long)]
        before: Option<String>,
    },
    /// Put a dead-lettered job back on the queue; it resumes at its first stage without a
    /// checkpoint, and its watchers see the new run.
    Requeue {
        /// The job's id.
        job_id: String,
    },
}

#[derive(clap::Args)]
struct TokenArgs {
    /// The user the token acts for (its `sub`).
    #[arg(long)]
    user: String,
    /// Grant the admin role (needed for /api/v1/analytics/usage, and for the admin RPCs).
    #[arg(long)]
    admin: bool,
    /// How long the token is valid: `1h`, `30m`, `7d` (default 24h); with `--grpc`, at most
    /// `5m` (the default), the longest any service believes an identity assertion.
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Option<std::time::Duration>,
    /// The data directory of the `ecoscan up` that should accept the token (its secret lives
    /// there).
    #[arg(long, env = "ECOSCAN_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// Instead of a bearer token for the gateway: the signed identity assertion a direct gRPC
    /// caller attaches to calls of this service (`ecoscan.v1.ScanService`, …), printed as the
    /// `-H` argument of grpcurl: `grpcurl -H "$(ecoscan token --user alice --grpc
    /// ecoscan.v1.ScanService)" …`.
    #[arg(long, value_name = "SERVICE")]
    grpc: Option<String>,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(value_enum)]
    service: Service,
}

#[derive(clap::Args)]
struct UpArgs {
    /// Where SQLite files, images and LLM bodies are kept.
    #[arg(long, env = "ECOSCAN_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// Address the gateway binds; the services always listen on loopback.
    #[arg(long, env = "ECOSCAN_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, env = "ECOSCAN_GATEWAY_PORT", default_value_t = Ports::DEFAULT.gateway)]
    gateway_port: u16,
    /// The gateway's admin listener (`/metrics`, `/readyz`), always on 127.0.0.1.
    #[arg(long, env = "ECOSCAN_GATEWAY_ADMIN_PORT", default_value_t = Ports::DEFAULT.gateway_admin)]
    gateway_admin_port: u16,
    #[arg(long, env = "ECOSCAN_INGEST_PORT", default_value_t = Ports::DEFAULT.ingest)]
    ingest_port: u16,
    #[arg(long, env = "ECOSCAN_VISION_PORT", default_value_t = Ports::DEFAULT.vision)]
    vision_port: u16,
    #[arg(long, env = "ECOSCAN_RULE_PORT", default_value_t = Ports::DEFAULT.rule)]
    rule_port: u16,
    #[arg(long, env = "ECOSCAN_ANSWER_PORT", default_value_t = Ports::DEFAULT.answer)]
    answer_port: u16,
    #[arg(long, env = "ECOSCAN_REWARD_PORT", default_value_t = Ports::DEFAULT.reward)]
    reward_port: u16,
    #[arg(long, env = "ECOSCAN_ANALYTICS_PORT", default_value_t = Ports::DEFAULT.analytics)]
    analytics_port: u16,
    #[arg(long, env = "ECOSCAN_NOTIFICATION_PORT", default_value_t = Ports::DEFAULT.notification)]
    notification_port: u16,
}

/// Parses the command line and runs the command (what `ecoscan`'s `main` does).
#[tokio::main]
pub async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // A misspelt or removed setting stops the start rather than being ignored.
    ecoscan_common::config::check_unknown_variables()?;
    ecoscan_common::binary::raise_file_limit();
    let args = match cli.command {
        Command::Up(args) => args,
        Command::Serve(args) => return serve(args.service).await,
        Command::Token(args) => return token(args),
        Command::Jobs(args) => return jobs(args).await,
        Command::Scan(args) => return scan(args).await,
        Command::Watch(args) => return watch(args).await,
        Command::Characters(args) => {
            let v = args.client.client()?.characters().await?;
            crate::cli::print_characters(&v, args.client.json);
            return Ok(());
        }
        Command::Notifications(args) => return notifications(args).await,
        Command::Migrate(args) => {
            let _telemetry = ecoscan_common::telemetry::init("migrate")?;
            let done = crate::migrate(&args.services).await?;
            println!("migrated: {}", done.join(", "));
            return Ok(());
        }
    };
    // Each service exports its spans as its own (`ecoscan-ingest`, …); what belongs to none
    // (the suite's own start and stop) as `ecoscan-suite`.
    let _telemetry = ecoscan_common::telemetry::init_routed("suite", crate::telemetry_routes())?;
    let ports = Ports {
        gateway: args.gateway_port,
        gateway_admin: args.gateway_admin_port,
        ingest: args.ingest_port,
        vision: args.vision_port,
        rule: args.rule_port,
        answer: args.answer_port,
        reward: args.reward_port,
        analytics: args.analytics_port,
        notification: args.notification_port,
    };
    // Every service of this process signs and verifies identity with the data directory's key,
    // which `ecoscan token --grpc` signs with too.
    crate::use_local_identity_key(&args.data_dir)?;
    let config = SuiteConfig::from_env(&args.data_dir, args.host, ports)?;
    let provider = config.llm.provider;
    let running = crate::start(config, ecoscan_common::binary::shutdown_on_signal()).await?;
    let a = running.addrs;
    // The page and the CLI need a token: one for the local user, printed in the page's URL
    // (a fragment never reaches a server or a log) and left in the data directory for the CLI.
    let token = crate::write_local_token(&args.data_dir)?;
    let page_host = if a.gateway.ip().is_unspecified() {
        std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), a.gateway.port())
    } else {
        a.gateway
    };
    // Internal TLS (GRPC_TLS_*) changes how grpcurl must call; the certificate must name the
    // address dialled (127.0.0.1 here) for the server to be verified.
    let grpcurl = match ecoscan_common::tls::TlsConfig::global()? {
        None => "-plaintext",
        Some(tls) if tls.is_mutual() => {
            "-cacert \"$GRPC_TLS_CA\" -cert \"$GRPC_TLS_CERT\" -key \"$GRPC_TLS_KEY\""
        }
        Some(_) => "-cacert <the CA that signed GRPC_TLS_CERT>",
    };
    println!(
        "\necoscan is up (model provider: {provider}; data in {data})\n\n\
         gateway        http://{gw}\n\
         gateway admin  http://{admin}   (/metrics, /readyz)\n\
         demo page      http://{page}/#access_token={token}\n\
         \x20              (acting as `{user}`; `ecoscan token --user NAME` mints others)\n\
         ingest         {ingest}\n\
         vision         {vision}\n\
         rule           {rule}\n\
         answer         {answer}\n\
         reward         {reward}\n\
         analytics      {analytics}\n\
         notification   {notification}\n\n\
         Run a scan and stream its events (the token is in {data}/token):\n  \
         curl -N -H \"Authorization: Bearer $(cat {data}/token)\" \\\n    \
         -F image=@photo.jpg -F hint='plastic bottle' http://{page}/api/v1/scan/completion\n\n\
         Explore over gRPC:\n  \
         grpcurl {grpcurl} {ingest} list\n  \
         grpcurl {grpcurl} -d '{{}}' {rule} ecoscan.v1.RuleService/ListCategories\n",
        data = args.data_dir.display(),
        gw = a.gateway,
        admin = a.gateway_admin,
        page = page_host,
        user = crate::LOCAL_USER,
        ingest = a.ingest,
        vision = a.vision,
        rule = a.rule,
        answer = a.answer,
        reward = a.reward,
        analytics = a.analytics,
        notification = a.notification,
    );
    running.wait().await
}

/// `ecoscan serve <service>`: one service, with its own telemetry resource
/// (`service.name = ecoscan-<service>`), until SIGTERM or SIGINT.
async fn serve(service: Service) -> anyhow::Result<()> {
    let _telemetry = ecoscan_common::telemetry::init(service.name())?;
    crate::serve_one(service, ecoscan_common::binary::shutdown_on_signal()).await
}

/// `ecoscan token`: a token signed with the local suite's secret, or with `--grpc` an identity
/// assertion signed with its services' key.
fn token(args: TokenArgs) -> anyhow::Result<()> {
    if let Some(service) = &args.grpc {
        anyhow::ensure!(
            ecoscan_common::identity::valid_user_id(&args.user),
            "user must be 1-128 characters of letters, digits and _.@|:+-"
        );
        let ttl = args.ttl.unwrap_or(ecoscan_common::assertion::MAX_LIFETIME);
        ecoscan_common::assertion::check_lifetime(ttl)?;
        crate::use_local_identity_key(&args.data_dir)?;
        let assertion =
            ecoscan_common::assertion::sign_for(Some(&args.user), args.admin, service, ttl)?;
        println!(
            "{}: {assertion}",
            ecoscan_common::assertion::ASSERTION_HEADER
        );
        return Ok(());
    }
    let secret = crate::local_token_secret(&args.data_dir)?;
    let token = ecoscan_gateway::mint_token(
        &secret,
        &args.user,
        args.admin,
        crate::LOCAL_ISSUER,
        crate::LOCAL_AUDIENCE,
        args.ttl
            .unwrap_or(std::time::Duration::from_secs(24 * 3600)),
    )?;
    println!("{token}");
    Ok(())
}

/// `ecoscan jobs …`: prints what ingest answered; a refusal is an error (exit status 1).
async fn jobs(args: JobsArgs) -> anyhow::Result<()> {
    crate::use_local_identity_key(&args.data_dir)?;
    let out = match args.command {
        JobsCommand::DeadLetter(DeadLetterCommand::List { limit, before }) => {
            crate::jobs::list(&args.ingest, limit, before.as_deref()).await?
        }
        JobsCommand::DeadLetter(DeadLetterCommand::Requeue { job_id }) => {
            crate::jobs::requeue(&args.ingest, &job_id).await?
        }
    };
    print!("{out}");
    Ok(())
}

/// `ecoscan scan`: submit, then follow the job to its end.
async fn scan(args: ScanArgs) -> anyhow::Result<()> {
    let image = std::fs::read(&args.photo)
        .with_context(|| format!("cannot read {}", args.photo.display()))?;
    let client = args.client.client()?;
    let job_id = client
        .submit(&image, args.hint.as_deref(), args.locale.as_deref())
        .await?;
    follow(&client, &job_id, args.client.json).await
}

/// `ecoscan watch`: follow a job that is already submitted.
async fn watch(args: WatchArgs) -> anyhow::Result<()> {
    let client = args.client.client()?;
    follow(&client, &args.job_id, args.client.json).await
}

async fn follow(client: &crate::cli::Client, job_id: &str, json: bool) -> anyhow::Result<()> {
    let mut view = crate::cli::ScanView::new(json);
    let outcome = client
        .follow(job_id, |name, data| view.event(name, data))
        .await?;
    view.finish(job_id);
    match outcome {
        crate::cli::Outcome::Ready => Ok(()),
        crate::cli::Outcome::Failed => {
            // The reason is printed; the status says it failed.
            std::process::exit(1)
        }
    }
}

async fn notifications(args: NotificationsArgs) -> anyhow::Result<()> {
    let client = args.client.client()?;
    let json = args.client.json;
    let list = client.notifications(args.limit).await?;
    for n in list["notifications"].as_array().into_iter().flatten() {
        crate::cli::print_notification(n, json);
    }
    if args.follow {
        client
            .follow_notifications(|n| crate::cli::print_notification(n, json))
            .await?;
    }
    Ok(())
}
