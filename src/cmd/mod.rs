//! One module per subcommand; each has `Args` (clap) and `run(Args) -> anyhow::Result<ExitCode>`.
pub mod bench;
pub mod gateway;
pub mod keygen;
pub mod receipts;
pub mod register_args;
pub mod shutdown;
pub mod sidecar;
pub mod tls_args;
pub mod tokenize;
pub mod worker;

/// Logs (`tracing`) to standard error — standard output may carry the gateway's access log
/// (`--access-log -`) — filtered by `RUST_LOG` (default `info`). For the long-running
/// commands: gateway, worker, sidecar.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
}
