//! CLI tests for `kvgate keygen` and `kvgate receipts verify|audit`, run against the built binary.

#[path = "python_support/mod.rs"]
mod python_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use receipts::*;

fn kvgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .output()
        .expect("run kvgate")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn keygen(dir: &Path, name: &str) -> KeyPair {
    let o = kvgate(&["keygen", "--out", s(dir), "--name", name]);
    assert!(o.status.success(), "{}", text(&o));
    KeyPair::load_private(&dir.join(format!("{name}.key"))).unwrap()
}

/// Gateway + one worker, `n` routed requests, a decision log and the worker's receipt log.
fn scenario(dir: &Path, n: usize) -> (PathBuf, PathBuf, PathBuf) {
    scenario_rotating(dir, n, Rotation::NEVER)
}

/// [`scenario`] with the receipt log rotating by `rotation`.
fn scenario_rotating(dir: &Path, n: usize, rotation: Rotation) -> (PathBuf, PathBuf, PathBuf) {
    let keys = dir.join("keys");
    let gw = keygen(&keys, "gw-1");
    let wk = keygen(&keys, "w0");
    let decisions = dir.join("gateway.jsonl");
    let receipts_path = dir.join("w0.jsonl");
    let dlog = DecisionLog::open(&decisions, FsyncPolicy::Always).unwrap();
    let rlog =
        ReceiptLog::open_with(&receipts_path, FsyncPolicy::Always, &wk, "w0", rotation).unwrap();
    let t0 = now_ms();
    for i in 0..n {
        let rid = format!("req-{i}");
        let st = RouteTicket {
            request_id: rid.clone(),
            gateway_id: "gw-1".into(),
            key_id: KeyId(String::new()),
            service: "chat".into(),
            rule_id: "kv".into(),
            rule_version: 2,
            mode: RouteMode::KvExact,
            worker: "w0".into(),
            predicted_matched_tokens: Some(16),
            prompt_tokens: Some(20),
            last_block_key: Some(prefix_index::BlockKey(0x00000000000000ff)),
            namespace_seed: prefix_index::NamespaceSeed([0xab; 32]),
            hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
            issued_at_ms: t0,
            expires_at_ms: t0 + DEFAULT_TICKET_TTL_MS,
        }
        .sign(&gw);
        rlog.append(ReceiptDraft {
            request_id: rid.clone(),
            ticket: Some(st.clone()),
            model: "m".into(),
            profile_digest: "cd".repeat(32),
            request_sha256: sha256_hex(rid.as_bytes()),
            response_sha256: sha256_hex(b"out"),
            prompt_tokens: 20,
            cached_tokens: 16,
            completion_tokens: 4,
            finish_reason: Some("stop".into()),
            status: 200,
            error_code: None,
            received_at_ms: t0 + 1,
            first_token_at_ms: Some(t0 + 2),
            completed_at_ms: t0 + 3,
            last_block_key: Some(prefix_index::BlockKey(0x00000000000000ff)),
        })
        .unwrap();
        dlog.append(&DecisionRecord {
            request_id: rid,
            at_ms: t0 + 4,
            ticket: Some(st),
            service: Some("chat".into()),
            rule_id: Some("kv".into()),
            rule_version: Some(2),
            worker: Some("w0".into()),
            status: 200,
            error: None,
            client_request_id: None,
            receipt_named: None,
            tenant: None,
            phase: None,
        })
        .unwrap();
    }
    (keys, decisions, receipts_path)
}

