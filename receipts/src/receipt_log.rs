//! The worker's receipt log: append-only JSON Lines, one signed receipt per line, hash-chained.
//!
//! [`ReceiptLog::open`] resumes an existing log: it reads every line (O(file size)), checks the
//! sequence numbers and the hash chain, rebuilds the request-id index, and removes a torn last
//! line left by a crash (reported in [`ReceiptLog::open_report`]). Signatures are not re-checked
//! on open; `kvgate receipts verify` does that. [`ReceiptLog::append`] is `&self` and
//! thread-safe: one lock orders sequence number, chain hash and write. [`ReceiptLog::get`] is an
//! O(1) index lookup plus one positioned read.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use prefix_index::WorkerId;

use crate::error::{ReceiptsError, Result};
use crate::keys::KeyPair;
use crate::logfile::{cut_torn_tail, scan, Appender, FsyncPolicy, TornTail};
use crate::receipt::{Receipt, ReceiptDraft, GENESIS_HASH};
use crate::ticket::RouteTicket;

/// What [`ReceiptLog::open`] found in an existing log.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpenReport {
    /// Complete receipts already in the log.
    pub receipts: u64,
    /// A torn last line that was removed (its bytes saved beside the log).
    pub torn_tail: Option<TornTail>,
    /// The tickets of the log's receipts that may still be inside their validity window
    /// (`expires_at_ms + LIVE_TICKET_MARGIN_MS ≥` the time of opening): a worker seeds its
    /// replay guard with them, so a ticket it accepted before a restart stays used.
    pub live_tickets: Vec<RouteTicket>,
}

/// How long after a ticket's `expires_at_ms` [`OpenReport::live_tickets`] still lists it: more
/// than any clock skew a worker tolerates (its default is 5 s).
pub const LIVE_TICKET_MARGIN_MS: u64 = 10 * 60 * 1000;

struct Chain {
    next_seq: u64,
    last_hash: String,
    /// request id -> (byte offset, line length without newline) of its latest receipt.
    index: HashMap<String, (u64, u32)>,
}

/// A worker's hash-chained, signed receipt log.
pub struct ReceiptLog {
    appender: Appender,
    reader: File,
    key: KeyPair,
    worker_id: WorkerId,
    chain: Mutex<Chain>,
    report: OpenReport,
    /// Fault injection: appends to fail before anything is written (tests of what a worker does
    /// when its disk refuses a receipt).
    fail_appends: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ReceiptLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiptLog")
            .field("path", &self.appender.path())
            .field("worker_id", &self.worker_id)
            .finish()
    }
}

