use std::sync::Arc;
use worker::executor::{Executor, KvGeometry, SeqChunk};
use worker::model::{reference, LlamaExecutor, LlamaWeights, WeightFormat};
#[test]
fn dbg() {
    let w = Arc::new(LlamaWeights::load("../models/SmolLM2-135M-Instruct.Q4_1.gguf", &candle_core::Device::Cpu, WeightFormat::Q8_0).unwrap());
    let toks = [1u32, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    let md = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let r1 = reference::last_logits(&w, &toks).unwrap();
    let r2 = reference::last_logits(&w, &toks).unwrap();
    println!("ref vs ref {}", md(&r1, &r2));
    let tbl: Vec<u32> = (0..8).collect();
    let mut e = LlamaExecutor::new(w.clone(), KvGeometry { block_size: 8, num_blocks: 8 }).unwrap();
    let a = e.forward(&[SeqChunk { tokens: &toks, start_pos: 0, block_table: &tbl, want_logits: true }]).unwrap()[0].clone().unwrap();
    let b = e.forward(&[SeqChunk { tokens: &toks, start_pos: 0, block_table: &tbl, want_logits: true }]).unwrap()[0].clone().unwrap();
    println!("exec vs exec {} exec vs ref {}", md(&a, &b), md(&a, &r1));
    let c = e.forward(&[SeqChunk { tokens: &toks[..30], start_pos: 0, block_table: &tbl, want_logits: false }]).unwrap();
    let c = e.forward(&[SeqChunk { tokens: &toks[30..], start_pos: 30, block_table: &tbl, want_logits: true }]).unwrap()[0].clone().unwrap();
    println!("exec chunked vs exec {}", md(&a, &c));
}
