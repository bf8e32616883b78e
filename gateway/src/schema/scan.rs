//! What a scan's operations take and answer with, as the document describes them: the JSON and
//! multipart forms of a scan (`input::ScanInput` reads both), and a finished scan's result.

use serde_json::json;
use utoipa::{
    PartialSchema, ToSchema,
    openapi::{
        self, Ref, RefOr,
        schema::{
            AdditionalProperties, AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaFormat,
            Type,
        },
    },
};

use super::{job_status_schema, proto, stage_schema};
use crate::error::ErrorJson;

/// The JSON form of a scan, as `input::ScanInput` reads `application/json`.
pub(crate) struct ScanJson;

impl PartialSchema for ScanJson {
    fn schema() -> RefOr<Schema> {
        let fields = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "image_url",
                ObjectBuilder::new()
                    .schema_type(nullable_string())
                    .format(Some(SchemaFormat::Custom("uri".into())))
                    .pattern(Some("^https?://"))
                    .max_length(Some(2048))
                    .description(Some(
                        "An absolute http(s) URL of the photo; ingest fetches it (public \
                         addresses only, size and time limited).",
                    )),
            )
            .property(
                "image_base64",
                ObjectBuilder::new()
                    .schema_type(nullable_string())
                    .content_encoding("base64")
                    .description(Some(
                        "The photo's bytes in standard base64 (padding optional), or a \
                         `data:image/...;base64,` URL as browsers make them. JPEG, PNG, GIF or \
                         WebP.",
                    )),
            )
            .property("upload_id", nullable_upload_id_schema())
            .property("hint", hint_schema())
            .property("locale", locale_schema())
            .property("model", model_schema())
            .additional_properties(Some(AdditionalProperties::<Schema>::FreeForm(false)))
            .description(Some(
                "A scan as JSON: exactly one of `image_url`, `image_base64` and `upload_id` (a \
                 `null` is the same as absent).",
            ))
            .build();
        // A `null` is the same as absent, so "exactly one" counts the non-null values.
        let exactly_one = OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .property("image_url", String::schema())
                    .required("image_url"),
            )
            .item(
                ObjectBuilder::new()
                    .property("image_base64", String::schema())
                    .required("image_base64"),
            )
            .item(
                ObjectBuilder::new()
                    .property("upload_id", String::schema())
                    .required("upload_id"),
            )
            .build();
        AllOfBuilder::new()
            .item(fields)
            .item(Schema::OneOf(exactly_one))
            .examples([json!({
                "image_base64": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==",
                "hint": "plastic bottle",
                "locale": "en",
            })])
            .into()
    }
}

impl ToSchema for ScanJson {}

/// A string or `null` (which the gateway reads as absent).
fn nullable_string() -> openapi::schema::SchemaType {
    openapi::schema::SchemaType::from_iter([Type::String, Type::Null])
}

/// The multipart form of a scan, as `input::ScanInput` reads `multipart/form-data`.
pub(crate) struct ScanForm;

impl PartialSchema for ScanForm {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "image",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .content_media_type("application/octet-stream")
                    .description(Some(
                        "The photo, as a file: JPEG, PNG, GIF or WebP (its type is read from \
                         its bytes). Exactly one, unless `upload_id` names the photo.",
                    )),
            )
            .property("upload_id", upload_id_schema())
            .property("hint", hint_schema())
            .property("locale", locale_schema())
            .property("model", model_schema())
            .description(Some(
                "A scan as a form: the photo in `image`, or a direct upload in `upload_id` (one \
                 of the two); other fields are ignored.",
            ))
            .into()
    }
}

impl ToSchema for ScanForm {}

/// What `upload_id` means, in both forms of a scan.
const UPLOAD_ID: &str = "A direct upload holding the photo (`upload_id` of `POST /api/v1/uploads`, \
                         its photo `PUT` to its `upload_url`): the caller's, not expired, not \
                         submitted before. Ingest checks its photo (the declared size and type, \
                         an image) before the scan is queued.";

fn upload_id_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .format(Some(SchemaFormat::Custom("uuid".into())))
        .description(Some(UPLOAD_ID))
        .build()
        .into()
}

fn nullable_upload_id_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(nullable_string())
        .format(Some(SchemaFormat::Custom("uuid".into())))
        .description(Some(UPLOAD_ID))
        .build()
        .into()
}

fn hint_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(ecoscan_common::limits::MAX_HINT_CHARS))
        .description(Some(
            "What the person thinks it is, e.g. \"plastic bottle\"; at most 500 characters.",
        ))
        .build()
        .into()
}

fn model_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(ecoscan_common::models::MAX_MODEL_NAME))
        .description(Some(
            "The model that classifies the photo and writes the answer, one of those the \
             deployment offers (`LLM_MODELS`); empty for its configured ones. Any other is a \
             400 naming the offered models.",
        ))
        .examples(["gpt-4o-mini"])
        .build()
        .into()
}

fn locale_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["", "ko", "en"]))
        .description(Some(
            "The answer's language; empty for the default (Korean).",
        ))
        .build()
        .into()
}

/// A finished scan (`GET /api/v1/scan/{id}`, 200): the proto3 JSON of `ScanResult`, with
/// `status` and `stage` as short names and `error` in the shape SSE errors have (see
/// `routes::scan::result_json`).
pub(crate) struct ScanResult;

impl PartialSchema for ScanResult {
    fn schema() -> RefOr<Schema> {
        let mut schema = proto::message("ScanResult");
        if let Schema::Object(object) = &mut schema {
            object
                .properties
                .insert("status".into(), job_status_schema().into());
            object
                .properties
                .insert("stage".into(), stage_schema().into());
            let mut error = Ref::from_schema_name(ErrorJson::name());
            error.description = "Set when the job failed.".into();
            object.properties.insert("error".into(), error.into());
        }
        schema.into()
    }
}

impl ToSchema for ScanResult {
    fn schemas(out: &mut Vec<(String, RefOr<Schema>)>) {
        proto::dependencies("ScanResult", out);
        out.retain(|(name, _)| name != "ErrorInfo");
        out.push((ErrorJson::name().into_owned(), ErrorJson::schema()));
    }
}
