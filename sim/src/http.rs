//! The HTTP surface of one pod, shaped like vLLM's OpenAI-compatible server:
//! `POST /v1/chat/completions` and `POST /v1/completions` (SSE streaming in vLLM's chunk format
//! ending with `data: [DONE]`, or one JSON body with `usage`), `POST /v1/messages` (Anthropic's
//! Messages API, which vLLM serves beside them: its message object, its named SSE events, its
//! error shape; and `POST /v1/messages/count_tokens`), `GET /v1/models` (base model and LoRA adapters with `root`/`parent`),
//! `POST /v1/audio/transcriptions` and `/v1/audio/translations` (a `multipart/form-data` upload,
//! as vLLM serves Whisper models there), `GET /health`, `GET /version` and `GET /metrics`.
//! Every response carries `x-served-by` and `x-served-by-address`. The failure modes `hang` and
//! `error` are applied here; `down` is applied by the listener ([`crate::server`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Multipart, RawQuery, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::engine::{FinishReason, NewRequest, Output};
use crate::lora::AdapterId;
use crate::pod::{Mode, Pod, RequestGuard};
use crate::text;

/// Largest request body accepted (vLLM has no small limit; long-context prompts are large).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// vLLM version the surface imitates (reported by `/version`).
const VLLM_VERSION: &str = "0.11.0";

/// The router of one pod.
pub fn router(pod: Arc<Pod>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/v1/audio/translations", post(transcriptions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&pod),
            failure_mode,
        ))
        .layer(middleware::from_fn_with_state(Arc::clone(&pod), served_by))
        .with_state(pod)
}

async fn served_by(State(pod): State<Arc<Pod>>, req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&pod.cfg.name) {
        h.insert("x-served-by", v);
    }
    if let Ok(v) = HeaderValue::from_str(&pod.addr.to_string()) {
        h.insert("x-served-by-address", v);
    }
    res
}

async fn failure_mode(State(pod): State<Arc<Pod>>, req: Request, next: Next) -> Response {
    match pod.mode() {
        Mode::Ok => next.run(req).await,
        Mode::Error => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "simulated failure (fleet-sim mode=error)",
        ),
        // never answer; the connection is dropped by the client or by mode=down
        Mode::Hang | Mode::Down => std::future::pending().await,
    }
}

/// An error in vLLM's format (`ErrorResponse` with a nested `error` object, vLLM >= 0.10.2).
pub fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    // field order as vLLM's pydantic ErrorInfo: message, type, param, code
    let message = serde_json::to_string(message).unwrap_or_else(|_| "\"\"".to_string());
    let kind = serde_json::to_string(kind).unwrap_or_else(|_| "\"\"".to_string());
    let body = format!(
        r#"{{"error":{{"message":{message},"type":{kind},"param":null,"code":{}}}}}"#,
        status.as_u16()
    );
    json_response(status, body)
}

fn json_response(status: StatusCode, body: String) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

fn bad_request(message: &str) -> Response {
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// An error in the request's API's shape: vLLM's own for the OpenAI paths; for the Messages API
/// Anthropic's (`{"type":"error","error":{"type","message"}}`), as vLLM translates it there.
fn api_error(api: Api, status: StatusCode, kind: &str, message: &str) -> Response {
    if api != Api::Messages {
        return error_response(status, kind, message);
    }
    let kind = match status.as_u16() {
        404 => "not_found_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    let body = serde_json::json!({"type": "error", "error": {"type": kind, "message": message}});
    json_response(status, body.to_string())
}

async fn not_found() -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        r#"{"detail":"Not Found"}"#.to_string(),
    )
}

async fn health() -> Response {
    StatusCode::OK.into_response()
}

