//! Shared helpers of the model-backed executor tests (`model_executor.rs`,
//! `device_executor.rs`): the default model's path, the golden prompts and drivers
//! (`engine::model::golden`), logit distances and scattered block tables. Included with `mod model_common;`; built alone it has no tests.
#![allow(dead_code)]

use std::path::PathBuf;

use engine::executor::BlockId;
pub use engine::model::golden::*;

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join(MODEL_FILE);
    assert!(
        p.is_file(),
        "model file {} is missing: fetch it (see README) or set KVGATE_MODEL_DIR",
        p.display()
    );
    p
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Block tables drawn from a shuffled pool so that positions are scattered over the cache.
pub fn scattered_tables(
    lens: &[usize],
    block_size: usize,
    num_blocks: usize,
    seed: u64,
) -> Vec<Vec<BlockId>> {
    let mut ids: Vec<BlockId> = (0..num_blocks as BlockId).collect();
    let mut s = seed | 1;
    for i in (1..ids.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ids.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut next = 0;
    lens.iter()
        .map(|&l| {
            let n = l.div_ceil(block_size);
            let t = ids[next..next + n].to_vec();
            next += n;
            t
        })
        .collect()
}
