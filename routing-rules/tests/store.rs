//! RuleStore: versions, reload (changed / unchanged / invalid), API changes with validation,
//! pre-apply checks and rollback, atomic write-back and restart.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::BASE;
use routing_rules::{
    rules_from_toml, service_from_json, ApplyOutcome, ContentHash, Problem, RuleStore, RuleVersion,
    RulesError,
};

fn setup(text: &str) -> (tempfile::TempDir, PathBuf, RuleStore) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.toml");
    fs::write(&path, text).unwrap();
    let store = RuleStore::open(&path).unwrap();
    (dir, path, store)
}

fn new_service(name: &str, model: &str) -> routing_rules::ServiceSpec {
    service_from_json(&format!(
        r#"{{"name":"{name}","pool":"local","match":{{"models":["{model}"]}},"rule":{{"type":"round_robin","weighted":true}}}}"#
    ))
    .unwrap()
}

fn leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "rules.toml")
        .collect()
}

#[test]
fn open_starts_at_version_one_with_the_content_hash() {
    let (_d, _p, store) = setup(BASE);
    let snap = store.snapshot();
    assert_eq!(snap.version(), RuleVersion(1));
    let rules = rules_from_toml(BASE).unwrap();
    assert_eq!(snap.content_hash(), ContentHash::of(&rules).unwrap());
    assert_eq!(snap.services().len(), 2);
}

#[test]
fn open_refuses_an_invalid_file_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.toml");
    fs::write(
        &path,
        BASE.replace("block_size = 16", "block_size = 0")
            .replace("profile = \"smol\"", "profile = \"x\""),
    )
    .unwrap();
    let err = RuleStore::open(&path).unwrap_err();
    assert_eq!(err.problems().len(), 2, "{err}");
    let missing = RuleStore::open(dir.path().join("nope.toml")).unwrap_err();
    assert_eq!(missing.error_type(), "rules_read");
}

#[test]
fn reload_with_same_content_does_not_bump_the_version() {
    let (_d, path, store) = setup(BASE);
    // Comments, formatting and spelled-out defaults do not change the content hash.
    let reformatted = format!(
        "# a comment\n{}",
        BASE.replace(
            "block_size = 16",
            "block_size   =   16\nnative_reserve_tokens = 0"
        )
    );
    fs::write(&path, reformatted).unwrap();
    let before = store.snapshot();
    assert_eq!(
        store.reload_from_file().unwrap(),
        ApplyOutcome::Unchanged {
            version: RuleVersion(1)
        }
    );
    assert!(Arc::ptr_eq(&before, &store.snapshot()));
}

#[test]
fn reload_with_changes_bumps_the_version_and_old_snapshots_stay_intact() {
    let (_d, path, store) = setup(BASE);
    let held = store.snapshot(); // a request in flight
    fs::write(&path, BASE.replace("block_size = 16", "block_size = 32")).unwrap();
    let out = store.reload_from_file().unwrap();
    let ApplyOutcome::Applied {
        previous, version, ..
    } = out
    else {
        panic!("expected Applied, got {out:?}")
    };
    assert_eq!((previous, version), (RuleVersion(1), RuleVersion(2)));
    assert_eq!(store.snapshot().profile("smol").unwrap().block_size, 32);
    assert_eq!(held.version(), RuleVersion(1));
    assert_eq!(held.profile("smol").unwrap().block_size, 16);
    // Versions only go up.
    fs::write(&path, BASE).unwrap();
    assert_eq!(store.reload_from_file().unwrap().version(), RuleVersion(3));
}

#[test]
fn invalid_reload_keeps_the_current_version_and_says_why() {
    let (_d, path, store) = setup(BASE);
    let before = store.snapshot();
    fs::write(
        &path,
        BASE.replace("workers = [\"w1\", \"w2\"]", "workers = []")
            .replace("profile = \"smol\"", "profile = \"x\""),
    )
    .unwrap();
    let err = store.reload_from_file().unwrap_err();
    assert_eq!(err.error_type(), "rules_invalid");
    let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, ["pools.local.workers", "services.chat.rule.profile"]);
    assert!(Arc::ptr_eq(&before, &store.snapshot()));
    // A syntax error too.
    fs::write(&path, "[[workers]").unwrap();
    assert_eq!(
        store.reload_from_file().unwrap_err().error_type(),
        "rules_invalid"
    );
    assert_eq!(store.snapshot().version(), RuleVersion(1));
    // The fixed file applies as version 2.
    fs::write(&path, BASE.replace("block_size = 16", "block_size = 8")).unwrap();
    assert_eq!(store.reload_from_file().unwrap().version(), RuleVersion(2));
}

