//! `kvgate receipts verify|audit`: check receipt logs and correlate them with gateway decisions.
//!
//! `verify LOG... --key PUB [--keys DIR]` checks every receipt signature, the hash chain,
//! sequence numbers and embedded tickets (ticket signatures need the gateway key: `--keys DIR`
//! or another `--key`); `audit --decisions GATEWAY_LOG --receipts WORKER_LOG... --keys DIR`
//! correlates decisions with receipts. Both print a summary and exit 1 on any failure.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use receipts::{AuditOptions, KeyRing, VerifyOptions, DEFAULT_MAX_CLOCK_SKEW_MS};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand)]
pub enum Command {
    /// Verify receipt logs: signatures (receipts and embedded tickets), chain, sequence gaps.
    Verify(VerifyArgs),
    /// Correlate a gateway decision log with worker receipt logs.
    Audit(AuditArgs),
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Receipt log(s) (JSON Lines).
    #[arg(required = true)]
    pub logs: Vec<PathBuf>,
    /// A public key file (the worker's; repeat for more keys, e.g. the gateway's).
    #[arg(long = "key")]
    pub key: Vec<PathBuf>,
    /// A directory of `*.pub` files (gateway keys for the embedded tickets, worker keys).
    #[arg(long = "keys")]
    pub keys: Vec<PathBuf>,
    /// Fail embedded tickets whose gateway key is not given (default: count them as unchecked).
    #[arg(long)]
    pub require_ticket_keys: bool,
    /// Clock skew allowed when checking a receipt's time against its ticket's validity window.
    #[arg(long, default_value_t = DEFAULT_MAX_CLOCK_SKEW_MS)]
    pub max_clock_skew_ms: u64,
    /// Print the report(s) as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct AuditArgs {
    /// The gateway's decision log; in cluster mode every replica's (repeat the flag or list
    /// them after it).
    #[arg(long, required = true, num_args = 1..)]
    pub decisions: Vec<PathBuf>,
    /// The workers' receipt logs.
    #[arg(long, required = true, num_args = 1..)]
    pub receipts: Vec<PathBuf>,
    /// A directory of `*.pub` files holding the gateway and worker public keys.
    #[arg(long = "keys", required = true)]
    pub keys: Vec<PathBuf>,
    /// Extra public key files.
    #[arg(long = "key")]
    pub key: Vec<PathBuf>,
    /// Count prefix-parity mismatches (gateway/worker tokenization split) as discrepancies.
    #[arg(long)]
    pub fail_on_parity_mismatch: bool,
    /// Clock skew allowed for ticket validity windows.
    #[arg(long, default_value_t = DEFAULT_MAX_CLOCK_SKEW_MS)]
    pub max_clock_skew_ms: u64,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn load_keys(files: &[PathBuf], dirs: &[PathBuf]) -> anyhow::Result<KeyRing> {
    let mut ring = KeyRing::new();
    for f in files {
        ring.add_file(f)
            .with_context(|| format!("loading public key {}", f.display()))?;
    }
    for d in dirs {
        let n = ring
            .add_dir(d)
            .with_context(|| format!("loading public keys from {}", d.display()))?;
        if n == 0 {
            anyhow::bail!("no *.pub files in {}", d.display());
        }
    }
    if ring.is_empty() {
        anyhow::bail!("no public key given (use --key PUB or --keys DIR)");
    }
    Ok(ring)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Verify(a) => verify(a),
        Command::Audit(a) => audit(a),
    }
}

fn verify(a: VerifyArgs) -> anyhow::Result<ExitCode> {
    let ring = load_keys(&a.key, &a.keys)?;
    let opts = VerifyOptions {
        require_ticket_keys: a.require_ticket_keys,
        max_clock_skew_ms: a.max_clock_skew_ms,
    };
    let mut all_ok = true;
    let mut reports = Vec::new();
    let logs = with_rotated(&a.logs)?;
    for report in receipts::verify_logs_with(&logs, &ring, opts).context("verifying the logs")? {
        all_ok &= report.ok();
        if a.json {
            reports.push(report);
        } else {
            print!("{report}");
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The given logs plus the rotated files beside each (`<stem>.<20 digits>.jsonl`), so that
/// naming a worker's current log verifies its whole chain.
fn with_rotated(logs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = Vec::new();
    for log in logs {
        for p in receipts::rotated_files(log)?
            .into_iter()
            .chain(std::iter::once(log.clone()))
        {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

fn audit(a: AuditArgs) -> anyhow::Result<ExitCode> {
    let ring = load_keys(&a.key, &a.keys)?;
    let opts = AuditOptions {
        max_clock_skew_ms: a.max_clock_skew_ms,
        fail_on_parity_mismatch: a.fail_on_parity_mismatch,
    };
    let report = receipts::audit_replicas(&a.decisions, &with_rotated(&a.receipts)?, &ring, opts)
        .context("auditing receipt logs")?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
