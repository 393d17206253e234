//! The drain on SIGTERM/Ctrl-C shared by `kvgate worker` and `kvgate sidecar`
//! (`worker::drain`): the flags, and the sequence signal → drain (a second signal cuts it
//! short) → stop.

use std::future::Future;
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct DrainArgs {
    /// On SIGTERM/Ctrl-C, keep answering for at least this long with `/ready` at 503
    /// (`draining`) so that gateways stop routing here (their health interval, default 1 s),
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

/// Runs `drain` (already holding its durations) for `label`, unless a second signal comes
/// first; reports on stderr.
pub async fn drain_until_done_or_signalled(
    label: &str,
    in_flight: usize,
    timeout: Duration,
    drain: impl Future<Output = worker::DrainReport>,
) {
    eprintln!(
        "{label}: draining ({in_flight} requests in flight; at most {} s, a second signal stops at once)",
        timeout.as_secs()
    );
    tokio::select! {
        report = drain => eprintln!(
            "{label}: drained in {:.1} s, {} requests left in flight",
            report.waited.as_secs_f64(),
            report.in_flight_left
        ),
        _ = super::worker::shutdown_signal() => eprintln!("{label}: second signal: stopping now"),
    }
}
