//! Gateway operations end to end over simulated workers: health (skip and recover), the admin
//! plane (auth, apply/read back, invalid apply keeps the old version, contract refusal, live
//! RR → KV-exact switch, file reload), a rules change during a long stream, 1 MiB bodies on the
//! gateway's own forwarding path, `Expect: 100-continue`, and the decision log audited against
//! the workers' receipts.

#[path = "python_support/mod.rs"]
mod python_support;

#[path = "gateway_support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use support::{chat, Fleet, FleetOptions, KV_SERVICE, RR_SERVICE};

#[test]
fn unhealthy_worker_is_skipped_and_comes_back() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(RR_SERVICE, false);
    fleet.stop_worker(1);
    // Every request still succeeds: a refused connection retries on the next candidate, and the
    // worker is marked unhealthy (passively at once, then by the active check).
    for i in 0..12 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("q{i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(r.worker(), "w2");
    }
    let gw = fleet.gw().data.clone();
    let w2 = prefix_index::WorkerId("w2".into());
    assert!(!gw.views.load().workers[&w2].healthy);
    let workers = fleet.admin(Method::GET, "/admin/workers", None).json();
    let w2_json = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == "w2")
        .unwrap()
        .clone();
    assert_eq!(w2_json["healthy"], false);
    // Back on the same port: the active check notices and traffic returns.
    fleet.restart_worker(1);
    fleet.wait_for("w2 healthy again", Duration::from_secs(10), || {
        gw.views.load().workers[&w2].healthy
    });
    let mut seen_w2 = false;
    for i in 0..9 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("r{i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200);
        seen_w2 |= r.worker() == "w2";
    }
    assert!(seen_w2, "w2 got no traffic after recovering");
    fleet.stop();
}

#[test]
fn admin_plane_applies_refuses_and_switches_live() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(RR_SERVICE, true);
    // Authentication.
    let anon = fleet.rt.block_on(async {
        support::Reply::read(
            fleet
                .http
                .get(fleet.admin_url("/admin/rules"))
                .send()
                .await
                .unwrap(),
        )
        .await
    });
    assert_eq!(anon.status, 401);
    assert_eq!(anon.json()["error"]["code"], "unauthorized");
    // Round robin only: no worker's KV events are read (they would feed nothing).
    let event_states = |fleet: &Fleet| -> Vec<String> {
        fleet.admin(Method::GET, "/admin/workers", None).json()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["events"]["state"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    assert_eq!(event_states(&fleet), ["not_subscribed", "not_subscribed"]);
    let rules = fleet.admin(Method::GET, "/admin/rules", None).json();
    let v1 = rules["version"].as_u64().unwrap();
    assert_eq!(rules["rules"]["services"][0]["rule"]["type"], "round_robin");

    // An invalid apply (unknown pool) is refused with 400 and the old version stays.
    let bad = json!({"name": "chat", "pool": "nope", "rule": {"type": "round_robin"}});
    let r = fleet.admin(Method::PUT, "/admin/services/chat", Some(bad));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rules_rejected");
    assert!(r.text().contains("pool"), "{}", r.text());
    assert_eq!(
        fleet.admin(Method::GET, "/admin/rules", None).json()["version"]
            .as_u64()
            .unwrap(),
        v1
    );

    // A kv_exact service whose profile pins another block size than the workers': refused,
    // naming the field.
    let mut text = std::fs::read_to_string(&fleet.rules_path).unwrap();
    text.push_str(&fleet.profile_toml("smol32", 32));
    std::fs::write(&fleet.rules_path, &text).unwrap();
    let reload = fleet.admin(Method::POST, "/admin/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    let v2 = reload.json()["version"].as_u64().unwrap();
    assert!(v2 > v1);
    let mismatch =
        json!({"name": "chat", "pool": "all", "rule": {"type": "kv_exact", "profile": "smol32"}});
    let r = fleet.admin(Method::PUT, "/admin/services/chat", Some(mismatch));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("block_size"), "{}", r.text());
    assert_eq!(
        fleet.admin(Method::GET, "/admin/rules", None).json()["version"]
            .as_u64()
            .unwrap(),
        v2
    );
    // The workers report their GGUF's `general.architecture` (`llama`) in /v1/profile; a profile
    // pinning another architecture, identical otherwise, is refused naming the field.
    // (The gateway reads it over HTTP in its contract check.)
    let reported = fleet.workers[0].as_ref().unwrap().profile();
    assert_eq!(
        reported.architecture.as_deref(),
        Some("llama"),
        "{reported:?}"
    );
    let mut text = std::fs::read_to_string(&fleet.rules_path).unwrap();
    text.push_str(
        &fleet
            .profile_toml("smolqwen", 16)
            .replace("\nrevision = ", "\narchitecture = \"qwen2\"\nrevision = "),
    );
    std::fs::write(&fleet.rules_path, &text).unwrap();
    let reload = fleet.admin(Method::POST, "/admin/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    let v2 = reload.json()["version"].as_u64().unwrap();
    let mismatch =
        json!({"name": "chat", "pool": "all", "rule": {"type": "kv_exact", "profile": "smolqwen"}});
    let r = fleet.admin(Method::PUT, "/admin/services/chat", Some(mismatch));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text()
            .contains(r#"architecture (pinned \"qwen2\", worker \"llama\")"#),
        "{}",
        r.text()
    );
    assert_eq!(
        fleet.admin(Method::GET, "/admin/rules", None).json()["version"]
            .as_u64()
            .unwrap(),
        v2
    );

    // Switch the service to kv_exact live, read it back, see it in routing and metrics.
    let kv =
        json!({"name": "chat", "pool": "all", "rule": {"type": "kv_exact", "profile": "smol"}});
    let r = fleet.admin(Method::PUT, "/admin/services/chat", Some(kv));
    assert_eq!(r.status, 200, "{}", r.text());
    let v3 = r.json()["version"].as_u64().unwrap();
    assert!(v3 > v2);
    let back = fleet
        .admin(Method::GET, "/admin/services/chat", None)
        .json();
    assert_eq!(back["rule"]["type"], "kv_exact");
    // Written back to the file: a restart would load it.
    assert!(std::fs::read_to_string(&fleet.rules_path)
        .unwrap()
        .contains("kv_exact"));
    let r = fleet.post(
        "/v1/chat/completions",
        &chat(&[("user", "after the switch")], 2),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvgate-rules-version").unwrap(), v3.to_string());
    assert_ne!(
        r.header("x-kvgate-route-reason").as_deref(),
        Some("round_robin")
    );
    let m = fleet.admin(Method::GET, "/metrics", None).text();
    assert!(m.contains("mode=\"kv_exact\""), "{m}");
    assert!(m.contains("kvgate_gateway_route_decision_seconds"), "{m}");
    // The decision's CPU and its tokenizing part: one observation each for the one kv_exact
    // request, the part no larger than the whole.
    let sample = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name) && l.contains("mode=\"kv_exact\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} for kv_exact in {m}"))
    };
    let cpu = "kvgate_gateway_route_decision_cpu_seconds";
    let tok = "kvgate_gateway_route_tokenize_cpu_seconds";
    assert_eq!(sample(&format!("{cpu}_count")), 1.0);
    assert_eq!(sample(&format!("{tok}_count")), 1.0);
    let (all, part) = (sample(&format!("{cpu}_sum")), sample(&format!("{tok}_sum")));
    assert!(part > 0.0 && part <= all, "tokenizing {part} s of {all} s");
    // A kv_exact service routes to them now: their event streams are read.
    fleet.wait_for("event streams", Duration::from_secs(10), || {
        event_states(&fleet) == ["connected", "connected"]
    });
    let workers = fleet.admin(Method::GET, "/admin/workers", None).json();
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["contract"]["state"], "ok", "{w}");
    }
    // Each stream's first load message arrives right after subscribing: counted per worker in
    // /admin/workers and in the metric.
    let reports = |fleet: &Fleet| -> Vec<u64> {
        fleet.admin(Method::GET, "/admin/workers", None).json()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["events"]["load_reports"].as_u64().unwrap_or(0))
            .collect()
    };
    fleet.wait_for("load reports", Duration::from_secs(10), || {
        reports(&fleet).iter().all(|&n| n > 0)
    });
    let m = fleet.admin(Method::GET, "/metrics", None).text();
    for (i, n) in reports(&fleet).iter().enumerate() {
        let line = format!(
            "kvgate_gateway_worker_load_reports_total{{worker=\"w{}\"}} ",
            i + 1
        );
        let exported: u64 = m
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in {m}"));
        assert!(
            exported > 0 && exported <= *n,
            "{line}{exported} against {n}"
        );
    }

    // DELETE, then the path has no service.
    let r = fleet.admin(Method::DELETE, "/admin/services/chat", None);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = fleet.post("/v1/chat/completions", &chat(&[("user", "x")], 2), &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "service_not_found");
    let r = fleet.admin(Method::DELETE, "/admin/services/chat", None);
    assert_eq!(r.status, 404);

    // The file watch: write a service back into the file; the gateway picks it up.
    let text = fleet.rules_toml(RR_SERVICE);
    std::fs::write(&fleet.rules_path, &text).unwrap();
    let gw = fleet.gw().data.clone();
    fleet.wait_for("file-watch reload", Duration::from_secs(10), || {
        gw.views.load().services.iter().any(|s| s.name() == "chat")
    });
    let r = fleet.post("/v1/chat/completions", &chat(&[("user", "x")], 2), &[]);
    assert_eq!(r.status, 200);
    // Round robin again: the streams are closed.
    fleet.wait_for("event streams closed", Duration::from_secs(10), || {
        event_states(&fleet) == ["not_subscribed", "not_subscribed"]
    });

    // Decision log vs receipts: every routed decision has exactly one receipt from its worker.
    let decisions = fleet.dir.path().join("decisions.jsonl");
    let logs: Vec<_> = (1..=2)
        .map(|i| fleet.dir.path().join(format!("receipts-w{i}.jsonl")))
        .collect();
    let ring = fleet.key_ring();
    let dir = fleet.dir.path().to_owned();
    fleet.stop(); // flushes the logs
    let text = std::fs::read_to_string(&decisions).unwrap();
    let lines: Vec<receipts::DecisionRecord> = text
        .lines()
        .map(|l| receipts::DecisionRecord::from_line(l.as_bytes()).unwrap())
        .collect();
    assert!(
        lines.iter().any(|d| d.ticket.is_some() && d.status == 200),
        "{text}"
    );
    assert!(
        lines.iter().any(|d| d.ticket.is_none() && d.status == 404),
        "{text}"
    );
    let report = receipts::audit(&decisions, &logs, &ring).unwrap();
    assert!(
        report.discrepancies.is_empty(),
        "audit found discrepancies: {:?}",
        report.discrepancies
    );
    assert_eq!(report.receipted, report.routed, "{report:?}");
    assert!(
        report.per_mode.contains_key("kv_exact") && report.per_mode.contains_key("round_robin")
    );
    drop(dir);
}

