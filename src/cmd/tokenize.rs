//! `kvgate tokenize` (placeholder until its issue lands: it refuses to run).
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`kvgate tokenize` is not implemented yet")
}
