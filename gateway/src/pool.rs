//! A bounded pool of threads for the routing work that costs CPU in proportion to a request's
//! size — parsing, rendering and tokenizing a KV-exact prompt — so that it never runs on
//! pingora's proxy threads: a few huge prompts cannot stall every other request, and the work
//! waiting is bounded (a full queue is refused at once, `503 gateway_overloaded`).
//!
//! `threads` owned threads take jobs from one multi-consumer channel of `queue` places (each
//! idle thread waits on the channel itself, so a job wakes exactly one thread);
//! [`BlockingPool::run`] hands a job over without blocking (or refuses it) and awaits its
//! answer. A job that panics loses only its own answer; its thread lives on. Dropping the pool
//! closes the channel and joins the threads after the jobs already queued.

use std::sync::Mutex;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// Why a job did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// `queue` jobs are already waiting.
    #[error("the pool's queue is full")]
    Full,
    /// The job panicked, or the pool is shutting down.
    #[error("the job did not complete")]
    Lost,
}

/// The pool; see the module docs.
pub struct BlockingPool {
    tx: async_channel::Sender<Job>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for BlockingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingPool").finish_non_exhaustive()
    }
}

impl BlockingPool {
    /// `threads` (≥ 1) threads named `name`, a queue of `queue` (≥ 1) waiting jobs.
    pub fn new(name: &str, threads: usize, queue: usize) -> std::io::Result<BlockingPool> {
        let (tx, rx) = async_channel::bounded::<Job>(queue.max(1));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    // Ends when the channel is closed and drained.
                    while let Ok(job) = rx.recv_blocking() {
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    tx.close();
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(BlockingPool {
            tx,
            threads: Mutex::new(handles),
        })
    }

    /// Runs `f` on the pool and awaits its result; refuses at once when the queue is full.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        let (otx, orx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = otx.send(f());
        });
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(async_channel::TrySendError::Full(_)) => return Err(PoolError::Full),
            Err(async_channel::TrySendError::Closed(_)) => return Err(PoolError::Lost),
        }
        orx.await.map_err(|_| PoolError::Lost)
    }
}

impl Drop for BlockingPool {
    fn drop(&mut self) {
        self.tx.close();
        if let Ok(mut threads) = self.threads.lock() {
            for t in threads.drain(..) {
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_refuses_when_full_and_survives_panics() {
        let pool = std::sync::Arc::new(BlockingPool::new("t", 1, 1).unwrap());
        assert_eq!(pool.run(|| 2 + 2).await, Ok(4));
        assert_eq!(
            pool.run(|| -> u32 { panic!("job panics") }).await,
            Err(PoolError::Lost)
        );
        assert_eq!(pool.run(|| 5).await, Ok(5), "the thread survived");
        // One running (blocked), one queued: the third is refused at once.
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        let first = tokio::spawn(async move {
            p.run(move || {
                started_tx.send(()).unwrap();
                gate_rx.recv().unwrap();
                1
            })
            .await
        });
        // Let the task hand its job over, then wait until the job runs.
        while started_rx.try_recv().is_err() {
            tokio::task::yield_now().await;
        }
        let p = pool.clone();
        let second = tokio::spawn(async move { p.run(|| 2).await });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.run(|| 3).await, Err(PoolError::Full));
        gate_tx.send(()).unwrap();
        assert_eq!(first.await.unwrap(), Ok(1));
        assert_eq!(second.await.unwrap(), Ok(2));
    }
}
