//! TLS end to end, with a CA and certificates generated in the test (rcgen): the VIP over HTTPS,
//! workers over HTTPS requiring the gateway's client certificate (mTLS), and everything the
//! gateway does with workers going through it — health, the profile contract, the KV event
//! stream (a prefix hit needs it), proxied requests, the >64 KiB forwarding path, streaming.
//! Clients without a certificate, with one from another CA, or speaking plain HTTP get nowhere.

#[path = "gateway_support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{chat, Fleet, FleetOptions, KV_SERVICE};

/// A CA and what it signs, written as PEM files.
struct Pki {
    dir: tempfile::TempDir,
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let ca = params.self_signed(&ca_key).unwrap();
        let pki = Pki {
            dir: tempfile::tempdir().unwrap(),
            ca,
            ca_key,
        };
        std::fs::write(pki.ca_path(), pki.ca.pem()).unwrap();
        pki
    }

    fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A leaf for `127.0.0.1` (server) or a client; returns (cert, key) paths.
    fn leaf(&self, name: &str, client: bool) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let (c, k) = (
            self.dir.path().join(format!("{name}.pem")),
            self.dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

/// A reqwest client trusting `ca`, showing `identity` when given.
fn client(ca: &Path, identity: Option<&(PathBuf, PathBuf)>) -> reqwest::Client {
    let tls = tls::ClientTls {
        ca: Some(ca.to_owned()),
        identity: identity.map(|(cert, key)| tls::Identity {
            cert: cert.clone(),
            key: key.clone(),
        }),
    };
    reqwest::Client::builder()
        .use_preconfigured_tls(tls.client_config().unwrap().unwrap())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

#[test]
fn https_vip_and_mtls_to_workers_carry_the_whole_path() {
    let pki = Pki::new("kvgate");
    let rogue = Pki::new("rogue");
    let worker_cert = pki.leaf("worker", false);
    let vip_cert = pki.leaf("vip", false);
    let gateway_client = pki.leaf("gateway-client", true);
    let rogue_client = rogue.leaf("intruder", true);

    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        worker_tls: Some(tls::ServerTls {
            cert: worker_cert.0.clone(),
            key: worker_cert.1.clone(),
            client_ca: Some(pki.ca_path()),
        }),
        ..FleetOptions::default()
    });
    let (ca, ident) = (pki.ca_path(), gateway_client.clone());
    let vip = vip_cert.clone();
    fleet.start_gateway_with(KV_SERVICE, false, move |cfg| {
        cfg.tls = Some(tls::ServerTls {
            cert: vip.0,
            key: vip.1,
            client_ca: None,
        });
        cfg.upstream_tls = tls::ClientTls {
            ca: Some(ca),
            identity: Some(tls::Identity {
                cert: ident.0,
                key: ident.1,
            }),
        };
    });
    let https = client(&pki.ca_path(), None);
    let vip_url = |path: &str| format!("https://127.0.0.1:{}{path}", fleet.gw().listen_addr.port());
    let post = |body: &serde_json::Value| {
        fleet.rt.block_on(async {
            let r = https
                .post(vip_url("/v1/chat/completions"))
                .json(body)
                .send()
                .await
                .unwrap();
            support::Reply::read(r).await
        })
    };

    // Through the HTTPS VIP to an mTLS worker: served, then a prefix hit once the worker's KV
    // events (an mTLS stream of their own) reached the index.
    let system = format!("TLS system prompt. {}", "Keep it short. ".repeat(20));
    let body = chat(&[("system", &system), ("user", "hi")], 2);
    let first = post(&body);
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(first.header("x-kvgate-receipt").is_some());
    let w = first.worker();
    fleet.wait_indexed(&w, 2);
    let second = post(&body);
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.worker(), w);
    assert_eq!(
        second.header("x-kvgate-route-reason").as_deref(),
        Some("hit")
    );
    assert!(second.cached_tokens() > 0);

    // The forwarding path for bodies over 64 KiB connects with the same TLS settings.
    // (JSON whitespace pads the body: the prompt stays small.)
    let pad = " ".repeat(100 * 1024);
    let big = format!(
        r#"{{"model":"smol",{pad}"messages":[{{"role":"user","content":"a big body"}}],"max_tokens":2}}"#
    );
    let r = fleet.rt.block_on(async {
        let r = https
            .post(vip_url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(big)
            .send()
            .await
            .unwrap();
        support::Reply::read(r).await
    });
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("x-kvgate-receipt").is_some());

    // Streaming over TLS both ways.
    let mut streamed = chat(&[("user", "stream please")], 4);
    streamed["stream"] = serde_json::json!(true);
    let r = post(&streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("data: [DONE]"), "{}", r.text());

    // Plain HTTP to the HTTPS VIP gets no answer.
    let plain = fleet.rt.block_on(async {
        reqwest::Client::new()
            .post(format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                fleet.gw().listen_addr.port()
            ))
            .json(&body)
            .timeout(Duration::from_secs(5))
            .send()
            .await
    });
    assert!(
        plain.map_or(true, |r| !r.status().is_success()),
        "plain HTTP was served by the TLS VIP"
    );

    // Straight to a worker: only a certificate of the fleet's CA gets through.
    let worker_url = format!("https://{}/ready", fleet.addrs[0]);
    let get = |c: &reqwest::Client| {
        fleet
            .rt
            .block_on(async { c.get(&worker_url).send().await.map(|r| r.status().as_u16()) })
    };
    assert_eq!(
        get(&client(&pki.ca_path(), Some(&gateway_client))).unwrap(),
        200
    );
    assert!(
        get(&client(&pki.ca_path(), None)).is_err(),
        "a client without a certificate reached the worker"
    );
    assert!(
        get(&client(&pki.ca_path(), Some(&rogue_client))).is_err(),
        "a certificate of another CA reached the worker"
    );
    let plain = fleet.rt.block_on(async {
        reqwest::Client::new()
            .get(format!("http://{}/ready", fleet.addrs[0]))
            .timeout(Duration::from_secs(5))
            .send()
            .await
    });
    assert!(plain.is_err(), "plain HTTP reached the TLS worker");
    fleet.stop();
}

