//! SSE tickets: what a client that cannot send headers (`EventSource`) puts in an event stream's
//! URL instead of its token. URLs end up in proxy logs and browser histories, so what goes there
//! is short-lived (`TICKET_TTL`) and good for one stream: `POST /api/v1/sse-tickets` (with the
//! token in `Authorization`) returns one, and `?ticket=` on an SSE route spends it.
//!
//! A ticket is signed (HS256) with `GATEWAY_SSE_TICKET_SECRET` (unset: derived from the
//! identity key every replica shares, else a key this process made at start), and names its
//! caller, so any gateway replica holding the
//! same secret can verify it; each replica refuses a ticket it has seen spent before (the spent
//! ids are kept until they expire).

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use super::{AuthError, Caller};

/// How long a ticket may wait before it is spent.
pub const TICKET_TTL: Duration = Duration::from_secs(60);
/// `aud` of tickets: no bearer token carries it, and a ticket is never a bearer token.
const AUDIENCE: &str = "ecoscan-sse-ticket";

#[derive(Serialize, Deserialize)]
struct Claims {
    sub: String,
    adm: bool,
    aud: String,
    exp: u64,
    jti: String,
}

/// Issues and spends tickets.
pub(super) struct Tickets {
    encoding: EncodingKey,
    decoding: DecodingKey,
    /// Spent ticket ids, with when they can be forgotten (their expiry has passed).
    spent: Mutex<HashMap<String, Instant>>,
}

impl Tickets {
    pub(super) fn new(secret: Option<&str>) -> anyhow::Result<Self> {
        let made;
        let secret = match secret {
            Some(s) => s.as_bytes(),
            None => {
                made = format!(
                    "{}{}",
                    uuid::Uuid::new_v4().simple(),
                    uuid::Uuid::new_v4().simple()
                );
                made.as_bytes()
            }
        };
        Ok(Self {
            encoding: EncodingKey::from_secret(secret)?,
            decoding: DecodingKey::from_secret(secret)?,
            spent: Mutex::default(),
        })
    }

    /// A ticket for `caller`, and how long it is good for.
    pub(super) fn issue(&self, caller: &Caller) -> Result<String, AuthError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let claims = Claims {
            sub: caller.user.clone(),
            adm: caller.admin,
            aud: AUDIENCE.to_owned(),
            exp: now + TICKET_TTL.as_secs(),
            jti: uuid::Uuid::new_v4().simple().to_string(),
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .map_err(|e| AuthError::Invalid(format!("cannot issue a ticket ({e})")))
    }

    /// The caller of `ticket`, which is spent by this call.
    pub(super) fn spend(&self, ticket: &str) -> Result<Caller, AuthError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(&[AUDIENCE]);
        v.set_required_spec_claims(&["exp", "aud", "sub"]);
        // Tickets are checked by the replica that issued them or a sibling with the same clock
        // source; a few seconds cover the difference.
        v.leeway = 5;
        let claims = jsonwebtoken::decode::<Claims>(ticket, &self.decoding, &v)
            .map_err(|e| AuthError::Invalid(format!("the ticket is not valid ({e})")))?
            .claims;
        let mut spent = self.spent.lock().expect("tickets lock poisoned");
        let now = Instant::now();
        if spent.len() > 1024 {
            spent.retain(|_, forget_at| *forget_at > now);
        }
        let forget_at = now + TICKET_TTL + Duration::from_secs(10);
        if spent.insert(claims.jti, forget_at).is_some() {
            return Err(AuthError::Invalid(
                "the ticket was used already; get a new one from POST /api/v1/sse-tickets".into(),
            ));
        }
        Ok(Caller {
            user: claims.sub,
            admin: claims.adm,
        })
    }
}

/// The answer to `POST /api/v1/sse-tickets`.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct TicketResponse {
    /// Put it in an event stream's URL as `?ticket=`; good for one stream.
    pub ticket: String,
    /// Seconds it may wait before it is spent.
    pub expires_in: u64,
}

/// `POST /api/v1/sse-tickets`: a single-use ticket for one event stream.
#[utoipa::path(
    post,
    path = "/api/v1/sse-tickets",
    tag = "account",
    operation_id = "sseTicket",
    summary = "A ticket for one event stream",
    description = "A single-use ticket, good for 60 s, that opens one event stream \
                   (`/api/v1/scan/{id}/events`, `/api/v1/notifications/stream`) as the caller \
                   with `?ticket=`: for an `EventSource`, which cannot send `Authorization`, \
                   so that a long-lived token never goes in a URL. Get a new one for every \
                   (re)connection.",
    responses(
        (status = 200, description = "The ticket.", body = TicketResponse),
        (status = 401, response = crate::schema::Unauthorized),
        (status = 429, response = crate::schema::TooManyRequests),
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn sse_ticket(
    axum::extract::State(state): axum::extract::State<crate::AppState>,
    caller: Caller,
) -> Result<axum::Json<TicketResponse>, crate::error::ApiError> {
    let ticket = state.auth.issue_ticket(&caller)?;
    Ok(axum::Json(TicketResponse {
        ticket,
        expires_in: TICKET_TTL.as_secs(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_is_good_once_and_only_where_its_key_is() {
        let tickets = Tickets::new(None).unwrap();
        let ann = Caller {
            user: "ann".into(),
            admin: true,
        };
        let t = tickets.issue(&ann).unwrap();
        assert_eq!(tickets.spend(&t).unwrap(), ann);
        assert!(
            tickets
                .spend(&t)
                .unwrap_err()
                .to_string()
                .contains("used already")
        );
        let other = Tickets::new(None).unwrap();
        assert!(other.spend(&tickets.issue(&ann).unwrap()).is_err());
        let shared_a = Tickets::new(Some("s".repeat(40).as_str())).unwrap();
        let shared_b = Tickets::new(Some("s".repeat(40).as_str())).unwrap();
        assert_eq!(shared_b.spend(&shared_a.issue(&ann).unwrap()).unwrap(), ann);
        assert!(tickets.spend("not.a.ticket").is_err());
    }
}
