//! The generation endpoints, `POST /v1/chat/completions` and `POST /v1/completions`, streaming
//! (SSE) and not, and the receipt of every request they answer.
//!
//! Path of one request:
//! 1. [`tickets::TicketGate::admit`] — request id and route ticket (401 / 400, no receipt: the request is
//!    not attributable);
//! 2. the body is read up to the configured limit (413, no receipt), then the ticket is claimed
//!    ([`tickets::TicketGate::claim`]: 401 `ticket_replayed`, no receipt — the first use has one);
//! 3. from here on every answer writes a signed receipt: validation (400), tokenization and the
//!    token budget (400 `context_length_exceeded`), the engine's refusal (429 + `Retry-After`),
//!    then the engine run;
//! 4. a *driver* task owns the [`SequenceHandle`] and forwards its events through a bounded
//!    channel to the HTTP response. It `select!`s on the channel closing, so a client that goes
//!    away (stream or not) drops the handle at once — the engine frees the sequence's blocks —
//!    and the receipt records the cancellation (status 499, code `client_disconnected`);
//! 5. the driver writes the receipt *before* the last message reaches the client, so a client
//!    that has read the end of its answer can fetch the receipt immediately.
//!
//! Streaming answers wait for the engine's `Started` event (or `Failed`) before sending
//! headers, so an admission timeout is still a real 429 status.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use crate::api_error::ApiError;
use crate::output_parser;
use crate::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, CompletionChoice, CompletionResponse, FunctionCallBody, FunctionDelta, ToolCallBody,
    ToolCallDelta, UsageBody,
};
use crate::tickets::{self, Admission, RECEIPT_HEADER, REQUEST_ID_HEADER};
use crate::validate;
use crate::AppState;
use engine::{GenerateRequest, SeqEvent};
use prompt_profile::{PromptSource, TokenBudget};

/// Which OpenAI endpoint (shapes the response objects).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
    /// `POST /v1/responses`: a chat request in the Responses API's shape (`crate::responses`).
    Responses,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completion => "completions",
            Endpoint::Responses => "responses",
        }
    }
}

/// HTTP status recorded in the receipt of a request whose client went away.
pub const CLIENT_CLOSED_STATUS: u16 = 499;

/// Who asked, and the receipt as far as it is known before the engine runs (request id,
/// ticket, model, profile, request hash, arrival); the outcome fields are filled in place by
/// whoever ends the request, so each receipt field is written once.
#[derive(Clone, Debug)]
struct ReceiptCtx {
    admission: Admission,
    draft: receipts::ReceiptDraft,
}

impl ReceiptCtx {
    /// The receipt of an answer that ran no generation (validation, budget, engine refusal).
    fn refused(&self, e: &ApiError, prompt_tokens: usize) -> receipts::ReceiptDraft {
        receipts::ReceiptDraft {
            status: e.status.as_u16(),
            error_code: Some(e.code.to_string()),
            prompt_tokens: to_u32(prompt_tokens),
            response_sha256: empty_sha256(),
            ..self.draft.clone()
        }
    }
}

fn empty_sha256() -> String {
    hex::encode(Sha256::digest(b""))
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Stamps the completion time, signs and appends the receipt (on the blocking pool: the log
/// may fsync). Whether it was written.
async fn write_receipt(st: &Arc<AppState>, mut draft: receipts::ReceiptDraft) -> bool {
    draft.completed_at_ms = receipts::now_ms();
    if let Some(t) = draft.ticket.as_ref().map(|s| s.ticket_unverified()) {
        if let (Some(predicted), 200) = (t.predicted_matched_tokens, draft.status) {
            st.metrics
                .routed_prefix(&t.service, &t.rule_id, predicted, draft.cached_tokens);
        }
    }
    let log = st.receipts.clone();
    let res = tokio::task::spawn_blocking(move || log.append(draft)).await;
    match res {
        Ok(Ok(_)) => {
            st.metrics.receipt_written();
            true
        }
        Ok(Err(e)) => {
            st.metrics.receipt_failed();
            tracing::error!(error = %e, "receipt append failed");
            false
        }
        Err(e) => {
            st.metrics.receipt_failed();
            tracing::error!(error = %e, "receipt task failed");
            false
        }
    }
}

/// The answer that replaces one whose receipt could not be written, when the worker requires
/// receipts (`ServerSettings::require_receipts`, the default).
fn unreceipted(st: &AppState) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "receipt_failed",
        "the answer is withheld: its receipt could not be written to the receipt log",
    );
    e.retry_after_s = Some(st.settings.retry_after_s);
    e
}

/// `e` as it may be answered after its receipt was (`written`) or was not written: without a
/// receipt the worker requiring receipts answers `receipt_failed` instead.
fn after_receipt(st: &AppState, e: ApiError, written: bool) -> ApiError {
    if written || !st.settings.require_receipts {
        e
    } else {
        unreceipted(st)
    }
}

/// `x-request-id` (and, when a receipt names it, `x-kvgate-receipt`) on an answer.
pub(crate) fn with_ids(mut resp: Response, request_id: &str, receipt: bool) -> Response {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        if receipt {
            resp.headers_mut().insert(RECEIPT_HEADER, v.clone());
        }
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp
}

/// An error answer before any receipt context exists (no receipt written).
fn early_error(
    st: &AppState,
    endpoint: Endpoint,
    e: ApiError,
    request_id: Option<&str>,
) -> Response {
    st.metrics.rejection(e.code);
    st.metrics.request(endpoint.label(), e.status.as_u16());
    let id = request_id
        .map(str::to_string)
        .unwrap_or_else(tickets::generate_request_id);
    with_ids(e.into_response(), &id, false)
}

/// An error answer after the receipt context exists: writes the receipt first.
async fn receipted_error(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    ctx: &ReceiptCtx,
    e: ApiError,
    prompt_tokens: usize,
) -> Response {
    st.metrics.rejection(e.code);
    st.metrics.request(endpoint.label(), e.status.as_u16());
    let written = write_receipt(st, ctx.refused(&e, prompt_tokens)).await;
    let e = after_receipt(st, e, written);
    with_ids(e.into_response(), &ctx.admission.request_id, written)
}

