//! Stored responses kept across a restart: the gateway's [`ResponseStore`] written to a file
//! (`--response-store-file`) and read back when the gateway starts (docs/gateway.md, "Stored
//! responses").
//!
//! The file is JSON lines: a header `{"kvgate":"stored-responses","version":1,"saved_at_ms":T}`
//! (T: the wall-clock time of the save, Unix milliseconds), then one line per turn, least
//! recently used first: `{"idle_ms":N,"turn":{…}}` — how long the turn had been unused when the
//! file was written, and the turn as the shared store holds it (`StoredResponse`'s JSON). A turn
//! read back has been unused for `N + (now − T)`: the time the gateway was down counts, so a
//! turn past the idle TTL is not restored; restoring oldest first keeps the store's order.
//!
//! A save writes `<file>.tmp` (mode 0600: the file holds conversations), flushes it to disk and
//! renames it over the file, so a crash leaves the old file or the new one, never half of one.
//! [`Saver`], a task the gateway owns, saves when the store changed, every interval, off the
//! request path (the turns are serialized on a blocking thread after a copy of their `Arc`s is
//! taken under the store's lock), and once more at shutdown after the listeners closed.
//!
//! Reading never fails the start: a missing file is an empty store; a file of another format or
//! version is left alone (logged, and overwritten by the next save); a line that is not a turn
//! (torn, edited, over the store's turn size) is skipped and counted in [`LoadReport`].
//!
//! In cluster mode the file also keeps what waits for Redis ([`Waiting`]: Redis did not answer),
//! after the turns, one line each, oldest first within each kind:
//! `{"redis":"write","id":I}` (the turn of id I above waits to be written),
//! `{"redis":"write","turn":{…}}` (a turn that waits, no longer in the store itself),
//! `{"redis":"delete","id":I}`, `{"redis":"cancel","id":I}` and
//! `{"redis":"conversation","id":I,"tenant":T,"change":C}` (C: [`crate::conversation::Change`]
//! as JSON, `{"append":[…]}`, `{"remove_item":"…"}` or `{"set_metadata":{…}}`). Read back, they
//! are handed to the cluster link, which writes them once Redis answers; a gateway started
//! without `--cluster` logs and drops them. At most as many of each kind are read back as a
//! replica keeps waiting; more are skipped.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::conversation::Change;
use crate::response_store::{ResponseStore, StoredResponse, MAX_ID_LEN};
use crate::write_backlog::Waiting;

/// The header's `kvgate` value.
const KIND: &str = "stored-responses";
/// The header's `version`.
const VERSION: u64 = 1;
/// Longest line read beyond the store's largest turn (the line's own fields).
const LINE_SLACK: usize = 256;

/// What reading a file gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Turns put back in the store.
    pub restored: usize,
    /// Turns past the idle TTL (the downtime included), not put back.
    pub expired: usize,
    /// Lines that are not a turn of this format, or a turn the store refused (too large, an
    /// id already taken), skipped.
    pub skipped: usize,
    /// Why the whole file was left alone (another format or version), if it was.
    pub ignored: Option<String>,
    /// What waited for Redis when the file was saved (see the module docs).
    pub waiting: Waiting,
}

#[derive(Deserialize)]
struct Header {
    kvgate: String,
    version: u64,
    saved_at_ms: u64,
}

#[derive(Deserialize)]
struct Line {
    idle_ms: u64,
    turn: StoredResponse,
}

/// A line of what waits for Redis (see the module docs).
#[derive(Deserialize)]
#[serde(tag = "redis", rename_all = "snake_case")]
enum WaitingLine {
    Write {
        #[serde(default)]
        id: Option<String>,
        #[serde(default)]
        turn: Option<StoredResponse>,
    },
    Delete {
        id: String,
    },
    Cancel {
        id: String,
    },
    Conversation {
        id: String,
        tenant: Option<String>,
        change: Change,
    },
}

