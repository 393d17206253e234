//! Parsing, validation (one test per kind of problem), serialization round trips, and the
//! documented examples (docs/rules.md, examples/rules.toml).

mod common;

use std::collections::BTreeSet;

use common::{workspace_root, BASE};
use proptest::prelude::*;
use routing_rules::{
    load_toml, rules_from_json, rules_from_toml, rules_to_toml, service_from_json, validate,
    ListenerName, MatchSpec, PoolId, Problem, RequestInfo, RoundRobinRule, Rule, RuleSnapshot,
    RuleVersion, RulesError, RulesFile, ServiceName, ServiceSpec, UpstreamSpec,
};

fn parse(text: &str) -> RulesFile {
    match rules_from_toml(text) {
        Ok(r) => r,
        Err(p) => panic!("parse failed: {p:?}"),
    }
}

/// Problems of `text` (parse problems, else validation problems).
fn problems(text: &str) -> Vec<Problem> {
    match rules_from_toml(text) {
        Ok(r) => validate(&r),
        Err(p) => p,
    }
}

fn assert_problem(problems: &[Problem], path: &str, needle: &str) {
    assert!(
        problems
            .iter()
            .any(|p| p.path == path && p.message.contains(needle)),
        "expected a problem at {path:?} containing {needle:?}, got:\n{}",
        problems
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn base_is_valid_and_defaults_are_filled() {
    let rules = parse(BASE);
    assert_eq!(validate(&rules), vec![]);
    let chat = rules.service("chat").unwrap();
    assert_eq!(chat.matcher.path_prefix, "/v1/");
    assert_eq!(chat.max_body_bytes, 16 * 1024 * 1024);
    assert_eq!(chat.upstream, UpstreamSpec::default());
    let Rule::KvExact(k) = &chat.rule else {
        panic!("kv_exact expected")
    };
    assert_eq!(k.max_load_ratio, 1.5);
    assert_eq!(k.min_match_tokens, 0);
    assert_eq!(
        k.load_metric,
        routing_rules::schema::LoadMetric::ActiveTokens
    );
    assert_eq!(k.effective_load_slack(), 1024);
    assert_eq!(k.pending_ttl_ms, 2000);
    assert_eq!(k.placement, routing_rules::schema::Placement::LeastCost);
    assert_eq!((k.uncached_weight, k.decode_weight), (2.0, 0.25));
    assert_eq!(rules.workers[0].weight, 1);
    assert_eq!(rules.gateway.health_interval_ms, 1000);
}

// ---- parse-time problems (serde, with paths) ----

#[test]
fn unknown_top_level_field() {
    let p = problems(&format!("foo = 1\n{BASE}"));
    assert_problem(&p, "foo", "unknown field `foo`");
}

#[test]
fn unknown_nested_fields_are_reported_per_entry_with_paths() {
    let text = BASE
        .replace(
            "url = \"http://127.0.0.1:8102\"",
            "url = \"http://127.0.0.1:8102\"\nwieght = 2",
        )
        .replace(
            "rule = { type = \"kv_exact\", profile = \"smol\" }",
            "rule = { type = \"kv_exact\", profile = \"smol\", max_load = 2 }",
        )
        .replace(
            "match = { models = [\"rr\"] }",
            "match = { model = [\"rr\"] }",
        );
    let p = problems(&text);
    assert_eq!(p.len(), 3, "{p:?}");
    assert_problem(&p, "workers[1].wieght", "unknown field `wieght`");
    assert_problem(&p, "services[0].match.model", "unknown field `model`");
    assert_problem(&p, "services[1].rule", "unknown field `max_load`");
}

#[test]
fn wrong_types_and_unknown_rule_type() {
    let text = BASE
        .replace("block_size = 16", "block_size = \"16\"")
        .replace("type = \"round_robin\"", "type = \"random\"");
    let p = problems(&text);
    assert_problem(&p, "profiles[0].block_size", "invalid type");
    assert_problem(&p, "services[0].rule.type", "unknown variant `random`");
}

#[test]
fn profile_source_must_be_one_form() {
    let text = BASE.replace(
        "source = { gguf = \"models/x.gguf\" }",
        "source = { gguf = \"a\", tokenizer_json = \"b\" }",
    );
    assert_problem(
        &problems(&text),
        "profiles[0].source",
        "either { gguf = PATH }",
    );
    let text = BASE.replace(
        "source = { gguf = \"models/x.gguf\" }",
        "source = { tokenizer_json = \"t.json\", tokenizer_config = \"c.json\" }",
    );
    assert_eq!(problems(&text), vec![]);
}

#[test]
fn profile_architecture_is_optional_and_checked() {
    let with = |a: &str| {
        BASE.replace(
            "revision = \"r\"",
            &format!("revision = \"r\"\narchitecture = {a:?}"),
        )
    };
    let rules = parse(&with("gemma3"));
    assert_eq!(validate(&rules), vec![]);
    assert_eq!(rules.profiles[0].architecture.as_deref(), Some("gemma3"));
    assert_eq!(parse(BASE).profiles[0].architecture, None);
    for bad in ["", "Llama", "llama 3", "qwen/2"] {
        assert_problem(
            &problems(&with(bad)),
            "profiles.smol.architecture",
            "must be a GGUF architecture name",
        );
    }
}

#[test]
fn toml_syntax_error_has_empty_path() {
    let p = problems("[[workers]\nid = 1");
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].path, "");
    assert!(p[0].message.starts_with("TOML syntax"), "{}", p[0]);
}

