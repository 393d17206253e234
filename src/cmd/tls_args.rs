//! The TLS listener flags the gateway (its VIP) and the worker share.
use std::path::PathBuf;

/// `--tls-cert`, `--tls-key`, `--tls-client-ca`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ServerTlsArgs {
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require every client to show a certificate signed by this CA (PEM): mTLS.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The listener's TLS material; `None` for plain HTTP.
    pub fn server_tls(&self) -> Option<tls::ServerTls> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(tls::ServerTls {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        }
    }
}
