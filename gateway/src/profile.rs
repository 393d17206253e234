//! A `kv_exact` service's pinned prompt profile, loaded once and shared by every view that
//! uses it: render the chat template, tokenize, and compute block keys in the request's
//! namespace.
//!
//! Loading checks the pinned template and tokenizer hashes against the files actually loaded,
//! so a profile file that changed on disk is refused instead of silently splitting the gateway's
//! tokens from the workers'. Rendering + tokenizing is O(prompt length); key computation is
//! O(prompt tokens) (one hash per full block).

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use prefix_index::{BlockKey, BlockSize, HashAlgorithm, NamespaceSeed};
use prompt_profile::{KeySpace, PromptProfile, PromptSource, TokenBudget};
use routing_rules::schema::{ProfileSource, ProfileSpec};

use crate::error::GatewayError;

/// A loaded, verified profile.
pub struct LoadedProfile {
    /// As pinned in the rules.
    pub spec: ProfileSpec,
    /// Tokenizer and template.
    pub profile: PromptProfile,
    /// Block size, validated.
    pub block_size: BlockSize,
    /// The pinned block-key space (the prompt contract's namespace rule).
    pub key_space: KeySpace,
}

impl std::fmt::Debug for LoadedProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedProfile")
            .field("id", &self.spec.id)
            .finish()
    }
}

/// A prompt rendered and tokenized in a request's namespace.
#[derive(Clone, Debug)]
pub struct Tokenized {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Block keys of the full blocks, in order.
    pub keys: Vec<BlockKey>,
    /// The namespace seed (goes into the ticket).
    pub seed: NamespaceSeed,
}

impl LoadedProfile {
    /// Loads the profile's tokenizer and template and checks the pinned hashes. The source's
    /// paths expand environment variables and are relative to `base` (the rules file's
    /// directory).
    pub fn load(
        spec: &ProfileSpec,
        base: Option<&std::path::Path>,
    ) -> Result<LoadedProfile, GatewayError> {
        let cfg = |reason: String| GatewayError::Config {
            reason: format!("profile {}: {reason}", spec.id),
        };
        let source = spec
            .source
            .resolve(base, |name| std::env::var(name).ok())
            .map_err(cfg)?;
        let profile = match &source {
            ProfileSource::Gguf {
                path,
                chat_template: None,
            } => PromptProfile::from_gguf(path),
            ProfileSource::Gguf {
                path,
                chat_template: Some(t),
            } => std::fs::read_to_string(t)
                .map_err(|e| prompt_profile::ProfileError::Io {
                    path: t.clone(),
                    cause: e,
                })
                .and_then(|text| PromptProfile::from_gguf_with_template(path, text)),
            ProfileSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config,
            } => PromptProfile::from_hf(tokenizer_json, tokenizer_config),
        }
        .map_err(|e| cfg(e.to_string()))?;
        let id = profile.identity();
        let mut differ = Vec::new();
        if id.template_sha256 != spec.template_sha256 {
            differ.push(format!(
                "template_sha256 (pinned {}, loaded {})",
                spec.template_sha256, id.template_sha256
            ));
        }
        if id.tokenizer_sha256 != spec.tokenizer_sha256 {
            differ.push(format!(
                "tokenizer_sha256 (pinned {}, loaded {})",
                spec.tokenizer_sha256, id.tokenizer_sha256
            ));
        }
        if !differ.is_empty() {
            return Err(cfg(format!(
                "loaded files differ from the pin: {}",
                differ.join(", ")
            )));
        }
        profile.warm_up();
        let block_size = BlockSize::new(spec.block_size).map_err(|e| cfg(e.to_string()))?;
        let key_space = KeySpace {
            model_id: spec.model_id.clone(),
            revision: spec.revision.clone(),
            template_sha256: spec.template_sha256.clone(),
            tokenizer_sha256: spec.tokenizer_sha256.clone(),
            block_size,
            algorithm: spec.hash_algorithm,
        };
        Ok(LoadedProfile {
            spec: spec.clone(),
            profile,
            block_size,
            key_space,
        })
    }

    /// The hash algorithm of this profile's keys.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.spec.hash_algorithm
    }

    /// The namespace seed for a salt (no adapter).
    pub fn seed(&self, salt: Option<&str>) -> NamespaceSeed {
        self.key_space.seed(salt)
    }

    /// The token budget of the pinned profile (the worker applies the same rule).
    pub fn budget(&self) -> TokenBudget {
        TokenBudget {
            context_limit: self.spec.context_limit as usize,
            native_reserve: self.spec.native_reserve_tokens as usize,
        }
    }

    /// The prompt's token ids, by the prompt contract the worker uses too; with a budget, a
    /// prompt that provably breaks it is refused before (or while) it is tokenized
    /// (`PromptProfile::tokenize_within`).
    pub fn tokenize(
        &self,
        prompt: &PromptSource,
        budget: Option<(TokenBudget, Option<usize>)>,
    ) -> Result<Vec<u32>, GatewayError> {
        let res = match budget {
            Some((b, requested)) => self.profile.tokenize_within(prompt, b, requested),
            None => self.profile.tokenize_prompt(prompt),
        };
        res.map(|t| t.ids)
            .map_err(|e| GatewayError::from_prompt(e, prompt.param()))
    }

    /// Tokenizes (refusing what breaks `budget`, when given) and computes the block keys in the
    /// namespace of `salt`.
    pub fn keys_within(
        &self,
        prompt: &PromptSource,
        salt: Option<&str>,
        budget: Option<(TokenBudget, Option<usize>)>,
    ) -> Result<Tokenized, GatewayError> {
        let tokens = self.tokenize(prompt, budget)?;
        let seed = self.seed(salt);
        let keys = self.key_space.chain(seed).keys(&tokens);
        Ok(Tokenized { tokens, keys, seed })
    }

    /// Tokenizes and computes the block keys in the namespace of `salt` (no budget).
    pub fn keys(
        &self,
        prompt: &PromptSource,
        salt: Option<&str>,
    ) -> Result<Tokenized, GatewayError> {
        self.keys_within(prompt, salt, None)
    }
}