async fn version() -> Response {
    json_response(StatusCode::OK, format!(r#"{{"version":"{VLLM_VERSION}"}}"#))
}

async fn metrics(State(pod): State<Arc<Pod>>, RawQuery(query): RawQuery) -> Response {
    let page = crate::render::render(&pod);
    // `?name[]=...` (repeated): only those samples, as prometheus_client serves vLLM's; SGLang
    // serves a multiprocess registry, which cannot restrict and answers none.
    let names = crate::metrics::names_asked(query.as_deref());
    let body = match (names.is_empty(), pod.cfg.engine.kind) {
        (true, _) => page,
        (false, crate::engine::EngineKind::Vllm) => crate::metrics::restrict(&page, &names),
        (false, crate::engine::EngineKind::Sglang) => String::new(),
    };
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(State(pod): State<Arc<Pod>>) -> Response {
    let created = unix_now();
    let owned_by = match pod.cfg.engine.kind {
        crate::engine::EngineKind::Vllm => "vllm",
        crate::engine::EngineKind::Sglang => "sglang",
    };
    let perm = |i: usize| {
        serde_json::json!({
            "id": format!("modelperm-{}-{i}", pod.cfg.name), "object": "model_permission",
            "created": created, "allow_create_engine": false, "allow_sampling": true,
            "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
            "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false
        })
    };
    let mut data = vec![serde_json::json!({
        "id": pod.cfg.model, "object": "model", "created": created, "owned_by": owned_by,
        "root": pod.cfg.model, "parent": null, "max_model_len": pod.max_model_len(),
        "permission": [perm(0)]
    })];
    for (i, a) in pod.cfg.adapters.iter().enumerate() {
        data.push(serde_json::json!({
            "id": a, "object": "model", "created": created, "owned_by": owned_by,
            "root": format!("/adapters/{a}"), "parent": pod.cfg.model, "max_model_len": null,
            "permission": [perm(i + 1)]
        }));
    }
    json_response(
        StatusCode::OK,
        serde_json::json!({"object": "list", "data": data}).to_string(),
    )
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// Anthropic's Messages API: the system prompt is a top-level string or list of text blocks, and
/// `max_tokens` is required.
#[derive(Debug, Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    system: Option<Value>,
    messages: Vec<ChatMessage>,
    max_tokens: i64,
    #[serde(default)]
    stream: Option<bool>,
}

/// `count_tokens`: a Messages body without generation parameters.
#[derive(Debug, Deserialize)]
struct CountTokensRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    system: Option<Value>,
    messages: Vec<ChatMessage>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// Chat, text completion or Anthropic message: decides the JSON shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Messages,
}

/// What the response writer needs to know about a request.
#[derive(Debug)]
struct Meta {
    api: Api,
    /// `{"id":...,"object":...,"created":...,"model":...,` (chunk or body prefix); for the
    /// Messages API the message object's `"id":...,"type":"message","role":...,"model":...`.
    head: String,
    /// All the prompts' tokens.
    prompt_tokens: u32,
    /// Choices per prompt (`n`): engine request `k` is prompt `k / choices`'s.
    choices: usize,
    include_usage: bool,
}

impl Meta {
    /// Prompt tokens read from the prefix cache: each prompt's first choice's count (the later
    /// choices reuse what the first computed), summed over the prompts.
    fn cached_tokens(&self, per_request: impl Iterator<Item = u32>) -> u32 {
        per_request.step_by(self.choices.max(1)).sum()
    }
}

fn message_text(content: &Option<Value>, out: &mut String) {
    match content {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    out.push_str(t);
                }
            }
        }
        _ => {}
    }
}

/// A request body of type `T`, or vLLM's 400 for it in `api`'s shape (boxed: a `Response` is
/// large).
fn parse_body<T: DeserializeOwned>(api: Api, what: &str, body: &[u8]) -> Result<T, Box<Response>> {
    serde_json::from_slice(body).map_err(|e| {
        let message = format!("invalid {what} request: {e}");
        Box::new(api_error(
            api,
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            &message,
        ))
    })
}

/// A request body that names a model (or none).
trait NamesModel {
    fn model(&self) -> Option<&str>;
}

/// The body of a request that needs no engine (`what`), naming this pod's model or one of its
/// adapters, or none: else vLLM's 400 or 404 in `api`'s shape.
fn no_engine_request<T: DeserializeOwned + NamesModel>(
    pod: &Pod,
    api: Api,
    what: &str,
    body: &[u8],
) -> Result<T, Box<Response>> {
    let req: T = parse_body(api, what, body)?;
    if let Some(m) = req.model() {
        resolve_model(pod, api, m)?;
    }
    Ok(req)
}

