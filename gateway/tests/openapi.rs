//! The OpenAPI document a running gateway serves at `/api/v1/openapi.json`, held to the routes
//! the gateway serves ([`ecoscan_gateway::ROUTES`]), its credentials and its SSE events.

mod support;

use std::{collections::BTreeSet, time::Duration};

use ecoscan_gateway::{AuthConfig, Config, ROUTES, TrustHeader};
use reqwest::StatusCode;
use serde_json::Value;
use support::*;

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// The routes anyone may call, without credentials.
const PUBLIC: [&str; 4] = [
    "/",
    "/healthz",
    "/api/v1/openapi.json",
    "/api/v1/scan/categories",
];

/// The gateway's upload URL (embedded store): its token in `?token=` is its only credential, no
/// bearer token (an app hands the URL to whatever sends the bytes, as a presigned S3 URL).
const UPLOAD_URL: &str = "/api/v1/uploads/{id}";

/// The SSE routes, which also take a ticket in `?ticket=` or the token in a cookie.
const SSE: [&str; 2] = ["/api/v1/scan/{id}/events", "/api/v1/notifications/stream"];

async fn document(env: &Env) -> Value {
    let res = env
        .http
        .get(env.url("/api/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/json");
    serde_json::from_str(&res.text().await.unwrap()).expect("the document is JSON")
}

/// `(METHOD, path)` of every operation in `doc`.
fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths is an object") {
        for method in METHODS {
            if let Some(op) = item.get(method) {
                out.push((method.to_uppercase(), path.clone(), op));
            }
        }
    }
    out
}

/// The document at a local `$ref` (`#/components/schemas/Name`), if there is one.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    doc.pointer(pointer)
}

fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                out.push(r);
            }
            map.values().for_each(|v| refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// The names of the security schemes each requirement of `op` lists (`[]` for "none needed").
fn security(op: &Value) -> Vec<BTreeSet<String>> {
    op.get("security")
        .and_then(Value::as_array)
        .map(|reqs| {
            reqs.iter()
                .map(|r| r.as_object().unwrap().keys().cloned().collect())
                .collect()
        })
        .unwrap_or_default()
}

/// The `event:` names a `text/event-stream` 200 response documents, and the schema of each
/// event's `data`.
fn sse_events<'a>(doc: &'a Value, op: &'a Value) -> Vec<(String, &'a Value)> {
    let mut response = &op["responses"]["200"];
    if let Some(r) = response.get("$ref").and_then(Value::as_str) {
        response = resolve(doc, r).expect("the response reference resolves");
    }
    let schema = &response["content"]["text/event-stream"]["schema"];
    let events = schema["oneOf"]
        .as_array()
        .expect("an event stream's schema is one of its events");
    events
        .iter()
        .map(|event| {
            let names = event["properties"]["event"]["enum"].as_array().unwrap();
            assert_eq!(names.len(), 1, "one name per event schema: {event}");
            assert_eq!(event["required"], serde_json::json!(["event", "data"]));
            let data = &event["properties"]["data"];
            assert_eq!(data["type"], "string", "`data:` is a line of text");
            assert_eq!(data["contentMediaType"], "application/json");
            (
                names[0].as_str().unwrap().to_owned(),
                &data["contentSchema"],
            )
        })
        .collect()
}

#[tokio::test]
async fn the_document_is_openapi_3_1_and_describes_exactly_the_gateways_routes() {
    let env = start().await;

    let doc = document(&env).await;

    let version = doc["openapi"].as_str().unwrap();
    assert!(version.starts_with("3.1."), "openapi is {version}");
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    let documented: BTreeSet<(String, String)> = operations(&doc)
        .into_iter()
        .map(|(m, p, _)| (m, p))
        .collect();
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(documented, served);
    let mut ids = BTreeSet::new();
    for (method, path, op) in operations(&doc) {
        let id = op["operationId"].as_str().unwrap_or_default();
        assert!(
            ids.insert(id.to_owned()),
            "{method} {path}: operationId {id:?} is not unique"
        );
        assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()));
    }
}

