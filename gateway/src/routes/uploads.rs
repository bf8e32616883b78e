//! Direct uploads: `POST /api/v1/uploads` reserves one (ingest's `CreateUpload`) and answers
//! where to `PUT` the photo. With S3 that is a presigned S3 URL: the photo goes to the bucket
//! and never through the gateway or ingest. With the embedded store (a local directory no
//! client can reach) ingest gives no URL, and the gateway hands out its own,
//! `PUT /api/v1/uploads/{id}?token=`, whose token is signed here with what the upload was
//! declared with (`auth::uploads`), and whose bytes it passes to ingest's `PutUpload`. A client
//! does the same either way: `PUT` the bytes to `upload_url` with `headers`, then submit the
//! scan with `upload_id`.

use std::collections::BTreeMap;

use axum::{
    Json,
    body::Bytes,
    extract::{
        Path, State,
        rejection::{BytesRejection, PathRejection},
    },
    http::{HeaderMap, StatusCode, header, request::Parts},
    response::{IntoResponse, Response},
};
use ecoscan_proto::v1::{CreateUploadRequest, PutUploadRequest};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{
    AppState, SUBMIT_DEADLINE, UNARY_DEADLINE,
    auth::{Caller, uploads::UploadGrant},
    error::ApiError,
    schema::{BodyErrors, CommonErrors, NotFound},
};

/// What `POST /api/v1/uploads` takes.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct UploadRequest {
    /// The photo's type: `image/jpeg`, `image/png`, `image/webp` or `image/gif`. The `PUT` must
    /// send it as its `Content-Type`, and the photo's bytes must be of this type.
    #[schema(example = "image/png")]
    content_type: String,
    /// The photo's exact size in bytes (at most the image limit, 10 MiB by default): the `PUT`
    /// must send exactly this many.
    #[schema(example = 48213, minimum = 1)]
    size_bytes: u64,
}

/// Where to send the photo (201 of `POST /api/v1/uploads`).
#[derive(Serialize, ToSchema)]
pub(crate) struct UploadCreated {
    /// The upload's id: send it as `upload_id` with `POST /api/v1/scan` once the photo is up.
    upload_id: String,
    /// Where to `PUT` the photo: a presigned S3 URL, or this gateway's upload URL (embedded
    /// store). Either carries its own credential: send no `Authorization` with it.
    upload_url: String,
    /// Always `PUT`.
    method: &'static str,
    /// Headers the `PUT` must carry exactly as given (they are signed): `Content-Type`,
    /// `Content-Length`.
    headers: BTreeMap<String, String>,
    /// When the URL stops working; an upload not submitted by then is deleted (RFC 3339).
    expires_at: String,
    /// The declared type, normalized (`image/jpg` is `image/jpeg`).
    content_type: String,
    /// The declared size in bytes.
    size_bytes: u64,
}

fn ingest_error(status: tonic::Status) -> ApiError {
    ApiError::upstream("ingest", status)
}