/// Reads the body up to `limit` bytes; `Err` is the 413 (or a read error).
pub(crate) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
        .with_detail("limit_bytes", limit)
    };
    if let Some(len) = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(too_large());
        }
    }
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let is_limit = std::error::Error::source(&e)
                .map(|s| s.is::<http_body_util::LengthLimitError>())
                .unwrap_or(false)
                || e.to_string().contains("length limit");
            if is_limit {
                Err(too_large())
            } else {
                Err(ApiError::bad_request(
                    "body_read_error",
                    None,
                    format!("could not read the request body: {e}"),
                ))
            }
        }
    }
}

/// Tokenizes the plan's prompt by the prompt contract (on the blocking pool), refusing a prompt
/// that provably breaks `budget` before (or while) it is tokenized.
async fn tokenize(
    st: &Arc<AppState>,
    prompt: PromptSource,
    budget: TokenBudget,
    requested: Option<usize>,
) -> Result<Vec<u32>, ApiError> {
    let profile = st.profile.clone();
    let job = move || {
        profile
            .tokenize_within(&prompt, budget, requested)
            .map(|t| t.ids)
            .map_err(|e| validate::prompt_error(&e, prompt.param()))
    };
    tokio::task::spawn_blocking(job).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("tokenizer task failed: {e}"),
        ))
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, Endpoint::Chat, headers, body).await
}

/// `POST /v1/responses` (`crate::responses`).
pub async fn responses(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, Endpoint::Responses, headers, body).await
}

