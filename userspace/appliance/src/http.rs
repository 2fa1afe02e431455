//! The HTTP API: `/v1/completions` (JSON or server-sent events), `/v1/models`, the KV-cache
//! API (`/v1/kv/lookup`, `/v1/kv/get`, `/v1/kv/put`, `/v1/kv/delete`, `/v1/kv/pin`,
//! `/v1/kv/unpin`; unit bodies in the binary framing of [`crate::frame`]), `/metrics`,
//! `/healthz`, `/readyz` (`docs/appliance.md` has every route, field and status).
//!
//! Request bodies are parsed by hand from JSON values so that every error names its field;
//! the tenant comes from the `Authorization: Bearer KEY` header alone.

// The helpers return the error response itself: it is built once per failed request, and
// boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvstack_engine::RequestSpec;
use kvstack_kernels::model::Sampling;
use kvstack_model::tokenizer::ByteLevel;
use serde_json::{Value, json};
use tokio::sync::mpsc::unbounded_channel;

use crate::config::{Config, Tenant};
use crate::metrics::{Metrics, TenantLabel};
use crate::worker::{Command, Job, JobDone, JobEvent, Shared};

/// Everything a handler needs.
pub struct AppState {
    /// The current config (tenants and limits are replaced on `SIGHUP`).
    pub config: RwLock<Arc<Config>>,
    /// To the engine thread.
    pub jobs: SyncSender<Command>,
    /// Shared with the engine thread.
    pub shared: Arc<Shared>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// SIGTERM seen: no new requests.
    pub draining: AtomicBool,
    /// The model's vocabulary size.
    pub vocab: u32,
    /// The tokenizer, when the model has one.
    pub tokenizer: Option<ByteLevel>,
    /// Requests per tenant running now.
    pub tenant_running: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

type St = State<Arc<AppState>>;

/// Header of node-to-node requests: the `[cluster] peer_secret`.
pub const PEER_HEADER: &str = "x-kvstack-peer";
/// Header of node-to-node requests: the tenant the peer acts for.
pub const PEER_TENANT_HEADER: &str = "x-kvstack-tenant";

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/kv/lookup", post(kv_lookup))
        .route("/v1/kv/delete", post(kv_delete))
        .route("/v1/kv/get", post(kv_get))
        .route("/v1/kv/put", post(kv_put))
        .route("/v1/kv/pin", post(kv_pin))
        .route("/v1/kv/unpin", post(kv_unpin))
        .fallback(|| async { error(StatusCode::NOT_FOUND, None, "no such route".into()) })
        // A panic in a handler fails that request alone (500) instead of dropping the
        // connection without an answer; the engine thread is not a handler (its failure
        // stops the daemon non-zero, for systemd to restart it).
        .layer(guard())
        .with_state(state)
}

/// The layer that turns a handler's panic into a 500 for that request.
fn guard() -> tower_http::catch_panic::CatchPanicLayer<fn(Box<dyn std::any::Any + Send>) -> Response>
{
    tower_http::catch_panic::CatchPanicLayer::custom(panicked as fn(_) -> Response)
}

/// The answer to a request whose handler panicked.
fn panicked(payload: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    log::error!("a request handler panicked: {what}");
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        None,
        "internal error: this request failed (the daemon's log has the cause)".into(),
    )
}

/// An OpenAI-style error body.
fn error(status: StatusCode, param: Option<&str>, message: String) -> Response {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}});
    let mut r = (status, axum::Json(body)).into_response();
    if matches!(status.as_u16(), 429 | 503) {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn bad(param: &str, message: String) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        Some(param),
        format!("{param}: {message}"),
    )
}

async fn readyz(State(s): St) -> Response {
    if s.draining.load(Ordering::Acquire) {
        return error(StatusCode::SERVICE_UNAVAILABLE, None, "draining".into());
    }
    if !s.shared.ready.load(Ordering::Acquire) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            "recovering the SSD store".into(),
        );
    }
    // Redis down is not unready: the node serves from its own tiers (misses only).
    let tiers = s.shared.tiers.read().ok().and_then(|t| t.clone());
    match tiers
        .as_deref()
        .and_then(|t| t.remote())
        .map(|r| r.health())
    {
        None => "ready\n".into_response(),
        Some(h) if h.up => "ready\nwindow pool redis-cluster: up\n".into_response(),
        Some(h) => format!(
            "ready\nwindow pool redis-cluster: down for {:.1} s ({}); serving from local tiers\n",
            h.down_for_ms.unwrap_or(0) as f64 / 1e3,
            h.last_error.unwrap_or_default()
        )
        .into_response(),
    }
}

