//! The public engine API: submit requests, stream their tokens, read stats and KV events.
//!
//! Owns the step loop — one `std::thread` per engine, owned by the [`Engine`] handles and
//! stopped and joined by [`Engine::shutdown`] or when the last handle is dropped — which
//! receives submissions over a channel, runs the [`Scheduler`] and the [`Executor`], samples,
//! detokenizes, applies stop conditions, and sends [`SeqEvent`]s to each sequence's
//! [`SequenceHandle`] over an unbounded tokio channel (bounded in practice by `max_tokens`).
//! Does not own the model (any [`Executor`]: the candle model or [`crate::sim::SimExecutor`]),
//! the tokenizer (a [`TokenDecoder`] is passed in; each sequence detokenizes through one
//! [`DecodeStream`]) or the HTTP surface (the `worker` crate).
//!
//! Per step: drain commands → drop cancelled sequences (a dropped handle is noticed at the
//! next step boundary at the latest; a dropped waiting handle also wakes an idle loop) →
//! fail waiting sequences past their admission deadline → admit → plan → one
//! `Executor::forward` → sample → publish the step's KV events → update [`EngineStats`].
//!
//! Token accounting: `Usage::completion_tokens` counts every sampled token, a stop token id
//! included (vLLM's convention), while the stop token itself is never sent as a
//! [`SeqEvent::Token`]. When a stop *string* completes, the token that completed it is sent
//! with the text before the stop string, then `Finished { reason: Stop }`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prefix_index::key::{BlockSize, KeyChain};
use prefix_index::{BlockKey, HashAlgorithm, NamespaceSeed};
use tokio::sync::mpsc;

use prompt_profile::{DecodeStream, TokenDecoder};

use crate::executor::{Executor, KvGeometry, Sampled};
use crate::kv::KvEventFeed;
use crate::sampler::{Sampler, SamplingParams, StopChecker, TextStep};
use crate::scheduler::{Scheduled, Scheduler, SchedulerConfig, SeqId, SeqSpec};
use crate::step_budget::StepBudget;
use crate::EngineError;

/// Engine limits. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences running at once (default 16).
    pub max_running: usize,
    /// Requests waiting for admission before `QueueFull` (default 256).
    pub max_waiting: usize,
    /// Tokens per forward step, decodes + prefill chunks (default 256; ≥ `max_running`). 256
    /// rather than 512 since 2026-12-04: the fairness probe's short request waits about two
    /// steps, and side by side the smaller step lost no prefill throughput (docs/benchmarks.md,
    /// "fairness probe").
    pub step_token_budget: usize,
    /// Largest prefill chunk of one sequence per step (default 128).
    pub prefill_chunk: usize,
    /// Time target per forward step (default none): when set, each step holds as many tokens
    /// as fit in it on this machine, learned from the steps run (at least `max_running` and
    /// 64, at most `step_token_budget`); see [`crate::step_budget`].
    pub step_time_target: Option<Duration>,
    /// Admission deadline when a request gives none (default 30 s).
    pub default_admission_timeout: Duration,
    /// Hash algorithm of the block keys (default xxh3).
    pub hash_algorithm: HashAlgorithm,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 16,
            max_waiting: 256,
            step_token_budget: 256,
            prefill_chunk: 128,
            step_time_target: None,
            default_admission_timeout: Duration::from_secs(30),
            hash_algorithm: HashAlgorithm::Xxh3,
        }
    }
}

