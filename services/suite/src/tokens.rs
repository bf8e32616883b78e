//! The local suite's credentials: the HS256 secret `ecoscan up`'s gateway verifies tokens
//! with (kept in the data directory), the token `ecoscan up` prints and leaves there for the CLI,
//! and tokens minted for any user (`ecoscan token`).

use std::path::Path;

use anyhow::Context;

/// `iss` and `aud` of the tokens `ecoscan token` mints for `ecoscan up`.
pub const LOCAL_ISSUER: &str = "ecoscan-local";
pub const LOCAL_AUDIENCE: &str = "ecoscan";
/// The file under the data directory that holds `ecoscan up`'s token secret.
const TOKEN_SECRET_FILE: &str = "token-secret";
/// The file under the data directory that holds the services' identity key.
const IDENTITY_KEY_FILE: &str = "identity-key";
/// The file under the data directory that holds the token `ecoscan up` printed last, which the
/// CLI uses when given none.
const TOKEN_FILE: &str = "token";
/// The user of the token `ecoscan up` prints, and of the CLI when it is given none.
pub const LOCAL_USER: &str = "local";
/// How long the token `ecoscan up` prints stays valid.
pub const LOCAL_TOKEN_TTL: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// A token for `user` that `ecoscan up` with `data_dir` accepts.
pub fn local_token(
    data_dir: &Path,
    user: &str,
    admin: bool,
    ttl: std::time::Duration,
) -> anyhow::Result<String> {
    let secret = local_token_secret(data_dir)?;
    ecoscan_gateway::mint_token(&secret, user, admin, LOCAL_ISSUER, LOCAL_AUDIENCE, ttl)
}

/// Mints the token `ecoscan up` prints (for [`LOCAL_USER`]) and keeps it in `data_dir` for the
/// CLI (mode 0600, replaced on every start).
pub fn write_local_token(data_dir: &Path) -> anyhow::Result<String> {
    let token = local_token(data_dir, LOCAL_USER, false, LOCAL_TOKEN_TTL)?;
    let path = data_dir.join(TOKEN_FILE);
    let tmp = data_dir.join(format!("{TOKEN_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    std::io::Write::write_all(&mut file, token.as_bytes())
        .with_context(|| format!("failed to write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("failed to write {}", path.display()))?;
    Ok(token)
}

/// The token `ecoscan up` left in `data_dir`, for the CLI.
pub fn read_local_token(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(TOKEN_FILE);
    let token = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no token given and none in {} (`ecoscan up` writes it there): pass --token, \
             --data-dir of the running `ecoscan up`, or --user to mint one from its secret",
            path.display()
        )
    })?;
    Ok(token.trim().to_owned())
}

/// The HS256 secret of `ecoscan up`'s gateway, kept in `data_dir` (created on first use, readable
/// by its owner only), so that `ecoscan token` can mint tokens it accepts.
pub fn local_token_secret(data_dir: &Path) -> anyhow::Result<String> {
    local_secret(data_dir, TOKEN_SECRET_FILE)
}

/// The key `ecoscan up`'s services sign and verify identity assertions with
/// (`ecoscan_common::assertion`), kept in `data_dir` like the token secret, so that
/// `ecoscan token --grpc` can sign what a grpcurl caller attaches.
pub fn local_identity_key(data_dir: &Path) -> anyhow::Result<String> {
    local_secret(data_dir, IDENTITY_KEY_FILE)
}

/// The key every service of the local suite uses: `ECOSCAN_IDENTITY_KEY` when set, else the data
/// directory's.
pub fn use_local_identity_key(data_dir: &Path) -> anyhow::Result<()> {
    if ecoscan_common::config::env_opt(ecoscan_common::assertion::KEY_VAR).is_some() {
        return ecoscan_common::assertion::check_env();
    }
    ecoscan_common::assertion::set_key(&local_identity_key(data_dir)?)
}

fn local_secret(data_dir: &Path, file: &str) -> anyhow::Result<String> {
    let path = data_dir.join(file);
    match std::fs::read_to_string(&path) {
        Ok(secret) if secret.trim().len() >= 32 => return Ok(secret.trim().to_owned()),
        Ok(_) => anyhow::bail!("{} is too short to be a secret", path.display()),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(anyhow::Error::from(e).context(format!("cannot read {}", path.display())));
        }
        Err(_) => {}
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("failed to create {}", data_dir.display()))?;
    let secret = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(&path) {
        Ok(mut file) => {
            std::io::Write::write_all(&mut file, secret.as_bytes())
                .with_context(|| format!("failed to write {}", path.display()))?;
            Ok(secret)
        }
        // Another process created it first: use theirs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => local_secret(data_dir, file),
        Err(e) => Err(anyhow::Error::from(e).context(format!("cannot create {}", path.display()))),
    }
}
