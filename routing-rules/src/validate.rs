//! Validation of a parsed rule set: every problem at once, each with its path, never a panic.
//!
//! Checks: identifier syntax and duplicates, empty pools, dangling references (pool → worker,
//! service → pool, rule → profile, match → listener), `kv_exact` without a profile, numeric
//! ranges (block size 1..=1024, weights, timeouts, load ratio), URLs and addresses, hash
//! syntax, salt policies, and pairs of services that could match the same request.
//!
//! Cost: O(W + P·w + R + S² · m) for W workers, P pools of w members, R profiles, S services
//! with m models each (the overlap check compares every pair of services).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;

use crate::error::Problem;
use crate::schema::{
    AuthPolicy, KvExactRule, MatchSpec, ProfileSource, ProfileSpec, Rule, RulesFile, SaltPolicy,
    ServiceSpec, TenantSpec,
};

/// Smallest accepted block size, in tokens.
pub const MIN_BLOCK_SIZE: u32 = 1;
/// Largest accepted block size, in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1024;

/// Every problem of `rules`; empty when the rule set is valid.
pub fn validate(rules: &RulesFile) -> Vec<Problem> {
    let mut v = Validator {
        problems: Vec::new(),
    };
    v.gateway(rules);
    let worker_paths = v.ids(
        "workers",
        rules.workers.iter().map(|w| w.id.0.as_str()),
        "worker",
    );
    for (w, path) in rules.workers.iter().zip(&worker_paths) {
        v.url(&format!("{path}.url"), &w.url);
        if w.weight == 0 {
            v.push(format!("{path}.weight"), "weight must be at least 1");
        }
        for key in w.labels.keys() {
            if key.is_empty() {
                v.push(format!("{path}.labels"), "label names must not be empty");
            }
        }
        if let Some(h) = &w.health_path {
            if !h.starts_with('/') || h.contains(['?', '#', ' ']) || h.len() > 256 {
                v.push(
                    format!("{path}.health_path"),
                    format!("{h:?} must start with / and have no `?`, `#` or space (≤ 256 bytes)"),
                );
            }
        }
        if let Some(c) = &w.prompt_cache {
            if c.ttl_ms.is_some_and(|t| t == 0 || t > 86_400_000) {
                v.push(
                    format!("{path}.prompt_cache.ttl_ms"),
                    "ttl_ms must be 1..=86400000",
                );
            }
            if c.max_prefixes == Some(0) {
                v.push(
                    format!("{path}.prompt_cache.max_prefixes"),
                    "max_prefixes must be at least 1",
                );
            }
        }
    }
    let workers: BTreeSet<&str> = rules.workers.iter().map(|w| w.id.0.as_str()).collect();

    let pool_paths = v.ids("pools", rules.pools.iter().map(|p| p.id.0.as_str()), "pool");
    for (p, path) in rules.pools.iter().zip(&pool_paths) {
        if p.workers.is_empty() && p.selector.is_empty() {
            v.push(
                format!("{path}.workers"),
                "empty pool: list at least one worker or give a selector",
            );
        }
        for (k, val) in &p.selector {
            if k.is_empty() || val.is_empty() {
                v.push(
                    format!("{path}.selector"),
                    "selector label names and values must not be empty",
                );
            }
        }
        let mut seen = BTreeSet::new();
        for (i, w) in p.workers.iter().enumerate() {
            if !workers.contains(w.0.as_str()) {
                v.push(
                    format!("{path}.workers[{i}]"),
                    format!("unknown worker {:?}", w.0),
                );
            }
            if !seen.insert(w.0.as_str()) {
                v.push(
                    format!("{path}.workers[{i}]"),
                    format!("worker {:?} listed twice", w.0),
                );
            }
        }
    }
    let pools: BTreeSet<&str> = rules.pools.iter().map(|p| p.id.0.as_str()).collect();

    let profile_paths = v.ids(
        "profiles",
        rules.profiles.iter().map(|p| p.id.0.as_str()),
        "profile",
    );
    for (p, path) in rules.profiles.iter().zip(&profile_paths) {
        v.profile(p, path);
    }
    let profiles: HashMap<&str, &ProfileSpec> = rules
        .profiles
        .iter()
        .map(|p| (p.id.0.as_str(), p))
        .collect();

    let service_paths = v.ids(
        "services",
        rules.services.iter().map(|s| s.name.0.as_str()),
        "service",
    );
    let listeners: BTreeSet<&str> = rules
        .gateway
        .listeners
        .iter()
        .map(|l| l.name.0.as_str())
        .collect();
    for (s, path) in rules.services.iter().zip(&service_paths) {
        v.service(s, path, &pools, &profiles, &listeners);
        v.auth(s, path, !rules.tenants.is_empty());
    }
    v.tenants(&rules.tenants, &rules.services);
    v.ids(
        "cordoned",
        rules.cordoned.iter().map(|w| w.0.as_str()),
        "cordoned worker",
    );
    for (j, b) in rules.services.iter().enumerate() {
        for a in &rules.services[..j] {
            if let Some(why) = overlap(&a.matcher, &b.matcher) {
                v.push(
                    format!("{}.match", service_paths[j]),
                    format!(
                        "matches the same requests as service {:?} ({why})",
                        a.name.0
                    ),
                );
            }
        }
    }
    v.problems
}

