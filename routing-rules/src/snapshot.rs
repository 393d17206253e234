//! [`RuleSnapshot`]: one immutable, validated rule set with its version, content hash, the
//! services resolved against their pools and profiles, and one selection policy per service.
//! A request takes one snapshot (an `Arc`) and reads everything from it for its whole life.

use std::collections::HashMap;
use std::fmt;

use prefix_index::{BlockSize, WorkerId};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Problem, RulesError};
use crate::policy::{self, SelectionPolicy};
use crate::schema::{ProfileSpec, Rule, RulesFile, ServiceSpec, WorkerSpec};
use crate::validate::validate;

/// Version of a rule set in one [`crate::RuleStore`]: starts at 1, +1 for every applied change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RuleVersion(pub u64);

impl fmt::Display for RuleVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// SHA-256 of a rule set's canonical content: the compact JSON serialization of the parsed
/// [`RulesFile`] (defaults filled in, fields in schema order, labels sorted). Comments,
/// formatting and spelled-out defaults do not change it; reordering list entries does.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    /// Hash of `rules`' canonical content.
    pub fn of(rules: &RulesFile) -> Result<Self, RulesError> {
        let bytes = serde_json::to_vec(rules).map_err(|e| RulesError::Serialize {
            message: e.to_string(),
        })?;
        Ok(Self(Sha256::digest(&bytes).into()))
    }

    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.to_hex())
    }
}

/// What the gateway knows about a request when matching it to a service.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestInfo<'a> {
    /// Name of the listener it arrived on, when listeners are named.
    pub listener: Option<&'a str>,
    /// The `Host` header (a `:port` suffix is ignored; case-insensitive).
    pub host: Option<&'a str>,
    /// The request path.
    pub path: &'a str,
    /// The body's `model`, when present.
    pub model: Option<&'a str>,
}

/// One service of a snapshot, resolved.
#[derive(Debug)]
pub struct ServiceEntry {
    /// The service as configured.
    pub spec: ServiceSpec,
    /// The members of its pool, in pool order.
    pub workers: Vec<WorkerSpec>,
    /// Its rule's profile (`kv_exact` only).
    pub profile: Option<ProfileSpec>,
    /// The profile's block size as the key type (`kv_exact` only).
    pub block_size: Option<BlockSize>,
    /// Its selection policy (rotation state lives here, per snapshot).
    pub policy: Box<dyn SelectionPolicy>,
}

impl ServiceEntry {
    /// Whether this service takes `req` (see [`crate::schema::MatchSpec`]).
    pub fn matches(&self, req: &RequestInfo<'_>) -> bool {
        let m = &self.spec.matcher;
        if let Some(l) = &m.listener {
            if req.listener != Some(l.0.as_str()) {
                return false;
            }
        }
        if let Some(h) = &m.host {
            let Some(got) = req.host else { return false };
            if !strip_port(got).eq_ignore_ascii_case(h) {
                return false;
            }
        }
        if !req.path.starts_with(m.path_prefix.as_str()) {
            return false;
        }
        m.models.is_empty() || req.model.is_some_and(|x| m.models.iter().any(|y| y == x))
    }
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        // [v6]:port
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// An immutable, validated rule set. Build with [`RuleSnapshot::build`] or get one from a
/// [`crate::RuleStore`].
#[derive(Debug)]
pub struct RuleSnapshot {
    version: RuleVersion,
    content_hash: ContentHash,
    rules: RulesFile,
    services: Vec<ServiceEntry>,
    workers: HashMap<WorkerId, usize>,
}

impl RuleSnapshot {
    /// Validate `rules` and resolve them into a snapshot carrying `version`.
    pub fn build(rules: RulesFile, version: RuleVersion) -> Result<Self, RulesError> {
        Self::build_staggered(rules, version, policy::Stagger::SOLO)
    }

