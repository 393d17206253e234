//! Cluster mode for a worker (`kvgate worker --register redis://…`): the worker announces
//! itself — id, the URL gateways reach it at, its receipt key, its profile digest, its labels —
//! in the shared store under a lease it renews every lease / 3, and trusts the gateway
//! replicas' ticket keys the store lists (besides its configured `--gateway-keys`), re-read at
//! the same period. A worker that stops withdraws its registration; one that dies leaves every
//! replica's pools when the lease lapses. Key layout: the `cluster` crate, docs/cluster.md.
//!
//! Redis unreachable: the worker keeps serving with the gateway keys it last read and keeps
//! retrying; it is simply not (re)announced meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::tickets::TicketGate;

/// How a worker registers.
#[derive(Clone, Debug)]
pub struct Registration {
    /// `redis://…` / `rediss://…`.
    pub url: String,
    /// Key prefix (the gateways' `--cluster-prefix`). Default `kvgate`.
    pub prefix: String,
    /// The URL the gateways use for this worker (e.g. `http://10.0.0.7:8101`).
    pub advertise_url: String,
    /// Labels pools select on.
    pub labels: BTreeMap<String, String>,
    /// Lease of the registration. Default 5 s.
    pub lease: Duration,
}

/// The registration loop (owned by the running worker; ends on `cancel`, withdrawing).
pub(crate) async fn run(
    reg: Registration,
    record: cluster::WorkerRecord,
    tickets: Arc<TicketGateHandle>,
    cancel: CancellationToken,
) {
    let period = (reg.lease / 3).max(Duration::from_millis(100));
    let mut store: Option<cluster::Store> = None;
    let mut warned = false;
    loop {
        let res = async {
            let s = match &store {
                Some(s) => s.clone(),
                None => {
                    let s = cluster::Store::connect(&reg.url, &reg.prefix).await?;
                    store = Some(s.clone());
                    s
                }
            };
            let keys = s.gateways().await?;
            let mut trusted = Vec::new();
            for g in keys {
                let mut raw = [0u8; 32];
                if hex::decode_to_slice(&g.public_key_hex, &mut raw).is_err() {
                    continue;
                }
                if let Ok(k) = receipts::PublicKey::from_bytes(&raw) {
                    trusted.push((g.gateway_id, k));
                }
            }
            tickets.gate().trust_cluster_keys(trusted);
            s.announce_worker(&record, reg.lease).await?;
            Ok::<_, cluster::ClusterError>(())
        }
        .await;
        match res {
            Ok(()) => warned = false,
            Err(e) if !warned => {
                tracing::warn!(error = %e, "registration: cluster store unreachable; retrying");
                warned = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(period) => {}
        }
    }
    if let Some(s) = store {
        let _ = tokio::time::timeout(Duration::from_secs(1), s.withdraw_worker(&record.id)).await;
    }
}

/// What the loop needs of the worker: its ticket gate (held by the worker's shared state).
pub(crate) struct TicketGateHandle(pub(crate) Arc<crate::AppState>);

impl TicketGateHandle {
    fn gate(&self) -> &TicketGate {
        &self.0.tickets
    }
}
