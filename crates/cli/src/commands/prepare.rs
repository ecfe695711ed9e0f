//! `kiln prepare`: documents into a token store, with a progress bar.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{Context, Layers, train_error};
use crate::progress;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store's folder [default: DATA_PATH.store beside a file, or
    /// <folder>.store beside a folder; a glob's goes under data.cache_dir]
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Encoding threads, 1 to 1024 [default: one per core]
    #[arg(long, value_name = "N", value_parser = super::thread_count)]
    threads: Option<usize>,
    #[command(flatten)]
    layers: Layers,
}

/// `kiln prepare [key=value ...] [--out DIR]`.
pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    let config = &resolved.config;
    let out = args
        .out
        .unwrap_or_else(|| default_out(&config.data.path, &config.data.cache_dir));
    let mut printer = progress::Printer::new();
    let outcome =
        kiln_train::prepare_store(config, &out, args.threads, &mut printer).map_err(train_error)?;
    printer.finish_prepare();
    let m = &outcome.manifest;
    let tokens = |split: &str| -> usize {
        m.shards
            .iter()
            .filter(|s| s.split == split)
            .map(|s| s.tokens)
            .sum()
    };
    let mut stdout = std::io::stdout().lock();
    if outcome.already_prepared {
        writeln!(
            stdout,
            "`{}` is prepared already (same inputs and settings): nothing to do",
            out.display()
        )?;
    } else {
        if outcome.resumed_after_pieces > 0 {
            writeln!(
                stdout,
                "continued an interrupted prepare (its written pieces were read again, not encoded)"
            )?;
        }
        let mb = m.text_bytes as f64 / 1e6;
        writeln!(
            stdout,
            "prepared {} ({mb:.1} MB of text) in {:.1} s ({:.1} MB/s)",
            kiln_train::counted(m.documents, "document"),
            outcome.seconds,
            mb / outcome.seconds.max(1e-9)
        )?;
    }
    writeln!(
        stdout,
        "store `{}`: {} training tokens, {} validation tokens in {} shards ({:?}), tokenizer {} ({} ids)",
        out.display(),
        tokens("train"),
        tokens("val"),
        m.shards.len(),
        m.width,
        m.tokenizer.kind,
        m.tokenizer.vocab_size
    )?;
    if tokens("val") == 0 {
        eprintln!(
            "kiln: warning: the validation split is empty: data.val_fraction = {} of {:.1} MB of text is under half a piece (the text goes to the splits in whole pieces, of 4 KiB at least), and training refuses a store without validation windows; prepare again into a new folder with a larger data.val_fraction",
            m.settings.val_fraction,
            m.text_bytes as f64 / 1e6
        );
    }
    let kept_open = kiln_train::kiln_data::store::shards_kept_open();
    if m.shards.len() > kept_open {
        eprintln!(
            "kiln: warning: {} are more than a run here keeps open ({kept_open}, a quarter of this process's open-files limit, `ulimit -n`): each read will open its shard, and the loader reads about 4x slower (docs/PERFORMANCE.md, \"Stores of many shards\"); a larger data.shard_tokens (now {}) makes fewer",
            kiln_train::counted(m.shards.len(), "shard"),
            m.settings.shard_tokens
        );
    }
    if m.skipped.count > 0 {
        writeln!(
            stdout,
            "skipped {} rows (data.bad_rows = \"skip\"), the first:",
            m.skipped.count
        )?;
        for s in &m.skipped.first {
            writeln!(stdout, "  {s}")?;
        }
    }
    writeln!(
        stdout,
        "train on it: kiln train data.path={} data.tokenizer={}",
        out.display(),
        if m.tokenizer.kind == "file" {
            "<as prepared> data.tokenizer_file=…"
        } else {
            &m.tokenizer.kind
        }
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `corpus.jsonl` → `corpus.jsonl.store`, `docs/` → `docs.store`; a glob's
/// store goes under the cache folder.
fn default_out(data_path: &str, cache_dir: &str) -> PathBuf {
    if data_path.contains(['*', '?', '[']) {
        return PathBuf::from(cache_dir).join("prepared.store");
    }
    let trimmed = data_path.trim_end_matches('/');
    PathBuf::from(format!("{trimmed}.store"))
}
