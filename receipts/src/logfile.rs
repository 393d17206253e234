//! The append-only JSON Lines file under both logs: fsync policy, the owned background flusher,
//! and crash recovery of a torn last line.
//!
//! Every append is one `write(2)` of `line + "\n"` to a file opened with `O_APPEND`, so the bytes
//! are in the kernel's page cache (and survive a `kill -9` of the process) when `append` returns;
//! the fsync policy decides when they are forced to stable storage (surviving power loss).
//! A crash in the middle of a `write` can leave a last line without its newline: a *torn* line.
//! [`recover`] finds it, saves its bytes beside the log (`<log>.torn-<offset>`) and truncates the
//! log to the end of the last complete line, so no complete line is ever lost.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::error::{ReceiptsError, Result};

/// When appended lines are forced to stable storage (`fdatasync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// `fdatasync` before every `append` returns: nothing acknowledged is ever lost. The default.
    #[default]
    Always,
    /// `fdatasync` once `max_receipts` lines are pending (inside that `append`), or when the oldest
    /// pending line is `max_ms` old (by an owned background flusher thread), whichever is first. On
    /// power loss at most `max_receipts` lines / `max_ms` of lines are lost; on a process crash
    /// nothing is lost (the kernel holds the written bytes).
    Batched {
        /// Pending lines that trigger a sync inside `append` (>= 1).
        max_receipts: u32,
        /// Age of the oldest pending line that triggers a background sync (>= 1).
        max_ms: u64,
    },
}

/// A torn last line found (and removed) when a log was opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TornTail {
    /// 1-based line number of the torn line.
    pub line: u64,
    /// Byte offset where it started (the log now ends here).
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where its bytes were saved for inspection.
    pub saved_to: Option<PathBuf>,
}

/// The result of [`scan`]: length of the complete lines, and the torn tail (offset, bytes).
pub(crate) type Scanned = (u64, Option<(u64, Vec<u8>)>);

/// Read every complete line of `path`, calling `each(line_no, offset, bytes_without_newline)`.
/// Returns the byte length of the complete lines and the torn tail (start offset, bytes) if the
/// file does not end with a newline. O(file size).
pub(crate) fn scan(
    path: &Path,
    mut each: impl FnMut(u64, u64, &[u8]) -> Result<()>,
) -> Result<Scanned> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, None)),
        Err(e) => return Err(ReceiptsError::io("open", path, e)),
    };
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let mut buf = Vec::with_capacity(1024);
    let mut offset = 0u64;
    let mut line_no = 0u64;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| ReceiptsError::io("read", path, e))?;
        if n == 0 {
            return Ok((offset, None));
        }
        line_no += 1;
        if buf.last() != Some(&b'\n') {
            return Ok((offset, Some((offset, std::mem::take(&mut buf)))));
        }
        each(line_no, offset, &buf[..n - 1])?;
        offset += n as u64;
    }
}

/// Truncate a torn tail found by [`scan`], saving its bytes beside the log first.
pub(crate) fn cut_torn_tail(
    path: &Path,
    valid_len: u64,
    line: u64,
    torn: &[u8],
) -> Result<TornTail> {
    let saved = PathBuf::from(format!("{}.torn-{valid_len}", path.display()));
    let saved_to = match std::fs::write(&saved, torn) {
        Ok(()) => Some(saved),
        Err(_) => None,
    };
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| ReceiptsError::io("open", path, e))?;
    f.set_len(valid_len)
        .map_err(|e| ReceiptsError::io("truncate", path, e))?;
    f.sync_all()
        .map_err(|e| ReceiptsError::io("fsync", path, e))?;
    Ok(TornTail {
        line,
        offset: valid_len,
        len: torn.len() as u64,
        saved_to,
    })
}

struct State {
    file: File,
    len: u64,
    pending: u32,
    first_pending_at: Option<Instant>,
    sync_error: Option<String>,
    shutdown: bool,
}

struct Shared {
    path: PathBuf,
    state: Mutex<State>,
    wake: Condvar,
    /// A second handle on the same open file, used to sync outside the state lock.
    sync_file: File,
}

impl Shared {
    fn sync(&self) -> Result<()> {
        self.sync_file
            .sync_data()
            .map_err(|e| ReceiptsError::io("fsync", &self.path, e))
    }
}

/// A thread-safe appender of lines to one file under an [`FsyncPolicy`].
pub(crate) struct Appender {
    shared: Arc<Shared>,
    policy: FsyncPolicy,
    flusher: Option<JoinHandle<()>>,
}