/// Two simulated workers at 10 ms per token: a 60-token stream lasts ~0.6 s.
fn slow_stream_fleet() -> Fleet {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.decode_us_base = 10_000;
    Fleet::workers(FleetOptions {
        workers: 2,
        sim,
        ..FleetOptions::default()
    })
}

/// Sends `body` (a streaming chat) through the VIP in the background and returns once its first
/// event arrived; the task gives the answer's headers and whole text when it ends.
fn spawn_stream(
    fleet: &Fleet,
    body: serde_json::Value,
) -> tokio::task::JoinHandle<(reqwest::header::HeaderMap, String)> {
    let url = fleet.url("/v1/chat/completions");
    let http = fleet.http.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let stream = fleet.rt.spawn(async move {
        use futures::StreamExt;
        let r = http.post(url).json(&body).send().await.unwrap();
        let headers = r.headers().clone();
        let mut s = r.bytes_stream();
        let mut text = String::new();
        while let Some(chunk) = s.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if text.contains("data:") {
                let _ = tx.send(());
            }
        }
        (headers, text)
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("stream started");
    stream
}

#[test]
fn rules_change_during_a_long_stream_does_not_break_it() {
    let mut fleet = slow_stream_fleet();
    fleet.start_gateway(RR_SERVICE, false);
    let v_before = fleet.gw().data.views.load().version();
    let mut body = chat(&[("user", "stream please")], 60);
    body["stream"] = json!(true);
    let stream = spawn_stream(&fleet, body);
    let kv =
        json!({"name": "chat", "pool": "all", "rule": {"type": "kv_exact", "profile": "smol"}});
    let r = fleet.admin(Method::PUT, "/admin/services/chat", Some(kv));
    assert_eq!(r.status, 200, "{}", r.text());
    let (headers, text) = fleet.rt.block_on(stream).unwrap();
    assert_eq!(
        headers["x-kvgate-rules-version"],
        v_before.to_string().as_str()
    );
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "stream cut: {text}"
    );
    let chunks = text.matches("data: {").count();
    assert!(chunks >= 10, "only {chunks} chunks: {text}");
    assert!(fleet.gw().data.views.load().version() > v_before);
    fleet.stop();
}

/// A rolling restart of one worker behind the gateway: the worker drains while requests keep
/// coming. Its open stream finishes with `[DONE]`, the gateway stops routing to it within a
/// health interval (its `/ready` says `draining`), and no request fails; then it stops.
#[test]
fn a_draining_worker_finishes_its_streams_and_loses_no_request() {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.decode_us_base = 10_000; // a 60-token stream lasts ~0.6 s
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        sim,
        ..FleetOptions::default()
    });
    fleet.start_gateway(RR_SERVICE, false);
    // A stream on w1 (round robin: retry until one lands there).
    let mut body = chat(&[("user", "stream please")], 60);
    body["stream"] = json!(true);
    let url = fleet.url("/v1/chat/completions");
    let stream = fleet.rt.block_on(async {
        loop {
            let mut r = fleet.http.post(&url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            if r.headers()["x-kvgate-worker"] == "w1" {
                let first = r.chunk().await.unwrap().unwrap();
                assert!(first.starts_with(b"data:"));
                return r;
            }
            let _ = r.bytes().await;
        }
    });
    let mut w1 = fleet.workers[0].take().unwrap();
    let short = chat(&[("user", "during the drain")], 2);
    let (report, rest, served) = fleet.rt.block_on(async {
        let requests = async {
            // Requests keep coming through the drain (its grace covers the 100 ms health
            // interval of these rules).
            let mut served = Vec::new();
            for _ in 0..20 {
                let r = fleet.http.post(&url).json(&short).send().await.unwrap();
                let worker = r.headers()["x-kvgate-worker"].to_str().unwrap().to_owned();
                served.push((r.status().as_u16(), worker));
                let _ = r.bytes().await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            served
        };
        let rest = async {
            let mut stream = stream;
            let mut out = Vec::new();
            while let Some(c) = stream.chunk().await.unwrap() {
                out.extend_from_slice(&c);
            }
            String::from_utf8(out).unwrap()
        };
        tokio::join!(
            w1.drain(Duration::from_millis(300), Duration::from_secs(20)),
            rest,
            requests
        )
    });
    assert!(
        rest.trim_end().ends_with("data: [DONE]"),
        "stream cut: {rest}"
    );
    assert_eq!(report.in_flight_left, 0, "{report:?}");
    assert!(
        served.iter().all(|(status, _)| *status == 200),
        "{served:?}"
    );
    // Once the gateway saw /ready fail, everything went to w2.
    assert!(
        served[served.len() - 8..].iter().all(|(_, w)| w == "w2"),
        "{served:?}"
    );
    let workers = fleet.admin(Method::GET, "/admin/workers", None).json();
    assert_eq!(workers["workers"][0]["healthy"], false, "{workers}");
    fleet.rt.block_on(w1.shutdown());
    fleet.stop();
}

/// A gateway that joins a fleet reports ready (admin `GET /ready`, no token) only once the KV
/// event snapshots of the healthy workers its `kv_exact` services route to have arrived: here
/// w2's 16 subscription slots are taken, so its stream is refused (429) until they free up.
#[test]
fn ready_waits_for_the_kv_event_snapshots_at_the_start() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    let w2 = fleet.addrs[1];
    let access = fleet.worker_access(1);
    let http = fleet.http.clone();
    let held: Vec<reqwest::Response> = fleet.rt.block_on(async {
        let mut held = Vec::new();
        for _ in 0..16 {
            let r = http
                .get(format!("http://{w2}/v1/kv/events"))
                .header("authorization", &access)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            held.push(r);
        }
        held
    });
    fleet.start_gateway(KV_SERVICE, false);
    let ready = || {
        fleet.rt.block_on(async {
            let r = http.get(fleet.admin_url("/ready")).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<serde_json::Value>().await.unwrap())
        })
    };
    // w1's snapshot arrives; w2's cannot.
    fleet.wait_for("w1's snapshot", Duration::from_secs(10), || {
        fleet.admin(Method::GET, "/admin/workers", None).json()["workers"][0]["events"]
            ["load_reports"]
            .as_u64()
            > Some(0)
    });
    let (status, body) = ready();
    assert_eq!(status, 503, "{body}");
    let reason = body["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("catching up") && reason.contains("w2") && !reason.contains("w1"),
        "{reason}"
    );
    // Requests are served meanwhile (readiness is for the VIP, not a gate on the proxy).
    assert_eq!(
        fleet
            .post("/v1/chat/completions", &chat(&[("user", "early")], 2), &[])
            .status,
        200
    );
    drop(held);
    fleet.wait_for("ready", Duration::from_secs(15), || ready().0 == 200);
    assert_eq!(ready().1, json!({"ready": true}));
    let health = fleet.rt.block_on(async {
        http.get(fleet.admin_url("/health"))
            .send()
            .await
            .unwrap()
            .status()
    });
    assert_eq!(health, 200);
    fleet.stop();
}

