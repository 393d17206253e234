//! `kvgate worker` and `kvgate gateway` stopped by a signal, with the real binaries (a
//! simulated engine, the default model's prompt profile): SIGTERM drains — `/ready` answers 503
//! `draining`, an open stream finishes with `[DONE]`, the process exits 0 once nothing is in
//! flight after the grace — and a second SIGTERM during a worker's drain stops at once, ending
//! the stream with `engine_stopped`. Also the processes' memory setting: the gateway runs with
//! transparent huge pages off unless told to keep them, the worker keeps them.

#[path = "gateway_support/mod.rs"]
mod support;

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use support::free_port;

/// A `kvgate` process; killed when dropped.
struct Worker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Worker {
    /// A simulated worker with 10 ms decode steps and the given drain settings.
    fn start(grace_ms: u64, timeout_secs: u64) -> Worker {
        Worker::start_trusting(grace_ms, timeout_secs, None)
    }

    /// [`Worker::start`], trusting the gateway keys in `keys` for route tickets.
    fn start_trusting(grace_ms: u64, timeout_secs: u64, keys: Option<&Path>) -> Worker {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
        cmd.args(["worker", "--engine", "sim", "--id", "w1"]);
        if let Some(k) = keys {
            cmd.arg("--gateway-keys").arg(k);
        }
        let child = cmd
            .arg("--model")
            .arg(support::model_path())
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(dir.path())
            .args(["--sim-decode-us-base", "10000"])
            .args(["--drain-grace-ms", &grace_ms.to_string()])
            .args(["--drain-timeout-secs", &timeout_secs.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvgate worker");
        Worker {
            child,
            port,
            _dir: dir,
        }
    }

    /// A round-robin gateway in front of `worker` (health probes every 100 ms) signing with
    /// `dir`'s `gateway.key` ([`keygen`]); its admin plane (`/ready`) on `admin`.
    fn gateway(worker: &Worker, dir: tempfile::TempDir, admin: u16, grace_ms: u64) -> Worker {
        Worker::gateway_with(worker, dir, admin, grace_ms, &[])
    }

    /// [`Worker::gateway`] with `extra` arguments.
    fn gateway_with(
        worker: &Worker,
        dir: tempfile::TempDir,
        admin: u16,
        grace_ms: u64,
        extra: &[&str],
    ) -> Worker {
        let port = free_port();
        let rules = format!(
            "[gateway]\nhealth_interval_ms = 100\n\n[[workers]]\nid = \"w1\"\nurl = \"http://127.0.0.1:{}\"\n\n\
             [[pools]]\nid = \"all\"\nworkers = [\"w1\"]\n\n[[services]]\nname = \"chat\"\npool = \"all\"\n\
             rule = {{ type = \"round_robin\" }}\n",
            worker.port
        );
        std::fs::write(dir.path().join("rules.toml"), rules).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["gateway", "--no-watch", "--rules"])
            .arg(dir.path().join("rules.toml"))
            .arg("--key")
            .arg(dir.path().join("gateway.key"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args(["--drain-grace-ms", &grace_ms.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvgate gateway");
        Worker {
            child,
            port,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn term(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM");
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let end = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < end,
                "the worker did not exit in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A directory holding a new gateway key pair (`gateway.key`, `gateway.pub`).
fn keygen() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ok = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["keygen", "--name", "gateway", "--out"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kvgate keygen");
    dir
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `/ready` answers `status`; returns its body.
async fn ready(http: &reqwest::Client, w: &Worker, status: u16) -> serde_json::Value {
    ready_at(http, &w.url("/ready"), status).await
}

/// Waits until `url` answers `status`; returns its body.
async fn ready_at(http: &reqwest::Client, url: &str, status: u16) -> serde_json::Value {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = http.get(url).send().await {
            if r.status().as_u16() == status {
                return r.json().await.unwrap();
            }
        }
        assert!(Instant::now() < end, "/ready never answered {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Opens a streamed chat completion of `max_tokens` and reads its first chunk.
async fn open_stream(http: &reqwest::Client, w: &Worker, max_tokens: u64) -> reqwest::Response {
    let body = serde_json::json!({"model": "m", "max_tokens": max_tokens, "stream": true,
        "messages": [{"role": "user", "content": "Tell me about lighthouses."}]});
    let mut resp = http
        .post(w.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.chunk().await.unwrap().is_some());
    resp
}

async fn rest_of(mut resp: reqwest::Response) -> String {
    let mut out = Vec::new();
    while let Ok(Some(c)) = resp.chunk().await {
        out.extend_from_slice(&c);
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn sigterm_drains_open_streams_then_exits() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut w = Worker::start(300, 30);
    let http = reqwest::Client::new();
    rt.block_on(async {
        ready(&http, &w, 200).await;
        // ~1.5 s of decode left when the signal comes.
        let stream = open_stream(&http, &w, 150).await;
        w.term();
        let body = ready(&http, &w, 503).await;
        assert!(
            body["reason"].as_str().unwrap().starts_with("draining"),
            "{body}"
        );
        let rest = rest_of(stream).await;
        assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
        assert!(!rest.contains("engine_stopped"), "{rest}");
    });
    let status = w.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_second_sigterm_stops_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut w = Worker::start(300, 60);
    let http = reqwest::Client::new();
    let started = Instant::now();
    rt.block_on(async {
        ready(&http, &w, 200).await;
        // 20 s of decode, far longer than the test waits: only the second signal can end it.
        let stream = open_stream(&http, &w, 2000).await;
        w.term();
        ready(&http, &w, 503).await;
        w.term();
        let rest = rest_of(stream).await;
        assert!(rest.contains("engine_stopped"), "{rest}");
    });
    let status = w.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(40));
}

/// A gateway replica taken out of a VIP: on SIGTERM its admin `/ready` (no token needed, as a
/// VIP's health check has none) answers 503 `draining`, the stream it proxies finishes with
/// `[DONE]`, and it exits 0 once nothing is in flight after the grace.
#[test]
fn sigterm_drains_the_gateway_too() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let keys = keygen();
    let worker = Worker::start_trusting(300, 30, Some(keys.path()));
    let admin = free_port();
    let mut gw = Worker::gateway(&worker, keys, admin, 300);
    let http = reqwest::Client::new();
    let gw_ready = format!("http://127.0.0.1:{admin}/ready");
    rt.block_on(async {
        ready(&http, &worker, 200).await;
        assert_eq!(ready_at(&http, &gw_ready, 200).await["ready"], true);
        // The gateway has seen the worker healthy once a request through it succeeds.
        let end = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            // Greedy: the simulated model never picks a stop token then, so the stream lasts.
            let body = serde_json::json!({"model": "m", "max_tokens": 150, "stream": true, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about lighthouses."}]});
            let mut r = http
                .post(gw.url("/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                assert!(r.chunk().await.unwrap().is_some());
                break r;
            }
            assert!(
                Instant::now() < end,
                "no answer through the gateway: {}",
                r.status()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        gw.term();
        let body = ready_at(&http, &gw_ready, 503).await;
        assert!(
            body["reason"].as_str().unwrap().starts_with("draining"),
            "{body}"
        );
        // A request that still arrives is answered, and its connection closed after it
        // (`Connection: close`): the client's next one goes through the VIP again.
        let body = serde_json::json!({"model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "still here?"}]});
        let late = http
            .post(gw.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(late.status(), 200);
        assert_eq!(
            late.headers().get("connection").map(|v| v.as_bytes()),
            Some(&b"close"[..]),
            "{:?}",
            late.headers()
        );
        let rest = rest_of(stream).await;
        assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    });
    let status = gw.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
}

/// `THP_enabled` of a running process (`/proc/<pid>/status`: 0 once it turned transparent huge
/// pages off for itself); `None` on a kernel that does not show it.
fn thp_enabled(child: &Child) -> Option<u8> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The gateway turns transparent huge pages off for its process by the time it is ready
/// (docs/gateway.md, "Memory"); `--transparent-huge-pages` keeps them; the worker keeps them.
#[test]
fn the_gateway_turns_transparent_huge_pages_off() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let worker = Worker::start(0, 5);
    let http = reqwest::Client::new();
    let (admin_off, admin_kept) = (free_port(), free_port());
    let off = Worker::gateway(&worker, keygen(), admin_off, 0);
    let kept = Worker::gateway_with(
        &worker,
        keygen(),
        admin_kept,
        0,
        &["--transparent-huge-pages"],
    );
    rt.block_on(async {
        ready(&http, &worker, 200).await;
        for admin in [admin_off, admin_kept] {
            ready_at(&http, &format!("http://127.0.0.1:{admin}/ready"), 200).await;
        }
    });
    let Some(worker_thp) = thp_enabled(&worker.child) else {
        eprintln!("skipped: this kernel's /proc/<pid>/status has no THP_enabled line");
        return;
    };
    assert_eq!(worker_thp, 1, "the worker keeps huge pages");
    assert_eq!(
        thp_enabled(&off.child),
        Some(0),
        "the gateway turns them off"
    );
    assert_eq!(
        thp_enabled(&kept.child),
        Some(1),
        "--transparent-huge-pages keeps them"
    );
}
