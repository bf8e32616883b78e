//! What one caller, and everyone together, may send and hold: per-user rate limits on
//! submitting scans and scheduling notifications (token buckets, `governor`), per-user and
//! global caps on open SSE streams, and — for what no user can be held to — per-address limits
//! on requests that prove nobody and on open connections. Past a limit the caller gets 429 with
//! `Retry-After` (a connection past its address's cap is closed at once).

use std::{
    collections::HashMap,
    net::IpAddr,
    num::NonZeroU32,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use governor::{
    DefaultKeyedRateLimiter, Quota, RateLimiter,
    clock::{Clock, DefaultClock},
};

use crate::{config::Limits, error::ApiError};

/// Per-user token buckets.
pub(crate) struct RateLimits {
    scans: DefaultKeyedRateLimiter<String>,
    schedules: DefaultKeyedRateLimiter<String>,
}

fn per_minute(n: u32) -> Quota {
    let n = NonZeroU32::new(n.max(1)).expect("at least one");
    // A full minute's worth may come at once; then one every 60/n seconds.
    Quota::per_minute(n).allow_burst(n)
}

fn check<K: Clone + std::hash::Hash + Eq>(
    limiter: &DefaultKeyedRateLimiter<K>,
    key: &K,
    what: &str,
) -> Result<(), ApiError> {
    match limiter.check_key(key) {
        Ok(()) => Ok(()),
        Err(not_until) => {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            Err(ApiError::TooMany {
                message: format!("too many {what}; try again in {secs} s"),
                retry_after_secs: secs.max(1),
            })
        }
    }
}

impl RateLimits {
    pub(crate) fn new(limits: &Limits) -> Arc<Self> {
        let this = Arc::new(Self {
            scans: RateLimiter::keyed(per_minute(limits.scans_per_minute)),
            schedules: RateLimiter::keyed(per_minute(limits.schedules_per_minute)),
        });
        // Forget users whose buckets are full again, now and then, so memory follows the
        // active users, not every user ever seen.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&this);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let Some(this) = weak.upgrade() else { return };
                    this.scans.retain_recent();
                    this.schedules.retain_recent();
                }
            });
        }
        this
    }

    /// Takes a token for one scan of `user`.
    pub(crate) fn scan(&self, user: &str) -> Result<(), ApiError> {
        check(&self.scans, &user.to_owned(), "scans")
    }

    /// Takes a token for one scheduled notification of `user`.
    pub(crate) fn schedule(&self, user: &str) -> Result<(), ApiError> {
        check(&self.schedules, &user.to_owned(), "scheduled notifications")
    }
}

/// The address a limit holds: the IPv4 address, or the /64 of an IPv6 address (one host
/// usually has a whole /64 to pick addresses from).
pub(crate) fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut s = v6.segments();
                s[4..].fill(0);
                IpAddr::V6(s.into())
            }
        },
    }
}

/// Requests that prove no user (the public routes, and refused authentication), per address.
pub(crate) struct IpLimits {
    requests: DefaultKeyedRateLimiter<IpAddr>,
}

impl IpLimits {
    pub(crate) fn new(per_minute_each: u32) -> Arc<Self> {
        let this = Arc::new(Self {
            requests: RateLimiter::keyed(per_minute(per_minute_each)),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&this);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let Some(this) = weak.upgrade() else { return };
                    this.requests.retain_recent();
                }
            });
        }
        this
    }

    /// Takes a token for one unauthenticated request from `ip`.
    pub(crate) fn check(&self, ip: IpAddr) -> Result<(), ApiError> {
        check(
            &self.requests,
            &address_key(ip),
            "requests without authentication from this address",
        )
    }
}

/// Open connections per address, within a cap.
#[derive(Clone)]
pub(crate) struct ConnectionsPerIp {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    max: usize,
}

impl ConnectionsPerIp {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            open: Arc::default(),
            max,
        }
    }

    /// A slot for one more connection from `ip`, or `None` when it holds the most allowed.
    pub(crate) fn take(&self, ip: IpAddr) -> Option<IpSlot> {
        let key = address_key(ip);
        let mut open = self.open.lock().expect("connection slots lock poisoned");
        let n = open.entry(key).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            open: self.open.clone(),
            key,
        })
    }
}

