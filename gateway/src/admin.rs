//! The admin plane: its own listener, bearer-token authentication, JSON bodies.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/admin/services` | every service (JSON array) |
//! | GET | `/admin/services/{name}` | one service as applied |
//! | PUT | `/admin/services/{name}` | create or replace (validated, contract-checked, written back) |
//! | DELETE | `/admin/services/{name}` | delete |
//! | GET | `/admin/rules` | version, content hash and the whole rules set |
//! | POST | `/admin/reload` | re-read the rules file |
//! | GET | `/admin/workers` | health, cordon, load, indexed blocks, event stream, contract state |
//! | POST | `/admin/workers/{id}/cordon`, `/admin/workers/{id}/uncordon` | take a worker out of new routing, or back (a rules change) |
//! | GET | `/admin/cluster` | standalone, or cluster mode's store, state (`ok` / `degraded`), replicas, registrations |
//! | GET | `/metrics` | Prometheus text: OpenMetrics or classic 0.0.4, by `Accept` |
//!
//! Refused changes answer 400 with the OpenAI-style error body naming every problem; the rules in
//! force do not change.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::BytesMut;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use routing_rules::ApplyOutcome;
use serde_json::json;

use crate::control_plane::ControlPlane;
use crate::error::GatewayError;
use crate::view::{ContractState, EventStreamState, LoadStreamState};

/// Largest admin request body.
const ADMIN_BODY_LIMIT: usize = 1024 * 1024;

/// The admin application.
pub struct Admin {
    control: Arc<ControlPlane>,
}

impl Admin {
    /// An admin plane over the gateway's control plane (and through it, the data plane).
    pub fn new(control: Arc<ControlPlane>) -> Admin {
        Admin { control }
    }
}

fn json_response(status: u16, value: &serde_json::Value) -> Response<Vec<u8>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    response(status, "application/json", body)
}

fn response(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    let mut r = Response::new(body);
    *r.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    let len = r.body().len();
    r.headers_mut()
        .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    r
}

fn error_response(e: &GatewayError) -> Response<Vec<u8>> {
    response(e.status(), "application/json", e.to_openai_json())
}

fn outcome_json(o: &ApplyOutcome) -> serde_json::Value {
    match o {
        ApplyOutcome::Applied {
            previous,
            version,
            content_hash,
        } => {
            json!({"applied": true, "previous_version": previous.0, "version": version.0, "content_hash": content_hash.to_hex()})
        }
        ApplyOutcome::Unchanged { version } => json!({"applied": false, "version": version.0}),
    }
}

async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, GatewayError> {
    let mut buf = BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > ADMIN_BODY_LIMIT {
                    return Err(GatewayError::BodyTooLarge {
                        limit: ADMIN_BODY_LIMIT,
                    });
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(buf.to_vec()),
            Err(e) => {
                return Err(GatewayError::InvalidBody {
                    reason: e.to_string(),
                })
            }
        }
    }
}

impl Admin {
    fn authorized(&self, session: &ServerSession) -> bool {
        let Some(token) = &self.control.admin_token else {
            return true;
        };
        let got = session
            .req_header()
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time comparison of equal-length tokens.
        got.is_some_and(|g| {
            g.len() == token.len()
                && g.bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        })
    }

    /// `GET /admin/cluster`: standalone, or the cluster link's state.
    fn cluster_json(&self) -> serde_json::Value {
        let version = self.control.store.snapshot().version().0;
        match self.control.cluster() {
            None => json!({"mode": "standalone", "rules_version": version}),
            Some(link) => {
                let degraded = link.status.degraded.load(Ordering::Relaxed);
                let shared = self.control.data.shared_responses.load();
                let (pending_writes, pending_write_bytes) =
                    shared.as_ref().map_or((0, 0), |s| s.pending_writes());
                json!({
                    "mode": "cluster",
                    "redis": ::cluster::redact(&link.settings.url),
                    "prefix": link.settings.prefix,
                    "replica": link.replica_id(),
                    "state": if degraded { "degraded" } else { "ok" },
                    "last_error": *link.status.last_error.lock(),
                    "rules_version": version,
                    "replicas": *link.status.replicas.lock(),
                    "place": {"index": self.control.stagger().index(), "of": self.control.stagger().of()},
                    "registered_workers": *link.status.registered.lock(),
                    "lease_ms": link.settings.lease.as_millis() as u64,
                    "stored_responses": {
                        "bytes_in_redis": link.status.shared_response_bytes.load(Ordering::Relaxed),
                        "budget_bytes": link.settings.response_budget,
                        "pending_deletes": shared.as_ref().map_or(0, |s| s.pending_deletes()),
                        "pending_cancels": shared.as_ref().map_or(0, |s| s.pending_cancels()),
                        "stream_mirror_gaps": shared.as_ref().map_or(0, |s| s.mirror_gaps()),
                        "pending_conversation_changes": self.control.data.responses.pending.len(),
                        "pending_writes": pending_writes,
                        "pending_write_bytes": pending_write_bytes,
                    },
                })
            }
        }
    }

