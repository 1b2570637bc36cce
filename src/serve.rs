//! `picchio serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! One worker thread owns the model and one chat session; requests queue for it in arrival
//! order, and each new conversation reuses the longest prefix of the previous one's KV cache
//! (a client continuing its conversation recomputes only the new turn). A client that goes away
//! stops its generation at the next token.
//!
//! Routes: `POST /v1/chat/completions` (Harmony, or the checkpoint's chat template; tools,
//! streaming), `POST /v1/completions` (raw text), `GET /v1/models`, `GET /health`. Errors are
//! OpenAI-style JSON bodies with a 4xx status; nothing a client sends can crash the server or
//! corrupt the session (requests are checked before the session is touched).

// Handlers' checks return the error response itself (axum's `Response` is large by design).
#![allow(clippy::result_large_err)]

mod guards;
mod http;
mod metrics;
mod stop;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::chat::format::{ChatFormat, TemplateChat, TemplateReply, TextStream};
use crate::chat::harmony::{
    ChatMessage, Conversation, DeveloperSettings, FunctionTool, ReasoningEffort, Role,
    SystemSettings,
};
use crate::chat::parser::{Event, StreamParser};
use crate::chat::tagged::Piece;
use crate::chat::tokenizer::{HARMONY_VOCAB_SIZE, Tokenizer};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::generate::SessionTier;
use crate::model::sampler::{Sampler, SamplingOptions};
use crate::model::session::{ChatSession, Finish};
use stop::StopSequences;

/// Default `max_tokens` when a request gives none.
const DEFAULT_MAX_TOKENS: usize = 1024;

/// What one server lets its clients do.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    /// Most tokens one request generates (a larger `max_tokens` is cut to it): one client
    /// cannot hold the model for a whole context.
    pub max_tokens: usize,
    /// Requests waiting for the model at most; more get 503 with Retry-After.
    pub queue: usize,
    /// When set, every route but /health needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Open connections at most; one more is answered 503 with Retry-After and closed.
    pub connections: usize,
    /// Largest request body in bytes; a larger one gets 413.
    pub body_bytes: usize,
    /// How long a connection may take to send a request's head, waiting idle between
    /// requests included; then it is closed.
    pub head_timeout: Duration,
    /// How long a request's body may take to arrive (408 after).
    pub body_timeout: Duration,
    /// Host names served besides loopback ones when bound to loopback ("*": any); when bound
    /// elsewhere, the only names served if any are given.
    pub allowed_hosts: Vec<String>,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_tokens: 8192,
            queue: 64,
            api_key: None,
            connections: 128,
            body_bytes: 8 << 20,
            head_timeout: Duration::from_secs(15),
            body_timeout: Duration::from_secs(30),
            allowed_hosts: Vec::new(),
        }
    }
}

/// What the worker sends back for one request.
enum Reply {
    Token(u32),
    /// The prompt's length, positions reused, tokens generated and why it ended.
    Done {
        prompt_tokens: usize,
        reused: usize,
        finish: Finish,
    },
    /// The request failed in the model (the session was reset).
    Failed(String),
}

/// A generation request for the worker.
struct Job {
    ids: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingOptions,
    stops: Vec<u32>,
    replies: mpsc::UnboundedSender<Reply>,
    /// Set by the handler when the reply is over before the model says so (a stop sequence).
    cancel: Arc<AtomicBool>,
    /// Where the request's token counts go for its access-log line.
    tally: Arc<guards::Tally>,
}

/// What handlers share.
struct Shared {
    name: String,
    context: usize,
    vocab_size: usize,
    stops: Vec<u32>,
    jobs: flume::Sender<Job>,
    tokenizer: Tokenizer,
    /// Harmony (GPT-OSS) or the checkpoint's template and tokenizer.
    format: ChatFormat,
    limits: ServeLimits,
    metrics: Arc<metrics::Metrics>,
    /// The model, for its expert counters in /metrics.
    model: Arc<Model>,
    /// Whether the listener is on a loopback address (the Host allow-list applies).
    bound_to_loopback: bool,
}

/// Runs the model worker: one job at a time, one session kept across jobs, on `tier`. Says
/// through `opened` whether the session opened before taking jobs.
fn worker(
    model: Arc<Model>,
    context: usize,
    tier: SessionTier,
    opened: std::sync::mpsc::Sender<Result<()>>,
    jobs: flume::Receiver<Job>,
    metrics: Arc<metrics::Metrics>,
) {
    let mut session = match ChatSession::open(&model, &tier, context) {
        Ok(session) => {
            let _ = opened.send(Ok(()));
            session
        }
        Err(e) => {
            let _ = opened.send(Err(e));
            return;
        }
    };
    for job in jobs.iter() {
        let replies = job.replies.clone();
        let started = std::time::Instant::now();
        job.tally.set_prompt(job.ids.len());
        let reused = match session.feed(&job.ids) {
            Ok(reused) => reused,
            Err(e) => {
                let _ = replies.send(Reply::Failed(e.to_string()));
                continue;
            }
        };
        let mut sampler = Sampler::new(job.sampling);
        let result = session.generate(job.max_tokens, &mut sampler, &job.stops, |token| {
            job.tally.add_completion_token();
            // A closed channel: the client went away, stop here.
            replies.send(Reply::Token(token)).is_ok() && !job.cancel.load(Ordering::Relaxed)
        });
        let micros = started.elapsed().as_micros() as u64;
        let _ = replies.send(match result {
            Ok((tokens, finish)) => {
                metrics.count_request(job.ids.len(), reused, tokens.len(), micros);
                Reply::Done {
                    prompt_tokens: job.ids.len(),
                    reused,
                    finish,
                }
            }
            Err(e) => {
                session.reset();
                Reply::Failed(e.to_string())
            }
        });
    }
}

