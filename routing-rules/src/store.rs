//! [`RuleStore`]: the current [`RuleSnapshot`] behind an `ArcSwap`, and every way it changes.
//!
//! - Readers call [`RuleStore::snapshot`] (lock-free) and keep the `Arc` for a whole request.
//! - Writers (file reload, admin API) are serialized by one lock. Each builds a complete
//!   candidate rule set, validates it as a whole, runs the caller's optional pre-apply check
//!   on the candidate snapshot, writes the file back when the change came from the API, and
//!   only then swaps. Any failure leaves the current snapshot untouched and says why.
//! - A candidate whose content hash equals the current one is not applied: the version does
//!   not move and nothing is written.
//! - API writes replace the rules file atomically: a temp file in the same directory, fsync,
//!   rename over the file, fsync of the directory. The file is written in canonical form
//!   (defaults spelled out, comments not kept), so a restart loads exactly the applied rules.
//!   If the rules file is a symlink, the rename replaces the link with a regular file.
//!
//! Watching the file (notify) and SIGHUP belong to the gateway binary; they call
//! [`RuleStore::reload_from_file`]. This crate is synchronous.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::error::{Problem, RulesError};
use crate::parse::{rules_from_toml, rules_to_toml};
use crate::schema::{RulesFile, ServiceSpec};
use crate::snapshot::{ContentHash, RuleSnapshot, RuleVersion};
use prefix_index::WorkerId;

/// What an accepted change did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// A new snapshot is current.
    Applied {
        /// The version it replaced.
        previous: RuleVersion,
        /// The new version.
        version: RuleVersion,
        /// The new content hash.
        content_hash: ContentHash,
    },
    /// The content hash did not change; nothing was swapped or written.
    Unchanged {
        /// The current (unchanged) version.
        version: RuleVersion,
    },
}

impl ApplyOutcome {
    /// The version current after the call.
    pub fn version(&self) -> RuleVersion {
        match self {
            ApplyOutcome::Applied { version, .. } | ApplyOutcome::Unchanged { version } => *version,
        }
    }
}

/// The pre-apply check: sees the fully built candidate snapshot (with its would-be version)
/// and may refuse it with located problems. It runs under the store's writer lock, so it must
/// not call back into the store.
pub type PreApplyCheck<'a> = &'a dyn Fn(&RuleSnapshot) -> Result<(), Vec<Problem>>;

fn accept_all(_: &RuleSnapshot) -> Result<(), Vec<Problem>> {
    Ok(())
}

/// The versioned rule store; see the module docs.
#[derive(Debug)]
pub struct RuleStore {
    path: Option<PathBuf>,
    current: ArcSwap<RuleSnapshot>,
    writer: Mutex<()>,
}