    fn workers_json(&self) -> serde_json::Value {
        let view = self.control.data.views.load();
        let stats: std::collections::BTreeMap<_, _> = self
            .control
            .data
            .index
            .all_worker_stats()
            .into_iter()
            .map(|s| (s.worker.clone(), s))
            .collect();
        let workers: Vec<serde_json::Value> = view
            .workers
            .values()
            .map(|e| {
                let rt = &e.runtime;
                let events = match &*rt.events.lock() {
                    EventStreamState::Connecting => "connecting",
                    EventStreamState::Connected => "connected",
                    EventStreamState::Unsupported => "unsupported (approximate holdings)",
                    EventStreamState::NotSubscribed => "not_subscribed",
                };
                let load_stream = match *rt.load_stream.lock() {
                    LoadStreamState::Off => "off",
                    LoadStreamState::Connecting => "connecting",
                    LoadStreamState::Connected => "connected",
                    LoadStreamState::Unsupported => "unsupported",
                };
                let lag = rt
                    .events_last_heard
                    .lock()
                    .map(|t| t.elapsed().as_secs_f64());
                let contract = match &*rt.contract.lock() {
                    ContractState::NotRequired => json!({"state": "not_required"}),
                    ContractState::Ok => json!({"state": "ok"}),
                    ContractState::Unverified(why) => json!({"state": "unverified", "detail": why}),
                    ContractState::Mismatch(why) => json!({"state": "mismatch", "detail": why}),
                };
                let reserved = rt.remote_reserved_now();
                json!({
                    "id": e.spec.id.0,
                    "url": e.spec.url,
                    "kind": e.spec.kind.as_str(),
                    "healthy": e.healthy,
                    "cordoned": e.cordoned,
                    "in_flight": rt.in_flight.load(Ordering::Relaxed),
                    "active_tokens": rt.active_tokens.load(Ordering::Relaxed),
                    "remote_reserved": {"prefill_tokens": reserved.0, "decode_tokens": reserved.1},
                    "remote_load": {
                        "in_flight": rt.remote_in_flight.load(Ordering::Relaxed),
                        "active_tokens": rt.remote_active_tokens.load(Ordering::Relaxed),
                        "prefill_tokens": rt.remote_prefill_tokens.load(Ordering::Relaxed),
                    },
                    "reported_load": rt.reported_load.lock().map(|(l, at)| json!({
                        "running": l.running,
                        "waiting": l.waiting,
                        "prefill_tokens": l.prefill_tokens,
                        "decode_tokens": l.decode_tokens,
                        "seconds_since_reported": at.elapsed().as_secs_f64(),
                    })),
                    "refusals": rt.refusals.load(Ordering::Relaxed),
                    "indexed_blocks": stats.get(&e.spec.id).map_or(0, |s| s.precise_blocks),
                    "approximate_blocks": stats.get(&e.spec.id).map_or(0, |s| s.approximate_blocks),
                    "events": {
                        "state": events,
                        "position": rt.events_position.lock().map(|(ep, seq)| json!({"epoch": ep, "seq": seq})),
                        "applied": rt.events_applied.load(Ordering::Relaxed),
                        "load_reports": rt.load_reports.load(Ordering::Relaxed),
                        "seconds_since_last_heard": lag,
                        "load_stream": load_stream,
                    },
                    "contract": contract,
                })
            })
            .collect();
        json!({ "rules_version": view.version(), "workers": workers })
    }

