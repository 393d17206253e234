use std::sync::Arc;
use worker::executor::{Executor, KvGeometry, SeqChunk};
use worker::model::{reference, LlamaExecutor, LlamaWeights, WeightFormat};
#[test]
fn dbg() {
    let w = Arc::new(LlamaWeights::load("../models/SmolLM2-135M-Instruct.Q4_1.gguf", &candle_core::Device::Cpu, WeightFormat::F32).unwrap());
    let toks = [1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    for (n, bs) in [(8, 64), (16, 64), (17, 64), (30, 64), (37, 64), (8, 4), (17, 4), (37, 4)] {
        let mut e = LlamaExecutor::new(w.clone(), KvGeometry { block_size: bs, num_blocks: 64 }).unwrap();
        let out = e.forward(&[SeqChunk { tokens: &toks[..n], start_pos: 0, block_table: &(0..64).collect::<Vec<u32>>(), want_logits: true }]).unwrap();
        let a = out[0].clone().unwrap();
        let b = reference::last_logits(&w, &toks[..n]).unwrap();
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        println!("n={n} bs={bs} diff {d} argmax {} {}", reference::argmax(&a), reference::argmax(&b));
    }
}
#[test]
fn dbg_greedy() {
    let w = Arc::new(LlamaWeights::load("../models/SmolLM2-135M-Instruct.Q4_1.gguf", &candle_core::Device::Cpu, WeightFormat::F32).unwrap());
    let toks = [1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    println!("greedy F32 {:?}", reference::greedy(&w, &toks, 10).unwrap());
}
