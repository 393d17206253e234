//! The crate's one error type, [`RulesError`], and [`Problem`], one located complaint about a
//! rules file or an admin API body (`services.chat.rule.profile: unknown profile "x"`).

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One problem found while parsing or validating rules, with the path of the offending value.
///
/// Paths name list entries by their id when the entry has a usable one
/// (`services.chat.rule.profile`) and by index otherwise (`services[2].name`); serde errors use
/// indexes (`services[0].rule`). An empty path means the whole document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// Where: a dotted path into the document.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl Problem {
    /// A problem at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Display helper: problems one per line.
struct Lines<'a>(&'a [Problem]);

impl fmt::Display for Lines<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

fn lines(problems: &[Problem]) -> Lines<'_> {
    Lines(problems)
}

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The rules file could not be read.
    #[error("cannot read rules file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The rules file could not be written back (temp file, fsync or rename failed). The
    /// current rule set was not changed.
    #[error("cannot write rules file {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The input does not parse or does not validate; every problem found is listed.
    #[error("invalid rules ({} problem(s)):\n{}", problems.len(), lines(problems))]
    Invalid {
        /// Every problem, with its path.
        problems: Vec<Problem>,
    },
    /// The input is valid but the caller's pre-apply check refused it (e.g. a `kv_exact`
    /// service whose workers report a different profile).
    #[error("rules refused by pre-apply check ({} problem(s)):\n{}", problems.len(), lines(problems))]
    Rejected {
        /// Every problem the check reported.
        problems: Vec<Problem>,
    },
    /// No service has this name.
    #[error("no service named {name:?}")]
    ServiceNotFound {
        /// The name asked for.
        name: String,
    },
    /// A file operation was asked of a store that has no rules file.
    #[error("this rule store has no rules file")]
    NoFile,
    /// The rules could not be serialized (a bug: every valid rule set serializes).
    #[error("cannot serialize rules: {message}")]
    Serialize {
        /// The serializer's message.
        message: String,
    },
}

impl RulesError {
    /// Stable string for metric labels and API error codes.
    pub fn error_type(&self) -> &'static str {
        match self {
            RulesError::Read { .. } => "rules_read",
            RulesError::Write { .. } => "rules_write",
            RulesError::Invalid { .. } => "rules_invalid",
            RulesError::Rejected { .. } => "rules_rejected",
            RulesError::ServiceNotFound { .. } => "service_not_found",
            RulesError::NoFile => "no_rules_file",
            RulesError::Serialize { .. } => "rules_serialize",
        }
    }

    /// The located problems, for `Invalid` and `Rejected`; empty otherwise.
    pub fn problems(&self) -> &[Problem] {
        match self {
            RulesError::Invalid { problems } | RulesError::Rejected { problems } => problems,
            _ => &[],
        }
    }
}