/// `POST /v1/responses/input_tokens`: the prompt tokens a `POST /v1/responses` of the same body
/// would be charged (its `usage.input_tokens`), by the same reading (`responses_to_chat`, the
/// chat validation) and the same tokenization; with `truncation: "auto"` the turns kept,
/// without it a prompt over the context counted all the same. Nothing is generated or
/// receipted: like `/v1/tokenize`, it needs the gateway's access token where route tickets are
/// required (a gateway counts for its clients itself).
pub async fn input_tokens(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let bytes = match read_body(body, &headers, st.settings.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let plan = prompt_profile::responses_to_chat(&bytes)
        .map_err(ApiError::from)
        .and_then(|chat| validate::chat(&chat, &st.schemas));
    let plan = match plan {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let budget = match plan.prompt.truncates() {
        true => TokenBudget {
            context_limit: st.context_limit,
            native_reserve: st.settings.native_reserve,
        },
        false => TokenBudget {
            context_limit: usize::MAX,
            native_reserve: 0,
        },
    };
    match tokenize(&st, plan.prompt, budget, plan.max_tokens).await {
        Ok(ids) => axum::Json(
            serde_json::json!({"object": "response.input_tokens", "input_tokens": ids.len()}),
        )
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, Endpoint::Completion, headers, body).await
}

/// What the gateway stores of a Responses API request (`prompt_profile::STORED_HEADER`), read
/// only from a request with a verified route ticket: from anyone else the header means nothing.
fn stored(headers: &HeaderMap, ctx: &ReceiptCtx) -> Option<prompt_profile::Stored> {
    ctx.admission.ticket.as_ref()?;
    headers
        .get(prompt_profile::STORED_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(prompt_profile::Stored::parse)
}

async fn handle(st: Arc<AppState>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let received = Instant::now();
    let received_at_ms = receipts::now_ms();
    let header_id = tickets::header_request_id(&headers).ok().flatten();
    let admission = match st.tickets.admit(&headers) {
        Ok(a) => a,
        Err(e) => return early_error(&st, endpoint, e, header_id.as_deref()),
    };
    let bytes = match read_body(body, &headers, st.settings.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return early_error(&st, endpoint, e, Some(&admission.request_id)),
    };
    if let Err(e) = st.tickets.claim(&admission) {
        return early_error(&st, endpoint, e, Some(&admission.request_id));
    }
    let ctx = ReceiptCtx {
        draft: receipts::ReceiptDraft {
            request_id: admission.request_id.clone(),
            ticket: admission.ticket.clone(),
            model: st.identity.model_id.clone(),
            profile_digest: st.profile_digest.clone(),
            request_sha256: hex::encode(Sha256::digest(&bytes)),
            received_at_ms,
            ..receipts::ReceiptDraft::default()
        },
        admission,
    };
    let plan = match endpoint {
        Endpoint::Chat => validate::chat(&bytes, &st.schemas),
        Endpoint::Completion => validate::completion(&bytes),
        // The Responses API has no `n`: one answer.
        Endpoint::Responses => prompt_profile::responses_to_chat(&bytes)
            .map_err(ApiError::from)
            .and_then(|chat| validate::chat(&chat, &st.schemas))
            .and_then(|p| match p.n {
                1 => Ok(p),
                _ => Err(ApiError::bad_request(
                    "unknown_parameter",
                    Some("n"),
                    "the Responses API has no `n`",
                )),
            }),
    };
    let mut plan = match plan {
        Ok(p) => p,
        Err(e) => return receipted_error(&st, endpoint, &ctx, e, 0).await,
    };
    match tickets::no_cache_header(&headers) {
        Ok(true) => plan.cache_insert = false,
        Ok(false) => {}
        Err(e) => return receipted_error(&st, endpoint, &ctx, e, 0).await,
    }
    if !st.settings.served_model_names.is_empty()
        && !st
            .settings
            .served_model_names
            .iter()
            .any(|m| m == &plan.model)
    {
        let e = ApiError::not_found(
            "model_not_found",
            format!(
                "model `{}` is not served here (served: {})",
                plan.model,
                st.settings.served_model_names.join(", ")
            ),
        )
        .with_param(Some("model"));
        return receipted_error(&st, endpoint, &ctx, e, 0).await;
    }
    let source = std::mem::replace(&mut plan.prompt, PromptSource::Tokens(Vec::new()));
    let param = source.param();
    // `echo`: a text prompt comes back as it was sent, token ids as their text.
    let echo_text = match (&source, plan.echo) {
        (PromptSource::Text(t), true) => Some(t.clone()),
        _ => None,
    };
    let budget = TokenBudget {
        context_limit: st.context_limit,
        native_reserve: st.settings.native_reserve,
    };
    let prompt = match tokenize(&st, source, budget, plan.max_tokens).await {
        Ok(p) => p,
        Err(e) => return receipted_error(&st, endpoint, &ctx, e, 0).await,
    };
    let prompt_tokens = prompt.len();
    let echo = match (plan.echo, echo_text) {
        (false, _) => None,
        (true, Some(text)) => Some(Echo::new(text, &prompt)),
        (true, None) => match st.profile.decode(&prompt, false) {
            Ok(text) => Some(Echo::new(text, &prompt)),
            Err(e) => {
                let e = ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    format!("the prompt's text for echo: {e}"),
                );
                return receipted_error(&st, endpoint, &ctx, e, prompt_tokens).await;
            }
        },
    };
    let max_tokens = match budget.output_tokens(
        prompt_tokens,
        plan.max_tokens,
        st.settings.default_max_tokens,
    ) {
        Ok(n) => n,
        Err(e) => {
            let e = validate::prompt_error(&e, param);
            return receipted_error(&st, endpoint, &ctx, e, prompt_tokens).await;
        }
    };
    // The answer parser of this request (chat only): tool calls when the request offers tools
    // and the worker knows the model's format, reasoning unless `separate_reasoning: false`; a
    // forced call (`tool_choice`) is JSON whatever the model's format.
    let tool_format = st
        .settings
        .tool_call_parser
        .filter(|_| plan.answer.tool_calls && plan.answer.forced.is_none());
    let reasoning_format = st
        .settings
        .reasoning_parser
        .filter(|_| endpoint != Endpoint::Completion && plan.answer.separate_reasoning);
    let starts_in_reasoning = reasoning_format.is_some() && {
        // Does the rendered prompt end inside an open `<think>`? Its last tokens tell.
        let tail = &prompt[prompt.len().saturating_sub(16)..];
        st.profile
            .decode(tail, false)
            .is_ok_and(|t| output_parser::prompt_opens_reasoning(&t))
    };
    // One parser per choice; each choice's tool-call ids derive from its own id.
    let parsers: Vec<output_parser::AnswerParser> = (0..plan.n)
        .map(|i| {
            let id = choice_id(&ctx.admission.request_id, i);
            match &plan.answer.forced {
                Some(call) => output_parser::AnswerParser::forced(call.clone(), &id),
                None => output_parser::AnswerParser::new(
                    reasoning_format,
                    tool_format,
                    starts_in_reasoning,
                    &id,
                )
                .with_single_call(plan.answer.single_call),
            }
        })
        .collect();
    let default_skip_special = !tool_format.is_some_and(|f| f.needs_special_tokens());
    let (stop_token_ids, output) = match plan.output.resolve(
        st.profile.end_of_generation_ids(),
        st.profile.vocab_size(),
        max_tokens,
        default_skip_special,
    ) {
        Ok(o) => o,
        Err(e) => return receipted_error(&st, endpoint, &ctx, e, prompt_tokens).await,
    };
    if let Err(e) = plan.check_logit_bias(st.profile.vocab_size()) {
        return receipted_error(&st, endpoint, &ctx, e, prompt_tokens).await;
    }
    let constraint = match &plan.format {
        validate::AnswerFormat::Text => None,
        validate::AnswerFormat::JsonObject => {
            st.metrics.constrained("json_object");
            Some(engine::Constraint::JsonObject(st.token_table()))
        }
        validate::AnswerFormat::JsonSchema(s) => {
            st.metrics.constrained("json_schema");
            Some(engine::Constraint::JsonSchema(st.token_table(), s.clone()))
        }
        validate::AnswerFormat::ToolCall(s) => {
            st.metrics.constrained("tool_call");
            Some(engine::Constraint::JsonSchema(st.token_table(), s.clone()))
        }
    };
    let req = GenerateRequest {
        request_id: ctx.admission.request_id.clone(),
        prompt,
        namespace: ctx.admission.namespace,
        sampling: plan.sampling.clone(),
        max_tokens,
        stop_token_ids,
        stop_strings: plan.stop.clone(),
        output,
        cache_insert: plan.cache_insert,
        deadline: None,
        constraint,
    };
    // `n` choices are `n` sequences of the same prompt, submitted in order: the scheduler admits
    // choices 1.. once choice 0 has computed the prompt's blocks, so they reuse its prefill
    // (engine::scheduler, "Prefix reuse"). A seed gives choice i the seed + i.
    let mut handles = Vec::with_capacity(plan.n);
    for i in 0..plan.n {
        let mut r = req.clone();
        if i > 0 {
            r.request_id = choice_id(&req.request_id, i);
            r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
        }
        match st.engine.submit(r) {
            Ok(h) => handles.push(h),
            Err(e) => {
                drop(handles);
                let e = ApiError::from_engine(&e, st.settings.retry_after_s);
                return receipted_error(&st, endpoint, &ctx, e, prompt_tokens).await;
            }
        }
    }

    let (head_tx, head_rx) = oneshot::channel();
    let (tx, rx) = mpsc::channel::<Msg>(64);
    let driver = Driver {
        st: st.clone(),
        endpoint,
        stream: plan.stream,
        ctx: ctx.clone(),
        prompt_tokens,
        received,
        echo,
    };
    tokio::spawn(driver.run(handles, head_tx, tx));

    match head_rx.await {
        Ok(Ok(())) => {}
        Ok(Err((e, written))) => {
            // The driver wrote (or failed to write) the receipt.
            st.metrics.rejection(e.code);
            st.metrics.request(endpoint.label(), e.status.as_u16());
            return with_ids(e.into_response(), &ctx.admission.request_id, written);
        }
        Err(_) => {
            let e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "engine_stopped",
                "the worker is shutting down",
            );
            st.metrics.request(endpoint.label(), e.status.as_u16());
            return with_ids(e.into_response(), &ctx.admission.request_id, false);
        }
    }
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", ctx.admission.request_id),
            Endpoint::Completion => format!("cmpl-{}", ctx.admission.request_id),
            Endpoint::Responses => format!("resp_{}", ctx.admission.request_id),
        },
        created: received_at_ms / 1000,
        model: plan.model.clone(),
        fingerprint: st.fingerprint.clone(),
    };
    if plan.stream {
        st.metrics.request(endpoint.label(), 200);
        let mut answers: Vec<AnswerStream> = parsers
            .into_iter()
            .map(|p| AnswerStream::new(p, plan.answer.stream_reasoning))
            .collect();
        let keep_alive = KeepAlive::new().interval(Duration::from_secs(15));
        let resp = match (endpoint, answers.pop()) {
            (Endpoint::Responses, Some(answer)) if answers.is_empty() => {
                let echo = crate::responses::Echo::of(&bytes, stored(&headers, &ctx));
                Sse::new(crate::responses::events(meta, echo, answer, rx))
                    .keep_alive(keep_alive)
                    .into_response()
            }
            (_, last) => {
                answers.extend(last);
                let events = sse_events(endpoint, meta, plan.include_usage, answers, rx);
                Sse::new(events).keep_alive(keep_alive).into_response()
            }
        };
        with_ids(resp, &ctx.admission.request_id, true)
    } else {
        let logprobs = plan.output.logprobs.is_some();
        let echo = (endpoint == Endpoint::Responses)
            .then(|| crate::responses::Echo::of(&bytes, stored(&headers, &ctx)));
        let (resp, written) = collect(endpoint, meta, echo, parsers, logprobs, rx).await;
        let status = resp.status().as_u16();
        st.metrics.request(endpoint.label(), status);
        with_ids(resp, &ctx.admission.request_id, written)
    }
}

