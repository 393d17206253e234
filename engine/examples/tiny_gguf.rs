//! Writes a small GGUF with deterministic pseudo-random weights for one architecture
//! (`engine::model::tiny`): `cargo run --example tiny_gguf -- ARCH TOKENIZER_GGUF OUT`, ARCH one
//! of `llama`, `qwen2`, `qwen3`. Used by scripts/make-llamacpp-fixtures.sh.

fn main() -> engine::model::tiny::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        return Err("usage: tiny_gguf ARCH TOKENIZER_GGUF OUT".into());
    }
    engine::model::tiny::write_tiny_gguf(
        &args[1],
        std::path::Path::new(&args[2]),
        std::path::Path::new(&args[3]),
    )
}