#[test]
fn one_mebibyte_bodies_route_and_expect_continue_works() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    // 1 MiB of JSON whitespace inside a valid chat body: the gateway must parse it (kv_exact),
    // then forward all of it (its own path: over pingora's 64 KiB retry buffer).
    let pad = " ".repeat(1 << 20);
    let body = format!(
        r#"{{"model":"smol",{pad}"messages":[{{"role":"user","content":"a big body"}}],"max_tokens":3}}"#
    );
    assert!(body.len() > 1 << 20);
    let r = fleet.post_raw("/v1/chat/completions", body.clone().into_bytes(), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["choices"][0]["message"]["content"].is_string());
    let w = r.worker();
    // Streaming on the big-body path.
    let sbody = body.replace(r#""max_tokens":3"#, r#""max_tokens":5,"stream":true"#);
    let r = fleet.post_raw("/v1/chat/completions", sbody.into_bytes(), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.text().trim_end().ends_with("data: [DONE]"),
        "{}",
        r.text()
    );
    // A 1 MiB prompt of real text is over the context limit: the gateway refuses it itself.
    let long = "token ".repeat(180_000);
    let r = fleet.post("/v1/chat/completions", &chat(&[("user", &long)], 4), &[]);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");

    // Expect: 100-continue over a raw socket: the gateway answers 100 before the body is sent.
    let small =
        r#"{"model":"smol","messages":[{"role":"user","content":"expect"}],"max_tokens":2}"#;
    let mut s = std::net::TcpStream::connect(fleet.gw().listen_addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        small.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).unwrap();
    let head = String::from_utf8_lossy(&first[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 100"), "{head}");
    s.write_all(small.as_bytes()).unwrap();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("200 OK"), "{rest}");
    let _ = w;
    fleet.stop();
}

#[test]
fn openai_python_client_through_the_gateway() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    // Two services told apart by `model`: the gateway lists both (`client.models.list()`).
    let services = format!(
        "{}match = {{ models = [\"smol\"] }}\n\n[[services]]\nname = \"rr\"\npool = \"all\"\n\
         match = {{ models = [\"smol-rr\"] }}\nrule = {{ type = \"round_robin\" }}\n",
        KV_SERVICE
    );
    fleet.start_gateway(&services, true);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gateway_openai.py");
    let out = std::process::Command::new(python_support::python())
        .arg(&script)
        .arg(format!("http://{}/v1", fleet.gw().listen_addr))
        .output()
        .expect("python3 must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gateway_openai.py failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("non-streaming ok")
            && stdout.contains("streaming ok")
            && stdout.contains("models ok")
            && stdout.contains("json mode ok")
            && stdout.contains("n=2 ok")
            && stdout.contains("responses ok")
            && stdout.contains("stored responses ok")
            && stdout.contains("background responses ok")
            && stdout.contains("background streams ok")
            && stdout.contains("truncation ok")
            && stdout.contains("input tokens ok")
            && stdout.contains("conversations ok"),
        "{stdout}"
    );
    // Every request the client sent was receipted, and on the KV-exact service the gateway's
    // prompt (chat, completions, Responses API) is the worker's, token for token.
    let rep = fleet.audit();
    assert!(rep.ok(), "{rep}");
    assert!(rep.parity.compared >= 7, "{rep}");
    assert_eq!(rep.parity.mismatched, 0, "{rep}");
    fleet.stop();
}

#[test]
fn a_declared_body_over_the_cap_is_refused_before_100_continue() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    fleet.start_gateway(RR_SERVICE, false);
    // 17 MiB declared, over the default 16 MiB cap: the client must not be told to send it.
    let mut s = std::net::TcpStream::connect(fleet.gw().listen_addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nexpect: 100-continue\r\n\r\n",
        17 << 20
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed without an answer");
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got);
    assert!(
        head.starts_with("HTTP/1.1 413"),
        "expected 413 before any 100 Continue, got {head}"
    );
    fleet.stop();
}

/// An operator cordons a worker through the admin plane: a stream in flight on it finishes, new
/// requests — its cached prefix included — go elsewhere, the cordon is a rules change (version,
/// written back to the file, `/admin/workers`, `worker_cordoned`), and lifting it brings the
/// worker back with its cache (the KV events kept it indexed). Cordoning every worker answers
/// 503; an unknown worker is 404; the audit stays clean.
#[test]
fn a_cordoned_worker_finishes_what_it_has_and_takes_nothing_new() {
    let mut fleet = slow_stream_fleet();
    fleet.start_gateway(KV_SERVICE, true);
    let system = format!("Cordon test. {}", "Keep it short. ".repeat(24));
    let body = chat(&[("system", &system), ("user", "hello")], 2);
    let path = "/v1/chat/completions";
    let first = fleet.post(path, &body, &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    let holder = first.worker();
    let other = if holder == "w1" { "w2" } else { "w1" };
    fleet.wait_for("the prompt indexed", Duration::from_secs(10), || {
        fleet
            .post(path, &body, &[])
            .header("x-kvgate-route-reason")
            .as_deref()
            == Some("hit")
    });
    // A stream on the holder (same prefix: a hit), in flight while the cordon lands.
    let mut long = chat(&[("system", &system), ("user", "hello")], 60);
    long["stream"] = json!(true);
    let stream = spawn_stream(&fleet, long);
    let v_before = fleet.gw().data.views.load().version();
    let r = fleet.admin(
        Method::POST,
        &format!("/admin/workers/{holder}/cordon"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (r.json()["applied"].clone(), r.json()["cordoned"].clone()),
        (json!(true), json!(true)),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["version"], json!(v_before + 1), "{}", r.text());
    // Again: nothing changes.
    let again = fleet.admin(
        Method::POST,
        &format!("/admin/workers/{holder}/cordon"),
        None,
    );
    assert_eq!(again.json()["applied"], json!(false), "{}", again.text());
    // The stream on the cordoned worker finishes.
    let (headers, text) = fleet.rt.block_on(stream).unwrap();
    assert_eq!(headers["x-kvgate-worker"], holder.as_str());
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "stream cut: {text}"
    );
    // New requests, the cached prefix included, go to the other worker.
    for _ in 0..3 {
        let r = fleet.post(path, &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.worker(), other);
    }
    // Visible: the admin API, the metric, the rules written back.
    let workers = fleet.admin(Method::GET, "/admin/workers", None).json();
    let cordoned: Vec<(String, bool)> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap().to_owned(), w["cordoned"] == true))
        .collect();
    assert!(cordoned.contains(&(holder.clone(), true)), "{workers}");
    assert!(cordoned.contains(&(other.to_owned(), false)), "{workers}");
    let metrics = fleet.admin(Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains(&format!(
            "kvgate_gateway_worker_cordoned{{worker=\"{holder}\"}} 1"
        )),
        "{metrics}"
    );
    let file = std::fs::read_to_string(&fleet.rules_path).unwrap();
    assert!(
        file.contains(&format!("cordoned = [\"{holder}\"]")),
        "{file}"
    );
    // Every worker cordoned: nothing to route to.
    let r = fleet.admin(
        Method::POST,
        &format!("/admin/workers/{other}/cordon"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let none = fleet.post(path, &body, &[]);
    assert_eq!(none.status, 503, "{}", none.text());
    assert_eq!(
        none.json()["error"]["code"],
        "no_healthy_worker",
        "{}",
        none.text()
    );
    // An unknown worker is a 404.
    let unknown = fleet.admin(Method::POST, "/admin/workers/w9/cordon", None);
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    // Lifted: the holder is back, with its cache.
    for w in [&holder, &other.to_owned()] {
        let r = fleet.admin(Method::POST, &format!("/admin/workers/{w}/uncordon"), None);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["cordoned"], json!(false));
    }
    let back = fleet.post(path, &body, &[]);
    assert_eq!(back.status, 200, "{}", back.text());
    assert_eq!(back.worker(), holder);
    assert_eq!(back.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    assert!(back.cached_tokens() > 0);
    assert!(!std::fs::read_to_string(&fleet.rules_path)
        .unwrap()
        .contains("cordoned"));
    fleet.stop();
    let report = fleet.audit();
    assert!(report.ok(), "{report}");
}

/// `--access-log`: one JSON line per client request as it ends — routed, streamed, refused
/// before routing — with the ids, where it went, why, and its timings and sizes.
#[test]
fn the_access_log_has_a_line_per_request_with_where_it_went_and_how_long_it_took() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    let log = fleet.dir.path().join("access.jsonl");
    let target = gateway::access_log::AccessLogTarget::File(log.clone());
    fleet.start_gateway_with(KV_SERVICE, false, |c| c.access_log = Some(target));
    let path = "/v1/chat/completions";
    let system = format!("Access log test. {}", "Answer briefly. ".repeat(20));
    let body = chat(&[("system", &system), ("user", "hello")], 2);
    let first = fleet.post(path, &body, &[("x-request-id", "client-1")]);
    assert_eq!(first.status, 200, "{}", first.text());
    let mut hit = None;
    fleet.wait_for("a hit", Duration::from_secs(10), || {
        let r = fleet.post(path, &body, &[]);
        let is_hit = r.header("x-kvgate-route-reason").as_deref() == Some("hit");
        hit = Some(r);
        is_hit
    });
    let hit = hit.unwrap();
    let mut streamed = chat(&[("user", "stream this")], 8);
    streamed["stream"] = json!(true);
    let stream = fleet.post(path, &streamed, &[]);
    assert!(stream.text().trim_end().ends_with("data: [DONE]"));
    let missing = fleet.post("/v2/nothing", &body, &[]);
    assert_eq!(missing.status, 404);
    let read = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let mut lines = Vec::new();
    fleet.wait_for("every line written", Duration::from_secs(5), || {
        lines = read();
        lines
            .iter()
            .any(|l| l["request_id"] == missing.header("x-request-id").unwrap().as_str())
    });
    let line_of = |r: &support::Reply| -> serde_json::Value {
        let id = r.header("x-request-id").unwrap();
        let found: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|l| l["request_id"] == id.as_str())
            .collect();
        assert_eq!(found.len(), 1, "one line for {id}: {lines:?}");
        found[0].clone()
    };
    let l = line_of(&first);
    assert_eq!(l["client_request_id"], "client-1");
    assert_eq!(l["method"], "POST");
    assert_eq!(l["path"], path);
    assert_eq!(l["model"], "smol");
    assert_eq!(l["service"], "chat");
    assert_eq!(l["status"], 200);
    assert_eq!(l["worker"], first.worker().as_str());
    assert_eq!(l["attempts"], 1);
    assert_eq!(l["refused_retries"], 0);
    assert_eq!(l["route_reason"], "no_match");
    assert!(
        l["client"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{l}"
    );
    assert!(l["prompt_tokens"].as_u64().unwrap() > 0, "{l}");
    assert_eq!(l["request_bytes"], serde_json::to_vec(&body).unwrap().len());
    assert_eq!(l["response_bytes"], first.body.len());
    let (d, dec, ttft) = (
        l["duration_ms"].as_f64().unwrap(),
        l["decision_ms"].as_f64().unwrap(),
        l["ttft_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < dec && dec <= ttft && ttft <= d, "{l}");
    let l = line_of(&hit);
    assert_eq!(l["route_reason"], "hit");
    // The prediction counts whole cached blocks; the worker recomputes a fully cached
    // prompt's last token, so it reports up to one fewer.
    let predicted = l["predicted_matched_tokens"].as_u64().unwrap();
    assert!(
        hit.cached_tokens() > 0 && (predicted - hit.cached_tokens()) <= 1,
        "{l} vs {}",
        hit.cached_tokens()
    );
    let l = line_of(&stream);
    assert_eq!(l["status"], 200);
    assert_eq!(l["response_bytes"], stream.body.len());
    assert!(l["ttft_ms"].as_f64().unwrap() <= l["duration_ms"].as_f64().unwrap());
    let l = line_of(&missing);
    assert_eq!(l["status"], 404);
    assert_eq!(l["service"], serde_json::Value::Null);
    assert_eq!(l["worker"], serde_json::Value::Null);
    assert_eq!(l["attempts"], 0);
    assert!(l["error"].is_string(), "{l}");
    // One line per request, nothing dropped.
    let metrics = fleet.admin(Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains("kvgate_gateway_access_log_dropped_total 0"),
        "{metrics}"
    );
    fleet.stop();
}

/// The `response` of a streamed Responses API answer's last event.
fn streamed_response(r: &support::Reply) -> serde_json::Value {
    let text = r.text();
    let data = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v["type"] == "response.completed" || v["type"] == "response.incomplete")
        .unwrap_or_else(|| panic!("no last event in {text}"));
    data["response"].clone()
}

fn output_text(response: &serde_json::Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter())
        .map(|p| p["text"].as_str().unwrap().to_owned())
        .collect()
}

