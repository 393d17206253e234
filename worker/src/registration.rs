//! Cluster mode for a worker (`kvgate worker --register redis://…`, and a sidecar in front of a
//! native engine, `kvgate sidecar --register …`, the same way): the worker announces
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
    /// What the gateways reach behind the URL, as `[[workers]] kind` names it: `None` for a
    /// kvgate worker; a sidecar gives its engine's (`openai`, `llama_cpp`).
    pub kind: Option<String>,
}

/// What the registration loop needs of a worker or a sidecar: the ticket gate it updates with
/// the gateway keys the store lists.
pub(crate) trait HoldsTicketGate: Send + Sync {
    fn gate(&self) -> &TicketGate;
}

impl HoldsTicketGate for crate::AppState {
    fn gate(&self) -> &TicketGate {
        &self.tickets
    }
}

impl HoldsTicketGate for crate::sidecar::SidecarState {
    fn gate(&self) -> &TicketGate {
        &self.tickets
    }
}

/// A running registration loop: cancel it (and await it) to withdraw.
pub(crate) type RegistrationTask = (CancellationToken, tokio::task::JoinHandle<()>);

/// Starts the registration loop of `record` (the caller's id, key and profile digest; `reg`
/// gives its URL and labels) for `holder`.
pub(crate) fn start(
    reg: Registration,
    id: &str,
    key: &receipts::KeyPair,
    profile_digest: &str,
    holder: Arc<dyn HoldsTicketGate>,
) -> RegistrationTask {
    let record = cluster::WorkerRecord {
        id: id.to_string(),
        url: reg.advertise_url.clone(),
        key_id: key.key_id().to_string(),
        public_key_hex: hex::encode(key.public().to_bytes()),
        profile_digest: profile_digest.to_string(),
        labels: reg.labels.clone(),
        kind: reg.kind.clone(),
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run(reg, record, holder, cancel.clone()));
    (cancel, task)
}

/// Withdraws: ends the loop, which deletes the registration (at most `2 s`).
pub(crate) async fn stop(task: RegistrationTask) {
    let (cancel, task) = task;
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
}

/// The registration loop (owned by the running worker; ends on `cancel`, withdrawing).
async fn run(
    reg: Registration,
    record: cluster::WorkerRecord,
    tickets: Arc<dyn HoldsTicketGate>,
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
