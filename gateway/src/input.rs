//! Edge validation: who is calling, ids in paths and headers, and the scan input (multipart or
//! JSON) with its image checked for emptiness, size and type before anything reaches ingest.

use axum::{
    body::Bytes,
    extract::{FromRequest, Multipart, Request},
    http::{HeaderMap, header},
};
use base64::Engine as _;
use ecoscan_proto::event::EventId;
use serde::Deserialize;

use crate::{AppState, error::ApiError};

use ecoscan_common::{
    limits::{MAX_HINT_CHARS, MAX_IDEMPOTENCY_KEY_BYTES},
    models::MAX_MODEL_NAME,
};

/// A job id must be a UUID; anything else is a client mistake, not an unknown job.
pub fn job_id(raw: &str) -> Result<String, ApiError> {
    uuid::Uuid::parse_str(raw)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| ApiError::invalid_field("job_id", format!("job id {raw:?} is not a uuid")))
}

/// An event id as the event log writes it: `<milliseconds>-<sequence>` (a Redis stream id).
pub fn valid_event_id(s: &str) -> bool {
    EventId::is_well_formed(s)
}

/// The `Idempotency-Key` header, if any: 1–128 visible ASCII characters (ingest's limit).
pub fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(String::new());
    };
    match v.to_str() {
        Ok(k)
            if (1..=MAX_IDEMPOTENCY_KEY_BYTES).contains(&k.len())
                && k.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Ok(k.to_owned())
        }
        _ => Err(ApiError::invalid_field(
            "Idempotency-Key",
            format!(
                "Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_BYTES} visible ASCII characters"
            ),
        )),
    }
}

/// The image's MIME type from its first bytes, if it is one of the types we take.
pub use ecoscan_common::image::sniff as sniff_image;

/// Checks an image and returns its sniffed MIME type.
pub fn check_image(bytes: &[u8], max: usize) -> Result<&'static str, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::invalid_field(
            "image",
            "image is empty; send the photo bytes in `image`",
        ));
    }
    if bytes.len() > max {
        return Err(too_large(max));
    }
    sniff_image(bytes).ok_or_else(|| {
        ApiError::UnsupportedMediaType(
            "image is not a JPEG, PNG, GIF or WebP file; send a photo in one of those formats"
                .into(),
        )
    })
}

fn too_large(max: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!(
        "image is larger than {max} bytes; send a smaller photo"
    ))
}

/// A scan as the caller sent it, validated.
#[derive(Debug, Default)]
pub struct ScanInput {
    pub image: Bytes,
    pub content_type: String,
    pub image_url: String,
    pub hint: String,
    pub locale: String,
    /// The model the caller chose; empty for the deployment's. Ingest holds it to the offered
    /// ones.
    pub model: String,
    /// A direct upload (`POST /api/v1/uploads`) holding the photo, instead of the photo.
    pub upload_id: String,
}

/// An upload id must be a UUID, as a job id.
fn upload_id(raw: &str) -> Result<String, ApiError> {
    uuid::Uuid::parse_str(raw.trim())
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| {
            ApiError::invalid_field(
                "upload_id",
                format!(
                    "upload_id {raw:?} is not a uuid; use the upload_id POST /api/v1/uploads \
                     returned"
                ),
            )
        })
}

/// The JSON form of a scan.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScanJson {
    image_url: Option<String>,
    image_base64: Option<String>,
    upload_id: Option<String>,
    #[serde(default)]
    hint: String,
    #[serde(default)]
    locale: String,
    #[serde(default)]
    model: String,
}

