//! Writes a GGUF with deterministic pseudo-random weights for one architecture
//! (`engine::model::tiny`): `cargo run --example tiny_gguf -- ARCH[-FORMAT] TOKENIZER_GGUF OUT
//! [--bench-shape]`, ARCH one of `llama`, `llama3`, `qwen2`, `qwen3`, `phi3`, `gemma3`.
//! `--bench-shape` writes SmolLM2-135M's shapes instead of the test size (for
//! scripts/bench-architectures.sh). Used by scripts/make-llamacpp-fixtures.sh.

fn main() -> engine::model::tiny::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = match (args.len(), args.get(4).map(String::as_str)) {
        (4, None) => engine::model::tiny::Shape::Tiny,
        (5, Some("--bench-shape")) => engine::model::tiny::Shape::Bench,
        _ => {
            return Err("usage: tiny_gguf ARCH[-FORMAT] TOKENIZER_GGUF OUT [--bench-shape]".into())
        }
    };
    engine::model::tiny::write_gguf(
        &args[1],
        shape,
        std::path::Path::new(&args[2]),
        std::path::Path::new(&args[3]),
    )
}
