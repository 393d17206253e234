//! The floor of the proxy path: pingora with nothing of kvgate in it — the same `ServerConf`
//! (threads, keepalive pool) and allocator as the gateway, one upstream, `upstream_peer` only (no body
//! buffering, no ticket, no metrics, no decision log). `scripts/bench-proxy.sh` runs it beside
//! the gateway to separate pingora's own cost per request from what kvgate adds.
//!
//!     cargo run --example pingora_floor -- LISTEN UPSTREAM [THREADS]
//!     cargo run --example pingora_floor -- 127.0.0.1:8090 127.0.0.1:8101 2

use async_trait::async_trait;
use pingora::prelude::{HttpPeer, ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::server::Server;

/// The gateway binary's allocator, so that the two differ only in what kvgate does per request.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Floor {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Floor {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: pingora_floor LISTEN UPSTREAM [THREADS]");
        std::process::exit(2);
    }
    let threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(2);
    let mut conf = ServerConf {
        threads,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(0),
        ..ServerConf::default()
    };
    conf.upstream_keepalive_pool_size = 256;
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service_with_name(
        &server.configuration,
        Floor {
            upstream: args[2].clone(),
        },
        "pingora-floor",
    );
    proxy.add_tcp(&args[1]);
    server.add_service(proxy);
    server.run_forever();
}
