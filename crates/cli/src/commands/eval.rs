//! `kiln eval FROM --data FILE`: a language model's loss, perplexity and
//! bits per byte on a text (kiln-train's `evaluate_text`). FROM is a
//! language-model run (its newest good checkpoint, or `--best`) or a
//! `transformers` GPT-2 folder.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{Context, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A language-model run directory (`runs/<time>-<experiment>`), or a
    /// transformers GPT-2 folder (config.json, model.safetensors,
    /// tokenizer.json: OpenAI's GPT-2, a `kiln export`)
    from: PathBuf,
    /// The text to score (UTF-8), e.g. a held-out test set
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Tokens each window moves on by and scores, the rest of it their
    /// context (Hugging Face's sliding window; 1 to the block) [default:
    /// the model's block: windows that do not overlap]
    #[arg(long, value_name = "N")]
    stride: Option<usize>,
    /// A run's best model (the lowest validation loss, `best.safetensors`)
    /// instead of its newest checkpoint
    #[arg(long)]
    best: bool,
    /// One JSON object: the source, the settings and the measures
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let mut request = kiln_train::EvalRequest::default();
    request.best = args.best;
    request.stride = args.stride;
    let e = kiln_train::evaluate_text(&args.from, &args.data, &request, &ctx.report)
        .map_err(train_error)?;
    for note in &e.notes {
        eprintln!("kiln: note: {note}");
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&e)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "{}: {} tokens scored by {} on {}",
        e.file, e.tokens, e.source, e.device
    )?;
    writeln!(
        out,
        "loss {:.4} nats/token, perplexity {:.3}, {:.4} bits per byte",
        e.loss, e.perplexity, e.bits_per_byte
    )?;
    writeln!(
        out,
        "windows: {} of block {}, stride {}{}; {:.0} tokens/s",
        e.windows,
        e.block,
        e.stride,
        if e.stride == e.block {
            " (no overlap)"
        } else {
            ""
        },
        e.tokens_per_s
    )?;
    Ok(ExitCode::SUCCESS)
}