/// The adapter `model` names on this pod (`None` for its base model), or vLLM's 404 in `api`'s
/// shape.
fn resolve_model(pod: &Pod, api: Api, model: &str) -> Result<Option<AdapterId>, Box<Response>> {
    if model == pod.cfg.model {
        return Ok(None);
    }
    pod.adapter_id(model).map(Some).ok_or_else(|| {
        let message = format!("The model `{model}` does not exist.");
        Box::new(api_error(
            api,
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &message,
        ))
    })
}

async fn chat_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: ChatRequest = match parse_body(Api::Chat, "chat completion", &body) {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let mut prompt = String::new();
    for m in &req.messages {
        message_text(&m.content, &mut prompt);
    }
    let max = req.max_completion_tokens.or(req.max_tokens);
    let stream = req.stream.unwrap_or(false);
    let usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let ask = Ask {
        max_tokens: max,
        n: req.n,
        stream,
        include_usage: usage,
    };
    serve(pod, Api::Chat, req.model, vec![prompt], ask).await
}

async fn messages(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: MessagesRequest = match parse_body(Api::Messages, "messages", &body) {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let prompt = messages_prompt(&req.system, &req.messages);
    let stream = req.stream.unwrap_or(false);
    let ask = Ask {
        max_tokens: Some(req.max_tokens),
        n: None,
        stream,
        include_usage: false,
    };
    serve(pod, Api::Messages, req.model, vec![prompt], ask).await
}

/// A Messages API prompt: the same text as the conversation in chat, system prompt first (one
/// chat template serves both APIs).
fn messages_prompt(system: &Option<Value>, messages: &[ChatMessage]) -> String {
    let mut prompt = String::new();
    message_text(system, &mut prompt);
    for m in messages {
        message_text(&m.content, &mut prompt);
    }
    prompt
}

/// vLLM's `/tokenize`: a completion's `prompt` or a chat's `messages`.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
}

/// vLLM's `/detokenize`.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<i64>,
}

impl NamesModel for TokenizeRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl NamesModel for DetokenizeRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl NamesModel for CountTokensRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// Ids in a vocabulary of Llama 3's size.
const VOCAB: u64 = 128_256;

/// `POST /tokenize`: `{"count","max_model_len","tokens","token_strs"}` as vLLM answers, the
/// prompt counted as the engine counts it (4 bytes a token); each id a hash of its 4 bytes. No
/// engine work (vLLM tokenizes in its API server).
async fn tokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: TokenizeRequest = match no_engine_request(&pod, Api::Completion, "tokenize", &body) {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let text = match (req.prompt, req.messages) {
        (Some(p), _) => p,
        (None, Some(messages)) => messages_prompt(&None, &messages),
        (None, None) => return bad_request("either `prompt` or `messages` is required"),
    };
    let count = text::prompt_tokens(&text);
    let bytes = text.as_bytes();
    let ids: Vec<String> = (0..count as usize)
        .map(|i| {
            let chunk = bytes
                .get(i * 4..(i * 4 + 4).min(bytes.len()))
                .unwrap_or_default();
            (xxhash_rust::xxh64::xxh64(chunk, 0) % VOCAB).to_string()
        })
        .collect();
    json_response(
        StatusCode::OK,
        format!(
            r#"{{"count":{count},"max_model_len":{},"tokens":[{}],"token_strs":null}}"#,
            pod.max_model_len(),
            ids.join(",")
        ),
    )
}

