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
