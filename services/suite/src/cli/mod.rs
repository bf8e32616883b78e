//! `ecoscan scan|watch|characters|notifications`: a terminal client of the public REST/SSE API
//! (nothing else: it works against any gateway it can reach). Human output draws a progress bar
//! per stage and the answer as it streams; `--json` prints one JSON object per line for scripts.

use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use base64::Engine;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};

mod view;
pub use view::ScanView;

/// Reconnects of one `watch` after its connection dropped, before giving up.
const MAX_RECONNECTS: u32 = 10;

/// How the client reaches the gateway and says who it acts for.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    auth: Auth,
}

#[derive(Clone, Debug)]
pub enum Auth {
    /// `Authorization: Bearer …`.
    Bearer(String),
    /// `X-User-Id`, for a gateway in header mode (`GATEWAY_TRUST_USER_HEADER`).
    User(String),
}

/// How a command ended, for the exit status.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Ready,
    Failed,
}

/// An API error in words (the gateway's `{"code","message"}`, with the HTTP status).
fn api_error(status: reqwest::StatusCode, body: &str) -> anyhow::Error {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let (code, message) = parsed
        .as_ref()
        .map(|v| {
            (
                v["code"].as_str().unwrap_or_default().to_owned(),
                v["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .unwrap_or_default();
    if code.is_empty() && message.is_empty() {
        anyhow!("the gateway answered {status}: {}", body.trim())
    } else {
        anyhow!("the gateway answered {status} {code}: {message}")
    }
}

impl Client {
    pub fn new(gateway: &str, auth: Auth) -> anyhow::Result<Self> {
        let base = gateway.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("--gateway {gateway:?} must be an http:// or https:// URL");
        }
        Ok(Self {
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(10))
                .build()
                .context("failed to build the HTTP client")?,
            base,
            auth,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let req = self.http.request(method, format!("{}{path}", self.base));
        match &self.auth {
            Auth::Bearer(t) => req.bearer_auth(t),
            Auth::User(u) => req.header("x-user-id", u),
        }
    }

    async fn json(&self, req: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let res = req
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        let status = res.status();
        let body = res.text().await.context("the gateway's answer broke off")?;
        if !status.is_success() {
            return Err(api_error(status, &body));
        }
        serde_json::from_str(&body).context("the gateway's answer is not JSON")
    }

    /// Submits a photo; returns the job id.
    pub async fn submit(
        &self,
        image: &[u8],
        hint: Option<&str>,
        locale: Option<&str>,
    ) -> anyhow::Result<String> {
        let mut body = json!({
            "image_base64": base64::engine::general_purpose::STANDARD.encode(image),
        });
        if let Some(h) = hint {
            body["hint"] = json!(h);
        }
        if let Some(l) = locale {
            body["locale"] = json!(l);
        }
        let v = self
            .json(
                self.request(reqwest::Method::POST, "/api/v1/scan")
                    .json(&body),
            )
            .await?;
        v["job_id"]
            .as_str()
            .map(str::to_owned)
            .context("the gateway accepted the scan without a job id")
    }

    /// Follows a job's events to its end, reconnecting with `Last-Event-ID` when the
    /// connection drops; `on_event` sees each SSE event (name, data) once. After a `resync`
    /// (a gap the job's log cannot fill) it reads the job's result and hands it on as a
    /// `result` event, the state to take instead of the missed events'.
    pub async fn follow(
        &self,
        job_id: &str,
        mut on_event: impl FnMut(&str, &Value),
    ) -> anyhow::Result<Outcome> {
        let mut last_id: Option<String> = None;
        let mut reconnects = 0;
        loop {
            let mut req = self.request(
                reqwest::Method::GET,
                &format!("/api/v1/scan/{job_id}/events"),
            );
            if let Some(id) = &last_id {
                req = req.header("last-event-id", id);
            }
            let dropped = match req.send().await {
                // The job ended at the id this client has: its outcome is the stored one.
                Ok(res) if res.status() == reqwest::StatusCode::NO_CONTENT => {
                    let result = self.result(job_id).await?;
                    on_event("result", &result);
                    return Ok(if result["status"] == "succeeded" {
                        Outcome::Ready
                    } else {
                        Outcome::Failed
                    });
                }
                Ok(res) if res.status().is_success() => {
                    let mut events = res.bytes_stream().eventsource();
                    let mut broke = None;
                    while let Some(ev) = events.next().await {
                        let ev = match ev {
                            Ok(ev) => ev,
                            Err(e) => {
                                broke = Some(e.to_string());
                                break;
                            }
                        };
                        if !ev.id.is_empty() {
                            last_id = Some(ev.id.clone());
                        }
                        let data: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
                        on_event(&ev.event, &data);
                        match ev.event.as_str() {
                            "ready" => return Ok(Outcome::Ready),
                            "error" => return Ok(Outcome::Failed),
                            "resync" => match self.result(job_id).await {
                                Ok(result) => on_event("result", &result),
                                Err(e) => {
                                    tracing::warn!(error = %e, "cannot read the job's result after a resync")
                                }
                            },
                            _ => {}
                        }
                    }
                    broke.unwrap_or_else(|| "the stream ended before the scan did".into())
                }
                Ok(res) => {
                    let status = res.status();
                    let body = res.text().await.unwrap_or_default();
                    // 4xx will not get better by retrying; 5xx and 429 may.
                    if status.is_client_error() && status != reqwest::StatusCode::TOO_MANY_REQUESTS
                    {
                        return Err(api_error(status, &body));
                    }
                    api_error(status, &body).to_string()
                }
                Err(e) => format!("cannot reach the gateway at {}: {e}", self.base),
            };
            reconnects += 1;
            if reconnects > MAX_RECONNECTS {
                bail!("gave up after {MAX_RECONNECTS} reconnects: {dropped}");
            }
            tracing::debug!(%dropped, reconnects, "reconnecting with Last-Event-ID");
            tokio::time::sleep(Duration::from_millis(250 * u64::from(reconnects.min(8)))).await;
        }
    }

    /// The job's result (`GET /api/v1/scan/{id}`): its outputs so far, or all of them.
    pub async fn result(&self, job_id: &str) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, &format!("/api/v1/scan/{job_id}")))
            .await
    }

    pub async fn characters(&self) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, "/api/v1/characters/me"))
            .await
    }

    pub async fn notifications(&self, limit: u32) -> anyhow::Result<Value> {
        self.json(
            self.request(reqwest::Method::GET, "/api/v1/notifications")
                .query(&[("limit", limit)]),
        )
        .await
    }

    /// Prints the caller's notifications as they arrive, until the stream ends.
    pub async fn follow_notifications(
        &self,
        mut on_event: impl FnMut(&Value),
    ) -> anyhow::Result<()> {
        let res = self
            .request(reqwest::Method::GET, "/api/v1/notifications/stream")
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        if !res.status().is_success() {
            let status = res.status();
            return Err(api_error(status, &res.text().await.unwrap_or_default()));
        }
        let mut events = res.bytes_stream().eventsource();
        while let Some(ev) = events.next().await {
            let ev = ev.context("the notification stream broke off")?;
            if ev.event == "notification" {
                on_event(&serde_json::from_str(&ev.data).unwrap_or(Value::Null));
            }
        }
        Ok(())
    }
}

/// Prints the caller's characters (or the raw JSON).
pub fn print_characters(v: &Value, json: bool) {
    if json {
        println!("{v}");
        return;
    }
    let owned = v["characters"].as_array().cloned().unwrap_or_default();
    if owned.is_empty() {
        println!("no characters yet: scan something");
        return;
    }
    for o in owned {
        let c = &o["character"];
        println!(
            "{}\t{}\t{}\t{}",
            c["code"].as_str().unwrap_or("?"),
            c["name_en"].as_str().unwrap_or_default(),
            c["name_ko"].as_str().unwrap_or_default(),
            o["acquired_at"].as_str().unwrap_or_default()
        );
    }
}

/// Prints one notification (or its raw JSON).
pub fn print_notification(n: &Value, json: bool) {
    if json {
        println!("{n}");
        return;
    }
    println!(
        "{}\t{}\t{}\t{}",
        n["due_at"].as_str().unwrap_or_default(),
        n["status"].as_str().unwrap_or_default(),
        n["title"].as_str().unwrap_or_default(),
        n["body"].as_str().unwrap_or_default()
    );
}
