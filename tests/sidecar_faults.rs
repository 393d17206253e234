//! `kvgate sidecar` against a hostile engine (an in-test HTTP server that misbehaves on
//! purpose): nothing the engine sends crashes the sidecar, grows its memory past its bounds or
//! goes unreceipted, and the client always gets an answer it can tell apart.
//! - a 200 that is not JSON: relayed unchanged, receipt `engine_answer_not_json`;
//! - a whole answer over `max_answer_bytes`: 502 `engine_answer_too_large`, receipted;
//! - an engine error (400 with an OpenAI error body): relayed, receipt with its code;
//! - an SSE event that never ends (over `max_event_bytes`) and a stream cut before `[DONE]`:
//!   in-band `engine_stream_broken`, receipted;
//! - a client that goes away mid-stream: receipt 499 `client_disconnected`;
//! - a `GET /slots` (the engine's own load) that is not JSON, too large, of the wrong types, a
//!   500, never answered or 501: the report falls back to the sidecar's own count; a vLLM
//!   `GET /metrics` read for its running and waiting requests;
//!
//! Then the whole log verifies.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use receipts::KeyPair;
use worker::sidecar::SidecarConfig;

fn sse(chunks: Vec<Bytes>, then_hang: bool) -> Response {
    let s = futures::stream::iter(chunks.into_iter().map(Ok::<_, Infallible>));
    let body = if then_hang {
        Body::from_stream(s.chain(futures::stream::pending()))
    } else {
        Body::from_stream(s)
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(body)
        .unwrap()
}

async fn hostile(body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let chunk = |text: &str| {
        Bytes::from(format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
        ))
    };
    match v["model"].as_str().unwrap_or("") {
        "garbage" => (StatusCode::OK, "this is not json").into_response(),
        "huge" => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            vec![b' '; 2 << 20],
        )
            .into_response(),
        "error" => (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"error":{"code":"bad_thing","message":"no"}}"#,
        )
            .into_response(),
        "endless_event" => sse(
            vec![
                chunk("a"),
                Bytes::from(format!("data: {}", "x".repeat(200_000))),
            ],
            true,
        ),
        "no_done" => sse(vec![chunk("a"), chunk("b")], false),
        "slow" => sse(vec![chunk("a")], true),
        // One chunk now, `[DONE]` 400 ms later.
        "paced" => {
            let later = futures::stream::once(async {
                tokio::time::sleep(Duration::from_millis(400)).await;
                Ok::<_, Infallible>(Bytes::from("data: [DONE]\n\n"))
            });
            let first = futures::stream::iter([Ok::<_, Infallible>(chunk("a"))]);
            Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(first.chain(later)))
                .unwrap()
        }
        _ => sse(vec![chunk("ok"), Bytes::from("data: [DONE]\n\n")], false),
    }
}

/// The hostile engine on an ephemeral port: its address and its server task.
async fn start_hostile_engine() -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = engine.local_addr().unwrap();
    let app = Router::new()
        .route("/v1/chat/completions", post(hostile))
        .route("/health", get(|| async { "ok" }));
    (
        addr,
        tokio::spawn(async move { axum::serve(engine, app).await }),
    )
}

/// `GET /v1/load` of the sidecar at `addr`.
async fn get_load(http: &reqwest::Client, addr: std::net::SocketAddr) -> reqwest::Response {
    http.get(format!("http://{addr}/v1/load"))
        .send()
        .await
        .unwrap()
}