async fn metrics(State(s): St) -> Response {
    let tiers = s.shared.tiers.read().ok().and_then(|t| t.clone());
    let tenants: Vec<String> = {
        let cfg = s.config.read().unwrap_or_else(|e| e.into_inner());
        cfg.tenants.iter().map(|t| t.name.clone()).collect()
    };
    let body = s
        .metrics
        .encode(tiers.as_deref(), &tenants, &s.shared.waiting);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn models(State(s): St, headers: HeaderMap) -> Response {
    if let Err(r) = tenant(&s, &headers) {
        return r;
    }
    let name = s
        .config
        .read()
        .map(|c| c.model_name.clone())
        .unwrap_or_default();
    // What a KV-cache API client needs to build frames: the fingerprint and the page size.
    let kv = shared_tiers(&s).ok().map(
        |t| json!({"fingerprint": fingerprint_hex(&t), "page_tokens": t.geometry().page_tokens}),
    );
    axum::Json(json!({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "kvstack", "kvstack": kv}
    ]}))
    .into_response()
}

/// The tenant of a request's key, or 401.
fn tenant(s: &AppState, headers: &HeaderMap) -> Result<(Tenant, Arc<Config>), Response> {
    let cfg = s.config.read().map(|c| Arc::clone(&c)).map_err(|_| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            "config lock".into(),
        )
    })?;
    // A peer node (docs/cluster.md): the shared secret and the tenant it fetches for.
    if let Some(secret) = headers.get(PEER_HEADER).and_then(|v| v.to_str().ok()) {
        let name = headers
            .get(PEER_TENANT_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        return match cfg.tenant_for_peer(secret, name) {
            Some(t) => Ok((t.clone(), Arc::clone(&cfg))),
            None => Err(error(
                StatusCode::UNAUTHORIZED,
                None,
                "invalid peer secret or unknown tenant".into(),
            )),
        };
    }
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match cfg.tenant_for_key(key) {
        Some(t) => Ok((t.clone(), Arc::clone(&cfg))),
        None => Err(error(
            StatusCode::UNAUTHORIZED,
            None,
            if key.is_some() {
                "invalid API key"
            } else {
                "missing Authorization: Bearer KEY"
            }
            .into(),
        )),
    }
}

fn parse_json(body: &Bytes) -> Result<serde_json::Map<String, Value>, Response> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad("body", "expected a JSON object".into())),
        Err(e) => Err(bad("body", format!("malformed JSON: {e}"))),
    }
}

/// Token ids of `v` (an array of integers below the vocabulary), or text through the
/// tokenizer.
fn token_ids(s: &AppState, name: &str, v: &Value) -> Result<Vec<u32>, Response> {
    match v {
        Value::String(text) => match &s.tokenizer {
            Some(t) => Ok(t.encode(text)),
            None => Err(bad(
                name,
                "this model has no tokenizer: send token ids".into(),
            )),
        },
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let id = x.as_u64().ok_or_else(|| {
                    bad(
                        &format!("{name}[{i}]"),
                        "expected a token id (integer >= 0)".into(),
                    )
                })?;
                if id >= u64::from(s.vocab) {
                    return Err(bad(
                        &format!("{name}[{i}]"),
                        format!("token id {id} is outside the vocabulary (0..{})", s.vocab),
                    ));
                }
                Ok(id as u32)
            })
            .collect(),
        _ => Err(bad(
            name,
            "expected a string or an array of token ids".into(),
        )),
    }
}

fn opt_u64(m: &serde_json::Map<String, Value>, k: &str) -> Result<Option<u64>, Response> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(k, "expected an integer >= 0".into())),
    }
}

fn opt_f64(m: &serde_json::Map<String, Value>, k: &str) -> Result<Option<f64>, Response> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(k, "expected a number".into())),
    }
}

/// Decrements a tenant's running count when the request ends (however it ends).
struct TenantSlot {
    state: Arc<AppState>,
    tenant: String,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        if let Ok(mut m) = self.state.tenant_running.lock()
            && let Some(n) = m.get_mut(&self.tenant)
        {
            *n = n.saturating_sub(1);
        }
    }
}