impl ReceiptLog {
    /// Open or create the log at `path` for `worker_id`, signing with `key`.
    ///
    /// Fails with [`ReceiptsError::CorruptLog`] if a complete line is not a receipt, or the
    /// sequence or chain is broken, and with [`ReceiptsError::LogOwner`] if the log was written
    /// by another worker id. A torn last line is not an error: it is cut and reported.
    pub fn open(
        path: &Path,
        policy: FsyncPolicy,
        key: &KeyPair,
        worker_id: &str,
    ) -> Result<ReceiptLog> {
        let mut chain = Chain {
            next_seq: 0,
            last_hash: GENESIS_HASH.to_string(),
            index: HashMap::new(),
        };
        let corrupt = |line: u64, detail: String| ReceiptsError::CorruptLog {
            path: path.to_path_buf(),
            line,
            detail,
        };
        let now = crate::now_ms();
        let mut live_tickets = Vec::new();
        let (valid_len, torn) = scan(path, |line_no, offset, bytes| {
            let r = Receipt::from_line(bytes).map_err(|e| corrupt(line_no, e.to_string()))?;
            if r.seq != chain.next_seq {
                return Err(corrupt(
                    line_no,
                    format!("seq {} where {} was expected", r.seq, chain.next_seq),
                ));
            }
            if r.prev_hash != chain.last_hash {
                return Err(corrupt(
                    line_no,
                    "prev_hash does not match the previous line".into(),
                ));
            }
            if r.worker_id.as_str() != worker_id {
                return Err(ReceiptsError::LogOwner {
                    path: path.to_path_buf(),
                    expected: worker_id.to_string(),
                    found: r.worker_id.0,
                });
            }
            chain.next_seq += 1;
            chain.last_hash = Receipt::line_hash(bytes);
            let len = u32::try_from(bytes.len())
                .map_err(|_| corrupt(line_no, "line longer than 4 GiB".into()))?;
            if let Some(t) = &r.body.ticket {
                let t = t.ticket_unverified();
                if t.expires_at_ms.saturating_add(LIVE_TICKET_MARGIN_MS) >= now {
                    live_tickets.push(t.clone());
                }
            }
            chain.index.insert(r.body.request_id, (offset, len));
            Ok(())
        })?;
        let torn_tail = match torn {
            Some((_, bytes)) => Some(cut_torn_tail(path, valid_len, chain.next_seq + 1, &bytes)?),
            None => None,
        };
        let appender = Appender::open(path, policy)?;
        let reader = File::open(path).map_err(|e| ReceiptsError::io("open", path, e))?;
        Ok(ReceiptLog {
            appender,
            reader,
            key: key.clone(),
            worker_id: WorkerId::from(worker_id),
            report: OpenReport {
                receipts: chain.next_seq,
                torn_tail,
                live_tickets,
            },
            chain: Mutex::new(chain),
            fail_appends: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// What was found when the log was opened.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// The log file.
    pub fn path(&self) -> &Path {
        self.appender.path()
    }

    /// The worker id the log signs for.
    pub fn worker_id(&self) -> &str {
        self.worker_id.as_str()
    }

    /// Number of receipts in the log (the next sequence number).
    pub fn len(&self) -> u64 {
        self.chain.lock().next_seq
    }

    /// True when the log holds no receipt.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fault injection: the next `n` appends fail with an I/O error (nothing is written; the
    /// chain is unchanged), as on a full disk.
    #[doc(hidden)]
    pub fn fail_next_appends(&self, n: u64) {
        self.fail_appends
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Sign `draft` as the next receipt of the chain and append it (durable per the policy).
    pub fn append(&self, draft: ReceiptDraft) -> Result<Receipt> {
        let mut chain = self.chain.lock();
        let injected = self
            .fail_appends
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok();
        if injected {
            return Err(ReceiptsError::io(
                "append to",
                self.appender.path(),
                std::io::Error::other("injected fault: no space left on device"),
            ));
        }
        let receipt = Receipt::sign(
            draft,
            chain.next_seq,
            chain.last_hash.clone(),
            self.worker_id.clone(),
            &self.key,
        )?;
        let line = receipt.to_line()?;
        let len = u32::try_from(line.len()).map_err(|_| ReceiptsError::Malformed {
            what: "receipt",
            detail: "line longer than 4 GiB".into(),
        })?;
        let offset = self.appender.append(&line)?;
        chain.next_seq += 1;
        chain.last_hash = Receipt::line_hash(&line);
        chain
            .index
            .insert(receipt.body.request_id.clone(), (offset, len));
        Ok(receipt)
    }

    /// The latest receipt for `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Result<Option<Receipt>> {
        let Some((offset, len)) = self.chain.lock().index.get(request_id).copied() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; len as usize];
        read_exact_at(&self.reader, &mut buf, offset)
            .map_err(|e| ReceiptsError::io("read", self.path(), e))?;
        Receipt::from_line(&buf).map(Some)
    }

    /// Force every appended receipt to stable storage now.
    pub fn sync(&self) -> Result<()> {
        self.appender.sync()
    }
}

#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset)
}

#[cfg(not(unix))]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = f.try_clone()?;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

/// The path a torn line was saved to, for messages.
pub fn describe_torn(t: &TornTail) -> String {
    let saved = t
        .saved_to
        .as_ref()
        .map(|p: &PathBuf| format!(", saved to {}", p.display()))
        .unwrap_or_default();
    format!(
        "torn last line {} ({} bytes at offset {}) removed{saved}",
        t.line, t.len, t.offset
    )
}