/// Validate one service as it would stand in `rules` (replacing a service of the same name):
/// the admin API's check before a `PUT`. Returns every problem of the resulting rule set.
pub fn validate_with_service(rules: &RulesFile, service: &ServiceSpec) -> Vec<Problem> {
    let mut candidate = rules.clone();
    candidate.upsert_service(service.clone());
    validate(&candidate)
}

/// Whether `s` is a usable identifier: 1..=128 of ASCII letters, digits, `.`, `_`, `-`.
pub fn is_valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Why two matchers can take the same request, or `None` when they cannot.
fn overlap(a: &MatchSpec, b: &MatchSpec) -> Option<String> {
    let listener = match (&a.listener, &b.listener) {
        (Some(x), Some(y)) if x != y => return None,
        (Some(x), _) | (_, Some(x)) => format!("listener {:?}", x.0),
        (None, None) => "any listener".to_owned(),
    };
    let host = match (&a.host, &b.host) {
        (Some(x), Some(y)) if !x.eq_ignore_ascii_case(y) => return None,
        (Some(x), _) | (_, Some(x)) => format!("host {x:?}"),
        (None, None) => "any host".to_owned(),
    };
    let (pa, pb) = (&a.path_prefix, &b.path_prefix);
    if !pa.starts_with(pb.as_str()) && !pb.starts_with(pa.as_str()) {
        return None;
    }
    let path = if pa == pb {
        format!("path prefix {pa:?}")
    } else {
        format!("path prefixes {pa:?} and {pb:?}")
    };
    let models = match (a.models.is_empty(), b.models.is_empty()) {
        (true, true) => "any model".to_owned(),
        (true, false) => format!("models {:?}", b.models),
        (false, true) => format!("models {:?}", a.models),
        (false, false) => {
            let common: Vec<&String> = a.models.iter().filter(|m| b.models.contains(m)).collect();
            if common.is_empty() {
                return None;
            }
            format!("models {common:?}")
        }
    };
    Some(format!("{listener}, {host}, {path}, {models}"))
}

struct Validator {
    problems: Vec<Problem>,
}

