//! A scripted OpenAI-compatible model on loopback, for the stage processes run with
//! `LLM_PROVIDER=openai`: `POST /v1/chat/completions` answers the vision call with a
//! JSON-schema reply (one path of the taxonomy the request lists) and streams the answer as
//! chat-completion chunks, cutting the connection mid-answer on the calls its seeded script
//! picks, the way a provider's stream breaks.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use super::Rng;

/// The answer, as the pieces the model streams (one chunk each).
pub const ANSWER_PIECES: [&str; 7] = [
    "Rinse it. ",
    "Remove the label. ",
    "Flatten it ",
    "and close the cap. ",
    "Put it in ",
    "the right bin. ",
    "Thank you!",
];
/// The wait before each answer chunk: an answer takes about a second and a half to stream.
const PIECE_EVERY: Duration = Duration::from_millis(200);
/// How long the vision call takes.
const CLASSIFY_TAKES: Duration = Duration::from_millis(250);

/// What the model did, for the summary.
#[derive(Default)]
pub struct Calls {
    pub classify: AtomicUsize,
    pub answer: AtomicUsize,
    /// Answer streams cut mid-answer.
    pub cut: AtomicUsize,
}

struct Script {
    rng: Mutex<Rng>,
    /// Whether the previous answer call was cut: never two in a row, so a retried stage
    /// usually gets through.
    last_cut: Mutex<bool>,
    /// The first answer call, and then one in `cut_one_in`, is cut (0: none).
    cut_one_in: u64,
    calls: Arc<Calls>,
}

/// The running server; stops with the test's runtime.
pub struct ScriptedModel {
    pub addr: SocketAddr,
    pub calls: Arc<Calls>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedModel {
    pub async fn start(seed: u64, cut_one_in: u64) -> Self {
        let calls = Arc::new(Calls::default());
        let script = Arc::new(Script {
            rng: Mutex::new(Rng(seed ^ 0x6d6f_6465_6c00)),
            last_cut: Mutex::new(false),
            cut_one_in,
            calls: calls.clone(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(completions))
            .with_state(script);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the scripted model");
        let addr = listener.local_addr().expect("its address");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, calls, task }
    }

    /// `LLM_BASE_URL` for the stage processes.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

async fn completions(State(script): State<Arc<Script>>, Json(body): Json<Value>) -> Response {
    if body["stream"] == true {
        answer(&script)
    } else {
        script.calls.classify.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(CLASSIFY_TAKES).await;
        classify(&body)
    }
}

/// The vision reply: the request's first taxonomy path that the person's hint names (else the
/// first path), as the JSON its `response_format` schema asks for.
fn classify(body: &Value) -> Response {
    let text = body["messages"][1]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    let hint = text
        .lines()
        .find_map(|l| l.strip_prefix("Hint from the person: "))
        .unwrap_or_default()
        .to_lowercase();
    // "- major: M | middle: D | minor: N | (english name)"
    let paths: Vec<(String, String, String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("- major: "))
        .filter_map(|l| {
            let mut parts = l.split(" | ");
            let major = parts.next()?.to_owned();
            let middle = parts.next()?.strip_prefix("middle: ")?.to_owned();
            let minor = parts.next()?.strip_prefix("minor: ")?.to_owned();
            let name = parts.next().unwrap_or_default().to_lowercase();
            Some((major, middle, minor, name))
        })
        .collect();
    let Some(path) = paths
        .iter()
        .find(|(_, _, _, name)| {
            hint.split_whitespace()
                .any(|w| w.len() > 2 && name.contains(w))
        })
        .or(paths.first())
    else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": "no taxonomy in the request"}})),
        )
            .into_response();
    };
    let content = json!({
        "major": path.0,
        "middle": path.1,
        "minor": path.2,
        "item_name": "scripted item",
        "confidence": 0.9,
        "situation_tags": [],
    });
    Json(json!({
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "model": "scripted-vision",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content.to_string()},
            "finish_reason": "stop",
        }],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
    }))
    .into_response()
}

/// The streamed answer: a chunk per piece, the usage, `[DONE]`; or, on a cut call, a few
/// pieces and then the connection breaks (the body fails mid-stream, so the client sees the
/// transfer end without its terminating chunk).
fn answer(script: &Script) -> Response {
    let call = script.calls.answer.fetch_add(1, Ordering::Relaxed);
    let cut_after = {
        let mut last_cut = script.last_cut.lock().expect("script lock");
        let mut rng = script.rng.lock().expect("script lock");
        // The first answer call is always cut, so every run has a retried answer stage;
        // after it, one in `cut_one_in`.
        let first = call == 0;
        let cut = script.cut_one_in > 0
            && !*last_cut
            && (first || rng.draw().is_multiple_of(script.cut_one_in));
        *last_cut = cut;
        cut.then(|| 1 + (rng.draw() % (ANSWER_PIECES.len() as u64 - 2)) as usize)
    };
    if cut_after.is_some() {
        script.calls.cut.fetch_add(1, Ordering::Relaxed);
    }
    let chunk = |content: &str| {
        let c = json!({
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "model": "scripted-answer",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}],
        });
        Bytes::from(format!("data: {c}\n\n"))
    };
    let mut frames: Vec<Result<Bytes, std::io::Error>> = Vec::new();
    for (i, piece) in ANSWER_PIECES.iter().enumerate() {
        if cut_after == Some(i) {
            frames.push(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "scripted cut mid-answer",
            )));
            break;
        }
        frames.push(Ok(chunk(piece)));
    }
    if cut_after.is_none() {
        let usage = json!({
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "model": "scripted-answer",
            "choices": [],
            "usage": {"prompt_tokens": 200, "completion_tokens": 40},
        });
        frames.push(Ok(Bytes::from(format!("data: {usage}\n\n"))));
        frames.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    }
    let stream = futures::stream::unfold(frames.into_iter(), |mut frames| async move {
        let frame = frames.next()?;
        tokio::time::sleep(PIECE_EVERY).await;
        Some((frame, frames))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("a response")
}
