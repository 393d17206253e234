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
use prefix_index::{BlockKey, BlockSize, HashAlgorithm, KeyChain, NamespaceInputs, NamespaceSeed};
use prompt_profile::{ChatMessage, PromptProfile};
use routing_rules::schema::{ProfileSource, ProfileSpec};

use crate::error::GatewayError;
use crate::protocol::{PromptInput, PromptSource};

/// A loaded, verified profile.
pub struct LoadedProfile {
    /// As pinned in the rules.
    pub spec: ProfileSpec,
    /// Tokenizer and template.
    pub profile: PromptProfile,
    /// Block size, validated.
    pub block_size: BlockSize,
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
    /// Loads the profile's tokenizer and template and checks the pinned hashes.
    pub fn load(spec: &ProfileSpec) -> Result<LoadedProfile, GatewayError> {
        let cfg = |reason: String| GatewayError::Config {
            reason: format!("profile {}: {reason}", spec.id),
        };
        let profile = match &spec.source {
            ProfileSource::Gguf { path } => PromptProfile::from_gguf(path),
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
        let block_size = BlockSize::new(spec.block_size).map_err(|e| cfg(e.to_string()))?;
        Ok(LoadedProfile {
            spec: spec.clone(),
            profile,
            block_size,
        })
    }

    /// The hash algorithm of this profile's keys.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.spec.hash_algorithm
    }

    /// The namespace seed for a salt (no adapter).
    pub fn seed(&self, salt: Option<&str>) -> NamespaceSeed {
        NamespaceSeed::derive(&NamespaceInputs {
            model_id: &self.spec.model_id,
            revision: &self.spec.revision,
            template_sha256: &self.spec.template_sha256,
            tokenizer_sha256: &self.spec.tokenizer_sha256,
            block_size: self.block_size,
            algorithm: self.spec.hash_algorithm,
            salt,
            adapter: None,
        })
    }

    /// Renders (chat) or takes (completion) the prompt and tokenizes it.
    pub fn tokenize(&self, prompt: &PromptSource) -> Result<Vec<u32>, GatewayError> {
        let prompt_err = |reason: String| GatewayError::Prompt { reason };
        match prompt {
            PromptSource::Messages(values) => {
                let messages = values
                    .iter()
                    .map(|v| serde_json::from_value::<ChatMessage>(v.clone()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| GatewayError::InvalidBody {
                        reason: format!("`messages`: {e}"),
                    })?;
                self.profile
                    .render_and_encode(&messages)
                    .map(|r| r.ids)
                    .map_err(|e| prompt_err(e.to_string()))
            }
            PromptSource::Prompt(PromptInput::Text(text)) => self
                .profile
                .encode(text, true)
                .map_err(|e| prompt_err(e.to_string())),
            PromptSource::Prompt(PromptInput::Tokens(ids)) => Ok(ids.clone()),
        }
    }

    /// Tokenizes and computes the block keys in the namespace of `salt`.
    pub fn keys(
        &self,
        prompt: &PromptSource,
        salt: Option<&str>,
    ) -> Result<Tokenized, GatewayError> {
        let tokens = self.tokenize(prompt)?;
        let seed = self.seed(salt);
        let keys = KeyChain::new(seed, self.spec.hash_algorithm, self.block_size).keys(&tokens);
        Ok(Tokenized { tokens, keys, seed })
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
                None => Arc::new(LoadedProfile::load(&spec)?),
            };
            keep.insert(key, loaded.clone());
            out.insert(id, loaded);
        }
        *cache = keep;
        Ok(out)
    }
}