/// The id of choice `i` of a request: the request's id for choice 0, `{id}#{i}` after it (the
/// engine's sequence id, and the seed of the choice's tool-call ids).
fn choice_id(request_id: &str, i: usize) -> String {
    match i {
        0 => request_id.to_string(),
        _ => format!("{request_id}#{i}"),
    }
}

/// From the driver to the HTTP side. The last message says whether the receipt was written.
pub(crate) enum Msg {
    /// Generated text of choice `.0` (may be empty when only log probabilities came).
    Text(usize, String, Option<LogprobItem>),
    /// Choice `.0`'s echoed prompt (a completion's `echo`), with its tokens' log probabilities
    /// when asked (the first token's none); before any of its generated text.
    Echo(usize, String, Vec<LogprobItem>),
    /// Choice `.0` finished, others are still generating.
    Finish(usize, String),
    /// The last choice to finish, `last` = (its index, its finish reason), and the usage of all.
    End {
        last: (usize, String),
        usage: UsageBody,
        receipted: bool,
    },
    Fail(ApiError, bool),
}

pub(crate) struct ResponseMeta {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) fingerprint: String,
}

struct Driver {
    st: Arc<AppState>,
    endpoint: Endpoint,
    stream: bool,
    ctx: ReceiptCtx,
    prompt_tokens: usize,
    received: Instant,
    /// A completion's `echo`.
    echo: Option<Echo>,
}

/// A completion's `echo`: the prompt's text and token ids, sent as each choice's first text.
struct Echo {
    text: String,
    prompt: Vec<u32>,
}

impl Echo {
    fn new(text: String, prompt: &[u32]) -> Echo {
        Echo {
            text,
            prompt: prompt.to_vec(),
        }
    }

    /// The echoed prompt of a choice: its text, and with the prompt's log probabilities
    /// (`lps`: of prompt tokens 1..) an item per prompt token, the first without any.
    fn msg(
        &self,
        i: usize,
        profile: &prompt_profile::PromptProfile,
        lps: Option<Vec<engine::TokenLogprobs>>,
    ) -> Msg {
        let items = match lps {
            None => Vec::new(),
            Some(lps) => {
                let first = self
                    .prompt
                    .first()
                    .map(|&id| LogprobItem::unscored(profile, id));
                let rest = self
                    .prompt
                    .iter()
                    .skip(1)
                    .zip(lps)
                    .map(|(&id, lp)| LogprobItem::new(profile, id, lp));
                first.into_iter().chain(rest).collect()
            }
        };
        Msg::Echo(i, self.text.clone(), items)
    }
}

/// What the driver knows of one choice.
#[derive(Default)]
struct ChoiceState {
    hasher: Sha256,
    last_token: Option<Instant>,
    completion_tokens: u32,
    finish: Option<String>,
    /// Its echoed prompt went out (a completion's `echo`).
    echoed: bool,
}

/// A sequence's events tagged with its choice index; `None` once when the engine stopped. The
/// handle is dropped (the sequence freed) as soon as it finished or failed.
fn choice_events(
    i: usize,
    handle: engine::SequenceHandle,
) -> impl Stream<Item = (usize, Option<SeqEvent>)> {
    stream::unfold(Some(handle), move |h| async move {
        let mut h = h?;
        match h.next().await {
            Some(ev) => {
                let last = matches!(ev, SeqEvent::Finished { .. } | SeqEvent::Failed { .. });
                Some(((i, Some(ev)), (!last).then_some(h)))
            }
            None => Some(((i, None), None)),
        }
    })
}

/// The receipt's `response_sha256` of these choices (`receipts::response_sha256`).
fn response_hash(choices: Vec<ChoiceState>) -> String {
    let hashes: Vec<[u8; 32]> = choices
        .into_iter()
        .map(|c| c.hasher.finalize().into())
        .collect();
    receipts::response_sha256(&hashes)
}

