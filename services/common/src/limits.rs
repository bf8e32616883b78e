//! Limits on what callers send, in one place: the gateway refuses at the edge what a service
//! would refuse anyway (so an HTTP caller hears of it before anything is sent on, under the
//! name the HTTP API gives the field), and the service holds every gRPC caller to the same
//! numbers. Two copies drifted once: the gateway took hints of 1,000 characters that ingest
//! then refused at 500.

/// Longest hint a scan may carry, in characters.
pub const MAX_HINT_CHARS: usize = 500;

/// Longest idempotency key (a scan's `idempotency_key`, a notification's `dedupe_key`, the
/// HTTP `Idempotency-Key` header), in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 128;