/// An OpenAI-style error response.
fn error(status: StatusCode, message: impl Into<String>, code: &str) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}})),
    )
        .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The sampling fields shared by both completion endpoints (`top_k`, `min_p` and
/// `repetition_penalty` are extensions, as llama.cpp's server has them).
#[derive(Debug, Deserialize)]
struct SamplingFields {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<u64>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    /// Choices per request: only 1 is served.
    n: Option<usize>,
    /// Stop sequences (`serve::stop`): a string or up to four.
    stop: Option<Value>,
    /// Token log-probabilities: not served yet (refused when asked for).
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
}

impl SamplingFields {
    /// The options (greedy when no temperature is given), or why they are invalid. Fields this
    /// server does not serve are refused rather than ignored.
    fn options(&self) -> std::result::Result<SamplingOptions, String> {
        if self.n.is_some_and(|n| n != 1) {
            return Err("n must be 1: this server returns one choice".into());
        }
        let asked = |v: &Option<Value>| match v {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_u64() != Some(0),
            Some(_) => true,
        };
        if asked(&self.logprobs) || asked(&self.top_logprobs) {
            return Err("logprobs and top_logprobs are not served yet".into());
        }
        let defaults = SamplingOptions::default();
        let options = SamplingOptions {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            seed: self.seed.unwrap_or(defaults.seed),
        };
        options.check()?;
        Ok(options)
    }

    /// The request's stop sequences, or why they are invalid.
    fn stop_sequences(&self) -> std::result::Result<StopSequences, String> {
        StopSequences::parse(self.stop.as_ref())
    }

    fn max_tokens(&self) -> usize {
        self.max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS)
    }
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    tools: Vec<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    stream: bool,
    reasoning_effort: Option<ReasoningEffort>,
    /// Extra arguments of a checkpoint's chat template (`{"enable_thinking": false}`), as vLLM
    /// and SGLang take them.
    #[serde(default)]
    chat_template_kwargs: Map<String, Value>,
    /// False: at most one tool call per reply (the reply ends after it).
    parallel_tool_calls: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Structured output: only `{"type": "text"}` is served yet.
    response_format: Option<Value>,
    #[serde(flatten)]
    sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    /// A last chunk with the usage and no choices, before `[DONE]`.
    #[serde(default)]
    include_usage: bool,
}

impl ChatRequest {
    /// Refuses what this server does not serve yet rather than ignoring it.
    fn check_served(&self) -> std::result::Result<(), String> {
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(format) if format.get("type") == Some(&json!("text")) => {}
            Some(format) => {
                return Err(format!(
                    "response_format {} is not served yet (structured output); only {{\"type\": \"text\"}} is",
                    format.get("type").unwrap_or(format)
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: String,
    #[serde(default)]
    stream: bool,
    #[serde(flatten)]
    sampling: SamplingFields,
}

/// The text of a message's `content`: a string, or an array of `{"type": "text", "text"}` parts.
fn content_text(content: &Value) -> std::result::Result<String, String> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err("only text content parts are supported".to_string()),
            })
            .collect(),
        _ => Err("content must be a string or an array of text parts".into()),
    }
}

/// `tool_choice` as served: absent, "auto" or "none". A forced call ("required", or a named
/// function) is refused rather than ignored, and a named function must be one of `tools`.
fn check_tool_choice(choice: Option<&Value>, tools: &[Value]) -> std::result::Result<(), String> {
    let Some(choice) = choice else {
        return Ok(());
    };
    match choice {
        Value::String(mode) if mode == "auto" || mode == "none" => Ok(()),
        Value::String(mode) if mode == "required" => {
            Err("tool_choice \"required\" is not served yet (use \"auto\")".into())
        }
        Value::Object(object) if object.get("type") == Some(&json!("function")) => {
            let name = object["function"]["name"]
                .as_str()
                .ok_or("tool_choice of type function needs function.name")?;
            let listed = tools
                .iter()
                .any(|t| t["function"]["name"].as_str() == Some(name));
            if !listed {
                return Err(format!(
                    "tool_choice names function {name:?}, which is not in tools"
                ));
            }
            Err(format!(
                "forcing a call of {name:?} (tool_choice) is not served yet (use \"auto\")"
            ))
        }
        other => Err(format!(
            "tool_choice must be \"auto\", \"none\", \"required\" or a function, not {other}"
        )),
    }
}

/// The tools the model is offered: the request's, checked against `tool_choice`, or none where
/// it is "none".
fn offered_tools(request: &ChatRequest) -> std::result::Result<&[Value], String> {
    check_tool_choice(request.tool_choice.as_ref(), &request.tools)?;
    let none = request.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
    Ok(if none { &[] } else { &request.tools })
}