/// `POST /detokenize`: `{"prompt"}`, one filler word a token (as generated text is).
async fn detokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: DetokenizeRequest = match no_engine_request(&pod, Api::Completion, "detokenize", &body)
    {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let count = u32::try_from(req.tokens.len()).unwrap_or(u32::MAX);
    let prompt = serde_json::to_string(&text::filler(0, count)).unwrap_or_default();
    json_response(StatusCode::OK, format!(r#"{{"prompt":{prompt}}}"#))
}

/// `{"input_tokens": N}`, the prompt's tokens as a Messages request would count them; no engine
/// work (vLLM answers it from the tokenizer).
async fn count_tokens(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: CountTokensRequest =
        match no_engine_request(&pod, Api::Messages, "count_tokens", &body) {
            Ok(r) => r,
            Err(answer) => return *answer,
        };
    let tokens = text::prompt_tokens(&messages_prompt(&req.system, &req.messages));
    json_response(StatusCode::OK, format!(r#"{{"input_tokens":{tokens}}}"#))
}

/// Audio a simulated upload holds per byte: 16 kHz, 16-bit mono PCM (a WAV file), the rate
/// Whisper models take their input at.
const AUDIO_BYTES_PER_SECOND: f64 = 32_000.0;
/// Whisper's encoder reads audio in 30-second windows of 1,500 frames; the simulation counts the
/// frames as prompt tokens (they are computed and attended to as a prompt's are).
const FRAMES_PER_WINDOW: u32 = 1_500;
const WINDOW_SECONDS: f64 = 30.0;
/// Text tokens per second of speech: ~150 words a minute at ~1.3 tokens a word.
const TEXT_TOKENS_PER_SECOND: f64 = 3.25;

/// `POST /v1/audio/transcriptions` (and `translations`): the form's `model` and `file`; the
/// engine runs the audio's frames as a prompt and its text as output, and the answer is OpenAI's
/// JSON transcription (`text`, and `usage` by duration). Streamed answers are not simulated.
async fn transcriptions(State(pod): State<Arc<Pod>>, mut form: Multipart) -> Response {
    let mut model = None;
    let mut audio_bytes = None;
    let mut stream = false;
    loop {
        let field = match form.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return bad_request(&format!("malformed multipart body: {e}")),
        };
        let name = field.name().unwrap_or_default().to_string();
        let is_file = field.file_name().is_some();
        let data = match field.bytes().await {
            Ok(d) => d,
            Err(e) => return bad_request(&format!("malformed multipart body: {e}")),
        };
        match name.as_str() {
            "file" if is_file => audio_bytes = Some(data.len()),
            "model" => model = Some(String::from_utf8_lossy(&data).into_owned()),
            "stream" => stream = matches!(&data[..], b"true" | b"True" | b"1"),
            _ => {}
        }
    }
    let Some(audio_bytes) = audio_bytes else {
        return bad_request("the form has no `file`");
    };
    if stream {
        return bad_request("fleet-sim does not simulate streamed transcriptions");
    }
    let model = model.unwrap_or_else(|| pod.cfg.model.clone());
    if model != pod.cfg.model {
        let message = format!("The model `{model}` does not exist.");
        return error_response(StatusCode::NOT_FOUND, "NotFoundError", &message);
    }
    let seconds = (audio_bytes as f64 / AUDIO_BYTES_PER_SECOND).max(1.0);
    let windows = (seconds / WINDOW_SECONDS).ceil() as u32;
    let (rx, mut guard) = pod.submit(NewRequest {
        prompt_tokens: windows.max(1) * FRAMES_PER_WINDOW,
        output_tokens: ((seconds * TEXT_TOKENS_PER_SECOND).round() as u32).max(1),
        finish: FinishReason::Stop,
        block_hashes: Vec::new(),
        adapter: None,
        stream: false,
    });
    let Some(Finished { generated, .. }) = finish(rx).await else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "the engine stopped before the request finished",
        );
    };
    guard.finish();
    let text = serde_json::to_string(&text::filler(0, generated)).unwrap_or_default();
    json_response(
        StatusCode::OK,
        format!(
            r#"{{"text":{text},"usage":{{"type":"duration","seconds":{}}}}}"#,
            seconds.ceil()
        ),
    )
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: CompletionRequest = match parse_body(Api::Completion, "completion", &body) {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let prompts = match completion_prompts(&req.prompt) {
        Ok(prompts) => prompts,
        Err(message) => return bad_request(&message),
    };
    let stream = req.stream.unwrap_or(false);
    let usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let ask = Ask {
        max_tokens: req.max_tokens,
        n: req.n,
        stream,
        include_usage: usage,
    };
    serve(pod, Api::Completion, req.model, prompts, ask).await
}

/// The most prompts one completions request may list.
const MAX_PROMPTS: usize = 1024;

/// A completions request's prompts: a string, a list of token ids, or a batch (a list of
/// strings, or of token-id lists), each of which vLLM runs as a request of its own. A token-id
/// prompt keeps one "token" (4 bytes of text) per id, so counts match.
fn completion_prompts(prompt: &Value) -> Result<Vec<String>, String> {
    fn token_ids(items: &[Value]) -> Option<String> {
        items
            .iter()
            .map(|v| v.as_u64().map(|id| format!("{:<4}", id % 10_000)))
            .collect()
    }
    let prompts = match prompt {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) if items.iter().all(Value::is_number) => {
            token_ids(items).map(|p| vec![p])
        }
        Value::Array(items) if items.iter().all(Value::is_string) => Some(
            items
                .iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect(),
        ),
        Value::Array(items) => items
            .iter()
            .map(|v| match v.as_array() {
                Some(ids) if !ids.is_empty() => token_ids(ids),
                _ => None,
            })
            .collect(),
        _ => None,
    };
    match prompts {
        Some(p) if p.len() > MAX_PROMPTS => Err(format!(
            "fleet-sim takes at most {MAX_PROMPTS} prompts a request, got {}.",
            p.len()
        )),
        Some(p) => Ok(p),
        None => Err(
            "prompt must be a string, a list of token ids, or a non-empty list of \
                     either (a batch)"
                .to_string(),
        ),
    }
}

/// What a generation request asks for besides its model and prompt.
struct Ask {
    max_tokens: Option<i64>,
    /// Choices to generate (`n`; 1 when absent).
    n: Option<i64>,
    stream: bool,
    include_usage: bool,
}

/// The most choices (`n`) fleet-sim generates for one request.
const MAX_CHOICES: i64 = 256;

/// The most engine requests one generation request may start (its prompts times `n`).
const MAX_SEQUENCES: usize = 4096;

/// Runs a generation request. A request for `n` choices runs as `n` requests of the engine, as
/// vLLM's v1 engine runs them (a parent request and its children, each in the running and
/// waiting gauges), sharing the prompt's cached blocks once the first has them. A batch of
/// prompts (completions) runs each prompt so; its choices are listed prompt by prompt, prompt
/// `p`'s choice `i` at index `p * n + i`, as vLLM lists them.
async fn serve(
    pod: Arc<Pod>,
    api: Api,
    model: Option<String>,
    prompts: Vec<String>,
    ask: Ask,
) -> Response {
    let Ask {
        max_tokens,
        n: choices,
        stream,
        include_usage,
    } = ask;
    let choices = match choices {
        None => 1,
        Some(c) if c < 1 => {
            let message = format!("n must be at least 1, got {c}.");
            return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", &message);
        }
        Some(c) if c > MAX_CHOICES => {
            let message = format!(
                "fleet-sim generates at most {MAX_CHOICES} choices a request, got n = {c}."
            );
            return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", &message);
        }
        Some(c) => c as usize,
    };
    if prompts.len().saturating_mul(choices) > MAX_SEQUENCES {
        let message = format!(
            "fleet-sim runs at most {MAX_SEQUENCES} sequences a request, got {} prompts with \
             n = {choices}.",
            prompts.len()
        );
        return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", &message);
    }
    let n = pod.next_request_number();
    let model = model.unwrap_or_else(|| pod.cfg.model.clone());
    let adapter = match resolve_model(&pod, api, &model) {
        Ok(adapter) => adapter,
        Err(answer) => return *answer,
    };
    let max_len = pod.max_model_len();
    if let Some(m) = max_tokens.filter(|&m| m < 1) {
        let message = format!("max_tokens must be at least 1, got {m}.");
        return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", &message);
    }
    // Each prompt's engine requests: its token count, its blocks, and each choice's output.
    let mut sequences = Vec::with_capacity(prompts.len() * choices);
    let mut all_prompt_tokens = 0u32;
    for (p, prompt) in prompts.iter().enumerate() {
        let prompt_tokens = text::prompt_tokens(prompt);
        all_prompt_tokens = all_prompt_tokens.saturating_add(prompt_tokens);
        // Each choice samples its own length when the request sets none (a seed of its own).
        let outputs: Vec<(u32, FinishReason)> = (0..choices)
            .map(|i| match max_tokens {
                Some(m) => (u32::try_from(m).unwrap_or(u32::MAX), FinishReason::Length),
                None => {
                    let room = max_len.saturating_sub(prompt_tokens);
                    let seed = pod.seed.wrapping_add((p * choices + i) as u64);
                    let drawn = text::drawn_output_tokens(seed, &model, prompt, room.max(1));
                    (drawn, FinishReason::Stop)
                }
            })
            .collect();
        let output_tokens = outputs.iter().map(|o| o.0).max().unwrap_or(1);
        let total = u64::from(prompt_tokens) + u64::from(output_tokens);
        if total > u64::from(max_len) {
            let message = format!(
                "This model's maximum context length is {max_len} tokens. However, you requested \
                 {total} tokens ({prompt_tokens} in the messages, {output_tokens} in the \
                 completion). Please reduce the length of the messages or completion."
            );
            return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", &message);
        }
        let block_hashes = if pod.cfg.engine.enable_prefix_caching {
            text::block_hashes(prompt, pod.cfg.engine.block_size, &model)
        } else {
            Vec::new()
        };
        for (output_tokens, finish) in outputs {
            sequences.push(NewRequest {
                prompt_tokens,
                output_tokens,
                finish,
                block_hashes: block_hashes.clone(),
                adapter,
                stream,
            });
        }
    }
    drop(prompts);
    let (prefix, object) = match api {
        Api::Chat => (
            "chatcmpl",
            if stream {
                "chat.completion.chunk"
            } else {
                "chat.completion"
            },
        ),
        Api::Completion => ("cmpl", "text_completion"),
        Api::Messages => ("msg", "message"),
    };
    let id = format!(
        "{prefix}-{:016x}{n:016x}",
        xxhash_rust::xxh64::xxh64(pod.cfg.name.as_bytes(), pod.seed)
    );
    let model_json = serde_json::to_string(&model).unwrap_or_else(|_| "\"\"".to_string());
    let head = match api {
        Api::Messages => {
            format!(r#""id":"{id}","type":"message","role":"assistant","model":{model_json}"#)
        }
        _ => format!(
            r#"{{"id":"{id}","object":"{object}","created":{},"model":{model_json},"#,
            unix_now()
        ),
    };
    let meta = Meta {
        api,
        head,
        prompt_tokens: all_prompt_tokens,
        choices,
        include_usage,
    };
    let children: Vec<Child> = sequences.into_iter().map(|r| pod.submit(r)).collect();
    if stream {
        sse_response(children, meta)
    } else {
        full_response(children, meta).await
    }
}

/// One engine request of a generation request: its emissions, and the guard that aborts it if
/// the client goes away first.
type Child = (mpsc::UnboundedReceiver<Output>, RequestGuard);

fn usage_json(prompt: u32, completion: u32, cached: u32) -> String {
    format!(
        r#"{{"prompt_tokens":{prompt},"total_tokens":{},"completion_tokens":{completion},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#,
        prompt + completion
    )
}

/// What a non-streamed request's emissions add up to once it finished.
struct Finished {
    generated: u32,
    finish: FinishReason,
    cached: u32,
}

/// Waits for a request's last emission; `None` if the engine stopped before it.
async fn finish(mut rx: mpsc::UnboundedReceiver<Output>) -> Option<Finished> {
    let mut generated = 0u32;
    while let Some(o) = rx.recv().await {
        generated += o.new_tokens;
        if let Some(finish) = o.finish {
            return Some(Finished {
                generated,
                finish,
                cached: o.cached_tokens,
            });
        }
    }
    None
}

async fn full_response(children: Vec<Child>, meta: Meta) -> Response {
    let mut done = Vec::with_capacity(children.len());
    let mut guards = Vec::with_capacity(children.len());
    for (rx, guard) in children {
        // Until every choice is done the guards stay alive: an engine that stops drops them
        // all, which aborts the choices still running.
        guards.push(guard);
        let Some(f) = finish(rx).await else {
            return api_error(
                meta.api,
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "the engine stopped before the request finished",
            );
        };
        done.push(f);
    }
    for g in &mut guards {
        g.finish();
    }
    // vLLM counts each prompt once and the choices' tokens together.
    let generated: u32 = done.iter().map(|f| f.generated).sum();
    let cached = meta.cached_tokens(done.iter().map(|f| f.cached));
    let usage = usage_json(meta.prompt_tokens, generated, cached);
    // The choices by index, as chat or completion objects.
    let choices = |chat: bool| {
        let each = done.iter().enumerate().map(|(i, f)| {
            let content =
                serde_json::to_string(&text::filler(0, f.generated)).unwrap_or_default();
            let reason = f.finish.as_str();
            if chat {
                format!(
                    r#"{{"index":{i},"message":{{"role":"assistant","reasoning_content":null,"content":{content},"tool_calls":[]}},"logprobs":null,"finish_reason":"{reason}","stop_reason":null}}"#
                )
            } else {
                format!(
                    r#"{{"index":{i},"text":{content},"logprobs":null,"finish_reason":"{reason}","stop_reason":null,"prompt_logprobs":null}}"#
                )
            }
        });
        each.collect::<Vec<_>>().join(",")
    };
    let body = match meta.api {
        Api::Chat => format!(
            r#"{}"choices":[{}],"usage":{usage},"prompt_logprobs":null}}"#,
            meta.head,
            choices(true)
        ),
        Api::Completion => format!(
            r#"{}"choices":[{}],"usage":{usage}}}"#,
            meta.head,
            choices(false)
        ),
        // One choice (the Messages API has no `n`).
        Api::Messages => {
            let finish = done.first().map_or(FinishReason::Stop, |f| f.finish);
            let content = serde_json::to_string(&text::filler(0, generated)).unwrap_or_default();
            format!(
                r#"{{{},"content":[{{"type":"text","text":{content}}}],"stop_reason":"{}","stop_sequence":null,"usage":{}}}"#,
                meta.head,
                stop_reason(finish),
                anthropic_usage(meta.prompt_tokens, generated, cached)
            )
        }
    };
    json_response(StatusCode::OK, body)
}

/// Anthropic's name for why generation stopped (an aborted request has no client to tell).
fn stop_reason(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "max_tokens",
        FinishReason::Stop | FinishReason::Abort => "end_turn",
    }
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens not read from the cache.
fn anthropic_usage(prompt: u32, output: u32, cached: u32) -> String {
    format!(
        r#"{{"input_tokens":{},"cache_read_input_tokens":{cached},"output_tokens":{output}}}"#,
        prompt.saturating_sub(cached)
    )
}

/// The emissions of a request's choices, each with its choice's index.
enum Emissions {
    One(mpsc::UnboundedReceiver<Output>),
    /// Several choices' emissions merged, in the order the engine made them.
    Many(mpsc::UnboundedReceiver<(usize, Output)>),
}

impl Emissions {
    fn of(mut children: Vec<mpsc::UnboundedReceiver<Output>>) -> Emissions {
        if children.len() == 1 {
            if let Some(rx) = children.pop() {
                return Emissions::One(rx);
            }
        }
        let (tx, merged) = mpsc::unbounded_channel();
        for (i, mut rx) in children.into_iter().enumerate() {
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(o) = rx.recv().await {
                    if tx.send((i, o)).is_err() {
                        break;
                    }
                }
            });
        }
        Emissions::Many(merged)
    }

    async fn recv(&mut self) -> Option<(usize, Output)> {
        match self {
            Emissions::One(rx) => rx.recv().await.map(|o| (0, o)),
            Emissions::Many(rx) => rx.recv().await,
        }
    }
}

