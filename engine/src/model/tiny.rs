//! Small GGUF files with deterministic pseudo-random F32 weights, one per architecture, with
//! the tokenizer (every `tokenizer.*` key) copied from another GGUF — so that llama.cpp and this
//! engine can both run them and be compared without downloading or committing weights
//! (`engine/tests/vs_llamacpp.rs`, `scripts/make-llamacpp-fixtures.sh`). 2 layers, width 64,
//! 4 query and 2 KV heads (head size 16; `qwen3`: 32, so that heads × head size ≠ width), FFN
//! 128, an untied output head (with the embedding as head every distribution would be a
//! near-certain repeat of the last token); about 15 MB with a 49k vocabulary.

/// The error of [`write_tiny_gguf`].
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// A splitmix64 stream of values uniform in (-scale, scale).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }
}

/// Writes the model for `arch` (`llama`, `llama3` — a llama file with RoPE frequency factors —
/// `qwen2`, `qwen3`, `phi3` — fused QKV and gate/up, half the head rotated — and `gemma3` —
/// 3 layers, the first two sliding over 4 positions) with `tokenizer_from`'s tokenizer
/// to `out`. Deterministic: the same inputs give the same bytes.
///
/// A `-FORMAT` suffix (`llama-q4_k`; formats `f16`, `bf16`, `q8_0`, `q4_0`, `q4_1`, `q5_k`,
/// `q4_k`, `q6_k`) stores every matrix but the embedding in that format (norms stay F32); the
/// K-quant ones use width 256 and FFN 512 (their blocks are 256 wide).
pub fn write_tiny_gguf(arch: &str, tokenizer_from: &Path, out: &Path) -> Result<()> {
    write_gguf(arch, Shape::Tiny, tokenizer_from, out)
}

/// The size of a generated model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The test size of [`write_tiny_gguf`] (seconds to run, every code path).
    Tiny,
    /// SmolLM2-135M's shapes — 30 layers, width 576, 9 query and 3 KV heads of 64, FFN 1536
    /// (`gemma3`: every 6th layer global, the others sliding over 512 positions) — so that a
    /// speed comparison runs the matrices of a real small model. Only formats with 32-wide
    /// blocks (576 is not a multiple of the K-quants' 256).
    Bench,
}

