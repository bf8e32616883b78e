//! The S3 client (the `s3` feature): aws-sdk-s3 with path-style addressing.

use std::time::Duration;

use super::S3Config;
use crate::{ObjectError, ObjectStore, PresignedPut, validate_key};
use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region, timeout::TimeoutConfig};
use aws_sdk_s3::{
    Client,
    config::{Credentials, RequestChecksumCalculation, ResponseChecksumValidation},
    error::{DisplayErrorContext, SdkError},
    operation::{
        create_bucket::CreateBucketError, get_object::GetObjectError, head_bucket::HeadBucketError,
        head_object::HeadObjectError,
    },
    presigning::PresigningConfig,
    primitives::ByteStream,
    types::{BucketLocationConstraint, CreateBucketConfiguration},
};
use bytes::Bytes;

/// Objects in an S3 bucket.
pub struct S3ObjectStore {
    client: Client,
    bucket: String,
    key_prefix: String,
}

fn s3_err<E: std::error::Error + 'static, R: std::fmt::Debug>(e: SdkError<E, R>) -> ObjectError {
    ObjectError::S3(DisplayErrorContext(e).to_string())
}

impl S3ObjectStore {
    /// Builds the client, checks that the endpoint answers, and creates the bucket when missing.
    pub async fn connect(config: S3Config) -> Result<Self, ObjectError> {
        // HTTPS on rustls with ring, as every TLS client and server of the suite.
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .region(Region::new(config.region.clone()))
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(3))
                    .operation_attempt_timeout(Duration::from_secs(30))
                    .build(),
            );
        if let Some((id, secret)) = &config.credentials {
            loader = loader.credentials_provider(Credentials::new(
                id,
                secret,
                None,
                None,
                "S3_ACCESS_KEY_ID",
            ));
        }
        let shared = loader.load().await;
        let s3_config = aws_sdk_s3::config::Builder::from(&shared)
            .endpoint_url(&config.endpoint)
            .force_path_style(true)
            // Checksums only where S3 requires them: several S3-compatible servers reject the
            // newer default trailing checksums.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        let store = Self {
            client: Client::from_conf(s3_config),
            bucket: config.bucket,
            key_prefix: config.key_prefix,
        };
        store.ensure_bucket(&config.region).await?;
        Ok(store)
    }

    async fn ensure_bucket(&self, region: &str) -> Result<(), ObjectError> {
        match self.client.head_bucket().bucket(&self.bucket).send().await {
            Ok(_) => return Ok(()),
            Err(SdkError::ServiceError(e)) if matches!(e.err(), HeadBucketError::NotFound(_)) => {}
            Err(e) => return Err(s3_err(e)),
        }
        let mut create = self.client.create_bucket().bucket(&self.bucket);
        // us-east-1 is the one region that refuses an explicit location constraint.
        if region != "us-east-1" {
            create = create.create_bucket_configuration(
                CreateBucketConfiguration::builder()
                    .location_constraint(BucketLocationConstraint::from(region))
                    .build(),
            );
        }
        match create.send().await {
            Ok(_) => {
                tracing::info!(bucket = %self.bucket, "created bucket");
                Ok(())
            }
            // Another replica created it meanwhile.
            Err(SdkError::ServiceError(e))
                if matches!(e.err(), CreateBucketError::BucketAlreadyOwnedByYou(_)) =>
            {
                Ok(())
            }
            Err(e) => Err(s3_err(e)),
        }
    }

    /// Deletes the object under `key` as stored (prefix included). S3 answers success for a
    /// missing key.
    async fn delete_full_key(&self, key: &str) -> Result<(), ObjectError> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(s3_err)?;
        Ok(())
    }

    fn full_key(&self, key: &str) -> Result<String, ObjectError> {
        validate_key(key)?;
        Ok(format!("{}{key}", self.key_prefix))
    }

    /// Deletes every object under this store's key prefix and then the bucket itself (test
    /// teardown; fails when other objects remain in the bucket).
    pub async fn delete_bucket(&self) -> Result<(), ObjectError> {
        self.delete_all().await?;
        self.client
            .delete_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map_err(s3_err)?;
        Ok(())
    }

    /// Deletes every object under this store's key prefix (tests and benchmarks cleaning up
    /// after themselves); how many.
    pub async fn delete_all(&self) -> Result<usize, ObjectError> {
        let mut deleted = 0;
        let mut token = None;
        loop {
            let page = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(&self.key_prefix)
                .set_continuation_token(token)
                .send()
                .await
                .map_err(s3_err)?;
            for object in page.contents() {
                if let Some(key) = object.key() {
                    self.delete_full_key(key).await?;
                    deleted += 1;
                }
            }
            token = page.next_continuation_token().map(str::to_owned);
            if token.is_none() {
                break;
            }
        }
        Ok(deleted)
    }
}

