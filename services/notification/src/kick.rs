//! How a part of notification that noticed lost state (the Redis hub resubscribed: Redis may
//! have come back empty) asks the reconcile loop ([`crate::reconcile`]) for a sweep. A leaf of
//! its own, so that the hub and the loop both use it without using each other.

use std::sync::Arc;

use tokio::sync::Notify;

/// Asks the reconcile loop for a sweep soon. Clones share the request; requests made while a
/// sweep runs make one more sweep, not one each.
#[derive(Clone, Default)]
pub struct Kick(Arc<Notify>);

impl Kick {
    /// Asks for a sweep soon.
    pub fn sweep_soon(&self) {
        self.0.notify_one();
    }

    pub(crate) async fn asked(&self) {
        self.0.notified().await;
    }
}