    /// [`Self::build`] with every policy's rotations staggered for one replica of a cluster
    /// ([`crate::policy::build_staggered`]).
    pub fn build_staggered(
        rules: RulesFile,
        version: RuleVersion,
        stagger: policy::Stagger,
    ) -> Result<Self, RulesError> {
        let problems = validate(&rules);
        if !problems.is_empty() {
            return Err(RulesError::Invalid { problems });
        }
        let content_hash = ContentHash::of(&rules)?;
        let workers: HashMap<WorkerId, usize> = rules
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.id.clone(), i))
            .collect();
        let mut services = Vec::with_capacity(rules.services.len());
        for spec in &rules.services {
            // Validation guarantees the references resolve; a miss here is reported, not
            // unwrapped, in case the two ever disagree.
            let pool = rules
                .pools
                .iter()
                .find(|p| p.id == spec.pool)
                .ok_or_else(|| RulesError::Invalid {
                    problems: vec![Problem::new(
                        format!("services.{}.pool", spec.name),
                        format!("unknown pool {:?}", spec.pool.0),
                    )],
                })?;
            // Listed workers in pool order, then selected ones (by label) in file order.
            let mut members: Vec<WorkerSpec> = pool
                .workers
                .iter()
                .filter_map(|id| workers.get(id).map(|&i| rules.workers[i].clone()))
                .collect();
            members.extend(
                rules
                    .workers
                    .iter()
                    .filter(|w| !pool.workers.contains(&w.id) && pool.contains(w))
                    .cloned(),
            );
            let profile = match &spec.rule {
                Rule::KvExact(k) => k
                    .profile
                    .as_ref()
                    .and_then(|id| rules.profiles.iter().find(|p| &p.id == id))
                    .cloned(),
                Rule::RoundRobin(_) => None,
            };
            let block_size = match &profile {
                None => None,
                Some(p) => Some(
                    BlockSize::new(p.block_size).map_err(|e| RulesError::Invalid {
                        problems: vec![Problem::new(
                            format!("profiles.{}.block_size", p.id),
                            e.to_string(),
                        )],
                    })?,
                ),
            };
            services.push(ServiceEntry {
                policy: policy::build_staggered(
                    &spec.rule,
                    profile.as_ref().map_or(1, |p| p.block_size),
                    stagger,
                ),
                spec: spec.clone(),
                workers: members,
                profile,
                block_size,
            });
        }
        Ok(Self {
            version,
            content_hash,
            rules,
            services,
            workers,
        })
    }

    /// The version.
    pub fn version(&self) -> RuleVersion {
        self.version
    }

    /// The content hash.
    pub fn content_hash(&self) -> ContentHash {
        self.content_hash
    }

    /// The rule set as parsed (defaults filled in).
    pub fn rules(&self) -> &RulesFile {
        &self.rules
    }

    /// Every service, in file order.
    pub fn services(&self) -> &[ServiceEntry] {
        &self.services
    }

    /// The service named `name`.
    pub fn service(&self, name: &str) -> Option<&ServiceEntry> {
        self.services.iter().find(|s| s.spec.name.0 == name)
    }

    /// The worker with this id.
    pub fn worker(&self, id: &WorkerId) -> Option<&WorkerSpec> {
        self.workers.get(id).map(|&i| &self.rules.workers[i])
    }

    /// The profile with this id.
    pub fn profile(&self, id: &str) -> Option<&ProfileSpec> {
        self.rules.profiles.iter().find(|p| p.id.0 == id)
    }

    /// The one service that takes `req`, if any (validation guarantees at most one).
    /// Cost: O(S) for S services.
    pub fn match_request(&self, req: &RequestInfo<'_>) -> Option<&ServiceEntry> {
        self.services.iter().find(|s| s.matches(req))
    }
}

#[cfg(test)]
mod tests {
    use super::strip_port;

    #[test]
    fn strip_port_handles_names_v4_and_v6() {
        assert_eq!(strip_port("example.com:8080"), "example.com");
        assert_eq!(strip_port("example.com"), "example.com");
        assert_eq!(strip_port("127.0.0.1:1"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:8080"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
    }
}
