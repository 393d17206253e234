//! How `kvgate gateway`, `kvgate worker` and `kvgate sidecar` stop: the stop signal
//! (SIGTERM or Ctrl-C), the drain flags (the `drain` crate), and the sequence signal → drain (a
//! second signal cuts it short) → stop.

use std::future::Future;
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct DrainArgs {
    /// On SIGTERM/Ctrl-C, keep answering for at least this long with `/ready` at 503
    /// (`draining`) so that whatever routes here stops (a gateway probes a worker's `/ready`
    /// every `health_interval_ms`, default 1 s; a VIP probes a gateway's on its own schedule),
    /// then stop once no request is in flight, ms.
    #[arg(long, default_value_t = 2000)]
    pub drain_grace_ms: u64,
    /// The longest a drain waits for requests in flight before the stop ends them, s
    /// (0: no drain, stop at once). A second SIGTERM/Ctrl-C stops at once.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_secs: u64,
}

impl DrainArgs {
    /// (grace, timeout); `None` when draining is off.
    pub fn durations(&self) -> Option<(Duration, Duration)> {
        (self.drain_timeout_secs > 0).then(|| {
            (
                Duration::from_millis(self.drain_grace_ms),
                Duration::from_secs(self.drain_timeout_secs),
            )
        })
    }
}

/// After the stop signal: runs `drain(grace, timeout)` for `label` (whose server has
/// `in_flight` requests now) when `args` asks for a drain, unless a second signal comes first;
/// reports on stderr.
pub async fn drain_unless_signalled<F>(
    label: &str,
    args: &DrainArgs,
    in_flight: usize,
    drain: impl FnOnce(Duration, Duration) -> F,
) where
    F: Future<Output = drain::DrainReport>,
{
    let Some((grace, timeout)) = args.durations() else {
        return;
    };
    eprintln!(
        "{label}: draining ({in_flight} requests in flight; at most {} s, a second signal stops at once)",
        timeout.as_secs()
    );
    tokio::select! {
        report = drain(grace, timeout) => eprintln!(
            "{label}: drained in {:.1} s, {} requests left in flight",
            report.waited.as_secs_f64(),
            report.in_flight_left
        ),
        _ = signal() => eprintln!("{label}: second signal: stopping now"),
    }
}

/// Ctrl-C or SIGTERM.
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
