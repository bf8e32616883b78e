//! The in-process fan-out of delivered notifications to live subscribers: one broadcast channel
//! per user with subscribers, removed when the last one leaves. Publishing never waits on a
//! subscriber; one that falls too far behind learns it from [`Subscription::recv`].

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use ecoscan_proto::v1::Notification;
use tokio::sync::broadcast::{self, error::RecvError};

mod redis;

pub use redis::RedisFanout;

/// How a delivered notification reaches live subscribers: this process's hub directly, or every
/// replica's hub through Redis (this process's included, by its own subscription).
pub enum Fanout {
    Local(Arc<Hub>),
    Redis(RedisFanout),
}

impl Fanout {
    /// Hands `n` to its user's live subscribers; returns how many subscribers (local) or
    /// processes (Redis) received it.
    pub async fn publish(&self, n: &Notification) -> anyhow::Result<usize> {
        match self {
            Self::Local(hub) => Ok(hub.publish(n)),
            Self::Redis(fanout) => fanout.publish(n).await,
        }
    }

    /// [`Self::publish`] for many notifications (one round trip on Redis); the receivers of
    /// each, in order.
    pub async fn publish_many(&self, ns: &[Notification]) -> anyhow::Result<Vec<usize>> {
        match self {
            Self::Local(hub) => Ok(ns.iter().map(|n| hub.publish(n)).collect()),
            Self::Redis(fanout) => fanout.publish_many(ns).await,
        }
    }
}

/// Live subscribers per user.
pub struct Hub {
    users: Mutex<HashMap<String, broadcast::Sender<Notification>>>,
    /// Notifications a subscriber may fall behind by before its subscription ends.
    capacity: usize,
}

/// Why a subscription ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The subscriber fell behind by this many notifications.
    Lagged(u64),
}

impl Hub {
    /// A hub whose subscribers may each fall `capacity` notifications behind.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            users: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        })
    }

    fn users(&self) -> MutexGuard<'_, HashMap<String, broadcast::Sender<Notification>>> {
        // No critical section below can leave the map half-updated.
        self.users.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts receiving `user_id`'s notifications published from now on.
    pub fn subscribe(self: &Arc<Self>, user_id: &str) -> Subscription {
        let rx = self
            .users()
            .entry(user_id.to_owned())
            .or_insert_with(|| broadcast::channel(self.capacity).0)
            .subscribe();
        Subscription {
            rx: Some(rx),
            hub: self.clone(),
            user_id: user_id.to_owned(),
        }
    }

    /// Hands `n` to every live subscriber of its user; returns how many there were.
    pub fn publish(&self, n: &Notification) -> usize {
        self.users()
            .get(&n.user_id)
            .map_or(0, |tx| tx.send(n.clone()).unwrap_or(0))
    }

    /// Users with at least one live subscriber.
    pub fn users_with_subscribers(&self) -> usize {
        self.users().len()
    }

    /// Live subscribers, over all users.
    pub fn subscribers(&self) -> usize {
        self.users()
            .values()
            .map(broadcast::Sender::receiver_count)
            .sum()
    }

    fn release(&self, user_id: &str) {
        let mut users = self.users();
        if users
            .get(user_id)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            users.remove(user_id);
        }
    }
}

/// One live subscriber; leaving (dropping it) removes the user's entry if it was the last.
pub struct Subscription {
    /// Always `Some` until drop, which takes it so the receiver is gone before the count check.
    rx: Option<broadcast::Receiver<Notification>>,
    hub: Arc<Hub>,
    user_id: String,
}

impl Subscription {
    /// The next notification, or why the subscription ended.
    pub async fn recv(&mut self) -> Result<Notification, Ended> {
        let rx = self.rx.as_mut().expect("receiver is present until drop");
        match rx.recv().await {
            Ok(n) => Ok(n),
            Err(RecvError::Lagged(n)) => Err(Ended::Lagged(n)),
            // The hub holds the sender while any receiver exists, so it is never closed under us.
            Err(RecvError::Closed) => Err(Ended::Lagged(0)),
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        drop(self.rx.take());
        self.hub.release(&self.user_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(user: &str, id: &str) -> Notification {
        Notification {
            id: id.into(),
            user_id: user.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn subscribers_get_only_their_users_notifications() {
        let hub = Hub::new(8);
        let mut a1 = hub.subscribe("a");
        let mut a2 = hub.subscribe("a");
        let mut b = hub.subscribe("b");

        assert_eq!(hub.publish(&note("a", "1")), 2);
        assert_eq!(hub.publish(&note("b", "2")), 1);
        assert_eq!(hub.publish(&note("c", "3")), 0);

        assert_eq!(a1.recv().await.unwrap().id, "1");
        assert_eq!(a2.recv().await.unwrap().id, "1");
        assert_eq!(b.recv().await.unwrap().id, "2");
    }

    #[tokio::test]
    async fn the_users_entry_goes_when_the_last_subscriber_leaves() {
        let hub = Hub::new(8);
        let first = hub.subscribe("a");
        let second = hub.subscribe("a");
        drop(first);
        assert_eq!(hub.users_with_subscribers(), 1);
        drop(second);
        assert_eq!(hub.users_with_subscribers(), 0);
    }

    #[tokio::test]
    async fn a_subscriber_that_falls_behind_is_told_and_others_are_unaffected() {
        let hub = Hub::new(2);
        let mut slow = hub.subscribe("a");
        let mut fast = hub.subscribe("a");
        for i in 0..5 {
            hub.publish(&note("a", &i.to_string()));
            assert_eq!(fast.recv().await.unwrap().id, i.to_string());
        }
        assert_eq!(slow.recv().await.unwrap_err(), Ended::Lagged(3));
    }
}
