//! Fleet simulation: N simulated workers and a gateway in-process (written once the gateway and
//! worker servers can be started in-process; until then `--fleet` refuses to run).

use std::process::ExitCode;

pub async fn run(_n: usize, _args: &crate::cmd::bench::Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("--fleet is not available yet in this build")
}