impl EngineConfig {
    /// Every problem with the limits, or Ok.
    pub fn validate(&self) -> Result<(), EngineError> {
        let mut problems = Vec::new();
        if self.max_running == 0 {
            problems.push("max_running must be >= 1".to_string());
        }
        if self.step_token_budget < self.max_running.max(1) {
            problems.push(format!(
                "step_token_budget ({}) must be >= max_running ({})",
                self.step_token_budget, self.max_running
            ));
        }
        if self.prefill_chunk == 0 {
            problems.push("prefill_chunk must be >= 1".to_string());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(EngineError::InvalidRequest(format!(
                "engine config: {}",
                problems.join("; ")
            )))
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Caller's id (echoed by the handle).
    pub request_id: String,
    /// Prompt token ids (non-empty, each < the vocabulary size).
    pub prompt: Vec<u32>,
    /// Prefix-cache namespace (from the route ticket, or the worker's default).
    pub namespace: NamespaceSeed,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Most tokens to generate. 0: the prompt only — computed (its blocks enter the prefix
    /// cache; its log probabilities come with [`OutputParams::prompt_logprobs`]), then the
    /// sequence finishes (`Length`) without sampling.
    pub max_tokens: usize,
    /// Token ids that end the sequence (not emitted), e.g. eos.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the sequence (not emitted unless `output.include_stop_str`; text is held
    /// back while one may form).
    pub stop_strings: Vec<String>,
    /// Output shaping: minimum length, special-token text, stop strings in the output.
    pub output: OutputParams,
    /// False = privacy opt-out: nothing of this request enters the prefix cache.
    pub cache_insert: bool,
    /// Admission deadline (None = config default).
    pub deadline: Option<Instant>,
    /// What the output must be (JSON mode), enforced by masking the logits before sampling;
    /// `None`: anything.
    pub constraint: Option<crate::constraint::Constraint>,
}

/// How a sequence's output is shaped (the vLLM/SGLang extensions `min_tokens`,
/// `skip_special_tokens`, `include_stop_str_in_output` / `no_stop_trim`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputParams {
    /// Until this many tokens were generated the stop token ids cannot be sampled (their logits
    /// are −∞) and stop strings are not matched; 0 = off. At most `max_tokens`.
    pub min_tokens: usize,
    /// Special tokens produce no text (default true).
    pub skip_special_tokens: bool,
    /// A matched stop string is part of the output (default false: dropped).
    pub include_stop_str: bool,
    /// Report each generated token's log probability and this many most likely alternatives
    /// (≤ [`MAX_TOP_LOGPROBS`]); `None` = off. Log probabilities are of the model's raw
    /// distribution (log-softmax of the logits, before penalties, temperature and filters).
    pub logprobs: Option<usize>,
    /// Report the log probability of every prompt token after the first, given the tokens
    /// before it, with this many alternatives (≤ [`MAX_TOP_LOGPROBS`]; the raw distribution, as
    /// `logprobs`), in one [`SeqEvent::PromptLogprobs`]; `None` = off. Such a sequence computes
    /// its whole prompt (no prefix reuse: a reused position has no logits;
    /// [`crate::scheduler::SeqSpec::prompt_logits`]).
    pub prompt_logprobs: Option<usize>,
}

/// The most alternatives [`OutputParams::logprobs`] may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// ln p(token).
    pub logprob: f32,
    /// (id, ln p) of the most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Of `logits` (raw), for `token`, with `k` alternatives. O(V + V·log k).
    pub fn of(logits: &[f32], token: u32, k: usize) -> Self {
        let max = logits
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        // exp in f32 (each term's relative error ~1e-7), summed in f64: a third of the time of
        // exp in f64, which a prompt's log probabilities pay once per position
        // (docs/benchmarks.md, "Scoring a prompt").
        let sum: f64 = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from((x - max).exp()))
            .sum();
        let lse = max + sum.ln() as f32;
        let lp = |x: f32| {
            if x.is_finite() {
                x - lse
            } else {
                f32::NEG_INFINITY
            }
        };
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &x) in logits.iter().enumerate() {
                if !x.is_finite() {
                    continue;
                }
                if top.len() < k || x > top[top.len() - 1].1 {
                    let at = top.partition_point(|&(_, y)| y >= x);
                    top.insert(at, (i as u32, x));
                    top.truncate(k);
                }
            }
        }
        TokenLogprobs {
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&x| lp(x)),
            top: top.into_iter().map(|(i, x)| (i, lp(x))).collect(),
        }
    }
}

impl Default for OutputParams {
    fn default() -> Self {
        OutputParams {
            min_tokens: 0,
            skip_special_tokens: true,
            include_stop_str: false,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token id or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The handle was dropped.
    Cancelled,
}

impl FinishReason {
    /// `"stop"`, `"length"` or `"cancelled"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token counts of a finished sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Sampled tokens (a stop token id included).
    pub completion_tokens: usize,
}

/// What a [`SequenceHandle`] receives.
#[derive(Clone, Debug, PartialEq)]
pub enum SeqEvent {
    /// Once, when admitted (prefix reuse known).
    Started {
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
        /// Submission → admission.
        queue_time: Duration,
    },
    /// With [`OutputParams::prompt_logprobs`], once, after the prompt was computed and before
    /// the first `Token`: entry `i` is prompt token `i + 1`'s (the first prompt token has none),
    /// `prompt − 1` entries.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// One generated token. Exception: when a stop token id ends the sequence while text
    /// was held back (a possible stop-string prefix, or incomplete UTF-8), that text comes
    /// in one last `Token` that repeats the previous token's id; count tokens with `Usage`.
    Token {
        /// Token id.
        id: u32,
        /// Newly completed text ("" while UTF-8 or a stop string is pending).
        text: String,
        /// With [`OutputParams::logprobs`]: this token's (none on the text-only flush).
        logprobs: Option<TokenLogprobs>,
    },
    /// The sequence ended normally; last event.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Counts.
        usage: Usage,
        /// Key of the last full prompt block (None for prompts shorter than a block).
        last_block_key: Option<BlockKey>,
    },
    /// The sequence failed; last event.
    Failed {
        /// Human-readable cause.
        error: String,
        /// Stable code (`EngineError::error_type`).
        code: &'static str,
    },
}

/// Counters and gauges for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Admitted sequences.
    pub running: usize,
    /// Submitted, not yet admitted.
    pub waiting: usize,
    /// Blocks in the pool.
    pub blocks_total: usize,
    /// Blocks held by running sequences.
    pub blocks_used: usize,
    /// Unreferenced blocks holding a cached (published) prefix key.
    pub blocks_cached: usize,
    /// Unreferenced blocks kept as partial tails of finished sequences (evictable, never
    /// published; docs/architecture.md, "Prefix cache").
    pub blocks_tail: usize,
    /// Unreferenced blocks without a key.
    pub blocks_free: usize,
    /// Prompt tokens served from the prefix cache (total).
    pub prefix_hit_tokens: u64,
    /// Prompt tokens admitted (total).
    pub prompt_tokens: u64,
    /// Tokens sampled (total).
    pub generation_tokens: u64,
    /// Forward steps run (total).
    pub steps: u64,
    /// Tokens the next step may hold (the fixed budget, or what the time target allows).
    pub step_budget_tokens: usize,
    /// Prompt tokens not computed yet (waiting and running sequences).
    pub prefill_tokens: usize,
    /// Output tokens still allowed (waiting and running sequences).
    pub decode_tokens: usize,
}

