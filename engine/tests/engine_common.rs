//! Shared helpers of the `engine_*` integration tests (the engine over the simulated
//! executor). Included with `mod engine_common;`; built alone it has no tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use engine::engine::{
    Engine, EngineConfig, EngineStats, FinishReason, GenerateRequest, SeqEvent, SequenceHandle,
    Usage,
};
use engine::executor::{Executor, SeqChunk};
use engine::sampler::{argmax, SamplingParams};
use engine::sim::{SimConfig, SimDecoder, SimExecutor};
use prefix_index::NamespaceSeed;

/// A namespace seed made of one repeated byte.
pub fn ns(n: u8) -> NamespaceSeed {
    NamespaceSeed([n; 32])
}

/// An engine over an instant simulator.
pub fn sim_engine(sim: SimConfig, cfg: EngineConfig) -> Engine {
    let exec = SimExecutor::new(sim).expect("sim config");
    Engine::start(Box::new(exec), Arc::new(SimDecoder), cfg).expect("engine start")
}

/// A greedy request.
pub fn req(
    id: &str,
    prompt: Vec<u32>,
    max_tokens: usize,
    namespace: NamespaceSeed,
) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_string(),
        prompt,
        namespace,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_token_ids: vec![2],
        stop_strings: Vec::new(),
        output: engine::OutputParams::default(),
        cache_insert: true,
        deadline: None,
        constraint: None,
    }
}

/// Everything a handle delivered.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub cached_tokens: Option<usize>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Option<(FinishReason, Usage, Option<prefix_index::BlockKey>)>,
    pub failed: Option<&'static str>,
    /// `SeqEvent::PromptLogprobs`, and the number of `Token`s delivered before it.
    pub prompt_logprobs: Option<(Vec<engine::TokenLogprobs>, usize)>,
}

/// Reads a handle to its end (10 s limit).
pub async fn collect(mut h: SequenceHandle) -> Outcome {
    let mut o = Outcome::default();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), h.next())
            .await
            .expect("sequence event within 10 s");
        match ev {
            None => return o,
            Some(SeqEvent::Started { cached_tokens, .. }) => o.cached_tokens = Some(cached_tokens),
            Some(SeqEvent::Token { id, text, .. }) => {
                o.tokens.push(id);
                o.text.push_str(&text);
            }
            Some(SeqEvent::Finished {
                reason,
                usage,
                last_block_key,
            }) => o.finish = Some((reason, usage, last_block_key)),
            Some(SeqEvent::Failed { code, .. }) => o.failed = Some(code),
            Some(SeqEvent::PromptLogprobs(lps)) => o.prompt_logprobs = Some((lps, o.tokens.len())),
        }
    }
}

/// Greedy tokens of a plain single-sequence, uncached, unchunked run on a fresh simulator
/// (contiguous block table), stopping after `max_tokens` or at eos (not included).
pub fn reference_greedy(sim: &SimConfig, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut cfg = sim.clone();
    cfg.prefill_us_per_token = 0;
    cfg.decode_us_base = 0;
    cfg.decode_us_per_seq = 0;
    let bs = cfg.block_size;
    let blocks = (prompt.len() + max_tokens).div_ceil(bs);
    cfg.num_blocks = blocks.max(1);
    let mut e = SimExecutor::new(cfg.clone()).expect("sim");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut toks = prompt.to_vec();
    let mut out = Vec::new();
    let mut start = 0;
    while out.len() < max_tokens {
        let l = e
            .forward(&[SeqChunk {
                tokens: &toks[start..],
                start_pos: start,
                block_table: &table,
                want_logits: true,
                all_logits: false,
            }])
            .expect("forward");
        let t = argmax(l[0].as_ref().expect("logits"));
        if t == cfg.eos_token_id {
            break;
        }
        start = toks.len();
        toks.push(t);
        out.push(t);
    }
    out
}

/// Waits (polling the stats, 10 s limit) until `pred` holds; returns the stats.
pub async fn wait_stats(engine: &Engine, pred: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats();
        if pred(&s) {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stats condition not reached: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A seed from the environment (`KVGATE_TEST_SEED`) or fresh, printed for replay.
pub fn test_seed(name: &str) -> u64 {
    let seed = std::env::var("KVGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("{name}: seed = {seed} (replay with KVGATE_TEST_SEED={seed})");
    seed
}
