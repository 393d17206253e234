//! Signing off the request path: [`PrecomputedSigner`] signs with a key pair's Ed25519 key using
//! nonces computed ahead of time by an owned background thread.
//!
//! An Ed25519 signature (RFC 8032 §5.1.6) is `R || S` with `R = r·B`, `k = SHA-512(R || A || M)`,
//! `S = r + k·a mod L`. Almost all of its cost is the base-point multiplication `r·B` and the
//! encoding of `R` (a field inversion), and neither depends on the message *if* `r` does not:
//! RFC 8032 derives `r = SHA-512(prefix || M)` so that signing needs no randomness, but a
//! verifier cannot tell how `r` was chosen — any secret, uniformly distributed `r` used for one
//! message only gives a standard signature that every RFC 8032 verifier accepts (this is plain
//! Schnorr signing; the deterministic derivation only removes the dependence on a random source).
//!
//! Here `r = SHA-512(prefix || seed || n) mod L` ("hedged"): `prefix` is the key's secret
//! RFC 8032 hash prefix, `seed` 32 fresh bytes from the operating system's random source per
//! batch of nonces and `n` a counter, so `r` stays secret and unpredictable even if the random
//! source were weak, and distinct as long as the (seed, n) pairs are. The background thread keeps
//! a pool of `(r, encoded R)` pairs topped up; [`PrecomputedSigner::sign`] pops one pair — each is used for
//! exactly one signature and then dropped — and does the two cheap steps (one SHA-512 over the
//! message, one scalar multiply-add). When the pool is empty (a burst larger than it, or before the
//! thread's first batch) it signs the RFC 8032 deterministic way instead, so signing never waits.
//!
//! What changes for a reader of the signatures: nothing in verification; only that signing the
//! same bytes twice gives two different (both valid) signatures. Tests check every signature with
//! ed25519-dalek's strict verifier.
//!
//! Cost: [`PrecomputedSigner::sign`] is O(message length) with one mutex pop; the thread spends
//! one base-point multiplication per nonce.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use curve25519_dalek::edwards::EdwardsPoint;
use curve25519_dalek::scalar::Scalar;
use ed25519_dalek::hazmat::ExpandedSecretKey;
use rand::RngCore;
use sha2::{Digest, Sha512};

use crate::keys::{KeyId, KeyPair};

/// What signs tickets, receipts and access tokens: a key id and Ed25519 signatures under it.
pub trait Signer {
    /// The id of the signing key.
    fn key_id(&self) -> &KeyId;
    /// The 64-byte Ed25519 signature of `message`.
    fn sign_message(&self, message: &[u8]) -> [u8; 64];
}

impl Signer for KeyPair {
    fn key_id(&self) -> &KeyId {
        KeyPair::key_id(self)
    }
    fn sign_message(&self, message: &[u8]) -> [u8; 64] {
        self.sign(message)
    }
}

/// Nonces made per refill step (one random seed each).
const BATCH: usize = 8;

struct Nonce {
    r: Scalar,
    encoded_r: [u8; 32],
}

struct Shared {
    pool: Mutex<VecDeque<Nonce>>,
    wake: Condvar,
    stop: AtomicBool,
    capacity: usize,
    precomputed: AtomicU64,
    fallbacks: AtomicU64,
}

/// An Ed25519 signer with nonces computed ahead by an owned background thread (see the module
/// documentation). Stops and joins its thread on drop.
pub struct PrecomputedSigner {
    key: KeyPair,
    secret: ExpandedSecretKey,
    public: [u8; 32],
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PrecomputedSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrecomputedSigner")
            .field("key_id", self.key.key_id())
            .field("capacity", &self.shared.capacity)
            .finish_non_exhaustive()
    }
}

/// Counts of signatures made since the signer started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignerStats {
    /// With a precomputed nonce.
    pub precomputed: u64,
    /// The RFC 8032 deterministic way (the pool was empty).
    pub fallbacks: u64,
}

impl PrecomputedSigner {
    /// A signer for `key` keeping up to `capacity` nonces ready; starts its thread. With
    /// `capacity` 0 there is no thread and every signature is the deterministic one.
    pub fn new(key: KeyPair, capacity: usize) -> std::io::Result<PrecomputedSigner> {
        let secret = ExpandedSecretKey::from(&key.signing_key().to_bytes());
        let public = key.signing_key().verifying_key().to_bytes();
        let shared = Arc::new(Shared {
            pool: Mutex::new(VecDeque::with_capacity(capacity)),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            capacity,
            precomputed: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        });
        let prefix = secret.hash_prefix;
        let thread = if capacity == 0 {
            None
        } else {
            Some(
                std::thread::Builder::new()
                    .name("kvgate-nonces".into())
                    .spawn({
                        let shared = shared.clone();
                        move || refill(&shared, prefix)
                    })?,
            )
        };
        Ok(PrecomputedSigner {
            key,
            secret,
            public,
            shared,
            thread,
        })
    }

