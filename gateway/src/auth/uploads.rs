//! Upload tokens: what the gateway's own upload URL (`PUT /api/v1/uploads/{id}?token=`) carries
//! when ingest's object store cannot presign one (the embedded store keeps photos in a local
//! directory, which no client can reach). The token does what a presigned S3 URL's signature
//! does: it names the upload and its owner, the type and the exact size the upload was declared
//! with, and an expiry, signed (HS256) so that none of them can be changed. It is the PUT's only
//! credential (no bearer token: an app hands the URL to whatever sends the bytes, as with S3),
//! checked before the body is read, so a forged or expired one costs the headers only.
//!
//! Signed with `GATEWAY_SSE_TICKET_SECRET` (unset: a key this process made at start, so an upload
//! URL works on the replica that made it), under a key of its own derived from it and with an
//! audience of its own: an SSE ticket is never an upload token, nor the reverse.

use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use super::{AuthError, Caller};

/// `aud` of upload tokens.
const AUDIENCE: &str = "ecoscan-upload";

#[derive(Serialize, Deserialize)]
struct Claims {
    sub: String,
    aud: String,
    exp: u64,
    /// The upload.
    upl: String,
    /// The declared type: the PUT's `Content-Type` must be it.
    typ: String,
    /// The declared size: the PUT's body must be exactly this many bytes.
    len: u64,
}

/// What a valid token allows: one photo of `content_type` and `size_bytes` to `upload_id`,
/// for `caller`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UploadGrant {
    pub caller: Caller,
    pub upload_id: String,
    pub content_type: String,
    pub size_bytes: u64,
}

/// Issues and checks upload tokens.
pub(super) struct UploadTokens {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

impl UploadTokens {
    /// Keys derived from `secret` (the SSE tickets' secret), or made now when there is none.
    pub(super) fn new(secret: Option<&str>) -> anyhow::Result<Self> {
        let secret = match secret {
            Some(s) => format!("{s}\nupload-tokens"),
            None => format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            ),
        };
        Ok(Self {
            encoding: EncodingKey::from_secret(secret.as_bytes())?,
            decoding: DecodingKey::from_secret(secret.as_bytes())?,
        })
    }

    /// A token for `grant`, good until `expires_at` (the upload's own expiry).
    pub(super) fn issue(
        &self,
        grant: &UploadGrant,
        expires_at: SystemTime,
    ) -> Result<String, AuthError> {
        let claims = Claims {
            sub: grant.caller.user.clone(),
            aud: AUDIENCE.to_owned(),
            exp: expires_at
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            upl: grant.upload_id.clone(),
            typ: grant.content_type.clone(),
            len: grant.size_bytes,
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .map_err(|e| AuthError::Invalid(format!("cannot issue an upload token ({e})")))
    }

    /// What `token` allows, when it is valid, unexpired and for `upload_id`.
    pub(super) fn check(&self, token: &str, upload_id: &str) -> Result<UploadGrant, AuthError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(&[AUDIENCE]);
        v.set_required_spec_claims(&["exp", "aud", "sub"]);
        // The upload's expiry is the token's, to the second: no leeway.
        v.leeway = 0;
        let renew = "create a new upload with POST /api/v1/uploads";
        let claims = jsonwebtoken::decode::<Claims>(token, &self.decoding, &v)
            .map_err(|e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                    AuthError::Invalid(format!("the upload URL has expired; {renew}"))
                }
                _ => AuthError::Invalid(format!(
                    "the upload URL's token is not one this gateway issued; {renew}"
                )),
            })?
            .claims;
        if claims.upl != upload_id {
            return Err(AuthError::Invalid(format!(
                "the upload URL's token is for another upload; {renew}"
            )));
        }
        Ok(UploadGrant {
            caller: Caller {
                user: claims.sub,
                admin: false,
            },
            upload_id: claims.upl,
            content_type: claims.typ,
            size_bytes: claims.len,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn grant() -> UploadGrant {
        UploadGrant {
            caller: Caller {
                user: "ann".into(),
                admin: false,
            },
            upload_id: "u1".into(),
            content_type: "image/png".into(),
            size_bytes: 42,
        }
    }

    #[test]
    fn a_token_grants_what_it_was_issued_for_and_only_for_its_upload() {
        let tokens = UploadTokens::new(None).unwrap();
        let later = SystemTime::now() + Duration::from_secs(600);
        let t = tokens.issue(&grant(), later).unwrap();
        assert_eq!(tokens.check(&t, "u1").unwrap(), grant());
        let e = tokens.check(&t, "u2").unwrap_err();
        assert!(e.to_string().contains("another upload"), "{e}");
        let e = tokens.check("not.a.token", "u1").unwrap_err();
        assert!(e.to_string().contains("not one this gateway issued"), "{e}");
    }

    #[test]
    fn a_token_is_good_only_where_its_key_is_and_until_its_expiry() {
        let key = "s".repeat(40);
        let a = UploadTokens::new(Some(&key)).unwrap();
        let b = UploadTokens::new(Some(&key)).unwrap();
        let other = UploadTokens::new(None).unwrap();
        let later = SystemTime::now() + Duration::from_secs(600);
        let t = a.issue(&grant(), later).unwrap();
        assert_eq!(b.check(&t, "u1").unwrap(), grant());
        assert!(other.check(&t, "u1").is_err());
        let past = SystemTime::now() - Duration::from_secs(5);
        let e = a
            .check(&a.issue(&grant(), past).unwrap(), "u1")
            .unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
    }
}
