//! `ecoscan`: the whole suite in one process.

use std::{net::IpAddr, path::PathBuf};

use clap::{Parser, Subcommand};
use ecoscan::{Ports, Service, SuiteConfig};

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
}

#[derive(clap::Args)]
struct TokenArgs {
    /// The user the token acts for (its `sub`).
    #[arg(long)]
    user: String,
    /// Grant the admin role (needed for /api/v1/usage).
    #[arg(long)]
    admin: bool,
    /// How long the token is valid: `1h`, `30m`, `7d`.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    ttl: std::time::Duration,
    /// The data directory of the `ecoscan up` that should accept the token (its secret lives
    /// there).
    #[arg(long, env = "ECOSCAN_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,
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
    /// Address every service binds.
    #[arg(long, env = "ECOSCAN_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, env = "ECOSCAN_GATEWAY_PORT", default_value_t = Ports::DEFAULT.gateway)]
    gateway_port: u16,
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = match Cli::parse().command {
        Command::Up(args) => args,
        Command::Serve(args) => return serve(args.service).await,
        Command::Token(args) => return token(args),
    };
    let _telemetry = ecoscan_common::telemetry::init("suite")?;
    let ports = Ports {
        gateway: args.gateway_port,
        ingest: args.ingest_port,
        vision: args.vision_port,
        rule: args.rule_port,
        answer: args.answer_port,
        reward: args.reward_port,
        analytics: args.analytics_port,
        notification: args.notification_port,
    };
    let config = SuiteConfig::from_env(&args.data_dir, args.host, ports)?;
    let provider = config.llm.provider;
    let running = ecoscan::start(config, ecoscan_common::binary::shutdown_on_signal()).await?;
    let a = running.addrs;
    println!(
        "\necoscan is up (model provider: {provider}; data in {data})\n\n\
         gateway        http://{gw}   (demo page: http://{gw}/)\n\
         ingest         {ingest}\n\
         vision         {vision}\n\
         rule           {rule}\n\
         answer         {answer}\n\
         reward         {reward}\n\
         analytics      {analytics}\n\
         notification   {notification}\n\n\
         Run a scan and stream its events:\n  \
         curl -N -F image=@photo.jpg -F hint='plastic bottle' http://{gw}/api/v1/scan/completion\n\n\
         Explore over gRPC:\n  \
         grpcurl -plaintext {ingest} list\n  \
         grpcurl -plaintext -d '{{}}' {rule} ecoscan.v1.RuleService/ListCategories\n",
        data = args.data_dir.display(),
        gw = a.gateway,
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
    ecoscan::serve_one(service, ecoscan_common::binary::shutdown_on_signal()).await
}

/// `ecoscan token`: a token signed with the local suite's secret.
fn token(args: TokenArgs) -> anyhow::Result<()> {
    let secret = ecoscan::local_token_secret(&args.data_dir)?;
    let token = ecoscan_gateway::mint_token(
        &secret,
        &args.user,
        args.admin,
        ecoscan::LOCAL_ISSUER,
        ecoscan::LOCAL_AUDIENCE,
        args.ttl,
    )?;
    println!("{token}");
    Ok(())
}