/// Renders an OpenAI chat request as a Harmony conversation: system and developer messages
/// become the developer's instructions (Harmony's system message carries the model identity,
/// date and reasoning effort), tools the developer's function namespace, assistant tool calls
/// and tool results their Harmony forms.
fn conversation(request: &ChatRequest) -> std::result::Result<Conversation, String> {
    let mut instructions = Vec::new();
    let mut messages = Vec::new();
    // Tool call ids to function names, to name the tool results.
    let mut calls: HashMap<String, String> = HashMap::new();
    for (i, m) in request.messages.iter().enumerate() {
        let role = m["role"]
            .as_str()
            .ok_or_else(|| format!("messages[{i}] has no role"))?;
        let text = content_text(&m["content"]).map_err(|e| format!("messages[{i}]: {e}"))?;
        let message = |role: Role, content: String| ChatMessage {
            role,
            content,
            channel: None,
            recipient: None,
            content_type: None,
            name: None,
        };
        match role {
            "system" | "developer" => instructions.push(text),
            "user" => messages.push(message(Role::User, text)),
            "assistant" => {
                if let Some(reasoning) = m["reasoning_content"].as_str() {
                    messages.push(ChatMessage {
                        channel: Some("analysis".into()),
                        ..message(Role::Assistant, reasoning.into())
                    });
                }
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    let name = call["function"]["name"].as_str().ok_or_else(|| {
                        format!("messages[{i}]: a tool call has no function name")
                    })?;
                    if let Some(id) = call["id"].as_str() {
                        calls.insert(id.to_string(), name.to_string());
                    }
                    let arguments = call["function"]["arguments"].as_str().unwrap_or("{}");
                    messages.push(ChatMessage {
                        channel: Some("commentary".into()),
                        recipient: Some(format!("functions.{name}")),
                        content_type: Some("<|constrain|>json".into()),
                        ..message(Role::Assistant, arguments.into())
                    });
                }
                if !text.is_empty() {
                    messages.push(ChatMessage {
                        channel: Some("final".into()),
                        ..message(Role::Assistant, text)
                    });
                }
            }
            "tool" => {
                let name = m["name"]
                    .as_str()
                    .map(str::to_string)
                    .or_else(|| calls.get(m["tool_call_id"].as_str()?).cloned())
                    .ok_or_else(|| {
                        format!(
                            "messages[{i}]: a tool result needs a tool_call_id of an earlier call"
                        )
                    })?;
                messages.push(ChatMessage {
                    channel: Some("commentary".into()),
                    name: Some(format!("functions.{name}")),
                    ..message(Role::Tool, text)
                });
            }
            other => return Err(format!("messages[{i}] has an unknown role {other:?}")),
        }
    }
    if messages.is_empty() {
        return Err("messages must hold at least one user message".into());
    }
    let mut tools = Vec::new();
    for (i, tool) in offered_tools(request)?.iter().enumerate() {
        let function = &tool["function"];
        let name = function["name"]
            .as_str()
            .ok_or_else(|| format!("tools[{i}] has no function name"))?;
        tools.push(FunctionTool {
            name: name.to_string(),
            description: function["description"].as_str().unwrap_or("").to_string(),
            parameters: function.get("parameters").cloned(),
        });
    }
    let developer = (!instructions.is_empty() || !tools.is_empty()).then(|| DeveloperSettings {
        instructions: (!instructions.is_empty()).then(|| instructions.join("\n\n")),
        tools,
    });
    Ok(Conversation {
        system: Some(SystemSettings {
            reasoning_effort: request.reasoning_effort,
            conversation_start_date: Some(crate::chat::harmony::today()),
            ..Default::default()
        }),
        developer,
        messages,
    })
}

/// An OpenAI chat request rendered by the checkpoint's template: messages as sent (text parts
/// joined), the tools unless `tool_choice` is "none", `chat_template_kwargs` as the template's
/// arguments. Returns the ids and the reply's reader.
fn template_prompt(
    request: &ChatRequest,
    chat: &Arc<TemplateChat>,
    stops: &[u32],
) -> std::result::Result<(Vec<u32>, TemplateReply), String> {
    if request.reasoning_effort.is_some() {
        return Err("reasoning_effort applies to GPT-OSS models; this model's template takes chat_template_kwargs (e.g. {\"enable_thinking\": false})".into());
    }
    let mut messages = Vec::with_capacity(request.messages.len());
    for (i, m) in request.messages.iter().enumerate() {
        if !m["role"].is_string() {
            return Err(format!("messages[{i}] has no role"));
        }
        let mut message = m.clone();
        let text = content_text(&m["content"]).map_err(|e| format!("messages[{i}]: {e}"))?;
        message["content"] = Value::from(text);
        messages.push(message);
    }
    if messages.is_empty() {
        return Err("messages must hold at least one message".into());
    }
    let tools = offered_tools(request)?;
    let tools = (!tools.is_empty()).then_some(tools);
    chat.prompt(&messages, tools, &request.chat_template_kwargs, stops)
        .map_err(|e| e.to_string())
}

