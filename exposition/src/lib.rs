//! exposition: how the gateway and the worker answer `GET /metrics` — one rule for both.
//!
//! Owns content negotiation as Prometheus does it (a scraper that accepts
//! `application/openmetrics-text` gets OpenMetrics 1.0.0; anything else — `text/plain;
//! version=0.0.4`, `*/*`, no `Accept` — gets the classic text format 0.0.4) and the translation
//! of `prometheus-client`'s OpenMetrics text into the classic format. Does not own the metrics
//! themselves (each binary registers its own into its own `Registry`).
//!
//! The classic form differs from OpenMetrics in exactly what this crate rewrites: a counter's
//! `# HELP`/`# TYPE` lines name the sample (`foo_total`, not the family `foo`), there is no
//! `# UNIT` and no `# EOF` line, `_created` samples are dropped, and `info` / `stateset`
//! families are typed `gauge`. Cost: O(text).

use prometheus_client::registry::Registry;

/// Content type of OpenMetrics text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic Prometheus text format.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Which exposition format to answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    Classic,
}

impl Format {
    /// The format for an `Accept` header: OpenMetrics only when the client names
    /// `application/openmetrics-text` with a non-zero quality.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Classic;
        };
        let wants_om = accept.split(',').any(|part| {
            let mut fields = part.split(';').map(str::trim);
            let media = fields.next().unwrap_or_default();
            let q_zero = fields.any(|f| {
                f.strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !q_zero
        });
        if wants_om {
            Format::OpenMetrics
        } else {
            Format::Classic
        }
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS,
            Format::Classic => CLASSIC,
        }
    }
}

/// Renders `registry` in `format`.
pub fn render(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(match format {
        Format::OpenMetrics => out,
        Format::Classic => to_classic(&out),
    })
}

/// Translates OpenMetrics text (as `prometheus-client` writes it) into the classic format.
pub fn to_classic(openmetrics: &str) -> String {
    // First pass: the type of every family.
    let mut types: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, kind)) = rest.split_once(' ') {
                types.insert(name, kind.trim());
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line
            .strip_prefix("# HELP ")
            .map(|r| ("HELP", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("TYPE", r)));
        if let Some((what, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let kind = types.get(name).copied().unwrap_or("untyped");
            let name = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            let tail = if what == "TYPE" {
                match kind {
                    "info" | "stateset" => "gauge",
                    "unknown" => "untyped",
                    other => other,
                }
            } else {
                tail
            };
            out.push_str(&format!("# {what} {name} {tail}\n"));
            continue;
        }
        let sample_name = line.split(['{', ' ']).next().unwrap_or_default();
        let created = sample_name
            .strip_suffix("_created")
            .is_some_and(|family| types.get(family) == Some(&"counter"));
        if !created {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn negotiates_as_prometheus_does() {
        assert_eq!(Format::negotiate(None), Format::Classic);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Classic
        );
        assert_eq!(Format::negotiate(Some("*/*")), Format::Classic);
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            )),
            Format::OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text; q=0, text/plain")),
            Format::Classic
        );
    }

    #[test]
    fn classic_text_names_counters_by_their_samples() {
        let mut r = Registry::with_prefix("t");
        let c = Counter::<u64>::default();
        c.inc_by(3);
        r.register("reqs", "Requests", c);
        let g = Gauge::<i64>::default();
        g.set(-2);
        r.register("depth", "Depth", g);
        let h = Histogram::new([1.0, 2.0]);
        h.observe(1.5);
        r.register("lat", "Latency", h);
        let om = render(&r, Format::OpenMetrics).unwrap();
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(om.contains("# TYPE t_reqs counter"), "{om}");
        let classic = render(&r, Format::Classic).unwrap();
        assert!(!classic.contains("# EOF"), "{classic}");
        assert!(
            classic.contains("# HELP t_reqs_total Requests.\n"),
            "{classic}"
        );
        assert!(
            classic.contains("# TYPE t_reqs_total counter\n"),
            "{classic}"
        );
        assert!(classic.contains("t_reqs_total 3\n"), "{classic}");
        assert!(
            classic.contains("# TYPE t_depth gauge\nt_depth -2\n"),
            "{classic}"
        );
        assert!(classic.contains("# TYPE t_lat histogram\n"), "{classic}");
        assert!(
            classic.contains("t_lat_bucket{le=\"+Inf\"} 1\n"),
            "{classic}"
        );
    }
}
