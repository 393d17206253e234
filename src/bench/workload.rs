//! Workloads: deterministic plans of chat sessions (seeded text, so two runs and two policies
//! see exactly the same prompts). A session is a list of user turns run one after another; each
//! assistant answer is replayed exactly into the next turn's history.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Which workload to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// N conversations × T turns, each answer replayed into the next turn.
    MultiTurn,
    /// K long system prompts × many short questions.
    SharedPrefix,
    /// Short chats beside long prompts.
    Mixed,
    /// Multi-turn conversations over a few shared system prompts, all at once: conversation c
    /// uses prefix c mod P (`--prefixes`), `--conversations` × `--turns`, arrivals shuffled.
    /// The cache-routing case of a chat product with several assistants: each conversation's
    /// history grows on top of a prefix other conversations share.
    PrefixChat,
    /// Twelve long prompts, then one short (≈ 64-token) request (its TTFT is the probe).
    OverloadFairness,
}

impl WorkloadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::Mixed => "mixed",
            WorkloadKind::PrefixChat => "prefix-chat",
            WorkloadKind::OverloadFairness => "overload-fairness",
        }
    }
}

/// Size knobs of a workload (defaults are a short run).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkloadShape {
    /// multi-turn: number of conversations.
    #[arg(long, default_value_t = 8)]
    pub conversations: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// shared-prefix: number of distinct long system prompts.
    #[arg(long, default_value_t = 4)]
    pub prefixes: usize,
    /// shared-prefix: short questions per system prompt.
    #[arg(long, default_value_t = 8)]
    pub questions: usize,
    /// Words in a long prompt (≈ 1.3 tokens per word).
    #[arg(long, default_value_t = 400)]
    pub long_words: usize,
    /// Output tokens requested per request (`max_tokens`).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Seed of the generated text, the shuffles and the think times.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Upper bound of a user's think time before each follow-up turn, ms (uniform, seeded).
    /// Real users don't arrive in lockstep; without it round-robin over N workers with N
    /// lockstep sessions is accidentally sticky.
    #[arg(long, default_value_t = 50)]
    pub think_ms: u64,
}

/// One session: a system prompt (optional) and user turns sent one after another.
#[derive(Clone, Debug)]
pub struct SessionPlan {
    pub id: String,
    /// What this session is inside its workload (e.g. `long`, `short`, `probe`).
    pub class: &'static str,
    pub system: Option<String>,
    pub user_turns: Vec<String>,
    /// Delay after the wave starts before this session's first request.
    pub start_delay: Duration,
    /// Think time before each turn after the first (same length as `user_turns`; entry 0 unused).
    pub think: Vec<Duration>,
    pub max_tokens: u32,
}

const WORDS: &[&str] = &[
    "cache",
    "router",
    "token",
    "block",
    "worker",
    "gateway",
    "prefix",
    "latency",
    "stream",
    "tensor",
    "request",
    "model",
    "answer",
    "policy",
    "service",
    "memory",
    "signal",
    "budget",
    "river",
    "mountain",
    "garden",
    "window",
    "letter",
    "market",
    "winter",
    "silver",
    "engine",
    "harbor",
    "planet",
    "forest",
    "bridge",
    "candle",
    "pocket",
    "ladder",
    "rocket",
    "orange",
    "number",
    "silence",
    "journey",
    "pattern",
    "morning",
    "library",
    "picture",
    "season",
    "quickly",
    "slowly",
    "carefully",
    "brightly",
    "always",
    "never",
    "today",
    "tomorrow",
];

fn words(rng: &mut ChaCha8Rng, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(if i % 12 == 0 { '.' } else { ' ' });
            if i % 12 == 0 {
                out.push(' ');
            }
        }
        out.push_str(WORDS[rng.gen_range(0..WORDS.len())]);
    }
    out.push('.');
    out
}

fn think(rng: &mut ChaCha8Rng, turns: usize, max_ms: u64) -> Vec<Duration> {
    (0..turns)
        .map(|i| {
            if i == 0 || max_ms == 0 {
                Duration::ZERO
            } else {
                Duration::from_millis(rng.gen_range(0..=max_ms))
            }
        })
        .collect()
}

fn question(rng: &mut ChaCha8Rng) -> String {
    format!(
        "In one short sentence, what is a {}?",
        WORDS[rng.gen_range(0..WORDS.len())]
    )
}