async fn completions(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let (t, cfg) = match tenant(&s, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    if s.draining.load(Ordering::Acquire) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            "the daemon is shutting down".into(),
        );
    }
    if !s.shared.ready.load(Ordering::Acquire) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            "recovering the SSD store".into(),
        );
    }
    let limits = &cfg.limits;
    let body = match axum::body::to_bytes(body, limits.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                Some("body"),
                format!(
                    "body: larger than {} bytes (limits.max_body_bytes)",
                    limits.max_body_bytes
                ),
            );
        }
    };
    let m = match parse_json(&body) {
        Ok(m) => m,
        Err(r) => return r,
    };
    for k in ["n", "best_of", "logprobs", "echo", "suffix"] {
        if m.get(k)
            .is_some_and(|v| !v.is_null() && v != &json!(1) && v != &json!(false))
        {
            return bad(k, "not supported by kvstackd".into());
        }
    }
    if let Some(v) = m.get("model")
        && v.as_str() != Some(cfg.model_name.as_str())
    {
        return error(
            StatusCode::NOT_FOUND,
            Some("model"),
            format!("model: `{v}` is not served here (`{}` is)", cfg.model_name),
        );
    }
    let Some(prompt) = m.get("prompt") else {
        return bad("prompt", "missing".into());
    };
    let tokens = match token_ids(&s, "prompt", prompt) {
        Ok(t) => t,
        Err(r) => return r,
    };
    if tokens.is_empty() {
        return bad("prompt", "empty".into());
    }
    if tokens.len() > t.max_prompt_tokens {
        return bad(
            "prompt",
            format!(
                "{} tokens, more than this tenant's limit of {}",
                tokens.len(),
                t.max_prompt_tokens
            ),
        );
    }
    let max_tokens = match opt_u64(&m, "max_tokens") {
        Ok(v) => v.unwrap_or(16),
        Err(r) => return r,
    };
    if max_tokens == 0 || max_tokens > limits.max_tokens as u64 {
        return bad(
            "max_tokens",
            format!("{max_tokens} is outside [1, {}]", limits.max_tokens),
        );
    }
    let temperature = match opt_f64(&m, "temperature") {
        Ok(v) => v.unwrap_or(1.0),
        Err(r) => return r,
    };
    if !(0.0..=2.0).contains(&temperature) {
        return bad("temperature", format!("{temperature} is outside [0, 2]"));
    }
    let top_p = match opt_f64(&m, "top_p") {
        Ok(v) => v.unwrap_or(1.0),
        Err(r) => return r,
    };
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad("top_p", format!("{top_p} is outside (0, 1]"));
    }
    let seed = match opt_u64(&m, "seed") {
        Ok(v) => v.unwrap_or(0),
        Err(r) => return r,
    };
    let stream = match m.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return bad("stream", "expected true or false".into()),
    };
    let stop: Vec<Vec<u8>> = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(x)) => vec![x.as_bytes().to_vec()],
        Some(Value::Array(a)) if a.len() <= 4 => {
            let mut v = Vec::new();
            for (i, x) in a.iter().enumerate() {
                match x.as_str() {
                    Some(x) => v.push(x.as_bytes().to_vec()),
                    None => return bad(&format!("stop[{i}]"), "expected a string".into()),
                }
            }
            v
        }
        Some(_) => return bad("stop", "expected a string or up to 4 strings".into()),
    };
    if !stop.is_empty() && s.tokenizer.is_none() {
        return bad(
            "stop",
            "this model has no tokenizer: stop sequences need one".into(),
        );
    }
    let session = match m.get("session").or(None) {
        Some(Value::String(x)) => Some(x.clone()),
        None | Some(Value::Null) => headers
            .get("x-kvstack-session")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        Some(_) => return bad("session", "expected a string".into()),
    };
    if let Some(x) = &session
        && (x.is_empty() || x.len() > 128)
    {
        return bad("session", "1 to 128 bytes".into());
    }
    let sampling = if temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::TopP {
            temperature: temperature as f32,
            top_p: top_p as f32,
        }
    };
    // Admission: the tenant's concurrency, then the engine's queue.
    {
        let Ok(mut running) = s.tenant_running.lock() else {
            return error(StatusCode::INTERNAL_SERVER_ERROR, None, "lock".into());
        };
        let n = running.entry(t.name.clone()).or_insert(0);
        if *n >= t.max_concurrent {
            s.metrics.request_done(&t.name, "rejected");
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                None,
                format!(
                    "tenant `{}` has {} requests running (its max_concurrent)",
                    t.name, n
                ),
            );
        }
        *n += 1;
    }
    let slot = TenantSlot {
        state: Arc::clone(&s),
        tenant: t.name.clone(),
    };
    if s.shared.in_flight.load(Ordering::Acquire) >= cfg.engine.queue_depth as u64 {
        s.metrics.request_done(&t.name, "rejected");
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            None,
            "the engine's queue is full".into(),
        );
    }
    // More of the prompt on another node (the shared prefix index): fetch it first.
    let peer = crate::peer::maybe_fetch(&s, &cfg, &t, &tokens)
        .await
        .map_or(Value::Null, |f| f.to_json());
    let (tx, mut rx) = unbounded_channel();
    let prompt_tokens = tokens.len() as u64;
    let job = Job {
        tenant: t.name.clone(),
        session,
        spec: RequestSpec {
            tokens,
            max_new_tokens: max_tokens as usize,
            sampling,
            seed,
        },
        stop,
        tokenizer: s.tokenizer,
        deadline: Instant::now() + Duration::from_millis(limits.request_timeout_ms),
        arrived,
        events: tx,
    };
    match s.jobs.try_send(Command::Job(Box::new(job))) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            s.metrics.request_done(&t.name, "rejected");
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                None,
                "the engine's queue is full".into(),
            );
        }
        Err(TrySendError::Disconnected(_)) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                "the engine is not running".into(),
            );
        }
    }
    let id = format!(
        "cmpl-{:x}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = cfg.model_name.clone();
    if stream {
        let st = Arc::clone(&s);
        let events = async_stream(
            rx,
            move |e| sse_event(&st, &id, created, &model, prompt_tokens, &peer, e),
            slot,
        );
        return Sse::new(events).into_response();
    }
    let mut tokens = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            JobEvent::Token(tk) => tokens.push(tk),
            JobEvent::Failed { status, message } => {
                return error(
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    None,
                    message,
                );
            }
            JobEvent::Done(d) => {
                drop(slot);
                let text = s.tokenizer.as_ref().map(|t| t.decode(&d.tokens));
                return axum::Json(json!({
                    "id": id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "text": text.unwrap_or_default(), "tokens": d.tokens,
                                 "finish_reason": d.finish_reason, "logprobs": null}],
                    "usage": usage(prompt_tokens, &d, &peer),
                }))
                .into_response();
            }
        }
    }
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        None,
        "the engine stopped".into(),
    )
}

