//! `kvgate keygen --out DIR --name ID`: generate an Ed25519 key pair for a gateway or a worker.
//!
//! Writes `DIR/ID.key` (PKCS#8 PEM, mode 0600) and `DIR/ID.pub` (SPKI PEM) and prints the key
//! id. Never overwrites an existing key.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// Directory to write the key files into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Key name: the gateway or worker id (files are NAME.key and NAME.pub).
    #[arg(long)]
    pub name: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let kp = receipts::KeyPair::generate();
    let (key, public) = kp
        .write_to_dir(&args.out, &args.name)
        .with_context(|| format!("writing key pair {} to {}", args.name, args.out.display()))?;
    println!("key id   {}", kp.key_id());
    println!("private  {} (mode 0600)", key.display());
    println!("public   {}", public.display());
    Ok(ExitCode::SUCCESS)
}