/// Loaded profiles, keyed by everything that determines their content, so a reload that keeps a
/// profile does not load its files again.
#[derive(Default)]
pub struct ProfileCache {
    loaded: Mutex<BTreeMap<String, Arc<LoadedProfile>>>,
}

fn cache_key(spec: &ProfileSpec) -> String {
    serde_json::to_string(spec).unwrap_or_else(|_| spec.id.0.clone())
}

impl ProfileCache {
    /// Loads (or reuses) every profile used by a `kv_exact` service of `rules`; returns them by
    /// profile id. Profiles no longer used are dropped from the cache.
    pub fn load_for(
        &self,
        rules: &routing_rules::schema::RulesFile,
        base: Option<&std::path::Path>,
    ) -> Result<BTreeMap<String, Arc<LoadedProfile>>, GatewayError> {
        let mut used = BTreeMap::new();
        for s in &rules.services {
            if let routing_rules::schema::Rule::KvExact(k) = &s.rule {
                if let Some(pid) = &k.profile {
                    if let Some(spec) = rules.profiles.iter().find(|p| &p.id == pid) {
                        used.insert(pid.0.clone(), spec.clone());
                    }
                }
            }
        }
        let mut out = BTreeMap::new();
        let mut cache = self.loaded.lock();
        let mut keep = BTreeMap::new();
        for (id, spec) in used {
            let key = cache_key(&spec);
            let loaded = match cache.get(&key) {
                Some(p) => p.clone(),
                None => Arc::new(LoadedProfile::load(&spec, base)?),
            };
            keep.insert(key, loaded.clone());
            out.insert(id, loaded);
        }
        *cache = keep;
        Ok(out)
    }
}