/// `usage` of a finished request: OpenAI's fields plus kvstack's split of the context.
fn usage(prompt_tokens: u64, d: &JobDone, peer: &Value) -> Value {
    let r = &d.reuse;
    let cached = r.live_tokens + r.mapped_tokens + r.ssd_tokens;
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": d.tokens.len(),
        "total_tokens": prompt_tokens + d.tokens.len() as u64,
        "prompt_tokens_details": {"cached_tokens": cached},
        "kvstack": {
            "context_tokens": d.context_tokens,
            "reuse": format!("{:?}", r.kind).to_lowercase(),
            "live_tokens": r.live_tokens,
            "paged_cache_tokens": r.mapped_tokens,
            "ssd_tokens": r.ssd_tokens,
            "ssd_bytes": r.ssd_bytes,
            "dram_window": r.window_from_pool,
            "window_source": match (r.window_from_pool, r.window_from_remote) {
                (false, _) => Value::Null,
                (true, false) => json!("dram"),
                (true, true) => json!("redis-cluster"),
            },
            "replayed_tokens": r.replayed_tokens,
            "peer_fetch": peer,
            "computed_tokens": r.computed_tokens,
            "ttft_ms": d.ttft.as_secs_f64() * 1e3,
            "ttft_queued_ms": d.ttft_queued.as_secs_f64() * 1e3,
            "total_ms": d.total.as_secs_f64() * 1e3,
        }
    })
}

fn sse_event(
    s: &AppState,
    id: &str,
    created: u64,
    model: &str,
    prompt_tokens: u64,
    peer: &Value,
    e: JobEvent,
) -> Vec<SseEvent> {
    let chunk = |choice: Value, usage: Option<Value>| {
        let mut v = json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    };
    match e {
        JobEvent::Token(t) => {
            let text = s
                .tokenizer
                .as_ref()
                .map(|k| k.decode(&[t]))
                .unwrap_or_default();
            vec![chunk(
                json!({"index": 0, "text": text, "token": t, "finish_reason": null}),
                None,
            )]
        }
        JobEvent::Done(d) => vec![
            chunk(
                json!({"index": 0, "text": "", "finish_reason": d.finish_reason}),
                Some(usage(prompt_tokens, &d, peer)),
            ),
            SseEvent::default().data("[DONE]"),
        ],
        JobEvent::Failed { status, message } => vec![
            SseEvent::default()
                .event("error")
                .data(json!({"error": {"message": message, "code": status}}).to_string()),
            SseEvent::default().data("[DONE]"),
        ],
    }
}

