//! Direct uploads against real stores: the embedded ones (a local directory, SQLite), and S3
//! (the server `infra/services.sh` starts, `TEST_S3_ENDPOINT`) with the presigned URL used by a
//! plain HTTP client. Create, send the photo, submit with `upload_id`, and the job runs; and
//! every way a submit of an upload is refused, before any stage runs.

mod support;

use std::time::{Duration, SystemTime};

use ecoscan_common::client::request_as;
use ecoscan_ingest::{metrics::IngestMetrics, uploads::sweep_uploads};
use ecoscan_objects::{ObjectStore, S3Config, S3ObjectStore};
use ecoscan_proto::v1::{
    CreateUploadRequest, CreateUploadResponse, EventStatus, JobStatus, PutUploadRequest, Stage,
    SubmitRequest,
};
use support::*;
use tonic::{Code, Status};
use tonic_types::StatusExt as _;

const ALICE: &str = "u1";

async fn create(env: &Env, user: &str, content_type: &str, size: usize) -> CreateUploadResponse {
    env.ingest
        .clone()
        .create_upload(request_as(
            CreateUploadRequest {
                content_type: content_type.into(),
                size_bytes: size as u64,
            },
            Duration::from_secs(10),
            user,
        ))
        .await
        .expect("CreateUpload answers")
        .into_inner()
}

async fn put(env: &Env, user: &str, upload_id: &str, image: &[u8]) -> Result<(), Status> {
    env.ingest
        .clone()
        .put_upload(request_as(
            PutUploadRequest {
                upload_id: upload_id.into(),
                image: image.to_vec(),
                content_type: "image/png".into(),
            },
            Duration::from_secs(10),
            user,
        ))
        .await
        .map(drop)
}

async fn submit(env: &Env, user: &str, upload_id: &str) -> Result<String, Status> {
    env.ingest
        .clone()
        .submit(request_as(
            SubmitRequest {
                upload_id: upload_id.into(),
                hint: "bottle".into(),
                ..Default::default()
            },
            Duration::from_secs(10),
            user,
        ))
        .await
        .map(|r| r.into_inner().job_id)
}

/// The reason of a refusal's `ErrorInfo`.
fn reason(status: &Status) -> String {
    status
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default()
}

/// Submits the upload, and the job runs to its end with every stage.
async fn submit_and_finish(env: &Env, upload_id: &str) -> String {
    let job_id = submit(env, ALICE, upload_id)
        .await
        .expect("the upload is submitted");
    let events = watch_all(env, &job_id).await;
    let last = events.last().expect("events");
    assert_eq!(
        (
            Stage::try_from(last.stage),
            EventStatus::try_from(last.status)
        ),
        (Ok(Stage::Done), Ok(EventStatus::Completed)),
        "{events:#?}"
    );
    let result = result_of(env, &job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded as i32);
    assert_eq!(result.hint, "bottle");
    job_id
}

#[tokio::test]
async fn an_embedded_upload_is_sent_through_ingest_submitted_once_and_runs() {
    let env = start(None, |_| {}).await;
    let up = create(&env, ALICE, "image/png", PNG.len()).await;
    assert!(
        up.upload_url.is_empty(),
        "a local directory presigns nothing"
    );
    assert_eq!(up.content_type, "image/png");

    // Nothing uploaded yet.
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::FailedPrecondition, "UPLOAD_EMPTY")
    );
    // Another user can neither send its photo nor submit it: it is not theirs to know of.
    let e = put(&env, "mallory", &up.upload_id, PNG).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // Not what was declared: another size, another type.
    let e = put(&env, ALICE, &up.upload_id, &PNG[..8])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = env
        .ingest
        .clone()
        .put_upload(request_as(
            PutUploadRequest {
                upload_id: up.upload_id.clone(),
                image: PNG.to_vec(),
                content_type: "image/jpeg".into(),
            },
            Duration::from_secs(10),
            ALICE,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    put(&env, ALICE, &up.upload_id, PNG).await.unwrap();
    let e = submit(&env, "mallory", &up.upload_id).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("not found"), "{}", e.message());

    submit_and_finish(&env, &up.upload_id).await;
    // The photo went to the images; the upload's own object is gone.
    let key = format!("uploads/{}", up.upload_id);
    assert_eq!(env.stores.objects.size(&key).await.unwrap(), None);

    // Once only, and no more photos for it either.
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::FailedPrecondition, "UPLOAD_SUBMITTED")
    );
    let e = put(&env, ALICE, &up.upload_id, PNG).await.unwrap_err();
    assert_eq!(reason(&e), "UPLOAD_SUBMITTED");
}

#[tokio::test]
async fn an_upload_whose_bytes_are_no_image_is_refused_before_any_stage_runs() {
    let env = start(None, |_| {}).await;
    let garbage = vec![b'x'; 64];
    let up = create(&env, ALICE, "image/png", garbage.len()).await;
    put(&env, ALICE, &up.upload_id, &garbage).await.unwrap();
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("not a JPEG, PNG, WebP or GIF"),
        "says what is wrong: {}",
        e.message()
    );
    let details = e.get_error_details();
    let field = &details
        .bad_request()
        .expect("a BadRequest")
        .field_violations[0];
    assert_eq!(field.field, "upload_id");
    // No job was queued: no stage was called, the queue is empty.
    assert_eq!(env.stores.queue.backlog().await.unwrap(), 0);
    for stage in ["vision", "rule", "answer", "reward"] {
        assert_eq!(env.stages.count(stage), 0, "{stage} ran");
    }
}

