//! The rules file model: what the TOML rules file and the admin API's JSON both deserialize
//! into. Every struct denies unknown fields; every optional field has a documented default
//! (the same defaults are listed in `docs/rules.md`, which a test parses).
//!
//! This module only describes shapes. Cross-field checks (duplicate ids, dangling references,
//! ranges, overlapping services) live in [`crate::validate`], which returns every problem at
//! once; parsing with error paths lives in [`crate::parse`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use prefix_index::{HashAlgorithm, WorkerId};
use serde::{Deserialize, Serialize};

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl $name {
            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }
    };
}

string_id!(
    /// Name of a service (`chat-rr`); unique in a rules file, used in admin URLs and metric labels.
    ServiceName
);
string_id!(
    /// Id of a pool of workers.
    PoolId
);
string_id!(
    /// Id of a prompt profile.
    ProfileId
);
string_id!(
    /// Name of a gateway listener (declared under `[gateway] listeners`).
    ListenerName
);
string_id!(
    /// Id of a tenant (`[[tenants]]`): who an API key authenticates, and the cache salt of its
    /// requests under `salt = { mode = "tenant" }`.
    TenantId
);

/// Default `path_prefix` of a service match.
pub const DEFAULT_PATH_PREFIX: &str = "/v1/";
/// Default `max_body_bytes` of a service: 16 MiB.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
/// Default `max_load_ratio` of a `kv_exact` rule.
pub const DEFAULT_MAX_LOAD_RATIO: f64 = 1.5;
/// Default `upstream.connect_timeout_ms`.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Default `upstream.read_timeout_ms`.
pub const DEFAULT_READ_TIMEOUT_MS: u64 = 300_000;
/// Default `upstream.idle_timeout_ms`.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default `upstream.refused_retries`: a request a worker refused (429 / 503) is offered to up
/// to this many other candidates.
pub const DEFAULT_REFUSED_RETRIES: u32 = 2;
/// Largest `upstream.refused_retries` the rules accept.
pub const MAX_REFUSED_RETRIES: u32 = 16;
/// Default `gateway.health_interval_ms`.
pub const DEFAULT_HEALTH_INTERVAL_MS: u64 = 1_000;
/// Default routing-time holding TTL of a `kv_exact` rule (ms).
pub const DEFAULT_PENDING_TTL_MS: u64 = 2000;

fn default_pending_ttl_ms() -> u64 {
    DEFAULT_PENDING_TTL_MS
}

/// Default load slack of a `kv_exact` rule whose `load_metric` is `in_flight` (requests).
pub const DEFAULT_LOAD_SLACK_IN_FLIGHT: u64 = 1;
/// Default load slack of a `kv_exact` rule whose `load_metric` is `active_tokens` (tokens).
pub const DEFAULT_LOAD_SLACK_ACTIVE_TOKENS: u64 = 1_024;

/// The whole rules file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesFile {
    /// Gateway-wide settings; optional (default: no named listeners, defaults below).
    #[serde(default)]
    pub gateway: GatewaySpec,
    /// The workers the gateway may route to. Default: none.
    #[serde(default)]
    pub workers: Vec<WorkerSpec>,
    /// Named sets of workers. Default: none.
    #[serde(default)]
    pub pools: Vec<PoolSpec>,
    /// Prompt profiles that `kv_exact` rules pin. Default: none.
    #[serde(default)]
    pub profiles: Vec<ProfileSpec>,
    /// Services: how a request matches and how it is routed. Default: none.
    #[serde(default)]
    pub services: Vec<ServiceSpec>,
    /// Tenants that services with `auth = "api_key"` authenticate. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantSpec>,
    /// Cordoned workers: ids (declared under `workers` or registered in cluster mode) that take
    /// no new requests; what is in flight on them finishes, they stay probed and their KV
    /// events indexed. An id no worker has cordons nothing (yet). Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cordoned: Vec<WorkerId>,
}