impl EngineStats {
    /// The queued work the KV event stream reports (`event: load`).
    pub fn load(&self) -> prefix_index::WorkerLoad {
        prefix_index::WorkerLoad {
            running: self.running as u64,
            waiting: self.waiting as u64,
            prefill_tokens: self.prefill_tokens as u64,
            decode_tokens: self.decode_tokens as u64,
        }
    }
}

enum Command {
    Submit(Box<Submission>),
    Cancel(SeqId),
    Shutdown,
}

struct Submission {
    id: SeqId,
    req: GenerateRequest,
    tx: mpsc::UnboundedSender<SeqEvent>,
    submitted_at: Instant,
}

/// The stream of one sequence. Dropping it cancels the sequence and frees its blocks (at the
/// next step boundary at the latest).
pub struct SequenceHandle {
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    request_id: String,
    id: SeqId,
    cmd: std_mpsc::Sender<Command>,
}

impl SequenceHandle {
    /// The next event; `None` after the last one (`Finished` / `Failed`).
    pub async fn next(&mut self) -> Option<SeqEvent> {
        self.rx.recv().await
    }

    /// The request id given at submit.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

impl Drop for SequenceHandle {
    fn drop(&mut self) {
        self.rx.close();
        // Wakes an idle loop; harmless when the sequence already ended or the engine stopped.
        let _ = self.cmd.send(Command::Cancel(self.id));
    }
}

impl std::fmt::Debug for SequenceHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceHandle")
            .field("request_id", &self.request_id)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Whether the step loop can still serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineHealth {
    /// The step loop runs.
    Running,
    /// Shut down on purpose.
    Stopped,
    /// The step loop died (a panic in the executor or the scheduler): the message. Every
    /// sequence it held got `Failed { code: "engine_failed" }`, and every later submit is refused.
    Failed(String),
}

struct Inner {
    cmd: Mutex<Option<std_mpsc::Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stopped: Arc<AtomicBool>,
    /// Set (with the panic message) when the step loop died.
    failure: Arc<Mutex<Option<String>>>,
    stats: Arc<Mutex<EngineStats>>,
    queued: Arc<AtomicUsize>,
    load: tokio::sync::watch::Sender<prefix_index::WorkerLoad>,
    next_id: AtomicU64,
    feed: KvEventFeed,
    block_size: usize,
    num_blocks: usize,
    vocab_size: usize,
    config: EngineConfig,
}

impl Inner {
    fn shutdown(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        if let Some(tx) = self.cmd.lock().take() {
            let _ = tx.send(Command::Shutdown);
        }
        let handle = self.thread.lock().take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("block_size", &self.inner.block_size)
            .field("num_blocks", &self.inner.num_blocks)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the step thread over `executor`.
    pub fn start(
        executor: Box<dyn Executor>,
        decoder: Arc<dyn TokenDecoder>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        config.validate()?;
        let geometry = executor.geometry();
        let bs = BlockSize::new(u32::try_from(geometry.block_size).unwrap_or(u32::MAX))
            .map_err(|e| EngineError::InvalidRequest(format!("executor block size: {e}")))?;
        if geometry.num_blocks == 0 {
            return Err(EngineError::InvalidRequest(
                "executor has no KV blocks".into(),
            ));
        }
        let vocab_size = executor.vocab_size();
        let feed = KvEventFeed::new();
        let stats = Arc::new(Mutex::new(EngineStats {
            blocks_total: geometry.num_blocks,
            step_budget_tokens: config.step_token_budget,
            blocks_free: geometry.num_blocks,
            ..EngineStats::default()
        }));
        let queued = Arc::new(AtomicUsize::new(0));
        let (load_tx, _) = tokio::sync::watch::channel(prefix_index::WorkerLoad::default());
        let stopped = Arc::new(AtomicBool::new(false));
        let failure: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let (cmd_tx, cmd_rx) = std_mpsc::channel();
        let sched = Scheduler::new(
            SchedulerConfig {
                max_running: config.max_running,
                step_token_budget: config.step_token_budget,
                prefill_chunk: config.prefill_chunk,
                copy_partial_blocks: executor.copies_blocks(),
                prompt_logits_chunk: crate::scheduler::prompt_logits_chunk(executor.vocab_size()),
            },
            geometry,
        );
        let mut step_loop = StepLoop {
            executor,
            decoder,
            sched,
            rx: cmd_rx,
            feed: feed.clone(),
            stats: stats.clone(),
            queued: queued.clone(),
            load: load_tx.clone(),
            announced: prefix_index::WorkerLoad::default(),
            budget: StepBudget::new(
                config.step_token_budget,
                config.max_running.max(STEP_BUDGET_FLOOR),
                config.step_time_target,
            ),
            totals: EngineStats::default(),
            block_size: bs,
            hash_algorithm: config.hash_algorithm,
            default_timeout: config.default_admission_timeout,
        };
        let (thread_stopped, thread_failure) = (stopped.clone(), failure.clone());
        let thread = std::thread::Builder::new()
            .name("kvgate-engine".into())
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    step_loop.run();
                }));
                if let Err(panic) = run {
                    let msg = panic_message(panic.as_ref());
                    // Refuse new work first, then fail what is held (its state may be torn:
                    // a second panic there only loses the Failed events, never the flags).
                    *thread_failure.lock() = Some(msg.clone());
                    thread_stopped.store(true, Ordering::SeqCst);
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        step_loop.fail_everything(&EngineError::EngineFailed(msg));
                    }));
                }
            })
            .map_err(|e| EngineError::Model(format!("cannot spawn engine thread: {e}")))?;
        Ok(Engine {
            inner: Arc::new(Inner {
                cmd: Mutex::new(Some(cmd_tx)),
                thread: Mutex::new(Some(thread)),
                stopped,
                failure,
                stats,
                queued,
                load: load_tx,
                next_id: AtomicU64::new(1),
                feed,
                block_size: geometry.block_size,
                num_blocks: geometry.num_blocks,
                vocab_size,
                config,
            }),
        })
    }

    /// Queues a request. Fails at once with `InvalidRequest`, `NeverFits`, `QueueFull` or
    /// `EngineStopped`; an admission timeout arrives later as `Failed`.
    pub fn submit(&self, req: GenerateRequest) -> Result<SequenceHandle, EngineError> {
        let inner = &self.inner;
        if inner.stopped.load(Ordering::SeqCst) {
            return Err(match inner.failure.lock().clone() {
                Some(msg) => EngineError::EngineFailed(msg),
                None => EngineError::EngineStopped,
            });
        }
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("empty prompt".into()));
        }
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= inner.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} outside the vocabulary ({})",
                inner.vocab_size
            )));
        }
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        if req.output.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS)
            || req
                .output
                .prompt_logprobs
                .is_some_and(|k| k > MAX_TOP_LOGPROBS)
        {
            return Err(EngineError::InvalidRequest(format!(
                "at most {MAX_TOP_LOGPROBS} top log probabilities"
            )));
        }
        if req.output.min_tokens > req.max_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "min_tokens ({}) exceeds max_tokens ({})",
                req.output.min_tokens, req.max_tokens
            )));
        }
        crate::scheduler::check_fits(
            KvGeometry {
                block_size: inner.block_size,
                num_blocks: inner.num_blocks,
            },
            req.prompt.len(),
            req.max_tokens,
        )?;
        let max_waiting = inner.config.max_waiting;
        if let Err(waiting) = inner
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                (q < max_waiting).then_some(q + 1)
            })
        {
            return Err(EngineError::QueueFull { waiting });
        }
        let id = SeqId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::unbounded_channel();
        let request_id = req.request_id.clone();
        let cmd = inner.cmd.lock().clone();
        let sent = cmd.as_ref().map(|c| {
            c.send(Command::Submit(Box::new(Submission {
                id,
                req,
                tx,
                submitted_at: Instant::now(),
            })))
        });
        match (cmd, sent) {
            (Some(cmd), Some(Ok(()))) => Ok(SequenceHandle {
                rx,
                request_id,
                id,
                cmd,
            }),
            _ => {
                inner.queued.fetch_sub(1, Ordering::SeqCst);
                Err(EngineError::EngineStopped)
            }
        }
    }

    /// Current counters (updated after every step).
    pub fn stats(&self) -> EngineStats {
        let mut s = *self.inner.stats.lock();
        s.waiting = self.inner.queued.load(Ordering::SeqCst);
        s
    }

    /// The engine's queued work, current after every step; a receiver is woken only when it
    /// moved enough since the last wake-up ([`prefix_index::WorkerLoad::moved_from`]); the KV
    /// event stream's `load` messages follow it.
    pub fn watch_load(&self) -> tokio::sync::watch::Receiver<prefix_index::WorkerLoad> {
        self.inner.load.subscribe()
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.inner.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }

    /// Vocabulary size of the executor.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Whether the step loop still serves.
    pub fn health(&self) -> EngineHealth {
        if let Some(msg) = self.inner.failure.lock().clone() {
            return EngineHealth::Failed(msg);
        }
        if self.inner.stopped.load(Ordering::SeqCst) {
            EngineHealth::Stopped
        } else {
            EngineHealth::Running
        }
    }

    /// The KV event feed (subscribe for the gateway).
    pub fn kv_events(&self) -> KvEventFeed {
        self.inner.feed.clone()
    }

    /// Stops and joins the step thread; pending sequences get `Failed { code:
    /// "engine_stopped" }` and KV subscriptions end. Idempotent. Blocks the caller for at
    /// most one forward step.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

