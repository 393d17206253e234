//! A corrupt GGUF header cannot make the metadata reader allocate much more than the file:
//! peak heap use while reading hostile headers stays within a small multiple of their size.
//! (Its own test binary: the global allocator below counts every allocation of the process.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use prompt_profile::GgufMetadata;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A header of `kv_count` entries whose first is an array of `count` elements of type `elem`,
/// padded with `pad` zero bytes (so the file is big enough for the count to pass the room check
/// of a 1-byte element, but the elements themselves are garbage or missing).
fn hostile(kv_count: u64, elem: u32, count: u64, pad: usize) -> Vec<u8> {
    hostile_with(kv_count, elem, count, pad, 0)
}

fn hostile_with(kv_count: u64, elem: u32, count: u64, pad: usize, fill: u8) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend(kv_count.to_le_bytes());
    let key = b"tokenizer.ggml.token_type";
    out.extend((key.len() as u64).to_le_bytes());
    out.extend(key);
    out.extend(9u32.to_le_bytes());
    out.extend(elem.to_le_bytes());
    out.extend(count.to_le_bytes());
    out.extend(std::iter::repeat_n(fill, pad));
    out
}

fn peak_while(bytes: &[u8]) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let r = GgufMetadata::from_reader(bytes, bytes.len() as u64, "hostile.gguf".into());
    let peak = PEAK.load(Ordering::SeqCst) - base;
    drop(r);
    peak
}

#[test]
fn hostile_counts_allocate_in_proportion_to_the_file() {
    let size = 1 << 20;
    // u8 elements: 1 byte encoded, a count as large as the file allows. The elements parse (zeros
    // are valid u8s), so the reader really holds `size` values: that is the representation's
    // cost (~32 bytes per value), bounded by the file, not the count.
    for (elem, count) in [
        (0u32, size as u64),
        (5, (size / 4) as u64),
        (8, u64::MAX / 16),
    ] {
        let bytes = hostile(1, elem, count, size);
        let peak = peak_while(&bytes);
        assert!(
            peak <= 80 * bytes.len(),
            "element type {elem}, count {count}: peak {peak} bytes for a {}-byte file",
            bytes.len()
        );
    }
    // A count that passes the room check but whose elements are garbage (bools must be 0 or 1):
    // the reader fails at the first one having allocated about the file, not count × 32 bytes
    // up front.
    let bytes = hostile_with(1, 7, size as u64, size, 0xff);
    let peak = peak_while(&bytes);
    assert!(
        peak <= 4 * bytes.len(),
        "peak {peak} for {} bytes",
        bytes.len()
    );
    // A metadata count far beyond the entries present.
    let bytes = hostile(u64::from(u32::MAX), 0, 1, size);
    let peak = peak_while(&bytes);
    assert!(
        peak <= 4 * bytes.len(),
        "peak {peak} for {} bytes",
        bytes.len()
    );
}