/// [`write_tiny_gguf`] at any [`Shape`].
pub fn write_gguf(arch: &str, shape: Shape, tokenizer_from: &Path, out: &Path) -> Result<()> {
    let (arch, fmt) = match arch.split_once('-') {
        Some((a, f)) => (a, Some(format_named(f)?)),
        None => (arch, None),
    };
    let kquant = matches!(fmt, Some(GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K));
    if kquant && shape == Shape::Bench {
        return Err("the bench shape (width 576) cannot hold 256-wide K-quant blocks".into());
    }
    let mut f = std::fs::File::open(tokenizer_from)?;
    let src = gguf_file::Content::read(&mut f)?;
    let mut tok: Vec<(String, Value)> = src
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    tok.sort_by(|a, b| a.0.cmp(&b.0));
    let vocab = match src.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a.len(),
        _ => return Err("the tokenizer GGUF has no tokenizer.ggml.tokens".into()),
    };
    let (hidden, heads, kv_heads, ffn) = match (shape, kquant) {
        (Shape::Bench, _) => (576usize, 9usize, 3usize, 1536usize),
        (Shape::Tiny, true) => (256, 4, 2, 512),
        (Shape::Tiny, false) => (64, 4, 2, 128),
    };
    // gemma3 (tiny): 3 layers, the last global, the first two sliding over 4 positions.
    let layers = match shape {
        Shape::Bench => 30usize,
        Shape::Tiny if arch == "gemma3" => 3,
        Shape::Tiny => 2,
    };
    let (window, pattern) = match shape {
        Shape::Bench => (512u32, 6u32),
        Shape::Tiny => (4, 3),
    };
    let variant = arch;
    // `llama3` is a `llama` file with Llama 3.1-style RoPE frequency factors.
    let arch = if variant == "llama3" {
        "llama"
    } else {
        variant
    };
    let head_dim = if arch == "qwen3" && shape == Shape::Tiny {
        32
    } else {
        hidden / heads
    };
    let rope_base = match variant {
        "llama" => 10_000.0f32,
        "llama3" => 500_000.0,
        _ => 1_000_000.0,
    };
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("kvgate tiny {variant}")),
        ),
        (format!("{arch}.context_length"), Value::U32(2048)),
        (
            format!("{arch}.embedding_length"),
            Value::U32(hidden as u32),
        ),
        (format!("{arch}.block_count"), Value::U32(layers as u32)),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(ffn as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(kv_heads as u32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(rope_base)),
    ];
    if arch == "gemma3" {
        meta.push((
            format!("{arch}.attention.sliding_window"),
            Value::U32(window),
        ));
        meta.push((
            format!("{arch}.attention.sliding_window_pattern"),
            Value::U32(pattern),
        ));
        meta.push((format!("{arch}.rope.freq_base_swa"), Value::F32(10_000.0)));
        // A cap near the logits' scale, so that soft-capping changes them measurably.
        meta.push((format!("{arch}.final_logit_softcapping"), Value::F32(3.0)));
    }
    if arch == "phi3" {
        // Partial rotary: half of each head rotates.
        meta.push((
            format!("{arch}.rope.dimension_count"),
            Value::U32((head_dim / 2) as u32),
        ));
    }
    if arch == "qwen3" {
        meta.push((
            format!("{arch}.attention.key_length"),
            Value::U32(head_dim as u32),
        ));
        meta.push((
            format!("{arch}.attention.value_length"),
            Value::U32(head_dim as u32),
        ));
    }
    meta.extend(tok);

    let mut rng = Rng(0x6b76_6761_7465 ^ variant.len() as u64);
    let dev = Device::Cpu;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: String, shape: &[usize], values: Vec<f32>| -> Result<()> {
        let t = Tensor::from_vec(values, shape, &dev)?;
        let dtype = match fmt {
            Some(f) if shape.len() == 2 && name != "token_embd.weight" => f,
            _ => GgmlDType::F32,
        };
        tensors.push((name, QTensor::quantize(&t, dtype)?));
        Ok(())
    };
    add(
        "token_embd.weight".into(),
        &[vocab, hidden],
        rng.values(vocab * hidden, 1.0),
    )?;
    let norm = |rng: &mut Rng, n: usize| rng.values(n, 0.2).into_iter().map(|v| 1.0 + v).collect();
    for i in 0..layers {
        let p = |s: &str| format!("blk.{i}.{s}");
        let s_in = 1.0 / (hidden as f32).sqrt();
        add(p("attn_norm.weight"), &[hidden], norm(&mut rng, hidden))?;
        if arch == "phi3" {
            let rows = (heads + 2 * kv_heads) * head_dim;
            add(
                p("attn_qkv.weight"),
                &[rows, hidden],
                rng.values(rows * hidden, s_in),
            )?;
        } else {
            add(
                p("attn_q.weight"),
                &[heads * head_dim, hidden],
                rng.values(heads * head_dim * hidden, s_in),
            )?;
            add(
                p("attn_k.weight"),
                &[kv_heads * head_dim, hidden],
                rng.values(kv_heads * head_dim * hidden, s_in),
            )?;
            add(
                p("attn_v.weight"),
                &[kv_heads * head_dim, hidden],
                rng.values(kv_heads * head_dim * hidden, s_in),
            )?;
        }
        if arch == "qwen2" {
            add(
                p("attn_q.bias"),
                &[heads * head_dim],
                rng.values(heads * head_dim, 0.5),
            )?;
            add(
                p("attn_k.bias"),
                &[kv_heads * head_dim],
                rng.values(kv_heads * head_dim, 0.5),
            )?;
            add(
                p("attn_v.bias"),
                &[kv_heads * head_dim],
                rng.values(kv_heads * head_dim, 0.5),
            )?;
        }
        if arch == "gemma3" {
            add(
                p("post_attention_norm.weight"),
                &[hidden],
                norm(&mut rng, hidden),
            )?;
            add(p("post_ffw_norm.weight"), &[hidden], norm(&mut rng, hidden))?;
        }
        if arch == "qwen3" || arch == "gemma3" {
            add(
                p("attn_q_norm.weight"),
                &[head_dim],
                norm(&mut rng, head_dim),
            )?;
            add(
                p("attn_k_norm.weight"),
                &[head_dim],
                norm(&mut rng, head_dim),
            )?;
        }
        let s_o = 1.0 / ((heads * head_dim) as f32).sqrt();
        add(
            p("attn_output.weight"),
            &[hidden, heads * head_dim],
            rng.values(hidden * heads * head_dim, s_o),
        )?;
        add(p("ffn_norm.weight"), &[hidden], norm(&mut rng, hidden))?;
        if arch == "phi3" {
            add(
                p("ffn_up.weight"),
                &[2 * ffn, hidden],
                rng.values(2 * ffn * hidden, s_in),
            )?;
        } else {
            add(
                p("ffn_gate.weight"),
                &[ffn, hidden],
                rng.values(ffn * hidden, s_in),
            )?;
            add(
                p("ffn_up.weight"),
                &[ffn, hidden],
                rng.values(ffn * hidden, s_in),
            )?;
        }
        add(
            p("ffn_down.weight"),
            &[hidden, ffn],
            rng.values(hidden * ffn, 1.0 / (ffn as f32).sqrt()),
        )?;
    }
    add(
        "output_norm.weight".into(),
        &[hidden],
        norm(&mut rng, hidden),
    )?;
    if variant == "llama3" {
        // Factors 1..8 over the frequencies, as Llama 3.1's scaling spans them.
        let f: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 + 7.0 * i as f32 / (head_dim / 2 - 1) as f32)
            .collect();
        add("rope_freqs.weight".into(), &[head_dim / 2], f)?;
    }
    // An untied head: with the embedding as head, the last input token's own row dominates and
    // every distribution is a near-certain repeat, which would test little.
    add(
        "output.weight".into(),
        &[vocab, hidden],
        rng.values(vocab * hidden, 2.0 / (hidden as f32).sqrt()),
    )?;

    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
    use std::io::Write;
    w.flush()?;
    Ok(())
}

/// The storage format a `-FORMAT` suffix names.
fn format_named(name: &str) -> Result<GgmlDType> {
    Ok(match name {
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        other => return Err(format!("unknown weight format `{other}`").into()),
    })
}
