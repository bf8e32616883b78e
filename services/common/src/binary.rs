//! What every service binary does around `serve`: read its command, bind its address, and turn
//! SIGTERM/SIGINT into a cancelled shutdown token.

use anyhow::{Context, bail};
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

/// Reads the command from the first argument: none or `serve`, or `migrate`.
pub fn command() -> anyhow::Result<Command> {
    parse_command(std::env::args().nth(1).as_deref())
}

fn parse_command(arg: Option<&str>) -> anyhow::Result<Command> {
    match arg {
        None | Some("serve") => Ok(Command::Serve),
        Some("migrate") => Ok(Command::Migrate),
        Some(other) => bail!("unknown command {other:?}; use `serve` (the default) or `migrate`"),
    }
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

/// A token cancelled on the first SIGTERM or SIGINT.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    tokio::spawn({
        let token = token.clone();
        async move {
            crate::shutdown::signal().await;
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
        assert_eq!(parse_command(None).unwrap(), Command::Serve);
        assert_eq!(parse_command(Some("serve")).unwrap(), Command::Serve);
        assert_eq!(parse_command(Some("migrate")).unwrap(), Command::Migrate);
        let err = parse_command(Some("migrat")).unwrap_err().to_string();
        assert!(err.contains("unknown command"), "{err}");
    }
}
