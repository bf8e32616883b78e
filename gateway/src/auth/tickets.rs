//! SSE tickets: what a client that cannot send headers (`EventSource`) puts in an event stream's
//! URL instead of its token. URLs end up in proxy logs and browser histories, so what goes there
//! is short-lived and good for one stream: `POST /api/v1/sse-tickets` (with the token in
//! `Authorization`) returns one, and `?ticket=` on an SSE route uses it.
//!
//! A native `EventSource` reconnects by itself with the URL it was given, ticket included, after
//! every dropped connection. So a ticket is good for the stream it opened, not for one
//! connection: its first use (within `TICKET_TTL` of its issue) binds it to that stream, and the
//! same stream may be opened with it again for `GATEWAY_SSE_TICKET_RESUME` (1 h) after that;
//! another stream, or a use after that, is refused. A ticket issued for a named stream
//! (`?stream=`) is bound from the start and good for that stream until the same time after its
//! issue, on any replica; an unbound one's binding is kept by the replica that saw its first
//! use (a reconnect that another replica serves needs a ticket issued for its stream).
//!
//! A ticket is signed (HS256) with `GATEWAY_SSE_TICKET_SECRET` (unset: derived from the
//! identity key every replica shares, else a key this process made at start), and names its
//! caller, so any gateway replica holding the same secret can verify it.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use super::{AuthError, Caller};

/// How long a ticket may wait before its first use.
pub const TICKET_TTL: Duration = Duration::from_secs(60);
/// `aud` of tickets: no bearer token carries it, and a ticket is never a bearer token.
const AUDIENCE: &str = "ecoscan-sse-ticket";
/// Clock difference tolerated between the replica that issued a ticket and the one that checks
/// it (both read the same clock source).
const LEEWAY_SECS: u64 = 5;

#[derive(Serialize, Deserialize)]
struct Claims {
    sub: String,
    adm: bool,
    aud: String,
    exp: u64,
    jti: String,
    /// The stream (path) it is bound to from its issue, if it was issued for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stream: Option<String>,
}

/// The stream an unbound ticket opened first, and until when it may open it again.
struct FirstUse {
    stream: String,
    until: Instant,
}

/// Issues and checks tickets.
pub(super) struct Tickets {
    encoding: EncodingKey,
    decoding: DecodingKey,
    /// How long a ticket stays good for its stream's reconnects.
    resume: Duration,
    /// Unbound tickets this replica saw used, by id, until their reconnects are over.
    used: Mutex<HashMap<String, FirstUse>>,
}

/// Seconds since the epoch.
fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Whether `path` is an event stream a ticket may open.
pub(crate) fn is_stream_path(path: &str) -> bool {
    path == "/api/v1/notifications/stream"
        || path
            .strip_prefix("/api/v1/scan/")
            .and_then(|rest| rest.strip_suffix("/events"))
            .is_some_and(|id| !id.is_empty() && !id.contains(['/', '?', '#']))
}

