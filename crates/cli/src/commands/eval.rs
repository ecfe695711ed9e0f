//! `kiln eval FROM --data FILE`: a language model's loss, perplexity and
//! bits per byte on a text, or on a token store's split (`--split`,
//! validation by default), read from its shards (kiln-train's
//! `evaluate_text`). FROM is a language-model run (its newest good
//! checkpoint, or `--best`), a `transformers` GPT-2 folder, or a sweep
//! (each job's, in a table).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{Context, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A language-model run directory (`runs/<time>-<experiment>`), a
    /// transformers GPT-2 folder (config.json, model.safetensors,
    /// tokenizer.json: OpenAI's GPT-2, a `kiln export`), or a sweep's
    /// folder (`kiln train -m`: every job that has a checkpoint)
    from: PathBuf,
    /// The text to score (UTF-8), e.g. a held-out test set; or a token
    /// store (`kiln prepare`'s folder, llm.c's shards, nanoGPT's
    /// train.bin/val.bin), read from disk a batch at a time
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// A token store's split to score: `val` (the held-out documents) or
    /// `train`
    #[arg(long, value_enum)]
    split: Option<SplitArg>,
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

/// `--split`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SplitArg {
    /// The validation split (held-out documents).
    Val,
    /// The training split.
    Train,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let mut request = kiln_train::EvalRequest::default();
    request.best = args.best;
    request.stride = args.stride;
    request.split = args.split.map(|s| match s {
        SplitArg::Val => kiln_train::kiln_data::Split::Val,
        SplitArg::Train => kiln_train::kiln_data::Split::Train,
    });
    if args.from.join(super::sweep::RECORD).is_file() {
        return sweep(&args, &request, ctx);
    }
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

/// `kiln eval SWEEP`: each job that has a checkpoint (finished, pruned or
/// stopped), in a table, the lowest loss marked.
fn sweep(
    args: &Args,
    request: &kiln_train::EvalRequest,
    ctx: &Context,
) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for (label, dir, status) in super::sweep::jobs_of(&args.from)? {
        if !dir.join("config.toml").is_file() || status == "failed" || status == "pending" {
            eprintln!("kiln: {label}: {status}, not scored");
            continue;
        }
        match kiln_train::evaluate_text(&dir, &args.data, request, &ctx.report) {
            Ok(e) => rows.push((label, status, e)),
            // The text itself is bad for every job: say so once, exit 2.
            Err(
                e @ (kiln_train::TrainError::Data(_)
                | kiln_train::TrainError::TextNotEncodable { .. }),
            ) => {
                return Err(train_error(e));
            }
            Err(e) => eprintln!("kiln: {label}: not scored: {e}"),
        }
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let list: Vec<_> = rows
            .iter()
            .map(|(label, status, e)| serde_json::json!({ "job": label, "status": status, "eval": e }))
            .collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&list)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let best = rows
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.2.loss.total_cmp(&b.1.2.loss))
        .map(|(i, _)| i);
    writeln!(
        out,
        "{}: {} jobs scored on {}{}",
        args.from.display(),
        rows.len(),
        args.data.display(),
        if args.best {
            " (each job's best model)"
        } else {
            ""
        }
    )?;
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(3).max(3);
    writeln!(
        out,
        "  {:<width$}  {:<8}  {:>8}  {:>10}  {:>9}",
        "job", "status", "loss", "perplexity", "bits/byte"
    )?;
    for (i, (label, status, e)) in rows.iter().enumerate() {
        writeln!(
            out,
            "  {label:<width$}  {status:<8}  {:>8.4}  {:>10.3}  {:>9.4}{}",
            e.loss,
            e.perplexity,
            e.bits_per_byte,
            if Some(i) == best { "  *" } else { "" }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
