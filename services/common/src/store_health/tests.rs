use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::advance;

use super::*;
use crate::metrics::Metrics;

fn health() -> StoreHealth {
    StoreHealth::with_settings(
        "redis",
        "redis://user:secret@10.0.0.7:6379/0?timeout=1",
        Settings {
            trip_after: 3,
            silence: Duration::from_secs(5),
            probe_interval: Duration::from_secs(1),
            probe_hold: Duration::from_secs(10),
        },
    )
}

#[tokio::test(start_paused = true)]
async fn faults_in_a_row_trip_the_circuit_and_an_answer_between_them_does_not() {
    let h = health();
    h.fault(FaultKind::Refused);
    h.fault(FaultKind::Refused);
    h.ok();
    h.fault(FaultKind::Refused);
    h.fault(FaultKind::Refused);
    assert!(h.is_up(), "an answer between faults starts the count again");
    assert_eq!(h.check(), Ok(()));

    h.fault(FaultKind::Refused);
    assert!(h.is_open(), "the third fault in a row trips it");
    let down = h.check().unwrap_err();
    assert_eq!(down.store, "redis");
    assert_eq!(down.fault, FaultKind::Refused);
    assert_eq!(down.retry_after, Duration::from_secs(1));
    assert_eq!(h.faults(FaultKind::Refused), 5);
}

#[tokio::test(start_paused = true)]
async fn a_fault_after_a_silence_trips_at_once_but_not_amid_answers() {
    let h = health();
    advance(Duration::from_secs(4)).await;
    h.fault(FaultKind::TimedOut);
    assert!(h.is_up(), "4 s without an answer is not yet a silence");
    h.ok();
    advance(Duration::from_secs(10)).await;
    h.fault(FaultKind::TimedOut);
    assert!(
        h.is_open(),
        "a timeout after 10 s in which nothing got an answer trips it"
    );
}

#[tokio::test(start_paused = true)]
async fn application_errors_never_trip_it() {
    let h = health();
    for _ in 0..100 {
        // What callers report for an answer that is an error (fenced write, constraint
        // violation): `report(None)`.
        h.report(None);
        advance(Duration::from_secs(10)).await;
    }
    assert!(h.is_up());
    assert_eq!(h.check(), Ok(()));
    assert!(FaultKind::ALL.iter().all(|k| h.faults(*k) == 0));
}