/// One tenant (`[[tenants]]`): the API keys it authenticates with (their SHA-256, never the keys)
/// and its rate limits (token buckets; none by default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Tenant id; unique; letters, digits, `.`, `_`, `-`.
    pub id: TenantId,
    /// SHA-256 (64 lowercase hex) of each API key of the tenant (`printf %s KEY | sha256sum`);
    /// at least one; a hash may belong to one tenant only.
    pub api_keys_sha256: Vec<String>,
    /// Requests per second the tenant may send (token bucket). Default: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
    /// Requests the bucket holds (a burst). Default: `max(1, ⌈requests_per_second⌉)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_burst: Option<u32>,
    /// Tokens per second: prompt tokens (as the gateway counts them for `kv_exact`, else body
    /// bytes ÷ 4) plus the requested output tokens. Default: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Tokens the bucket holds. Default: `max(1, ⌈tokens_per_second⌉)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_burst: Option<u64>,
    /// Requests of the tenant in flight at once through one gateway (from admission to the
    /// answer's end, streams included); more get 429. Default: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_requests: Option<u32>,
    /// The services (with `auth = "api_key"`) this tenant may call; its requests to another
    /// get the answer a service that does not exist gets (404 `service_not_found`), and
    /// `GET /v1/models` lists only these services' models to it. Default (empty): every
    /// service with `auth = "api_key"`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceName>,
}

impl TenantSpec {
    /// Whether the tenant may call service `name` (its `services`, or every one when empty).
    pub fn may_use(&self, name: &str) -> bool {
        self.services.is_empty() || self.services.iter().any(|s| s.0 == name)
    }
}

/// Who may call a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthPolicy {
    /// Anyone who reaches the VIP (put authentication in front).
    #[default]
    None,
    /// `Authorization: Bearer <API key>` of a `[[tenants]]` entry; 401 otherwise.
    ApiKey,
}

/// Gateway-wide settings (`[gateway]`). Every field is optional.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySpec {
    /// Named listeners. A service may restrict itself to one with `match.listener`.
    /// Default: none (the gateway binary's command line decides where it listens).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<ListenerSpec>,
    /// Address of the admin plane (`127.0.0.1:9000`). Default: none (the command line decides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_addr: Option<String>,
    /// Interval between worker health probes, in milliseconds. Default: 1000.
    #[serde(default = "default_health_interval_ms")]
    pub health_interval_ms: u64,
}

impl Default for GatewaySpec {
    fn default() -> Self {
        Self {
            listeners: Vec::new(),
            admin_addr: None,
            health_interval_ms: DEFAULT_HEALTH_INTERVAL_MS,
        }
    }
}

/// One named listener.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerSpec {
    /// Listener name, referenced by `services.match.listener`.
    pub name: ListenerName,
    /// Socket address to bind (`0.0.0.0:8080`).
    pub addr: String,
}

/// One worker (`[[workers]]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Worker id (`w1`); unique; letters, digits, `.`, `_`, `-`.
    pub id: WorkerId,
    /// Base URL, `http://host:port` (an optional path prefix is allowed; no query).
    pub url: String,
    /// Weight for weighted round robin, >= 1. Default: 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Free-form labels, reported by the admin API. Default: none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// What answers at `url`. Default: `kvgate`.
    #[serde(default, skip_serializing_if = "UpstreamKind::is_default")]
    pub kind: UpstreamKind,
    /// Path of the active health probe (2xx = healthy). Default by kind: `/ready` (kvgate),
    /// `/health` (llama_cpp, openai).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_path: Option<String>,
    /// What the gateway believes a worker without KV events holds (kinds `openai` and
    /// `llama_cpp`, or a kvgate worker without an event stream). Default: the gateway's
    /// `--approx-ttl-ms`, no prefix limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache: Option<PromptCacheSpec>,
}

/// The kind of server a worker URL reaches (`[[workers]] kind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamKind {
    /// A kvgate worker (or a kvgate sidecar in front of one): `/v1/profile`, KV events,
    /// tickets, receipts.
    #[default]
    Kvgate,
    /// Any OpenAI-compatible server (vLLM, SGLang, TGI, ...), directly or behind
    /// `kvgate sidecar`: no profile endpoint, no KV events.
    Openai,
    /// llama.cpp's `llama-server` (directly or behind `kvgate sidecar`): `/health`, `/props`,
    /// `/tokenize`, no KV events.
    LlamaCpp,
    /// vLLM behind `kvgate sidecar --kind vllm --kv-events …`: the contract check of
    /// `openai`, and the engine's own KV events, mapped to kvgate block keys by the sidecar
    /// and subscribed to as a kvgate worker's (`/v1/kv/events`; approximated when absent).
    Vllm,
}