/// Distinguishes temp files of concurrent writers in one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl RuleStore {
    /// Load, parse and validate the rules file at `path`; the first snapshot is version 1.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, RulesError> {
        let path = path.into();
        let rules = read_rules(&path)?;
        let snapshot = RuleSnapshot::build(rules, RuleVersion(1))?;
        Ok(Self {
            path: Some(path),
            current: ArcSwap::from_pointee(snapshot),
            writer: Mutex::new(()),
        })
    }

    /// A store without a file (tests, embedding): API changes are applied but not persisted,
    /// and [`RuleStore::reload_from_file`] fails with [`RulesError::NoFile`].
    pub fn in_memory(rules: RulesFile) -> Result<Self, RulesError> {
        let snapshot = RuleSnapshot::build(rules, RuleVersion(1))?;
        Ok(Self {
            path: None,
            current: ArcSwap::from_pointee(snapshot),
            writer: Mutex::new(()),
        })
    }

    /// The rules file, when the store has one.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The current snapshot. Lock-free; keep it for the whole request.
    pub fn snapshot(&self) -> Arc<RuleSnapshot> {
        self.current.load_full()
    }

    /// Re-read the rules file and apply it when valid and changed.
    pub fn reload_from_file(&self) -> Result<ApplyOutcome, RulesError> {
        self.reload_from_file_with(&accept_all)
    }

    /// [`RuleStore::reload_from_file`] with a pre-apply check.
    pub fn reload_from_file_with(
        &self,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        let path = self.path.as_deref().ok_or(RulesError::NoFile)?;
        let _guard = self.writer.lock();
        let rules = read_rules(path)?;
        self.install(rules, check, false)
    }

    /// Replace the whole rule set (admin API), written back to the file.
    pub fn apply(&self, rules: RulesFile) -> Result<ApplyOutcome, RulesError> {
        self.apply_with(rules, &accept_all)
    }

    /// [`RuleStore::apply`] with a pre-apply check.
    pub fn apply_with(
        &self,
        rules: RulesFile,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        let _guard = self.writer.lock();
        self.install(rules, check, true)
    }

    /// Create or replace one service (matched by name), validated as part of the whole rule
    /// set and written back to the file.
    pub fn put_service(&self, spec: ServiceSpec) -> Result<ApplyOutcome, RulesError> {
        self.put_service_with(spec, &accept_all)
    }

    /// [`RuleStore::put_service`] with a pre-apply check.
    pub fn put_service_with(
        &self,
        spec: ServiceSpec,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        self.edit_with(
            |rules| {
                rules.upsert_service(spec);
                Ok(())
            },
            check,
        )
    }

    /// Delete one service; [`RulesError::ServiceNotFound`] when there is none of that name.
    pub fn delete_service(&self, name: &str) -> Result<ApplyOutcome, RulesError> {
        self.delete_service_with(name, &accept_all)
    }

    /// [`RuleStore::delete_service`] with a pre-apply check.
    pub fn delete_service_with(
        &self,
        name: &str,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        self.edit_with(
            |rules| match rules.remove_service(name) {
                Some(_) => Ok(()),
                None => Err(RulesError::ServiceNotFound {
                    name: name.to_owned(),
                }),
            },
            check,
        )
    }

    /// Cordons worker `id` or lifts its cordon (`RulesFile::set_cordoned`), validated as part
    /// of the whole rule set and written back to the file; `Unchanged` when it already was so.
    pub fn set_cordoned_with(
        &self,
        id: &WorkerId,
        cordoned: bool,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        self.edit_with(
            |rules| {
                rules.set_cordoned(id, cordoned);
                Ok(())
            },
            check,
        )
    }

    /// Applies `edit` to a copy of the rules in force, under the writer lock, then installs the
    /// result (validated, `check`ed, written back): the one path of every API edit.
    fn edit_with(
        &self,
        edit: impl FnOnce(&mut RulesFile) -> Result<(), RulesError>,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        let _guard = self.writer.lock();
        let mut rules = self.current.load().rules().clone();
        edit(&mut rules)?;
        self.install(rules, check, true)
    }

    /// The current definition of one service.
    pub fn get_service(&self, name: &str) -> Option<ServiceSpec> {
        self.current.load().rules().service(name).cloned()
    }

    /// Every service of the current rule set, in file order.
    pub fn list_services(&self) -> Vec<ServiceSpec> {
        self.current.load().rules().services.clone()
    }

    /// Installs `rules` as exactly `version` (cluster mode: the version comes from the shared
    /// store, so every replica names the same rules by the same number), after validation and
    /// `check`. Never writes the file. Applied even when only the version differs;
    /// `Unchanged` when both content and version are the current ones.
    pub fn replace_versioned(
        &self,
        rules: RulesFile,
        version: RuleVersion,
        check: PreApplyCheck<'_>,
    ) -> Result<ApplyOutcome, RulesError> {
        let _guard = self.writer.lock();
        let current = self.current.load_full();
        let hash = ContentHash::of(&rules)?;
        if hash == current.content_hash() && version == current.version() {
            return Ok(ApplyOutcome::Unchanged { version });
        }
        let candidate = RuleSnapshot::build(rules, version)?;
        check(&candidate).map_err(|problems| RulesError::Rejected { problems })?;
        self.current.store(Arc::new(candidate));
        Ok(ApplyOutcome::Applied {
            previous: current.version(),
            version,
            content_hash: hash,
        })
    }

    /// Validate, check, persist (when `persist` and the store has a file), swap. Caller holds
    /// the writer lock.
    fn install(
        &self,
        rules: RulesFile,
        check: PreApplyCheck<'_>,
        persist: bool,
    ) -> Result<ApplyOutcome, RulesError> {
        let current = self.current.load_full();
        let hash = ContentHash::of(&rules)?;
        if hash == current.content_hash() {
            return Ok(ApplyOutcome::Unchanged {
                version: current.version(),
            });
        }
        let version = RuleVersion(current.version().0 + 1);
        let candidate = RuleSnapshot::build(rules, version)?;
        check(&candidate).map_err(|problems| RulesError::Rejected { problems })?;
        if persist {
            if let Some(path) = &self.path {
                let text = format!(
                    "# kvgate rules file, written by the admin API (rule version {version}, content \
                     sha256 {hash}).\n# Canonical form: defaults are spelled out; comments are \
                     not kept.\n\n{}",
                    rules_to_toml(candidate.rules())?
                );
                write_atomically(path, text.as_bytes()).map_err(|source| RulesError::Write {
                    path: path.clone(),
                    source,
                })?;
            }
        }
        self.current.store(Arc::new(candidate));
        Ok(ApplyOutcome::Applied {
            previous: current.version(),
            version,
            content_hash: hash,
        })
    }
}

fn read_rules(path: &Path) -> Result<RulesFile, RulesError> {
    let text = fs::read_to_string(path).map_err(|source| RulesError::Read {
        path: path.to_owned(),
        source,
    })?;
    rules_from_toml(&text).map_err(|problems| RulesError::Invalid { problems })
}

/// Replace `path` with `contents` atomically: temp file in the same directory, fsync, rename,
/// fsync of the directory. Keeps the old file's permissions. On failure the temp file is
/// removed and `path` is untouched.
pub fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "rules".to_owned());
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        if let Ok(meta) = fs::metadata(path) {
            f.set_permissions(meta.permissions())?;
        }
        f.write_all(contents)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(&dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}
