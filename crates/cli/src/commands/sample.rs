//! `kiln sample FROM [--prompt TEXT]`: text from a trained GPT, as
//! nanoGPT's `sample.py` (kiln-train's `sample`). FROM is a language-model
//! run (its newest good checkpoint) or a `transformers` GPT-2 folder.

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
    /// The text the samples continue [default: a newline, as the run's
    /// samples.txt]
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a file
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Texts to generate, at most 10000 (transformers'
    /// `num_return_sequences`) [default: the run's sample.count]
    #[arg(long, short = 'n', visible_alias = "num-return-sequences", value_parser = count)]
    count: Option<usize>,
    /// Tokens each, at most a million (transformers' `max_new_tokens`)
    /// [default: the run's sample.tokens]
    #[arg(long, visible_alias = "max-new-tokens", value_parser = tokens)]
    tokens: Option<usize>,
    /// Sampling temperature: lower is more conservative, 0 takes the most
    /// likely token (greedy) [default: the run's sample.temperature]
    #[arg(long, value_parser = non_negative)]
    temperature: Option<f64>,
    /// Sample among the k most likely tokens; 0: among all [default: the
    /// run's sample.top_k]
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: among the most likely tokens whose probabilities
    /// first reach P in all (after top-k), above 0 and at most 1 [default:
    /// the run's sample.top_p]
    #[arg(long, value_name = "P", value_parser = probability)]
    top_p: Option<f64>,
    /// The random stream's seed [default: the run's training.seed, which
    /// gives samples.txt's texts again]
    #[arg(long)]
    seed: Option<u64>,
    /// One JSON object: the source, the settings and the continuations
    #[arg(long)]
    json: bool,
    /// A run's best model (the lowest validation loss, `best.safetensors`)
    /// instead of its newest checkpoint
    #[arg(long)]
    best: bool,
}

fn count(s: &str) -> Result<usize, String> {
    super::whole_number_in(s, 1, kiln_config::MAX_SAMPLE_COUNT)
}

fn tokens(s: &str) -> Result<usize, String> {
    super::whole_number_in(s, 0, kiln_config::MAX_SAMPLE_TOKENS)
}

fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a number, 0 or more")),
    }
}

fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number above 0 and at most 1")),
    }
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let prompt = match &args.prompt_file {
        Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
            super::BadInput(format!(
                "--prompt-file: cannot read `{}`: {e}",
                path.display()
            ))
        })?),
        None => args.prompt.clone(),
    };
    let mut request = kiln_train::SampleRequest::default();
    request.prompt = prompt;
    request.count = args.count;
    request.tokens = args.tokens;
    request.temperature = args.temperature;
    request.top_k = args.top_k;
    request.top_p = args.top_p;
    request.seed = args.seed;
    request.best = args.best;
    let s = kiln_train::sample(&args.from, &request, &ctx.report).map_err(train_error)?;
    for note in &s.notes {
        eprintln!("kiln: note: {note}");
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&s)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "kiln: sampling from {} on {}: {} tokens each, temperature {}, top-k {}{}, seed {}; the prompt is {}",
        s.source,
        s.device,
        s.tokens,
        s.temperature,
        s.top_k,
        if s.top_p < 1.0 {
            format!(", top-p {}", s.top_p)
        } else {
            String::new()
        },
        s.seed,
        kiln_train::counted(s.prompt_tokens, "token")
    );
    for (i, text) in s.continuations.iter().enumerate() {
        writeln!(out, "--- sample {}\n{}{text}", i + 1, s.prompt)?;
    }
    Ok(ExitCode::SUCCESS)
}