impl WaitingLine {
    /// Adds the line to `w` (within each kind's bound: see the module docs; ids within
    /// [`MAX_ID_LEN`]; whole turns not in the store within the store's bytes, counted in
    /// `turn_bytes`); whether it was taken.
    fn add_to(self, w: &mut Waiting, turn_bytes: &mut usize, store: &ResponseStore) -> bool {
        use crate::cluster::{MAX_PENDING_CANCELS, MAX_PENDING_DELETES};
        use crate::conversation::MAX_PENDING;
        use crate::write_backlog::MAX_TURNS;
        match self {
            WaitingLine::Write { id, turn } if w.turns.len() < MAX_TURNS => {
                let turn = match (id, turn) {
                    (Some(id), None) => store.peek(&id),
                    (None, Some(t)) => {
                        StoredResponse::checked(t.id, t.tenant, t.chain, t.input, t.response)
                            .filter(|t| {
                                t.bytes() <= store.limits().max_entry()
                                    && *turn_bytes + t.bytes() <= store.limits().max_bytes
                            })
                            .map(|t| {
                                *turn_bytes += t.bytes();
                                Arc::new(crate::background::interrupted(t))
                            })
                    }
                    _ => None,
                };
                turn.map(|t| w.turns.push(t)).is_some()
            }
            WaitingLine::Delete { id }
                if w.deletes.len() < MAX_PENDING_DELETES && id.len() <= MAX_ID_LEN =>
            {
                w.deletes.push(id);
                true
            }
            WaitingLine::Cancel { id }
                if w.cancels.len() < MAX_PENDING_CANCELS && id.len() <= MAX_ID_LEN =>
            {
                w.cancels.push(id);
                true
            }
            WaitingLine::Conversation { id, tenant, change }
                if w.changes.len() < MAX_PENDING && id.len() <= MAX_ID_LEN =>
            {
                w.changes.push((id, tenant, change));
                true
            }
            _ => false,
        }
    }
}

/// Reads `path` into `store` (see the module docs); `now_ms`: the wall clock, Unix ms.
pub fn load(path: &Path, store: &ResponseStore, now_ms: u64) -> std::io::Result<LoadReport> {
    let mut report = LoadReport::default();
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(report),
        Err(e) => return Err(e),
    };
    let cap = store.limits().max_entry() + LINE_SLACK;
    let mut lines = CappedLines {
        reader: BufReader::new(file),
        cap,
    };
    let header = match lines.next_line()? {
        None => return Ok(report),
        Some(None) => None,
        Some(Some(l)) => serde_json::from_slice::<Header>(&l).ok(),
    };
    let Some(header) = header.filter(|h| h.kvgate == KIND && h.version == VERSION) else {
        report.ignored = Some(format!(
            "not a kvgate stored-responses file of version {VERSION}"
        ));
        return Ok(report);
    };
    let downtime = now_ms.saturating_sub(header.saved_at_ms);
    let mut turn_bytes = 0;
    while let Some(line) = lines.next_line()? {
        let Some(line) = line else {
            report.skipped += 1;
            continue;
        };
        let Ok(line) = serde_json::from_slice::<Line>(&line) else {
            let taken = serde_json::from_slice::<WaitingLine>(&line)
                .is_ok_and(|w| w.add_to(&mut report.waiting, &mut turn_bytes, store));
            if !taken {
                report.skipped += 1;
            }
            continue;
        };
        let idle = Duration::from_millis(line.idle_ms.saturating_add(downtime));
        if idle >= store.limits().idle_ttl {
            report.expired += 1;
            continue;
        }
        let t = line.turn;
        let Some(turn) = StoredResponse::checked(t.id, t.tenant, t.chain, t.input, t.response)
        else {
            report.skipped += 1;
            continue;
        };
        if store.restore(turn, idle) {
            report.restored += 1;
        } else {
            report.skipped += 1;
        }
    }
    Ok(report)
}

/// Lines of at most `cap` bytes: `Some(None)` for a longer one (skipped to its end).
struct CappedLines<R> {
    reader: BufReader<R>,
    cap: usize,
}

