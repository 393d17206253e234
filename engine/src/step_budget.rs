//! How many tokens the next forward step may hold: a fixed count, or the count that a time
//! target per step allows on this machine, learned from the steps it runs.
//!
//! A request that arrives while a step runs waits for that step and then for its own, so the
//! step's duration — not its token count — bounds a short request's time to first token behind
//! long prefills. A fixed token budget gives a step time that depends on the CPU and on how long
//! the contexts being attended to are; a time target keeps it near `target` everywhere.
//!
//! Model: a step of `n` tokens takes `a + b·n` (a: what every step pays — the weights streamed
//! once, thread hand-offs; b: per token, growing with the contexts attended to). The learner
//! keeps an exponentially weighted mean `c` of seconds per token over *full* steps (those that
//! used at least half the budget they were given, and at least [`MIN_OBSERVED_TOKENS`]) and
//! offers `target / c` tokens. That update is a fixed-point iteration of `n = target · n / (a +
//! b·n)`, whose fixed point is exactly `a + b·n = target`: no need to separate `a` from `b`.
//! The offer is clamped to `[floor, max]`: `max` is the configured token budget (a hard cap
//! either way), `floor` keeps every decode in the step and the per-step cost amortized.

use std::time::Duration;

/// Steps with fewer tokens than this say little about a full step's cost (decode-only steps are
/// bound by reading the weights, not by their tokens) and are not learned from.
pub const MIN_OBSERVED_TOKENS: usize = 32;

/// Weight of the newest full step in the mean (the rest decays geometrically).
const ALPHA: f64 = 0.3;

/// The token budget per step.
#[derive(Clone, Debug)]
pub struct StepBudget {
    max: usize,
    floor: usize,
    target: Option<Duration>,
    /// Mean seconds per token of recent full steps; None before the first.
    per_token_s: Option<f64>,
}

impl StepBudget {
    /// A budget of `max` tokens per step, or, with `target`, as many as fit in it (at least
    /// `floor`, at most `max`). `floor` is raised to 1 and lowered to `max` where needed.
    pub fn new(max: usize, floor: usize, target: Option<Duration>) -> StepBudget {
        let max = max.max(1);
        StepBudget {
            max,
            floor: floor.clamp(1, max),
            target: target.filter(|t| !t.is_zero()),
            per_token_s: None,
        }
    }

    /// Tokens the next step may hold.
    pub fn tokens(&self) -> usize {
        match (self.target, self.per_token_s) {
            (Some(t), Some(c)) if c > 0.0 => {
                let n = t.as_secs_f64() / c;
                if n.is_finite() {
                    (n as usize).clamp(self.floor, self.max)
                } else {
                    self.max
                }
            }
            _ => self.max,
        }
    }

    /// Learns from a step that ran `tokens` tokens in `elapsed`, having been offered `offered`.
    pub fn observe(&mut self, tokens: usize, offered: usize, elapsed: Duration) {
        if self.target.is_none() || tokens < MIN_OBSERVED_TOKENS || tokens * 2 < offered {
            return;
        }
        let c = elapsed.as_secs_f64() / tokens as f64;
        if !c.is_finite() || c <= 0.0 {
            return;
        }
        self.per_token_s = Some(match self.per_token_s {
            None => c,
            Some(prev) => prev + ALPHA * (c - prev),
        });
    }

    /// The learned seconds per token of a full step, if any (for stats and tests).
    pub fn per_token_seconds(&self) -> Option<f64> {
        self.per_token_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine whose step of n tokens takes a + b·n seconds.
    fn run(budget: &mut StepBudget, a: f64, b: f64, steps: usize) -> usize {
        for _ in 0..steps {
            let n = budget.tokens();
            budget.observe(n, n, Duration::from_secs_f64(a + b * n as f64));
        }
        budget.tokens()
    }

    #[test]
    fn without_a_target_the_budget_is_the_fixed_count() {
        let mut b = StepBudget::new(512, 16, None);
        assert_eq!(run(&mut b, 0.05, 0.002, 10), 512);
        assert_eq!(b.per_token_seconds(), None);
    }

    #[test]
    fn converges_to_the_step_size_that_takes_the_target() {
        // 40 ms per step plus 1.5 ms per token: 0.4 s fits (0.4 − 0.04) / 0.0015 = 240 tokens.
        let mut b = StepBudget::new(4096, 16, Some(Duration::from_millis(400)));
        let n = run(&mut b, 0.040, 0.0015, 60);
        assert!((238..=242).contains(&n), "{n}");
        // The contexts grow: 3 ms per token now; it follows (0.36 / 0.003 = 120).
        let n = run(&mut b, 0.040, 0.003, 60);
        assert!((118..=122).contains(&n), "{n}");
    }

    #[test]
    fn the_cap_and_the_floor_hold() {
        let mut fast = StepBudget::new(512, 16, Some(Duration::from_millis(400)));
        assert_eq!(run(&mut fast, 0.001, 0.00001, 20), 512);
        let mut slow = StepBudget::new(512, 64, Some(Duration::from_millis(400)));
        assert_eq!(run(&mut slow, 0.5, 0.01, 20), 64);
    }

    #[test]
    fn small_or_underfilled_steps_are_not_learned_from() {
        let mut b = StepBudget::new(512, 16, Some(Duration::from_millis(400)));
        b.observe(8, 512, Duration::from_millis(30)); // decode-only step
        b.observe(100, 512, Duration::from_millis(900)); // one short prefill, budget not binding
        assert_eq!(b.per_token_seconds(), None);
        assert_eq!(b.tokens(), 512);
        b.observe(300, 512, Duration::from_millis(600));
        assert_eq!(b.tokens(), 200);
    }

    #[test]
    fn degenerate_timings_do_not_break_it() {
        let mut b = StepBudget::new(512, 16, Some(Duration::from_millis(400)));
        b.observe(512, 512, Duration::ZERO);
        assert_eq!(b.tokens(), 512);
        b.observe(512, 512, Duration::from_secs(3600));
        assert_eq!(b.tokens(), 16);
        assert_eq!(StepBudget::new(0, 0, Some(Duration::ZERO)).tokens(), 1);
    }
}