/// The SSE stream of a job: its events mapped by `f`, ending after the last; `slot` (and so
/// the tenant's running count) lives as long as the stream. Dropping the stream (the client
/// went away) closes the job's channel, which cancels it in the engine.
fn async_stream(
    rx: tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
    f: impl Fn(JobEvent) -> Vec<SseEvent> + Send + Unpin + 'static,
    slot: TenantSlot,
) -> impl tokio_stream::Stream<Item = Result<SseEvent, Infallible>> + Send {
    struct S<F> {
        rx: tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
        f: F,
        pending: std::collections::VecDeque<SseEvent>,
        done: bool,
        _slot: TenantSlot,
    }
    impl<F: Fn(JobEvent) -> Vec<SseEvent> + Unpin> tokio_stream::Stream for S<F> {
        type Item = Result<SseEvent, Infallible>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            use std::task::Poll;
            loop {
                if let Some(e) = self.pending.pop_front() {
                    return Poll::Ready(Some(Ok(e)));
                }
                if self.done {
                    return Poll::Ready(None);
                }
                match self.rx.poll_recv(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => self.done = true,
                    Poll::Ready(Some(e)) => {
                        let last = !matches!(e, JobEvent::Token(_));
                        let out = (self.f)(e);
                        self.pending.extend(out);
                        self.done = last;
                    }
                }
            }
        }
    }
    S {
        rx,
        f,
        pending: Default::default(),
        done: false,
        _slot: slot,
    }
}

/// The tenant and the body of a KV-cache API call (at most `limit` bytes), or the error
/// response (401, 503 while recovering, 413).
async fn kv_prelude(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
    limit: impl Fn(&Config) -> (usize, &'static str),
) -> Result<(Tenant, Arc<Config>, Bytes), Response> {
    let (t, cfg) = tenant(s, headers)?;
    if !s.shared.ready.load(Ordering::Acquire) {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            "recovering the SSD store".into(),
        ));
    }
    if s.draining.load(Ordering::Acquire) {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            "draining".into(),
        ));
    }
    let (max, key) = limit(&cfg);
    let body = axum::body::to_bytes(body, max).await.map_err(|_| {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Some("body"),
            format!("body: larger than {max} bytes (limits.{key})"),
        )
    })?;
    Ok((t, cfg, body))
}

/// The tenant and the `tokens` of a JSON KV-cache API call.
async fn kv_body(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Tenant, Vec<u32>), Response> {
    kv_json(s, headers, body)
        .await
        .map(|(t, _, tokens, _)| (t, tokens))
}

/// The tenant, config, `tokens` and whole JSON object of a JSON KV-cache API call.
async fn kv_json(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<
    (
        Tenant,
        Arc<Config>,
        Vec<u32>,
        serde_json::Map<String, Value>,
    ),
    Response,
> {
    let (t, cfg, body) = kv_prelude(s, headers, body, |c| {
        (c.limits.max_body_bytes, "max_body_bytes")
    })
    .await?;
    let m = parse_json(&body)?;
    let v = m
        .get("tokens")
        .ok_or_else(|| bad("tokens", "missing".into()))?;
    if !v.is_array() {
        return Err(bad("tokens", "expected an array of token ids".into()));
    }
    let tokens = token_ids(s, "tokens", v)?;
    if tokens.is_empty() {
        return Err(bad("tokens", "empty".into()));
    }
    Ok((t, cfg, tokens, m))
}

/// The model fingerprint in hex, as the KV-cache API reports it.
pub fn fingerprint_hex(tiers: &kvstack_tiers::Tiers) -> String {
    tiers.model().0.iter().map(|b| format!("{b:02x}")).collect()
}

/// The status and message of a tiers error met by the KV-cache API: the caller's data is at
/// fault (400, naming the block), the store or the tenant's SSD quota is full (507), or the
/// server failed (500).
fn tiers_error(what: &str, e: &kvstack_tiers::Error) -> Response {
    use kvstack_tiers::Error as E;
    match e {
        E::Payload { block, .. } => bad(&format!("blocks[{block}]"), e.to_string()),
        E::UnitRange { .. } => bad("tokens", e.to_string()),
        E::StoreFull { .. } | E::QuotaExceeded { .. } => error(
            StatusCode::INSUFFICIENT_STORAGE,
            None,
            format!("{what} failed: {e}"),
        ),
        _ => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("{what} failed: {}", error_chain(e)),
        ),
    }
}