impl UpstreamKind {
    /// Whether this is the default (`kvgate`).
    pub fn is_default(&self) -> bool {
        *self == UpstreamKind::Kvgate
    }

    /// The default health path.
    pub fn default_health_path(&self) -> &'static str {
        match self {
            UpstreamKind::Kvgate => "/ready",
            UpstreamKind::Openai | UpstreamKind::LlamaCpp | UpstreamKind::Vllm => "/health",
        }
    }

    /// Whether the server publishes kvgate KV events (or may: a `vllm` sidecar started
    /// without `--kv-events` answers 404, and its holdings are approximated).
    pub fn has_events(&self) -> bool {
        matches!(self, UpstreamKind::Kvgate | UpstreamKind::Vllm)
    }

    /// The name in the rules file.
    pub fn as_str(&self) -> &'static str {
        match self {
            UpstreamKind::Kvgate => "kvgate",
            UpstreamKind::Openai => "openai",
            UpstreamKind::LlamaCpp => "llama_cpp",
            UpstreamKind::Vllm => "vllm",
        }
    }
}

impl WorkerSpec {
    /// The health probe's path (the configured one, else the kind's default).
    pub fn health_path(&self) -> &str {
        self.health_path
            .as_deref()
            .unwrap_or_else(|| self.kind.default_health_path())
    }
}

/// The approximate prompt cache of a worker without KV events (`[[workers]] prompt_cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptCacheSpec {
    /// How long a routed prompt is believed cached, ms (1..=86400000). Default: the
    /// gateway's `--approx-ttl-ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Most prompts believed cached at once (≥ 1): a slot-based cache such as
    /// `llama-server --parallel N --cache-ram 0` holds one per slot. Default: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prefixes: Option<u32>,
}

/// A named set of workers (`[[pools]]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Pool id; unique.
    pub id: PoolId,
    /// Worker ids; no duplicates, each declared under `workers`. May be empty only with a
    /// `selector`.
    #[serde(default)]
    pub workers: Vec<WorkerId>,
    /// Labels a worker must all carry to be a member too (static workers and, in cluster mode,
    /// registered ones). Default: none (only the listed workers).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub selector: BTreeMap<String, String>,
}

impl PoolSpec {
    /// Whether `w` is a member: listed, or carrying every selector label.
    pub fn contains(&self, w: &WorkerSpec) -> bool {
        self.workers.contains(&w.id)
            || (!self.selector.is_empty()
                && self
                    .selector
                    .iter()
                    .all(|(k, v)| w.labels.get(k) == Some(v)))
    }
}

/// A prompt profile (`[[profiles]]`): what a `kv_exact` service pins so that the gateway and
/// every worker of its pool tokenize a request identically.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    /// Profile id; unique.
    pub id: ProfileId,
    /// Model id as the workers report it (`SmolLM2-135M-Instruct`).
    pub model_id: String,
    /// Model revision as the workers report it.
    pub revision: String,
    /// Model architecture as the workers report it (GGUF `general.architecture`: `llama`,
    /// `qwen2`, `qwen3`, `phi3`, `gemma3`, …). Optional: when absent, a GGUF source's own
    /// `general.architecture` is pinned; a HF source pins none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// Where the gateway loads the tokenizer and chat template from.
    pub source: ProfileSource,
    /// Pinned SHA-256 of the chat template, 64 lowercase hex digits.
    pub template_sha256: String,
    /// Pinned SHA-256 of the tokenizer, 64 lowercase hex digits.
    pub tokenizer_sha256: String,
    /// Tokens per KV block, 1..=1024.
    pub block_size: u32,
    /// Block-key hash algorithm: `xxh3` or `sha256`. Default: `xxh3`.
    #[serde(default)]
    pub hash_algorithm: HashAlgorithm,
    /// Context window of the model, in tokens; > `native_reserve_tokens`.
    pub context_limit: u32,
    /// Tokens the engine reserves beyond prompt + output (counted by the token budget). Default: 0.
    #[serde(default)]
    pub native_reserve_tokens: u32,
}