#[tokio::test(start_paused = true)]
async fn while_open_one_probe_per_interval_goes_through_and_an_answer_closes_it() {
    let h = health();
    for _ in 0..3 {
        h.fault(FaultKind::TimedOut);
    }
    assert!(h.is_open());
    for _ in 0..10 {
        assert!(h.check().is_err(), "refused before the probe interval");
    }
    advance(Duration::from_millis(1000)).await;
    assert_eq!(h.check(), Ok(()), "the probe goes through");
    assert!(
        h.check().is_err(),
        "one probe per interval: the next caller is refused"
    );
    // The probe fails at once (a refused connection): still open, the next probe once the
    // hold has passed (a fault cannot say it was the probe's).
    h.fault(FaultKind::TimedOut);
    assert!(h.is_open());
    advance(Duration::from_millis(9_999)).await;
    assert!(h.check().is_err());
    advance(Duration::from_millis(1)).await;
    assert_eq!(h.check(), Ok(()), "the next probe");
    h.ok();
    assert!(h.is_up(), "an answer closes it");
    for _ in 0..10 {
        assert_eq!(h.check(), Ok(()));
    }
    // Closed again, it takes a whole trip to open it again.
    h.fault(FaultKind::Reset);
    assert!(h.is_up());
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_waits_out_its_timeout_does_not_make_the_next_caller_a_probe() {
    let h = health();
    for _ in 0..3 {
        h.fault(FaultKind::TimedOut);
    }
    advance(Duration::from_secs(1)).await;
    assert_eq!(h.check(), Ok(()), "the probe");
    // A caller that sends one request at a time: its probe times out 10 s later, and its next
    // request, right after, is refused at once.
    advance(Duration::from_secs(10)).await;
    h.fault(FaultKind::TimedOut);
    assert!(h.check().is_err(), "refused right after the failed probe");
    advance(Duration::from_millis(999)).await;
    assert!(h.check().is_err());
    advance(Duration::from_millis(1)).await;
    assert_eq!(
        h.check(),
        Ok(()),
        "a probe a whole interval after the last fault"
    );
}

#[tokio::test(start_paused = true)]
async fn a_probe_out_keeps_every_other_caller_refused_until_it_reports_or_its_hold_passes() {
    let h = health();
    for _ in 0..3 {
        h.fault(FaultKind::TimedOut);
    }
    advance(Duration::from_secs(1)).await;
    assert_eq!(h.check(), Ok(()), "the probe");
    // Callers a second apart while the probe waits (found by services/suite/tests/partition.rs:
    // each became a probe and waited out a timeout of its own).
    for _ in 0..9 {
        advance(Duration::from_secs(1)).await;
        assert!(h.check().is_err(), "refused while the probe is out");
    }
    // Its caller gave up on it without a word: after the hold, the next caller probes.
    advance(Duration::from_secs(1)).await;
    assert_eq!(h.check(), Ok(()), "a probe once the hold has passed");
    assert!(h.check().is_err());
    // Another call's fault while it is out does not let a second probe out.
    advance(Duration::from_secs(2)).await;
    h.fault(FaultKind::TimedOut);
    advance(Duration::from_secs(2)).await;
    assert!(
        h.check().is_err(),
        "one probe at a time, whoever's the fault"
    );
    // An answer closes the circuit whatever the hold.
    h.ok();
    assert_eq!(h.check(), Ok(()));
}

#[test]
fn io_errors_are_classified_by_kind_and_lookups_by_message() {
    use std::io::{Error, ErrorKind};
    assert_eq!(
        FaultKind::of_io(&Error::from(ErrorKind::TimedOut)),
        FaultKind::TimedOut
    );
    assert_eq!(
        FaultKind::of_io(&Error::from(ErrorKind::ConnectionRefused)),
        FaultKind::Refused
    );
    for kind in [
        ErrorKind::ConnectionReset,
        ErrorKind::BrokenPipe,
        ErrorKind::UnexpectedEof,
    ] {
        assert_eq!(FaultKind::of_io(&Error::from(kind)), FaultKind::Reset);
    }
    assert_eq!(
        FaultKind::of_io(&Error::other(
            "failed to lookup address information: Name or service not known"
        )),
        FaultKind::NameNotResolved
    );
    assert_eq!(
        FaultKind::of_io(&Error::other("no route to host")),
        FaultKind::Other
    );
}

#[test]
fn addresses_lose_their_credentials_and_query() {
    assert_eq!(
        redact_url("redis://user:secret@10.0.0.7:6379/0?timeout=1"),
        "redis://10.0.0.7:6379/0"
    );
    assert_eq!(
        redact_url("postgres://app:p%40ss@db.internal:5432/ecoscan?password=x&sslmode=require"),
        "postgres://db.internal:5432/ecoscan"
    );
    assert_eq!(
        redact_url("redis://:pw@a:7000, redis://b:7001"),
        "redis://a:7000,redis://b:7001"
    );
    assert_eq!(
        redact_url("redis://127.0.0.1:6379"),
        "redis://127.0.0.1:6379"
    );
}

#[tokio::test(start_paused = true)]
async fn the_metrics_say_down_and_up_and_count_faults_by_kind() {
    let h = health();
    let mut metrics = Metrics::new("test");
    register(
        &mut metrics,
        &[h.clone(), h.clone()],
        vec![(
            "postgres",
            Box::new(|| PoolStats { open: 4, idle: 3 }) as PoolReader,
        )],
    );
    let text = metrics.render().await;
    assert!(
        text.contains(
            r#"store_up{service="test",store="redis",address="redis://10.0.0.7:6379/0"} 1"#
        ),
        "{text}"
    );
    assert_eq!(
        text.matches("store_up{").count(),
        1,
        "each store once: {text}"
    );
    assert!(!text.contains("secret"), "{text}");
    assert!(
        text.contains(r#"store_pool_connections{service="test",store="postgres",state="open"} 4"#),
        "{text}"
    );
    for _ in 0..3 {
        h.fault(FaultKind::TimedOut);
    }
    let text = metrics.render().await;
    assert!(
        text.contains(r#"address="redis://10.0.0.7:6379/0"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"store_faults_total{service="test",store="redis",kind="timed_out"} 3"#),
        "{text}"
    );
    h.ok();
    let text = metrics.render().await;
    assert!(
        text.contains(r#"address="redis://10.0.0.7:6379/0"} 1"#),
        "{text}"
    );
}

/// Log lines written while `f` runs, as plain text.
fn logs_of(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn it_says_once_that_the_store_stopped_answering_and_once_that_it_is_back() {
    let h = health();
    h.set_waiting("new scans are refused; running scans wait");
    let logs = logs_of(|| {
        for _ in 0..50 {
            h.fault(FaultKind::Refused);
        }
        h.ok();
        h.ok();
    });
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines.len(), 2, "{logs}");
    let down = lines[0];
    assert!(down.contains("WARN"), "{down}");
    for want in [
        "redis at redis://10.0.0.7:6379/0 stopped answering (connection refused)",
        r#"fault="refused""#,
        r#"waiting="new scans are refused; running scans wait""#,
    ] {
        assert!(down.contains(want), "{want} in {down}");
    }
    let up = lines[1];
    assert!(up.contains("INFO"), "{up}");
    assert!(up.contains("answers again"), "{up}");
    assert!(up.contains("out_for_s="), "{up}");
    assert!(!logs.contains("secret"), "{logs}");
}

#[test]
fn a_store_url_names_its_server_and_port() {
    for (url, want) in [
        (
            "postgres://postgres@127.0.0.1:5432/test",
            Some(("127.0.0.1", 5432)),
        ),
        (
            "postgres://u:p@db.internal/app?sslmode=require",
            Some(("db.internal", 5432)),
        ),
        ("redis://:secret@[::1]/0", Some(("::1", 6379))),
        ("redis://[::1]:6380", Some(("::1", 6380))),
        (
            "redis://10.0.0.5:7000,10.0.0.6:7001",
            Some(("10.0.0.5", 7000)),
        ),
        ("sqlite://data/ingest.db", None),
        ("not a url", None),
    ] {
        let got = server_of(url);
        assert_eq!(got.as_ref().map(|(h, p)| (h.as_str(), *p)), want, "{url}");
    }
}