/// `e` and its sources, as one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The tiers for a KV-cache API call, or 503 (not open yet, or closing).
fn shared_tiers(s: &AppState) -> Result<Arc<kvstack_tiers::Tiers>, Response> {
    s.shared
        .tiers
        .read()
        .ok()
        .and_then(|x| x.clone())
        .ok_or_else(|| {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                "the tiers are not open".into(),
            )
        })
}

/// Runs `f` on a blocking thread with the open tiers and the caller's cache tenant: what
/// every KV-cache API call shares (503 while the tiers are not open, 500 naming `what` if `f`
/// panics).
async fn on_tiers<T: Send + 'static>(
    s: &AppState,
    tenant: &Tenant,
    what: &str,
    f: impl FnOnce(Arc<kvstack_tiers::Tiers>, kvstack_tiers::Tenant) -> T + Send + 'static,
) -> Result<T, Response> {
    let tiers = shared_tiers(s)?;
    let cache_tenant = kvstack_tiers::Tenant::new(&tenant.name);
    tokio::task::spawn_blocking(move || f(tiers, cache_tenant))
        .await
        .map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                format!("{what} failed: {e}"),
            )
        })
}

async fn kv_lookup(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let (t, tokens) = match kv_body(&s, &headers, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let st = Arc::clone(&s);
    let label = TenantLabel {
        tenant: t.name.clone(),
    };
    let r = on_tiers(&s, &t, "lookup", move |tiers, tenant| {
        let hit = tiers.lookup(&tokens, &tenant);
        st.metrics.kv_lookups.get_or_create(&label).inc();
        if hit.tokens > 0 {
            st.metrics.kv_hits.get_or_create(&label).inc();
        }
        // The shared prefix index (docs/cluster.md): which node holds the longest prefix, for
        // routers and for fetching from a peer; null without an index or when Redis is down.
        let page = tiers.geometry().page_tokens as u64;
        let cluster = tiers.cluster_lookup(&tokens, &tenant).map(|ix| {
            let covered = (ix.blocks as u64 * page).min(tokens.len() as u64);
            json!({"node": ix.entry.node, "tokens": covered.min(ix.entry.unit_tokens),
                   "unit_tokens": ix.entry.unit_tokens})
        });
        json!({
            "tokens": hit.tokens,
            "tiers": {"ssd": {"tokens": hit.tokens, "blocks": hit.store.keys.len()},
                      "dram_window": hit.window},
            "cluster": cluster,
            "page_tokens": tiers.geometry().page_tokens,
            "tenant": {"dram_pool_bytes": tiers.dram_bytes(&tenant),
                       "dram_pool_quota_bytes": tiers.dram_quota(&tenant),
                       "ssd_bytes": tiers.ssd_bytes(&tenant),
                       "ssd_quota_bytes": tiers.ssd_quota(&tenant)},
        })
    })
    .await;
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(r) => r,
    }
}

