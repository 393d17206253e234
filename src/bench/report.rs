//! Summaries of a run (percentiles, wall throughput, hit rate, per-worker share), verdicts on
//! declared thresholds, and the output files: JSON Lines, CSV and an SVG chart of the TTFT
//! distribution per label.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::client::RequestRecord;

/// p50/p95/p99 of one quantity.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Pcts {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Nearest-rank percentile over a sorted slice; None when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn pcts(mut v: Vec<f64>) -> Option<Pcts> {
    v.sort_by(|a, b| a.total_cmp(b));
    Some(Pcts {
        p50: percentile(&v, 50.0)?,
        p95: percentile(&v, 95.0)?,
        p99: percentile(&v, 99.0)?,
    })
}

/// The summary of one label (one policy, or one target).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub label: String,
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub ttft: Option<Pcts>,
    pub itl: Option<Pcts>,
    pub e2e: Option<Pcts>,
    /// Completed output tokens / whole-wave wall duration (not decode-only throughput).
    pub wall_output_tok_per_s: f64,
    pub wave_seconds: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// cached / prompt tokens over successful requests.
    pub hit_rate: Option<f64>,
    /// Share of requests per serving worker (fraction of requests whose worker is known).
    pub worker_share: BTreeMap<String, f64>,
    /// Largest worker share divided by the mean share (1.0 = perfectly even).
    pub max_share_over_mean: Option<f64>,
    /// Whether the run hit its time bound before every planned request ran.
    pub truncated: bool,
    /// TTFT of the `probe` class (overload-fairness), when present.
    pub probe_ttft: Option<f64>,
}

/// Summarizes one wave. `pool` names every worker that could have served it: each counts in
/// the share figures with 0 requests when it got none (an idle worker is the worst imbalance,
/// not one to leave out); workers seen but not in `pool` are counted too.
pub fn summarize(
    label: &str,
    recs: &[RequestRecord],
    wave_seconds: f64,
    truncated: bool,
    pool: &[String],
) -> Summary {
    let ok: Vec<&RequestRecord> = recs.iter().filter(|r| r.ok()).collect();
    let ttft = pcts(ok.iter().filter_map(|r| r.ttft_seconds).collect());
    let itl = pcts(
        ok.iter()
            .flat_map(|r| r.inter_token_latencies.iter().copied())
            .collect(),
    );
    let e2e = pcts(ok.iter().map(|r| r.e2e_seconds).collect());
    let out_tokens: u64 = ok.iter().filter_map(|r| r.actual_output_tokens).sum();
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.actual_prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let mut counts: BTreeMap<String, usize> = pool.iter().map(|w| (w.clone(), 0)).collect();
    for r in &ok {
        if let Some(w) = &r.worker {
            *counts.entry(w.clone()).or_default() += 1;
        }
    }
    let known: usize = counts.values().sum();
    let worker_share: BTreeMap<String, f64> = counts
        .iter()
        .map(|(w, c)| (w.clone(), *c as f64 / known.max(1) as f64))
        .collect();
    let max_share_over_mean = if known > 0 {
        let mean = 1.0 / counts.len() as f64;
        worker_share
            .values()
            .copied()
            .fold(None, |m: Option<f64>, s| Some(m.map_or(s, |m| m.max(s))))
            .map(|m| m / mean)
    } else {
        None
    };
    Summary {
        label: label.to_string(),
        requests: recs.len(),
        ok: ok.len(),
        errors: recs.len() - ok.len(),
        ttft,
        itl,
        e2e,
        wall_output_tok_per_s: if wave_seconds > 0.0 {
            out_tokens as f64 / wave_seconds
        } else {
            0.0
        },
        wave_seconds,
        prompt_tokens,
        cached_tokens,
        hit_rate: (prompt_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        worker_share,
        max_share_over_mean,
        truncated,
        probe_ttft: ok
            .iter()
            .find(|r| r.class == "probe")
            .and_then(|r| r.ttft_seconds),
    }
}

/// PASS / FAIL / PARTIAL / INVALID / NOT RUN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    #[serde(rename = "PASS")]
    Pass,
    #[serde(rename = "FAIL")]
    Fail,
    /// Met on a run cut short by its time bound.
    #[serde(rename = "PARTIAL")]
    Partial,
    /// The figure could not be computed (no successful requests, missing usage, > 5% errors).
    #[serde(rename = "INVALID")]
    Invalid,
    #[serde(rename = "NOT RUN")]
    NotRun,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Partial => "PARTIAL",
            Outcome::Invalid => "INVALID",
            Outcome::NotRun => "NOT RUN",
        }
    }
}