#[test]
fn a_hostile_engine_cannot_crash_or_unreceipt_the_sidecar() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let key = KeyPair::generate();
    let log = dir.path().join("receipts.jsonl");
    rt.block_on(async {
        let (engine_addr, server) = start_hostile_engine().await;
        let mut cfg = SidecarConfig::new(
            format!("http://{engine_addr}"),
            "s1",
            key.clone(),
            log.clone(),
        );
        cfg.max_answer_bytes = 1 << 20;
        cfg.max_event_bytes = 64 << 10;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sc = worker::sidecar::spawn(cfg, l).await.unwrap();
        let url = format!("http://{}/v1/chat/completions", sc.addr());
        let http = reqwest::Client::new();
        let ask = |model: &str, stream: bool| {
            let body = serde_json::json!({"model": model, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}]});
            http.post(&url)
                .header("x-request-id", format!("req-{model}"))
                .json(&body)
                .send()
        };

        let r = ask("garbage", false).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "this is not json");

        let r = ask("huge", false).await.unwrap();
        assert_eq!(r.status(), 502);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "engine_answer_too_large");

        let r = ask("error", false).await.unwrap();
        assert_eq!(r.status(), 400);
        assert!(r.text().await.unwrap().contains("bad_thing"));

        for model in ["endless_event", "no_done"] {
            let r = ask(model, true).await.unwrap();
            assert_eq!(r.status(), 200);
            let text = tokio::time::timeout(Duration::from_secs(10), r.text())
                .await
                .expect("the stream ends")
                .unwrap();
            assert!(text.contains("engine_stream_broken"), "{model}: {text}");
            assert!(!text.contains("data: [DONE]"), "{model}: {text}");
        }

        // The client goes away after the first event.
        let r = ask("slow", true).await.unwrap();
        let mut body = r.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: "));
        drop(body);

        let ok = ask("fine", true).await.unwrap();
        assert!(ok.text().await.unwrap().ends_with("data: [DONE]\n\n"));

        // Every request above is receipted (the disconnect's once the sidecar noticed).
        let receipt = |id: &str| {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| receipts::Receipt::from_line(l.as_bytes()).ok())
                .find(|r| r.body.request_id == id)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while receipt("req-slow").is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "no receipt for the disconnect"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let code = |id: &str| receipt(id).and_then(|r| r.body.error_code);
        assert_eq!(
            code("req-garbage").as_deref(),
            Some("engine_answer_not_json")
        );
        assert_eq!(code("req-huge").as_deref(), Some("engine_answer_too_large"));
        assert_eq!(receipt("req-huge").unwrap().body.status, 502);
        assert_eq!(code("req-error").as_deref(), Some("bad_thing"));
        assert_eq!(receipt("req-error").unwrap().body.status, 400);
        assert_eq!(
            code("req-endless_event").as_deref(),
            Some("engine_stream_broken")
        );
        assert_eq!(code("req-no_done").as_deref(), Some("engine_stream_broken"));
        assert_eq!(code("req-slow").as_deref(), Some("client_disconnected"));
        assert_eq!(receipt("req-slow").unwrap().body.status, 499);
        let fine = receipt("req-fine").unwrap();
        assert_eq!(
            (fine.body.status, fine.body.error_code.clone()),
            (200, None)
        );
        assert_eq!(
            fine.body.response_sha256,
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"ok"))
        );

        // However each request ended, none is left in the load report (its first message is
        // the load as it is).
        let load = get_load(&http, sc.addr()).await;
        assert_eq!(load.status(), 200);
        let mut body = load.bytes_stream();
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("a load message")
            .unwrap()
            .unwrap();
        let text = String::from_utf8_lossy(&first).to_string();
        assert!(text.starts_with("event: load\n"), "{text}");
        let data = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(data).unwrap(),
            serde_json::json!({"running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0})
        );
        drop(body);
        let metrics = http
            .get(format!("http://{}/metrics", sc.addr()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("kvgate_sidecar_load_running 0"),
            "{metrics}"
        );

        sc.shutdown().await;

        // With the report off, `GET /v1/load` is 404.
        let mut cfg = SidecarConfig::new(
            format!("http://{engine_addr}"),
            "s2",
            KeyPair::generate(),
            dir.path().join("receipts-s2.jsonl"),
        );
        cfg.load_report = false;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let off = worker::sidecar::spawn(cfg, l).await.unwrap();
        let r = get_load(&http, off.addr()).await;
        assert_eq!(r.status(), 404);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        off.shutdown().await;
        server.abort();
    });
    let mut ring = receipts::KeyRing::new();
    ring.insert("s1", key.public().clone());
    let report = receipts::verify_log(&log, &ring).unwrap();
    assert!(report.ok(), "{report:?}");
    assert_eq!(report.valid, 7, "{report:?}");
}