impl Appender {
    /// Open (create) `path` for appending; `len` is its current (recovered) length.
    pub(crate) fn open(path: &Path, policy: FsyncPolicy) -> Result<Appender> {
        if let FsyncPolicy::Batched {
            max_receipts,
            max_ms,
        } = policy
        {
            if max_receipts == 0 || max_ms == 0 {
                return Err(ReceiptsError::Malformed {
                    what: "fsync policy",
                    detail: "batched max_receipts and max_ms must be >= 1".into(),
                });
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| ReceiptsError::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| ReceiptsError::io("stat", path, e))?
            .len();
        let sync_file = file
            .try_clone()
            .map_err(|e| ReceiptsError::io("dup", path, e))?;
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            state: Mutex::new(State {
                file,
                len,
                pending: 0,
                first_pending_at: None,
                sync_error: None,
                shutdown: false,
            }),
            wake: Condvar::new(),
            sync_file,
        });
        let flusher = match policy {
            FsyncPolicy::Always => None,
            FsyncPolicy::Batched { max_ms, .. } => {
                let s = Arc::clone(&shared);
                let period = Duration::from_millis(max_ms);
                let handle = std::thread::Builder::new()
                    .name("receipts-fsync".into())
                    .spawn(move || flusher_loop(&s, period))
                    .map_err(|e| ReceiptsError::io("spawn flusher for", path, e))?;
                Some(handle)
            }
        };
        Ok(Appender {
            shared,
            policy,
            flusher,
        })
    }

    /// Append `line` plus a newline; returns the line's byte offset. The caller serializes calls
    /// that must keep an order (the receipt chain holds its own lock around this).
    pub(crate) fn append(&self, line: &[u8]) -> Result<u64> {
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line);
        buf.push(b'\n');
        let mut st = self.shared.state.lock();
        if let Some(e) = st.sync_error.take() {
            return Err(ReceiptsError::io(
                "background fsync of",
                &self.shared.path,
                std::io::Error::other(e),
            ));
        }
        let offset = st.len;
        if let Err(e) = st.file.write_all(&buf) {
            // A partial write leaves a torn line; cut it so later appends stay line-aligned.
            let _ = st.file.set_len(offset);
            return Err(ReceiptsError::io("write", &self.shared.path, e));
        }
        st.len += buf.len() as u64;
        match self.policy {
            FsyncPolicy::Always => {
                st.file
                    .sync_data()
                    .map_err(|e| ReceiptsError::io("fsync", &self.shared.path, e))?;
            }
            FsyncPolicy::Batched { max_receipts, .. } => {
                st.pending += 1;
                if st.pending >= max_receipts {
                    st.pending = 0;
                    st.first_pending_at = None;
                    st.file
                        .sync_data()
                        .map_err(|e| ReceiptsError::io("fsync", &self.shared.path, e))?;
                } else if st.first_pending_at.is_none() {
                    st.first_pending_at = Some(Instant::now());
                    self.shared.wake.notify_one();
                }
            }
        }
        Ok(offset)
    }

    /// Force everything written so far to stable storage.
    pub(crate) fn sync(&self) -> Result<()> {
        {
            let mut st = self.shared.state.lock();
            st.pending = 0;
            st.first_pending_at = None;
        }
        self.shared.sync()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.shared.path
    }
}

fn flusher_loop(shared: &Shared, max_age: Duration) {
    let mut st = shared.state.lock();
    loop {
        if st.shutdown {
            break;
        }
        match st.first_pending_at {
            None => shared.wake.wait(&mut st),
            Some(t) => {
                let deadline = t + max_age;
                if Instant::now() >= deadline {
                    st.pending = 0;
                    st.first_pending_at = None;
                    drop(st);
                    let res = shared.sync();
                    st = shared.state.lock();
                    if let Err(e) = res {
                        st.sync_error = Some(e.to_string());
                    }
                } else {
                    let _ = shared.wake.wait_until(&mut st, deadline);
                }
            }
        }
    }
}

impl Drop for Appender {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock();
            st.shutdown = true;
            self.shared.wake.notify_all();
        }
        if let Some(h) = self.flusher.take() {
            let _ = h.join();
        }
        // Final sync so that a clean shutdown never loses a batched line.
        let _ = self.shared.sync();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_reports_torn_tail_and_cut_keeps_complete_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        std::fs::write(&p, b"{\"a\":1}\n{\"b\":2}\n{\"c\":").unwrap();
        let mut seen = Vec::new();
        let (len, torn) = scan(&p, |n, off, l| {
            seen.push((n, off, l.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1], (2, 8, b"{\"b\":2}".to_vec()));
        assert_eq!(len, 16);
        let (off, bytes) = torn.unwrap();
        assert_eq!((off, bytes.as_slice()), (16, &b"{\"c\":"[..]));
        let t = cut_torn_tail(&p, len, 3, &bytes).unwrap();
        assert_eq!(t.line, 3);
        assert_eq!(std::fs::read(&p).unwrap(), b"{\"a\":1}\n{\"b\":2}\n");
        assert_eq!(std::fs::read(t.saved_to.unwrap()).unwrap(), b"{\"c\":");
    }

    #[test]
    fn batched_flusher_syncs_by_age_and_stops_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        let a = Appender::open(
            &p,
            FsyncPolicy::Batched {
                max_receipts: 1000,
                max_ms: 2,
            },
        )
        .unwrap();
        a.append(b"one").unwrap();
        // Wait for the event (the flusher clearing the pending batch), bounded.
        let start = Instant::now();
        loop {
            if a.shared.state.lock().first_pending_at.is_none() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "flusher never ran"
            );
            std::thread::yield_now();
        }
        a.append(b"two").unwrap();
        drop(a); // joins the flusher
        assert_eq!(std::fs::read(&p).unwrap(), b"one\ntwo\n");
    }

    #[test]
    fn batched_rejects_zero_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        let r = Appender::open(
            &p,
            FsyncPolicy::Batched {
                max_receipts: 0,
                max_ms: 5,
            },
        );
        assert!(r.is_err());
    }
}