impl ScanInput {
    /// Reads a multipart (`image` file, `hint`, `locale`, `model`) or JSON scan from the
    /// request.
    pub async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        let max = state.config.max_image_bytes;
        let input = if content_type.starts_with("multipart/form-data") {
            let multipart = Multipart::from_request(req, state)
                .await
                .map_err(|e| ApiError::InvalidArgument(format!("invalid multipart body: {e}")))?;
            Self::from_multipart(multipart, max).await?
        } else if content_type.starts_with("application/json") {
            let body = Bytes::from_request(req, state).await.map_err(|e| {
                if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::PayloadTooLarge("request body is too large".into())
                } else {
                    ApiError::InvalidArgument(format!("could not read the request body: {e}"))
                }
            })?;
            Self::from_json(&body, max)?
        } else {
            return Err(ApiError::UnsupportedMediaType(
                "send the scan as multipart/form-data (field `image`) or application/json".into(),
            ));
        };
        input.validate_text()?;
        Ok(input)
    }

    async fn from_multipart(mut multipart: Multipart, max: usize) -> Result<Self, ApiError> {
        let mut input = Self::default();
        let mut saw_image = false;
        // The image part's own `Content-Type`, held to the bytes (the rule ingest applies too).
        let mut declared: Option<String> = None;
        while let Some(mut field) = multipart.next_field().await.map_err(multipart_error)? {
            match field.name().unwrap_or_default() {
                "image" => {
                    if saw_image {
                        return Err(ApiError::invalid_field(
                            "image",
                            "send exactly one `image` field",
                        ));
                    }
                    saw_image = true;
                    declared = field.content_type().map(str::to_owned);
                    // Read chunk by chunk so an oversized image is refused without buffering it.
                    let mut buf = Vec::new();
                    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
                        if buf.len() + chunk.len() > max {
                            return Err(too_large(max));
                        }
                        buf.extend_from_slice(&chunk);
                    }
                    input.image = Bytes::from(buf);
                }
                "hint" => input.hint = text_field("hint", field).await?,
                "locale" => input.locale = text_field("locale", field).await?,
                "model" => input.model = text_field("model", field).await?,
                "upload_id" => input.upload_id = upload_id(&text_field("upload_id", field).await?)?,
                // Unknown form fields are ignored, as HTML forms often add their own.
                _ => {}
            }
        }
        match (saw_image, input.upload_id.is_empty()) {
            (false, true) => {
                return Err(ApiError::invalid_field(
                    "image",
                    "missing the `image` field; send the photo as a file in `image`, or name a \
                     direct upload in `upload_id`",
                ));
            }
            (true, false) => {
                return Err(ApiError::invalid_fields(
                    &["image", "upload_id"],
                    "send the photo in `image` or name a direct upload in `upload_id`, not both",
                ));
            }
            // The upload's photo is checked by ingest, which holds it.
            (false, false) => return Ok(input),
            (true, true) => {}
        }
        let found = check_image(&input.image, max)?;
        if let Some(declared) = &declared {
            ecoscan_common::image::check_declared(declared, found)
                .map_err(ApiError::UnsupportedMediaType)?;
        }
        input.content_type = found.to_owned();
        Ok(input)
    }

    fn from_json(body: &[u8], max: usize) -> Result<Self, ApiError> {
        let json: ScanJson = serde_json::from_slice(body)
            .map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
        let mut input = Self {
            hint: json.hint,
            locale: json.locale,
            model: json.model,
            ..Self::default()
        };
        match (json.image_url, json.image_base64, json.upload_id) {
            (Some(url), None, None) => input.image_url = check_image_url(url)?,
            // The upload's photo is checked by ingest, which holds it.
            (None, None, Some(id)) => input.upload_id = upload_id(&id)?,
            (None, Some(b64), None) => {
                let b64 = strip_data_url(b64.trim());
                // Refuse before decoding: base64 is 4/3 of the bytes it carries.
                if b64.len() / 4 * 3 > max + 3 {
                    return Err(too_large(max));
                }
                let image = BASE64.decode(b64).map_err(|e| {
                    ApiError::invalid_field(
                        "image_base64",
                        format!("image_base64 is not valid base64: {e}"),
                    )
                })?;
                input.content_type = check_image(&image, max)?.to_owned();
                input.image = Bytes::from(image);
            }
            _ => {
                return Err(ApiError::invalid_fields(
                    &["image_url", "image_base64", "upload_id"],
                    "send exactly one of `image_url`, `image_base64` and `upload_id`",
                ));
            }
        }
        Ok(input)
    }

    fn validate_text(&self) -> Result<(), ApiError> {
        if self.hint.chars().count() > MAX_HINT_CHARS {
            return Err(ApiError::invalid_field(
                "hint",
                format!("hint is longer than {MAX_HINT_CHARS} characters"),
            ));
        }
        if !matches!(self.locale.as_str(), "" | "ko" | "en") {
            return Err(ApiError::invalid_field(
                "locale",
                "locale must be \"ko\" or \"en\"",
            ));
        }
        // Which models are offered is ingest's to say; the length bound is everyone's.
        if self.model.len() > MAX_MODEL_NAME {
            return Err(ApiError::invalid_field(
                "model",
                format!("model is longer than {MAX_MODEL_NAME} bytes"),
            ));
        }
        Ok(())
    }
}

/// Standard base64, with or without padding.
const BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// Accepts `data:image/png;base64,....` as browsers produce it, as well as bare base64.
fn strip_data_url(s: &str) -> &str {
    match s.split_once(";base64,") {
        Some((prefix, rest)) if prefix.starts_with("data:") => rest,
        _ => s,
    }
}

fn check_image_url(url: String) -> Result<String, ApiError> {
    let url = url.trim().to_owned();
    let ok = url.len() <= 2048
        && url
            .parse::<axum::http::Uri>()
            .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some());
    if ok {
        Ok(url)
    } else {
        Err(ApiError::invalid_field(
            "image_url",
            "image_url must be an absolute http(s) URL of at most 2048 characters",
        ))
    }
}