async fn kv_delete(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let (t, tokens) = match kv_body(&s, &headers, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let r = on_tiers(&s, &t, "delete", move |tiers, tenant| {
        tiers.delete_unit(&tenant, &tokens)?.wait()
    })
    .await;
    match r {
        Ok(Ok(outcome)) => {
            axum::Json(json!({"deleted": format!("{outcome:?}").to_lowercase(), "durable": true}))
                .into_response()
        }
        Ok(Err(e)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("delete failed: {e}"),
        ),
        Err(r) => r,
    }
}

/// `POST /v1/kv/pin`: pins the longest cached prefix of `tokens` for `ttl_ms` (at most and by
/// default `limits.max_pin_ttl_ms`): until then it is neither evicted from the SSD past its
/// retention nor, when the DRAM pool holds its window snapshot, expired or evicted there
/// (`docs/tiers.md`, "Pins"). 404 when nothing is cached; 429 when the pool has as many pins
/// as it allows.
async fn kv_pin(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let (t, cfg, tokens, m) = match kv_json(&s, &headers, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let max = cfg.limits.max_pin_ttl_ms;
    let ttl_ms = match m.get("ttl_ms") {
        None | Some(Value::Null) => max,
        Some(v) => match v.as_u64() {
            Some(0) | None => {
                return bad(
                    "ttl_ms",
                    format!("expected milliseconds, 1 to {max}, got {v}"),
                );
            }
            Some(n) if n > max => {
                return bad(
                    "ttl_ms",
                    format!("{n} is above limits.max_pin_ttl_ms ({max})"),
                );
            }
            Some(n) => n,
        },
    };
    let r = on_tiers(&s, &t, "pin", move |tiers, tenant| {
        tiers.pin_unit(&tenant, &tokens, ttl_ms)
    })
    .await;
    match r {
        Ok(Ok(Some(p))) => axum::Json(json!({
            "pinned": true,
            "tokens": p.tokens,
            "ttl_ms": ttl_ms,
            "until_ms": p.until_ms,
            "dram_window": p.window,
        }))
        .into_response(),
        Ok(Ok(None)) => error(
            StatusCode::NOT_FOUND,
            Some("tokens"),
            "no cached prefix of these tokens for this tenant".into(),
        ),
        Ok(Err(e @ kvstack_tiers::Error::TooManyPins { .. })) => error(
            StatusCode::TOO_MANY_REQUESTS,
            None,
            format!("pin refused: {e} in the DRAM window pool; unpin or wait for pins to end"),
        ),
        Ok(Err(e)) => tiers_error("pin", &e),
        Err(r) => r,
    }
}

/// `POST /v1/kv/unpin`: ends the pin of the longest cached prefix of `tokens`;
/// `{"unpinned": false}` when none was held.
async fn kv_unpin(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let (t, tokens) = match kv_body(&s, &headers, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let r = on_tiers(&s, &t, "unpin", move |tiers, tenant| {
        tiers.unpin_unit(&tenant, &tokens)
    })
    .await;
    match r {
        Ok(unpinned) => axum::Json(json!({ "unpinned": unpinned })).into_response(),
        Err(r) => r,
    }
}

/// `POST /v1/kv/get`: the longest cached prefix of `tokens` as a frame (`docs/kv-protocol.md`):
/// its blocks, read and checked under a read lease, and the window snapshot when the DRAM
/// pool holds one at its end. 404 when nothing is cached.
async fn kv_get(State(s): St, headers: HeaderMap, body: Body) -> Response {
    let (t, tokens) = match kv_body(&s, &headers, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let st = Arc::clone(&s);
    let label = TenantLabel {
        tenant: t.name.clone(),
    };
    let r = on_tiers(&s, &t, "get", move |tiers, tenant| {
        st.metrics.kv_lookups.get_or_create(&label).inc();
        let hit = tiers.lookup(&tokens, &tenant);
        if hit.tokens == 0 {
            return Ok(None);
        }
        // `None`: evicted or damaged since the lookup; a miss, never partial bytes.
        let Some(data) = tiers.read_unit(&tokens, &hit)? else {
            return Ok(None);
        };
        st.metrics.kv_hits.get_or_create(&label).inc();
        let frame = crate::frame::encode(
            data.tokens,
            tiers.geometry().page_tokens as u32,
            Some(fingerprint_hex(&tiers)),
            &[],
            &data.blocks,
            data.window.as_deref(),
        );
        st.metrics.kv_bytes_read.inc_by(frame.len() as u64);
        Ok::<_, kvstack_tiers::Error>(Some((data.tokens, frame)))
    })
    .await;
    match r {
        Ok(Ok(Some((n, frame)))) => {
            let mut resp =
                ([(header::CONTENT_TYPE, "application/octet-stream")], frame).into_response();
            resp.headers_mut()
                .insert("x-kvstack-tokens", HeaderValue::from(n));
            resp
        }
        Ok(Ok(None)) => error(
            StatusCode::NOT_FOUND,
            Some("tokens"),
            "no cached prefix of these tokens for this tenant".into(),
        ),
        Ok(Err(e)) => tiers_error("get", &e),
        Err(r) => r,
    }
}

/// `POST /v1/kv/put[?durable=true]`: stores the unit a frame carries for the caller's tenant.
/// Everything is checked before anything is stored (the frame, the token ids, the page size,
/// the model, each block's size for its tokens, the window snapshot). With `durable=true`
/// the answer (200) comes once the unit is on the SSD; otherwise 202 once it is queued.
async fn kv_put(
    State(s): St,
    headers: HeaderMap,
    Query(q): Query<std::collections::HashMap<String, String>>,
    body: Body,
) -> Response {
    let durable = match q.get("durable").map(String::as_str) {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(v) => return bad("durable", format!("{v:?}: expected true or false")),
    };
    if let Some(k) = q.keys().find(|k| k.as_str() != "durable") {
        return bad(k, "unknown query parameter".into());
    }
    let (t, cfg, body) = match kv_prelude(&s, &headers, body, |c| {
        (c.limits.max_kv_body_bytes, "max_kv_body_bytes")
    })
    .await
    {
        Ok(x) => x,
        Err(r) => return r,
    };
    let tiers = match shared_tiers(&s) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let vocab = s.vocab;
    let st = Arc::clone(&s);
    let r = tokio::task::spawn_blocking(move || -> Result<Value, Response> {
        let frame = crate::frame::decode(&body).map_err(|e| match &e {
            crate::Error::Frame { field, .. } => bad(field, e.to_string()),
            _ => bad("body", e.to_string()),
        })?;
        let h = &frame.header;
        if h.token_ids != h.tokens {
            return Err(bad(
                "token_ids",
                format!(
                    "{} token ids for a unit of {} tokens (put carries the unit's tokens)",
                    h.token_ids, h.tokens
                ),
            ));
        }
        if h.tokens > cfg.engine.context_limit {
            return Err(bad(
                "tokens",
                format!(
                    "{} tokens, more than the context limit {} (engine.context_limit)",
                    h.tokens, cfg.engine.context_limit
                ),
            ));
        }
        if let Some(i) = frame.token_ids.iter().position(|&id| id >= vocab) {
            return Err(bad(
                &format!("token_ids[{i}]"),
                format!(
                    "{} is outside the vocabulary of {vocab}",
                    frame.token_ids[i]
                ),
            ));
        }
        let page = tiers.geometry().page_tokens as u32;
        if h.page_tokens != page {
            return Err(bad(
                "page_tokens",
                format!(
                    "{}, this server stores pages of {page} tokens",
                    h.page_tokens
                ),
            ));
        }
        if let Some(m) = &h.model {
            let ours = fingerprint_hex(&tiers);
            if !m.eq_ignore_ascii_case(&ours) {
                return Err(bad(
                    "model",
                    format!("fingerprint {m} is not this server's model ({ours})"),
                ));
            }
        }
        let data = kvstack_tiers::UnitData {
            tokens: h.tokens,
            blocks: frame.blocks,
            window: frame.window,
        };
        let tenant = kvstack_tiers::Tenant::new(&t.name);
        let ticket = tiers
            .write_unit(&tenant, &frame.token_ids, &data)
            .map_err(|e| tiers_error("put", &e))?;
        st.metrics.kv_bytes_written.inc_by(body.len() as u64);
        if durable {
            ticket.wait().map_err(|e| tiers_error("put", &e))?;
        } else {
            // Answered before the write: a write that fails later (a full store, an I/O
            // error) is logged and counted, never silent.
            let st = Arc::clone(&st);
            let tenant = t.name.clone();
            let tokens = data.tokens;
            tokio::task::spawn_blocking(move || {
                if let Err(e) = ticket.wait() {
                    st.metrics.kv_put_failures.inc();
                    log::warn!(
                        "a put of {tokens} tokens for tenant {tenant}, answered 202, was not stored: {}",
                        error_chain(&e)
                    );
                }
            });
        }
        Ok(json!({
            "tokens": data.tokens,
            "blocks": data.blocks.len(),
            "window": data.window.is_some(),
            "durable": durable,
        }))
    })
    .await;
    match r {
        Ok(Ok(v)) => {
            let status = if durable {
                StatusCode::OK
            } else {
                StatusCode::ACCEPTED
            };
            (status, axum::Json(v)).into_response()
        }
        Ok(Err(resp)) => resp,
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("put failed: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    async fn boom() -> &'static str {
        panic!("test panic")
    }

    #[tokio::test]
    async fn a_panicking_handler_fails_its_request_only() {
        let app: Router = Router::new()
            .route("/boom", get(boom))
            .route("/fine", get(|| async { "ok" }))
            .layer(guard());
        let req = |p: &str| axum::http::Request::get(p).body(Body::empty()).unwrap();
        let r = app.clone().oneshot(req("/boom")).await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        assert!(String::from_utf8_lossy(&body).contains("internal error"));
        let r = app.oneshot(req("/fine")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}
