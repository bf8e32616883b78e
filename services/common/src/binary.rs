//! What every service binary does around `serve`: read its command, bind its address, and turn
//! SIGTERM/SIGINT into a cancelled shutdown token.

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The command a service binary was started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Serve (the default).
    Serve,
    /// Apply the database migrations and exit.
    Migrate,
}

/// Reads the command line of service binary `name` (`ecoscan-<service>`): `serve` (the default) or, for
/// a service with a database, `migrate`; `--help` and `--version` print and exit, and anything
/// else is refused with a usage message (exit status 2), as is an environment variable of
/// ecoscan's prefixes that nothing reads ([`crate::config::check_unknown_variables`]). Settings
/// are environment variables, which the help names.
pub fn command(name: &'static str, about: &str, addr_var: &str, migrations: bool) -> Command {
    let command = match parse(name, about, addr_var, migrations, std::env::args_os()) {
        Ok(command) => command,
        Err(e) => e.exit(),
    };
    raise_file_limit();
    // A bad identity key stops the start, instead of failing every call between services.
    if let Err(e) =
        crate::config::check_unknown_variables().and_then(|()| crate::assertion::check_env())
    {
        eprintln!("{name}: {e}");
        std::process::exit(2);
    }
    command
}

fn parse<I, T>(
    name: &'static str,
    about: &str,
    addr_var: &str,
    migrations: bool,
    args: I,
) -> Result<Command, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let mut cli = clap::Command::new(name)
        .about(about.to_owned())
        .version(env!("CARGO_PKG_VERSION"))
        .after_help(format!(
            "Settings are environment variables: {addr_var} is the address to listen on, and \
             docs/configuration.md lists the rest (durations take ms, s, m, h or d). \
             GRPC_TLS_CERT/GRPC_TLS_KEY/GRPC_TLS_CA turn on TLS; ECOSCAN_STORES=production \
             refuses embedded stores."
        ))
        .subcommand(
            clap::Command::new("serve").about("Serve until SIGTERM or SIGINT (the default)"),
        );
    if migrations {
        cli = cli.subcommand(
            clap::Command::new("migrate")
                .about("Bring the database schema up to date, then exit (safe to run again)"),
        );
    }
    let matches = cli.try_get_matches_from(args)?;
    Ok(match matches.subcommand_name() {
        Some("migrate") => Command::Migrate,
        _ => Command::Serve,
    })
}

/// Raises this process's open-file limit to its hard limit, as servers do (nginx's
/// `worker_rlimit_nofile`, Go's runtime at start): every connection is a descriptor, and the
/// soft limit many systems start processes with (1,024) would cap a gateway at about a
/// thousand clients while the hard limit allows far more. Best effort: a process that may not
/// raise it keeps what it has.
pub fn raise_file_limit() {
    if let Err(e) = rlimit::increase_nofile_limit(u64::MAX) {
        eprintln!("could not raise the open-file limit: {e}");
    }
}

/// What a service binary is, for [`run`] and [`run_with_migrations`].
#[derive(Clone, Copy, Debug)]
pub struct Binary {
    /// `ecoscan-ingest`, …: the command's name.
    pub binary: &'static str,
    /// `ingest`, …: the service, as telemetry names it.
    pub service: &'static str,
    /// One line of `--help`.
    pub about: &'static str,
    /// The variable holding the address to listen on, and its default.
    pub addr_var: &'static str,
    pub default_addr: &'static str,
}

/// A service binary's `main`: [`run`] (or, with `migrations`, [`run_with_migrations`]) of the
/// library crate `$krate` (its `Config::from_env`, `serve` and `migrate`), as
/// `ecoscan-<service>` listening on `$addr_var` (default `$default_addr`).
#[macro_export]
macro_rules! service_main {
    ($krate:ident, $service:literal, $about:literal, $addr_var:literal, $default_addr:literal) => {
        #[tokio::main]
        async fn main() -> anyhow::Result<()> {
            $crate::binary::run(
                $crate::service_main!(@binary $service, $about, $addr_var, $default_addr),
                $krate::Config::from_env,
                $krate::serve,
            )
            .await
        }
    };
    ($krate:ident, $service:literal, $about:literal, $addr_var:literal, $default_addr:literal,
     migrations) => {
        #[tokio::main]
        async fn main() -> anyhow::Result<()> {
            $crate::binary::run_with_migrations(
                $crate::service_main!(@binary $service, $about, $addr_var, $default_addr),
                $krate::Config::from_env,
                $krate::serve,
                async |config: &$krate::Config| $krate::migrate(config).await,
            )
            .await
        }
    };
    (@binary $service:literal, $about:literal, $addr_var:literal, $default_addr:literal) => {
        $crate::binary::Binary {
            binary: concat!("ecoscan-", $service),
            service: $service,
            about: $about,
            addr_var: $addr_var,
            default_addr: $default_addr,
        }
    };
}

