//! What the suite knows, as a person browses it: the disposal taxonomy (public, cacheable) and
//! the character catalogue with the caller's ownership.

use axum::{
    Json,
    body::Bytes,
    extract::{Path, State, rejection::PathRejection},
    http::{HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
};
use ecoscan_proto::v1::{GetCharacterRequest, ListCatalogueRequest, ListCategoriesRequest};

use crate::{
    AppState, UNARY_DEADLINE,
    auth::Caller,
    error::ApiError,
    results::{Finished, answer_public},
    schema::{
        CommonErrors, GatewayTimeout, Internal, NotFound, TooManyRequests, Unavailable, proto,
    },
};

/// How long a browser or a shared cache may keep the taxonomy before asking again (with its
/// `ETag`, answered `304` while it is the same): it changes only with a new rule dataset.
const CATEGORIES_MAX_AGE: HeaderValue = HeaderValue::from_static("public, max-age=300");

/// `GET /api/v1/scan/categories`: the disposal taxonomy and the situation tags.
#[utoipa::path(
    get,
    path = "/api/v1/scan/categories",
    tag = "scans",
    operation_id = "scanCategories",
    summary = "The disposal taxonomy",
    description = "Every category a scan can be classified into — its Korean taxonomy names \
                   (`major_category`, `middle_category`, `items`) with their English names \
                   (`major_name_en`, `name_en`, `items_en`) and whether it is a separately \
                   collected recyclable stream — and the situation tags a classification may \
                   carry. The same for everyone: no authentication, and cacheable (`ETag`, \
                   `Cache-Control: public, max-age=300`; `If-None-Match` with the tag is \
                   answered 304).",
    params(
        ("If-None-Match" = Option<String>, Header,
            description = "An `ETag` this route gave: 304 while the taxonomy is the same."),
    ),
    responses(
        (status = 200, description = "The taxonomy.", body = proto::ListCategoriesResponse,
            headers(("ETag" = String, description = "Names these bytes."))),
        (status = 304, description = "Unchanged since the `ETag` sent in `If-None-Match`."),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
        (status = 504, response = GatewayTimeout),
    ),
)]
pub(crate) async fn categories(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let mut req = tonic::Request::new(ListCategoriesRequest {});
    req.set_timeout(UNARY_DEADLINE);
    let res = state
        .rule
        .clone()
        .list_categories(req)
        .await
        .map_err(|s| ApiError::upstream("rule", s))?
        .into_inner();
    let body = serde_json::to_vec(&res)
        .map_err(|e| ApiError::Internal(format!("the taxonomy does not serialize: {e}")))?;
    Ok(answer_public(
        &Finished::new(Bytes::from(body)),
        &headers,
        CATEGORIES_MAX_AGE,
    ))
}

/// `GET /api/v1/characters`: the catalogue, with the caller's ownership of each character.
#[utoipa::path(
    get,
    path = "/api/v1/characters",
    tag = "account",
    operation_id = "characterCatalogue",
    summary = "The character catalogue",
    description = "Every character a scan can earn — the default character first (`is_default`: \
                   what a recyclable item whose category has no character of its own earns), \
                   then one per recyclable category in the taxonomy's order — each with whether \
                   the caller owns it, since when and from which scan.",
    responses(
        (status = 200, description = "The catalogue.", body = proto::ListCatalogueResponse),
        CommonErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn characters(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    let res = state
        .reward
        .clone()
        .list_catalogue(crate::auth::request(
            ListCatalogueRequest {},
            UNARY_DEADLINE,
            &caller,
        ))
        .await
        .map_err(|s| ApiError::upstream("reward", s))?
        .into_inner();
    Ok(Json(res).into_response())
}

/// `GET /api/v1/characters/{name}`: one character and the caller's ownership of it.
#[utoipa::path(
    get,
    path = "/api/v1/characters/{name}",
    tag = "account",
    operation_id = "character",
    summary = "One character",
    description = "The character named by its code (`char-petty`), Korean name (`페티`) or \
                   English name (`Petty`, any case), and whether the caller owns it. \
                   (`/api/v1/characters/me` is the caller's collection, not a character.)",
    params(
        ("name" = String, Path, description = "A character's code, Korean or English name.",
            min_length = 1, max_length = 64),
    ),
    responses(
        (status = 200, description = "The character and the caller's ownership of it.",
            body = proto::GetCharacterResponse),
        (status = 404, response = NotFound),
        CommonErrors,
    ),
    security(("bearerAuth" = [])),
)]
pub(crate) async fn character(
    State(state): State<AppState>,
    caller: Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path(name) = path.map_err(|e| ApiError::InvalidArgument(e.body_text()))?;
    // The catalogue's names are short; a longer one names nothing and is not sent on.
    if name.trim().is_empty() || name.chars().count() > 64 {
        return Err(ApiError::invalid_field(
            "name",
            "name must be a character's code, Korean or English name (1-64 characters)",
        ));
    }
    let res = state
        .reward
        .clone()
        .get_character(crate::auth::request(
            GetCharacterRequest { name },
            UNARY_DEADLINE,
            &caller,
        ))
        .await
        .map_err(|s| ApiError::upstream("reward", s))?
        .into_inner();
    Ok(Json(res).into_response())
}