    async fn handle(&self, session: &mut ServerSession) -> Result<Response<Vec<u8>>, GatewayError> {
        let method = session.req_header().method.as_str().to_owned();
        let path = session.req_header().uri.path().to_owned();
        // For a VIP's or an orchestrator's health checks, which carry no token: the process is
        // up (`/health`); it takes traffic (`/ready`: 503 while the index catches up at the
        // start, and while draining before a stop).
        match (method.as_str(), path.as_str()) {
            ("GET", "/health") => return Ok(json_response(200, &json!({"status": "ok"}))),
            ("GET", "/ready") => {
                return Ok(match self.control.not_ready_reason() {
                    None => json_response(200, &json!({"ready": true})),
                    Some(reason) => json_response(503, &json!({"ready": false, "reason": reason})),
                });
            }
            _ => {}
        }
        if !self.authorized(session) {
            return Err(GatewayError::Unauthorized);
        }
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method.as_str(), segments.as_slice()) {
            ("GET", ["metrics"]) => {
                self.control.data.refresh_gauges();
                let accept = session
                    .req_header()
                    .headers
                    .get("accept")
                    .and_then(|v| v.to_str().ok());
                let format = exposition::Format::negotiate(accept);
                Ok(response(
                    200,
                    format.content_type(),
                    self.control.data.metrics.render(format).into_bytes(),
                ))
            }
            ("GET", ["admin", "rules"]) => {
                let snap = self.control.store.snapshot();
                Ok(json_response(
                    200,
                    &json!({
                        "version": snap.version().0,
                        "content_hash": snap.content_hash().to_hex(),
                        "rules": snap.rules(),
                    }),
                ))
            }
            ("POST", ["admin", "reload"]) => {
                let o = self.control.reload_from_file().await?;
                Ok(json_response(200, &outcome_json(&o)))
            }
            ("GET", ["admin", "workers"]) => Ok(json_response(200, &self.workers_json())),
            ("POST", ["admin", "workers", id, action @ ("cordon" | "uncordon")]) => {
                let id = prefix_index::WorkerId((*id).to_owned());
                let cordon = *action == "cordon";
                // A worker of the live view (declared or registered), or one the rules
                // cordon (it may have left since): anything else is a typo.
                let known = self.control.data.views.load().workers.contains_key(&id)
                    || self.control.store.snapshot().rules().is_cordoned(&id);
                if !known {
                    return Err(GatewayError::NotFound {
                        what: format!("worker {:?}", id.0),
                    });
                }
                let o = self.control.set_cordoned(&id, cordon).await?;
                let mut answer = outcome_json(&o);
                answer["worker"] = json!(id.0);
                answer["cordoned"] = json!(cordon);
                Ok(json_response(200, &answer))
            }
            ("GET", ["admin", "cluster"]) => Ok(json_response(200, &self.cluster_json())),
            ("GET", ["admin", "services"]) => Ok(json_response(
                200,
                &json!(self.control.store.list_services()),
            )),
            ("GET", ["admin", "services", name]) => match self.control.store.get_service(name) {
                Some(s) => Ok(json_response(200, &json!(s))),
                None => Err(GatewayError::NotFound {
                    what: format!("service {name:?}"),
                }),
            },
            ("PUT", ["admin", "services", name]) => {
                let name = (*name).to_owned();
                let body = read_body(session).await?;
                let text = String::from_utf8(body).map_err(|_| GatewayError::InvalidBody {
                    reason: "body is not UTF-8".into(),
                })?;
                let spec = routing_rules::service_from_json(&text).map_err(|problems| {
                    GatewayError::RulesRejected {
                        reason: problems
                            .iter()
                            .map(|p| format!("{}: {}", p.path, p.message))
                            .collect::<Vec<_>>()
                            .join("; "),
                    }
                })?;
                if spec.name.0 != name {
                    return Err(GatewayError::RulesRejected {
                        reason: format!(
                            "name: the body names service {:?} but the path names {name:?}",
                            spec.name.0
                        ),
                    });
                }
                let o = self.control.put_service(spec).await?;
                Ok(json_response(200, &outcome_json(&o)))
            }
            ("DELETE", ["admin", "services", name]) => {
                let o = self.control.delete_service(name).await?;
                Ok(json_response(200, &outcome_json(&o)))
            }
            _ => Err(GatewayError::NotFound {
                what: format!("{method} {path}"),
            }),
        }
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match self.handle(session).await {
            Ok(r) => r,
            Err(e) => error_response(&e),
        }
    }
}