impl<R: Read> CappedLines<R> {
    fn next_line(&mut self) -> std::io::Result<Option<Option<Vec<u8>>>> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(self.cap as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(None);
        }
        if line.last() == Some(&b'\n') {
            line.pop();
            return Ok(Some(Some(line)));
        }
        if line.len() <= self.cap {
            // The last line, without its newline.
            return Ok(Some(Some(line)));
        }
        // Too long: skip the rest of it without holding it.
        loop {
            let buf = self.reader.fill_buf()?;
            if buf.is_empty() {
                break;
            }
            match buf.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.reader.consume(i + 1);
                    break;
                }
                None => {
                    let len = buf.len();
                    self.reader.consume(len);
                }
            }
        }
        Ok(Some(None))
    }
}

/// Writes `turns` (least recently used first, with their idle time) and what `waiting` holds
/// to `path`, atomically (see the module docs); the bytes written.
pub fn save(
    path: &Path,
    turns: &[(Arc<StoredResponse>, Duration)],
    waiting: &Waiting,
    now_ms: u64,
) -> std::io::Result<u64> {
    let tmp = tmp_path(path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let file = options.open(&tmp)?;
    let mut out = std::io::BufWriter::new(file);
    let mut written = 0u64;
    let header = serde_json::json!({"kvgate": KIND, "version": VERSION, "saved_at_ms": now_ms});
    let mut put = |out: &mut std::io::BufWriter<std::fs::File>, s: &str| {
        written += s.len() as u64;
        out.write_all(s.as_bytes())
    };
    put(&mut out, &format!("{header}\n"))?;
    for (turn, idle) in turns {
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        put(
            &mut out,
            &format!("{{\"idle_ms\":{idle_ms},\"turn\":{}}}\n", turn.to_json()),
        )?;
    }
    let held: std::collections::HashMap<&str, &Arc<StoredResponse>> =
        turns.iter().map(|(t, _)| (t.id.as_str(), t)).collect();
    for t in &waiting.turns {
        let line = match held.get(t.id.as_str()) {
            Some(h) if Arc::ptr_eq(h, t) => {
                serde_json::json!({"redis": "write", "id": t.id}).to_string()
            }
            _ => format!("{{\"redis\":\"write\",\"turn\":{}}}", t.to_json()),
        };
        put(&mut out, &format!("{line}\n"))?;
    }
    for id in &waiting.deletes {
        put(
            &mut out,
            &format!("{}\n", serde_json::json!({"redis": "delete", "id": id})),
        )?;
    }
    for id in &waiting.cancels {
        put(
            &mut out,
            &format!("{}\n", serde_json::json!({"redis": "cancel", "id": id})),
        )?;
    }
    for (id, tenant, change) in &waiting.changes {
        let line = serde_json::json!({"redis": "conversation", "id": id, "tenant": tenant, "change": change});
        put(&mut out, &format!("{line}\n"))?;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    // The rename itself reaches the disk with the directory.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(written)
}

/// `<file>.tmp`: one gateway process per file (two would replace each other's saves).
fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Saves a store to its file when it changed, every `interval`, and once more on [`Saver::stop`]
/// (a task the gateway owns; see the module docs).
pub struct Saver {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// What the saver saves, and where.
struct Target {
    path: PathBuf,
    data: Arc<crate::data_plane::DataPlane>,
}

/// What a file holds: the store's [`ResponseStore::changes`] count and the digest of what
/// waited for Redis ([`Waiting::digest`]) when it was saved.
pub type Saved = (u64, u64);

/// What waits for Redis in `data` (cluster mode; empty otherwise).
pub fn waiting(data: &crate::data_plane::DataPlane) -> Waiting {
    let mut w = data
        .shared_responses
        .load()
        .as_ref()
        .map(|s| s.waiting())
        .unwrap_or_default();
    w.changes = data.responses.pending.waiting();
    w
}

impl Target {
    /// Saves when the store, or what waits for Redis, changed since `saved`; what is saved now.
    async fn save_if_changed(&self, saved: Saved) -> Saved {
        let store = &self.data.responses;
        let waiting = waiting(&self.data);
        let now = (store.changes(), waiting.digest());
        if now == saved {
            return saved;
        }
        let turns = store.snapshot();
        let path = self.path.clone();
        let result = tokio::task::spawn_blocking(move || {
            save(&path, &turns, &waiting, receipts::now_ms()).map(|b| (b, turns.len()))
        })
        .await;
        match result {
            Ok(Ok((bytes, n))) => {
                tracing::debug!(turns = n, bytes, path = %self.path.display(), "stored responses saved");
                now
            }
            Ok(Err(e)) => {
                self.data.metrics.response_store_save_failures.inc();
                tracing::warn!(error = %e, path = %self.path.display(), "stored responses: save failed");
                saved
            }
            Err(e) => {
                self.data.metrics.response_store_save_failures.inc();
                tracing::warn!(error = %e, "stored responses: the save task failed");
                saved
            }
        }
    }
}

impl Saver {
    /// Starts saving `data.responses` (and what waits for Redis) to `path` every `interval` on
    /// `handle`; `saved`: what the file already holds (after [`load`]).
    pub fn start(
        handle: &tokio::runtime::Handle,
        data: Arc<crate::data_plane::DataPlane>,
        path: PathBuf,
        interval: Duration,
        saved: Saved,
    ) -> Saver {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let target = Target { path, data };
        let task = handle.spawn(async move {
            let mut saved = saved;
            let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => saved = target.save_if_changed(saved).await,
                    _ = stopped.changed() => break,
                }
            }
            target.save_if_changed(saved).await;
        });
        Saver { stop, task }
    }

    /// Stops the saver after a last save (when the store changed).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response_store::StoreLimits;
    use serde_json::json;

    fn turn(id: &str, chain: &[&str], said: &str) -> StoredResponse {
        StoredResponse::new(
            id.into(),
            Some("team-a".into()),
            chain.iter().map(|s| s.to_string()).collect(),
            vec![json!({"type": "message", "role": "user", "content": said})],
            json!({"id": id, "object": "response", "status": "completed", "output": [
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": format!("re: {said}")}]}]}),
        )
    }

    fn ids(store: &ResponseStore) -> Vec<String> {
        store.snapshot().iter().map(|(t, _)| t.id.clone()).collect()
    }

    #[test]
    fn a_saved_store_is_read_back_in_its_order_and_conversations_continue() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("responses.jsonl");
        let store = ResponseStore::new(StoreLimits::DEFAULT);
        store.insert(turn("resp_1", &[], "one")).unwrap();
        store.insert(turn("resp_2", &["resp_1"], "two")).unwrap();
        store.insert(turn("resp_x", &[], "other")).unwrap();
        // Using turn 1 makes it the most recent.
        store.peek("resp_1").unwrap();
        let before = ids(&store);
        assert_eq!(before, ["resp_2", "resp_x", "resp_1"]);
        let written = save(
            &path,
            &store.snapshot(),
            &Waiting::default(),
            receipts::now_ms(),
        )
        .unwrap();
        assert_eq!(written, std::fs::metadata(&path).unwrap().len());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        }
        assert!(!tmp_path(&path).exists());

        let back = ResponseStore::new(StoreLimits::DEFAULT);
        let report = load(&path, &back, receipts::now_ms()).unwrap();
        assert_eq!(report.restored, 3, "{report:?}");
        assert_eq!(ids(&back), before);
        assert_eq!(back.stats(), store.stats());
        let turns = back.turns("resp_2", Some("team-a")).unwrap();
        assert_eq!(turns.len(), 2);
        assert_eq!(turns[0].response, store.peek("resp_1").unwrap().response);
        // The owner is kept.
        assert!(back.get("resp_2", Some("team-b")).is_none());
    }

    #[test]
    fn what_waits_for_redis_is_read_back_in_its_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("responses.jsonl");
        let store = ResponseStore::new(StoreLimits::DEFAULT);
        store.insert(turn("resp_1", &[], "one")).unwrap();
        store.insert(turn("resp_2", &["resp_1"], "two")).unwrap();
        let waiting = Waiting {
            // resp_2 is in the store (a line naming it); resp_gone is not (a whole turn).
            turns: vec![
                store.peek("resp_2").unwrap(),
                Arc::new(turn("resp_gone", &[], "evicted here")),
            ],
            deletes: vec!["resp_d1".into(), "resp_d2".into()],
            cancels: vec!["resp_c".into()],
            changes: vec![
                (
                    "conv_1".into(),
                    Some("team-a".into()),
                    crate::conversation::append(vec![json!({"id": "msg_1", "type": "message"})]),
                ),
                (
                    "conv_1".into(),
                    Some("team-a".into()),
                    crate::conversation::remove_item("msg_0"),
                ),
                (
                    "conv_2".into(),
                    None,
                    crate::conversation::set_metadata(
                        json!({"topic": "x"}).as_object().unwrap().clone(),
                    ),
                ),
            ],
        };
        save(&path, &store.snapshot(), &waiting, receipts::now_ms()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("{\"redis\":\"write\",\"id\":\"resp_2\"}"),
            "{text}"
        );
        assert!(
            text.contains("{\"redis\":\"write\",\"turn\":{\"id\":\"resp_gone\""),
            "{text}"
        );
        assert!(
            text.contains("\"change\":{\"remove_item\":\"msg_0\"}"),
            "{text}"
        );

        let back = ResponseStore::new(StoreLimits::DEFAULT);
        let report = load(&path, &back, receipts::now_ms()).unwrap();
        assert_eq!((report.restored, report.skipped), (2, 0), "{report:?}");
        assert_eq!(report.waiting, waiting);
        // The turn named by id is the store's own copy; the other stays out of the store.
        assert!(Arc::ptr_eq(
            &report.waiting.turns[0],
            &back.peek("resp_2").unwrap()
        ));
        assert!(back.peek("resp_gone").is_none());
        // Saved again as read, the waiting lines are the same.
        let again = dir.path().join("again.jsonl");
        save(
            &again,
            &back.snapshot(),
            &report.waiting,
            receipts::now_ms(),
        )
        .unwrap();
        let waiting_lines = |p: &Path| -> Vec<String> {
            let t = std::fs::read_to_string(p).unwrap();
            t.lines()
                .filter(|l| l.starts_with("{\"redis\""))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(waiting_lines(&again), waiting_lines(&path));
        assert_eq!(waiting_lines(&path).len(), waiting.len());
    }

    #[test]
    fn waiting_lines_are_bounded_and_bad_ones_skipped() {
        use crate::cluster::MAX_PENDING_CANCELS;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let mut text = format!(
            "{}\n",
            json!({"kvgate": KIND, "version": VERSION, "saved_at_ms": receipts::now_ms()})
        );
        for i in 0..=MAX_PENDING_CANCELS {
            text.push_str(&format!(
                "{}\n",
                json!({"redis": "cancel", "id": format!("resp_{i}")})
            ));
        }
        for bad in [
            json!({"redis": "write", "id": "resp_not_in_the_file"}),
            json!({"redis": "write"}),
            json!({"redis": "write", "id": "a", "turn": {"id": "a"}}),
            json!({"redis": "bogus", "id": "a"}),
            json!({"redis": "conversation", "id": "conv_1", "change": {"rename": "x"}}),
            json!({"redis": "delete"}),
            json!({"redis": "delete", "id": "r".repeat(MAX_ID_LEN + 1)}),
        ] {
            text.push_str(&format!("{bad}\n"));
        }
        std::fs::write(&path, text).unwrap();
        let report = load(
            &path,
            &ResponseStore::new(StoreLimits::DEFAULT),
            receipts::now_ms(),
        )
        .unwrap();
        assert_eq!(report.waiting.cancels.len(), MAX_PENDING_CANCELS);
        assert_eq!(report.waiting.len(), MAX_PENDING_CANCELS);
        assert_eq!(
            report.skipped,
            1 + 7,
            "{:?}",
            (report.restored, report.expired)
        );
    }

    #[test]
    fn the_downtime_counts_as_idle_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let limits = StoreLimits {
            idle_ttl: Duration::from_secs(600),
            ..StoreLimits::DEFAULT
        };
        let store = ResponseStore::new(limits);
        store.insert(turn("resp_old", &[], "a")).unwrap();
        store.insert(turn("resp_new", &[], "b")).unwrap();
        let mut turns = store.snapshot();
        turns[0].1 = Duration::from_secs(500);
        turns[1].1 = Duration::from_secs(10);
        let saved_at = receipts::now_ms();
        save(&path, &turns, &Waiting::default(), saved_at).unwrap();
        // Read back 200 s later: the old one has been idle 700 s, past the TTL.
        let back = ResponseStore::new(limits);
        let report = load(&path, &back, saved_at + 200_000).unwrap();
        assert_eq!((report.restored, report.expired), (1, 1), "{report:?}");
        assert_eq!(ids(&back), ["resp_new"]);
        let (_, idle) = back.snapshot()[0].clone();
        assert!(idle >= Duration::from_secs(210), "{idle:?}");
    }

    #[test]
    fn damaged_lines_are_skipped_and_foreign_files_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let limits = StoreLimits {
            max_bytes: 64 << 10,
            ..StoreLimits::DEFAULT
        };
        let store = ResponseStore::new(limits);
        store.insert(turn("resp_1", &[], "one")).unwrap();
        store.insert(turn("resp_2", &["resp_1"], "two")).unwrap();
        save(
            &path,
            &store.snapshot(),
            &Waiting::default(),
            receipts::now_ms(),
        )
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        // A garbage line, a line far over the store's turn size (no newline inside it: read
        // past without holding it), a turn with an id over the limit, and a torn last line.
        lines.insert(1, "{not json".into());
        lines.insert(2, "x".repeat(1 << 20));
        let long_id = "r".repeat(300);
        lines.insert(
            3,
            format!(
                "{{\"idle_ms\":0,\"turn\":{}}}",
                turn(&long_id, &[], "z").to_json()
            ),
        );
        let torn = lines[4].clone();
        lines.push(torn[..torn.len() / 2].to_owned());
        std::fs::write(&path, lines.join("\n")).unwrap();
        let back = ResponseStore::new(limits);
        let report = load(&path, &back, receipts::now_ms()).unwrap();
        assert_eq!((report.restored, report.skipped), (2, 4), "{report:?}");
        assert_eq!(ids(&back), ["resp_1", "resp_2"]);

        // Another format: nothing read, the file untouched.
        std::fs::write(
            &path,
            "{\"kvgate\":\"stored-responses\",\"version\":9,\"saved_at_ms\":1}\n",
        )
        .unwrap();
        let other = ResponseStore::new(limits);
        let report = load(&path, &other, receipts::now_ms()).unwrap();
        assert!(report.ignored.is_some(), "{report:?}");
        assert_eq!(other.stats(), (0, 0));
        // No file, an empty file: an empty store.
        assert_eq!(
            load(&dir.path().join("none"), &other, 0).unwrap(),
            LoadReport::default()
        );
        std::fs::write(&path, "").unwrap();
        assert_eq!(load(&path, &other, 0).unwrap(), LoadReport::default());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any file — saved turns cut, flipped or mixed with noise — reads without a panic,
        /// within the store's bounds, restoring at most the turns it holds whole.
        #[test]
        fn any_file_reads_back_within_bounds(
            cuts in proptest::collection::vec((0usize..4, 0usize..2000, proptest::num::u8::ANY), 0..12),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("r.jsonl");
            let limits = StoreLimits { max_bytes: 8 << 10, ..StoreLimits::DEFAULT };
            let store = ResponseStore::new(StoreLimits::DEFAULT);
            for t in 0..4 {
                store.insert(turn(&format!("resp_{t}"), &[], &"w ".repeat(t * 200))).unwrap();
            }
            save(&path, &store.snapshot(), &Waiting::default(), receipts::now_ms()).unwrap();
            let mut bytes = std::fs::read(&path).unwrap();
            for (kind, at, b) in &cuts {
                let at = at % (bytes.len() + 1);
                match kind {
                    0 => bytes.truncate(at),
                    1 => if at < bytes.len() { bytes[at] ^= b | 1 },
                    2 => bytes.insert(at, *b),
                    _ => bytes.splice(at..at, noise.iter().copied()).for_each(drop),
                }
            }
            std::fs::write(&path, &bytes).unwrap();
            let back = ResponseStore::new(limits);
            let report = load(&path, &back, receipts::now_ms()).unwrap();
            let (entries, used) = back.stats();
            proptest::prop_assert!(used <= limits.max_bytes);
            proptest::prop_assert!(report.restored <= 4, "{report:?}");
            proptest::prop_assert!(entries <= report.restored);
        }
    }
}