impl Tickets {
    pub(super) fn new(secret: Option<&str>, resume: Duration) -> anyhow::Result<Self> {
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
            resume,
            used: Mutex::default(),
        })
    }

    /// A ticket for `caller`, bound to `stream` when one is named.
    pub(super) fn issue(&self, caller: &Caller, stream: Option<&str>) -> Result<String, AuthError> {
        let life = if stream.is_some() {
            self.resume
        } else {
            TICKET_TTL
        };
        let claims = Claims {
            sub: caller.user.clone(),
            adm: caller.admin,
            aud: AUDIENCE.to_owned(),
            exp: now_secs() + life.as_secs(),
            jti: uuid::Uuid::new_v4().simple().to_string(),
            stream: stream.map(str::to_owned),
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .map_err(|e| AuthError::Invalid(format!("cannot issue a ticket ({e})")))
    }

    /// The caller of `ticket`, used to open `stream` (the request's path).
    pub(super) fn spend(&self, ticket: &str, stream: &str) -> Result<Caller, AuthError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(&[AUDIENCE]);
        v.set_required_spec_claims(&["exp", "aud", "sub"]);
        // Expiry is judged below: an unbound ticket past it may still reopen its stream.
        v.validate_exp = false;
        let claims = jsonwebtoken::decode::<Claims>(ticket, &self.decoding, &v)
            .map_err(|_| {
                AuthError::Invalid(
                    "the ticket is not one this gateway issued; get a new one from POST \
                     /api/v1/sse-tickets"
                        .into(),
                )
            })?
            .claims;
        let caller = Caller {
            user: claims.sub,
            admin: claims.adm,
        };
        let live = now_secs() <= claims.exp + LEEWAY_SECS;
        let renew = "get a new one from POST /api/v1/sse-tickets";
        if let Some(bound) = claims.stream {
            return match (bound == stream, live) {
                (false, _) => Err(AuthError::Invalid(format!(
                    "the ticket is for another stream ({bound})"
                ))),
                (true, false) => Err(AuthError::Invalid(format!(
                    "the ticket's time is over; {renew}"
                ))),
                (true, true) => Ok(caller),
            };
        }
        let now = Instant::now();
        let mut used = self.used.lock().expect("tickets lock poisoned");
        if used.len() > 1024 {
            used.retain(|_, u| u.until > now);
        }
        match used.get(&claims.jti) {
            Some(first) if first.stream != stream => Err(AuthError::Invalid(format!(
                "the ticket opened another stream already; {renew}"
            ))),
            Some(first) if first.until <= now => Err(AuthError::Invalid(format!(
                "the ticket's time for reconnects is over; {renew}"
            ))),
            Some(_) => Ok(caller),
            None if !live => Err(AuthError::Invalid(format!(
                "the ticket expired before it was used ({} s); {renew}",
                TICKET_TTL.as_secs()
            ))),
            None => {
                used.insert(
                    claims.jti,
                    FirstUse {
                        stream: stream.to_owned(),
                        until: now + self.resume,
                    },
                );
                Ok(caller)
            }
        }
    }
}

/// The answer to `POST /api/v1/sse-tickets`.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct TicketResponse {
    /// Put it in an event stream's URL as `?ticket=`. Good for the stream it opens first (or
    /// the one it was issued for), and for that stream's reconnects.
    pub ticket: String,
    /// Seconds it may wait before its first use.
    pub expires_in: u64,
    /// Seconds after its first use (after its issue, when issued for a stream) during which
    /// the same stream may be opened with it again: an `EventSource` reconnects by itself.
    pub reconnects_for: u64,
    /// The stream it is bound to, when one was named.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub stream: Option<String>,
}

/// Which stream a ticket is for.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct TicketQuery {
    /// Bind the ticket to this stream from its issue (`/api/v1/scan/{id}/events` or
    /// `/api/v1/notifications/stream`): then it opens that stream on any gateway replica for
    /// the whole reconnect window. Without it, the ticket binds to the first stream it opens.
    #[param(nullable = false)]
    stream: Option<String>,
}