/// One connection's slot; released when dropped.
pub(crate) struct IpSlot {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    key: IpAddr,
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().expect("connection slots lock poisoned");
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// Open SSE streams, counted per user and in all, within their caps.
#[derive(Clone)]
pub(crate) struct SseSlots {
    inner: Arc<SlotsInner>,
}

struct SlotsInner {
    open: AtomicUsize,
    per_user: Mutex<HashMap<String, usize>>,
    max: usize,
    max_per_user: usize,
}

impl SseSlots {
    pub(crate) fn new(max: usize, max_per_user: usize) -> Self {
        Self {
            inner: Arc::new(SlotsInner {
                open: AtomicUsize::new(0),
                per_user: Mutex::default(),
                max,
                max_per_user,
            }),
        }
    }

    /// Streams open now (`gateway_sse_connections`).
    pub(crate) fn open(&self) -> usize {
        self.inner.open.load(Ordering::Relaxed)
    }

    /// A slot for one more stream of `user`, held until the guard is dropped (with the
    /// response body); 429 when `user` or everyone holds the most allowed.
    pub(crate) fn take(&self, user: &str) -> Result<SseSlot, ApiError> {
        let mut per_user = self.inner.per_user.lock().expect("sse slots lock poisoned");
        let mine = per_user.get(user).copied().unwrap_or(0);
        if mine >= self.inner.max_per_user {
            return Err(ApiError::TooMany {
                message: format!(
                    "{mine} event streams are open for this user already; close one first"
                ),
                retry_after_secs: 5,
            });
        }
        if self.inner.open.load(Ordering::Relaxed) >= self.inner.max {
            return Err(ApiError::TooMany {
                message: "the gateway holds as many event streams as it may; try again shortly"
                    .into(),
                retry_after_secs: 5,
            });
        }
        per_user.insert(user.to_owned(), mine + 1);
        let open = self.inner.open.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(sse.connections = open, "sse stream opened");
        Ok(SseSlot {
            slots: self.inner.clone(),
            user: user.to_owned(),
        })
    }
}

/// One open stream's slot; released when dropped.
pub(crate) struct SseSlot {
    slots: Arc<SlotsInner>,
    user: String,
}

impl Drop for SseSlot {
    fn drop(&mut self) {
        self.slots.open.fetch_sub(1, Ordering::Relaxed);
        let mut per_user = self.slots.per_user.lock().expect("sse slots lock poisoned");
        if let Some(n) = per_user.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                per_user.remove(&self.user);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_gets_a_minutes_worth_at_once_and_then_waits() {
        let limits = Limits {
            scans_per_minute: 3,
            ..Limits::default()
        };
        let rl = RateLimits::new(&limits);
        for _ in 0..3 {
            rl.scan("ann").unwrap();
        }
        match rl.scan("ann") {
            Err(ApiError::TooMany {
                retry_after_secs, ..
            }) => assert!((1..=20).contains(&retry_after_secs), "{retry_after_secs}"),
            other => panic!("expected 429, got {other:?}"),
        }
        rl.scan("bo").unwrap();
        rl.schedule("ann").unwrap();
    }

    #[test]
    fn addresses_are_limited_by_v4_address_or_v6_slash_64() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        assert_eq!(address_key(a), address_key(b));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(address_key(mapped), "192.0.2.1".parse::<IpAddr>().unwrap());
        let conns = ConnectionsPerIp::new(2);
        let one = conns.take(a).unwrap();
        let _two = conns.take(b).unwrap();
        assert!(conns.take(a).is_none(), "a /64 holds two already");
        assert!(conns.take("192.0.2.1".parse().unwrap()).is_some());
        drop(one);
        assert!(conns.take(a).is_some());
        let limits = IpLimits::new(2);
        limits.check(a).unwrap();
        limits.check(b).unwrap();
        assert!(matches!(limits.check(a), Err(ApiError::TooMany { .. })));
        limits.check("192.0.2.1".parse().unwrap()).unwrap();
    }

    #[test]
    fn sse_slots_cap_each_user_and_everyone_and_come_back_when_dropped() {
        let slots = SseSlots::new(3, 2);
        let a1 = slots.take("ann").unwrap();
        let _a2 = slots.take("ann").unwrap();
        assert!(matches!(slots.take("ann"), Err(ApiError::TooMany { .. })));
        let _b1 = slots.take("bo").unwrap();
        assert!(
            matches!(slots.take("cy"), Err(ApiError::TooMany { .. })),
            "three open in all"
        );
        assert_eq!(slots.open(), 3);
        drop(a1);
        assert_eq!(slots.open(), 2);
        let _c1 = slots.take("cy").unwrap();
    }
}