#[tokio::test]
async fn every_route_the_document_lists_is_served() {
    let env = start().await;
    let job = "0193a5b0-0000-7000-8000-000000000000";

    for (method, path) in ROUTES {
        let url = env.url(&path.replace("{id}", job));
        let req = match *method {
            "GET" => env.http.get(&url),
            "POST" => env.http.post(&url),
            "PUT" => env.http.put(&url),
            other => panic!("no test request for {other}"),
        };
        let res = tokio::time::timeout(Duration::from_secs(5), req.send())
            .await
            .unwrap_or_else(|_| panic!("{method} {path} answered within 5 s"))
            .unwrap();

        let status = res.status();
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        if status == StatusCode::NOT_FOUND {
            let body = res.text().await.unwrap();
            assert!(
                !body.contains("no route"),
                "{method} {path} is not routed: {body}"
            );
        }
    }
}

#[tokio::test]
async fn every_reference_in_the_document_resolves() {
    let env = start().await;

    let doc = document(&env).await;

    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(!found.is_empty());
    for r in found {
        assert!(resolve(&doc, r).is_some(), "dangling $ref {r}");
    }
}

#[tokio::test]
async fn the_bearer_scheme_is_documented_and_every_non_public_operation_takes_it() {
    let env = start().await;

    let doc = document(&env).await;

    let bearer = &doc["components"]["securitySchemes"]["bearerAuth"];
    assert_eq!(bearer["type"], "http");
    assert_eq!(bearer["scheme"], "bearer");
    assert_eq!(bearer["bearerFormat"], "JWT");
    for (method, path, op) in operations(&doc) {
        let security = security(op);
        if PUBLIC.contains(&path.as_str()) {
            assert!(
                security.is_empty(),
                "{method} {path} is public: {security:?}"
            );
            continue;
        }
        if path == UPLOAD_URL {
            let token = BTreeSet::from(["uploadToken".to_owned()]);
            assert_eq!(security, vec![token], "{method} {path}: its token alone");
            let unauthorized = &op["responses"]["401"]["$ref"];
            assert_eq!(unauthorized, "#/components/responses/Unauthorized");
            continue;
        }
        let alone = BTreeSet::from(["bearerAuth".to_owned()]);
        assert!(security.contains(&alone), "{method} {path}: {security:?}");
        let in_query = BTreeSet::from(["sseTicket".to_owned()]);
        let in_cookie = BTreeSet::from(["tokenCookie".to_owned()]);
        let sse = SSE.contains(&path.as_str());
        assert_eq!(security.contains(&in_query), sse, "{method} {path}");
        assert_eq!(security.contains(&in_cookie), sse, "{method} {path}");
        // A refused token is a documented 401, with the error body.
        let unauthorized = &op["responses"]["401"]["$ref"];
        assert_eq!(unauthorized, "#/components/responses/Unauthorized");
    }
    let usage = doc["paths"]["/api/v1/analytics/usage"]["get"]["security"].clone();
    assert!(
        usage
            .as_array()
            .unwrap()
            .contains(&serde_json::json!({"bearerAuth": ["admin"]})),
        "usage needs the admin role: {usage}"
    );
    let unauthorized = &doc["components"]["responses"]["Unauthorized"];
    assert!(unauthorized["headers"]["WWW-Authenticate"].is_object());
    assert_eq!(
        unauthorized["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/ErrorBody"
    );
}

#[tokio::test]
async fn the_trusted_header_is_documented_only_where_the_gateway_believes_it() {
    let loopback = start().await;
    let tokens_only = start_with(|c| Config {
        auth: AuthConfig {
            hs256_secret: Some("a-test-secret-that-is-long-enough-0123456789".into()),
            trust_header: TrustHeader::Off,
            ..AuthConfig::default()
        },
        ..c
    })
    .await;

    let trusting = document(&loopback).await;
    let strict = document(&tokens_only).await;

    let schemes = |doc: &Value| -> BTreeSet<String> {
        doc["components"]["securitySchemes"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    assert!(schemes(&trusting).contains("userHeader"));
    assert!(!schemes(&strict).contains("userHeader"));
    assert!(!schemes(&strict).contains("rolesHeader"));
    // Header mode `loopback` never takes roles from a header.
    assert!(!schemes(&trusting).contains("rolesHeader"));
    let characters = |doc: &Value| security(&doc["paths"]["/api/v1/characters/me"]["get"]);
    let header = BTreeSet::from(["userHeader".to_owned()]);
    assert!(characters(&trusting).contains(&header));
    assert!(!characters(&strict).contains(&header));
    // There is no anonymous caller anywhere.
    assert!(!characters(&trusting).contains(&BTreeSet::new()));
    assert!(!characters(&strict).contains(&BTreeSet::new()));
}

#[tokio::test]
async fn the_sse_routes_document_their_event_types() {
    let env = start().await;

    let doc = document(&env).await;

    let scan_events = ["delta", "error", "ready", "resync", "stage"];
    for (method, path) in [
        ("post", "/api/v1/scan/completion"),
        ("get", "/api/v1/scan/{id}/events"),
    ] {
        let events = sse_events(&doc, &doc["paths"][path][method]);
        let names: BTreeSet<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, BTreeSet::from(scan_events), "{method} {path}");
        for (name, data) in &events {
            let mut found = Vec::new();
            refs(data, &mut found);
            let schema = if name == "resync" {
                "#/components/schemas/ResyncData"
            } else {
                "#/components/schemas/ScanEventData"
            };
            assert!(
                found.contains(&schema),
                "{path}: `{name}` data is a {schema}: {data}"
            );
        }
    }
    let resync = &doc["components"]["schemas"]["ResyncData"];
    for field in ["job_id", "event_id", "seq", "reason", "result_url"] {
        assert!(
            resync["required"]
                .as_array()
                .unwrap()
                .contains(&Value::from(field)),
            "ResyncData.{field} is always sent"
        );
    }
    let statuses = &doc["components"]["schemas"]["ScanEventData"]["properties"]["status"]["enum"];
    assert!(
        statuses
            .as_array()
            .unwrap()
            .contains(&Value::from("restarted")),
        "{statuses}"
    );
    let stream = &doc["paths"]["/api/v1/notifications/stream"]["get"];
    let events = sse_events(&doc, stream);
    let names: BTreeSet<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, BTreeSet::from(["error", "notification"]));
    let notification = &events.iter().find(|(n, _)| n == "notification").unwrap().1;
    assert_eq!(notification["$ref"], "#/components/schemas/Notification");
    let data = &doc["components"]["schemas"]["ScanEventData"];
    for field in ["event_id", "job_id", "seq", "stage", "status", "progress"] {
        assert!(
            data["required"]
                .as_array()
                .unwrap()
                .contains(&Value::from(field)),
            "ScanEventData.{field} is always sent"
        );
    }
}

#[tokio::test]
async fn a_streamed_scan_sends_only_documented_events_with_documented_fields() {
    let env = start().await;
    let doc = document(&env).await;
    let documented: BTreeSet<String> =
        sse_events(&doc, &doc["paths"]["/api/v1/scan/completion"]["post"])
            .into_iter()
            .map(|(n, _)| n)
            .collect();
    let properties = doc["components"]["schemas"]["ScanEventData"]["properties"]
        .as_object()
        .unwrap()
        .clone();
    let (content_type, body) = multipart(&[("image", Some("a.png"), &png(32))]);

    let res = env
        .http
        .post(env.url("/api/v1/scan/completion"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let text = tokio::time::timeout(Duration::from_secs(10), res.text())
        .await
        .expect("the stream ended")
        .unwrap();

    let events = parse_sse(&text);
    assert!(events.iter().any(|e| e.name() == "ready"));
    for event in &events {
        assert!(
            documented.contains(event.name()),
            "undocumented event {event:?}"
        );
        for field in event.json().as_object().unwrap().keys() {
            assert!(
                properties.contains_key(field),
                "undocumented field {field} in {event:?}"
            );
        }
    }
}
