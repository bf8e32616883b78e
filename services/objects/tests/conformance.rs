//! One conformance suite for `ObjectStore`, run against the local directory and against S3 (moto
//! or any S3-compatible server at `TEST_S3_ENDPOINT`, started by `infra/services.sh`).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use ecoscan_objects::{
    LocalObjectStore, ObjectStore, PresignedPut, RecentWrites, S3Config, S3ObjectStore,
};

async fn object_store_conformance(objects: Arc<dyn ObjectStore>) {
    objects
        .put("images/ab/one", Bytes::from_static(b"\x89PNG"))
        .await
        .unwrap();
    assert_eq!(
        objects.get("images/ab/one").await.unwrap().unwrap(),
        Bytes::from_static(b"\x89PNG")
    );
    objects
        .put("images/ab/one", Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(
        objects.get("images/ab/one").await.unwrap().unwrap(),
        Bytes::from_static(b"two"),
        "a put replaces the object"
    );
    let big = Bytes::from(
        (0..3 * 1024 * 1024)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    objects.put("bodies/big", big.clone()).await.unwrap();
    assert_eq!(objects.get("bodies/big").await.unwrap().unwrap(), big);
    objects.put("empty", Bytes::new()).await.unwrap();
    assert_eq!(objects.get("empty").await.unwrap().unwrap(), Bytes::new());

    assert!(objects.get("images/ab/missing").await.unwrap().is_none());
    assert_eq!(
        objects.size("bodies/big").await.unwrap(),
        Some(big.len() as u64)
    );
    assert_eq!(objects.size("empty").await.unwrap(), Some(0));
    assert_eq!(objects.size("images/ab/missing").await.unwrap(), None);
    objects.delete("images/ab/one").await.unwrap();
    assert!(objects.get("images/ab/one").await.unwrap().is_none());
    objects
        .delete("images/ab/one")
        .await
        .expect("deleting a missing object is not an error");
    for bad in ["../escape", "/abs", "a//b", ""] {
        assert!(
            objects.put(bad, Bytes::new()).await.is_err(),
            "key {bad:?} must be refused"
        );
        assert!(
            objects.get(bad).await.is_err(),
            "key {bad:?} must be refused"
        );
    }
    objects.delete("bodies/big").await.unwrap();
    objects.delete("empty").await.unwrap();
}

#[tokio::test]
async fn local_object_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    object_store_conformance(Arc::new(LocalObjectStore::open(dir.path()).await.unwrap())).await;
}

#[tokio::test]
async fn a_store_remembering_recent_writes_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let inner = Arc::new(LocalObjectStore::open(dir.path()).await.unwrap());
    // Small enough that the 3 MiB object of the suite leaves the cache and is read through.
    object_store_conformance(Arc::new(RecentWrites::new(inner, 1024 * 1024))).await;
}

#[tokio::test]
async fn recent_writes_are_served_from_memory_and_the_rest_read_through() {
    let dir = tempfile::tempdir().unwrap();
    let inner: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::open(dir.path()).await.unwrap());
    let store = RecentWrites::new(inner.clone(), 10);
    store.put("a", Bytes::from_static(b"12345")).await.unwrap();
    // Changed behind the cache's back: a cached read still answers the cached bytes.
    inner.put("a", Bytes::from_static(b"other")).await.unwrap();
    assert_eq!(store.get("a").await.unwrap().unwrap(), "12345");
    // Two more writes push the first out (10 bytes at most): it is read through again.
    store.put("b", Bytes::from_static(b"678")).await.unwrap();
    store.put("c", Bytes::from_static(b"90ab")).await.unwrap();
    assert_eq!(store.get("a").await.unwrap().unwrap(), "other");
    assert_eq!(store.get("c").await.unwrap().unwrap(), "90ab");
    store.delete("c").await.unwrap();
    assert!(store.get("c").await.unwrap().is_none());
}

fn s3_config(bucket: &str, key_prefix: &str) -> S3Config {
    let endpoint =
        std::env::var("TEST_S3_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9000".into());
    S3Config {
        endpoint,
        bucket: bucket.into(),
        region: "us-east-1".into(),
        credentials: Some(("test".into(), "test".into())),
        key_prefix: key_prefix.into(),
    }
}

async fn connect_s3(config: S3Config) -> S3ObjectStore {
    let endpoint = config.endpoint.clone();
    S3ObjectStore::connect(config).await.unwrap_or_else(|e| {
        panic!(
            "S3 endpoint {endpoint} (TEST_S3_ENDPOINT) is unreachable: {e}; start it with infra/services.sh"
        )
    })
}