/// `POST /api/v1/uploads`: reserves a direct upload of one photo.
#[utoipa::path(
    post,
    path = "/api/v1/uploads",
    tag = "scans",
    operation_id = "createUpload",
    summary = "Reserve a direct upload",
    description = "Reserves an upload of one photo of the declared type and size and answers \
                   where to `PUT` it: with S3 a presigned URL (the photo goes straight to the \
                   bucket), with the embedded store this gateway's upload URL. The type and size \
                   are signed into the URL: a `PUT` with another `Content-Type` or length is \
                   refused. Then submit the scan with `upload_id` (`POST /api/v1/scan`); ingest \
                   checks the photo (size, type, an image) before the scan is queued. An upload \
                   is submitted once; one never submitted expires (10 min by default) and is \
                   deleted. Rate-limited per user, as a scan.",
    request_body(content = UploadRequest, content_type = "application/json"),
    responses(
        (status = 201, description = "Reserved: `PUT` the photo to `upload_url` with `headers`.",
            body = UploadCreated),
        CommonErrors,
        BodyErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: UploadRequest =
        crate::input::json_body(&headers, body, "the upload's content_type and size_bytes")?;
    // An upload is the first half of a scan: it counts against the same limit.
    state.rate.scan(&caller.user)?;
    let res = state
        .scan
        .clone()
        .create_upload(crate::auth::request(
            CreateUploadRequest {
                content_type: req.content_type,
                size_bytes: req.size_bytes,
            },
            UNARY_DEADLINE,
            &caller,
        ))
        .await
        .map_err(ingest_error)?
        .into_inner();
    let expires_at = res.expires_at.ok_or_else(|| {
        ApiError::Internal("ingest answered CreateUpload without expires_at".into())
    })?;
    let (upload_url, headers) = if res.upload_url.is_empty() {
        // The embedded store: this gateway's URL, with the declaration signed into its token.
        let grant = UploadGrant {
            caller: caller.clone(),
            upload_id: res.upload_id.clone(),
            content_type: res.content_type.clone(),
            size_bytes: res.size_bytes,
        };
        let until = ecoscan_proto::to_system_time(&expires_at);
        let token = state.auth.issue_upload_token(&grant, until)?;
        let url = state
            .config
            .public_url(&format!("/api/v1/uploads/{}?token={token}", res.upload_id));
        let headers = BTreeMap::from([
            ("Content-Type".to_owned(), res.content_type.clone()),
            ("Content-Length".to_owned(), res.size_bytes.to_string()),
        ]);
        (url, headers)
    } else {
        (res.upload_url, res.headers.into_iter().collect())
    };
    let body = UploadCreated {
        upload_id: res.upload_id,
        upload_url,
        method: "PUT",
        headers,
        // Protobuf's JSON of a timestamp is RFC 3339.
        expires_at: serde_json::to_value(expires_at)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        content_type: res.content_type,
        size_bytes: res.size_bytes,
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// `PUT /api/v1/uploads/{id}?token=`: the embedded store's upload URL.
#[utoipa::path(
    put,
    path = "/api/v1/uploads/{id}",
    tag = "scans",
    operation_id = "putUpload",
    summary = "Upload a photo (embedded store)",
    description = "Where `POST /api/v1/uploads` sends the photo when the object store cannot \
                   presign a URL (the embedded store). The URL's `token` is its only credential \
                   (no `Authorization`): it names the upload, its owner, and the type and size \
                   declared, and expires with the upload. The `Content-Type` must be the \
                   declared type (else 415) and the body exactly the declared size (413 when \
                   larger, 400 otherwise). A forged, expired or other upload's token is 401, \
                   before the body is read.",
    params(
        ("id" = String, Path, format = "uuid", description = "The upload's id."),
        ("token" = String, Query, description = "The token in the `upload_url`."),
    ),
    request_body(description = "The photo's bytes.", content_type = "image/*",
        content = Vec<u8>),
    responses(
        (status = 204, description = "Stored; submit the scan with `upload_id`."),
        (status = 404, response = NotFound),
        CommonErrors,
        BodyErrors,
    ),
    security(("uploadToken" = [])),
)]
pub(crate) async fn put(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    parts: Parts,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(id) = path.map_err(|e| ApiError::InvalidArgument(e.body_text()))?;
    // The token was checked before the body was read (`auth::authenticate`); read again here
    // for what it allows.
    let grant = state.auth.upload_grant(&parts, &id)?;
    let sent_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if ecoscan_common::image::declared_type(sent_type) != Some(grant.content_type.as_str()) {
        return Err(ApiError::UnsupportedMediaType(format!(
            "this upload URL was signed for {}, not {sent_type:?}: send `Content-Type: {}`",
            grant.content_type, grant.content_type
        )));
    }
    let body = crate::input::body_bytes(body)?;
    let sent = body.len() as u64;
    if sent > grant.size_bytes {
        return Err(ApiError::PayloadTooLarge(format!(
            "the photo is {sent} bytes; this upload URL was signed for {} bytes",
            grant.size_bytes
        )));
    }
    if sent != grant.size_bytes {
        return Err(ApiError::invalid_field(
            "Content-Length",
            format!(
                "the photo is {sent} bytes; this upload URL was signed for exactly {} bytes",
                grant.size_bytes
            ),
        ));
    }
    state
        .scan
        .clone()
        .put_upload(crate::auth::request(
            PutUploadRequest {
                upload_id: grant.upload_id,
                image: body.to_vec(),
                content_type: grant.content_type,
            },
            SUBMIT_DEADLINE,
            &grant.caller,
        ))
        .await
        .map_err(ingest_error)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