impl Validator {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem::new(path, message));
    }

    /// Check the ids of one list; returns each entry's path: `list.id` when the id is valid
    /// and unique, `list[i]` otherwise.
    fn ids<'a>(
        &mut self,
        list: &str,
        ids: impl Iterator<Item = &'a str>,
        what: &str,
    ) -> Vec<String> {
        let ids: Vec<&str> = ids.collect();
        let mut count: HashMap<&str, usize> = HashMap::new();
        for id in &ids {
            *count.entry(id).or_default() += 1;
        }
        let key = if what == "service" { "name" } else { "id" };
        let mut first_seen: HashMap<&str, usize> = HashMap::new();
        let mut paths = Vec::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            let unique = count.get(id).copied() == Some(1);
            if !is_valid_id(id) {
                self.push(
                    format!("{list}[{i}].{key}"),
                    format!(
                        "invalid {what} {key} {id:?}: use 1 to 128 ASCII letters, digits, '.', '_' or '-'"
                    ),
                );
            } else if let Some(first) = first_seen.get(id) {
                self.push(
                    format!("{list}[{i}].{key}"),
                    format!("duplicate {what} {key} {id:?} (first at {list}[{first}])"),
                );
            }
            first_seen.entry(id).or_insert(i);
            if unique && is_valid_id(id) {
                paths.push(format!("{list}.{id}"));
            } else {
                paths.push(format!("{list}[{i}]"));
            }
        }
        paths
    }

    fn gateway(&mut self, rules: &RulesFile) {
        let g = &rules.gateway;
        let mut seen = BTreeSet::new();
        for (i, l) in g.listeners.iter().enumerate() {
            let path = format!("gateway.listeners[{i}]");
            if !is_valid_id(&l.name.0) {
                self.push(
                    format!("{path}.name"),
                    format!("invalid listener name {:?}", l.name.0),
                );
            } else if !seen.insert(l.name.0.as_str()) {
                self.push(
                    format!("{path}.name"),
                    format!("duplicate listener name {:?}", l.name.0),
                );
            }
            if l.addr.parse::<SocketAddr>().is_err() {
                self.push(
                    format!("{path}.addr"),
                    format!("not a socket address (ip:port): {:?}", l.addr),
                );
            }
        }
        if let Some(a) = &g.admin_addr {
            if a.parse::<SocketAddr>().is_err() {
                self.push(
                    "gateway.admin_addr",
                    format!("not a socket address (ip:port): {a:?}"),
                );
            }
        }
        if g.health_interval_ms == 0 {
            self.push("gateway.health_interval_ms", "must be greater than 0");
        }
    }

    fn url(&mut self, path: &str, url: &str) {
        let uri = match url.parse::<http::Uri>() {
            Ok(u) => u,
            Err(e) => {
                self.push(path, format!("bad URL {url:?}: {e}"));
                return;
            }
        };
        match uri.scheme_str() {
            Some("http") | Some("https") => {}
            _ => {
                self.push(
                    path,
                    format!("bad URL {url:?}: the scheme must be http or https"),
                );
                return;
            }
        }
        match uri.authority() {
            Some(a) if !a.host().is_empty() && !a.as_str().contains('@') => {
                // `http::Uri` keeps a port it cannot represent as u16 without complaint.
                let after_host = a.as_str().rsplit_once(']').map_or(a.as_str(), |(_, r)| r);
                if let Some((_, port)) = after_host.rsplit_once(':') {
                    if port.parse::<u16>().is_err() {
                        self.push(path, format!("bad URL {url:?}: bad port {port:?}"));
                    }
                }
            }
            _ => self.push(
                path,
                format!("bad URL {url:?}: needs a host and no user info"),
            ),
        }
        if uri.query().is_some() {
            self.push(path, format!("bad URL {url:?}: must not have a query"));
        }
    }

    fn profile(&mut self, p: &ProfileSpec, path: &str) {
        if p.model_id.trim().is_empty() {
            self.push(format!("{path}.model_id"), "must not be empty");
        }
        if p.revision.trim().is_empty() {
            self.push(format!("{path}.revision"), "must not be empty");
        }
        if let Some(a) = &p.architecture {
            let ok = !a.is_empty()
                && a.len() <= 64
                && a.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !ok {
                self.push(
                    format!("{path}.architecture"),
                    format!(
                        "must be a GGUF architecture name (1-64 of a-z, 0-9, `_`, `-`), got {a:?}"
                    ),
                );
            }
        }
        match &p.source {
            ProfileSource::Gguf { path: f, .. } => {
                if f.as_os_str().is_empty() {
                    self.push(format!("{path}.source.gguf"), "must not be empty");
                }
            }
            ProfileSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config,
            } => {
                if tokenizer_json.as_os_str().is_empty() {
                    self.push(format!("{path}.source.tokenizer_json"), "must not be empty");
                }
                if tokenizer_config.as_os_str().is_empty() {
                    self.push(
                        format!("{path}.source.tokenizer_config"),
                        "must not be empty",
                    );
                }
            }
        }
        for (field, value) in [
            ("template_sha256", &p.template_sha256),
            ("tokenizer_sha256", &p.tokenizer_sha256),
        ] {
            if !is_sha256_hex(value) {
                self.push(
                    format!("{path}.{field}"),
                    format!("must be 64 lowercase hex digits, got {value:?}"),
                );
            }
        }
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&p.block_size) {
            self.push(
                format!("{path}.block_size"),
                format!(
                    "block size {} out of range {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}",
                    p.block_size
                ),
            );
        }
        if p.context_limit == 0 {
            self.push(format!("{path}.context_limit"), "must be greater than 0");
        } else if p.native_reserve_tokens >= p.context_limit {
            self.push(
                format!("{path}.native_reserve_tokens"),
                format!(
                    "{} leaves no room in context_limit {}",
                    p.native_reserve_tokens, p.context_limit
                ),
            );
        }
    }

    fn service(
        &mut self,
        s: &ServiceSpec,
        path: &str,
        pools: &BTreeSet<&str>,
        profiles: &HashMap<&str, &ProfileSpec>,
        listeners: &BTreeSet<&str>,
    ) {
        let m = &s.matcher;
        if let Some(l) = &m.listener {
            if !listeners.contains(l.0.as_str()) {
                self.push(
                    format!("{path}.match.listener"),
                    format!(
                        "unknown listener {:?} (declare it under gateway.listeners)",
                        l.0
                    ),
                );
            }
        }
        if let Some(h) = &m.host {
            if h.is_empty() || h.contains(['/', ':', ' ']) {
                self.push(
                    format!("{path}.match.host"),
                    format!("{h:?} is not a host name (no scheme, port or path)"),
                );
            }
        }
        if !m.path_prefix.starts_with('/') || m.path_prefix.contains(['?', '#', ' ']) {
            self.push(
                format!("{path}.match.path_prefix"),
                format!(
                    "{:?} must start with '/' and hold no '?', '#' or space",
                    m.path_prefix
                ),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, model) in m.models.iter().enumerate() {
            if model.is_empty() {
                self.push(format!("{path}.match.models[{i}]"), "must not be empty");
            } else if !seen.insert(model.as_str()) {
                self.push(
                    format!("{path}.match.models[{i}]"),
                    format!("model {model:?} listed twice"),
                );
            }
        }
        if !pools.contains(s.pool.0.as_str()) {
            self.push(
                format!("{path}.pool"),
                format!("unknown pool {:?}", s.pool.0),
            );
        }
        match &s.rule {
            Rule::RoundRobin(_) => {}
            Rule::KvExact(k) => self.kv_exact(k, &format!("{path}.rule"), profiles),
        }
        let u = &s.upstream;
        for (field, value) in [
            ("connect_timeout_ms", u.connect_timeout_ms),
            ("read_timeout_ms", u.read_timeout_ms),
            ("idle_timeout_ms", u.idle_timeout_ms),
        ] {
            if value == 0 {
                self.push(format!("{path}.upstream.{field}"), "must be greater than 0");
            }
        }
        if u.refused_retries > crate::schema::MAX_REFUSED_RETRIES {
            self.push(
                format!("{path}.upstream.refused_retries"),
                format!("must be at most {}", crate::schema::MAX_REFUSED_RETRIES),
            );
        }
        if s.max_body_bytes == 0 {
            self.push(format!("{path}.max_body_bytes"), "must be greater than 0");
        }
    }

    fn kv_exact(&mut self, k: &KvExactRule, path: &str, profiles: &HashMap<&str, &ProfileSpec>) {
        match &k.profile {
            None => self.push(
                format!("{path}.profile"),
                "kv_exact needs a profile (the prompt profile its workers share)",
            ),
            Some(id) => match profiles.get(id.0.as_str()) {
                None => self.push(
                    format!("{path}.profile"),
                    format!("unknown profile {:?}", id.0),
                ),
                Some(p) => {
                    if p.context_limit > 0 && k.min_match_tokens > p.context_limit {
                        self.push(
                            format!("{path}.min_match_tokens"),
                            format!(
                                "{} exceeds the profile's context_limit {}: no request could hit",
                                k.min_match_tokens, p.context_limit
                            ),
                        );
                    }
                }
            },
        }
        if !k.max_load_ratio.is_finite() || k.max_load_ratio < 1.0 {
            self.push(
                format!("{path}.max_load_ratio"),
                format!("must be a finite number >= 1.0, got {}", k.max_load_ratio),
            );
        }
        for (name, w) in [
            ("uncached_weight", k.uncached_weight),
            ("decode_weight", k.decode_weight),
        ] {
            if !w.is_finite() || !(0.0..=1000.0).contains(&w) {
                self.push(
                    format!("{path}.{name}"),
                    format!("must be a finite number in 0..=1000, got {w}"),
                );
            }
        }
        if k.load_slack == Some(0) {
            self.push(format!("{path}.load_slack"), "must be at least 1");
        }
        if k.pending_ttl_ms > 60_000 {
            self.push(
                format!("{path}.pending_ttl_ms"),
                format!("must be at most 60000, got {}", k.pending_ttl_ms),
            );
        }
        match &k.salt {
            SaltPolicy::None | SaltPolicy::PerRequest | SaltPolicy::Tenant => {}
            SaltPolicy::Fixed { salt } => {
                if salt.is_empty() {
                    self.push(format!("{path}.salt.salt"), "must not be empty");
                }
            }
            SaltPolicy::TenantHeader { header, .. } => {
                let ok = http::HeaderName::from_bytes(header.as_bytes())
                    .map(|h| h.as_str() == header)
                    .unwrap_or(false);
                if !ok {
                    self.push(
                        format!("{path}.salt.header"),
                        format!("{header:?} is not a lowercase HTTP header name"),
                    );
                }
            }
        }
    }
}