/// Where a profile's tokenizer and template come from. In TOML either
/// `source = { gguf = "models/x.gguf" }` or
/// `source = { tokenizer_json = "tokenizer.json", tokenizer_config = "tokenizer_config.json" }`.
/// Paths may name environment variables, `${NAME}` or `${NAME:-default}` (e.g.
/// `"${KVGATE_MODEL_DIR:-../models}/SmolLM2-135M-Instruct.Q4_1.gguf"`); after expansion a relative
/// path is relative to the directory of the rules file ([`ProfileSource::resolve`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawProfileSource", into = "RawProfileSource")]
pub enum ProfileSource {
    /// Tokenizer and chat template from a GGUF file's metadata.
    Gguf {
        /// Path of the GGUF file.
        path: PathBuf,
        /// A Jinja chat template file to use instead of the GGUF's (for a GGUF without one;
        /// the workers must use the same file: `kvgate worker --chat-template`).
        chat_template: Option<PathBuf>,
    },
    /// A Hugging Face `tokenizer.json` plus the `tokenizer_config.json` carrying `chat_template`.
    TokenizerJson {
        /// Path of `tokenizer.json`.
        tokenizer_json: PathBuf,
        /// Path of `tokenizer_config.json`.
        tokenizer_config: PathBuf,
    },
}

/// Expands `${NAME}` and `${NAME:-default}` in `s` with `env`; an unset `NAME` without a default
/// is an error naming it. `$` not followed by `{` is kept.
pub fn expand_env(s: &str, env: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(end) = after.find('}') else {
            return Err(format!("unclosed `${{` in {s:?}"));
        };
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        let valid =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(format!("`${{{inner}}}` in {s:?} is not a variable name"));
        }
        match (env(name).filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "environment variable {name} is not set (in {s:?}; `${{{name}:-default}}` gives a default)"
                ))
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl ProfileSource {
    /// The source with environment variables expanded (`env`) and relative paths joined to
    /// `base` (the rules file's directory, when there is one).
    pub fn resolve(
        &self,
        base: Option<&std::path::Path>,
        env: impl Fn(&str) -> Option<String> + Copy,
    ) -> Result<ProfileSource, String> {
        let one = |p: &PathBuf| -> Result<PathBuf, String> {
            let text = p
                .to_str()
                .ok_or_else(|| format!("path {} is not UTF-8", p.display()))?;
            let expanded = PathBuf::from(expand_env(text, env)?);
            Ok(match base {
                Some(b) if expanded.is_relative() => b.join(expanded),
                _ => expanded,
            })
        };
        Ok(match self {
            ProfileSource::Gguf {
                path,
                chat_template,
            } => ProfileSource::Gguf {
                path: one(path)?,
                chat_template: chat_template.as_ref().map(one).transpose()?,
            },
            ProfileSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config,
            } => ProfileSource::TokenizerJson {
                tokenizer_json: one(tokenizer_json)?,
                tokenizer_config: one(tokenizer_config)?,
            },
        })
    }
}

/// The on-disk shape of [`ProfileSource`]; converted with a clear error when the combination
/// of keys is not one of the two allowed forms.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfileSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gguf: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokenizer_json: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokenizer_config: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chat_template: Option<PathBuf>,
}

impl TryFrom<RawProfileSource> for ProfileSource {
    type Error = String;

    fn try_from(raw: RawProfileSource) -> Result<Self, Self::Error> {
        match (raw.gguf, raw.tokenizer_json, raw.tokenizer_config) {
            (Some(path), None, None) => Ok(Self::Gguf {
                path,
                chat_template: raw.chat_template,
            }),
            (None, Some(tokenizer_json), Some(tokenizer_config)) if raw.chat_template.is_none() => {
                Ok(Self::TokenizerJson {
                    tokenizer_json,
                    tokenizer_config,
                })
            }
            _ => Err(
                "source must be either { gguf = PATH } (optionally with chat_template = PATH) \
                      or { tokenizer_json = PATH, tokenizer_config = PATH }"
                    .to_owned(),
            ),
        }
    }
}