/// `POST /api/v1/sse-tickets`: a ticket for one event stream and its reconnects.
#[utoipa::path(
    post,
    path = "/api/v1/sse-tickets",
    tag = "account",
    operation_id = "sseTicket",
    summary = "A ticket for one event stream",
    description = "A ticket that opens one event stream (`/api/v1/scan/{id}/events`, \
                   `/api/v1/notifications/stream`) as the caller with `?ticket=`: for an \
                   `EventSource`, which cannot send `Authorization`, so that a long-lived token \
                   never goes in a URL. Its first use must come within 60 s; it is then bound \
                   to that stream, and the `EventSource`'s own reconnects (the same URL, with \
                   `Last-Event-ID`) are accepted for `reconnects_for` seconds. Issued with \
                   `?stream=`, it is bound to that stream from the start, on every replica.",
    params(TicketQuery),
    responses(
        (status = 200, description = "The ticket.", body = TicketResponse),
        (status = 400, response = crate::schema::BadRequest),
        (status = 401, response = crate::schema::Unauthorized),
        (status = 429, response = crate::schema::TooManyRequests),
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn sse_ticket(
    axum::extract::State(state): axum::extract::State<crate::AppState>,
    caller: Caller,
    query: Result<axum::extract::Query<TicketQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<TicketResponse>, crate::error::ApiError> {
    let axum::extract::Query(query) =
        query.map_err(|e| crate::error::ApiError::InvalidArgument(e.body_text()))?;
    let stream = query.stream.filter(|s| !s.is_empty());
    if let Some(s) = &stream
        && !is_stream_path(s)
    {
        return Err(crate::error::ApiError::invalid_field(
            "stream",
            "stream must be an event stream's path: /api/v1/scan/{id}/events or \
             /api/v1/notifications/stream",
        ));
    }
    let ticket = state.auth.issue_ticket(&caller, stream.as_deref())?;
    let reconnects_for = state.config.auth.ticket_resume.as_secs();
    Ok(axum::Json(TicketResponse {
        ticket,
        expires_in: if stream.is_some() {
            reconnects_for
        } else {
            TICKET_TTL.as_secs()
        },
        reconnects_for,
        stream,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVENTS: &str = "/api/v1/scan/j1/events";

    fn ann() -> Caller {
        Caller {
            user: "ann".into(),
            admin: true,
        }
    }

    #[test]
    fn a_ticket_reopens_the_stream_it_opened_and_no_other() {
        let tickets = Tickets::new(None, Duration::from_secs(3600)).unwrap();
        let t = tickets.issue(&ann(), None).unwrap();
        assert_eq!(tickets.spend(&t, EVENTS).unwrap(), ann());
        // The EventSource's reconnects: the same URL.
        assert_eq!(tickets.spend(&t, EVENTS).unwrap(), ann());
        let e = tickets
            .spend(&t, "/api/v1/notifications/stream")
            .unwrap_err();
        assert!(e.to_string().contains("another stream"), "{e}");
        assert!(tickets.spend("not.a.ticket", EVENTS).is_err());
    }

    #[test]
    fn a_ticket_is_good_only_where_its_key_is() {
        let tickets = Tickets::new(None, Duration::from_secs(3600)).unwrap();
        let other = Tickets::new(None, Duration::from_secs(3600)).unwrap();
        let e = other
            .spend(&tickets.issue(&ann(), None).unwrap(), EVENTS)
            .unwrap_err();
        assert!(!e.to_string().contains("InvalidSignature"), "{e}");
        let key = "s".repeat(40);
        let a = Tickets::new(Some(&key), Duration::from_secs(3600)).unwrap();
        let b = Tickets::new(Some(&key), Duration::from_secs(3600)).unwrap();
        assert_eq!(
            b.spend(&a.issue(&ann(), None).unwrap(), EVENTS).unwrap(),
            ann()
        );
    }

    #[test]
    fn reconnects_end_with_their_window() {
        let tickets = Tickets::new(None, Duration::ZERO).unwrap();
        let t = tickets.issue(&ann(), None).unwrap();
        tickets.spend(&t, EVENTS).unwrap();
        let e = tickets.spend(&t, EVENTS).unwrap_err();
        assert!(e.to_string().contains("time for reconnects is over"), "{e}");
    }

    #[test]
    fn a_ticket_issued_for_a_stream_opens_it_on_any_replica_and_nothing_else() {
        let key = "k".repeat(40);
        let a = Tickets::new(Some(&key), Duration::from_secs(3600)).unwrap();
        let b = Tickets::new(Some(&key), Duration::from_secs(3600)).unwrap();
        let t = a.issue(&ann(), Some(EVENTS)).unwrap();
        assert_eq!(a.spend(&t, EVENTS).unwrap(), ann());
        assert_eq!(b.spend(&t, EVENTS).unwrap(), ann());
        assert_eq!(b.spend(&t, EVENTS).unwrap(), ann());
        let e = b.spend(&t, "/api/v1/scan/j2/events").unwrap_err();
        assert!(e.to_string().contains("for another stream"), "{e}");
    }

    #[test]
    fn only_event_streams_are_ticket_streams() {
        assert!(is_stream_path(EVENTS));
        assert!(is_stream_path("/api/v1/notifications/stream"));
        for bad in [
            "/api/v1/scan//events",
            "/api/v1/scan/a/b/events",
            "/api/v1/characters/me",
            "/api/v1/scan/x/events?y",
        ] {
            assert!(!is_stream_path(bad), "{bad}");
        }
    }
}