#[test]
fn put_service_is_written_back_and_survives_a_restart() {
    let (dir, path, store) = setup(BASE);
    let spec = new_service("chat2", "other");
    let out = store.put_service(spec.clone()).unwrap();
    assert_eq!(out.version(), RuleVersion(2));
    assert_eq!(store.get_service("chat2"), Some(spec.clone()));
    assert_eq!(store.list_services().len(), 3);
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );

    // The file now holds the applied rules: a reload is a no-op ...
    assert_eq!(
        store.reload_from_file().unwrap(),
        ApplyOutcome::Unchanged {
            version: RuleVersion(2)
        }
    );
    // ... and a restart sees the same content.
    let restarted = RuleStore::open(&path).unwrap();
    assert_eq!(restarted.get_service("chat2"), Some(spec.clone()));
    assert_eq!(
        restarted.snapshot().content_hash(),
        store.snapshot().content_hash()
    );

    // Replacing keeps the position; putting the same definition again changes nothing.
    let mut replaced = spec.clone();
    replaced.max_body_bytes = 1024;
    assert_eq!(
        store.put_service(replaced.clone()).unwrap().version(),
        RuleVersion(3)
    );
    assert_eq!(store.list_services()[2], replaced);
    let bytes = fs::read(&path).unwrap();
    assert_eq!(
        store.put_service(replaced).unwrap(),
        ApplyOutcome::Unchanged {
            version: RuleVersion(3)
        }
    );
    assert_eq!(fs::read(&path).unwrap(), bytes);
}

#[test]
fn invalid_put_changes_nothing() {
    let (_d, path, store) = setup(BASE);
    let bytes = fs::read(&path).unwrap();
    let mut bad = new_service("chat2", "exact"); // overlaps "chat"
    bad.pool = routing_rules::PoolId("nope".into());
    let err = store.put_service(bad).unwrap_err();
    let shown: Vec<String> = err.problems().iter().map(Problem::to_string).collect();
    assert_eq!(
        shown,
        [
            "services.chat2.pool: unknown pool \"nope\"",
            "services.chat2.match: matches the same requests as service \"chat\" \
             (any listener, any host, path prefix \"/v1/\", models [\"exact\"])"
        ]
    );
    assert_eq!(store.snapshot().version(), RuleVersion(1));
    assert_eq!(fs::read(&path).unwrap(), bytes);
    assert_eq!(store.get_service("chat2"), None);
}

#[test]
fn pre_apply_check_sees_the_candidate_and_can_refuse_it() {
    let (_d, path, store) = setup(BASE);
    let bytes = fs::read(&path).unwrap();
    let seen = parking_lot::Mutex::new(None);
    let refuse = |snap: &routing_rules::RuleSnapshot| {
        *seen.lock() = Some((snap.version(), snap.service("chat2").is_some()));
        Err(vec![Problem::new(
            "services.chat2.rule.profile",
            "worker w2 reports block_size 32, profile says 16",
        )])
    };
    let err = store
        .put_service_with(new_service("chat2", "other"), &refuse)
        .unwrap_err();
    assert_eq!(err.error_type(), "rules_rejected");
    assert_eq!(*seen.lock(), Some((RuleVersion(2), true)));
    assert_eq!(store.snapshot().version(), RuleVersion(1));
    assert_eq!(fs::read(&path).unwrap(), bytes);

    // Accepted by the check: applied as version 2 (the refused one consumed no version).
    let accept = |_: &routing_rules::RuleSnapshot| Ok(());
    let out = store
        .put_service_with(new_service("chat2", "other"), &accept)
        .unwrap();
    assert_eq!(out.version(), RuleVersion(2));

    // Reload with a refusing check keeps the current version too.
    fs::write(&path, BASE).unwrap();
    let err = store.reload_from_file_with(&refuse).unwrap_err();
    assert_eq!(err.error_type(), "rules_rejected");
    assert!(store.get_service("chat2").is_some());
}

#[test]
fn delete_service_is_persisted() {
    let (_d, path, store) = setup(BASE);
    assert_eq!(
        store.delete_service("chat").unwrap().version(),
        RuleVersion(2)
    );
    assert_eq!(store.get_service("chat"), None);
    assert_eq!(RuleStore::open(&path).unwrap().get_service("chat"), None);
    let err = store.delete_service("chat").unwrap_err();
    assert!(matches!(err, RulesError::ServiceNotFound { ref name } if name == "chat"));
    assert_eq!(err.error_type(), "service_not_found");
    assert_eq!(store.snapshot().version(), RuleVersion(2));
}

