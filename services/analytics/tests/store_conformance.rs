//! One conformance suite for [`CallStore`], run against every implementation: SQLite (a file in
//! a temporary directory) and PostgreSQL (a schema of its own on `TEST_DATABASE_URL`).

use std::collections::HashSet;

use ecoscan_analytics::store::{CallRow, CallStore};

fn row(id: &str, started_at_us: i64) -> CallRow {
    CallRow {
        call_id: id.into(),
        service: "vision".into(),
        provider: "mock".into(),
        model: "m".into(),
        operation: "classify".into(),
        input_tokens: 120,
        output_tokens: 45,
        latency_ms: 812.25,
        ttft_ms: 90.5,
        status: 1,
        error: String::new(),
        body_key: "0193.bin".into(),
        body_offset: 4096,
        request_len: 100,
        response_len: 200,
        job_id: "job-1".into(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        started_at_us,
        recorded_at_us: started_at_us + 1,
        cached_input_tokens: 20,
        images: 1,
        cost_micros: Some(45),
        price_version: "2026-01-01/0123456789ab".into(),
    }
}

fn ids(ids: &[&str]) -> HashSet<String> {
    ids.iter().map(|s| (*s).to_owned()).collect()
}

async fn a_batch_reports_only_the_ids_it_inserted<S: CallStore + Clone>(s: S) {
    let first = s.insert_batch(&[row("a", 1), row("b", 2)]).await.unwrap();
    // "b" repeats an earlier batch and "c" repeats itself within the batch.
    let second = s
        .insert_batch(&[row("b", 2), row("c", 3), row("c", 3)])
        .await
        .unwrap();
    let empty = s.insert_batch(&[]).await.unwrap();

    assert_eq!(first, ids(&["a", "b"]));
    assert_eq!(second, ids(&["c"]));
    assert!(empty.is_empty());
    assert_eq!(s.usage_samples(0, 100).await.unwrap().len(), 3);
}

async fn every_column_round_trips_and_unknown_ids_are_none<S: CallStore + Clone>(s: S) {
    let mut r = row("x", 1_700_000_000_000_000);
    r.status = 2;
    r.error = "provider said 429".into();
    r.input_tokens = i64::from(u32::MAX);
    r.body_key = String::new();

    // An unknown cost is stored as unknown, not as zero, beside a zero one.
    let unpriced = CallRow {
        cost_micros: None,
        price_version: String::new(),
        ..row("unpriced", 1)
    };
    let free = CallRow {
        cost_micros: Some(0),
        ..row("free", 1)
    };

    s.insert_batch(&[r.clone(), unpriced.clone(), free.clone()])
        .await
        .unwrap();

    assert_eq!(s.get("x").await.unwrap(), Some(r));
    assert_eq!(s.get("unpriced").await.unwrap(), Some(unpriced));
    assert_eq!(s.get("free").await.unwrap(), Some(free));
    assert_eq!(s.get("missing").await.unwrap(), None);
}

async fn usage_covers_calls_started_in_the_half_open_window<S: CallStore + Clone>(s: S) {
    s.insert_batch(&[
        row("early", 9),
        row("first", 10),
        row("last", 19),
        row("late", 20),
    ])
    .await
    .unwrap();

    let samples = s.usage_samples(10, 20).await.unwrap();

    assert_eq!(samples.len(), 2);
    let sample = &samples[0];
    assert_eq!(
        (sample.service.as_str(), sample.model.as_str()),
        ("vision", "m")
    );
    assert_eq!((sample.input_tokens, sample.output_tokens), (120, 45));
    assert_eq!((sample.status, sample.latency_ms), (1, 812.25));
}

async fn a_thousand_row_batch_is_stored_whole<S: CallStore + Clone>(s: S) {
    let rows: Vec<_> = (0..1000).map(|i| row(&format!("call-{i:04}"), i)).collect();

    let inserted = s.insert_batch(&rows).await.unwrap();

    assert_eq!(inserted.len(), 1000);
    assert_eq!(s.usage_samples(0, 1000).await.unwrap().len(), 1000);
    assert_eq!(s.get("call-0999").await.unwrap(), Some(rows[999].clone()));
}

async fn concurrent_overlapping_batches_insert_each_id_once<S: CallStore + Clone>(s: S) {
    // Eight writers, each sending ids 0..200 in its own order: every id must be reported as
    // inserted by exactly one of them.
    let tasks: Vec<_> = (0..8)
        .map(|w| {
            let s = s.clone();
            tokio::spawn(async move {
                let mut rows: Vec<_> = (0..200).map(|i| row(&format!("id-{i}"), i)).collect();
                rows.rotate_left(w * 25);
                s.insert_batch(&rows).await
            })
        })
        .collect();
    let mut total = 0;
    let mut seen = HashSet::new();
    for t in tasks {
        let inserted = t.await.unwrap().unwrap();
        total += inserted.len();
        seen.extend(inserted);
    }

    assert_eq!(total, 200);
    assert_eq!(seen.len(), 200);
}

ecoscan_sql::store_conformance! {
    sqlite: ecoscan_analytics::store::SqliteCallStore, "analytics.db";
    postgres: ecoscan_analytics::store::PgCallStore;
    cases:
    a_batch_reports_only_the_ids_it_inserted,
    every_column_round_trips_and_unknown_ids_are_none,
    usage_covers_calls_started_in_the_half_open_window,
    a_thousand_row_batch_is_stored_whole,
    concurrent_overlapping_batches_insert_each_id_once,
}
