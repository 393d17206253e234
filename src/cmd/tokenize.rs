//! `kvgate tokenize`: render a chat with a model's prompt profile and print the prompt, the
//! token ids and the profile identity.
//!
//! `--model` is a GGUF file (metadata only is read; a vocabulary-only GGUF works with
//! `--chat-template`) or a folder holding a HF `tokenizer.json` + `tokenizer_config.json`;
//! `--chat-template FILE` replaces the model's template. The input is `--messages FILE.json`
//! (an array of OpenAI messages, or a chat completion body: its `tools`, `tool_choice`,
//! `documents`, `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`
//! shape the prompt exactly as in a worker; `-` reads stdin) or `--text T` (one user message;
//! with `--raw`, T is completion text, tokenized as a worker tokenizes a completion prompt).
//! Every failure (missing file, not a GGUF, malformed JSON, a template rejecting a role) is
//! one line on stderr and exit status 1.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use prompt_profile::{
    parse_messages, ChatMessage, ChatPrompt, ChatTemplateFields, PromptProfile, PromptSource,
};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "messages"])))]
pub struct Args {
    /// A GGUF model file, or a folder with tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    pub model: PathBuf,
    /// A Jinja chat template to use instead of the model's (required for a GGUF without one).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Text of a single user message (or, with --raw, text to tokenize without template).
    #[arg(long)]
    pub text: Option<String>,
    /// JSON file with the messages (an array, or an object with `messages`); `-` for stdin.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Tokenize --text as is (special tokens parsed), without the chat template.
    #[arg(long, requires = "text")]
    pub raw: bool,
    /// Do not append the assistant generation prompt.
    #[arg(long)]
    pub no_generation_prompt: bool,
    /// Override the profile revision.
    #[arg(long)]
    pub revision: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let template = match &args.chat_template {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading the chat template {}", f.display()))?,
        ),
        None => None,
    };
    let mut profile = load_profile(&args.model, template)?;
    if let Some(rev) = &args.revision {
        profile = profile.with_revision(rev.clone());
    }
    // The same prompt contract as the worker's: completion text or a chat prompt.
    let (source, text) = if let (true, Some(text)) = (args.raw, &args.text) {
        (PromptSource::Text(text.clone()), text.clone())
    } else {
        let chat = match (&args.text, &args.messages) {
            (Some(text), _) => ChatTemplateFields {
                add_generation_prompt: Some(!args.no_generation_prompt),
                ..ChatTemplateFields::default()
            }
            .prompt(vec![ChatMessage::new("user", text.clone())])
            .map_err(|e| anyhow::anyhow!("`{}`: {}", e.param, e.reason))?,
            (None, Some(file)) => read_chat(file, args.no_generation_prompt)?,
            (None, None) => anyhow::bail!("one of --text or --messages is required"),
        };
        let text = profile
            .render_chat(&chat)
            .context("rendering the chat template")?;
        (PromptSource::Chat(chat), text)
    };
    let ids = profile
        .prompt_ids(&source)
        .context("tokenizing the prompt")?;
    let identity = profile.identity();
    if args.json {
        let out = serde_json::json!({
            "identity": identity,
            "digest": identity.digest(),
            "prompt": text,
            "ids": ids,
            "num_tokens": ids.len(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("profile");
        println!("  model_id          {}", identity.model_id);
        println!("  revision          {}", identity.revision);
        println!("  template_sha256   {}", identity.template_sha256);
        println!("  tokenizer_sha256  {}", identity.tokenizer_sha256);
        println!("  context_limit     {}", identity.context_limit);
        println!("  eos_token_ids     {:?}", identity.eos_token_ids);
        match identity.bos_token_id {
            Some(id) => println!("  bos_token_id      {id}"),
            None => println!("  bos_token_id      none"),
        }
        println!("  digest            {}", identity.digest());
        println!("prompt ({} bytes)", text.len());
        println!("{text}");
        println!("ids ({} tokens)", ids.len());
        println!("{ids:?}");
    }
    if ids.len() > identity.context_limit as usize {
        eprintln!(
            "kvgate: warning: {} prompt tokens exceed the context limit {}",
            ids.len(),
            identity.context_limit
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The prompt profile of a GGUF file or a model folder (`tokenizer.json`,
/// `tokenizer_config.json`), the template replaced by `template` when given.
pub(crate) fn load_profile(
    model: &Path,
    template: Option<String>,
) -> anyhow::Result<PromptProfile> {
    let profile = match (model.is_dir(), template) {
        (true, None) => PromptProfile::from_hf(
            model.join("tokenizer.json"),
            model.join("tokenizer_config.json"),
        ),
        (true, Some(t)) => PromptProfile::from_hf_with_template(
            model.join("tokenizer.json"),
            model.join("tokenizer_config.json"),
            t,
        ),
        (false, None) => PromptProfile::from_gguf(model),
        (false, Some(t)) => PromptProfile::from_gguf_with_template(model, t),
    };
    profile.with_context(|| format!("loading the prompt profile from {}", model.display()))
}

/// A messages file: an array of messages, or a chat completion body whose prompt-shaping
/// fields are read as a worker reads them.
fn read_chat(file: &Path, no_generation_prompt: bool) -> anyhow::Result<ChatPrompt> {
    let (name, bytes) = if file == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading messages from stdin")?;
        ("stdin".to_string(), buf)
    } else {
        let bytes = std::fs::read(file)
            .with_context(|| format!("reading messages from {}", file.display()))?;
        (file.display().to_string(), bytes)
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{name}: invalid JSON"))?;
    let messages = parse_messages(&value).with_context(|| format!("{name}: invalid messages"))?;
    let mut fields: ChatTemplateFields = if value.is_object() {
        serde_json::from_value(value).with_context(|| format!("{name}: invalid chat fields"))?
    } else {
        ChatTemplateFields::default()
    };
    if no_generation_prompt {
        fields.add_generation_prompt = Some(false);
    }
    fields
        .prompt(messages)
        .map_err(|e| anyhow::anyhow!("{name}: `{}`: {}", e.param, e.reason))
}
