use std::{fs, time::Duration};

use bytes::Bytes;

use super::{
    files::{BATCH_SUFFIX, file_name, write_file},
    format::{Crc, decode, encode_meta, file_len, len_u64},
    queue::{PushError, Spool},
    replay::backoff,
};
use crate::{batch::Batch, metrics::SpoolMetrics, store::CallRow};

fn row(id: &str) -> CallRow {
    CallRow {
        call_id: id.into(),
        service: "vision".into(),
        provider: "mock".into(),
        model: "모델".into(),
        operation: "classify".into(),
        input_tokens: 1,
        output_tokens: -2,
        latency_ms: 3.5,
        ttft_ms: f64::MIN_POSITIVE,
        status: 2,
        error: "e".into(),
        body_key: "k.bin".into(),
        body_offset: 7,
        request_len: 8,
        response_len: 9,
        job_id: "j".into(),
        trace_id: String::new(),
        started_at_us: i64::MIN,
        recorded_at_us: i64::MAX,
        cached_input_tokens: 3,
        images: 1,
        cost_micros: Some(0),
        price_version: "mock".into(),
    }
}

fn file(batch: &Batch) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    write_file(
        dir.path(),
        1,
        &encode_meta(&batch.key, &batch.rows),
        &batch.object,
    )
    .unwrap();
    let bytes = fs::read(dir.path().join(file_name(1))).unwrap();
    assert_eq!(
        len_u64(bytes.len()),
        file_len(
            encode_meta(&batch.key, &batch.rows).len(),
            batch.object.len()
        )
    );
    bytes
}

#[test]
fn an_unknown_cost_stays_unknown_and_a_version_1_file_is_still_read() {
    // Unknown is not zero, through the spool too.
    let unpriced = CallRow {
        cost_micros: None,
        price_version: String::new(),
        ..row("u")
    };
    let batch = Batch {
        key: "k.bin".into(),
        object: Bytes::new(),
        rows: vec![unpriced.clone(), row("z")],
    };
    let back = decode(Bytes::from(file(&batch))).unwrap();
    assert_eq!(back.rows, batch.rows);
    assert_eq!(back.rows[0].cost_micros, None);
    assert_eq!(back.rows[1].cost_micros, Some(0));

    // A file an earlier release spooled (version 1: no cached tokens, images or cost).
    let r = row("old");
    let mut meta = Vec::new();
    let s = |out: &mut Vec<u8>, v: &str| {
        out.extend_from_slice(&u32::try_from(v.len()).unwrap().to_le_bytes());
        out.extend_from_slice(v.as_bytes());
    };
    s(&mut meta, "k.bin");
    meta.extend_from_slice(&1u32.to_le_bytes());
    for v in [&r.call_id, &r.service, &r.provider, &r.model, &r.operation] {
        s(&mut meta, v);
    }
    for v in [r.input_tokens, r.output_tokens] {
        meta.extend_from_slice(&v.to_le_bytes());
    }
    meta.extend_from_slice(&r.latency_ms.to_le_bytes());
    meta.extend_from_slice(&r.ttft_ms.to_le_bytes());
    meta.extend_from_slice(&r.status.to_le_bytes());
    s(&mut meta, &r.error);
    s(&mut meta, &r.body_key);
    for v in [r.body_offset, r.request_len, r.response_len] {
        meta.extend_from_slice(&v.to_le_bytes());
    }
    s(&mut meta, &r.job_id);
    s(&mut meta, &r.trace_id);
    for v in [r.started_at_us, r.recorded_at_us] {
        meta.extend_from_slice(&v.to_le_bytes());
    }
    let mut body = Vec::new();
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&len_u64(meta.len()).to_le_bytes());
    body.extend_from_slice(&meta);
    body.extend_from_slice(&0u64.to_le_bytes());
    let mut crc = Crc::new();
    crc.update(&body);
    let mut v1 = b"ECOSPOOL".to_vec();
    v1.extend_from_slice(&body);
    v1.extend_from_slice(&crc.finish().to_le_bytes());
    let back = decode(Bytes::from(v1)).unwrap();
    assert_eq!(
        back.rows,
        [CallRow {
            cached_input_tokens: 0,
            images: 0,
            cost_micros: None,
            price_version: String::new(),
            ..r
        }]
    );
}

#[test]
fn crc_is_the_ieee_one() {
    let mut c = Crc::new();
    c.update(b"123456789");
    assert_eq!(c.finish(), 0xCBF4_3926);
}

#[test]
fn a_batch_round_trips_and_any_damage_is_detected() {
    let batch = Batch {
        key: "0193.bin".into(),
        object: Bytes::from_static("요청 응답".as_bytes()),
        rows: vec![row("a"), row("b")],
    };
    let bytes = file(&batch);
    let bytes = Bytes::from(bytes);
    let back = decode(bytes.clone()).unwrap();
    assert_eq!(back.key, batch.key);
    assert_eq!(back.object, batch.object);
    assert_eq!(back.rows, batch.rows);

    for cut in [0, 7, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        assert!(decode(bytes.slice(..cut)).is_err(), "truncated at {cut}");
    }
    for flip in [8, 30, bytes.len() - 10, bytes.len() - 1] {
        let mut bad = bytes.to_vec();
        bad[flip] ^= 0x40;
        assert!(decode(bad.into()).is_err(), "bit flipped at {flip}");
    }
    let mut longer = bytes.to_vec();
    longer.push(0);
    assert!(decode(longer.into()).is_err());
}

#[test]
fn backoff_doubles_from_100ms_up_to_the_most() {
    let max = Duration::from_secs(1);
    let got: Vec<_> = (1..=6).map(|n| backoff(n, max).as_millis()).collect();
    assert_eq!(got, [100, 200, 400, 800, 1000, 1000]);
    assert_eq!(backoff(1000, max), max);
    assert_eq!(
        backoff(1, Duration::from_millis(20)),
        Duration::from_millis(20)
    );
}

#[tokio::test]
async fn a_second_process_cannot_take_a_spool_in_use_and_leftovers_are_cleaned() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("00000000000000000007.batch.tmp"), b"half").unwrap();
    fs::write(dir.path().join("notes.txt"), b"left alone").unwrap();
    let spool = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
        .await
        .unwrap();
    let err = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("in use"), "{err:#}");
    assert!(!dir.path().join("00000000000000000007.batch.tmp").exists());
    assert!(dir.path().join("notes.txt").exists());

    let batch = Batch {
        key: "x.bin".into(),
        object: Bytes::from_static(b"body"),
        rows: vec![row("a")],
    };
    spool.push(&batch).await.unwrap();
    spool.push(&batch).await.unwrap();
    assert_eq!(spool.batches(), 2);
    drop(spool);

    // Reopened, it finds both and numbers new batches after them.
    let spool = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
        .await
        .unwrap();
    assert_eq!(spool.oldest(|_| true), [1, 2]);
    spool.push(&batch).await.unwrap();
    assert_eq!(spool.oldest(|_| true), [1, 2, 3]);
    let full = spool.bytes();

    // Past the bound nothing is written.
    let small = Spool {
        max_bytes: full + 10,
        ..spool
    };
    assert!(matches!(
        small.push(&batch).await,
        Err(PushError::Full { used, .. }) if used == full
    ));
    assert_eq!(small.batches(), 3);
    assert_eq!(
        fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(BATCH_SUFFIX))
            .count(),
        3
    );
}