/// A sidecar drains as a worker does (`worker::drain`): `/ready` turns 503 `draining`, the
/// stream it relays finishes with `[DONE]`, and the drain returns once it has.
#[test]
fn a_draining_sidecar_lets_its_streams_finish() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let (engine_addr, server) = start_hostile_engine().await;
        let cfg = SidecarConfig::new(
            format!("http://{engine_addr}"),
            "s1",
            KeyPair::generate(),
            dir.path().join("receipts.jsonl"),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut sc = worker::sidecar::spawn(cfg, l).await.unwrap();
        let base = format!("http://{}", sc.addr());
        let http = reqwest::Client::new();
        assert_eq!(
            http.get(format!("{base}/ready"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let body = serde_json::json!({"model": "paced", "stream": true,
            "messages": [{"role": "user", "content": "hi"}]});
        let mut r = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let first = r.chunk().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: "));
        assert_eq!(sc.in_flight(), 1);
        let rest = async {
            let mut out = Vec::new();
            while let Some(c) = r.chunk().await.unwrap() {
                out.extend_from_slice(&c);
            }
            String::from_utf8(out).unwrap()
        };
        let ready = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            http.get(format!("{base}/ready")).send().await.unwrap()
        };
        let (report, rest, ready) = tokio::join!(
            sc.drain(Duration::from_millis(20), Duration::from_secs(10)),
            rest,
            ready
        );
        assert_eq!(ready.status(), 503);
        let v: serde_json::Value = ready.json().await.unwrap();
        assert!(v["reason"].as_str().unwrap().starts_with("draining"), "{v}");
        assert!(rest.contains("data: [DONE]"), "{rest}");
        assert_eq!(report.in_flight_left, 0, "{report:?}");
        assert!(report.waited >= Duration::from_millis(300), "{report:?}");
        let m = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(m.contains("kvgate_sidecar_draining 1"), "{m}");
        assert!(m.contains("kvgate_sidecar_requests_in_flight 0"), "{m}");
        sc.shutdown().await;
        server.abort();
    });
}