fn call(fleet: &Fleet, method: Method, path: &str) -> support::Reply {
    fleet.rt.block_on(async {
        let r = fleet
            .http
            .request(method, fleet.url(path))
            .send()
            .await
            .unwrap();
        support::Reply::read(r).await
    })
}

#[test]
fn stored_responses_survive_a_gateway_restart() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    let file = fleet.dir.path().join("responses.jsonl");
    // The rules file is `dir/rules.toml`: the responses file sits beside it.
    let keep = |cfg: &mut gateway::GatewayConfig| {
        cfg.response_file = Some(cfg.rules_path.with_file_name("responses.jsonl"));
        cfg.response_save_interval = Duration::from_millis(200);
    };
    // A file the gateway cannot write is refused at the start, naming it.
    fleet.rules_path = fleet.dir.path().join("rules.toml");
    std::fs::write(&fleet.rules_path, fleet.rules_toml(KV_SERVICE)).unwrap();
    let mut cfg = gateway::GatewayConfig::new(&fleet.rules_path, fleet.gateway_key.clone());
    let nowhere = fleet.dir.path().join("missing-dir").join("responses.jsonl");
    cfg.response_file = Some(nowhere.clone());
    let err = gateway::spawn(cfg)
        .err()
        .expect("an unwritable file is refused");
    assert!(
        err.to_string().contains(&nowhere.display().to_string()),
        "{err}"
    );
    fleet.start_gateway_with(KV_SERVICE, true, keep);
    let first = "Tell me about the history of the lighthouse keepers of the northern coast, \
                 their daily routines, the lamps and lenses they tended, and the storms. "
        .repeat(3);
    let ask = |fleet: &Fleet, body: serde_json::Value| fleet.post("/v1/responses", &body, &[]);
    let r1 = ask(
        &fleet,
        json!({"model": "smol", "input": first, "max_output_tokens": 6, "temperature": 0}),
    );
    assert_eq!(r1.status, 200, "{}", r1.text());
    let (w1, one) = (r1.worker(), r1.json());
    let id1 = one["id"].as_str().unwrap().to_owned();
    fleet.wait_indexed(&w1, 3);
    let r2 = ask(
        &fleet,
        json!({"model": "smol", "previous_response_id": id1, "input": "And then?",
               "max_output_tokens": 6, "temperature": 0}),
    );
    assert_eq!(r2.status, 200, "{}", r2.text());
    let id2 = r2.json()["id"].as_str().unwrap().to_owned();
    let gone = ask(
        &fleet,
        json!({"model": "smol", "input": "forget me", "max_output_tokens": 2}),
    );
    let gone = gone.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        call(&fleet, Method::DELETE, &format!("/v1/responses/{gone}")).status,
        200
    );
    // Saved while the gateway runs (every 200 ms when something changed).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.contains(&id2) && !text.contains(&gone) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not saved:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Turn 3, stored just before the stop: saved at shutdown.
    let r3 = ask(
        &fleet,
        json!({"model": "smol", "previous_response_id": id2, "input": "Third.",
               "max_output_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r3.status, 200, "{}", r3.text());
    let three = r3.json();
    let id3 = three["id"].as_str().unwrap().to_owned();
    // A conversation, made and changed just before the stop.
    let conv = fleet.post(
        "/v1/conversations",
        &json!({"items": [{"role": "user", "content": "kept across restarts"}]}),
        &[],
    );
    let conv = conv.json()["id"].as_str().unwrap().to_owned();
    let r = fleet.post(
        &format!("/v1/conversations/{conv}"),
        &json!({"metadata": {"n": "2"}}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    fleet.gateway.take().unwrap().shutdown();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }

    // A new gateway process over the same file: the conversation goes on, on the worker that
    // holds its prefix; the deleted turn stays deleted.
    fleet.start_gateway_with(KV_SERVICE, true, keep);
    let got = fleet.get(&format!("/v1/responses/{id3}"), None);
    assert_eq!(got.status, 200, "{}", got.text());
    let got = got.json();
    assert_eq!(got["previous_response_id"], json!(id2));
    assert_eq!(got["output"], three["output"]);
    assert_eq!(
        fleet.get(&format!("/v1/responses/{gone}"), None).status,
        404
    );
    // The conversation too, at its last revision, and it goes on.
    let got = fleet.get(&format!("/v1/conversations/{conv}"), None);
    assert_eq!(got.json()["metadata"], json!({"n": "2"}), "{}", got.text());
    let r = fleet.post(
        &format!("/v1/conversations/{conv}/items"),
        &json!({"items": [{"role": "user", "content": "and after"}]}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = fleet.get(&format!("/v1/conversations/{conv}/items?order=asc"), None);
    let texts: Vec<serde_json::Value> = listed.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].clone())
        .collect();
    assert_eq!(texts, [json!("kept across restarts"), json!("and after")]);
    fleet.wait_indexed(&w1, 3);
    let r4 = ask(
        &fleet,
        json!({"model": "smol", "previous_response_id": id3, "input": "Fourth.",
               "max_output_tokens": 4, "temperature": 0, "stream": true}),
    );
    assert_eq!(r4.status, 200, "{}", r4.text());
    assert_eq!(r4.worker(), w1);
    assert_eq!(r4.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    let four = streamed_response(&r4);
    let cached = four["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 32, "cached {cached}");
    // The restored conversation is the one stored: the same answer as it sent whole.
    let whole = ask(
        &fleet,
        json!({"model": "smol", "max_output_tokens": 4, "temperature": 0, "input": [
            {"role": "user", "content": first},
            {"role": "assistant", "content": output_text(&one)},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": output_text(&r2.json())},
            {"role": "user", "content": "Third."},
            {"role": "assistant", "content": output_text(&three)},
            {"role": "user", "content": "Fourth."}]}),
    );
    assert_eq!(whole.status, 200, "{}", whole.text());
    assert_eq!(output_text(&whole.json()), output_text(&four));
    let rep = fleet.audit();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.parity.mismatched, 0, "{rep}");
    fleet.stop();
}

#[test]
fn conversations_hold_their_turns_and_items() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, true);
    let system = "You are a harbour master. Answer in one short sentence. ".repeat(6);
    let made = fleet.post(
        "/v1/conversations",
        &json!({"items": [{"role": "system", "content": system}], "metadata": {"topic": "harbour"}}),
        &[],
    );
    assert_eq!(made.status, 200, "{}", made.text());
    let conv = made.json();
    let id = conv["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("conv_"), "{conv}");
    assert_eq!(
        (&conv["object"], &conv["metadata"]["topic"]),
        (&json!("conversation"), &json!("harbour"))
    );
    let items = |fleet: &Fleet| -> Vec<serde_json::Value> {
        let r = fleet.get(
            &format!("/v1/conversations/{id}/items?order=asc&limit=100"),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["data"].as_array().unwrap().clone()
    };
    let turn = |fleet: &Fleet, text: &str, stream: bool| {
        let body = json!({"model": "smol", "conversation": id, "input": text,
            "max_output_tokens": 6, "temperature": 0, "stream": stream});
        let r = fleet.post("/v1/responses", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    // Two turns: each adds its input and its output; the second is sent with the first.
    let t1 = turn(&fleet, "Where is the harbour?", false);
    let one = t1.json();
    assert_eq!(one["conversation"], json!({"id": id}), "{one}");
    fleet.wait_indexed(&t1.worker(), 2);
    let next = json!({"model": "smol", "conversation": id, "input": "And the ships?",
        "max_output_tokens": 6, "temperature": 0});
    let counted = fleet.post("/v1/responses/input_tokens", &next, &[]);
    assert_eq!(counted.status, 200, "{}", counted.text());
    let t2 = turn(&fleet, "And the ships?", true);
    assert_eq!(t2.worker(), t1.worker());
    assert_eq!(t2.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    let two = streamed_response(&t2);
    assert_eq!(
        two["usage"]["input_tokens"],
        counted.json()["input_tokens"],
        "{two}"
    );
    assert!(
        two["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 32
    );
    let held = items(&fleet);
    let roles: Vec<&str> = held
        .iter()
        .map(|i| i["role"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "user", "assistant"],
        "{held:?}"
    );
    assert_eq!(held[2]["id"], one["output"][0]["id"]);
    // The conversation is the one sent whole: the same answer.
    let whole = fleet.post(
        "/v1/responses",
        &json!({"model": "smol", "max_output_tokens": 6, "temperature": 0, "input": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Where is the harbour?"},
            {"role": "assistant", "content": output_text(&one)},
            {"role": "user", "content": "And the ships?"}]}),
        &[],
    );
    assert_eq!(output_text(&whole.json()), output_text(&two));
    // Items added, read one by one, deleted; the metadata changed.
    let added = fleet.post(
        &format!("/v1/conversations/{id}/items"),
        &json!({"items": [{"role": "user", "content": "Note: the tide is high."}]}),
        &[],
    );
    assert_eq!(added.status, 200, "{}", added.text());
    let note = added.json()["data"][0]["id"].as_str().unwrap().to_owned();
    let got = fleet.get(&format!("/v1/conversations/{id}/items/{note}"), None);
    assert_eq!(got.json()["content"], "Note: the tide is high.");
    assert_eq!(items(&fleet).len(), 6);
    let r = call(
        &fleet,
        Method::DELETE,
        &format!("/v1/conversations/{id}/items/{note}"),
    );
    assert_eq!(
        (r.status, &r.json()["id"]),
        (200, &json!(id)),
        "{}",
        r.text()
    );
    assert_eq!(items(&fleet).len(), 5);
    let r = fleet.post(
        &format!("/v1/conversations/{id}"),
        &json!({"metadata": {"topic": "ships"}}),
        &[],
    );
    assert_eq!(
        r.json()["metadata"],
        json!({"topic": "ships"}),
        "{}",
        r.text()
    );
    // A background turn appends its items when it ends.
    let r = fleet.post(
        "/v1/responses",
        &json!({"model": "smol", "conversation": id, "input": "Later?", "max_output_tokens": 4,
                "background": true}),
        &[],
    );
    assert_eq!(r.json()["conversation"], json!({"id": id}), "{}", r.text());
    fleet.wait_for(
        "the background turn's items",
        Duration::from_secs(10),
        || items(&fleet).len() == 7,
    );
    let later = items(&fleet);
    let bg = r.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        later[5]["id"],
        json!(format!("item_{}_0", bg.trim_start_matches("resp_")))
    );
    for item in &later[5..] {
        let r = call(
            &fleet,
            Method::DELETE,
            &format!(
                "/v1/conversations/{id}/items/{}",
                item["id"].as_str().unwrap()
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Counted apart from the stored turns.
    let metrics = fleet.metrics();
    let gauge = |name: &str| -> u64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not in\n{metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(gauge("kvgate_gateway_stored_conversations"), 1);
    // The two turns, the conversation sent whole and the background turn are stored; the
    // conversation is not one of them.
    assert_eq!(gauge("kvgate_gateway_stored_responses"), 4);
    // Newest first by default, in pages.
    let page = fleet
        .get(&format!("/v1/conversations/{id}/items?limit=2"), None)
        .json();
    assert_eq!(page["data"][0]["id"], held[4]["id"]);
    assert_eq!(page["has_more"], json!(true));
    // Refusals.
    let code = |r: support::Reply, status: u16, code: &str| {
        assert_eq!(r.status, status, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], code, "{}", r.text());
    };
    code(
        fleet.get("/v1/conversations/conv_none", None),
        404,
        "conversation_not_found",
    );
    code(
        fleet.post(
            "/v1/responses",
            &json!({"model": "smol", "conversation": "conv_none", "input": "x"}),
            &[],
        ),
        404,
        "conversation_not_found",
    );
    code(
        fleet.post(
            "/v1/responses",
            &json!({"model": "smol", "conversation": id, "previous_response_id": one["id"], "input": "x"}),
            &[],
        ),
        400,
        "invalid_value",
    );
    code(
        fleet.get(&format!("/v1/conversations/{id}/items/msg_none"), None),
        404,
        "item_not_found",
    );
    code(
        fleet.get(&format!("/v1/responses/{id}"), None),
        404,
        "response_not_found",
    );
    let many: Vec<serde_json::Value> = (0..21)
        .map(|i| json!({"role": "user", "content": i.to_string()}))
        .collect();
    code(
        fleet.post("/v1/conversations", &json!({"items": many}), &[]),
        400,
        "invalid_value",
    );
    code(
        fleet.post_raw("/v1/conversations", b"[]".to_vec(), &[]),
        400,
        "invalid_json",
    );
    code(
        call(&fleet, Method::PUT, &format!("/v1/conversations/{id}")),
        405,
        "method_not_allowed",
    );
    code(
        call(&fleet, Method::GET, "/v1/conversations"),
        405,
        "method_not_allowed",
    );
    // Deleted: gone, and no turn can be made in it.
    let r = call(&fleet, Method::DELETE, &format!("/v1/conversations/{id}"));
    assert_eq!(
        r.json(),
        json!({"id": id, "object": "conversation.deleted", "deleted": true})
    );
    code(
        fleet.get(&format!("/v1/conversations/{id}"), None),
        404,
        "conversation_not_found",
    );
    let body = json!({"model": "smol", "conversation": id, "input": "x"});
    code(
        fleet.post("/v1/responses", &body, &[]),
        404,
        "conversation_not_found",
    );
    let rep = fleet.audit();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.parity.mismatched, 0, "{rep}");
    fleet.stop();
}

#[test]
fn stored_responses_continue_a_conversation_on_the_worker_holding_it() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, true);
    let first = "Tell me about the history of the lighthouse keepers of the northern coast, \
                 their daily routines, the lamps and lenses they tended, and the storms. "
        .repeat(3);
    let ask = |body: serde_json::Value| fleet.post("/v1/responses", &body, &[]);
    // Turn 1, stored by default.
    let r1 =
        ask(json!({"model": "smol", "input": first, "max_output_tokens": 6, "temperature": 0}));
    assert_eq!(r1.status, 200, "{}", r1.text());
    let (w1, one) = (r1.worker(), r1.json());
    let id1 = one["id"].as_str().unwrap().to_owned();
    // The answer says what the gateway does with it: stored, continuing nothing.
    assert_eq!(one["store"], true, "{one}");
    assert!(one["previous_response_id"].is_null(), "{one}");
    fleet.wait_indexed(&w1, 3);
    let got = fleet.get(&format!("/v1/responses/{id1}"), None);
    assert_eq!(got.status, 200, "{}", got.text());
    let got = got.json();
    assert_eq!(
        (got["id"].as_str(), got["store"].as_bool()),
        (Some(&*id1), Some(true))
    );
    assert!(got["previous_response_id"].is_null());
    assert_eq!(got["output"], one["output"]);

    // Turn 2 names turn 1, streamed: routed as the whole conversation, to the worker that
    // holds turn 1's prefix, which it finds cached.
    let r2 = ask(
        json!({"model": "smol", "previous_response_id": id1, "input": "And then?",
                        "max_output_tokens": 6, "temperature": 0, "stream": true}),
    );
    assert_eq!(r2.status, 200, "{}", r2.text());
    assert_eq!(r2.worker(), w1);
    assert_eq!(r2.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    let two = streamed_response(&r2);
    let id2 = two["id"].as_str().unwrap().to_owned();
    assert_eq!(
        (&two["store"], &two["previous_response_id"]),
        (&json!(true), &json!(id1)),
        "{two}"
    );
    let cached = two["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 32, "cached {cached}");
    // The same conversation sent whole gets the same answer.
    let whole = ask(
        json!({"model": "smol", "max_output_tokens": 6, "temperature": 0, "input": [
        {"role": "user", "content": first},
        {"role": "assistant", "content": output_text(&one)},
        {"role": "user", "content": "And then?"}]}),
    );
    assert_eq!(whole.status, 200, "{}", whole.text());
    assert_eq!(output_text(&whole.json()), output_text(&two));

    // Turn 3 continues the streamed turn 2; its input items are its own.
    let r3 = ask(
        json!({"model": "smol", "previous_response_id": id2, "input": "Third.",
                        "max_output_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r3.status, 200, "{}", r3.text());
    let id3 = r3.json()["id"].as_str().unwrap().to_owned();
    let items = fleet.get(&format!("/v1/responses/{id3}/input_items?order=asc"), None);
    assert_eq!(items.status, 200, "{}", items.text());
    let items = items.json();
    assert_eq!(items["data"].as_array().unwrap().len(), 1, "{items}");
    assert_eq!(items["data"][0]["content"][0]["text"], "Third.");
    assert_eq!(
        fleet.get(&format!("/v1/responses/{id2}"), None).json()["previous_response_id"],
        json!(id1)
    );

    // `store: false` is not kept, and says so — whatever header the client sent to say
    // otherwise (the gateway replaces it). A continuation not stored still names its turn.
    let r = fleet.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "x", "max_output_tokens": 2, "store": false}),
        &[(
            prompt_profile::STORED_HEADER,
            "store=true; previous_response_id=resp_forged",
        )],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (&r.json()["store"], &r.json()["previous_response_id"]),
        (&json!(false), &json!(null))
    );
    let unstored = r.json()["id"].as_str().unwrap().to_owned();
    let r = ask(
        json!({"model": "smol", "previous_response_id": id1, "input": "Aside.",
                       "max_output_tokens": 2, "store": false}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (&r.json()["store"], &r.json()["previous_response_id"]),
        (&json!(false), &json!(id1))
    );
    assert_eq!(
        fleet
            .get(
                &format!("/v1/responses/{}", r.json()["id"].as_str().unwrap()),
                None
            )
            .status,
        404
    );
    let r = fleet.get(&format!("/v1/responses/{unstored}"), None);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "response_not_found");

    // Deleting turn 1 ends the conversation: continuing turn 3 names the missing turn.
    let d = call(&fleet, Method::DELETE, &format!("/v1/responses/{id1}"));
    assert_eq!(d.status, 200, "{}", d.text());
    assert_eq!(d.json()["deleted"], true);
    assert_eq!(
        call(&fleet, Method::DELETE, &format!("/v1/responses/{id1}")).status,
        404
    );
    assert_eq!(fleet.get(&format!("/v1/responses/{id1}"), None).status, 404);
    let r = ask(json!({"model": "smol", "previous_response_id": id3, "input": "Fourth."}));
    assert_eq!(r.status, 400, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["code"], "previous_response_not_found");
    assert_eq!(e["error"]["param"], "previous_response_id");
    assert!(
        e["error"]["message"].as_str().unwrap().contains(&id1),
        "{e}"
    );
    let r = ask(json!({"model": "smol", "previous_response_id": "resp_nope", "input": "x"}));
    assert_eq!(r.json()["error"]["code"], "previous_response_not_found");
    let r = call(&fleet, Method::PUT, &format!("/v1/responses/{id2}"));
    assert_eq!(r.status, 405, "{}", r.text());

    // Over pingora's 64 KiB retry buffer (the gateway's own forwarding path): an item with a
    // large field of its own, stored whole and continued, streamed and not.
    let note = "n".repeat(70_000);
    let big = ask(
        json!({"model": "smol", "max_output_tokens": 3, "temperature": 0,
                         "input": [{"role": "user", "content": "A big one.", "note": note}]}),
    );
    assert_eq!(big.status, 200, "{}", big.text());
    let big_id = big.json()["id"].as_str().unwrap().to_owned();
    let next = ask(
        json!({"model": "smol", "previous_response_id": big_id, "input": "More.",
                          "max_output_tokens": 3, "temperature": 0, "stream": true}),
    );
    assert_eq!(next.status, 200, "{}", next.text());
    let next_id = streamed_response(&next)["id"].as_str().unwrap().to_owned();
    let last = ask(
        json!({"model": "smol", "previous_response_id": next_id, "input": "Last.",
                          "max_output_tokens": 3}),
    );
    assert_eq!(last.status, 200, "{}", last.text());

    let metrics = fleet.metrics();
    let stored = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvgate_gateway_stored_responses "))
        .unwrap_or_else(|| panic!("no stored_responses gauge:\n{metrics}"));
    // Turns 2 and 3, the whole conversation sent at once, the big one and its two
    // continuations (turn 1 was deleted, `store: false` never kept).
    assert_eq!(stored, "6", "{metrics}");
    // Every request receipted; the gateway's prompt of each continued conversation is the
    // worker's, token for token.
    let rep = fleet.audit();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.parity.mismatched, 0, "{rep}");
    fleet.stop();
}

/// The status of the stored response `id` once `done` holds for it (or the deadline passed).
fn poll_response(
    fleet: &Fleet,
    id: &str,
    within: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + within;
    loop {
        let r = fleet.get(&format!("/v1/responses/{id}"), None);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        if done(&v) || std::time::Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `kvgate_worker_running_sequences` of worker `i`.
fn running_sequences(fleet: &Fleet, i: usize) -> f64 {
    let url = format!("http://{}/metrics", fleet.addrs[i]);
    let text = fleet.rt.block_on(async {
        fleet
            .http
            .get(url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    text.lines()
        .find_map(|l| l.strip_prefix("kvgate_worker_running_sequences "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no running_sequences in {text}"))
}

/// `background: true`: answered at once (`queued`), run by the gateway, polled to its answer
/// (the answer a request sent in the foreground gets), continued as a conversation; a long one
/// cancelled while the worker generates stops there and stays `cancelled`; refusals; the audit
/// clean over every background request.
#[test]
fn background_responses_are_polled_continued_and_cancelled() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        // Real step times: a long answer takes seconds, so it can be cancelled mid-way.
        sim: engine::sim::SimConfig::default(),
        ..FleetOptions::default()
    });
    let access = fleet.dir.path().join("access.jsonl");
    let target = gateway::access_log::AccessLogTarget::File(access.clone());
    fleet.start_gateway_with(KV_SERVICE, true, |c| c.access_log = Some(target));
    let question = "Describe the tides of the northern sea and what the harbour masters \
                    wrote about them over the years. "
        .repeat(2);
    let body = json!({"model": "smol", "input": question, "max_output_tokens": 6,
                      "temperature": 0, "metadata": {"job": "a"}});
    let mut bg = body.clone();
    bg["background"] = json!(true);
    let started = std::time::Instant::now();
    let r = fleet.post("/v1/responses", &bg, &[]);
    let accepted = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    let q = r.json();
    assert_eq!(
        (&q["status"], &q["background"], &q["store"], &q["object"]),
        (
            &json!("queued"),
            &json!(true),
            &json!(true),
            &json!("response")
        ),
        "{q}"
    );
    assert_eq!(q["output"], json!([]));
    assert_eq!(q["metadata"], json!({"job": "a"}));
    let id = q["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    // The simulated engine never ends by itself: cut by `max_output_tokens`.
    let done = poll_response(&fleet, &id, Duration::from_secs(20), |v| {
        v["status"] == "incomplete"
    });
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(
        (&done["id"], &done["background"], &done["metadata"]),
        (&json!(id), &json!(true), &json!({"job": "a"}))
    );
    assert_eq!(done["usage"]["output_tokens"], 6, "{done}");
    println!(
        "background: accepted in {:.1} ms, completed {}",
        accepted.as_secs_f64() * 1e3,
        output_text(&done)
    );
    // The answer is the one the same request gets in the foreground.
    let fg = fleet.post("/v1/responses", &body, &[]);
    assert_eq!(fg.status, 200, "{}", fg.text());
    assert_eq!(output_text(&fg.json()), output_text(&done));
    assert_eq!(fg.json()["background"], false);
    // Continued: the conversation's prefix is where the background request left it.
    let next = fleet.post(
        "/v1/responses",
        &json!({"model": "smol", "previous_response_id": id, "input": "And in winter?",
                "max_output_tokens": 4, "temperature": 0}),
        &[],
    );
    assert_eq!(next.status, 200, "{}", next.text());
    assert_eq!(next.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    let cached = next.json()["usage"]["input_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.unwrap_or(0) >= 32, "{}", next.text());

    // A long one: cancelled while its worker generates.
    let mut long = bg.clone();
    long["max_output_tokens"] = json!(3000);
    long["input"] = json!(format!("{question} Go on at length."));
    let r = fleet.post("/v1/responses", &long, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let long_id = r.json()["id"].as_str().unwrap().to_owned();
    let seen = poll_response(&fleet, &long_id, Duration::from_secs(10), |v| {
        v["status"] == "in_progress"
    });
    assert_eq!(seen["status"], "in_progress", "{seen}");
    let workers = 0..fleet.addrs.len();
    fleet.wait_for("the worker generating", Duration::from_secs(10), || {
        workers
            .clone()
            .map(|i| running_sequences(&fleet, i))
            .sum::<f64>()
            >= 1.0
    });
    // Not continued while it runs.
    let r = fleet.post(
        "/v1/responses",
        &json!({"model": "smol", "previous_response_id": long_id, "input": "x"}),
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "previous_response_not_ready");
    let c = call(
        &fleet,
        Method::POST,
        &format!("/v1/responses/{long_id}/cancel"),
    );
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(
        (&c.json()["status"], &c.json()["background"]),
        (&json!("cancelled"), &json!(true))
    );
    let cancelled_at = std::time::Instant::now();
    fleet.wait_for("the worker to stop", Duration::from_secs(5), || {
        workers
            .clone()
            .map(|i| running_sequences(&fleet, i))
            .sum::<f64>()
            == 0.0
    });
    println!(
        "background: the worker stopped {:.0} ms after the cancel",
        cancelled_at.elapsed().as_secs_f64() * 1e3
    );
    std::thread::sleep(Duration::from_millis(300));
    let after = fleet.get(&format!("/v1/responses/{long_id}"), None).json();
    assert_eq!(after["status"], "cancelled", "stays cancelled: {after}");
    // Cancelling again, or a finished one, answers it as it is.
    let again = call(
        &fleet,
        Method::POST,
        &format!("/v1/responses/{long_id}/cancel"),
    );
    assert_eq!(again.json()["status"], "cancelled");
    let finished = call(&fleet, Method::POST, &format!("/v1/responses/{id}/cancel"));
    assert_eq!(finished.json()["status"], "incomplete");

    // A request the worker refuses ends `failed`, with the worker's error.
    let mut bad = bg.clone();
    bad["top_k"] = json!("many");
    let r = fleet.post("/v1/responses", &bad, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let bad_id = r.json()["id"].as_str().unwrap().to_owned();
    let failed = poll_response(&fleet, &bad_id, Duration::from_secs(10), |v| {
        v["status"] == "failed"
    });
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["error"]["code"], "invalid_type", "{failed}");

    // Refusals.
    let fg_id = fg.json()["id"].as_str().unwrap().to_owned();
    let r = call(
        &fleet,
        Method::POST,
        &format!("/v1/responses/{fg_id}/cancel"),
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!("response_not_background"))
    );
    let r = call(&fleet, Method::POST, "/v1/responses/resp_nope/cancel");
    assert_eq!(r.status, 404);
    let r = call(&fleet, Method::GET, &format!("/v1/responses/{id}/cancel"));
    assert_eq!(r.status, 405);
    // A background response is stored.
    let mut unstored = bg.clone();
    unstored["store"] = json!(false);
    let r = fleet.post("/v1/responses", &unstored, &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "background", "{}", r.text());
    // Counted by how they ended.
    let metrics = fleet.metrics();
    for line in [
        "kvgate_gateway_background_responses_ended_total{status=\"incomplete\"} 1",
        "kvgate_gateway_background_responses_ended_total{status=\"cancelled\"} 1",
        "kvgate_gateway_background_responses_ended_total{status=\"failed\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }
    // The access log: the accepting request's line, and the run's when it ended.
    let lines_of = |id: &str| -> Vec<serde_json::Value> {
        let rid = id.trim_start_matches("resp_");
        std::fs::read_to_string(&access)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|l| l["request_id"] == rid)
            .collect()
    };
    fleet.wait_for("the access lines", Duration::from_secs(5), || {
        lines_of(&long_id).len() == 2
    });
    let lines = lines_of(&long_id);
    let (accepted, ran) = match lines[0].get("background") {
        Some(_) => (&lines[1], &lines[0]),
        None => (&lines[0], &lines[1]),
    };
    assert_eq!(
        (&accepted["status"], &accepted["worker"]),
        (&json!(200), &json!(null))
    );
    assert_eq!(
        (&ran["background"], &ran["status"], &ran["error"]),
        (&json!(true), &json!(499), &json!("cancelled")),
        "{ran}"
    );
    // Not streamed: nothing came back before the cancel.
    assert!(
        ran["worker"].is_string() && ran["ttft_ms"].is_null(),
        "{ran}"
    );
    let done_line = lines_of(&id)
        .into_iter()
        .find(|l| l.get("background").is_some());
    let done_line = done_line.expect("the first run's line");
    assert_eq!(done_line["status"], 200, "{done_line}");
    assert!(
        done_line["response_bytes"].as_u64().unwrap() > 0,
        "{done_line}"
    );
    assert!(done_line["ttft_ms"].is_number(), "{done_line}");
    // Deleting a finished background response.
    let d = call(&fleet, Method::DELETE, &format!("/v1/responses/{long_id}"));
    assert_eq!(d.json()["deleted"], true);
    assert_eq!(
        fleet.get(&format!("/v1/responses/{long_id}"), None).status,
        404
    );

    let report = fleet.audit();
    assert!(
        report.discrepancies.is_empty(),
        "audit found discrepancies: {:?}",
        report.discrepancies
    );
    fleet.stop();
}

/// The events of an SSE text: (type, sequence number, the event's JSON).
fn sse_events(text: &str) -> Vec<(String, u64, serde_json::Value)> {
    text.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .map(|v| {
            let kind = v["type"].as_str().unwrap_or("").to_owned();
            (kind, v["sequence_number"].as_u64().unwrap_or(u64::MAX), v)
        })
        .collect()
}

/// The text of the `response.output_text.delta` events.
fn deltas(events: &[(String, u64, serde_json::Value)]) -> String {
    events
        .iter()
        .filter(|(k, _, _)| k == "response.output_text.delta")
        .map(|(_, _, v)| v["delta"].as_str().unwrap().to_owned())
        .collect()
}

/// `background: true` with `stream: true`: the events stream as the worker writes them; a
/// client that goes after a few events resumes with `GET …?stream=true&starting_after=N` and
/// gets every later event, so the two parts make the whole answer; after the end a resume gets
/// the final event; refusals.
#[test]
fn a_streamed_background_response_resumes_after_the_client_goes() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        sim: engine::sim::SimConfig::default(),
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, true);
    let body = json!({"model": "smol", "input": "Tell a long story about the sea. ".repeat(3),
                      "max_output_tokens": 200, "temperature": 0, "background": true,
                      "stream": true});
    // Read the first events, then go.
    let first: Vec<(String, u64, serde_json::Value)> = fleet.rt.block_on(async {
        let mut r = fleet
            .http
            .post(fleet.url("/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        let mut text = String::new();
        loop {
            let chunk = r.chunk().await.unwrap().expect("the stream ended early");
            text.push_str(&String::from_utf8_lossy(&chunk));
            let events = sse_events(&text);
            if deltas(&events).len() >= 10 {
                // Whole events only.
                let whole = text.rfind("\n\n").unwrap();
                return sse_events(&text[..whole]);
            }
        }
    });
    let (kind, seq, created) = &first[0];
    assert_eq!((kind.as_str(), *seq), ("response.created", 0));
    assert_eq!(created["response"]["background"], true, "{created}");
    let id = created["response"]["id"].as_str().unwrap().to_owned();
    for (i, (_, seq, _)) in first.iter().enumerate() {
        assert_eq!(*seq, i as u64, "consecutive");
    }
    let last = first.last().unwrap().1;
    // The job went on without the client: resume after the last event read.
    let rest = fleet.get(
        &format!("/v1/responses/{id}?stream=true&starting_after={last}"),
        None,
    );
    assert_eq!(rest.status, 200, "{}", rest.text());
    let rest = sse_events(&rest.text());
    assert_eq!(rest[0].1, last + 1, "{:?}", rest[0]);
    for w in rest.windows(2) {
        assert_eq!(w[1].1, w[0].1 + 1, "consecutive");
    }
    let (end_kind, _, end) = rest.last().unwrap();
    assert_eq!(end_kind, "response.incomplete", "{end}");
    let answer = output_text(&end["response"]);
    assert_eq!(format!("{}{}", deltas(&first), deltas(&rest)), answer);
    // Stored as any background response.
    let got = fleet.get(&format!("/v1/responses/{id}"), None).json();
    assert_eq!(
        (&got["status"], &got["background"]),
        (&json!("incomplete"), &json!(true))
    );
    assert_eq!(output_text(&got), answer);
    // Resumed after the end (its events are kept a while): every event from the cursor on.
    let r = fleet.get(
        &format!("/v1/responses/{id}?stream=true&starting_after=3"),
        None,
    );
    let events = sse_events(&r.text());
    assert_eq!(events[0].1, 4, "{}", r.text());
    assert_eq!(events.len() as u64, rest.last().unwrap().1 - 3);
    assert_eq!(events.last().unwrap().0, "response.incomplete");
    // A background response not streamed has no events: a stream of it is its final event.
    let mut quiet = body.clone();
    quiet["stream"] = json!(false);
    quiet["max_output_tokens"] = json!(3);
    let q = fleet.post("/v1/responses", &quiet, &[]).json();
    let qid = q["id"].as_str().unwrap();
    let done = poll_response(&fleet, qid, Duration::from_secs(10), |v| {
        v["status"] == "incomplete"
    });
    let r = fleet.get(&format!("/v1/responses/{qid}?stream=true"), None);
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 1, "{}", r.text());
    assert_eq!(
        (events[0].0.as_str(), events[0].1),
        ("response.incomplete", 0)
    );
    assert_eq!(output_text(&events[0].2["response"]), output_text(&done));
    // Refusals: a cursor that is not a number; a stream of a response not made in the
    // background.
    let r = fleet.get(
        &format!("/v1/responses/{id}?stream=true&starting_after=x"),
        None,
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "starting_after");
    let mut fg = body.clone();
    fg["background"] = json!(false);
    fg["stream"] = json!(false);
    fg["max_output_tokens"] = json!(2);
    let fg = fleet.post("/v1/responses", &fg, &[]);
    let fg_id = fg.json()["id"].as_str().unwrap().to_owned();
    let r = fleet.get(&format!("/v1/responses/{fg_id}?stream=true"), None);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "response_not_background");
    let report = fleet.audit();
    assert!(
        report.discrepancies.is_empty(),
        "audit found discrepancies: {:?}",
        report.discrepancies
    );
    fleet.stop();
}

/// `POST /v1/responses/input_tokens`: the count is the create's `usage.input_tokens` — counted
/// by the gateway on kv_exact services, by a worker on a round-robin one — for a first turn, a
/// continued conversation and a truncated one; no worker is asked on kv_exact services.
#[test]
fn input_tokens_count_what_a_create_would_send() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    // kv_exact (its budget enforced, and not), and a round-robin service with no profile.
    let services = format!(
        "{KV_SERVICE}match = {{ models = [\"smol\"] }}\n\n[[services]]\nname = \"off\"\n\
         pool = \"all\"\nmatch = {{ models = [\"smol-off\"] }}\ntoken_budget = \"off\"\n\
         rule = {{ type = \"kv_exact\", profile = \"smol\" }}\n\n[[services]]\nname = \"rr\"\n\
         pool = \"all\"\nmatch = {{ models = [\"smol-rr\"] }}\nrule = {{ type = \"round_robin\" }}\n"
    );
    fleet.start_gateway(&services, true);
    let count = |body: &serde_json::Value| {
        let r = fleet.post("/v1/responses/input_tokens", body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "response.input_tokens", "{v}");
        v["input_tokens"].as_u64().unwrap()
    };
    let used = |r: &support::Reply| {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["input_tokens"].as_u64().unwrap()
    };
    // A first turn, with instructions and a tool: the count is the create's `input_tokens`.
    let tool = json!({"type": "function", "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}});
    let first = json!({"model": "smol", "instructions": "Be brief.", "input": "Where is the harbour?",
        "tools": [tool], "max_output_tokens": 6});
    let counted = count(&first);
    let r = fleet.post("/v1/responses", &first, &[]);
    assert_eq!(counted, used(&r));
    // A continued conversation is counted whole, as the create sends it.
    let id = r.json()["id"].as_str().unwrap().to_owned();
    let next = json!({"model": "smol", "previous_response_id": id, "input": "And the ships?",
        "max_output_tokens": 6});
    let counted_next = count(&next);
    assert!(counted_next > counted, "{counted_next} <= {counted}");
    assert_eq!(counted_next, used(&fleet.post("/v1/responses", &next, &[])));
    // Over the context: counted whole without truncation (a create is refused), and with
    // `truncation: "auto"` the turns kept, on either budget policy.
    let mut input = vec![json!({"role": "system", "content": "You are brief."})];
    for i in 0..80 {
        let turn = format!("Turn {i}: tell me about the harbour and its ships. ").repeat(12);
        input.push(json!({"role": "user", "content": turn}));
        input.push(json!({"role": "assistant", "content": format!("Answer {i}.")}));
    }
    input.push(json!({"role": "user", "content": "And now?"}));
    let long = |model: &str, truncation: &str| {
        json!({"model": model, "input": input,
        "max_output_tokens": 8, "truncation": truncation})
    };
    let limit = fleet.workers[0].as_ref().unwrap().profile().context_limit as u64;
    let whole = count(&long("smol", "disabled"));
    assert!(whole > limit, "{whole} <= {limit}");
    let refused = fleet.post("/v1/responses", &long("smol", "disabled"), &[]);
    assert_eq!(refused.json()["error"]["code"], "context_length_exceeded");
    for model in ["smol", "smol-off"] {
        let kept = count(&long(model, "auto"));
        assert!(
            kept + 8 <= limit && kept < whole,
            "{kept} of {whole}, limit {limit}"
        );
        assert_eq!(
            kept,
            used(&fleet.post("/v1/responses", &long(model, "auto"), &[]))
        );
    }
    println!("input tokens: {counted}, continued {counted_next}, {whole} whole → truncated");
    // What is refused, and how.
    let refused = |body: Vec<u8>, status: u16, code: &str| {
        let r = fleet.post_raw("/v1/responses/input_tokens", body, &[]);
        assert_eq!(r.status, status, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], code, "{}", r.text());
    };
    // A round-robin service (no profile) asks a kvgate worker of its pool: the same count, and
    // the worker's refusals as it answers them; with no worker to ask, 503 (the kv_exact
    // service counts without one).
    let mut on_rr = first.clone();
    on_rr["model"] = json!("smol-rr");
    assert_eq!(count(&on_rr), counted);
    let mut rr_long = long("smol-rr", "auto");
    assert_eq!(count(&rr_long), count(&long("smol", "auto")));
    rr_long["input"] = json!(7);
    refused(serde_json::to_vec(&rr_long).unwrap(), 400, "invalid_type");
    for w in ["w1", "w2"] {
        let r = fleet.admin(Method::POST, &format!("/admin/workers/{w}/cordon"), None);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    refused(
        serde_json::to_vec(&on_rr).unwrap(),
        503,
        "no_healthy_worker",
    );
    assert_eq!(count(&first), counted);
    for w in ["w1", "w2"] {
        fleet.admin(Method::POST, &format!("/admin/workers/{w}/uncordon"), None);
    }
    refused(b"[1, 2]".to_vec(), 400, "invalid_json");
    let gone = json!({"model": "smol", "previous_response_id": "resp_gone", "input": "hi"});
    refused(
        serde_json::to_vec(&gone).unwrap(),
        400,
        "previous_response_not_found",
    );
    let bad = json!({"model": "smol", "input": 7});
    refused(serde_json::to_vec(&bad).unwrap(), 400, "invalid_type");
    let r = fleet.get("/v1/responses/input_tokens", None);
    assert_eq!(r.status, 405, "{}", r.text());
    // Counting asks no worker: the four creates answered are the routed decisions, and their
    // audit (prompt parity included) is clean.
    let report = fleet.audit();
    assert!(
        report.discrepancies.is_empty(),
        "audit found discrepancies: {:?}",
        report.discrepancies
    );
    assert_eq!(report.routed, 4, "{report}");
    assert_eq!(
        (report.parity.compared, report.parity.mismatched),
        (4, 0),
        "{report}"
    );
    fleet.stop();
}

/// `truncation: "auto"` (the Responses API; chat's extension of the same name) through the
/// KV-exact gateway: a conversation over the context is answered, its oldest turns dropped,
/// and the gateway routed on the same truncated prompt the worker ran (the audit's prompt
/// parity); `disabled` is refused with `context_length_exceeded` by the gateway.
#[test]
fn truncation_auto_keeps_a_long_conversation_within_the_context() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, true);
    let turn = |i: usize| format!("Turn {i}: tell me about the harbour and its ships. ").repeat(12);
    let mut input = vec![json!({"role": "system", "content": "You are brief."})];
    for i in 0..80 {
        input.push(json!({"role": "user", "content": turn(i)}));
        input.push(json!({"role": "assistant", "content": format!("Answer {i}.")}));
    }
    input.push(json!({"role": "user", "content": "And now?"}));
    let body = |truncation: &str| json!({"model": "smol", "input": input, "max_output_tokens": 8, "truncation": truncation});
    let refused = fleet.post("/v1/responses", &body("disabled"), &[]);
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(refused.json()["error"]["code"], "context_length_exceeded");
    let r = fleet.post("/v1/responses", &body("auto"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["truncation"], "auto");
    let used = v["usage"]["input_tokens"].as_u64().unwrap();
    let limit = fleet.workers[0].as_ref().unwrap().profile().context_limit as u64;
    assert!(used + 8 <= limit, "{used} + 8 > {limit}");
    println!("truncation auto: {used} input tokens of a {limit}-token context");
    // Chat's extension of the same name.
    let messages = input.clone();
    let c = fleet.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": messages, "max_tokens": 8, "truncation": "auto"}),
        &[],
    );
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(c.json()["usage"]["prompt_tokens"].as_u64(), Some(used));
    let report = fleet.audit();
    assert!(
        report.discrepancies.is_empty(),
        "audit found discrepancies: {:?}",
        report.discrepancies
    );
    // The gateway routed on the turns the workers kept.
    assert_eq!(
        (report.parity.compared, report.parity.mismatched),
        (2, 0),
        "{report}"
    );
    fleet.stop();
}