/// A verdict on one declared threshold.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub threshold: String,
    pub value: Option<f64>,
    pub limit: f64,
    pub outcome: Outcome,
}

/// Judge `value OP limit` where `value` may be missing; `valid` says whether the run is sound.
pub fn judge(
    threshold: String,
    value: Option<f64>,
    le: bool,
    limit: f64,
    s: &[&Summary],
) -> Verdict {
    let ran = s.iter().all(|s| s.requests > 0);
    let sound = s
        .iter()
        .all(|s| s.ok > 0 && (s.errors as f64) <= 0.05 * s.requests as f64);
    let truncated = s.iter().any(|s| s.truncated);
    let outcome = match value {
        _ if !ran => Outcome::NotRun,
        None => Outcome::Invalid,
        Some(_) if !sound => Outcome::Invalid,
        Some(v) => {
            let met = if le { v <= limit } else { v >= limit };
            match (met, truncated) {
                (false, _) => Outcome::Fail,
                (true, true) => Outcome::Partial,
                (true, false) => Outcome::Pass,
            }
        }
    };
    Verdict {
        threshold,
        value,
        limit,
        outcome,
    }
}

/// A user-declared threshold `metric<=x` or `metric>=x` on one label's summary.
/// Metrics: ttft_p50, ttft_p95, ttft_p99, itl_p50, itl_p95, e2e_p50, e2e_p95, hit_rate,
/// wall_output_tok_per_s, error_rate, max_share_over_mean, probe_ttft.
pub fn parse_threshold(s: &str) -> Result<(String, bool, f64), String> {
    let (name, le, rest) = if let Some((a, b)) = s.split_once("<=") {
        (a, true, b)
    } else if let Some((a, b)) = s.split_once(">=") {
        (a, false, b)
    } else {
        return Err(format!(
            "threshold `{s}`: expected METRIC<=VALUE or METRIC>=VALUE"
        ));
    };
    let v: f64 = rest
        .trim()
        .parse()
        .map_err(|_| format!("threshold `{s}`: `{rest}` is not a number"))?;
    let name = name.trim().to_string();
    if metric(&name, &empty_summary()).is_err() {
        return Err(format!("threshold `{s}`: unknown metric `{name}`"));
    }
    Ok((name, le, v))
}

fn empty_summary() -> Summary {
    summarize("", &[], 0.0, false, &[])
}

pub fn metric(name: &str, s: &Summary) -> Result<Option<f64>, String> {
    Ok(match name {
        "ttft_p50" => s.ttft.map(|p| p.p50),
        "ttft_p95" => s.ttft.map(|p| p.p95),
        "ttft_p99" => s.ttft.map(|p| p.p99),
        "itl_p50" => s.itl.map(|p| p.p50),
        "itl_p95" => s.itl.map(|p| p.p95),
        "e2e_p50" => s.e2e.map(|p| p.p50),
        "e2e_p95" => s.e2e.map(|p| p.p95),
        "hit_rate" => s.hit_rate,
        "wall_output_tok_per_s" => Some(s.wall_output_tok_per_s),
        "error_rate" => (s.requests > 0).then(|| s.errors as f64 / s.requests as f64),
        "max_share_over_mean" => s.max_share_over_mean,
        "probe_ttft" => s.probe_ttft,
        other => return Err(format!("unknown metric `{other}`")),
    })
}

/// Write `records.jsonl`, `records.csv`, `summary.json` and `ttft.svg` into `dir`.
pub fn write_outputs(
    dir: &Path,
    recs: &[RequestRecord],
    summaries: &[Summary],
    verdicts: &[Verdict],
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut jsonl = String::new();
    for r in recs {
        jsonl.push_str(&serde_json::to_string(r).map_err(std::io::Error::other)?);
        jsonl.push('\n');
    }
    std::fs::write(dir.join("records.jsonl"), jsonl)?;
    std::fs::write(dir.join("records.csv"), csv(recs))?;
    let summary = serde_json::json!({"summaries": summaries, "verdicts": verdicts});
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&summary).map_err(std::io::Error::other)?,
    )?;
    std::fs::write(dir.join("ttft.svg"), ttft_svg(recs))?;
    Ok(())
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_default()
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