#[test]
fn negative_number_is_refused() {
    let p = problems(&BASE.replace("block_size = 16", "block_size = -1"));
    assert_problem(&p, "profiles[0].block_size", "invalid value");
}

// ---- validation problems ----

#[test]
fn duplicate_ids_are_reported_for_every_list() {
    let text = format!(
        "{BASE}
[[workers]]
id = \"w1\"
url = \"http://127.0.0.1:9\"

[[pools]]
id = \"local\"
workers = [\"w1\"]

[[profiles]]
id = \"smol\"
model_id = \"m\"
revision = \"r\"
source = {{ gguf = \"x\" }}
template_sha256 = \"1111111111111111111111111111111111111111111111111111111111111111\"
tokenizer_sha256 = \"2222222222222222222222222222222222222222222222222222222222222222\"
block_size = 16
context_limit = 8192

[[services]]
name = \"chat\"
pool = \"local\"
match = {{ models = [\"other\"] }}
rule = {{ type = \"round_robin\" }}
"
    );
    let p = problems(&text);
    assert_problem(
        &p,
        "workers[2].id",
        "duplicate worker id \"w1\" (first at workers[0])",
    );
    assert_problem(&p, "pools[1].id", "duplicate pool id \"local\"");
    assert_problem(&p, "profiles[1].id", "duplicate profile id \"smol\"");
    assert_problem(&p, "services[2].name", "duplicate service name \"chat\"");
}

#[test]
fn invalid_identifiers() {
    let p = problems(&BASE.replace("id = \"w1\"", "id = \"w 1\""));
    assert_problem(&p, "workers[0].id", "invalid worker id \"w 1\"");
    // The pool still references "w1", which no longer exists.
    assert_problem(&p, "pools.local.workers[0]", "unknown worker \"w1\"");
    let p = problems(&BASE.replace("name = \"chat\"", "name = \"\""));
    assert_problem(&p, "services[1].name", "invalid service name");
}

#[test]
fn empty_pool() {
    let p = problems(&BASE.replace("workers = [\"w1\", \"w2\"]", "workers = []"));
    assert_problem(&p, "pools.local.workers", "empty pool");
}

#[test]
fn pool_with_unknown_or_repeated_worker() {
    let p = problems(&BASE.replace(
        "workers = [\"w1\", \"w2\"]",
        "workers = [\"w1\", \"w9\", \"w1\"]",
    ));
    assert_problem(&p, "pools.local.workers[1]", "unknown worker \"w9\"");
    assert_problem(&p, "pools.local.workers[2]", "worker \"w1\" listed twice");
}

#[test]
fn service_with_unknown_pool() {
    let p = problems(&BASE.replace(
        "name = \"chat\"\npool = \"local\"",
        "name = \"chat\"\npool = \"nope\"",
    ));
    assert_problem(&p, "services.chat.pool", "unknown pool \"nope\"");
}

#[test]
fn rule_with_unknown_profile() {
    let p = problems(&BASE.replace("profile = \"smol\"", "profile = \"x\""));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(
        p[0].to_string(),
        "services.chat.rule.profile: unknown profile \"x\""
    );
}

#[test]
fn kv_exact_without_profile() {
    let p = problems(&BASE.replace(", profile = \"smol\"", ""));
    assert_problem(&p, "services.chat.rule.profile", "kv_exact needs a profile");
}

#[test]
fn block_size_out_of_range() {
    for bad in ["0", "1025", "4096"] {
        let p = problems(&BASE.replace("block_size = 16", &format!("block_size = {bad}")));
        assert_problem(
            &p,
            "profiles.smol.block_size",
            &format!("block size {bad} out of range 1..=1024"),
        );
    }
    for good in ["1", "1024"] {
        assert_eq!(
            problems(&BASE.replace("block_size = 16", &format!("block_size = {good}"))),
            vec![]
        );
    }
}

#[test]
fn bad_urls() {
    for bad in [
        "127.0.0.1:8101",
        "ftp://127.0.0.1:8101",
        "http://",
        "http://user@host:1",
        "http://h:1/?q=1",
        "http://h:99999",
        "not a url",
    ] {
        let p = problems(&BASE.replace("http://127.0.0.1:8101", bad));
        assert!(
            p.iter()
                .any(|p| p.path == "workers.w1.url" && p.message.contains("bad URL")),
            "{bad}: {p:?}"
        );
    }
    for good in [
        "http://h",
        "https://h:443",
        "http://[::1]:8101",
        "http://h:1/prefix",
    ] {
        assert_eq!(
            problems(&BASE.replace("http://127.0.0.1:8101", good)),
            vec![]
        );
    }
}

#[test]
fn profile_field_checks() {
    let text = BASE
        .replace(
            "template_sha256 = \"1111111111111111111111111111111111111111111111111111111111111111\"",
            "template_sha256 = \"ABC\"",
        )
        .replace("model_id = \"m\"", "model_id = \"\"")
        .replace("context_limit = 8192", "context_limit = 8192\nnative_reserve_tokens = 8192");
    let p = problems(&text);
    assert_problem(&p, "profiles.smol.template_sha256", "64 lowercase hex");
    assert_problem(&p, "profiles.smol.model_id", "must not be empty");
    assert_problem(&p, "profiles.smol.native_reserve_tokens", "leaves no room");
}

#[test]
fn kv_exact_parameter_checks() {
    let text = BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "rule = { type = \"kv_exact\", profile = \"smol\", max_load_ratio = 0.5, load_slack = 0, \
         min_match_tokens = 9000, salt = { mode = \"tenant_header\", header = \"X-Tenant\" } }",
    );
    let p = problems(&text);
    assert_problem(&p, "services.chat.rule.max_load_ratio", ">= 1.0");
    assert_problem(&p, "services.chat.rule.load_slack", "at least 1");
    assert_problem(&p, "services.chat.rule.min_match_tokens", "exceeds");
    let w = problems(&BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "rule = { type = \"kv_exact\", profile = \"smol\", uncached_weight = -1.0, \
         decode_weight = 1e9 }",
    ));
    assert_problem(&w, "services.chat.rule.uncached_weight", "0..=1000");
    assert_problem(&w, "services.chat.rule.decode_weight", "0..=1000");
    let bad = BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "rule = { type = \"kv_exact\", profile = \"smol\", placement = \"nearest\" }",
    );
    assert!(rules_from_toml(&bad).is_err());
    assert_problem(
        &p,
        "services.chat.rule.salt.header",
        "lowercase HTTP header",
    );
    let p = problems(&BASE.replace(
        "profile = \"smol\" }",
        "profile = \"smol\", salt = { mode = \"fixed\", salt = \"\" } }",
    ));
    assert_problem(&p, "services.chat.rule.salt.salt", "must not be empty");
}

#[test]
fn service_field_checks() {
    let text = BASE.replace(
        "match = { models = [\"exact\"] }",
        "match = { models = [\"exact\", \"exact\", \"\"], path_prefix = \"v1\", host = \"http://x\", listener = \"nope\" }\n\
         max_body_bytes = 0\nupstream = { connect_timeout_ms = 0, refused_retries = 17 }",
    );
    let p = problems(&text);
    assert_problem(&p, "services.chat.match.models[1]", "listed twice");
    assert_problem(&p, "services.chat.match.models[2]", "must not be empty");
    assert_problem(&p, "services.chat.match.path_prefix", "must start with '/'");
    assert_problem(&p, "services.chat.match.host", "not a host name");
    assert_problem(
        &p,
        "services.chat.match.listener",
        "unknown listener \"nope\"",
    );
    assert_problem(&p, "services.chat.max_body_bytes", "greater than 0");
    assert_problem(
        &p,
        "services.chat.upstream.connect_timeout_ms",
        "greater than 0",
    );
    assert_problem(
        &p,
        "services.chat.upstream.refused_retries",
        "must be at most 16",
    );
}

const TENANTS: &str = r#"
[[tenants]]
id = "acme"
api_keys_sha256 = ["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]
requests_per_second = 5.0
request_burst = 10
tokens_per_second = 1000.0
"#;

#[test]
fn tenants_and_api_key_auth() {
    // A valid setup: tenants, an api_key service salted by the tenant.
    let ok = format!(
        "{}{TENANTS}",
        BASE.replace(
            "rule = { type = \"kv_exact\", profile = \"smol\" }",
            "auth = \"api_key\"\nrule = { type = \"kv_exact\", profile = \"smol\", salt = { mode = \"tenant\" } }",
        )
    );
    assert_eq!(validate(&parse(&ok)), vec![]);
    let rules = parse(&ok);
    assert_eq!(rules.tenants[0].id.as_str(), "acme");
    // It round-trips through TOML.
    assert_eq!(parse(&rules_to_toml(&rules).unwrap()), rules);

    // api_key without tenants; a client-picked salt under api_key.
    let no_tenants = BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "auth = \"api_key\"\nrule = { type = \"kv_exact\", profile = \"smol\", salt = { mode = \"per_request\" } }",
    );
    let p = problems(&no_tenants);
    assert_problem(&p, "services.chat.auth", "needs at least one [[tenants]]");
    assert_problem(&p, "services.chat.rule.salt", "must be the tenant's");
    // The tenant salt without auth.
    let no_auth = BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "rule = { type = \"kv_exact\", profile = \"smol\", salt = { mode = \"tenant\" } }",
    );
    assert_problem(&problems(&no_auth), "services.chat.rule.salt", "needs auth");
    // Tenant field checks.
    let bad = format!(
        "{BASE}{}\n[[tenants]]\nid = \"beta\"\napi_keys_sha256 = [\"AAAA\", \"{}\"]\nrequest_burst = 0\ntoken_burst = 3\ntokens_per_second = -1.0\nmax_concurrent_requests = 0\n\n[[tenants]]\nid = \"gamma\"\napi_keys_sha256 = []\n",
        TENANTS,
        "a".repeat(64)
    );
    let p = problems(&bad);
    assert_problem(&p, "tenants.beta.api_keys_sha256[0]", "64 lowercase hex");
    assert_problem(
        &p,
        "tenants.beta.api_keys_sha256[1]",
        "also belongs to tenant \"acme\"",
    );
    assert_problem(&p, "tenants.beta.request_burst", "at least 1");
    assert_problem(
        &p,
        "tenants.beta.request_burst",
        "needs requests_per_second",
    );
    assert_problem(&p, "tenants.beta.tokens_per_second", "finite number > 0");
    assert_problem(&p, "tenants.beta.max_concurrent_requests", "at least 1");
    assert_problem(&p, "tenants.gamma.api_keys_sha256", "at least one");
    // A tenant's services: keyed services that exist, each once.
    let keyed = BASE.replace(
        "rule = { type = \"kv_exact\", profile = \"smol\" }",
        "auth = \"api_key\"\nrule = { type = \"kv_exact\", profile = \"smol\", salt = { mode = \"tenant\" } }",
    );
    let ok = format!("{keyed}{TENANTS}services = [\"chat\"]\n");
    assert_eq!(validate(&parse(&ok)), vec![]);
    assert_eq!(parse(&rules_to_toml(&parse(&ok)).unwrap()), parse(&ok));
    assert!(parse(&ok).tenants[0].may_use("chat"));
    assert!(!parse(&ok).tenants[0].may_use("chat-rr"));
    assert!(parse(&format!("{keyed}{TENANTS}")).tenants[0].may_use("chat-rr"));
    let bad = format!("{keyed}{TENANTS}services = [\"chat\", \"nope\", \"chat-rr\", \"chat\"]\n");
    let p = problems(&bad);
    assert_problem(
        &p,
        "tenants.acme.services[1]",
        "no service is named \"nope\"",
    );
    assert_problem(
        &p,
        "tenants.acme.services[2]",
        "does not authenticate tenants",
    );
    assert_problem(&p, "tenants.acme.services[3]", "listed twice");
}

#[test]
fn gateway_checks() {
    let text = format!(
        "[gateway]\nlisteners = [{{ name = \"a\", addr = \"nope\" }}, {{ name = \"a\", addr = \"127.0.0.1:1\" }}]\n\
         admin_addr = \"localhost\"\nhealth_interval_ms = 0\n{BASE}"
    );
    let p = problems(&text);
    assert_problem(&p, "gateway.listeners[0].addr", "not a socket address");
    assert_problem(&p, "gateway.listeners[1].name", "duplicate listener name");
    assert_problem(&p, "gateway.admin_addr", "not a socket address");
    assert_problem(&p, "gateway.health_interval_ms", "greater than 0");
}

#[test]
fn every_problem_is_returned_at_once() {
    let text = BASE
        .replace("block_size = 16", "block_size = 0")
        .replace("profile = \"smol\"", "profile = \"x\"")
        .replace("http://127.0.0.1:8102", "nope")
        .replace(
            "name = \"chat-rr\"\npool = \"local\"",
            "name = \"chat-rr\"\npool = \"p\"",
        );
    let p = problems(&text);
    assert_eq!(p.len(), 4, "{p:?}");
    let err = load_toml(&text).unwrap_err();
    assert_eq!(err.error_type(), "rules_invalid");
    assert_eq!(err.problems(), &p[..]);
    let shown = err.to_string();
    assert!(shown.contains("4 problem(s)"), "{shown}");
    assert!(
        shown.contains("services.chat.rule.profile: unknown profile \"x\""),
        "{shown}"
    );
}

// ---- overlapping services ----

fn with_matches(a: &str, b: &str) -> String {
    BASE.replace("match = { models = [\"rr\"] }", a)
        .replace("match = { models = [\"exact\"] }", b)
}

#[test]
fn overlapping_services_are_refused() {
    let cases = [
        ("match = {}", "match = {}"),
        (
            "match = { models = [\"a\", \"b\"] }",
            "match = { models = [\"b\"] }",
        ),
        ("match = {}", "match = { models = [\"b\"] }"),
        (
            "match = { path_prefix = \"/v1/\" }",
            "match = { path_prefix = \"/v1/chat/\" }",
        ),
        (
            "match = { host = \"A.example\" }",
            "match = { host = \"a.example\" }",
        ),
        ("match = { host = \"a.example\" }", "match = {}"),
    ];
    for (a, b) in cases {
        let p = problems(&with_matches(a, b));
        assert_problem(
            &p,
            "services.chat.match",
            "matches the same requests as service \"chat-rr\"",
        );
    }
}

#[test]
fn disjoint_services_are_accepted() {
    let cases = [
        (
            "match = { models = [\"a\"] }",
            "match = { models = [\"b\"] }",
        ),
        (
            "match = { path_prefix = \"/v1/\" }",
            "match = { path_prefix = \"/v2/\" }",
        ),
        (
            "match = { host = \"a.example\" }",
            "match = { host = \"b.example\" }",
        ),
    ];
    for (a, b) in cases {
        assert_eq!(problems(&with_matches(a, b)), vec![], "{a} / {b}");
    }
}

fn service(name: &str, matcher: MatchSpec) -> ServiceSpec {
    ServiceSpec {
        name: ServiceName(name.into()),
        matcher,
        pool: PoolId("local".into()),
        rule: Rule::RoundRobin(RoundRobinRule::default()),
        upstream: UpstreamSpec::default(),
        max_body_bytes: 1,
        token_budget: Default::default(),
        auth: Default::default(),
    }
}

fn arb_match() -> impl Strategy<Value = MatchSpec> {
    (
        prop::option::of(prop::sample::select(vec!["l1", "l2"])),
        prop::option::of(prop::sample::select(vec!["a.x", "A.X", "b.x"])),
        prop::sample::select(vec!["/", "/v1/", "/v1/chat/", "/v2/"]),
        prop::sample::subsequence(vec!["m1", "m2", "m3"], 0..=2),
    )
        .prop_map(|(l, h, p, m)| MatchSpec {
            listener: l.map(|s| ListenerName(s.into())),
            host: h.map(str::to_owned),
            path_prefix: p.to_owned(),
            models: m.into_iter().map(str::to_owned).collect(),
        })
}

proptest! {
    /// The overlap check agrees exactly with request matching: two services are refused iff
    /// some request (from an exhaustive small space) matches both.
    #[test]
    fn overlap_check_agrees_with_matching(a in arb_match(), b in arb_match()) {
        let mut rules = parse(BASE);
        rules.gateway.listeners = ["l1", "l2"]
            .iter()
            .enumerate()
            .map(|(i, n)| routing_rules::ListenerSpec {
                name: ListenerName((*n).into()),
                addr: format!("127.0.0.1:{}", 1000 + i),
            })
            .collect();
        rules.services = vec![service("a", a), service("b", b)];
        let flagged = validate(&rules).iter().any(|p| p.message.contains("matches the same requests"));
        // One snapshot per service (each alone is valid), then both matchers against every
        // request of a small exhaustive space.
        let snaps: Vec<RuleSnapshot> = rules.services.iter().map(|s| {
            let mut one = rules.clone();
            one.services = vec![s.clone()];
            RuleSnapshot::build(one, RuleVersion(1)).unwrap()
        }).collect();
        let mut both = false;
        for listener in [None, Some("l1"), Some("l2")] {
            for host in [None, Some("a.x"), Some("b.x:8080"), Some("c.x")] {
                for path in ["/", "/v1/", "/v1/chat/completions", "/v2/x", "/v3"] {
                    for model in [None, Some("m1"), Some("m2"), Some("m3"), Some("m4")] {
                        let req = RequestInfo { listener, host, path, model };
                        let hits = snaps.iter().filter(|s| s.match_request(&req).is_some()).count();
                        both |= hits == 2;
                    }
                }
            }
        }
        prop_assert_eq!(flagged, both);
    }
}

// ---- serialization ----

#[test]
fn service_json_is_pinned() {
    let rules = parse(BASE);
    let chat = rules.service("chat").unwrap();
    let json = serde_json::to_string(chat).unwrap();
    assert_eq!(
        json,
        r#"{"name":"chat","match":{"path_prefix":"/v1/","models":["exact"]},"pool":"local","rule":{"type":"kv_exact","profile":"smol","salt":{"mode":"none"},"max_load_ratio":1.5,"min_match_tokens":0,"on_no_match":"least_loaded","load_metric":"active_tokens","pending_ttl_ms":2000,"placement":"least_cost","uncached_weight":2.0,"decode_weight":0.25},"upstream":{"connect_timeout_ms":1000,"read_timeout_ms":300000,"idle_timeout_ms":60000,"refused_retries":2},"max_body_bytes":16777216,"token_budget":"reject"}"#
    );
    assert_eq!(&service_from_json(&json).unwrap(), chat);
}

#[test]
fn service_json_problems_have_relative_paths() {
    let p = service_from_json(
        r#"{"name":"x","pool":"p","rule":{"type":"kv_exact","salt":{"mode":"fixed"}}}"#,
    )
    .unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].path, "rule");
    assert!(p[0].message.contains("missing field `salt`"), "{}", p[0]);
    let p = service_from_json(r#"{"name":"x","pool":"p","rule":{"type":"round_robin"},"extra":1}"#)
        .unwrap_err();
    assert!(p[0].message.contains("unknown field `extra`"), "{}", p[0]);
    let p = service_from_json("{").unwrap_err();
    assert!(p[0].message.starts_with("JSON syntax"));
}

#[test]
fn toml_and_json_round_trip() {
    for text in [BASE.to_owned(), docs_example(), example_file()] {
        let rules = parse(&text);
        let back = parse(&rules_to_toml(&rules).unwrap());
        assert_eq!(back, rules);
        let json = serde_json::to_string(&rules).unwrap();
        assert_eq!(rules_from_json(&json).unwrap(), rules);
    }
}

fn si<'a>(header: Option<&'a str>, body: Option<&'a str>) -> routing_rules::schema::SaltInputs<'a> {
    routing_rules::schema::SaltInputs {
        header,
        tenant: None,
        body,
    }
}

#[test]
fn salt_policies() {
    use routing_rules::schema::SaltInputs;
    use routing_rules::SaltPolicy;
    assert_eq!(SaltPolicy::None.effective_salt(si(None, None)), Ok(None));
    assert!(SaltPolicy::None
        .effective_salt(si(None, Some("s")))
        .is_err());
    let fixed = SaltPolicy::Fixed { salt: "f".into() };
    assert_eq!(
        fixed.effective_salt(si(Some("h"), None)),
        Ok(Some("f".into()))
    );
    assert!(fixed.effective_salt(si(None, Some("s"))).is_err());
    assert_eq!(
        SaltPolicy::PerRequest.effective_salt(si(Some("h"), Some("s"))),
        Ok(Some("s".into()))
    );
    assert_eq!(
        SaltPolicy::PerRequest.effective_salt(si(None, None)),
        Ok(None)
    );
    let strict = SaltPolicy::TenantHeader {
        header: "x-t".into(),
        allow_body_salt: false,
    };
    assert_eq!(
        strict.effective_salt(si(Some("h"), None)),
        Ok(Some("h".into()))
    );
    assert_eq!(strict.effective_salt(si(None, None)), Ok(None));
    assert!(strict.effective_salt(si(Some("h"), Some("s"))).is_err());
    let loose = SaltPolicy::TenantHeader {
        header: "x-t".into(),
        allow_body_salt: true,
    };
    assert_eq!(
        loose.effective_salt(si(Some("h"), Some("s"))),
        Ok(Some("h".into()))
    );
    assert_eq!(
        loose.effective_salt(si(None, Some("s"))),
        Ok(Some("s".into()))
    );
    // The tenant salt: the authenticated tenant, never the client's pick, never a header.
    let t = |tenant, body| SaltInputs {
        header: Some("h"),
        tenant,
        body,
    };
    assert_eq!(
        SaltPolicy::Tenant.effective_salt(t(Some("acme"), None)),
        Ok(Some("tenant:acme".into()))
    );
    assert!(SaltPolicy::Tenant
        .effective_salt(t(Some("acme"), Some("s")))
        .is_err());
    assert!(SaltPolicy::Tenant.effective_salt(t(None, None)).is_err());
}

// ---- documentation ----

fn docs_text() -> String {
    let path = workspace_root().join("docs/rules.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn docs_example() -> String {
    let text = docs_text();
    let start = text
        .find("```toml\n")
        .expect("docs/rules.md has a ```toml block")
        + 8;
    let end = start + text[start..].find("```").expect("closing fence");
    text[start..end].to_owned()
}

fn example_file() -> String {
    let path = workspace_root().join("examples/rules.toml");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn docs_example_parses_and_validates() {
    let rules = load_toml(&docs_example()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rules.services.len(), 2);
    assert!(matches!(
        rules.service("chat").unwrap().rule,
        Rule::KvExact(_)
    ));
    let snap = RuleSnapshot::build(rules, RuleVersion(1)).unwrap();
    let req = RequestInfo {
        listener: Some("public"),
        host: Some("LLM.example.com:8080"),
        path: "/v1/chat/completions",
        model: Some("smollm2"),
    };
    assert_eq!(snap.match_request(&req).unwrap().spec.name.as_str(), "chat");
}

#[test]
fn docs_json_service_example_parses() {
    let text = docs_text();
    let start = text.find("```json\n").expect("a ```json block") + 8;
    let end = start + text[start..].find("```").unwrap();
    let spec = service_from_json(&text[start..end]).unwrap();
    let mut rules = load_toml(&docs_example()).unwrap();
    rules.upsert_service(spec);
    assert_eq!(validate(&rules), vec![]);
}

#[test]
fn example_file_parses_and_routes_by_model() {
    let rules = load_toml(&example_file()).unwrap_or_else(|e| panic!("{e}"));
    let urls: Vec<&str> = rules.workers.iter().map(|w| w.url.as_str()).collect();
    assert_eq!(urls, ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]);
    let snap = RuleSnapshot::build(rules, RuleVersion(1)).unwrap();
    let route = |model| {
        snap.match_request(&RequestInfo {
            path: "/v1/chat/completions",
            model: Some(model),
            ..Default::default()
        })
        .map(|s| (s.spec.name.as_str().to_owned(), s.spec.rule.kind()))
    };
    assert_eq!(route("smollm2-rr"), Some(("chat-rr".into(), "round_robin")));
    assert_eq!(route("smollm2"), Some(("chat-exact".into(), "kv_exact")));
    assert_eq!(route("other"), None);
    let exact = snap.service("chat-exact").unwrap();
    assert_eq!(exact.block_size.map(|b| b.get()), Some(16));
    assert!(snap.service("chat-rr").unwrap().block_size.is_none());
    let profile = exact.profile.as_ref().unwrap();
    assert_eq!(
        profile.source,
        routing_rules::ProfileSource::Gguf {
            path: "${KVGATE_MODEL_DIR:-../models}/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            chat_template: None,
        }
    );
    // Relative to the rules file: the workspace's models/ unless KVGATE_MODEL_DIR says otherwise.
    let examples = workspace_root().join("examples");
    let resolve = |dir: Option<&'static str>| match profile
        .source
        .resolve(Some(&examples), move |name| {
            dir.filter(|_| name == "KVGATE_MODEL_DIR")
                .map(str::to_owned)
        })
        .unwrap()
    {
        routing_rules::ProfileSource::Gguf { path, .. } => path,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        resolve(None),
        examples.join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    );
    assert_eq!(
        resolve(Some("/srv/models")),
        std::path::PathBuf::from("/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    );
}

/// Every field name of the schema (collected from a fully populated rule set) is documented.
#[test]
fn docs_mention_every_field() {
    let mut rules = parse(&docs_example());
    // Make sure optional fields are present so their names serialize.
    if let Rule::KvExact(k) = &mut rules.services[1].rule {
        k.load_slack = Some(1);
    }
    let value = serde_json::to_value(&rules).unwrap();
    let mut keys = BTreeSet::new();
    fn walk(v: &serde_json::Value, keys: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    keys.insert(k.clone());
                    walk(v, keys);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, keys)),
            _ => {}
        }
    }
    walk(&value, &mut keys);
    keys.remove("zone"); // a label key, not a field
    for extra in [
        "gguf",
        "tokenizer_json",
        "tokenizer_config",
        "allow_body_salt",
        "header",
        "mode",
    ] {
        keys.insert(extra.to_owned());
    }
    let docs = docs_text();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !docs.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "fields missing from docs/rules.md: {missing:?}"
    );
}

#[test]
fn invalid_errors_have_stable_types() {
    let e = RulesError::ServiceNotFound { name: "x".into() };
    assert_eq!(e.error_type(), "service_not_found");
    assert!(e.problems().is_empty());
}