struct SseState {
    rx: Emissions,
    /// One per choice; each is finished when its choice is.
    guards: Vec<RequestGuard>,
    meta: Meta,
    /// Tokens emitted so far, per choice.
    generated: Vec<u32>,
    /// Prompt tokens each choice read from the prefix cache, as its last emission said.
    cached: Vec<u32>,
    /// Choices not finished yet.
    left: usize,
    done: bool,
}

impl SseState {
    /// The SSE events for one engine emission of choice `i`.
    fn events(&mut self, i: usize, o: &Output) -> Bytes {
        if self.meta.api == Api::Messages {
            return self.message_events(o);
        }
        let mut buf = String::with_capacity(256 + 8 * o.new_tokens as usize);
        let head = &self.meta.head;
        let generated = self.generated.get(i).copied().unwrap_or(0);
        if generated == 0 && self.meta.api == Api::Chat {
            // vLLM sends the role chunk together with the first output
            buf.push_str("data: ");
            buf.push_str(head);
            buf.push_str(&format!(
                r#""choices":[{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}"#
            ));
            buf.push_str("\n\n");
        }
        let content = text::filler(generated, generated + o.new_tokens);
        let content = serde_json::to_string(&content).unwrap_or_default();
        if let Some(g) = self.generated.get_mut(i) {
            *g += o.new_tokens;
        }
        if let Some(c) = self.cached.get_mut(i) {
            *c = o.cached_tokens;
        }
        let finish = match o.finish {
            Some(r) => format!(r#""finish_reason":"{}","stop_reason":null"#, r.as_str()),
            None => match self.meta.api {
                Api::Completion => r#""finish_reason":null,"stop_reason":null"#.to_string(),
                _ => r#""finish_reason":null"#.to_string(),
            },
        };
        buf.push_str("data: ");
        buf.push_str(head);
        match self.meta.api {
            Api::Chat | Api::Messages => {
                buf.push_str(&format!(r#""choices":[{{"index":{i},"delta":{{"content":"#));
                buf.push_str(&content);
                buf.push_str(r#"},"logprobs":null,"#);
                buf.push_str(&finish);
                buf.push_str("}]}");
            }
            Api::Completion => {
                buf.push_str(&format!(r#""choices":[{{"index":{i},"text":"#));
                buf.push_str(&content);
                buf.push_str(r#","logprobs":null,"#);
                buf.push_str(&finish);
                buf.push_str(r#"}],"usage":null}"#);
            }
        }
        buf.push_str("\n\n");
        if o.finish.is_some() {
            if let Some(g) = self.guards.get_mut(i) {
                g.finish();
            }
            self.left = self.left.saturating_sub(1);
        }
        if o.finish.is_some() && self.left == 0 {
            self.done = true;
            if self.meta.include_usage {
                buf.push_str("data: ");
                buf.push_str(head);
                buf.push_str(r#""choices":[],"usage":"#);
                buf.push_str(&usage_json(
                    self.meta.prompt_tokens,
                    self.generated.iter().sum(),
                    self.meta.cached_tokens(self.cached.iter().copied()),
                ));
                buf.push_str("}\n\n");
            }
            buf.push_str("data: [DONE]\n\n");
        }
        Bytes::from(buf)
    }
}

impl SseState {
    /// Anthropic's named events for one engine emission: `message_start` and
    /// `content_block_start` with the first output (as vLLM sends its role chunk), a
    /// `content_block_delta` per emission, and at the end `content_block_stop`, `message_delta`
    /// (stop reason, output tokens) and `message_stop`.
    fn message_events(&mut self, o: &Output) -> Bytes {
        let mut buf = String::with_capacity(512 + 8 * o.new_tokens as usize);
        let mut event = |name: &str, data: &str| {
            buf.push_str("event: ");
            buf.push_str(name);
            buf.push_str("\ndata: ");
            buf.push_str(data);
            buf.push_str("\n\n");
        };
        let generated = self.generated.first().copied().unwrap_or(0);
        if generated == 0 {
            let usage = anthropic_usage(self.meta.prompt_tokens, 0, o.cached_tokens);
            event(
                "message_start",
                &format!(
                    r#"{{"type":"message_start","message":{{{},"content":[],"stop_reason":null,"stop_sequence":null,"usage":{usage}}}}}"#,
                    self.meta.head
                ),
            );
            event(
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            );
        }
        let content = text::filler(generated, generated + o.new_tokens);
        let content = serde_json::to_string(&content).unwrap_or_default();
        let generated = generated + o.new_tokens;
        if let Some(g) = self.generated.first_mut() {
            *g = generated;
        }
        event(
            "content_block_delta",
            &format!(
                r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{content}}}}}"#
            ),
        );
        if let Some(finish) = o.finish {
            event(
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            );
            event(
                "message_delta",
                &format!(
                    r#"{{"type":"message_delta","delta":{{"stop_reason":"{}","stop_sequence":null}},"usage":{{"output_tokens":{}}}}}"#,
                    stop_reason(finish),
                    generated
                ),
            );
            event("message_stop", r#"{"type":"message_stop"}"#);
            for g in &mut self.guards {
                g.finish();
            }
            self.done = true;
        }
        Bytes::from(buf)
    }
}

fn sse_response(children: Vec<Child>, meta: Meta) -> Response {
    let (rxs, guards): (Vec<_>, Vec<_>) = children.into_iter().unzip();
    let state = SseState {
        generated: vec![0; guards.len()],
        cached: vec![0; guards.len()],
        left: guards.len(),
        rx: Emissions::of(rxs),
        guards,
        meta,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let (i, o) = st.rx.recv().await?;
        let bytes = st.events(i, &o);
        Some((Ok::<Bytes, Infallible>(bytes), st))
    });
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        )],
        Body::from_stream(stream),
    )
        .into_response()
}