/// A multi-threaded runtime for a test's servers.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An engine serving `load` (its load endpoint), the [`hostile`] engine's chat completions and
/// `/health`, and in front of it a sidecar reading the engine's own load from `source` every
/// `interval`: the sidecar, and the engine's server task.
async fn sidecar_reading(
    load: Router,
    source: worker::sidecar::engine_load::EngineLoadSource,
    interval: Duration,
    dir: &std::path::Path,
) -> (
    worker::sidecar::RunningSidecar,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_addr = engine.local_addr().unwrap();
    let app = load
        .route("/v1/chat/completions", post(hostile))
        .route("/health", get(|| async { "ok" }));
    let server = tokio::spawn(async move { axum::serve(engine, app).await });
    let mut cfg = SidecarConfig::new(
        format!("http://{engine_addr}"),
        "s1",
        KeyPair::generate(),
        dir.join("receipts.jsonl"),
    );
    cfg.engine_load = Some(worker::sidecar::engine_load::EngineLoadConfig {
        interval,
        ..worker::sidecar::engine_load::EngineLoadConfig::new(source)
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    (worker::sidecar::spawn(cfg, l).await.unwrap(), server)
}

/// One streamed chat request through the sidecar at `addr`, answered whole.
async fn relay_one(http: &reqwest::Client, addr: std::net::SocketAddr) {
    let r = http
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "fine", "stream": true, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
}

/// The first sample of `series` (its full name and labels) in the `/metrics` of the sidecar
/// at `addr`; 0 when absent.
async fn metric(http: &reqwest::Client, addr: std::net::SocketAddr, series: &str) -> f64 {
    let text = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Waits (10 s at most) until `series` reads `want`; `what` names the wait.
async fn wait_metric(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    what: &str,
    series: &str,
    want: f64,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(http, addr, series).await != want {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The engine's own load (`engine_load`, llama-server's `GET /slots`) read from a hostile
/// engine: an answer that is not a slots array, too large, of the wrong types, or that never
/// comes drops the engine's view (the report falls back to the forwarded requests' count: 0
/// here) and is counted `failed`; a 501 (llama-server `--no-slots`) is `unsupported`; a good
/// answer after failures is read again; the sidecar serves throughout and stops promptly.
#[test]
fn a_hostile_slots_answer_leaves_the_forwarded_count() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const GOOD: usize = 0;
    let mode = Arc::new(AtomicUsize::new(GOOD));
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let m = mode.clone();
        let slots = move || {
            let m = m.clone();
            async move {
                match m.load(Ordering::SeqCst) {
                    GOOD => (
                        [(header::CONTENT_TYPE, "application/json")],
                        r#"[{"id":0,"n_ctx":4096,"is_processing":true,"next_token":[{"n_remain":100,"n_decoded":3}]},
                            {"id":1,"n_ctx":4096,"is_processing":true,"next_token":[{"n_remain":50,"n_decoded":1}]}]"#,
                    )
                        .into_response(),
                    1 => (StatusCode::OK, "this is not json").into_response(),
                    2 => (StatusCode::OK, vec![b'['; 2 << 20]).into_response(),
                    3 => (StatusCode::OK, r#"[{"is_processing":1}]"#).into_response(),
                    4 => futures::future::pending::<Response>().await,
                    5 => (StatusCode::INTERNAL_SERVER_ERROR, "oops").into_response(),
                    _ => (
                        StatusCode::NOT_IMPLEMENTED,
                        r#"{"error":{"code":501,"message":"This server does not support slots endpoint. Start it with `--slots`","type":"not_supported_error"}}"#,
                    )
                        .into_response(),
                }
            }
        };
        let app = Router::new().route("/slots", get(slots));
        let (sc, server) = sidecar_reading(
            app,
            worker::sidecar::engine_load::EngineLoadSource::Slots,
            Duration::from_millis(20),
            dir.path(),
        )
        .await;
        let http = reqwest::Client::new();
        let addr = sc.addr();
        let metric = |series| metric(&http, addr, series);
        let wait_for = |what, series, want| wait_metric(&http, addr, what, series, want);
        let failed = r#"kvgate_sidecar_engine_load_reads_total{outcome="failed"}"#;
        let serves = || relay_one(&http, addr);

        wait_for("the engine's view read", "kvgate_sidecar_load_decode_tokens", 150.0).await;
        assert_eq!(metric("kvgate_sidecar_load_running").await, 2.0);
        for (bad, what) in [
            (1, "not JSON"),
            (2, "2 MiB"),
            (3, "wrong types"),
            (5, "a 500"),
            (4, "no answer"),
        ] {
            let before = metric(failed).await;
            mode.store(bad, Ordering::SeqCst);
            wait_for(what, "kvgate_sidecar_load_running", 0.0).await;
            assert_eq!(metric("kvgate_sidecar_load_decode_tokens").await, 0.0, "{what}");
            assert!(metric(failed).await > before, "{what} counted as failed");
            serves().await;
            mode.store(GOOD, Ordering::SeqCst);
            wait_for("read again", "kvgate_sidecar_load_running", 2.0).await;
        }
        mode.store(6, Ordering::SeqCst);
        wait_for(
            "501: unsupported",
            r#"kvgate_sidecar_engine_load_reads_total{outcome="unsupported"}"#,
            1.0,
        )
        .await;
        assert_eq!(metric("kvgate_sidecar_load_running").await, 0.0);
        serves().await;
        // The reader waits 30 s before asking again; the sidecar still stops at once.
        let t = std::time::Instant::now();
        sc.shutdown().await;
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        server.abort();
    });
}

/// The engine's own load from a vLLM-style `GET /metrics` (`--engine-load vllm`): the running
/// and waiting gauges, summed over their label sets, reach the sidecar's `GET /v1/load` as
/// `running` and `waiting` (each request counted as 256 output tokens) though no request went
/// through the sidecar; when the engine is idle again so is the report; an exposition without
/// either series is `unsupported`.
#[test]
fn a_vllm_engines_own_counts_reach_the_load_report() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    // (running, waiting); u64::MAX: an exposition without the two series.
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let c = counts.clone();
        let metrics = move || {
            let c = c.clone();
            async move {
                let (r, w) = (c.0.load(Ordering::SeqCst), c.1.load(Ordering::SeqCst));
                if r == u64::MAX {
                    return "# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 1.5\n"
                        .to_string();
                }
                format!(
                    "# TYPE vllm:num_requests_running gauge\n\
                     vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {r}.0\n\
                     vllm:num_requests_running{{engine=\"1\",model_name=\"m\"}} 1.0\n\
                     # TYPE vllm:num_requests_waiting gauge\n\
                     vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {w}.0\n\
                     vllm:num_requests_waiting_by_reason{{reason=\"capacity\"}} 50.0\n"
                )
            }
        };
        let app = Router::new().route("/metrics", get(metrics));
        let (sc, server) = sidecar_reading(
            app,
            worker::sidecar::engine_load::EngineLoadSource::vllm(),
            Duration::from_millis(20),
            dir.path(),
        )
        .await;
        let http = reqwest::Client::new();
        // The first load message of a fresh `GET /v1/load` (the current load).
        let load_now = || {
            let (http, addr) = (http.clone(), sc.addr());
            async move {
                let mut r = get_load(&http, addr).await;
                let mut text = String::new();
                while let Some(chunk) = r.chunk().await.unwrap() {
                    text.push_str(&String::from_utf8_lossy(&chunk));
                    if let Some(line) = text.lines().find(|l| l.starts_with("data:")) {
                        return serde_json::from_str::<serde_json::Value>(&line[5..]).unwrap();
                    }
                }
                panic!("no load message: {text}");
            }
        };
        let wait_for = |want: serde_json::Value| async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let got = load_now().await;
                if got == want {
                    return;
                }
                assert!(tokio::time::Instant::now() < deadline, "{got} != {want}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        counts.0.store(4, Ordering::SeqCst);
        counts.1.store(3, Ordering::SeqCst);
        wait_for(serde_json::json!({
            "running": 5, "waiting": 3, "prefill_tokens": 0, "decode_tokens": 8 * 256,
        }))
        .await;
        counts.0.store(0, Ordering::SeqCst);
        counts.1.store(0, Ordering::SeqCst);
        wait_for(serde_json::json!({
            "running": 1, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 256,
        }))
        .await;
        counts.0.store(u64::MAX, Ordering::SeqCst);
        wait_metric(
            &http,
            sc.addr(),
            "an exposition without the series: unsupported",
            r#"kvgate_sidecar_engine_load_reads_total{outcome="unsupported"}"#,
            1.0,
        )
        .await;
        wait_for(serde_json::json!({
            "running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0,
        }))
        .await;
        sc.shutdown().await;
        server.abort();
    });
}

