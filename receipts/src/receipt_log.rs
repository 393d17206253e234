//! The worker's receipt log: append-only JSON Lines, one signed receipt per line, hash-chained.
//!
//! [`ReceiptLog::open`] resumes an existing log: it reads every line of the *current* file
//! (O(current file size)), checks the sequence numbers and the hash chain, rebuilds the
//! request-id index, and removes a torn last line left by a crash (reported in
//! [`ReceiptLog::open_report`]). Signatures are not re-checked on open; `kvgate receipts verify`
//! does that. [`ReceiptLog::append`] is `&self` and thread-safe: one lock orders sequence
//! number, chain hash and write. [`ReceiptLog::get`] is an O(1) index lookup plus one positioned
//! read.
//!
//! **Rotation** ([`Rotation`]): when the current file would pass `max_bytes`, or is older than
//! `max_age`, it is renamed to `<stem>.<first seq, 20 digits>.jsonl` beside it and a new current
//! file is started. The chain does not restart: the new file's first receipt has the next seq and
//! the hash of the previous file's last line as `prev_hash`, so the files of one worker, ordered by
//! their first seq, are one chain (`kvgate receipts verify` / `audit` take the whole set). On open,
//! the chain head comes from the last rotated file's last line when the current file is empty,
//! and its first line is checked against it when it is not; a rotated file modified within
//! [`LIVE_TICKET_MARGIN_MS`] is also read for live tickets. `get` serves the current file only.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// When the current receipt file is rotated. Default: at 256 MiB, no age limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Rotate before an append would make the current file larger than this (a file always
    /// takes at least one receipt).
    pub max_bytes: Option<u64>,
    /// Rotate before an append when the current file's first receipt is older than this.
    pub max_age: Option<Duration>,
}

impl Default for Rotation {
    fn default() -> Self {
        Rotation {
            max_bytes: Some(256 << 20),
            max_age: None,
        }
    }
}

impl Rotation {
    /// Never rotate.
    pub const NEVER: Rotation = Rotation {
        max_bytes: None,
        max_age: None,
    };
}

