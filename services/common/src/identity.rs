//! The user a call acts for. Code names it in one place only, the `x-user-id` request metadata,
//! set by the gateway from the authenticated caller (or by ingest, acting for a job's owner); on
//! the wire it travels as a signed assertion ([`crate::assertion`]), and a server sets
//! `x-user-id` again from a verified one only. No request field can name or override it.

use tonic::metadata::MetadataMap;

/// Metadata key that carries the acting user's id on internal calls.
pub const USER_ID_HEADER: &str = "x-user-id";
/// Metadata key that carries the acting user's roles (`admin`), comma-separated.
pub const ROLES_HEADER: &str = "x-user-roles";

/// Metadata key that names the ecoscan service making a call on its own account (`ingest`
/// running a job's stages, a service reporting its model calls), set by code like
/// [`USER_ID_HEADER`] and, like it, believed only from a verified assertion (its `act` claim).
pub const ACTOR_HEADER: &str = "x-ecoscan-actor";

/// The actor of ingest's stage calls: reward's `Evaluate` grants for no other.
pub const INGEST_ACTOR: &str = "ingest";

/// The ecoscan service that makes the call on its own account, when a verified assertion names
/// one.
pub fn actor(metadata: &MetadataMap) -> Option<&str> {
    metadata
        .get(ACTOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|a| !a.is_empty())
}

/// Whether the call carries any verified identity: a user, the admin role or an actor.
pub fn has_identity(metadata: &MetadataMap) -> bool {
    metadata.contains_key(USER_ID_HEADER) || is_admin(metadata) || actor(metadata).is_some()
}

/// Whether the call's metadata grants the `admin` role.
pub fn is_admin(metadata: &MetadataMap) -> bool {
    metadata
        .get(ROLES_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|roles| roles.split(',').any(|r| r.trim() == "admin"))
}

/// Why a call has no usable user: `UNAUTHENTICATED` either way (the user comes from the
/// verified assertion only, so a missing or unusable one is a missing credential).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "this call needs an identity: send the signed `x-ecoscan-identity` assertion of the user \
         it acts for (`ecoscan token --grpc <service> --user <id>` prints one)"
    )]
    Missing,
    #[error(
        "the identity names an unusable user id: a user id is 1-128 characters of letters, \
         digits, '_', '.', '@', '|', ':', '+' or '-'"
    )]
    Invalid,
}

impl From<IdentityError> for tonic::Status {
    fn from(e: IdentityError) -> Self {
        let reason = match e {
            IdentityError::Missing => crate::reasons::Reason::IdentityMissing,
            IdentityError::Invalid => crate::reasons::Reason::IdentityInvalid,
        };
        crate::reasons::status(
            tonic::Code::Unauthenticated,
            e.to_string(),
            reason,
            &[],
            None,
        )
    }
}

/// Whether `id` is a user id services accept: short, printable, no separators that could
/// confuse a log line or a key (`|` and `:` appear in OIDC subjects such as `auth0|123`).
pub fn valid_user_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.@|:+-".contains(&b))
}

/// The acting user of a call, from its metadata.
pub fn caller(metadata: &MetadataMap) -> Result<String, IdentityError> {
    let Some(value) = metadata.get(USER_ID_HEADER) else {
        return Err(IdentityError::Missing);
    };
    let id = value.to_str().map_err(|_| IdentityError::Invalid)?;
    if id.is_empty() {
        return Err(IdentityError::Missing);
    }
    if !valid_user_id(id) {
        return Err(IdentityError::Invalid);
    }
    Ok(id.to_owned())
}

#[cfg(test)]
mod tests {
    use tonic::metadata::MetadataValue;

    use super::*;

    fn with(value: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert(USER_ID_HEADER, MetadataValue::try_from(value).unwrap());
        m
    }

    #[test]
    fn the_caller_comes_from_metadata() {
        assert_eq!(caller(&with("alice")).unwrap(), "alice");
        assert_eq!(caller(&with("auth0|abc:1")).unwrap(), "auth0|abc:1");
    }

    #[test]
    fn a_missing_empty_or_odd_user_is_refused() {
        assert_eq!(caller(&MetadataMap::new()), Err(IdentityError::Missing));
        assert_eq!(caller(&with("")), Err(IdentityError::Missing));
        assert_eq!(caller(&with("a b")), Err(IdentityError::Invalid));
        assert_eq!(caller(&with(&"a".repeat(129))), Err(IdentityError::Invalid));
        assert!(valid_user_id("alice@example.com"));
        assert!(valid_user_id("u_1.2-3"));
        assert!(!valid_user_id(""));
        assert!(!valid_user_id("a b"));
        assert!(!valid_user_id("ünïcode"));
        assert!(!valid_user_id(&"a".repeat(129)));
    }

    #[test]
    fn a_call_without_a_usable_identity_is_unauthenticated() {
        for e in [IdentityError::Missing, IdentityError::Invalid] {
            let status = tonic::Status::from(e);
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
        }
        let missing = tonic::Status::from(IdentityError::Missing);
        assert!(
            missing.message().contains("ecoscan token --grpc"),
            "{missing:?}"
        );
        use tonic_types::StatusExt as _;
        let details = missing.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "IDENTITY_MISSING");
    }
}