#[tokio::test]
async fn create_refuses_types_and_sizes_ingest_would_not_take() {
    let env = start(None, |c| c.max_image_bytes = 1000).await;
    for (content_type, size, field) in [
        ("text/plain", 10, "content_type"),
        ("image/png", 0, "size_bytes"),
        ("image/png", 1001, "size_bytes"),
    ] {
        let e = env
            .ingest
            .clone()
            .create_upload(request_as(
                CreateUploadRequest {
                    content_type: content_type.into(),
                    size_bytes: size,
                },
                Duration::from_secs(10),
                ALICE,
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        let details = e.get_error_details();
        assert_eq!(
            details.bad_request().unwrap().field_violations[0].field,
            field
        );
    }
    // image/jpg is JPEG.
    assert_eq!(
        create(&env, ALICE, "image/jpg", 10).await.content_type,
        "image/jpeg"
    );
}

#[tokio::test]
async fn an_expired_upload_cannot_be_submitted_and_the_sweep_deletes_it() {
    let ttl = Duration::from_millis(300);
    let env = start(None, |c| c.upload_ttl = ttl).await;
    let up = create(&env, ALICE, "image/png", PNG.len()).await;
    put(&env, ALICE, &up.upload_id, PNG).await.unwrap();
    // Past its expiry (the row's time, set at its creation).
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::FailedPrecondition, "UPLOAD_EXPIRED"),
        "{e:?}"
    );

    // The sweep (run here at a time past the expiry, not waited for) deletes it, object and
    // row, and counts it once however often it runs.
    let metrics = IngestMetrics::default();
    let key = format!("uploads/{}", up.upload_id);
    assert!(env.stores.objects.size(&key).await.unwrap().is_some());
    let later = SystemTime::now() + Duration::from_secs(1);
    assert_eq!(
        sweep_uploads(&env.stores, &metrics, later).await.unwrap(),
        1
    );
    assert_eq!(
        sweep_uploads(&env.stores, &metrics, later).await.unwrap(),
        0
    );
    assert_eq!(env.stores.objects.size(&key).await.unwrap(), None);
    assert!(
        env.stores
            .jobs
            .get_upload(&up.upload_id)
            .await
            .unwrap()
            .is_none()
    );
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

#[tokio::test]
async fn a_submitted_upload_is_swept_without_counting_as_expired() {
    let env = start(None, |_| {}).await;
    let up = create(&env, ALICE, "image/png", PNG.len()).await;
    put(&env, ALICE, &up.upload_id, PNG).await.unwrap();
    let job_id = submit_and_finish(&env, &up.upload_id).await;
    let later = SystemTime::now() + Duration::from_secs(3600);
    let metrics = IngestMetrics::default();
    assert_eq!(
        sweep_uploads(&env.stores, &metrics, later).await.unwrap(),
        0
    );
    assert!(
        env.stores
            .jobs
            .get_upload(&up.upload_id)
            .await
            .unwrap()
            .is_none()
    );
    // The job keeps its photo: it was stored with the images.
    let job = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert!(
        env.stores
            .objects
            .get(&job.image_key)
            .await
            .unwrap()
            .is_some()
    );
}

fn s3_config(bucket: &str) -> S3Config {
    S3Config {
        endpoint: std::env::var("TEST_S3_ENDPOINT")
            .unwrap_or_else(|_| "http://127.0.0.1:9000".into()),
        bucket: bucket.into(),
        region: "us-east-1".into(),
        credentials: Some(("test".into(), "test".into())),
        key_prefix: String::new(),
    }
}

/// A `PUT` of `body` to the presigned URL with the headers it names, from a plain HTTP client.
async fn put_presigned(up: &CreateUploadResponse, body: &[u8]) -> reqwest::StatusCode {
    let mut req = reqwest::Client::new()
        .put(&up.upload_url)
        .body(body.to_vec());
    for (k, v) in &up.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    req.send().await.expect("the S3 endpoint answers").status()
}

#[tokio::test]
async fn an_s3_upload_goes_to_the_bucket_by_its_presigned_url_and_runs() {
    let bucket = format!("t-{}", uuid::Uuid::new_v4());
    let config = s3_config(&bucket);
    let env = start(None, |c| c.s3 = Some(config.clone())).await;

    let up = create(&env, ALICE, "image/png", PNG.len()).await;
    assert!(
        up.upload_url.starts_with(&config.endpoint),
        "{}",
        up.upload_url
    );
    assert!(
        up.upload_url
            .contains(&format!("/{bucket}/uploads/{}?", up.upload_id))
    );
    assert_eq!(
        up.headers.get("content-type").map(String::as_str),
        Some("image/png")
    );
    assert_eq!(
        up.headers.get("content-length"),
        Some(&PNG.len().to_string())
    );
    assert!(put_presigned(&up, PNG).await.is_success());
    let key = format!("uploads/{}", up.upload_id);
    assert_eq!(
        env.stores.objects.size(&key).await.unwrap(),
        Some(PNG.len() as u64),
        "the photo is in the bucket, sent there by the client"
    );
    submit_and_finish(&env, &up.upload_id).await;
    assert_eq!(env.stores.objects.size(&key).await.unwrap(), None);
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(reason(&e), "UPLOAD_SUBMITTED");

    // An object that is not what was declared is refused at submit, whatever the server let
    // through (moto does not check presigned signatures; S3 refuses such a PUT itself).
    let up = create(&env, ALICE, "image/png", PNG.len()).await;
    let bigger = [PNG, b"trailing"].concat();
    let raw = S3ObjectStore::connect(config.clone()).await.unwrap();
    raw.put(&format!("uploads/{}", up.upload_id), bigger.into())
        .await
        .unwrap();
    let e = submit(&env, ALICE, &up.upload_id).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("declared"), "{}", e.message());

    raw.delete_bucket().await.unwrap();
}