impl Validator {
    /// A service's authentication and the salt it implies.
    fn auth(&mut self, s: &ServiceSpec, path: &str, have_tenants: bool) {
        let kv_salt = match &s.rule {
            Rule::KvExact(k) => Some(&k.salt),
            Rule::RoundRobin(_) => None,
        };
        match s.auth {
            AuthPolicy::None => {
                if matches!(kv_salt, Some(SaltPolicy::Tenant)) {
                    self.push(
                        format!("{path}.rule.salt"),
                        "salt mode \"tenant\" needs auth = \"api_key\" (the salt is the authenticated tenant)",
                    );
                }
            }
            AuthPolicy::ApiKey => {
                if !have_tenants {
                    self.push(
                        format!("{path}.auth"),
                        "auth = \"api_key\" needs at least one [[tenants]] entry",
                    );
                }
                if let Some(salt) = kv_salt {
                    if *salt != SaltPolicy::Tenant {
                        self.push(
                            format!("{path}.rule.salt"),
                            "with auth = \"api_key\" the cache salt must be the tenant's \
                             (salt = { mode = \"tenant\" }): a client never picks its own salt",
                        );
                    }
                }
            }
        }
    }

    fn tenants(&mut self, tenants: &[TenantSpec], services: &[ServiceSpec]) {
        let paths = self.ids("tenants", tenants.iter().map(|t| t.id.0.as_str()), "tenant");
        let mut owner: HashMap<&str, &str> = HashMap::new();
        for (t, path) in tenants.iter().zip(&paths) {
            if t.api_keys_sha256.is_empty() {
                self.push(
                    format!("{path}.api_keys_sha256"),
                    "list at least one key hash",
                );
            }
            for (i, h) in t.api_keys_sha256.iter().enumerate() {
                if !is_sha256_hex(h) {
                    self.push(
                        format!("{path}.api_keys_sha256[{i}]"),
                        "must be 64 lowercase hex digits (the SHA-256 of the key)",
                    );
                } else if let Some(other) = owner.insert(h.as_str(), t.id.as_str()) {
                    self.push(
                        format!("{path}.api_keys_sha256[{i}]"),
                        format!("this key hash also belongs to tenant {other:?}"),
                    );
                }
            }
            for (field, rate) in [
                ("requests_per_second", t.requests_per_second),
                ("tokens_per_second", t.tokens_per_second),
            ] {
                if let Some(r) = rate {
                    if !(r.is_finite() && r > 0.0) {
                        self.push(
                            format!("{path}.{field}"),
                            format!("must be a finite number > 0, got {r}"),
                        );
                    }
                }
            }
            if t.request_burst == Some(0) {
                self.push(format!("{path}.request_burst"), "must be at least 1");
            }
            if t.token_burst == Some(0) {
                self.push(format!("{path}.token_burst"), "must be at least 1");
            }
            if t.max_concurrent_requests == Some(0) {
                self.push(
                    format!("{path}.max_concurrent_requests"),
                    "must be at least 1",
                );
            }
            if t.request_burst.is_some() && t.requests_per_second.is_none() {
                self.push(format!("{path}.request_burst"), "needs requests_per_second");
            }
            if t.token_burst.is_some() && t.tokens_per_second.is_none() {
                self.push(format!("{path}.token_burst"), "needs tokens_per_second");
            }
            for (i, name) in t.services.iter().enumerate() {
                let at = format!("{path}.services[{i}]");
                match services.iter().find(|s| s.name == *name) {
                    None => self.push(at, format!("no service is named {:?}", name.0)),
                    Some(s) if s.auth != AuthPolicy::ApiKey => self.push(
                        at,
                        format!(
                            "service {:?} does not authenticate tenants (auth = \"api_key\")",
                            name.0
                        ),
                    ),
                    Some(_) if t.services[..i].contains(name) => {
                        self.push(at, format!("{:?} is listed twice", name.0))
                    }
                    Some(_) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(listener: Option<&str>, host: Option<&str>, prefix: &str, models: &[&str]) -> MatchSpec {
        MatchSpec {
            listener: listener.map(|l| crate::schema::ListenerName(l.into())),
            host: host.map(str::to_owned),
            path_prefix: prefix.into(),
            models: models.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn overlap_needs_every_dimension_to_overlap() {
        let any = m(None, None, "/v1/", &[]);
        assert!(overlap(&any, &any).is_some());
        assert!(overlap(&any, &m(Some("a"), Some("h"), "/v1/x", &["m"])).is_some());
        assert!(overlap(&m(Some("a"), None, "/", &[]), &m(Some("b"), None, "/", &[])).is_none());
        assert!(overlap(&m(None, Some("h"), "/", &[]), &m(None, Some("H"), "/", &[])).is_some());
        assert!(overlap(&m(None, Some("h"), "/", &[]), &m(None, Some("g"), "/", &[])).is_none());
        assert!(overlap(&m(None, None, "/a", &[]), &m(None, None, "/b", &[])).is_none());
        assert!(overlap(&m(None, None, "/", &["x"]), &m(None, None, "/", &["y"])).is_none());
    }

    #[test]
    fn identifiers() {
        assert!(is_valid_id("chat-rr.v2_1"));
        assert!(!is_valid_id(""));
        assert!(!is_valid_id("a b"));
        assert!(!is_valid_id("a/b"));
        assert!(!is_valid_id(&"a".repeat(129)));
    }
}