async fn text_field(
    name: &'static str,
    field: axum::extract::multipart::Field<'_>,
) -> Result<String, ApiError> {
    let text = field.text().await.map_err(multipart_error)?;
    // Bounded as it is read (a form field could be megabytes); every text field's limit is
    // the hint's or less.
    if text.chars().count() > MAX_HINT_CHARS {
        return Err(ApiError::invalid_field(
            name,
            format!("{name} is longer than {MAX_HINT_CHARS} characters"),
        ));
    }
    Ok(text)
}

fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge("request body is too large".into())
    } else {
        ApiError::InvalidArgument(format!("invalid multipart body: {}", e.body_text()))
    }
}

/// A JSON request body as a handler takes it (`Result<Bytes, BytesRejection>`): 413 past the
/// body limit, 415 unless it is declared `application/json` (`what` says what to send so), 400
/// for JSON that is not a `T`.
pub(crate) fn json_body<T: serde::de::DeserializeOwned>(
    headers: &axum::http::HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
    what: &str,
) -> Result<T, ApiError> {
    let body = body_bytes(body)?;
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("application/json"));
    if !is_json {
        return Err(ApiError::UnsupportedMediaType(format!(
            "send {what} as application/json"
        )));
    }
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))
}

/// A request body as a handler takes it: 413 past the body limit, 400 when it could not be read.
pub(crate) fn body_bytes(
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge("request body is too large".into())
        } else {
            ApiError::InvalidArgument(format!("could not read the request body: {e}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_image_distinguishes_empty_large_and_wrong_type() {
        let png = b"\x89PNG\r\n\x1a\n0000";
        assert_eq!(check_image(png, 100).unwrap(), "image/png");
        assert_eq!(check_image(b"", 100).unwrap_err().http_status(), 400);
        assert_eq!(check_image(png, 4).unwrap_err().http_status(), 413);
        assert_eq!(check_image(b"hello", 100).unwrap_err().http_status(), 415);
    }

    #[test]
    fn event_ids_look_like_redis_stream_ids() {
        assert!(valid_event_id("1718000000000-0"));
        assert!(valid_event_id("1-12"));
        assert!(!valid_event_id("1718000000000"));
        assert!(!valid_event_id("abc-1"));
        assert!(!valid_event_id("1-"));
        assert!(!valid_event_id("-1"));
        assert!(!valid_event_id("1-2-3"));
    }

    #[test]
    fn job_ids_must_be_uuids() {
        assert!(job_id("7f8e2a9c-1d2b-4c3d-8e9f-0a1b2c3d4e5f").is_ok());
        assert_eq!(job_id("42").unwrap_err().http_status(), 400);
    }

    #[test]
    fn json_scan_needs_exactly_one_image_source() {
        let both = br#"{"image_url":"http://x/a.png","image_base64":"aGk="}"#;
        assert_eq!(
            ScanInput::from_json(both, 100).unwrap_err().http_status(),
            400
        );
        assert_eq!(
            ScanInput::from_json(b"{}", 100).unwrap_err().http_status(),
            400
        );
        let url = ScanInput::from_json(br#"{"image_url":"https://x.org/a.png"}"#, 100).unwrap();
        assert_eq!(url.image_url, "https://x.org/a.png");
        let bad_url = br#"{"image_url":"file:///etc/passwd"}"#;
        assert_eq!(
            ScanInput::from_json(bad_url, 100)
                .unwrap_err()
                .http_status(),
            400
        );
    }

    #[test]
    fn json_scan_may_name_an_upload_instead_of_the_photo() {
        let id = "7f8e2a9c-1d2b-4c3d-8e9f-0a1b2c3d4e5f";
        let body = format!(r#"{{"upload_id":"{id}","hint":"bottle"}}"#);
        let input = ScanInput::from_json(body.as_bytes(), 100).unwrap();
        assert_eq!(input.upload_id, id);
        assert!(input.image.is_empty() && input.image_url.is_empty());
        let both = format!(r#"{{"upload_id":"{id}","image_url":"https://x.org/a.png"}}"#);
        assert_eq!(
            ScanInput::from_json(both.as_bytes(), 100)
                .unwrap_err()
                .http_status(),
            400
        );
        let bad = br#"{"upload_id":"42"}"#;
        assert_eq!(
            ScanInput::from_json(bad, 100).unwrap_err().http_status(),
            400
        );
    }

    #[test]
    fn json_scan_decodes_base64_and_data_urls() {
        let b64 = BASE64.encode(b"GIF89a-pixels");
        let body = format!(r#"{{"image_base64":"data:image/gif;base64,{b64}"}}"#);
        let input = ScanInput::from_json(body.as_bytes(), 100).unwrap();
        assert_eq!(input.content_type, "image/gif");
        assert_eq!(&input.image[..], b"GIF89a-pixels");
        let bad = br#"{"image_base64":"!!!not base64!!!"}"#;
        assert_eq!(
            ScanInput::from_json(bad, 100).unwrap_err().http_status(),
            400
        );
    }
}