/// Build the plan of a workload. Deterministic for a given shape and seed.
pub fn plan(kind: WorkloadKind, shape: &WorkloadShape) -> Vec<SessionPlan> {
    let mut rng = ChaCha8Rng::seed_from_u64(shape.seed);
    let mut out = Vec::new();
    match kind {
        WorkloadKind::MultiTurn => {
            for c in 0..shape.conversations {
                let system = format!(
                    "You are assistant number {c}. Background notes: {}",
                    words(&mut rng, shape.long_words / 2)
                );
                let turns = (0..shape.turns).map(|_| question(&mut rng)).collect();
                out.push(SessionPlan {
                    id: format!("conv{c}"),
                    class: "conversation",
                    system: Some(system),
                    user_turns: turns,
                    start_delay: Duration::ZERO,
                    think: think(&mut rng, shape.turns, shape.think_ms),
                    max_tokens: shape.max_tokens,
                });
            }
        }
        WorkloadKind::SharedPrefix => {
            let prefixes: Vec<String> = (0..shape.prefixes)
                .map(|k| format!("Document {k}: {}", words(&mut rng, shape.long_words)))
                .collect();
            // Interleave questions across prefixes so each prefix recurs over the whole run.
            for q in 0..shape.questions {
                for (k, p) in prefixes.iter().enumerate() {
                    out.push(SessionPlan {
                        id: format!("p{k}q{q}"),
                        class: "question",
                        system: Some(p.clone()),
                        user_turns: vec![question(&mut rng)],
                        start_delay: Duration::ZERO,
                        think: vec![Duration::ZERO],
                        max_tokens: shape.max_tokens,
                    });
                }
            }
            // Arrivals in a seeded random order: interleaved in a fixed rotation, round-robin
            // over as many workers as prefixes would be sticky by accident.
            use rand::seq::SliceRandom;
            out.shuffle(&mut rng);
        }
        WorkloadKind::Mixed => {
            for i in 0..shape.conversations.max(1) {
                out.push(SessionPlan {
                    id: format!("long{i}"),
                    class: "long",
                    system: None,
                    user_turns: vec![format!("Summarise: {}", words(&mut rng, shape.long_words))],
                    start_delay: Duration::ZERO,
                    think: vec![Duration::ZERO],
                    max_tokens: shape.max_tokens,
                });
                out.push(SessionPlan {
                    id: format!("short{i}"),
                    class: "short",
                    system: None,
                    user_turns: (0..shape.turns.max(1))
                        .map(|_| question(&mut rng))
                        .collect(),
                    start_delay: Duration::ZERO,
                    think: think(&mut rng, shape.turns.max(1), shape.think_ms),
                    max_tokens: shape.max_tokens,
                });
            }
        }
        WorkloadKind::PrefixChat => {
            let prefixes: Vec<String> = (0..shape.prefixes.max(1))
                .map(|k| {
                    format!(
                        "You are assistant {k}. Reference material: {}",
                        words(&mut rng, shape.long_words)
                    )
                })
                .collect();
            for c in 0..shape.conversations {
                out.push(SessionPlan {
                    id: format!("p{}c{c}", c % prefixes.len()),
                    class: "conversation",
                    system: Some(prefixes[c % prefixes.len()].clone()),
                    user_turns: (0..shape.turns).map(|_| question(&mut rng)).collect(),
                    start_delay: Duration::ZERO,
                    think: think(&mut rng, shape.turns, shape.think_ms),
                    max_tokens: shape.max_tokens,
                });
            }
            use rand::seq::SliceRandom;
            out.shuffle(&mut rng);
        }
        WorkloadKind::OverloadFairness => {
            for i in 0..12 {
                out.push(SessionPlan {
                    id: format!("long{i}"),
                    class: "long",
                    system: None,
                    user_turns: vec![format!("Summarise: {}", words(&mut rng, shape.long_words))],
                    start_delay: Duration::ZERO,
                    think: vec![Duration::ZERO],
                    max_tokens: shape.max_tokens,
                });
            }
            out.push(SessionPlan {
                id: "probe".into(),
                class: "probe",
                system: None,
                // About 64 prompt tokens with SmolLM2's default system prompt (the probe).
                user_turns: vec![format!(
                    "{} Context: {}",
                    question(&mut rng),
                    words(&mut rng, 18)
                )],
                start_delay: Duration::from_millis(200),
                think: vec![Duration::ZERO],
                max_tokens: shape.max_tokens,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> WorkloadShape {
        WorkloadShape {
            conversations: 3,
            turns: 2,
            prefixes: 2,
            questions: 3,
            long_words: 50,
            max_tokens: 8,
            seed: 1,
            think_ms: 10,
        }
    }

    #[test]
    fn plans_are_deterministic_and_sized() {
        let s = shape();
        let a = plan(WorkloadKind::MultiTurn, &s);
        let b = plan(WorkloadKind::MultiTurn, &s);
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|p| p.user_turns.len() == 2));
        assert_eq!(a[0].system, b[0].system);
        assert_eq!(plan(WorkloadKind::SharedPrefix, &s).len(), 6);
        let f = plan(WorkloadKind::OverloadFairness, &s);
        assert_eq!(f.len(), 13);
        assert_eq!(f[12].class, "probe");
        assert!(f[12].start_delay > Duration::ZERO);
    }

    #[test]
    fn prefix_chat_conversations_share_prefixes_and_run_turns() {
        let mut s = shape();
        s.conversations = 5;
        let p = plan(WorkloadKind::PrefixChat, &s);
        assert_eq!(p.len(), 5);
        assert!(p.iter().all(|c| c.user_turns.len() == s.turns));
        let distinct: std::collections::HashSet<_> = p.iter().map(|c| c.system.clone()).collect();
        assert_eq!(distinct.len(), s.prefixes);
        // Every conversation of one prefix carries exactly that prefix.
        for c in &p {
            let k: usize = c.id[1..c.id.find('c').unwrap()].parse().unwrap();
            assert!(c
                .system
                .as_ref()
                .unwrap()
                .starts_with(&format!("You are assistant {k}.")));
        }
    }

    #[test]
    fn shared_prefix_sessions_share_system_prompts() {
        let p = plan(WorkloadKind::SharedPrefix, &shape());
        let distinct: std::collections::HashSet<_> = p.iter().map(|s| s.system.clone()).collect();
        assert_eq!(distinct.len(), 2);
    }
}