/// The whole life of a service binary: its command line (before anything else, so that `--help`
/// works whatever the environment holds), telemetry, its configuration from the environment,
/// then `serve` on its address until SIGTERM or SIGINT.
pub async fn run<C>(
    bin: Binary,
    config: impl FnOnce() -> anyhow::Result<C>,
    serve: impl AsyncFnOnce(C, TcpListener, CancellationToken) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    run_any(bin, config, serve, None::<NoMigrations<C>>).await
}

/// [`run`] for a service with a database: `ecoscan-<service> migrate` applies its migrations
/// with `migrate` and exits.
pub async fn run_with_migrations<C>(
    bin: Binary,
    config: impl FnOnce() -> anyhow::Result<C>,
    serve: impl AsyncFnOnce(C, TcpListener, CancellationToken) -> anyhow::Result<()>,
    migrate: impl AsyncFnOnce(&C) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    run_any(bin, config, serve, Some(migrate)).await
}

/// What [`run`] passes for migrations: none.
type NoMigrations<C> = fn(&C) -> std::future::Ready<anyhow::Result<()>>;

async fn run_any<C>(
    bin: Binary,
    config: impl FnOnce() -> anyhow::Result<C>,
    serve: impl AsyncFnOnce(C, TcpListener, CancellationToken) -> anyhow::Result<()>,
    migrate: Option<impl AsyncFnOnce(&C) -> anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let command = self::command(bin.binary, bin.about, bin.addr_var, migrate.is_some());
    let _guard = crate::telemetry::init(bin.service)?;
    let config = config()?;
    if let (Command::Migrate, Some(migrate)) = (command, migrate) {
        migrate(&config).await?;
        tracing::info!("{} database is up to date", bin.service);
        return Ok(());
    }
    let listener = self::bind(bin.service, bin.addr_var, bin.default_addr).await?;
    serve(config, listener, shutdown_on_signal()).await
}

/// Binds the address in `var` (default `default`) and logs where `service` listens.
pub async fn bind(service: &str, var: &str, default: &str) -> anyhow::Result<TcpListener> {
    let addr = crate::config::env_addr(var, default)?;
    let listener = crate::server::listen(addr)
        .with_context(|| format!("failed to bind {service} on {addr} (set {var} to change it)"))?;
    let bound = listener
        .local_addr()
        .context("bound listener has no address")?;
    tracing::info!(service, addr = %bound, "listening");
    Ok(listener)
}

/// A token cancelled once the process has drained after the first SIGTERM or SIGINT: the
/// signal starts the drain ([`crate::shutdown::draining`]: servers report not ready but keep
/// serving), and the token is cancelled `SHUTDOWN_DRAIN_GRACE` later, or at a second signal.
pub fn shutdown_on_signal() -> CancellationToken {
    let grace = crate::shutdown::drain_grace().unwrap_or_else(|e| {
        tracing::error!(error = format!("{e:#}"), "using the default drain grace");
        crate::shutdown::DEFAULT_DRAIN_GRACE
    });
    let token = CancellationToken::new();
    tokio::spawn({
        let token = token.clone();
        async move {
            crate::shutdown::signal().await;
            crate::shutdown::draining().cancel();
            tracing::info!(grace = ?grace, "draining: not ready, still serving");
            tokio::select! {
                () = tokio::time::sleep(grace) => {}
                () = crate::shutdown::signal() => tracing::info!("second signal, ending the drain"),
            }
            token.cancel();
        }
    });
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_and_unknown_ones_are_refused() {
        let p = |migrations: bool, args: &[&str]| {
            let argv = std::iter::once("ecoscan-x").chain(args.iter().copied());
            parse("ecoscan-x", "the x service", "X_ADDR", migrations, argv)
        };
        assert_eq!(p(true, &[]).unwrap(), Command::Serve);
        assert_eq!(p(true, &["serve"]).unwrap(), Command::Serve);
        assert_eq!(p(true, &["migrate"]).unwrap(), Command::Migrate);
        let err = p(true, &["migrat"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidSubcommand);
        // A service without a database has no `migrate`.
        assert_eq!(
            p(false, &["migrate"]).unwrap_err().kind(),
            clap::error::ErrorKind::InvalidSubcommand
        );
        assert_eq!(
            p(false, &["--port", "1"]).unwrap_err().kind(),
            clap::error::ErrorKind::UnknownArgument
        );
    }

    #[test]
    fn help_names_the_commands_and_the_settings() {
        let err = parse(
            "ecoscan-x",
            "the x service",
            "X_ADDR",
            true,
            ["ecoscan-x", "--help"],
        )
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
        let help = err.to_string();
        for needle in [
            "the x service",
            "serve",
            "migrate",
            "X_ADDR",
            "docs/configuration.md",
            "h or d",
        ] {
            assert!(help.contains(needle), "{needle:?} in {help}");
        }
        let err = parse(
            "ecoscan-x",
            "the x service",
            "X_ADDR",
            false,
            ["ecoscan-x", "--version"],
        )
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayVersion);
    }
}