#[test]
fn keygen_writes_0600_key_and_refuses_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let o = kvgate(&["keygen", "--out", s(dir.path()), "--name", "gw-1"]);
    assert!(o.status.success(), "{}", text(&o));
    let key = dir.path().join("gw-1.key");
    let public = PublicKey::load(&dir.path().join("gw-1.pub")).unwrap();
    assert!(text(&o).contains(public.key_id().as_str()), "{}", text(&o));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let o = kvgate(&["keygen", "--out", s(dir.path()), "--name", "gw-1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("refusing to overwrite"), "{}", text(&o));
}

#[test]
fn a_rotated_log_is_verified_and_audited_as_one_chain() {
    let dir = tempfile::tempdir().unwrap();
    let rotation = Rotation {
        max_bytes: Some(4096),
        max_age: None,
    };
    let (keys, decisions, log) = scenario_rotating(dir.path(), 9, rotation);
    let rotated = rotated_files(&log).unwrap();
    assert!(rotated.len() >= 2, "{rotated:?}");
    // Naming the current file takes in the rotated ones beside it.
    let o = kvgate(&["receipts", "verify", s(&log), "--keys", s(&keys)]);
    assert!(o.status.success(), "{}", text(&o));
    for r in &rotated {
        assert!(text(&o).contains(&r.display().to_string()), "{}", text(&o));
    }
    let o = kvgate(&[
        "receipts",
        "audit",
        "--decisions",
        s(&decisions),
        "--receipts",
        s(&log),
        "--keys",
        s(&keys),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("receipted 9"), "{}", text(&o));
    // A rotated file lost from the middle is a chain break.
    std::fs::remove_file(&rotated[0]).unwrap();
    let o = kvgate(&["receipts", "verify", s(&log), "--keys", s(&keys)]);
    assert!(!o.status.success(), "{}", text(&o));
}

#[test]
fn keygen_keys_are_read_by_openssl_and_python_cryptography() {
    let dir = tempfile::tempdir().unwrap();
    let kp = keygen(dir.path(), "gw-1");
    let key = dir.path().join("gw-1.key");
    let public = dir.path().join("gw-1.pub");
    // OpenSSL 3 reads the private key and derives the same public key kvgate wrote.
    let o = std::process::Command::new("openssl")
        .args(["pkey", "-in", s(&key), "-pubout"])
        .output()
        .expect("openssl runs");
    assert!(o.status.success(), "openssl pkey: {}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        std::fs::read_to_string(&public).unwrap()
    );
    let o = std::process::Command::new("openssl")
        .args(["pkey", "-pubin", "-in", s(&public), "-noout"])
        .output()
        .unwrap();
    assert!(o.status.success(), "openssl pkey -pubin: {}", text(&o));
    // Python `cryptography` loads both and a signature made by kvgate verifies there.
    let sig = hex::encode(kp.sign(b"kvgate"));
    let script = format!(
        "from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key\n\
         k = load_pem_private_key(open({key:?}, 'rb').read(), None)\n\
         p = load_pem_public_key(open({public:?}, 'rb').read())\n\
         p.verify(bytes.fromhex('{sig}'), b'kvgate')\n\
         k.public_key().verify(k.sign(b'x'), b'x')\n\
         print('ok')\n",
        key = s(&key),
        public = s(&public),
    );
    let o = std::process::Command::new(python_support::python())
        .args(["-c", &script])
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "python cryptography: {}", text(&o));
    // Keys written by earlier versions (PKCS#8 v2 with the public key) still load.
    let v2 = dir.path().join("v2.key");
    std::fs::write(
        &v2,
        "-----BEGIN PRIVATE KEY-----\nMFECAQEwBQYDK2VwBCIEIFkQ+sXMBwtMTmd08Ixb7N9WgDMgPtBHRA6u5HbGptTR\ngSEAxTT1NtG5Ls7vN4UGAF78ki0DUVqESz/sKnG5QJR3fIw=\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&v2, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    assert!(KeyPair::load_private(&v2).is_ok());
}

#[test]
fn verify_ok_then_tampered_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let (keys, _, log) = scenario(dir.path(), 4);
    let o = kvgate(&[
        "receipts",
        "verify",
        s(&log),
        "--key",
        s(&keys.join("w0.pub")),
        "--keys",
        s(&keys),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(": OK"), "{}", text(&o));
    assert!(text(&o).contains("valid receipts 4"), "{}", text(&o));

    // Without the gateway key the tickets are unchecked, and said so.
    let o = kvgate(&[
        "receipts",
        "verify",
        s(&log),
        "--key",
        s(&keys.join("w0.pub")),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("tickets unchecked 4"), "{}", text(&o));

    // Flip one byte of line 3.
    let mut bytes = std::fs::read(&log).unwrap();
    let starts: Vec<usize> = bytes
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    bytes[starts[1] + 100] ^= 0x01;
    std::fs::write(&log, bytes).unwrap();
    let o = kvgate(&["receipts", "verify", s(&log), "--keys", s(&keys)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("FAILED"), "{}", text(&o));
    assert!(text(&o).contains("first failure: line 3:"), "{}", text(&o));

    // Wrong key.
    let other = dir.path().join("other");
    keygen(&other, "x");
    let o = kvgate(&[
        "receipts",
        "verify",
        s(&log),
        "--key",
        s(&other.join("x.pub")),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unknown_key"), "{}", text(&o));
}

#[test]
fn audit_ok_then_missing_receipt() {
    let dir = tempfile::tempdir().unwrap();
    let (keys, decisions, log) = scenario(dir.path(), 3);
    let args = |d: &Path, l: &Path, k: &Path| -> Vec<String> {
        [
            "receipts",
            "audit",
            "--decisions",
            s(d),
            "--receipts",
            s(l),
            "--keys",
            s(k),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let a = args(&decisions, &log, &keys);
    let o = kvgate(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.starts_with("audit: OK"), "{out}");
    assert!(
        out.contains("chat / kv / v2: decisions 3, receipted 3"),
        "{out}"
    );
    assert!(
        out.contains("prefix parity: compared 3 (0 on prompt tokens only), mismatched 0"),
        "{out}"
    );

    // Drop the last receipt: the gateway's decision has no receipt.
    let t = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = t.lines().collect();
    std::fs::write(&log, lines[..2].join("\n") + "\n").unwrap();
    let o = kvgate(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("missing_receipt"), "{out}");
    assert!(out.contains("request req-2"), "{out}");

    // JSON output parses.
    let mut aj = a.clone();
    aj.push("--json".into());
    let o = kvgate(&aj.iter().map(String::as_str).collect::<Vec<_>>());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["discrepancies"][0]["kind"], "missing_receipt");
}