#[test]
fn bad_tls_material_stops_the_start_with_the_file_named() {
    let pki = Pki::new("kvgate");
    let (cert, _key) = pki.leaf("vip", false);
    let missing = pki.dir.path().join("missing.key");
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "").unwrap();
    let mut cfg = gateway::GatewayConfig::new(&rules, receipts::KeyPair::generate());
    cfg.tls = Some(tls::ServerTls {
        cert: cert.clone(),
        key: missing.clone(),
        client_ca: None,
    });
    let e = gateway::spawn(cfg).err().expect("the gateway started");
    assert!(e.to_string().contains("missing.key"), "{e}");
    // A client certificate without a CA to trust the workers with is refused too.
    let mut cfg = gateway::GatewayConfig::new(&rules, receipts::KeyPair::generate());
    cfg.upstream_tls = tls::ClientTls {
        ca: None,
        identity: Some(tls::Identity {
            cert: cert.clone(),
            key: cert,
        }),
    };
    let e = gateway::spawn(cfg).err().expect("the gateway started");
    assert!(e.to_string().contains("upstream TLS"), "{e}");
    // The admin plane's material is checked the same way, and named as its own.
    let mut cfg = gateway::GatewayConfig::new(&rules, receipts::KeyPair::generate());
    cfg.admin_tls = Some(tls::ServerTls {
        cert: pki.leaf("admin", false).0,
        key: missing,
        client_ca: None,
    });
    let e = gateway::spawn(cfg).err().expect("the gateway started");
    assert!(
        e.to_string().contains("admin TLS") && e.to_string().contains("missing.key"),
        "{e}"
    );
}

/// The admin plane over HTTPS with client certificates required (`--admin-tls-cert`,
/// `--admin-tls-key`, `--admin-tls-client-ca`): an operator's certificate of the fleet's CA
/// gets `/ready` and, with the token, the admin API; no certificate, another CA's, or plain
/// HTTP get nowhere. The VIP stays plain HTTP and keeps serving.
#[test]
fn the_admin_plane_serves_https_with_client_certificates() {
    let pki = Pki::new("kvgate");
    let rogue = Pki::new("rogue");
    let admin_cert = pki.leaf("admin", false);
    let operator = pki.leaf("operator", true);
    let intruder = rogue.leaf("intruder", true);
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    let (cert, ca) = (admin_cert.clone(), pki.ca_path());
    fleet.start_gateway_with(support::RR_SERVICE, false, move |cfg| {
        cfg.admin_tls = Some(tls::ServerTls {
            cert: cert.0,
            key: cert.1,
            client_ca: Some(ca),
        });
    });
    let port = fleet.gw().admin_addr.port();
    let get = |c: &reqwest::Client, path: &str, token: bool| {
        let url = format!("https://127.0.0.1:{port}{path}");
        fleet.rt.block_on(async {
            let mut r = c.get(url);
            if token {
                r = r.bearer_auth(&fleet.admin_token);
            }
            r.send().await.map(|r| r.status().as_u16())
        })
    };
    let ok = client(&pki.ca_path(), Some(&operator));
    assert_eq!(get(&ok, "/ready", false).unwrap(), 200);
    assert_eq!(get(&ok, "/admin/workers", true).unwrap(), 200);
    assert_eq!(get(&ok, "/admin/workers", false).unwrap(), 401);
    assert!(
        get(&client(&pki.ca_path(), None), "/ready", false).is_err(),
        "a client without a certificate reached the admin plane"
    );
    assert!(
        get(&client(&pki.ca_path(), Some(&intruder)), "/ready", false).is_err(),
        "a certificate of another CA reached the admin plane"
    );
    let plain = fleet.rt.block_on(async {
        reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}/ready"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
    });
    assert!(
        plain.map_or(true, |r| !r.status().is_success()),
        "plain HTTP was served by the TLS admin plane"
    );
    let r = fleet.post("/v1/chat/completions", &chat(&[("user", "hi")], 2), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    fleet.stop();
}