/// The engine's per-sequence data inside the scheduler.
struct SeqPayload {
    tx: mpsc::UnboundedSender<SeqEvent>,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    /// Below this many generated tokens, stop ids are masked and stop strings not matched.
    min_tokens: usize,
    /// Report log probabilities with this many alternatives.
    logprobs: Option<usize>,
    /// Report the prompt's log probabilities with this many alternatives.
    prompt_logprobs: Option<usize>,
    /// The prompt's log probabilities computed so far (sent when the prompt is done).
    prompt_lps: Vec<TokenLogprobs>,
    stop: StopChecker,
    detok: DecodeStream,
    /// The constraint's state (JSON mode), when the request has one.
    constraint: Option<crate::constraint::ConstraintState>,
}

struct StepLoop {
    executor: Box<dyn Executor>,
    decoder: Arc<dyn TokenDecoder>,
    sched: Scheduler<SeqPayload>,
    rx: std_mpsc::Receiver<Command>,
    feed: KvEventFeed,
    stats: Arc<Mutex<EngineStats>>,
    queued: Arc<AtomicUsize>,
    /// The latest queued work, for `event: load` messages: always the current value, but
    /// subscribers are woken only when it moved enough from `announced`
    /// ([`prefix_index::WorkerLoad::moved_from`]).
    load: tokio::sync::watch::Sender<prefix_index::WorkerLoad>,
    /// The load subscribers were last woken for.
    announced: prefix_index::WorkerLoad,
    /// Tokens per step: fixed, or learned from a time target.
    budget: StepBudget,
    /// Cumulative counters (copied into `stats`).
    totals: EngineStats,
    block_size: BlockSize,
    hash_algorithm: HashAlgorithm,
    default_timeout: Duration,
}