/// A request relayed by the sidecar brings the next read of the engine's view forward: with
/// reads 5 s apart, the engine's busy slot from the last read leaves the report within a
/// second of a relayed request's end, not at the next scheduled read.
#[test]
fn a_relayed_requests_end_brings_the_next_read_forward() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let busy = Arc::new(AtomicBool::new(true));
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let b = busy.clone();
        let slots = move || {
            let b = b.clone();
            async move {
                let slot = if b.load(Ordering::SeqCst) {
                    r#"{"id":0,"n_ctx":4096,"is_processing":true,"next_token":[{"n_remain":500,"n_decoded":3}]}"#
                } else {
                    r#"{"id":0,"n_ctx":4096,"is_processing":false}"#
                };
                format!("[{slot}]")
            }
        };
        let app = Router::new().route("/slots", get(slots));
        let (sc, server) = sidecar_reading(
            app,
            worker::sidecar::engine_load::EngineLoadSource::Slots,
            Duration::from_secs(5),
            dir.path(),
        )
        .await;
        let http = reqwest::Client::new();
        let addr = sc.addr();
        // The read at start-up sees the busy slot.
        wait_metric(&http, addr, "the first read", "kvgate_sidecar_load_running", 1.0).await;
        busy.store(false, Ordering::SeqCst);
        let t = std::time::Instant::now();
        relay_one(&http, addr).await;
        wait_metric(&http, addr, "the early read", "kvgate_sidecar_load_running", 0.0).await;
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        sc.shutdown().await;
        server.abort();
    });
}