impl Shared {
    /// Checks a request's model name.
    fn check_model(&self, model: &Option<String>) -> std::result::Result<(), Response> {
        match model {
            Some(name) if name != &self.name => Err(error(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{name}` does not exist (this server has `{}`)",
                    self.name
                ),
                "model_not_found",
            )),
            _ => Ok(()),
        }
    }

    /// Checks `ids` against the vocabulary and the context before queueing them.
    fn check_prompt(&self, ids: &[u32]) -> std::result::Result<(), Response> {
        if ids.is_empty() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "the prompt is empty",
                "invalid_prompt",
            ));
        }
        if let Some(id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "token {id} is outside this model's vocabulary of {}",
                    self.vocab_size
                ),
                "invalid_prompt",
            ));
        }
        if ids.len() >= self.context {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "This model's context is {} tokens; the prompt has {}",
                    self.context,
                    ids.len()
                ),
                "context_length_exceeded",
            ));
        }
        Ok(())
    }

    /// Queues a job and returns its replies; setting `cancel` ends its generation.
    fn submit(
        &self,
        ids: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingOptions,
        cancel: Arc<AtomicBool>,
    ) -> std::result::Result<mpsc::UnboundedReceiver<Reply>, Response> {
        let (replies, receiver) = mpsc::unbounded_channel();
        let job = Job {
            ids,
            max_tokens: max_tokens.min(self.limits.max_tokens),
            sampling,
            stops: self.stops.clone(),
            replies,
            cancel,
            tally: guards::Tally::current(),
        };
        match self.jobs.try_send(job) {
            Ok(()) => Ok(receiver),
            Err(flume::TrySendError::Full(_)) => {
                let message = format!(
                    "{} requests are already waiting for the model; retry later",
                    self.limits.queue
                );
                let mut response = error(StatusCode::SERVICE_UNAVAILABLE, message, "server_busy");
                let retry = axum::http::HeaderValue::from_static("1");
                response.headers_mut().insert("retry-after", retry);
                Err(response)
            }
            Err(flume::TrySendError::Disconnected(_)) => Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model worker stopped",
                "server_error",
            )),
        }
    }
}

/// A request both completion endpoints take: it names a model.
trait Named {
    fn model(&self) -> &Option<String>;
}

impl Named for ChatRequest {
    fn model(&self) -> &Option<String> {
        &self.model
    }
}

impl Named for CompletionRequest {
    fn model(&self) -> &Option<String> {
        &self.model
    }
}

impl Shared {
    /// The request's body, for this server's model, or the error response.
    fn accept<T: Named>(
        &self,
        payload: std::result::Result<Json<T>, JsonRejection>,
    ) -> std::result::Result<T, Response> {
        let request = body(payload)?;
        self.check_model(request.model())?;
        Ok(request)
    }
}

/// The answer when the worker's replies end without a result (it stopped).
fn worker_stopped() -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the model worker stopped",
        "server_error",
    )
}

/// A JSON body, or an OpenAI-style 400 naming what is wrong with it.
fn body<T>(
    payload: std::result::Result<Json<T>, JsonRejection>,
) -> std::result::Result<T, Response> {
    payload
        .map(|Json(v)| v)
        .map_err(|e| error(StatusCode::BAD_REQUEST, e.body_text(), "invalid_json"))
}

fn finish_reason(finish: Finish, tool_call: bool) -> &'static str {
    match finish {
        _ if tool_call => "tool_calls",
        Finish::Stop(_) => "stop",
        Finish::MaxTokens | Finish::ContextFull | Finish::Cancelled => "length",
    }
}

/// How a reply's tokens are read: Harmony's parser, or the checkpoint's tokenizer and Qwen3's
/// tags.
enum Reader {
    Harmony(StreamParser),
    Tagged(TemplateReply),
}

/// Turns worker replies into content, reasoning and tool calls; shared by the streaming and the
/// plain chat responses.
struct ChatOutput {
    reader: Reader,
    /// The request's stop sequences, matched in the content.
    stop: StopSequences,
    /// The reply ends after its first tool call (`parallel_tool_calls: false`).
    one_call: bool,
    tool_calls: Vec<Value>,
    content: String,
    reasoning: String,
    completion_tokens: usize,
}

/// Deltas `(field, text)` for content and reasoning, and finished tool calls.
type Deltas = (Vec<(&'static str, String)>, Vec<Value>);

impl ChatOutput {
    fn new(reader: Reader, stop: StopSequences) -> ChatOutput {
        ChatOutput {
            reader,
            stop,
            one_call: false,
            tool_calls: Vec::new(),
            content: String::new(),
            reasoning: String::new(),
            completion_tokens: 0,
        }
    }

    fn harmony(tokenizer: Tokenizer, stop: StopSequences) -> ChatOutput {
        ChatOutput::new(Reader::Harmony(StreamParser::new(tokenizer)), stop)
    }

    /// Whether the reply is over before the model ended it: a stop sequence, or the one tool
    /// call asked for (tokens after it are neither read nor counted).
    fn over(&self) -> bool {
        self.stop.stopped() || (self.one_call && !self.tool_calls.is_empty())
    }

    /// The reply's `finish_reason`, `finish` being how its generation ended.
    fn finish_reason(&self, finish: Finish) -> &'static str {
        match finish {
            _ if !self.tool_calls.is_empty() => "tool_calls",
            _ if self.over() => "stop",
            finish => finish_reason(finish, false),
        }
    }

    /// The `usage` of the reply to a prompt of `prompt_tokens`, `reused` of them from the cache.
    fn usage(&self, prompt_tokens: usize, reused: usize) -> Value {
        json!({"prompt_tokens": prompt_tokens,
               "completion_tokens": self.completion_tokens,
               "total_tokens": prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": reused}})
    }

    /// Feeds a token; returns the deltas it makes.
    fn push(&mut self, token: u32) -> Deltas {
        // Tokens the worker made before it saw the reply was over are not part of it.
        if self.over() {
            return Default::default();
        }
        self.completion_tokens += 1;
        match &mut self.reader {
            Reader::Harmony(parser) => {
                let events = parser.push(token).unwrap_or_default();
                self.harmony_events(events)
            }
            Reader::Tagged(reply) => {
                let pieces = reply.push(token);
                self.pieces(pieces)
            }
        }
    }

    /// What the reply left unfinished, at its end: text outside any Harmony message (a model
    /// that does not follow the format, or a header cut by max_tokens) shown as content rather
    /// than lost; or the tagged text held back.
    fn finish(&mut self) -> Deltas {
        if self.stop.stopped() {
            return Default::default();
        }
        let (mut deltas, calls) = if self.over() {
            Default::default()
        } else {
            match &mut self.reader {
                Reader::Harmony(parser) => {
                    let text = parser.unfinished_header().unwrap_or_default().to_string();
                    let mut deltas = Vec::new();
                    let no_content = self.content.is_empty() && !self.stop.holding();
                    if no_content && self.tool_calls.is_empty() && !text.is_empty() {
                        self.add_text("content", text, &mut deltas);
                    }
                    (deltas, Vec::new())
                }
                Reader::Tagged(reply) => {
                    let pieces = reply.finish();
                    self.pieces(pieces)
                }
            }
        };
        // The content held back in case it began a stop sequence.
        let held = self.stop.finish();
        if !held.is_empty() {
            self.content.push_str(&held);
            deltas.push(("content", held));
        }
        (deltas, calls)
    }

    fn add_text(&mut self, field: &'static str, text: String, deltas: &mut Vec<(&str, String)>) {
        let text = match field {
            "content" => self.stop.push(&text),
            _ => text,
        };
        if text.is_empty() {
            return;
        }
        match field {
            "content" => self.content.push_str(&text),
            _ => self.reasoning.push_str(&text),
        }
        deltas.push((field, text));
    }

    fn add_call(&mut self, name: &str, arguments: String, calls: &mut Vec<Value>) {
        let call = json!({
            "index": self.tool_calls.len(),
            "id": format!("call_{}", self.tool_calls.len()),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        self.tool_calls.push(call.clone());
        calls.push(call);
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Deltas {
        let (mut deltas, mut calls) = (Vec::new(), Vec::new());
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => self.add_text("reasoning_content", text, &mut deltas),
                Piece::Content(text) => self.add_text("content", text, &mut deltas),
                Piece::ToolCall { name, arguments } => self.add_call(&name, arguments, &mut calls),
            }
        }
        (deltas, calls)
    }

    fn harmony_events(&mut self, events: Vec<Event>) -> Deltas {
        let (mut deltas, mut calls) = (Vec::new(), Vec::new());
        for event in events {
            match event {
                Event::Text { channel, text } => {
                    // Tool-call arguments arrive whole, with the call.
                    let field = match channel.as_deref() {
                        Some("analysis") => "reasoning_content",
                        Some("commentary") => continue,
                        _ => "content",
                    };
                    self.add_text(field, text, &mut deltas);
                }
                Event::Message(m) => {
                    if let Some(name) = m
                        .recipient
                        .as_deref()
                        .and_then(|r| r.strip_prefix("functions."))
                    {
                        self.add_call(name, m.content, &mut calls);
                    } else if m.channel.as_deref() == Some("commentary") {
                        // Commentary to the user (a preamble) is content.
                        self.add_text("content", m.content, &mut deltas);
                    }
                }
                Event::Stop(_) => {}
            }
        }
        (deltas, calls)
    }
}

/// The prompt's ids and the reader of the reply, for the model's chat format.
fn chat_prompt(
    shared: &Shared,
    request: &ChatRequest,
    stop: StopSequences,
) -> std::result::Result<(Vec<u32>, ChatOutput), Response> {
    let invalid = |e: String| error(StatusCode::BAD_REQUEST, e, "invalid_messages");
    match &shared.format {
        ChatFormat::Template(chat) => {
            let (ids, reply) = template_prompt(request, chat, &shared.stops).map_err(invalid)?;
            Ok((ids, ChatOutput::new(Reader::Tagged(reply), stop)))
        }
        ChatFormat::Harmony => {
            if shared.vocab_size < HARMONY_VOCAB_SIZE {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "chat needs a model with the o200k_harmony vocabulary; use /v1/completions",
                    "unsupported_model",
                ));
            }
            if !request.chat_template_kwargs.is_empty() {
                return Err(invalid(
                    "chat_template_kwargs apply to models with a Jinja chat template; GPT-OSS speaks Harmony (use reasoning_effort)".into(),
                ));
            }
            let conversation = conversation(request).map_err(invalid)?;
            let ids = conversation.render_for_completion(&shared.tokenizer);
            Ok((ids, ChatOutput::harmony(shared.tokenizer, stop)))
        }
    }
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    payload: std::result::Result<Json<ChatRequest>, JsonRejection>,
) -> Response {
    let request = match shared.accept(payload) {
        Ok(r) => r,
        Err(response) => return response,
    };
    let sampling = match request.sampling.options() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, "invalid_sampling"),
    };
    if let Err(e) = request.check_served() {
        return error(StatusCode::BAD_REQUEST, e, "unsupported_parameter");
    }
    let stop = match request.sampling.stop_sequences() {
        Ok(stop) => stop,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, "invalid_stop"),
    };
    let (ids, mut output) = match chat_prompt(&shared, &request, stop) {
        Ok(prompt) => prompt,
        Err(response) => return response,
    };
    output.one_call = request.parallel_tool_calls == Some(false);
    let include_usage = request
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    if let Err(response) = shared.check_prompt(&ids) {
        return response;
    }
    let max_tokens = request.sampling.max_tokens();
    let cancel = Arc::new(AtomicBool::new(false));
    let mut replies = match shared.submit(ids, max_tokens, sampling, cancel.clone()) {
        Ok(r) => r,
        Err(response) => return response,
    };
    let id = format!("chatcmpl-{}", now());
    let created = now();
    let model = shared.name.clone();
    if request.stream {
        let (events, stream) =
            mpsc::channel::<std::result::Result<SseEvent, std::convert::Infallible>>(64);
        tokio::spawn(async move {
            let chunk = |delta: Value| {
                let data = json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": null}],
                });
                Ok(SseEvent::default().data(data.to_string()))
            };
            if events
                .send(chunk(json!({"role": "assistant", "content": ""})))
                .await
                .is_err()
            {
                return;
            }
            while let Some(reply) = replies.recv().await {
                match reply {
                    Reply::Token(token) => {
                        let (deltas, calls) = output.push(token);
                        cancel.fetch_or(output.over(), Ordering::Relaxed);
                        if deltas.is_empty() && calls.is_empty() {
                            // A comment line (ignored by clients): writing something per token is
                            // how a hung-up client is noticed, so that its generation stops.
                            if events
                                .send(Ok(SseEvent::default().comment("")))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                        for (field, text) in deltas {
                            // A closed stream drops `replies`: the worker stops generating.
                            if events.send(chunk(json!({ field: text }))).await.is_err() {
                                return;
                            }
                        }
                        for call in calls {
                            if events
                                .send(chunk(json!({"tool_calls": [call]})))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                    }
                    Reply::Done {
                        prompt_tokens,
                        reused,
                        finish,
                    } => {
                        let (deltas, calls) = output.finish();
                        for (field, text) in deltas {
                            let _ = events.send(chunk(json!({ field: text }))).await;
                        }
                        for call in calls {
                            let _ = events.send(chunk(json!({"tool_calls": [call]}))).await;
                        }
                        let reason = output.finish_reason(finish);
                        let usage = output.usage(prompt_tokens, reused);
                        let last = json!({
                            "id": id, "object": "chat.completion.chunk", "created": created,
                            "model": model,
                            "choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
                            "usage": usage,
                        });
                        let _ = events
                            .send(Ok(SseEvent::default().data(last.to_string())))
                            .await;
                        if include_usage {
                            let usage_chunk = json!({
                                "id": id, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [], "usage": usage,
                            });
                            let _ = events
                                .send(Ok(SseEvent::default().data(usage_chunk.to_string())))
                                .await;
                        }
                        let _ = events.send(Ok(SseEvent::default().data("[DONE]"))).await;
                        return;
                    }
                    Reply::Failed(message) => {
                        let data = json!({"error": {"message": message, "type": "server_error"}});
                        let _ = events
                            .send(Ok(SseEvent::default().data(data.to_string())))
                            .await;
                        let _ = events.send(Ok(SseEvent::default().data("[DONE]"))).await;
                        return;
                    }
                }
            }
        });
        return Sse::new(tokio_stream::wrappers::ReceiverStream::new(stream))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    while let Some(reply) = replies.recv().await {
        match reply {
            Reply::Token(token) => {
                output.push(token);
                cancel.fetch_or(output.over(), Ordering::Relaxed);
            }
            Reply::Done {
                prompt_tokens,
                reused,
                finish,
            } => {
                output.finish();
                let tool_call = !output.tool_calls.is_empty();
                let mut message = json!({
                    "role": "assistant",
                    "content": if tool_call && output.content.is_empty() { Value::Null } else { json!(output.content) },
                });
                if !output.reasoning.is_empty() {
                    message["reasoning_content"] = json!(output.reasoning);
                }
                if tool_call {
                    message["tool_calls"] = json!(output.tool_calls);
                }
                return Json(json!({
                    "id": id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message,
                                 "finish_reason": output.finish_reason(finish)}],
                    "usage": output.usage(prompt_tokens, reused),
                }))
                .into_response();
            }
            Reply::Failed(message) => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, message, "server_error");
            }
        }
    }
    worker_stopped()
}

/// A completion's text as its tokens come: whole characters only (bytes that end inside one wait
/// for the next token), cut before the first stop sequence.
struct CompletionText {
    format: ChatFormat,
    tokenizer: Tokenizer,
    /// Harmony ids whose bytes do not end a character yet.
    pending: Vec<u32>,
    /// The template tokenizer's decoding so far.
    stream: TextStream,
    stop: StopSequences,
    tokens: usize,
}

impl CompletionText {
    fn new(shared: &Shared, stop: StopSequences) -> CompletionText {
        CompletionText {
            format: shared.format.clone(),
            tokenizer: shared.tokenizer,
            pending: Vec::new(),
            stream: TextStream::default(),
            stop,
            tokens: 0,
        }
    }

    /// The text `token` completes (empty while a character or a possible stop sequence is
    /// unfinished, and after a stop sequence).
    fn push(&mut self, token: u32) -> String {
        if self.stop.stopped() {
            return String::new();
        }
        self.tokens += 1;
        let text = match &self.format {
            ChatFormat::Harmony => {
                self.pending.push(token);
                let bytes = self
                    .tokenizer
                    .decode_bytes(&self.pending)
                    .unwrap_or_default();
                match String::from_utf8(bytes) {
                    Ok(text) => {
                        self.pending.clear();
                        text
                    }
                    Err(_) => String::new(),
                }
            }
            ChatFormat::Template(chat) => self.stream.push(&chat.tokenizer, token),
        };
        self.stop.push(&text)
    }

    /// What is left at the end (incomplete characters replaced).
    fn finish(&mut self) -> String {
        if self.stop.stopped() {
            return String::new();
        }
        let text = match &self.format {
            ChatFormat::Harmony => self
                .tokenizer
                .decode_lossy(&self.pending)
                .unwrap_or_default(),
            ChatFormat::Template(chat) => self.stream.finish(&chat.tokenizer),
        };
        let mut text = self.stop.push(&text);
        text.push_str(&self.stop.finish());
        text
    }

    fn finish_reason(&self, finish: Finish) -> &'static str {
        if self.stop.stopped() {
            "stop"
        } else {
            finish_reason(finish, false)
        }
    }
}

async fn completions(
    State(shared): State<Arc<Shared>>,
    payload: std::result::Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    let request = match shared.accept(payload) {
        Ok(r) => r,
        Err(response) => return response,
    };
    let sampling = match request.sampling.options() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, "invalid_sampling"),
    };
    let stop = match request.sampling.stop_sequences() {
        Ok(stop) => stop,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, "invalid_stop"),
    };
    let ids = match &shared.format {
        ChatFormat::Harmony => shared.tokenizer.encode_with_special_tokens(&request.prompt),
        ChatFormat::Template(chat) => match chat.tokenizer.encode(&request.prompt) {
            Ok(ids) => ids,
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string(), "invalid_prompt"),
        },
    };
    if let Err(response) = shared.check_prompt(&ids) {
        return response;
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let max_tokens = request.sampling.max_tokens();
    let mut replies = match shared.submit(ids, max_tokens, sampling, cancel.clone()) {
        Ok(r) => r,
        Err(response) => return response,
    };
    let (id, created, model) = (format!("cmpl-{}", now()), now(), shared.name.clone());
    let mut output = CompletionText::new(&shared, stop);
    if request.stream {
        let (events, stream) =
            mpsc::channel::<std::result::Result<SseEvent, std::convert::Infallible>>(64);
        tokio::spawn(async move {
            while let Some(reply) = replies.recv().await {
                let (text, finish) = match reply {
                    Reply::Token(token) => {
                        let text = output.push(token);
                        cancel.fetch_or(output.stop.stopped(), Ordering::Relaxed);
                        if text.is_empty() {
                            // A comment line, so that a hung-up client is still noticed.
                            if events
                                .send(Ok(SseEvent::default().comment("")))
                                .await
                                .is_err()
                            {
                                return;
                            }
                            continue;
                        }
                        (text, None)
                    }
                    Reply::Done { finish, .. } => {
                        (output.finish(), Some(output.finish_reason(finish)))
                    }
                    Reply::Failed(_) => (String::new(), Some("error")),
                };
                let data = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                                  "choices": [{"index": 0, "text": text, "finish_reason": finish}]});
                if events
                    .send(Ok(SseEvent::default().data(data.to_string())))
                    .await
                    .is_err()
                {
                    return;
                }
                if finish.is_some() {
                    let _ = events.send(Ok(SseEvent::default().data("[DONE]"))).await;
                    return;
                }
            }
        });
        return Sse::new(tokio_stream::wrappers::ReceiverStream::new(stream)).into_response();
    }
    let mut text = String::new();
    while let Some(reply) = replies.recv().await {
        match reply {
            Reply::Token(token) => {
                text.push_str(&output.push(token));
                cancel.fetch_or(output.stop.stopped(), Ordering::Relaxed);
            }
            Reply::Done {
                prompt_tokens,
                finish,
                ..
            } => {
                text.push_str(&output.finish());
                let tokens = output.tokens;
                return Json(json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "finish_reason": output.finish_reason(finish)}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                              "total_tokens": prompt_tokens + tokens},
                }))
                .into_response();
            }
            Reply::Failed(message) => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, message, "server_error");
            }
        }
    }
    worker_stopped()
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    Json(json!({"object": "list", "data": [
        {"id": shared.name, "object": "model", "created": 0, "owned_by": "picchio"}
    ]}))
    .into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let text = (shared.metrics).render(shared.jobs.len(), &shared.model.experts.stats());
    let kind = "text/plain; version=0.0.4; charset=utf-8";
    ([(axum::http::header::CONTENT_TYPE, kind)], text).into_response()
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "no such route", "not_found")
}

/// Serves `model` (called `name`) on `host:port` within `limits` until Ctrl-C or SIGTERM, then
/// lets the requests in flight finish (at most `http::SHUTDOWN_GRACE`) and returns; `ready` is called
/// with the bound address (port 0 picks a free one).
#[allow(clippy::too_many_arguments)] // the CLI's serve options, each used once
pub fn serve(
    model: Model,
    format: ChatFormat,
    name: String,
    context: usize,
    tier: SessionTier,
    host: &str,
    port: u16,
    limits: ServeLimits,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    let model = Arc::new(model);
    let (jobs, queue) = flume::bounded(limits.queue.max(1));
    let counters = Arc::new(metrics::Metrics::default());
    let (worker_model, worker_counters) = (model.clone(), counters.clone());
    let (opened, open_result) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("picchio-model".into())
        .spawn(move || worker(worker_model, context, tier, opened, queue, worker_counters))
        .map_err(|e| Error::io("model worker", e))?;
    // No request is taken before the session opened (on the GPU: weights uploaded).
    open_result
        .recv()
        .map_err(|_| Error::Gpu("the model worker stopped before its session opened".into()))??;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    let bound = |e| Error::io(format!("{host}:{port}"), e);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((host, port)))
        .map_err(bound)?;
    let address = listener.local_addr().map_err(bound)?;
    let connections = http::ConnectionLimits {
        max_open: limits.connections.max(1),
        head_timeout: limits.head_timeout,
    };
    let shared = Arc::new(Shared {
        name,
        context,
        vocab_size: model.config.vocab_size,
        stops: crate::chat::stop_ids(&model.config),
        jobs,
        tokenizer: Tokenizer::o200k_harmony(),
        format,
        limits,
        metrics: counters.clone(),
        model,
        bound_to_loopback: address.ip().is_loopback(),
    });
    ready(address);
    let app = routes(shared);
    runtime.block_on(http::run(
        listener,
        app,
        connections,
        counters,
        stop_signal(),
    ));
    Ok(())
}

/// The API's routes behind the guards every request passes, outermost first: access log,
/// Host allow-list, API key, body limits.
fn routes(shared: Arc<Shared>) -> Router {
    use axum::middleware::from_fn_with_state as guard;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(guard(shared.clone(), guards::limit_body))
        .layer(guard(shared.clone(), guards::authorize))
        .layer(guard(shared.clone(), guards::check_host))
        .layer(guard(shared.clone(), guards::access_log))
        .with_state(shared)
}

/// Ctrl-C, or SIGTERM on Unix.
async fn stop_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::tokenizer::{CALL, RETURN};

    fn run(text: &str) -> (ChatOutput, Vec<(&'static str, String)>, Vec<Value>) {
        let tokenizer = Tokenizer::o200k_harmony();
        let mut output = ChatOutput::harmony(tokenizer, StopSequences::default());
        let (mut deltas, mut calls) = (Vec::new(), Vec::new());
        for token in tokenizer.encode_with_special_tokens(text) {
            let (d, c) = output.push(token);
            deltas.extend(d);
            calls.extend(c);
        }
        (output, deltas, calls)
    }

    /// A Qwen3 reply read through the chat fixture's tokenizer (`output`'s settings applied).
    fn run_tagged(text: &str, edit: impl FnOnce(&mut ChatOutput)) -> ChatOutput {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/qwen3-moe/tiny-qwen3-chat");
        let config = crate::config::Config::load(&dir).unwrap();
        let ChatFormat::Template(chat) = ChatFormat::for_model(&dir, &config).unwrap() else {
            panic!("a template model");
        };
        let messages = [json!({"role": "user", "content": "x"})];
        let (_, reply) = chat.prompt(&messages, None, &Map::new(), &[]).unwrap();
        let mut output = ChatOutput::new(Reader::Tagged(reply), StopSequences::default());
        edit(&mut output);
        for token in chat.tokenizer.encode(text).unwrap() {
            output.push(token);
        }
        output.finish();
        output
    }

    /// `parallel_tool_calls: false` ends the reply after its first call; by default every call
    /// is read.
    #[test]
    fn one_call_ends_the_reply_when_parallel_calls_are_off() {
        let calls = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\
                     <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let text = format!("Sure.\n{calls}");
        let all = run_tagged(&text, |_| {});
        assert_eq!(all.tool_calls.len(), 2, "{:?}", all.tool_calls);
        assert!(!all.over());
        let one = run_tagged(&text, |output| output.one_call = true);
        assert_eq!(one.tool_calls.len(), 1);
        assert_eq!(one.tool_calls[0]["function"]["name"], "a");
        assert!(one.over());
        assert_eq!(one.finish_reason(Finish::MaxTokens), "tool_calls");
        assert_eq!(one.content, all.content);
    }

    /// A stop sequence cuts the content, not the reasoning, and ends the reply.
    #[test]
    fn a_stop_sequence_cuts_the_content_only() {
        let text = "<think>\nplan: say STOP\n</think>\n\nfirst STOP second";
        let output = run_tagged(text, |output| {
            output.stop = StopSequences::parse(Some(&json!(["STOP"]))).unwrap();
        });
        assert_eq!(output.reasoning, "plan: say STOP\n");
        assert_eq!(output.content, "first ");
        assert!(output.over());
        assert_eq!(output.finish_reason(Finish::Cancelled), "stop");
    }

    /// A full queue answers 503 with Retry-After instead of growing without bound.
    #[test]
    fn a_full_queue_is_refused_with_retry_after() {
        let (jobs, _waiting) = flume::bounded(1);
        let shared = Shared {
            name: "m".into(),
            context: 64,
            vocab_size: 256,
            stops: Vec::new(),
            jobs,
            tokenizer: Tokenizer::o200k_harmony(),
            format: ChatFormat::Harmony,
            limits: ServeLimits {
                queue: 1,
                ..Default::default()
            },
            metrics: Default::default(),
            bound_to_loopback: true,
            model: Arc::new(
                Model::load(
                    &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-single"),
                )
                .unwrap(),
            ),
        };
        let options = SamplingOptions::default();
        assert!(
            shared
                .submit(vec![1], 4, options, Default::default())
                .is_ok()
        );
        let refused = shared
            .submit(vec![1], 4, options, Default::default())
            .unwrap_err();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.headers()["retry-after"], "1");
    }

    #[test]
    fn a_generated_tool_call_becomes_tool_calls() {
        let (output, deltas, calls) = run(
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"city\":\"Rome\"}<|call|>",
        );
        assert_eq!(output.reasoning, "Need weather.");
        assert!(
            deltas
                .iter()
                .all(|(field, _)| *field == "reasoning_content")
        );
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Rome\"}");
        assert_eq!(calls[0]["id"], "call_0");
        assert_eq!(
            finish_reason(Finish::Stop(CALL), !output.tool_calls.is_empty()),
            "tool_calls"
        );
    }

    #[test]
    fn analysis_and_final_split_into_reasoning_and_content() {
        let (output, deltas, calls) = run(
            "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
        );
        assert!(calls.is_empty());
        assert_eq!(
            (output.reasoning.as_str(), output.content.as_str()),
            ("Think.", "Hello!")
        );
        let content: String = deltas
            .iter()
            .filter(|(f, _)| *f == "content")
            .map(|(_, t)| t.as_str())
            .collect();
        assert_eq!(content, "Hello!");
        assert_eq!(finish_reason(Finish::Stop(RETURN), false), "stop");
    }

    #[test]
    fn chat_messages_render_tool_calls_and_results() {
        let request: ChatRequest = serde_json::from_value(json!({
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "W"}}]
        }))
        .unwrap();
        let c = conversation(&request).unwrap();
        let developer = c.developer.unwrap();
        assert_eq!(developer.instructions.as_deref(), Some("Be brief."));
        assert_eq!(developer.tools[0].name, "get_weather");
        assert_eq!(
            c.messages[1].recipient.as_deref(),
            Some("functions.get_weather")
        );
        assert_eq!(c.messages[2].name.as_deref(), Some("functions.get_weather"));
        // A tool result for an unknown call is an error, not a guess.
        let bad: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "y"}]}))
        .unwrap();
        assert!(conversation(&bad).unwrap_err().contains("tool_call_id"));
    }
}