#[test]
fn apply_whole_rule_set_and_roll_back() {
    let (_d, path, store) = setup(BASE);
    let v1 = store.snapshot().rules().clone();
    let mut v2 = v1.clone();
    v2.workers[0].weight = 3;
    assert_eq!(store.apply(v2).unwrap().version(), RuleVersion(2));
    assert_eq!(
        RuleStore::open(&path).unwrap().snapshot().rules().workers[0].weight,
        3
    );
    // Rolling back to the old content is a new version with the old content hash.
    let out = store.apply(v1).unwrap();
    assert_eq!(out.version(), RuleVersion(3));
    assert_eq!(
        store.snapshot().content_hash(),
        ContentHash::of(&rules_from_toml(BASE).unwrap()).unwrap()
    );
}

#[test]
fn failed_write_back_leaves_the_current_version() {
    let (dir, path, store) = setup(BASE);
    // Make the file's directory disappear: the temp file cannot be created.
    let gone = dir.path().join("gone");
    fs::create_dir(&gone).unwrap();
    let moved = gone.join("rules.toml");
    fs::rename(&path, &moved).unwrap();
    let store2 = RuleStore::open(&moved).unwrap();
    fs::remove_dir_all(&gone).unwrap();
    let err = store2
        .put_service(new_service("chat2", "other"))
        .unwrap_err();
    assert_eq!(err.error_type(), "rules_write");
    assert_eq!(store2.snapshot().version(), RuleVersion(1));
    assert_eq!(store2.get_service("chat2"), None);
    drop(store);
}

#[test]
fn concurrent_puts_are_serialized_and_all_persisted() {
    let (_d, path, store) = setup(BASE);
    let store = Arc::new(store);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                store
                    .put_service(new_service(&format!("s{i}"), &format!("m{i}")))
                    .unwrap()
            })
        })
        .collect();
    let mut versions: Vec<u64> = threads
        .into_iter()
        .map(|t| t.join().unwrap().version().0)
        .collect();
    versions.sort();
    assert_eq!(versions, (2..=9).collect::<Vec<_>>());
    let restarted = RuleStore::open(&path).unwrap();
    assert_eq!(restarted.list_services().len(), 10);
    assert_eq!(
        restarted.snapshot().content_hash(),
        store.snapshot().content_hash()
    );
}

#[test]
fn in_memory_store_applies_without_a_file() {
    let store = RuleStore::in_memory(rules_from_toml(BASE).unwrap()).unwrap();
    assert!(store.path().is_none());
    assert_eq!(
        store.reload_from_file().unwrap_err().error_type(),
        "no_rules_file"
    );
    assert_eq!(
        store.put_service(new_service("x", "y")).unwrap().version(),
        RuleVersion(2)
    );
}

#[test]
fn written_file_is_canonical_toml_with_a_header() {
    let (_d, path, store) = setup(BASE);
    store.put_service(new_service("chat2", "other")).unwrap();
    let text = fs::read_to_string(&path).unwrap();
    println!("{text}");
    assert!(text.starts_with("# kvgate rules file, written by the admin API (rule version 2"));
    assert!(text.contains("[[services]]\nname = \"chat2\""), "{text}");
    let reparsed = rules_from_toml(&text).unwrap();
    assert_eq!(&reparsed, store.snapshot().rules());
}

/// Cordons are part of the rule set: a change bumps the version and is written back to the file
/// (a restart keeps it), a repeat is `Unchanged`, lifting it restores the original content hash
/// (an empty list is not written), and an invalid id is refused.
#[test]
fn cordons_are_versioned_written_back_and_validated() {
    let (_d, path, store) = setup(BASE);
    let before = store.snapshot();
    let w = prefix_index::WorkerId("w1".into());
    let accept = |_: &routing_rules::RuleSnapshot| Ok(());
    let o = store.set_cordoned_with(&w, true, &accept).unwrap();
    assert!(matches!(o, ApplyOutcome::Applied { .. }), "{o:?}");
    assert!(store.snapshot().rules().is_cordoned(&w));
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.contains("cordoned = [\"w1\"]"), "{text}");
    let reopened = RuleStore::open(&path).unwrap();
    assert!(reopened.snapshot().rules().is_cordoned(&w));
    assert!(matches!(
        store.set_cordoned_with(&w, true, &accept).unwrap(),
        ApplyOutcome::Unchanged { .. }
    ));
    store.set_cordoned_with(&w, false, &accept).unwrap();
    assert_eq!(store.snapshot().content_hash(), before.content_hash());
    assert!(!fs::read_to_string(&path).unwrap().contains("cordoned"));
    // Ids are checked like every other id: valid and unique.
    let bad = prefix_index::WorkerId("no spaces".into());
    let err = store.set_cordoned_with(&bad, true, &accept).unwrap_err();
    assert!(err.to_string().contains("cordoned[0]"), "{err}");
    let mut rules = rules_from_toml(BASE).unwrap();
    rules.cordoned = vec![w.clone(), w.clone()];
    let problems = routing_rules::validate(&rules);
    assert!(
        problems.iter().any(|p| p.path == "cordoned[1].id"),
        "{problems:?}"
    );
}
