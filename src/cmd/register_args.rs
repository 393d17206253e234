//! `--register` and its companions, shared by `kvgate worker` and `kvgate sidecar`: cluster
//! mode for whatever serves inference (docs/cluster.md, "Workers that register themselves").

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;

#[derive(clap::Args, Debug, Clone)]
pub struct RegisterArgs {
    /// Cluster mode: announce this server in the gateways' Redis (`redis://…`, `rediss://…`)
    /// under a lease, and trust the gateway keys listed there; also from KVGATE_REGISTER.
    #[arg(long, env = "KVGATE_REGISTER", hide_env_values = true)]
    pub register: Option<String>,
    /// The URL gateways reach this server at [default: http(s)://<--listen>].
    #[arg(long)]
    pub advertise_url: Option<String>,
    /// Labels pools select on: `k=v,k2=v2`.
    #[arg(long, default_value = "")]
    pub labels: String,
    /// Key prefix in the cluster's Redis.
    #[arg(long, default_value = "kvgate")]
    pub register_prefix: String,
    /// Lease of the registration, ms (renewed every lease / 3).
    #[arg(long, default_value_t = 5000)]
    pub register_lease_ms: u64,
}

impl RegisterArgs {
    /// The registration asked for (`None` without `--register`), for a server listening on
    /// `listen` (`https`: with TLS).
    /// `kind`: what serves behind this server's URL (`None`: a kvgate worker).
    pub fn registration(
        &self,
        listen: SocketAddr,
        https: bool,
        kind: Option<&str>,
    ) -> anyhow::Result<Option<worker::registration::Registration>> {
        let Some(url) = &self.register else {
            return Ok(None);
        };
        cluster::check_url(url).context("--register")?;
        let scheme = if https { "https" } else { "http" };
        Ok(Some(worker::registration::Registration {
            url: url.clone(),
            prefix: self.register_prefix.clone(),
            advertise_url: self
                .advertise_url
                .clone()
                .unwrap_or_else(|| format!("{scheme}://{listen}")),
            labels: parse_labels(&self.labels)?,
            lease: Duration::from_millis(self.register_lease_ms.max(500)),
            kind: kind.map(str::to_string),
        }))
    }
}

/// Parses `k=v,k2=v2` (empty: none).
pub fn parse_labels(s: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .filter(|(k, v)| !k.is_empty() && !v.is_empty())
            .with_context(|| format!("--labels: {part:?} is not k=v"))?;
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}
