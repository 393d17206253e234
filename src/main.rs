//! `kvgate`: the one CLI binary (gateway, worker, sidecar, receipts, keygen, bench, tokenize).

use clap::{Parser, Subcommand};

mod bench;
mod cmd;
mod memory;

#[derive(Parser)]
#[command(
    name = "kvgate",
    version,
    about = "Cache-aware inference gateway with embedded engine workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the VIP) in front of a worker fleet.
    Gateway(cmd::gateway::Args),
    /// Run a worker that embeds the engine.
    Worker(Box<cmd::worker::Args>),
    /// Run the receipt sidecar beside a native engine (llama-server, any OpenAI-compatible server).
    Sidecar(Box<cmd::sidecar::Args>),
    /// Verify and audit receipt logs.
    Receipts(cmd::receipts::Args),
    /// Generate an Ed25519 key pair for a gateway or a worker.
    Keygen(cmd::keygen::Args),
    /// Load generator, engine benchmark and fleet simulation.
    Bench(cmd::bench::Args),
    /// Render and tokenize a prompt with a model's prompt profile.
    Tokenize(cmd::tokenize::Args),
}

/// mimalloc instead of glibc's malloc: the proxy path allocates and frees small buffers per
/// request on two threads, where glibc spent ~20 % of the gateway's CPU (`_int_malloc`,
/// `malloc_consolidate`, `_int_free` in a `perf` profile under `wrk`; docs/benchmarks.md).
/// The one process-wide item the binary has; libraries never set it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Gateway(a) => cmd::gateway::run(a),
        Command::Worker(a) => cmd::worker::run(*a),
        Command::Sidecar(a) => cmd::sidecar::run(*a),
        Command::Receipts(a) => cmd::receipts::run(a),
        Command::Keygen(a) => cmd::keygen::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvgate: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