/// The rotated files of the log at `path` (`<stem>.<20 digits>.jsonl` beside it), in chain
/// order (by first seq).
pub fn rotated_files(path: &Path) -> Result<Vec<PathBuf>> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ReceiptsError::io("list", dir, e)),
    };
    let mut out: Vec<(u64, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&format!("{stem}.")) else {
            continue;
        };
        let Some(digits) = rest.strip_suffix(".jsonl") else {
            continue;
        };
        if digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(seq) = digits.parse::<u64>() {
                out.push((seq, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// The name a current file whose first receipt has `first_seq` is rotated to.
fn rotated_name(path: &Path, first_seq: u64) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{stem}.{first_seq:020}.jsonl"))
}

/// The last complete line of a file (reading backwards from its end).
fn last_line(path: &Path) -> Result<Option<Vec<u8>>> {
    let bytes = std::fs::read(path).map_err(|e| ReceiptsError::io("read", path, e))?;
    let body = match bytes.iter().rposition(|&b| b == b'\n') {
        Some(end) => &bytes[..end],
        None => return Ok(None),
    };
    let start = body.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    Ok(Some(body[start..].to_vec()))
}

struct Chain {
    next_seq: u64,
    last_hash: String,
    /// request id -> (byte offset, line length without newline) of its latest receipt, in the
    /// current file.
    index: HashMap<String, (u64, u32)>,
    /// The current file.
    appender: Appender,
    reader: File,
    /// Bytes of the current file.
    bytes: u64,
    /// Seq and `completed_at_ms` of the current file's first receipt (`None`: empty).
    first: Option<(u64, u64)>,
}

/// A worker's hash-chained, signed receipt log.
pub struct ReceiptLog {
    path: PathBuf,
    policy: FsyncPolicy,
    rotation: Rotation,
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
            .field("path", &self.path)
            .field("worker_id", &self.worker_id)
            .finish()
    }
}

impl ReceiptLog {
    /// Open or create the log at `path` for `worker_id`, signing with `key`, with the default
    /// [`Rotation`].
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
        Self::open_with(path, policy, key, worker_id, Rotation::default())
    }

    /// [`Self::open`] with an explicit rotation policy.
    pub fn open_with(
        path: &Path,
        policy: FsyncPolicy,
        key: &KeyPair,
        worker_id: &str,
        rotation: Rotation,
    ) -> Result<ReceiptLog> {
        let corrupt = |p: &Path, line: u64, detail: String| ReceiptsError::CorruptLog {
            path: p.to_path_buf(),
            line,
            detail,
        };
        let now = crate::now_ms();
        let mut live_tickets = Vec::new();
        let rotated = rotated_files(path)?;
        // The chain head before the current file: the last rotated file's last line.
        let (mut next_seq, mut last_hash) = (0u64, GENESIS_HASH.to_string());
        if let Some(prev) = rotated.last() {
            if let Some(line) = last_line(prev)? {
                let r = Receipt::from_line(&line).map_err(|e| corrupt(prev, 0, e.to_string()))?;
                next_seq = r.seq + 1;
                last_hash = Receipt::line_hash(&line);
            }
            let recent = std::fs::metadata(prev)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_millis() < u128::from(LIVE_TICKET_MARGIN_MS));
            if recent {
                scan(prev, |_, _, bytes| {
                    if let Ok(r) = Receipt::from_line(bytes) {
                        if let Some(t) = &r.body.ticket {
                            let t = t.ticket_unverified();
                            if t.expires_at_ms.saturating_add(LIVE_TICKET_MARGIN_MS) >= now {
                                live_tickets.push(t.clone());
                            }
                        }
                    }
                    Ok(())
                })?;
            }
        }
        let mut index = HashMap::new();
        let mut first = None;
        let (valid_len, torn) = scan(path, |line_no, offset, bytes| {
            let r = Receipt::from_line(bytes).map_err(|e| corrupt(path, line_no, e.to_string()))?;
            if r.seq != next_seq {
                return Err(corrupt(
                    path,
                    line_no,
                    format!("seq {} where {next_seq} was expected", r.seq),
                ));
            }
            if r.prev_hash != last_hash {
                return Err(corrupt(
                    path,
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
            first.get_or_insert((r.seq, r.body.completed_at_ms));
            next_seq += 1;
            last_hash = Receipt::line_hash(bytes);
            let len = u32::try_from(bytes.len())
                .map_err(|_| corrupt(path, line_no, "line longer than 4 GiB".into()))?;
            if let Some(t) = &r.body.ticket {
                let t = t.ticket_unverified();
                if t.expires_at_ms.saturating_add(LIVE_TICKET_MARGIN_MS) >= now {
                    live_tickets.push(t.clone());
                }
            }
            index.insert(r.body.request_id, (offset, len));
            Ok(())
        })?;
        let receipts_in_file = first.map_or(0, |(s, _)| next_seq - s);
        let torn_tail = match torn {
            Some((_, bytes)) => Some(cut_torn_tail(
                path,
                valid_len,
                receipts_in_file + 1,
                &bytes,
            )?),
            None => None,
        };
        let appender = Appender::open(path, policy)?;
        let reader = File::open(path).map_err(|e| ReceiptsError::io("open", path, e))?;
        Ok(ReceiptLog {
            path: path.to_path_buf(),
            policy,
            rotation,
            key: key.clone(),
            worker_id: WorkerId::from(worker_id),
            report: OpenReport {
                receipts: next_seq,
                torn_tail,
                live_tickets,
            },
            chain: Mutex::new(Chain {
                next_seq,
                last_hash,
                index,
                appender,
                reader,
                bytes: valid_len,
                first,
            }),
            fail_appends: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// What was found when the log was opened.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// The current log file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The worker id the log signs for.
    pub fn worker_id(&self) -> &str {
        self.worker_id.as_str()
    }

    /// Number of receipts in the log, rotated files included (the next sequence number).
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

    /// Renames the current file to its rotated name and starts a new one (under the chain lock).
    fn rotate(&self, chain: &mut Chain) -> Result<()> {
        let Some((first_seq, _)) = chain.first else {
            return Ok(());
        };
        chain.appender.sync()?;
        let to = rotated_name(&self.path, first_seq);
        std::fs::rename(&self.path, &to).map_err(|e| ReceiptsError::io("rotate", &to, e))?;
        chain.appender = Appender::open(&self.path, self.policy)?;
        chain.reader =
            File::open(&self.path).map_err(|e| ReceiptsError::io("open", &self.path, e))?;
        chain.bytes = 0;
        chain.first = None;
        chain.index.clear();
        Ok(())
    }

    /// Sign `draft` as the next receipt of the chain and append it (durable per the policy),
    /// rotating the current file first when the [`Rotation`] says so.
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
                &self.path,
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
        if let Some((_, first_ms)) = chain.first {
            let too_big = self
                .rotation
                .max_bytes
                .is_some_and(|max| chain.bytes + line.len() as u64 + 1 > max);
            let too_old = self.rotation.max_age.is_some_and(|age| {
                receipt.body.completed_at_ms.saturating_sub(first_ms) > age.as_millis() as u64
            });
            if too_big || too_old {
                self.rotate(&mut chain)?;
            }
        }
        let offset = chain.appender.append(&line)?;
        chain.bytes = offset + line.len() as u64 + 1;
        chain
            .first
            .get_or_insert((receipt.seq, receipt.body.completed_at_ms));
        chain.next_seq += 1;
        chain.last_hash = Receipt::line_hash(&line);
        chain
            .index
            .insert(receipt.body.request_id.clone(), (offset, len));
        Ok(receipt)
    }

    /// The latest receipt for `request_id` in the current file, if any.
    pub fn get(&self, request_id: &str) -> Result<Option<Receipt>> {
        let chain = self.chain.lock();
        let Some((offset, len)) = chain.index.get(request_id).copied() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; len as usize];
        read_exact_at(&chain.reader, &mut buf, offset)
            .map_err(|e| ReceiptsError::io("read", &self.path, e))?;
        Receipt::from_line(&buf).map(Some)
    }

    /// Force every appended receipt to stable storage now.
    pub fn sync(&self) -> Result<()> {
        self.chain.lock().appender.sync()
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