#[async_trait]
impl ObjectStore for S3ObjectStore {
    #[tracing::instrument(
        name = "s3",
        skip_all,
        fields(otel.name = "S3.PutObject", otel.kind = "client", rpc.system = "aws-api", rpc.service = "S3", rpc.method = "PutObject", aws.s3.bucket = %self.bucket, aws.s3.key = tracing::field::Empty, aws.s3.object.size = body.len()),
        err
    )]
    async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError> {
        let key = self.full_key(key)?;
        tracing::Span::current().record("aws.s3.key", key.as_str());
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(s3_err)?;
        Ok(())
    }

    #[tracing::instrument(
        name = "s3",
        skip_all,
        fields(otel.name = "S3.GetObject", otel.kind = "client", rpc.system = "aws-api", rpc.service = "S3", rpc.method = "GetObject", aws.s3.bucket = %self.bucket, aws.s3.key = tracing::field::Empty),
        err
    )]
    async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError> {
        let key = self.full_key(key)?;
        tracing::Span::current().record("aws.s3.key", key.as_str());
        let out = match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(out) => out,
            Err(SdkError::ServiceError(e)) if matches!(e.err(), GetObjectError::NoSuchKey(_)) => {
                return Ok(None);
            }
            Err(e) => return Err(s3_err(e)),
        };
        let body = out
            .body
            .collect()
            .await
            .map_err(|e| ObjectError::S3(format!("reading object body: {e}")))?;
        Ok(Some(body.into_bytes()))
    }

    #[tracing::instrument(
        name = "s3",
        skip_all,
        fields(otel.name = "S3.DeleteObject", otel.kind = "client", rpc.system = "aws-api", rpc.service = "S3", rpc.method = "DeleteObject", aws.s3.bucket = %self.bucket, aws.s3.key = tracing::field::Empty),
        err
    )]
    async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        let key = self.full_key(key)?;
        tracing::Span::current().record("aws.s3.key", key.as_str());
        self.delete_full_key(&key).await
    }

    #[tracing::instrument(
        name = "s3",
        skip_all,
        fields(otel.name = "S3.HeadObject", otel.kind = "client", rpc.system = "aws-api", rpc.service = "S3", rpc.method = "HeadObject", aws.s3.bucket = %self.bucket, aws.s3.key = tracing::field::Empty),
        err
    )]
    async fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        let key = self.full_key(key)?;
        tracing::Span::current().record("aws.s3.key", key.as_str());
        match self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(out) => Ok(Some(
                out.content_length().map_or(0, |n| n.max(0).unsigned_abs()),
            )),
            Err(SdkError::ServiceError(e)) if matches!(e.err(), HeadObjectError::NotFound(_)) => {
                Ok(None)
            }
            Err(e) => Err(s3_err(e)),
        }
    }

    /// Signs a `PutObject` locally (no request to S3): `Content-Type` and `Content-Length` are
    /// signed headers, so S3 refuses a `PUT` with another type or size, and the URL stops
    /// working after `expires_in`.
    #[tracing::instrument(
        name = "s3 presign",
        skip_all,
        fields(aws.s3.bucket = %self.bucket, aws.s3.key = tracing::field::Empty, aws.s3.object.size = content_length),
        err
    )]
    async fn presign_put(
        &self,
        key: &str,
        content_type: &str,
        content_length: u64,
        expires_in: Duration,
    ) -> Result<Option<PresignedPut>, ObjectError> {
        let key = self.full_key(key)?;
        tracing::Span::current().record("aws.s3.key", key.as_str());
        let config = PresigningConfig::expires_in(expires_in)
            .map_err(|e| ObjectError::S3(format!("presigning: {e}")))?;
        let length = i64::try_from(content_length)
            .map_err(|_| ObjectError::S3(format!("object size {content_length} is too large")))?;
        let signed = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .content_length(length)
            .presigned(config)
            .await
            .map_err(s3_err)?;
        Ok(Some(PresignedPut {
            url: signed.uri().to_owned(),
            headers: signed
                .headers()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }))
    }
}