impl Driver {
    /// Owns the choices' sequences until they end, the client goes away or the server shuts
    /// down.
    async fn run(
        self,
        handles: Vec<engine::SequenceHandle>,
        head_tx: oneshot::Sender<Result<(), (ApiError, bool)>>,
        tx: mpsc::Sender<Msg>,
    ) {
        let st = self.st.clone();
        let n = handles.len();
        let mut head_tx = Some(head_tx);
        let mut choices: Vec<ChoiceState> = (0..n).map(|_| ChoiceState::default()).collect();
        let mut o = receipts::ReceiptDraft {
            prompt_tokens: to_u32(self.prompt_tokens),
            ..self.ctx.draft.clone()
        };
        // The head (the response status) goes once a choice is admitted: the others may wait
        // for it to finish (a worker running one sequence at a time), so their admission
        // failures travel like a failure mid-answer.
        let mut started = false;
        let mut running = n;
        let mut first_token = false;
        let retry = st.settings.retry_after_s;
        let mut events = stream::select_all(
            handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| choice_events(i, h).boxed()),
        );
        enum End {
            Done(Msg),
            HeadFailed(ApiError),
            Cancelled,
        }
        let end = loop {
            if started {
                if let Some(h) = head_tx.take() {
                    if h.send(Ok(())).is_err() {
                        break End::Cancelled;
                    }
                }
            }
            let ev = tokio::select! {
                biased;
                _ = st.shutdown.cancelled() => None,
                _ = tx.closed() => break End::Cancelled,
                ev = events.next() => ev.and_then(|(i, ev)| ev.map(|ev| (i, ev))),
            };
            let Some((i, ev)) = ev else {
                let e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine_stopped",
                    "the worker is shutting down",
                );
                if head_tx.is_some() {
                    break End::HeadFailed(e);
                }
                break End::Done(Msg::Fail(e, false));
            };
            // A completion's `echo`: the prompt goes first, once it is computed — with its log
            // probabilities when they were asked, else before the choice's first token or end.
            let (ev, lps) = match ev {
                SeqEvent::PromptLogprobs(lps) => (None, Some(lps)),
                ev => (Some(ev), None),
            };
            let opens = lps.is_some()
                || matches!(ev, Some(SeqEvent::Token { .. } | SeqEvent::Finished { .. }));
            if let Some(echo) = self.echo.as_ref().filter(|_| opens && !choices[i].echoed) {
                choices[i].echoed = true;
                choices[i].hasher.update(echo.text.as_bytes());
                if tx.send(echo.msg(i, &st.profile, lps)).await.is_err() {
                    break End::Cancelled;
                }
            }
            let Some(ev) = ev else { continue };
            match ev {
                SeqEvent::PromptLogprobs(_) => {}
                SeqEvent::Started {
                    cached_tokens,
                    queue_time,
                } => {
                    st.metrics.observe_queue_time(queue_time.as_secs_f64());
                    if i == 0 {
                        o.cached_tokens = to_u32(cached_tokens);
                    }
                    started = true;
                }
                SeqEvent::Token { id, text, logprobs } => {
                    let now = Instant::now();
                    let c = &mut choices[i];
                    match c.last_token {
                        None if !first_token => {
                            first_token = true;
                            st.metrics
                                .observe_ttft(now.duration_since(self.received).as_secs_f64());
                            o.first_token_at_ms = Some(receipts::now_ms());
                        }
                        None => {}
                        Some(prev) => st
                            .metrics
                            .observe_itl(now.duration_since(prev).as_secs_f64()),
                    }
                    c.last_token = Some(now);
                    c.completion_tokens += 1;
                    let item = logprobs.map(|lp| LogprobItem::new(&st.profile, id, lp));
                    if !text.is_empty() || item.is_some() {
                        c.hasher.update(text.as_bytes());
                        if tx.send(Msg::Text(i, text, item)).await.is_err() {
                            break End::Cancelled;
                        }
                    }
                }
                SeqEvent::Finished {
                    reason,
                    usage,
                    last_block_key,
                } => {
                    if i == 0 {
                        o.prompt_tokens = to_u32(usage.prompt_tokens);
                        o.cached_tokens = to_u32(usage.cached_tokens);
                        o.last_block_key = last_block_key;
                    }
                    let c = &mut choices[i];
                    c.completion_tokens = to_u32(usage.completion_tokens);
                    c.finish = Some(reason.as_str().to_string());
                    // Finished without Started: it was started all the same.
                    started = true;
                    running -= 1;
                    if running > 0 {
                        if tx
                            .send(Msg::Finish(i, reason.as_str().to_string()))
                            .await
                            .is_err()
                        {
                            break End::Cancelled;
                        }
                        continue;
                    }
                    let completion: u32 = choices.iter().map(|c| c.completion_tokens).sum();
                    let msg = Msg::End {
                        last: (i, reason.as_str().to_string()),
                        usage: UsageBody::new(
                            o.prompt_tokens as usize,
                            o.cached_tokens as usize,
                            completion as usize,
                        ),
                        receipted: false,
                    };
                    if let Some(h) = head_tx.take() {
                        // Finished without Started: treat as started now.
                        let _ = h.send(Ok(()));
                    }
                    break End::Done(msg);
                }
                SeqEvent::Failed { error, code } => {
                    let e = ApiError::from_failed(code, error, retry);
                    if head_tx.is_some() {
                        break End::HeadFailed(e);
                    }
                    break End::Done(Msg::Fail(e, false));
                }
            }
        };
        // Free the sequences (and their blocks) before anything slow.
        drop(events);
        o.completion_tokens = choices.iter().map(|c| c.completion_tokens).sum();
        o.finish_reason =
            receipts::finish_reason_of(choices.iter().filter_map(|c| c.finish.as_deref()));
        o.response_sha256 = response_hash(choices);
        match end {
            End::Cancelled => {
                st.metrics.cancelled();
                o.status = CLIENT_CLOSED_STATUS;
                o.error_code = Some("client_disconnected".into());
                write_receipt(&st, o).await;
            }
            End::HeadFailed(e) => {
                o.status = e.status.as_u16();
                o.error_code = Some(e.code.to_string());
                let written = write_receipt(&st, o).await;
                if let Some(h) = head_tx.take() {
                    let _ = h.send(Err((after_receipt(&st, e, written), written)));
                }
            }
            End::Done(mut msg) => {
                match &msg {
                    Msg::Fail(e, _) => {
                        // Streaming: the 200 is already on the wire; the error travels in-band.
                        o.status = if self.stream { 200 } else { e.status.as_u16() };
                        o.error_code = Some(e.code.to_string());
                        st.metrics.rejection(e.code);
                    }
                    _ => o.status = 200,
                }
                let written = write_receipt(&st, o).await;
                msg = match msg {
                    _ if !written && st.settings.require_receipts => {
                        Msg::Fail(unreceipted(&st), false)
                    }
                    Msg::End { last, usage, .. } => Msg::End {
                        last,
                        usage,
                        receipted: written,
                    },
                    Msg::Fail(e, _) => Msg::Fail(e, written),
                    other => other,
                };
                st.metrics
                    .observe_e2e(Instant::now().duration_since(self.received).as_secs_f64());
                let _ = tx.send(msg).await;
            }
        }
        let _ = self.endpoint;
    }
}