    /// The key pair.
    pub fn key(&self) -> &KeyPair {
        &self.key
    }

    /// Signatures made so far, by kind.
    pub fn stats(&self) -> SignerStats {
        SignerStats {
            precomputed: self.shared.precomputed.load(Ordering::Relaxed),
            fallbacks: self.shared.fallbacks.load(Ordering::Relaxed),
        }
    }

    /// Nonces ready now.
    pub fn ready(&self) -> usize {
        self.shared.pool.lock().map_or(0, |p| p.len())
    }

    /// The 64-byte Ed25519 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        let nonce = match self.shared.pool.lock() {
            Ok(mut pool) => {
                let n = pool.pop_front();
                if self.thread.is_some() && pool.len() <= low_water(self.shared.capacity) {
                    self.shared.wake.notify_one();
                }
                n
            }
            Err(_) => None,
        };
        let Some(nonce) = nonce else {
            self.shared.fallbacks.fetch_add(1, Ordering::Relaxed);
            return self.key.sign(message);
        };
        self.shared.precomputed.fetch_add(1, Ordering::Relaxed);
        let mut h = Sha512::new();
        h.update(nonce.encoded_r);
        h.update(self.public);
        h.update(message);
        let k = Scalar::from_bytes_mod_order_wide(&h.finalize().into());
        let s = k * self.secret.scalar + nonce.r;
        let mut sig = [0u8; 64];
        sig[..32].copy_from_slice(&nonce.encoded_r);
        sig[32..].copy_from_slice(s.as_bytes());
        sig
    }
}

impl Signer for PrecomputedSigner {
    fn key_id(&self) -> &KeyId {
        self.key.key_id()
    }
    fn sign_message(&self, message: &[u8]) -> [u8; 64] {
        self.sign(message)
    }
}

impl Drop for PrecomputedSigner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Take the lock so the thread is either waiting (and gets the notification) or will see
        // the flag before it waits again.
        drop(self.shared.pool.lock());
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Puts the calling thread in Linux's `SCHED_IDLE` class: it runs only on CPU no other thread
/// wants, and any waking request thread preempts it. At normal priority the refill thread's
/// bursts (64 base-point multiplications, ~1 ms) competed with the proxy threads on a 2-core box
/// and gave 1-connection GETs a 5 ms p99 (270 µs without it); at idle priority a saturated box
/// simply drains the pool and signs the deterministic way, as without this signer.
fn idle_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid, initialized sched_param.
        // Refused (a sandbox without the syscall): the thread keeps normal priority.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    }
}

/// The pool is refilled when it holds at most this many nonces (half of `capacity`).
fn low_water(capacity: usize) -> usize {
    capacity / 2
}

