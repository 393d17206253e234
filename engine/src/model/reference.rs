//! A plain single-sequence, uncached Llama forward written only with candle tensor ops
//! (contiguous K/V, `candle_nn::rotary_emb::rope_i`, masked softmax attention), independent of
//! the paged executor's attention and RoPE code. Tests compare the executor against it.
//!
//! Cost: every call recomputes the whole sequence, `O(T² · hidden)` attention and
//! `O(T · params)` matmuls; it is a test oracle, not a serving path.

use candle_core::{DType, Device, Tensor};

use super::weights::LlamaWeights;
use crate::EngineError;

/// Logits of the last token of `tokens` (positions `0..tokens.len()`).
pub fn last_logits(weights: &LlamaWeights, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
    let dev = weights.device().clone();
    dev.with_context(|| last_logits_inner(weights, tokens))
}

fn last_logits_inner(w: &LlamaWeights, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
    if w.config().arch != super::weights::Architecture::Llama {
        // Biases, q/k norms and half-rotation RoPE are not in this oracle; other architectures
        // are checked against llama.cpp (engine/tests/vs_llamacpp.rs).
        return Err(EngineError::Model(format!(
            "the reference forward covers the llama architecture only, not {:?}",
            w.config().arch
        )));
    }
    if tokens.is_empty() {
        return Err(EngineError::InvalidRequest("empty sequence".into()));
    }
    let cfg = w.config();
    let dev = w.device();
    let t = tokens.len();
    let (hq, hk, d) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
    let rk = hq / hk;
    let dense = w.format().use_dense(t);

    // RoPE tables [t, d/2].
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_base.powf(2.0 * i as f32 / d as f32))
        .collect();
    let inv_freq = Tensor::from_vec(inv_freq, (1, d / 2), dev)?;
    let pos = Tensor::arange(0u32, t as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((t, 1))?;
    let angles = pos.matmul(&inv_freq)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), dev)?;

    let ids = Tensor::new(tokens, dev)?;
    let mut x = w.embedding.index_select(&ids, 0)?;
    for layer in &w.layers {
        let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
        let qkv = layer.wqkv.forward(&h, dense)?;
        let heads = |off: usize, n: usize| -> Result<Tensor, EngineError> {
            Ok(qkv
                .narrow(1, off * d, n * d)?
                .reshape((t, n, d))?
                .transpose(0, 1)?
                .contiguous()?
                .unsqueeze(0)?)
        };
        let q = candle_nn::rotary_emb::rope_i(&heads(0, hq)?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_i(&heads(hq, hk)?, &cos, &sin)?;
        let v = heads(hq + hk, hk)?;
        // Grouped KV heads: query head h reads KV head h / rk.
        let repeat = |x: Tensor| -> Result<Tensor, EngineError> {
            Ok(x.unsqueeze(2)?
                .expand((1, hk, rk, t, d))?
                .reshape((1, hq, t, d))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let att = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let att = att.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let o = att
            .matmul(&v.contiguous()?)?
            .squeeze(0)?
            .transpose(0, 1)?
            .reshape((t, hq * d))?;
        x = (x + layer.wo.forward(&o, dense)?)?;
        let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
        let gu = layer.w_gate_up.forward(&h, dense)?;
        let ffn = cfg.ffn;
        let act = (gu.narrow(1, 0, ffn)?.silu()? * gu.narrow(1, ffn, ffn)?)?;
        x = (x + layer.w_down.forward(&act, dense)?)?;
    }
    let last = x.narrow(0, t - 1, 1)?;
    let last = candle_nn::ops::rms_norm(&last, &w.output_norm, cfg.rms_eps)?;
    let logits = w.lm_head(&last)?;
    Ok(logits.squeeze(0)?.to_device(&Device::Cpu)?.to_vec1()?)
}

/// Greedy continuation of `prompt` for `n` tokens, recomputing the whole sequence each step.
pub fn greedy(weights: &LlamaWeights, prompt: &[u32], n: usize) -> Result<Vec<u32>, EngineError> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let logits = last_logits(weights, &seq)?;
        let next = argmax(&logits);
        out.push(next);
        seq.push(next);
    }
    Ok(out)
}

/// Index of the largest value (first on ties; 0 for an empty slice).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(super::argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(super::argmax(&[]), 0);
    }
}