pub fn csv(recs: &[RequestRecord]) -> String {
    let mut out = String::from(
        "label,workload,session,class,turn,request_id,context_limit,actual_prompt_tokens,requested_output_tokens,actual_output_tokens,finish_reason,cached_tokens,ttft_seconds,mean_itl_seconds,e2e_seconds,status,worker,error\n",
    );
    for r in recs {
        let mean_itl = (!r.inter_token_latencies.is_empty()).then(|| {
            r.inter_token_latencies.iter().sum::<f64>() / r.inter_token_latencies.len() as f64
        });
        let fields = [
            r.label.clone(),
            r.workload.clone(),
            r.session.clone(),
            r.class.clone(),
            r.turn.to_string(),
            r.request_id.clone(),
            opt(&r.context_limit),
            opt(&r.actual_prompt_tokens),
            r.requested_output_tokens.to_string(),
            opt(&r.actual_output_tokens),
            opt(&r.finish_reason),
            opt(&r.cached_tokens),
            opt(&r.ttft_seconds),
            opt(&mean_itl),
            r.e2e_seconds.to_string(),
            r.status.to_string(),
            opt(&r.worker),
            opt(&r.error),
        ];
        let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// The empirical CDF of TTFT per label, as an SVG line chart.
pub fn ttft_svg(recs: &[RequestRecord]) -> String {
    let mut by_label: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in recs.iter().filter(|r| r.ok()) {
        if let Some(t) = r.ttft_seconds {
            by_label.entry(&r.label).or_default().push(t);
        }
    }
    let (w, h, m) = (640.0, 400.0, 50.0);
    let xmax = by_label
        .values()
        .flatten()
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"];
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\
<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">TTFT distribution (empirical CDF) per policy</text>\
<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>",
        w / 2.0,
        h - m,
        w - m,
        h - m,
        h - m
    );
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        let x = m + f * (w - 2.0 * m);
        let y = h - m - f * (h - 2.0 * m);
        let _ = write!(
            svg,
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{:.3}s</text><text x=\"{}\" y=\"{y}\" text-anchor=\"end\">{:.2}</text>",
            h - m + 16.0,
            f * xmax,
            m - 4.0,
            f
        );
    }
    for (i, (label, mut v)) in by_label.into_iter().enumerate() {
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len() as f64;
        let mut pts = format!("{m},{}", h - m);
        for (k, t) in v.iter().enumerate() {
            let x = m + t / xmax * (w - 2.0 * m);
            let y0 = h - m - (k as f64 / n) * (h - 2.0 * m);
            let y1 = h - m - ((k + 1) as f64 / n) * (h - 2.0 * m);
            let _ = write!(pts, " {x:.1},{y0:.1} {x:.1},{y1:.1}");
        }
        let c = colors[i % colors.len()];
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{pts}\"/>\
<text x=\"{}\" y=\"{}\" fill=\"{c}\">{label} (n={})</text>",
            w - m - 150.0,
            h - m - 20.0 - 16.0 * i as f64,
            v.len()
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Print the summaries and verdicts, write the output files into `dir`; true when every verdict
/// is PASS.
pub fn print_and_write(
    dir: &Path,
    recs: &[RequestRecord],
    summaries: &[Summary],
    verdicts: &[Verdict],
) -> anyhow::Result<bool> {
    print!("{}", table(summaries));
    for v in verdicts {
        let value = v
            .value
            .map(|v| format!("{v:.3}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "  {:<8} {} (value {value})",
            v.outcome.as_str(),
            v.threshold
        );
    }
    write_outputs(dir, recs, summaries, verdicts)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", dir.display()))?;
    println!("  outputs: {}", dir.display());
    Ok(verdicts.iter().all(|v| v.outcome == Outcome::Pass))
}

/// A human-readable table of summaries.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>10}",
        "label",
        "reqs",
        "err",
        "ttft_p50",
        "ttft_p95",
        "itl_p50",
        "e2e_p50",
        "hit",
        "wall_tok/s",
        "max_share"
    );
    let f = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
    for s in summaries {
        let _ = writeln!(
            out,
            "{:<14} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9.1} {:>10}",
            s.label,
            s.requests,
            s.errors,
            f(s.ttft.map(|p| p.p50)),
            f(s.ttft.map(|p| p.p95)),
            f(s.itl.map(|p| p.p50)),
            f(s.e2e.map(|p| p.p50)),
            f(s.hit_rate),
            s.wall_output_tok_per_s,
            f(s.max_share_over_mean)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        label: &str,
        ttft: f64,
        worker: &str,
        prompt: u64,
        cached: u64,
        status: u16,
    ) -> RequestRecord {
        RequestRecord {
            label: label.into(),
            workload: "w".into(),
            session: "s".into(),
            class: "c".into(),
            turn: 0,
            request_id: "r".into(),
            context_limit: Some(8192),
            actual_prompt_tokens: Some(prompt),
            requested_output_tokens: 4,
            actual_output_tokens: Some(4),
            finish_reason: Some("length".into()),
            cached_tokens: Some(cached),
            ttft_seconds: Some(ttft),
            inter_token_latencies: vec![0.01, 0.02],
            e2e_seconds: ttft + 0.03,
            started_at: 0.0,
            status,
            worker: Some(worker.into()),
            error: None,
            answer: String::new(),
        }
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 95.0), Some(95.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
    }

    #[test]
    fn summary_counts_hits_shares_and_errors() {
        let recs = vec![
            rec("a", 0.1, "w1", 100, 50, 200),
            rec("a", 0.2, "w1", 100, 0, 200),
            rec("a", 0.3, "w2", 100, 100, 200),
            rec("a", 9.0, "w2", 100, 100, 429),
        ];
        let s = summarize("a", &recs, 2.0, false, &[]);
        assert_eq!((s.requests, s.ok, s.errors), (4, 3, 1));
        assert_eq!(s.hit_rate, Some(0.5));
        assert_eq!(s.wall_output_tok_per_s, 6.0);
        assert!((s.worker_share["w1"] - 2.0 / 3.0).abs() < 1e-9);
        assert!((s.max_share_over_mean.unwrap() - 4.0 / 3.0).abs() < 1e-9);
        // Idle workers of the pool count: w1 and w2 busy, w3 and w4 idle → w1 holds 2/3 of the
        // traffic where an even split gives 1/4.
        let pool: Vec<String> = ["w1", "w2", "w3", "w4"].map(String::from).to_vec();
        let s = summarize("a", &recs, 2.0, false, &pool);
        assert_eq!(s.worker_share["w4"], 0.0);
        assert!((s.max_share_over_mean.unwrap() - 8.0 / 3.0).abs() < 1e-9);
        // 25% errors make any verdict on this summary INVALID.
        let v = judge("hit_rate>=0.1".into(), s.hit_rate, false, 0.1, &[&s]);
        assert_eq!(v.outcome, Outcome::Invalid);
    }

    #[test]
    fn verdicts() {
        let recs = vec![rec("a", 0.1, "w1", 10, 5, 200)];
        let s = summarize("a", &recs, 1.0, false, &[]);
        assert_eq!(
            judge("x".into(), Some(1.0), true, 2.0, &[&s]).outcome,
            Outcome::Pass
        );
        assert_eq!(
            judge("x".into(), Some(3.0), true, 2.0, &[&s]).outcome,
            Outcome::Fail
        );
        assert_eq!(
            judge("x".into(), None, true, 2.0, &[&s]).outcome,
            Outcome::Invalid
        );
        let t = summarize("a", &recs, 1.0, true, &[]);
        assert_eq!(
            judge("x".into(), Some(1.0), true, 2.0, &[&t]).outcome,
            Outcome::Partial
        );
        let e = summarize("a", &[], 1.0, false, &[]);
        assert_eq!(
            judge("x".into(), Some(1.0), true, 2.0, &[&e]).outcome,
            Outcome::NotRun
        );
    }

    #[test]
    fn thresholds_parse() {
        assert_eq!(
            parse_threshold("ttft_p50<=0.5").unwrap(),
            ("ttft_p50".into(), true, 0.5)
        );
        assert_eq!(
            parse_threshold("hit_rate >= 0.9").unwrap(),
            ("hit_rate".into(), false, 0.9)
        );
        assert!(parse_threshold("nope<=1").is_err());
        assert!(parse_threshold("ttft_p50<1").is_err());
        assert!(parse_threshold("ttft_p50<=x").is_err());
    }

    #[test]
    fn csv_and_svg_render() {
        let mut r = rec("rr", 0.1, "w1", 10, 0, 200);
        r.error = Some("a,b".into());
        let c = csv(&[r.clone()]);
        assert_eq!(c.lines().count(), 2);
        assert!(c.contains("\"a,b\""));
        let svg = ttft_svg(&[
            rec("rr", 0.1, "w1", 10, 0, 200),
            rec("kv", 0.05, "w2", 10, 5, 200),
        ]);
        assert!(svg.starts_with("<svg") && svg.contains("rr (n=1)") && svg.contains("kv (n=1)"));
    }
}