/// One choice of a non-streamed answer, as it is gathered.
struct Gathered {
    parser: output_parser::AnswerParser,
    text: String,
    items: Vec<LogprobItem>,
    finish: String,
}

impl Gathered {
    fn chat(mut self, index: usize, logprobs: bool) -> ChatChoice {
        let mut pieces = self.parser.feed(&self.text);
        pieces.extend(self.parser.finish());
        let mut content = String::new();
        let mut reasoning: Option<String> = None;
        let mut tool_calls = Vec::new();
        let mut content_after_calls = false;
        for piece in pieces {
            match piece {
                output_parser::Piece::Content(c) => {
                    content_after_calls |= content.is_empty() && !tool_calls.is_empty();
                    content.push_str(&c)
                }
                output_parser::Piece::Reasoning(r) => {
                    reasoning.get_or_insert_with(String::new).push_str(&r)
                }
                output_parser::Piece::ToolCall(t) => tool_calls.push(ToolCallBody {
                    id: t.id,
                    kind: "function".into(),
                    function: FunctionCallBody {
                        name: t.name,
                        arguments: t.arguments,
                    },
                }),
            }
        }
        let finish = finish_with_tools(self.finish, !tool_calls.is_empty());
        let content = if content.is_empty() && !tool_calls.is_empty() {
            None
        } else {
            Some(content)
        };
        ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant".into(),
                content,
                reasoning_content: reasoning,
                tool_calls,
            },
            logprobs: logprobs.then(|| LogprobItem::chat_json(&self.items)),
            finish_reason: finish,
            content_after_calls,
        }
    }

    fn completion(self, index: usize, logprobs: bool) -> CompletionChoice {
        CompletionChoice {
            index,
            logprobs: logprobs.then(|| LogprobItem::completion_json(&self.items)),
            text: self.text,
            finish_reason: Some(self.finish),
        }
    }
}

/// Non-streaming: gathers the driver's messages into one JSON answer, a choice per parser.
/// With whether the answer's receipt was written.
async fn collect(
    endpoint: Endpoint,
    meta: ResponseMeta,
    echo: Option<crate::responses::Echo>,
    parsers: Vec<output_parser::AnswerParser>,
    logprobs: bool,
    mut rx: mpsc::Receiver<Msg>,
) -> (Response, bool) {
    let mut choices: Vec<Gathered> = parsers
        .into_iter()
        .map(|parser| Gathered {
            parser,
            text: String::new(),
            items: Vec::new(),
            finish: String::new(),
        })
        .collect();
    while let Some(m) = rx.recv().await {
        match m {
            Msg::Text(i, t, item) => {
                if let Some(c) = choices.get_mut(i) {
                    c.text.push_str(&t);
                    c.items.extend(item);
                }
            }
            Msg::Echo(i, t, items) => {
                if let Some(c) = choices.get_mut(i) {
                    c.text.push_str(&t);
                    c.items.extend(items);
                }
            }
            Msg::Finish(i, finish) => {
                if let Some(c) = choices.get_mut(i) {
                    c.finish = finish;
                }
            }
            Msg::Fail(e, receipted) => return (e.into_response(), receipted),
            Msg::End {
                last: (i, finish),
                usage,
                receipted,
            } => {
                if let Some(c) = choices.get_mut(i) {
                    c.finish = finish;
                }
                let mut all = choices.into_iter().enumerate();
                let body = match (endpoint, &echo) {
                    (Endpoint::Responses, Some(echo)) => {
                        let choice = all.next().map(|(i, c)| c.chat(i, logprobs));
                        let body = choice.map(|c| crate::responses::body(&meta, echo, &c, &usage));
                        serde_json::to_vec(&body)
                    }
                    (Endpoint::Chat | Endpoint::Responses, _) => {
                        serde_json::to_vec(&ChatCompletionResponse {
                            id: meta.id,
                            object: "chat.completion".into(),
                            created: meta.created,
                            model: meta.model,
                            system_fingerprint: meta.fingerprint,
                            choices: all.map(|(i, c)| c.chat(i, logprobs)).collect(),
                            usage,
                        })
                    }
                    (Endpoint::Completion, _) => serde_json::to_vec(&CompletionResponse {
                        id: meta.id,
                        object: "text_completion".into(),
                        created: meta.created,
                        model: meta.model,
                        system_fingerprint: meta.fingerprint,
                        choices: all.map(|(i, c)| c.completion(i, logprobs)).collect(),
                        usage: Some(Some(usage)),
                    }),
                };
                let resp = match body {
                    Ok(b) => (
                        StatusCode::OK,
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        b,
                    )
                        .into_response(),
                    Err(e) => ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "internal_error",
                        e.to_string(),
                    )
                    .into_response(),
                };
                return (resp, receipted);
            }
        }
    }
    (
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "engine_stopped",
            "the worker is shutting down",
        )
        .into_response(),
        false,
    )
}

fn json_event<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