impl From<ProfileSource> for RawProfileSource {
    fn from(source: ProfileSource) -> Self {
        match source {
            ProfileSource::Gguf {
                path,
                chat_template,
            } => Self {
                gguf: Some(path),
                tokenizer_json: None,
                tokenizer_config: None,
                chat_template,
            },
            ProfileSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config,
            } => Self {
                gguf: None,
                tokenizer_json: Some(tokenizer_json),
                tokenizer_config: Some(tokenizer_config),
                chat_template: None,
            },
        }
    }
}

/// One service (`[[services]]`); also the body of the admin API's `PUT /services/{name}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Service name; unique; letters, digits, `.`, `_`, `-`.
    pub name: ServiceName,
    /// Which requests this service takes. Default: every request under `/v1/`.
    #[serde(rename = "match", default)]
    pub matcher: MatchSpec,
    /// The pool the rule picks workers from.
    pub pool: PoolId,
    /// The routing rule.
    pub rule: Rule,
    /// Upstream timeouts. Default: see [`UpstreamSpec`].
    #[serde(default)]
    pub upstream: UpstreamSpec,
    /// Largest accepted request body, in bytes; > 0. Default: 16 MiB (16777216).
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    /// What to do when prompt + output + reserve exceed the context limit. Default: `reject`.
    #[serde(default)]
    pub token_budget: TokenBudgetPolicy,
    /// Who may call the service. Default: `none`.
    #[serde(default, skip_serializing_if = "is_default_auth")]
    pub auth: AuthPolicy,
}

fn is_default_auth(a: &AuthPolicy) -> bool {
    *a == AuthPolicy::None
}

/// How a request is matched to a service. A request matches when every given criterion holds.
/// No two services of one rules file may match the same request (checked by validation).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    /// Only requests arriving on this named listener. Default: any listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener: Option<ListenerName>,
    /// Only requests whose `Host` (port stripped, case-insensitive) equals this. Default: any host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Only paths starting with this prefix; must start with `/`. Default: `/v1/`.
    #[serde(default = "default_path_prefix")]
    pub path_prefix: String,
    /// Only requests whose body `model` is one of these. Default: empty = any model (and
    /// requests without a `model`).
    #[serde(default)]
    pub models: Vec<String>,
}

impl Default for MatchSpec {
    fn default() -> Self {
        Self {
            listener: None,
            host: None,
            path_prefix: default_path_prefix(),
            models: Vec::new(),
        }
    }
}

/// The routing rule of a service, tagged by `type`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Rule {
    /// Round robin over the pool's healthy workers.
    RoundRobin(RoundRobinRule),
    /// Route to the worker holding the longest cached prefix, with a load guard.
    KvExact(KvExactRule),
}

impl Rule {
    /// The rule's type as written in the file (`round_robin`, `kv_exact`); also a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Rule::RoundRobin(_) => "round_robin",
            Rule::KvExact(_) => "kv_exact",
        }
    }
}

/// Parameters of `type = "round_robin"`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundRobinRule {
    /// Use the workers' `weight` (smooth weighted round robin). Default: false.
    #[serde(default)]
    pub weighted: bool,
}