#[tokio::test]
async fn s3_object_store_conforms() {
    let bucket = format!("t-{}", uuid::Uuid::new_v4());
    let store = Arc::new(connect_s3(s3_config(&bucket, "")).await);
    object_store_conformance(store.clone()).await;
    store.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn s3_object_store_keeps_prefixes_apart_and_creates_its_bucket_once() {
    let bucket = format!("t-{}", uuid::Uuid::new_v4());
    let a = connect_s3(s3_config(&bucket, "a/")).await;
    // A second store on the same, now existing, bucket starts fine.
    let b = connect_s3(s3_config(&bucket, "b/")).await;
    a.put("k", Bytes::from_static(b"from a")).await.unwrap();
    assert!(b.get("k").await.unwrap().is_none(), "prefixes are separate");
    b.put("k", Bytes::from_static(b"from b")).await.unwrap();
    assert_eq!(a.get("k").await.unwrap().unwrap(), "from a");
    b.delete("k").await.unwrap();
    a.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn s3_delete_all_removes_its_own_prefix_only() {
    let bucket = format!("t-{}", uuid::Uuid::new_v4());
    let a = connect_s3(s3_config(&bucket, "run/1/")).await;
    let b = connect_s3(s3_config(&bucket, "run/2/")).await;
    for key in ["x", "y/z", "y/w"] {
        a.put(key, Bytes::from_static(b"a")).await.unwrap();
    }
    b.put("x", Bytes::from_static(b"b")).await.unwrap();
    assert_eq!(a.delete_all().await.unwrap(), 3);
    for key in ["x", "y/z", "y/w"] {
        assert!(a.get(key).await.unwrap().is_none(), "{key} deleted");
    }
    assert_eq!(
        b.get("x").await.unwrap().unwrap(),
        "b",
        "another prefix is kept"
    );
    assert_eq!(a.delete_all().await.unwrap(), 0, "nothing left to delete");
    b.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn local_puts_make_missing_directories_again_and_leave_no_temporary_files() {
    let dir = tempfile::tempdir().unwrap();
    let objects = LocalObjectStore::open(dir.path()).await.unwrap();
    objects
        .put("images/ab/one", Bytes::from_static(b"1"))
        .await
        .unwrap();
    // Someone removed a directory the store had made: the next put there makes it again.
    std::fs::remove_dir_all(dir.path().join("images")).unwrap();
    objects
        .put("images/ab/two", Bytes::from_static(b"2"))
        .await
        .unwrap();
    objects
        .put("images/cd/ef/three", Bytes::from_static(b"3"))
        .await
        .unwrap();
    assert_eq!(
        objects.get("images/ab/two").await.unwrap().unwrap(),
        Bytes::from_static(b"2")
    );
    // A put whose rename fails (a directory where the object goes) fails and leaves nothing.
    std::fs::create_dir_all(dir.path().join("images/ab/dir/inside")).unwrap();
    assert!(
        objects
            .put("images/ab/dir", Bytes::from_static(b"x"))
            .await
            .is_err()
    );
    let mut names = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                names.push(path.strip_prefix(dir.path()).unwrap().to_owned());
            }
        }
    }
    names.sort();
    assert_eq!(
        names,
        ["images/ab/two", "images/cd/ef/three"].map(std::path::PathBuf::from),
        "only the objects, no temporary file"
    );
}

#[tokio::test]
async fn a_local_store_hands_out_no_presigned_urls() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalObjectStore::open(dir.path()).await.unwrap();
    let url = store
        .presign_put("uploads/x", "image/png", 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(url, None, "its bytes come through the service");
}

/// A `PUT` of `body` to `signed` with its headers, from a plain HTTP client, as an app sends it.
async fn put_to(signed: &PresignedPut, body: &'static [u8]) -> reqwest::StatusCode {
    let mut req = reqwest::Client::new().put(&signed.url).body(body);
    for (k, v) in &signed.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    req.send().await.expect("the S3 endpoint answers").status()
}

fn query_param<'a>(url: &'a str, name: &str) -> &'a str {
    url.split(['?', '&'])
        .find_map(|p| p.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{name} in {url}"))
}

/// The type and the size are in the signature, and a plain HTTP client's `PUT` stores the
/// object where the store reads it. That S3 refuses a `PUT` with another type, size or key is
/// S3's signature check, which moto (the tests' server) does not make: it takes any presigned
/// `PUT` (docs/stores.md says so). What this shows is that the signature covers them: another
/// type, size or lifetime gives another signature.
#[tokio::test]
async fn s3_presigned_puts_sign_the_type_and_size_and_store_the_object() {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n0123456789";
    let bucket = format!("t-{}", uuid::Uuid::new_v4());
    let store = connect_s3(s3_config(&bucket, "run/")).await;
    let presign = |ct: &'static str, len: u64| {
        let store = &store;
        async move {
            store
                .presign_put("uploads/a", ct, len, Duration::from_secs(600))
                .await
                .unwrap()
                .expect("S3 presigns")
        }
    };
    let signed = presign("image/png", PNG.len() as u64).await;
    let header = |name: &str| {
        signed
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("content-type").as_deref(), Some("image/png"));
    assert_eq!(header("content-length"), Some(PNG.len().to_string()));
    assert_eq!(
        query_param(&signed.url, "X-Amz-SignedHeaders"),
        "content-length%3Bcontent-type%3Bhost",
        "type and size are signed headers"
    );
    assert_eq!(query_param(&signed.url, "X-Amz-Expires"), "600");
    let signature = |p: &PresignedPut| query_param(&p.url, "X-Amz-Signature").to_owned();
    let other_type = presign("image/jpeg", PNG.len() as u64).await;
    let other_size = presign("image/png", PNG.len() as u64 + 1).await;
    assert_ne!(signature(&signed), signature(&other_type));
    assert_ne!(signature(&signed), signature(&other_size));

    assert_eq!(store.size("uploads/a").await.unwrap(), None);
    assert!(put_to(&signed, PNG).await.is_success());
    assert_eq!(
        store.size("uploads/a").await.unwrap(),
        Some(PNG.len() as u64)
    );
    assert_eq!(store.get("uploads/a").await.unwrap().unwrap(), PNG);
    store.delete_bucket().await.unwrap();
}