/// Streaming: the driver's messages as OpenAI SSE chunks, ending with `data: [DONE]`. Each
/// chunk carries one choice's piece, tagged with its `index`; a chat choice's first chunk is its
/// role chunk, sent with its first piece.
fn sse_events(
    endpoint: Endpoint,
    meta: ResponseMeta,
    include_usage: bool,
    answers: Vec<AnswerStream>,
    rx: mpsc::Receiver<Msg>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let meta = Arc::new(meta);
    let usage_slot = if include_usage { Some(None) } else { None };
    let chunk = {
        let meta = meta.clone();
        move |index: usize,
              delta: ChatDelta,
              finish: Option<String>,
              logprobs: Option<Value>|
              -> Event {
            match endpoint {
                Endpoint::Chat | Endpoint::Responses => json_event(&ChatCompletionChunk {
                    id: meta.id.clone(),
                    object: "chat.completion.chunk".into(),
                    created: meta.created,
                    model: meta.model.clone(),
                    system_fingerprint: meta.fingerprint.clone(),
                    choices: vec![ChatChunkChoice {
                        index,
                        delta,
                        logprobs,
                        finish_reason: finish,
                    }],
                    usage: usage_slot.clone(),
                }),
                Endpoint::Completion => json_event(&CompletionResponse {
                    id: meta.id.clone(),
                    object: "text_completion".into(),
                    created: meta.created,
                    model: meta.model.clone(),
                    system_fingerprint: meta.fingerprint.clone(),
                    choices: vec![CompletionChoice {
                        index,
                        text: delta.content.unwrap_or_default(),
                        logprobs,
                        finish_reason: finish,
                    }],
                    usage: usage_slot.clone(),
                }),
            }
        }
    };
    let usage_chunk = {
        let meta = meta.clone();
        move |usage: UsageBody| -> Event {
            match endpoint {
                Endpoint::Chat | Endpoint::Responses => json_event(&ChatCompletionChunk {
                    id: meta.id.clone(),
                    object: "chat.completion.chunk".into(),
                    created: meta.created,
                    model: meta.model.clone(),
                    system_fingerprint: meta.fingerprint.clone(),
                    choices: vec![],
                    usage: Some(Some(usage)),
                }),
                Endpoint::Completion => json_event(&CompletionResponse {
                    id: meta.id.clone(),
                    object: "text_completion".into(),
                    created: meta.created,
                    model: meta.model.clone(),
                    system_fingerprint: meta.fingerprint.clone(),
                    choices: vec![],
                    usage: Some(Some(usage)),
                }),
            }
        }
    };
    // The role chunk of a choice goes out with its first generated piece (not at admission),
    // so that the first body byte a proxy sees marks the first token: the gateway counts a
    // request's prefill as done then (its `active_tokens` load) and measures TTFT from it.
    let role = match endpoint {
        Endpoint::Chat | Endpoint::Responses => Some(ChatDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
            ..ChatDelta::default()
        }),
        Endpoint::Completion => None,
    };
    struct Choice {
        answer: AnswerStream,
        role_sent: bool,
    }
    let choices: Vec<Choice> = answers
        .into_iter()
        .map(|answer| Choice {
            answer,
            role_sent: role.is_none(),
        })
        .collect();
    // A choice's events: its role chunk first if it has not gone yet, then `pieces`.
    let opened = {
        let chunk = chunk.clone();
        move |c: &mut Choice, index: usize, mut pieces: Vec<Event>| -> Vec<Event> {
            match (&role, std::mem::replace(&mut c.role_sent, true)) {
                (Some(r), false) => {
                    pieces.insert(0, chunk(index, r.clone(), None, None));
                    pieces
                }
                _ => pieces,
            }
        }
    };
    // A choice's last events: what its parser held back, then its finish reason.
    let finished = {
        let chunk = chunk.clone();
        let opened = opened.clone();
        move |c: &mut Choice, index: usize, finish: String| -> Vec<Event> {
            let mut v: Vec<Event> = c
                .answer
                .finish()
                .into_iter()
                .map(|d| chunk(index, d, None, None))
                .collect();
            let finish = finish_with_tools(finish, c.answer.made_tool_calls());
            v.push(chunk(index, ChatDelta::default(), Some(finish), None));
            opened(c, index, v)
        }
    };
    stream::unfold(Some((rx, choices)), move |state| {
        let chunk = chunk.clone();
        let usage_chunk = usage_chunk.clone();
        let opened = opened.clone();
        let finished = finished.clone();
        async move {
            let (mut rx, mut choices) = state?;
            let events = match rx.recv().await {
                None => return None,
                Some(Msg::Text(i, t, item)) => {
                    let Some(c) = choices.get_mut(i) else {
                        return Some((Vec::new(), Some((rx, choices))));
                    };
                    let pieces = match endpoint {
                        Endpoint::Chat | Endpoint::Responses => {
                            let mut lp = item.map(|i| LogprobItem::chat_json(&[i]));
                            let mut deltas = c.answer.feed(&t);
                            if deltas.is_empty() && lp.is_some() {
                                deltas.push(ChatDelta::default());
                            }
                            deltas
                                .into_iter()
                                .map(|d| chunk(i, d, None, lp.take()))
                                .collect()
                        }
                        Endpoint::Completion => vec![chunk(
                            i,
                            ChatDelta {
                                content: Some(t),
                                ..ChatDelta::default()
                            },
                            None,
                            item.map(|i| LogprobItem::completion_json(&[i])),
                        )],
                    };
                    opened(c, i, pieces)
                }
                Some(Msg::Echo(i, t, items)) => {
                    let Some(c) = choices.get_mut(i) else {
                        return Some((Vec::new(), Some((rx, choices))));
                    };
                    let lp = (!items.is_empty()).then(|| LogprobItem::completion_json(&items));
                    let delta = ChatDelta {
                        content: Some(t),
                        ..ChatDelta::default()
                    };
                    let pieces = vec![chunk(i, delta, None, lp)];
                    opened(c, i, pieces)
                }
                Some(Msg::Finish(i, finish)) => match choices.get_mut(i) {
                    Some(c) => finished(c, i, finish),
                    None => Vec::new(),
                },
                Some(Msg::End {
                    last: (i, finish),
                    usage,
                    ..
                }) => {
                    let mut v = match choices.get_mut(i) {
                        Some(c) => finished(c, i, finish),
                        None => Vec::new(),
                    };
                    if include_usage {
                        v.push(usage_chunk(usage));
                    }
                    v.push(Event::default().data("[DONE]"));
                    return Some((v, None));
                }
                Some(Msg::Fail(e, _)) => {
                    let error = vec![json_event(&e.body())];
                    // Nothing sent yet: the role chunk of the first choice comes first.
                    let v = match choices.iter().all(|c| !c.role_sent) {
                        true => match choices.get_mut(0) {
                            Some(c) => opened(c, 0, error),
                            None => error,
                        },
                        false => error,
                    };
                    return Some((v, None));
                }
            };
            Some((events, Some((rx, choices))))
        }
    })
    .flat_map(stream::iter)
    .map(Ok)
}

