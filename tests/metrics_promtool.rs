//! Both servers' `/metrics`, as a Prometheus server scrapes them, pass `promtool check metrics`
//! (the real Prometheus tool; `scripts/setup.sh` installs it into `.cache/tools/bin`), and a
//! scraper that asks for OpenMetrics gets OpenMetrics.

#[path = "gateway_support/mod.rs"]
mod support;

use support::{chat, promtool_check as check, Fleet, FleetOptions, KV_SERVICE};

fn scrape(fleet: &Fleet, url: String, accept: &str) -> (String, String) {
    fleet.rt.block_on(async {
        let r = fleet
            .http
            .get(url)
            .bearer_auth(&fleet.admin_token)
            .header("accept", accept)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
        (ct, r.text().await.unwrap())
    })
}

#[test]
fn gateway_and_worker_metrics_pass_promtool() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    // Traffic, so that every family has samples (counters, histograms, per-worker gauges).
    for i in 0..4 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("metrics {i}"))], 3),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let classic = "text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let (ct, text) = scrape(&fleet, fleet.admin_url("/metrics"), classic);
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    assert!(!text.contains("# EOF"));
    check(&text, "gateway");
    let worker_url = format!("http://{}/metrics", fleet.addrs[0]);
    let (ct, text) = scrape(&fleet, worker_url.clone(), classic);
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    check(&text, "worker");
    // A scraper asking for OpenMetrics gets it.
    let om = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
    let (ct, text) = scrape(&fleet, worker_url, om);
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    assert!(text.ends_with("# EOF\n"));
    let (ct, _) = scrape(&fleet, fleet.admin_url("/metrics"), om);
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    fleet.stop();
}