/// Parameters of `type = "kv_exact"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvExactRule {
    /// The pinned prompt profile. Required (validation reports it when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileId>,
    /// Cache-salt policy. Default: `{ mode = "none" }`.
    #[serde(default)]
    pub salt: SaltPolicy,
    /// Load guard: a worker whose load is at or above
    /// `max(max_load_ratio × pool mean load, pool mean load + load_slack)` is skipped for the
    /// next-best match. Finite and >= 1.0. Default: 1.5.
    #[serde(default = "default_max_load_ratio")]
    pub max_load_ratio: f64,
    /// Additive allowance of the load guard, in units of `load_metric`, so that tiny loads do
    /// not trip it. Default: 1 for `in_flight`, 1024 for `active_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_slack: Option<u64>,
    /// A match counts as a hit only when it covers at least this many tokens (rounded up to
    /// whole blocks; at least one block). Default: 0 (any full block).
    #[serde(default)]
    pub min_match_tokens: u32,
    /// Choice when no healthy worker has a hit. Default: `least_loaded`.
    #[serde(default)]
    pub on_no_match: NoMatchPolicy,
    /// Which load the gateway feeds the policy. Default: `active_tokens`.
    #[serde(default)]
    pub load_metric: LoadMetric,
    /// Routing-time holdings: a routed prompt's blocks count as held by the chosen worker for
    /// placement for this long (ms), until its KV events confirm them; never as a cache hit in
    /// the ticket's prediction. 0 = off. At most 60000. Default: 2000.
    #[serde(default = "default_pending_ttl_ms")]
    pub pending_ttl_ms: u64,
    /// How the admissible candidates are ranked. Default: `least_cost`.
    #[serde(default)]
    pub placement: Placement,
    /// `least_cost`: the weight of the prompt tokens a candidate would still have to compute
    /// (prompt − its matched prefix) against the tokens already queued there. Finite, 0..=1000.
    /// Default: 2.0 — a token computed cold costs the fleet its compute on top of this
    /// request's wait, a queued token only the wait.
    #[serde(default = "default_uncached_weight")]
    pub uncached_weight: f64,
    /// `least_cost`: the weight of a candidate's queued decode tokens (output tokens still to
    /// generate there) against its queued prefill tokens. Finite, 0..=1000. Default: 0.25.
    #[serde(default = "default_decode_weight")]
    pub decode_weight: f64,
}

/// How `kv_exact` ranks the candidates that pass the load guard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Least estimated cost: `uncached_weight × (prompt − matched) + queued prefill tokens +
    /// decode_weight × queued decode tokens`; ties go to the longer match, then lower load.
    #[default]
    LeastCost,
    /// Longest match first, then lower load (the ranking before least-cost placement).
    LongestMatch,
}

/// Default `uncached_weight` of a `kv_exact` rule.
pub const DEFAULT_UNCACHED_WEIGHT: f64 = 2.0;
/// Default `decode_weight` of a `kv_exact` rule.
pub const DEFAULT_DECODE_WEIGHT: f64 = 0.25;

fn default_uncached_weight() -> f64 {
    DEFAULT_UNCACHED_WEIGHT
}
fn default_decode_weight() -> f64 {
    DEFAULT_DECODE_WEIGHT
}

impl KvExactRule {
    /// The effective load slack: the configured one or the default for the load metric.
    pub fn effective_load_slack(&self) -> u64 {
        self.load_slack.unwrap_or(match self.load_metric {
            LoadMetric::InFlight => DEFAULT_LOAD_SLACK_IN_FLIGHT,
            LoadMetric::ActiveTokens => DEFAULT_LOAD_SLACK_ACTIVE_TOKENS,
        })
    }
}

/// Which cache salt a request's block keys are computed in, tagged by `mode`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum SaltPolicy {
    /// No salt; a body `cache_salt` is refused.
    #[default]
    None,
    /// One salt for the whole service; a body `cache_salt` is refused.
    Fixed {
        /// The salt; non-empty.
        salt: String,
    },
    /// The body's `cache_salt`, when present, is the salt.
    PerRequest,
    /// The authenticated tenant (`auth = "api_key"`) is the salt (`tenant:<id>`): tenants never
    /// share cached prefixes and no client picks its salt — a body `cache_salt` is refused.
    Tenant,
    /// The value of a request header (e.g. a tenant id) is the salt; it overrides the body.
    TenantHeader {
        /// Header name, lowercase (`x-tenant-id`).
        header: String,
        /// Whether a body `cache_salt` is used when the header is absent. Default: false
        /// (a body `cache_salt` is then refused).
        #[serde(default)]
        allow_body_salt: bool,
    },
}

/// Why a request's salt was refused (the gateway answers 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaltRefused {
    /// Human-readable reason.
    pub reason: &'static str,
}