/// `tool_calls` instead of `stop` when the answer made tool calls (OpenAI's finish reason).
fn finish_with_tools(finish: String, made_calls: bool) -> String {
    if made_calls && finish == "stop" {
        "tool_calls".into()
    } else {
        finish
    }
}

/// A streamed chat answer's parser: the pieces of each generated text as OpenAI deltas.
pub(crate) struct AnswerStream {
    parser: output_parser::AnswerParser,
    /// SGLang `stream_reasoning`: false = reasoning held and sent in one delta when it ends.
    stream_reasoning: bool,
    held_reasoning: String,
}

impl AnswerStream {
    fn new(parser: output_parser::AnswerParser, stream_reasoning: bool) -> Self {
        AnswerStream {
            parser,
            stream_reasoning,
            held_reasoning: String::new(),
        }
    }

    fn made_tool_calls(&self) -> bool {
        self.parser.tool_calls() > 0
    }

    pub(crate) fn feed(&mut self, text: &str) -> Vec<ChatDelta> {
        if !self.parser.is_active() {
            return vec![ChatDelta {
                content: Some(text.to_string()),
                ..ChatDelta::default()
            }];
        }
        let pieces = self.parser.feed(text);
        self.deltas(pieces, false)
    }

    pub(crate) fn finish(&mut self) -> Vec<ChatDelta> {
        let pieces = self.parser.finish();
        self.deltas(pieces, true)
    }

    fn deltas(&mut self, pieces: Vec<output_parser::Piece>, end: bool) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        for piece in pieces {
            if !matches!(piece, output_parser::Piece::Reasoning(_)) {
                self.release_reasoning(&mut out);
            }
            match piece {
                output_parser::Piece::Reasoning(r) if self.stream_reasoning => {
                    out.push(ChatDelta {
                        reasoning_content: Some(r),
                        ..ChatDelta::default()
                    })
                }
                output_parser::Piece::Reasoning(r) => self.held_reasoning.push_str(&r),
                output_parser::Piece::Content(c) => out.push(ChatDelta {
                    content: Some(c),
                    ..ChatDelta::default()
                }),
                output_parser::Piece::ToolCall(t) => {
                    out.push(ChatDelta {
                        tool_calls: Some(vec![ToolCallDelta {
                            index: t.index,
                            id: Some(t.id),
                            kind: Some("function".into()),
                            function: FunctionDelta {
                                name: Some(t.name),
                                arguments: Some(String::new()),
                            },
                        }]),
                        ..ChatDelta::default()
                    });
                    out.push(ChatDelta {
                        tool_calls: Some(vec![ToolCallDelta {
                            index: t.index,
                            id: None,
                            kind: None,
                            function: FunctionDelta {
                                name: None,
                                arguments: Some(t.arguments),
                            },
                        }]),
                        ..ChatDelta::default()
                    });
                }
            }
        }
        if end {
            self.release_reasoning(&mut out);
        }
        out
    }

    fn release_reasoning(&mut self, out: &mut Vec<ChatDelta>) {
        if !self.held_reasoning.is_empty() {
            out.push(ChatDelta {
                reasoning_content: Some(std::mem::take(&mut self.held_reasoning)),
                ..ChatDelta::default()
            });
        }
    }
}

/// One generated token's log probabilities with its text and its alternatives' texts.
pub(crate) struct LogprobItem {
    token: String,
    /// `None`: the first token of an echoed prompt (nothing before it to condition on).
    logprob: Option<f32>,
    top: Option<Vec<(String, f32)>>,
}

/// OpenAI writes −∞ as −9999.
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

impl LogprobItem {
    fn new(profile: &prompt_profile::PromptProfile, id: u32, lp: engine::TokenLogprobs) -> Self {
        let text = |id: u32| profile.decode(&[id], false).unwrap_or_default();
        LogprobItem {
            token: text(id),
            logprob: Some(lp.logprob),
            top: Some(lp.top.into_iter().map(|(id, l)| (text(id), l)).collect()),
        }
    }

    /// The first token of an echoed prompt: a text, no log probability (OpenAI's `null`).
    fn unscored(profile: &prompt_profile::PromptProfile, id: u32) -> Self {
        LogprobItem {
            token: profile.decode(&[id], false).unwrap_or_default(),
            logprob: None,
            top: None,
        }
    }

    /// One token as chat's `logprobs.content` and the Responses API's `output_text.logprobs`
    /// write it: `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
    pub(crate) fn chat_entry(&self) -> Value {
        let entry = |t: &str, l: f32| serde_json::json!({"token": t, "logprob": finite(l), "bytes": t.as_bytes()});
        let mut e = entry(&self.token, self.logprob.unwrap_or(f32::NEG_INFINITY));
        let top = self.top.iter().flatten();
        e["top_logprobs"] = Value::Array(top.map(|(t, l)| entry(t, *l)).collect());
        e
    }

    /// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
    fn chat_json(items: &[LogprobItem]) -> Value {
        let content: Vec<Value> = items.iter().map(LogprobItem::chat_entry).collect();
        serde_json::json!({ "content": content })
    }

    /// The legacy completion `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`
    /// (offsets count UTF-8 bytes of the token texts from the first item).
    fn completion_json(items: &[LogprobItem]) -> Value {
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(items.len());
        for i in items {
            offsets.push(offset);
            offset += i.token.len();
        }
        serde_json::json!({
            "tokens": items.iter().map(|i| i.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": items
                .iter()
                .map(|i| i.logprob.map(finite))
                .collect::<Vec<_>>(),
            "top_logprobs": items
                .iter()
                .map(|i| {
                    i.top.as_ref().map(|top| {
                        let m: serde_json::Map<String, Value> = top
                            .iter()
                            .map(|(t, l)| (t.clone(), Value::from(finite(*l))))
                            .collect();
                        Value::Object(m)
                    })
                })
                .collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }
}