/// The background loop: fill the pool to capacity in batches, sleep until it drains to the low
/// water mark, fill it again; return when asked to stop.
fn refill(shared: &Shared, prefix: [u8; 32]) {
    idle_priority();
    let mut counter: u64 = 0;
    let mut filling = true;
    loop {
        let room = {
            let Ok(mut pool) = shared.pool.lock() else {
                return;
            };
            loop {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                if pool.len() >= shared.capacity {
                    filling = false;
                } else if pool.len() <= low_water(shared.capacity) {
                    filling = true;
                }
                if filling {
                    break shared.capacity - pool.len();
                }
                pool = match shared.wake.wait(pool) {
                    Ok(p) => p,
                    Err(_) => return,
                };
            }
        };
        let mut seed = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut seed);
        let made: Vec<Nonce> = (0..room.min(BATCH))
            .map(|_| {
                counter = counter.wrapping_add(1);
                let mut h = Sha512::new();
                h.update(prefix);
                h.update(seed);
                h.update(counter.to_le_bytes());
                let r = Scalar::from_bytes_mod_order_wide(&h.finalize().into());
                let encoded_r = EdwardsPoint::mul_base(&r).compress().to_bytes();
                Nonce { r, encoded_r }
            })
            .collect();
        let Ok(mut pool) = shared.pool.lock() else {
            return;
        };
        pool.extend(made);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn verifies(key: &KeyPair, msg: &[u8], sig: &[u8; 64]) -> bool {
        let vk = key.signing_key().verifying_key();
        vk.verify_strict(msg, &ed25519_dalek::Signature::from_bytes(sig))
            .is_ok()
    }

    fn wait_ready(s: &PrecomputedSigner, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.ready() < n {
            assert!(Instant::now() < deadline, "the pool never filled");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn precomputed_signatures_verify_strictly_and_never_repeat_a_nonce() {
        let key = KeyPair::generate();
        let s = PrecomputedSigner::new(key.clone(), 256).unwrap();
        wait_ready(&s, 256);
        let mut rs = std::collections::HashSet::new();
        for i in 0..600u32 {
            let msg = format!("ticket {i}");
            let sig = s.sign(msg.as_bytes());
            assert!(verifies(&key, msg.as_bytes(), &sig), "signature {i}");
            assert!(!verifies(&key, b"another message", &sig));
            assert!(rs.insert(sig[..32].to_vec()), "nonce reused at {i}");
        }
        let st = s.stats();
        assert_eq!(st.precomputed + st.fallbacks, 600);
        assert!(st.precomputed >= 256, "{st:?}");
    }

    #[test]
    fn the_same_message_gets_distinct_valid_signatures() {
        let key = KeyPair::from_seed(&[7; 32]);
        let s = PrecomputedSigner::new(key.clone(), 8).unwrap();
        wait_ready(&s, 8);
        let a = s.sign(b"same");
        let b = s.sign(b"same");
        assert_ne!(a, b);
        assert!(verifies(&key, b"same", &a) && verifies(&key, b"same", &b));
        // The deterministic fallback is RFC 8032's own signature.
        assert_eq!(key.sign(b"same"), key.sign(b"same"));
    }

    #[test]
    fn an_empty_pool_falls_back_to_deterministic_signing() {
        let key = KeyPair::generate();
        let s = PrecomputedSigner::new(key.clone(), 1).unwrap();
        // Drain faster than one nonce refills: some signatures must be fallbacks, all valid.
        for i in 0..200u32 {
            let m = i.to_le_bytes();
            assert!(verifies(&key, &m, &s.sign(&m)));
        }
        let st = s.stats();
        assert_eq!(st.precomputed + st.fallbacks, 200);
        assert!(st.fallbacks > 0, "{st:?}");
    }

    #[test]
    fn capacity_zero_signs_deterministically_without_a_thread() {
        let key = KeyPair::from_seed(&[3; 32]);
        let s = PrecomputedSigner::new(key.clone(), 0).unwrap();
        assert!(s.thread.is_none());
        assert_eq!(s.sign(b"m"), key.sign(b"m"));
        assert_eq!(s.stats().fallbacks, 1);
    }

    #[test]
    fn dropping_the_signer_stops_its_thread() {
        let s = PrecomputedSigner::new(KeyPair::generate(), 64).unwrap();
        wait_ready(&s, 64);
        let t = Instant::now();
        drop(s);
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use curve25519_dalek::constants::ED25519_BASEPOINT_POINT;
    use curve25519_dalek::edwards::EdwardsBasepointTableRadix256;
    use curve25519_dalek::traits::BasepointTable;
    use std::time::Instant;

    /// What a signature costs, by kind (run on purpose:
    /// `cargo test --workspace --lib -- signer::timing --ignored --nocapture`).
    #[test]
    #[ignore = "timing; run with --ignored --nocapture"]
    fn signature_costs() {
        let key = KeyPair::generate();
        let msg = vec![b'x'; 420];
        let n = 3000u32;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(key.sign(&msg));
        }
        let det = t.elapsed() / n;
        let table16 = curve25519_dalek::constants::ED25519_BASEPOINT_TABLE;
        let table256 = EdwardsBasepointTableRadix256::create(&ED25519_BASEPOINT_POINT);
        let r = Scalar::from_bytes_mod_order_wide(&[9; 64]);
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(table16.mul_base(&r).compress());
        }
        let n16 = t.elapsed() / n;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(table256.mul_base(&r).compress());
        }
        let n256 = t.elapsed() / n;
        let s = PrecomputedSigner::new(key, n as usize).unwrap();
        while s.ready() < n as usize {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(s.sign(&msg));
        }
        let pre = t.elapsed() / n;
        let ring_key = ring::signature::Ed25519KeyPair::from_seed_unchecked(&[7; 32]).unwrap();
        let dalek_key = KeyPair::from_seed(&[7; 32]);
        assert_eq!(ring_key.sign(&msg).as_ref(), &dalek_key.sign(&msg)[..]);
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(dalek_key.sign_reference(&msg));
        }
        let dalek_det = t.elapsed() / n;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(ring_key.sign(&msg));
        }
        let ring_det = t.elapsed() / n;
        let sig = dalek_key.sign(&msg);
        let public = dalek_key.public().clone();
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(public.verify(&msg, &sig));
        }
        let dalek_verify = t.elapsed() / n;
        let ring_public = ring::signature::UnparsedPublicKey::new(
            &ring::signature::ED25519,
            ring::signature::KeyPair::public_key(&ring_key)
                .as_ref()
                .to_vec(),
        );
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(ring_public.verify(&msg, &sig).is_ok());
        }
        let ring_verify = t.elapsed() / n;
        println!(
            "deterministic sign: AWS-LC (KeyPair::sign) {det:?}, ed25519-dalek {dalek_det:?}, \
             ring {ring_det:?}; verify: dalek strict {dalek_verify:?}, ring {ring_verify:?}"
        );
        println!(
            "nonce r·B+encode radix-16 {n16:?}, radix-256 {n256:?}; \
             sign with a ready nonce {pre:?} ({:?})",
            s.stats()
        );
    }
}