/// What a request offers the salt policy.
#[derive(Clone, Copy, Debug, Default)]
pub struct SaltInputs<'a> {
    /// The value of the policy's tenant header, when the request carries it.
    pub header: Option<&'a str>,
    /// The tenant the request authenticated as (`auth = "api_key"`).
    pub tenant: Option<&'a str>,
    /// The body's `cache_salt`.
    pub body: Option<&'a str>,
}

impl SaltPolicy {
    /// The salt a request's keys use. `Ok(None)` = unsalted.
    pub fn effective_salt(&self, i: SaltInputs<'_>) -> Result<Option<String>, SaltRefused> {
        match self {
            SaltPolicy::None => match i.body {
                Some(_) => Err(SaltRefused {
                    reason: "cache_salt is not allowed by this service's salt policy (none)",
                }),
                None => Ok(None),
            },
            SaltPolicy::Fixed { salt } => match i.body {
                Some(_) => Err(SaltRefused {
                    reason: "cache_salt is not allowed by this service's salt policy (fixed)",
                }),
                None => Ok(Some(salt.clone())),
            },
            SaltPolicy::PerRequest => Ok(i.body.map(str::to_owned)),
            SaltPolicy::Tenant => {
                if i.body.is_some() {
                    return Err(SaltRefused {
                        reason: "cache_salt is not allowed: this service salts by the \
                                 authenticated tenant",
                    });
                }
                match i.tenant {
                    Some(t) => Ok(Some(format!("tenant:{t}"))),
                    None => Err(SaltRefused {
                        reason: "the tenant salt needs an authenticated tenant",
                    }),
                }
            }
            SaltPolicy::TenantHeader {
                allow_body_salt, ..
            } => {
                if i.body.is_some() && !*allow_body_salt {
                    return Err(SaltRefused {
                        reason: "cache_salt is not allowed by this service's salt policy \
                                 (tenant_header without allow_body_salt)",
                    });
                }
                // The header, when present, overrides the body.
                Ok(i.header.or(i.body).map(str::to_owned))
            }
        }
    }
}

/// What `kv_exact` does when no healthy worker has a hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoMatchPolicy {
    /// The healthy worker with the lowest load (ties rotate).
    #[default]
    LeastLoaded,
    /// Plain rotation over the healthy workers under the load guard.
    RoundRobin,
}

/// The load signal a `kv_exact` rule compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMetric {
    /// Requests in flight from this gateway to the worker.
    InFlight,
    /// Active tokens of this gateway's requests in flight to the worker: each
    /// one's uncached prompt tokens (prompt − predicted cached) until its first response byte,
    /// plus its requested output tokens (`max_tokens`, else 256) until it ends. A request the
    /// gateway did not tokenize (round robin) counts a quarter of its body's bytes as prompt.
    #[default]
    ActiveTokens,
}

impl LoadMetric {
    /// Stable string for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadMetric::InFlight => "in_flight",
            LoadMetric::ActiveTokens => "active_tokens",
        }
    }
}

/// Upstream timeouts of a service (`[services.upstream]`). Every value > 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSpec {
    /// TCP connect timeout, ms. Default: 1000.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Longest wait for the next bytes of the response, ms. Default: 300000.
    #[serde(default = "default_read_timeout_ms")]
    pub read_timeout_ms: u64,
    /// How long an idle pooled upstream connection is kept, ms. Default: 60000.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// How many other candidates a request is offered to when a worker refuses it before
    /// answering (429 or 503: queue full, admission timeout, stopping, engine failed); 0 hands
    /// the refusal to the client. Default: 2.
    #[serde(default = "default_refused_retries")]
    pub refused_retries: u32,
}

impl Default for UpstreamSpec {
    fn default() -> Self {
        Self {
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            read_timeout_ms: DEFAULT_READ_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
            refused_retries: DEFAULT_REFUSED_RETRIES,
        }
    }
}

/// Token-budget policy: prompt tokens + requested output tokens + native reserve must fit the
/// profile's context limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenBudgetPolicy {
    /// Refuse an over-budget request with 400 (never truncate).
    #[default]
    Reject,
    /// Do not check in the gateway (the worker still refuses what it cannot hold).
    Off,
}