/// The text of a panic payload.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("engine thread panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("engine thread panicked: {s}")
    } else {
        "engine thread panicked".to_string()
    }
}

/// Fewest tokens a time-targeted step is cut to (with `max_running`, whichever is larger): a
/// step pays for reading the weights whatever it holds, so tiny steps waste it.
const STEP_BUDGET_FLOOR: usize = 64;

/// Longest idle wait while requests are waiting (they are re-examined at least this often).
const WAITING_POLL: Duration = Duration::from_millis(50);

impl StepLoop {
    fn run(&mut self) {
        'outer: loop {
            // 1. Commands: block when there is nothing to run.
            if self.sched.running_len() == 0 {
                let now = Instant::now();
                let wait = if self.sched.waiting_len() > 0 {
                    let until = self
                        .sched
                        .next_deadline()
                        .map_or(WAITING_POLL, |d| d.saturating_duration_since(now));
                    Some(until.min(WAITING_POLL))
                } else {
                    None
                };
                let got = match wait {
                    None => self.rx.recv().map_err(|_| true),
                    Some(w) => match self.rx.recv_timeout(w) {
                        Ok(c) => Ok(c),
                        Err(std_mpsc::RecvTimeoutError::Timeout) => Err(false),
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => Err(true),
                    },
                };
                match got {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break 'outer;
                        }
                    }
                    Err(true) => break 'outer,
                    Err(false) => {}
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break 'outer;
                        }
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => break 'outer,
                }
            }
            // 2. Cancellations: receivers that are gone.
            for id in self.sched.ids_where(|p| p.tx.is_closed()) {
                self.cancel(id);
            }
            // 3. Admission deadlines.
            let now = Instant::now();
            for s in self.sched.expire(now) {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                let e = EngineError::AdmissionTimeout;
                let _ = s.payload.tx.send(SeqEvent::Failed {
                    error: e.to_string(),
                    code: e.error_type(),
                });
            }
            // 4. Admission.
            for id in self.sched.admit(now) {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                if let Some(s) = self.sched.get(id) {
                    self.totals.prompt_tokens += s.prompt_len() as u64;
                    self.totals.prefix_hit_tokens += s.cached_tokens() as u64;
                    let _ = s.payload.tx.send(SeqEvent::Started {
                        cached_tokens: s.cached_tokens(),
                        queue_time: now.saturating_duration_since(s.submitted_at()),
                    });
                }
            }
            // Copies of the cached blocks whose first tokens the admitted requests reuse.
            let copies = self.sched.take_copies();
            if !copies.is_empty() {
                let ok: Vec<bool> = copies
                    .iter()
                    .map(|c| self.executor.copy_block(c.src, c.dst).is_ok())
                    .collect();
                self.sched.copies_done(&copies, &ok);
            }
            // 5. Plan and run one step.
            let offered = self.budget.tokens();
            let (plan, broken) = self.sched.schedule_within(offered);
            for id in broken {
                self.fail(
                    id,
                    &EngineError::Tensor("KV reservation broken (engine bug)".into()),
                );
            }
            if !plan.is_empty() {
                let started = Instant::now();
                self.step(&plan);
                let tokens = plan.iter().map(|c| c.len).sum();
                self.budget.observe(tokens, offered, started.elapsed());
            }
            self.feed.publish(self.sched.take_events());
            self.publish_stats();
        }
        self.stop();
    }

    /// Handles one command; false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Shutdown => false,
            Command::Cancel(id) => {
                self.cancel(id);
                true
            }
            Command::Submit(sub) => {
                self.enqueue(*sub);
                true
            }
        }
    }

    fn enqueue(&mut self, sub: Submission) {
        let Submission {
            id,
            req,
            tx,
            submitted_at,
        } = sub;
        if tx.is_closed() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        let chain = KeyChain::new(req.namespace, self.hash_algorithm, self.block_size);
        let deadline = req
            .deadline
            .unwrap_or_else(|| submitted_at + self.default_timeout);
        let payload = SeqPayload {
            tx,
            sampler: Sampler::new(req.sampling, &req.prompt),
            stop_ids: req.stop_token_ids,
            min_tokens: req.output.min_tokens,
            logprobs: req.output.logprobs,
            prompt_logprobs: req.output.prompt_logprobs,
            prompt_lps: Vec::new(),
            stop: StopChecker::new(&req.stop_strings).keeping_stop(req.output.include_stop_str),
            detok: DecodeStream::new(self.decoder.clone(), req.output.skip_special_tokens),
            constraint: req.constraint.as_ref().map(|c| c.start()),
        };
        self.sched.enqueue(
            id,
            SeqSpec {
                prompt: req.prompt,
                chain,
                max_tokens: req.max_tokens,
                cache_insert: req.cache_insert,
                submitted_at,
                deadline,
                prompt_logits: req.output.prompt_logprobs.is_some(),
            },
            payload,
        );
    }

    fn cancel(&mut self, id: SeqId) {
        if let Some(s) = self.sched.remove(id) {
            if s.admitted_at().is_none() {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            // The receiver is usually gone; if not (explicit cancel), say so.
            let _ = s.payload.tx.send(SeqEvent::Finished {
                reason: FinishReason::Cancelled,
                usage: Usage {
                    prompt_tokens: s.prompt_len(),
                    cached_tokens: s.cached_tokens(),
                    completion_tokens: s.generated().len(),
                },
                last_block_key: s.last_prompt_block_key(),
            });
        }
    }

    fn fail(&mut self, id: SeqId, e: &EngineError) {
        if let Some(s) = self.sched.remove(id) {
            if s.admitted_at().is_none() {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            let _ = s.payload.tx.send(SeqEvent::Failed {
                error: e.to_string(),
                code: e.error_type(),
            });
        }
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason, completion_tokens: usize) {
        if let Some(s) = self.sched.remove(id) {
            let _ = s.payload.tx.send(SeqEvent::Finished {
                reason,
                usage: Usage {
                    prompt_tokens: s.prompt_len(),
                    cached_tokens: s.cached_tokens(),
                    completion_tokens,
                },
                last_block_key: s.last_prompt_block_key(),
            });
        }
    }

    fn step(&mut self, plan: &[Scheduled]) {
        // Sequences whose next token is the plain argmax of the logits (greedy, no penalty, no
        // log probabilities, no stop-id mask): the executor may pick it where the logits are.
        let argmax: Vec<bool> = plan
            .iter()
            .map(|c| {
                c.want_logits
                    && !c.all_logits
                    && self.sched.get(c.id).is_some_and(|s| {
                        let p = s.payload();
                        p.sampler.is_plain_argmax()
                            && p.logprobs.is_none()
                            && p.constraint.is_none()
                            && (s.generated().len() >= p.min_tokens || p.stop_ids.is_empty())
                    })
            })
            .collect();
        let result = {
            let chunks = self.sched.chunks(plan);
            if chunks.len() != plan.len() {
                Err(EngineError::Tensor("plan and chunks disagree".into()))
            } else {
                self.executor.forward_sampled(&chunks, &argmax)
            }
        };
        self.totals.steps += 1;
        let outs = match result {
            Ok(outs) if outs.len() == plan.len() => outs,
            Ok(outs) => {
                let e = EngineError::Tensor(format!(
                    "executor returned {} outputs for {} chunks",
                    outs.len(),
                    plan.len()
                ));
                for c in plan {
                    self.fail(c.id, &e);
                }
                return;
            }
            Err(e) => {
                for c in plan {
                    self.fail(c.id, &e);
                }
                return;
            }
        };
        self.sched.complete(plan);
        // Publish the step's stores before any sequence finishes: a client that sees
        // `Finished` can count on the gateway's index receiving its blocks first.
        self.feed.publish(self.sched.take_events());
        for (c, out) in plan.iter().zip(outs) {
            let out = match (c.all_logits, out) {
                (true, Some(Sampled::Logits(all))) => match self.prompt_logprobs(c, &all) {
                    Ok(last) => last,
                    Err(e) => {
                        self.fail(c.id, &e);
                        continue;
                    }
                },
                (true, _) => {
                    let e = EngineError::Tensor("executor returned no prompt logits".into());
                    self.fail(c.id, &e);
                    continue;
                }
                (false, out) => out,
            };
            if !c.want_logits {
                continue;
            }
            // `max_tokens = 0`: the prompt was all.
            if self.sched.get(c.id).is_some_and(|s| s.max_tokens() == 0) {
                self.finish(c.id, FinishReason::Length, 0);
                continue;
            }
            match out {
                Some(next) => self.on_output(c.id, next),
                None => self.fail(
                    c.id,
                    &EngineError::Tensor("executor returned no logits".into()),
                ),
            }
        }
    }

    /// The log probabilities of the prompt tokens after chunk `c` (every row of `all`: the
    /// distribution after each of its tokens), kept in the sequence's payload; after its last
    /// prompt chunk, sends them all and gives back the last row (the first answer token's
    /// logits). O(chunk × vocab × log k).
    fn prompt_logprobs(
        &mut self,
        c: &Scheduled,
        all: &[f32],
    ) -> Result<Option<Sampled>, EngineError> {
        let vocab = self.executor.vocab_size();
        if vocab == 0 || all.len() != c.len * vocab {
            return Err(EngineError::Tensor(format!(
                "executor returned {} prompt logits for {} tokens of a {vocab}-token vocabulary",
                all.len(),
                c.len
            )));
        }
        let Some(s) = self.sched.get_mut(c.id) else {
            return Ok(None);
        };
        let prompt_len = s.prompt_len();
        let (p, tokens) = s.payload_and_tokens();
        let k = p.prompt_logprobs.unwrap_or(0);
        for (r, row) in all.chunks_exact(vocab).enumerate() {
            if let Some(&next) = tokens[..prompt_len].get(c.start + r + 1) {
                p.prompt_lps.push(TokenLogprobs::of(row, next, k));
            }
        }
        if !c.want_logits {
            return Ok(None);
        }
        let entries = std::mem::take(&mut p.prompt_lps);
        let _ = p.tx.send(SeqEvent::PromptLogprobs(entries));
        Ok(all
            .chunks_exact(vocab)
            .last()
            .map(|l| Sampled::Logits(l.to_vec())))
    }

    fn on_output(&mut self, id: SeqId, next: Sampled) {
        match self.sample_and_emit(id, next) {
            Ok(None) => {}
            Ok(Some((reason, completion))) => self.finish(id, reason, completion),
            Err(e) => self.fail(id, &e),
        }
    }

    /// Samples one token for `id` (or takes the executor's argmax) and sends its text;
    /// `Some((reason, completion tokens))` when the sequence ends with it.
    fn sample_and_emit(
        &mut self,
        id: SeqId,
        next: Sampled,
    ) -> Result<Option<(FinishReason, usize)>, EngineError> {
        let detok_err = |e: prompt_profile::ProfileError| EngineError::Detokenize(e.to_string());
        let Some(s) = self.sched.get_mut(id) else {
            return Ok(None);
        };
        let max_tokens = s.max_tokens();
        let (p, generated) = s.payload_and_generated();
        let early = generated.len() < p.min_tokens;
        let (token, raw) = match next {
            Sampled::Logits(mut logits) => {
                // The raw distribution, before the sampler and the min_tokens mask change the
                // logits.
                let raw = p.logprobs.map(|k| (logits.to_vec(), k));
                if early {
                    for &id in &p.stop_ids {
                        if let Some(l) = logits.get_mut(id as usize) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
                if let Some(c) = &p.constraint {
                    // While `min_tokens` holds the stop ids back, they stay masked.
                    let stops: &[u32] = if early { &[] } else { &p.stop_ids };
                    if !c.mask(&mut logits, stops) {
                        return Err(EngineError::InvalidRequest(
                            "constrained decoding: no token can continue the output".into(),
                        ));
                    }
                }
                (p.sampler.sample(&mut logits), raw)
            }
            // Asked for in `step` only when the sampler is the plain argmax, without log
            // probabilities or a stop-id mask.
            Sampled::Token(t) => (t, None),
        };
        p.sampler.record(token);
        if let Some(c) = p.constraint.as_mut() {
            c.advance(token);
        }
        self.totals.generation_tokens += 1;
        let completion = generated.len() + 1;
        // Stop strings are matched from the `min_tokens`-th token on.
        let checked = completion >= p.min_tokens;
        if p.stop_ids.contains(&token) && !early {
            // Release held-back text that turned out not to be a stop string.
            let tail = p.detok.flush().map_err(detok_err)?.unwrap_or_default();
            let st = p.stop.push_text(&tail);
            let mut text = st.emit;
            if !st.stopped {
                text.push_str(&p.stop.take_pending());
            }
            if !text.is_empty() {
                // A text-only flush that repeats the previous token's id (the stop token
                // is never emitted); see `SeqEvent::Token`.
                let last = generated.last().copied().unwrap_or(token);
                let _ = p.tx.send(SeqEvent::Token {
                    id: last,
                    text,
                    logprobs: None,
                });
            }
            return Ok(Some((FinishReason::Stop, completion)));
        }
        let new_text = p.detok.step(token).map_err(detok_err)?.unwrap_or_default();
        let st = if checked {
            p.stop.push_text(&new_text)
        } else {
            TextStep {
                emit: new_text,
                stopped: false,
            }
        };
        let mut text = st.emit;
        let mut stopped = st.stopped;
        let at_limit = completion >= max_tokens;
        if at_limit && !stopped {
            let tail = p.detok.flush().map_err(detok_err)?.unwrap_or_default();
            let st2 = p.stop.push_text(&tail);
            text.push_str(&st2.emit);
            stopped = st2.stopped;
            if !stopped {
                text.push_str(&p.stop.take_pending());
            }
        }
        let logprobs = raw.map(|(l, k)| TokenLogprobs::of(&l, token, k));
        let _ = p.tx.send(SeqEvent::Token {
            id: token,
            text,
            logprobs,
        });
        self.sched.append_token(id, token);
        Ok(if stopped {
            Some((FinishReason::Stop, completion))
        } else if at_limit {
            Some((FinishReason::Length, completion))
        } else {
            None
        })
    }

    fn publish_stats(&mut self) {
        let c = self.sched.kv().counts();
        let (prefill_tokens, decode_tokens) = self.sched.queued_tokens();
        let st = EngineStats {
            running: self.sched.running_len(),
            waiting: self.queued.load(Ordering::SeqCst),
            blocks_total: c.total,
            blocks_used: c.used,
            blocks_cached: c.cached - self.sched.kv().tails(),
            blocks_tail: self.sched.kv().tails(),
            blocks_free: c.free,
            prefill_tokens,
            decode_tokens,
            step_budget_tokens: self.budget.tokens(),
            ..self.totals
        };
        *self.stats.lock() = st;
        let load = st.load();
        let announce = load.moved_from(&self.announced);
        if announce {
            self.announced = load;
        }
        // The value is always current (a heartbeat reads it); only a move wakes subscribers.
        self.load.send_if_modified(|l| {
            *l = load;
            announce
        });
    }

    fn stop(&mut self) {
        self.fail_everything(&EngineError::EngineStopped);
    }

    /// Fails queued submissions still in the channel, then every known sequence, with `e`;
    /// publishes the last events and closes the feed.
    fn fail_everything(&mut self, e: &EngineError) {
        while let Ok(cmd) = self.rx.try_recv() {
            if let Command::Submit(sub) = cmd {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                let _ = sub.tx.send(SeqEvent::Failed {
                    error: e.to_string(),
                    code: e.error_type(),
                });
            }
        }
        for s in self.sched.drain_all() {
            if s.admitted_at().is_none() {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            let _ = s.payload.tx.send(SeqEvent::Failed {
                error: e.to_string(),
                code: e.error_type(),
            });
        }
        self.feed.publish(self.sched.take_events());
        self.publish_stats();
        self.feed.close();
    }
}

#[cfg(test)]
mod tests {
    use super::TokenLogprobs;

    #[test]
    fn token_logprobs_are_a_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 2.0, 3.0];
        let lp = TokenLogprobs::of(&logits, 3, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        assert!(
            (f64::from(lp.logprob) - (2.0 - z.ln())).abs() < 1e-6,
            "{lp:?}"
        );
        assert_eq!(lp.top.len(), 3);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
        // The two tied maxima first (ids 1 and 4), then id 3 (logit 2).
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(&ids[2..], &[3]);
        assert!(ids[..2].contains(&1) && ids[..2].contains(&4));
        // The probabilities of the finite logits sum to 1.
        let lse = 2.0 - lp.logprob;
        let mass: f64 = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from(x - lse).exp())
            .sum();
        assert!((mass - 1.0).abs() < 1e-5, "{mass}");
        let masked = TokenLogprobs::of(&logits, 2, 0);
        assert_eq!(masked.logprob, f32::NEG_INFINITY);
        assert!(masked.top.is_empty());
    }
}