fn default_weight() -> u32 {
    1
}
fn default_path_prefix() -> String {
    DEFAULT_PATH_PREFIX.to_owned()
}
fn default_max_body_bytes() -> u64 {
    DEFAULT_MAX_BODY_BYTES
}
fn default_max_load_ratio() -> f64 {
    DEFAULT_MAX_LOAD_RATIO
}
fn default_connect_timeout_ms() -> u64 {
    DEFAULT_CONNECT_TIMEOUT_MS
}
fn default_read_timeout_ms() -> u64 {
    DEFAULT_READ_TIMEOUT_MS
}
fn default_idle_timeout_ms() -> u64 {
    DEFAULT_IDLE_TIMEOUT_MS
}
fn default_refused_retries() -> u32 {
    DEFAULT_REFUSED_RETRIES
}
fn default_health_interval_ms() -> u64 {
    DEFAULT_HEALTH_INTERVAL_MS
}

impl RulesFile {
    /// The service named `name`, if any.
    pub fn service(&self, name: &str) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.name.0 == name)
    }

    /// Replace the service with the same name in place, or append it. Returns whether a
    /// service was replaced.
    pub fn upsert_service(&mut self, spec: ServiceSpec) -> bool {
        match self.services.iter_mut().find(|s| s.name == spec.name) {
            Some(slot) => {
                *slot = spec;
                true
            }
            None => {
                self.services.push(spec);
                false
            }
        }
    }

    /// Remove the service named `name`; returns it when it existed.
    pub fn remove_service(&mut self, name: &str) -> Option<ServiceSpec> {
        let pos = self.services.iter().position(|s| s.name.0 == name)?;
        Some(self.services.remove(pos))
    }

    /// Whether worker `id` is cordoned.
    pub fn is_cordoned(&self, id: &WorkerId) -> bool {
        self.cordoned.contains(id)
    }

    /// Cordons worker `id` (appended, once) or lifts its cordon.
    pub fn set_cordoned(&mut self, id: &WorkerId, cordoned: bool) {
        if !cordoned {
            self.cordoned.retain(|w| w != id);
        } else if !self.is_cordoned(id) {
            self.cordoned.push(id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_variables_with_defaults_and_joins_relative_paths() {
        let env = |n: &str| (n == "DIR").then(|| "/data/models".to_string());
        assert_eq!(
            expand_env("${DIR}/m.gguf", env).unwrap(),
            "/data/models/m.gguf"
        );
        assert_eq!(
            expand_env("${NOPE:-../models}/m.gguf", env).unwrap(),
            "../models/m.gguf"
        );
        assert_eq!(expand_env("$HOME/x", env).unwrap(), "$HOME/x");
        assert!(expand_env("${NOPE}/m", env).unwrap_err().contains("NOPE"));
        assert!(expand_env("${bad name}", env).is_err());
        assert!(expand_env("${DIR", env).is_err());
        let src = ProfileSource::Gguf {
            path: "${NOPE:-../models}/m.gguf".into(),
            chat_template: None,
        };
        let r = src
            .resolve(Some(std::path::Path::new("/etc/kvgate")), env)
            .unwrap();
        assert_eq!(
            r,
            ProfileSource::Gguf {
                path: "/etc/kvgate/../models/m.gguf".into(),
                chat_template: None,
            }
        );
        let with_template: RawProfileSource =
            toml::from_str("gguf = \"m.gguf\"\nchat_template = \"t.jinja\"").unwrap();
        assert_eq!(
            ProfileSource::try_from(with_template).unwrap(),
            ProfileSource::Gguf {
                path: "m.gguf".into(),
                chat_template: Some("t.jinja".into()),
            }
        );
        let hf_with_template: RawProfileSource = toml::from_str(
            "tokenizer_json = \"a\"\ntokenizer_config = \"b\"\nchat_template = \"t\"",
        )
        .unwrap();
        assert!(ProfileSource::try_from(hf_with_template).is_err());
        let r = src.resolve(None, |_| Some("/abs".into())).unwrap();
        assert_eq!(
            r,
            ProfileSource::Gguf {
                path: "/abs/m.gguf".into(),
                chat_template: None,
            }
        );
    }
}
