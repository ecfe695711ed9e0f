//! `kiln export RUN [--out DIR]`: a trained GPT as a Hugging Face
//! `transformers` GPT-2 folder, a cross-validation run's best fold as a
//! `BertForSequenceClassification` or its family's (kiln-train's
//! `export_hf`).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use super::train_error;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The run directory (`runs/<time>-<experiment>`): a language model, or
    /// a finished cross-validation run trained with `model.pooling=pooler`
    run: PathBuf,
    /// The folder to write; it must not exist [default: RUN/hf]
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// A language model's best model (the lowest validation loss,
    /// `best.safetensors`) instead of its newest checkpoint; a
    /// cross-validation run exports its best fold's best model either way
    #[arg(long)]
    best: bool,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let out = args.out.unwrap_or_else(|| args.run.join("hf"));
    let e = kiln_train::export_hf(&args.run, &out, args.best).map_err(train_error)?;
    let mut stdout = std::io::stdout().lock();
    for note in &e.notes {
        writeln!(stdout, "note: {note}")?;
    }
    let what = match e.fold {
        Some(fold) => format!("fold {fold}'s best model (step {})", e.step),
        None if args.best => format!("the best model (step {})", e.step),
        None => format!("step {}", e.step),
    };
    let (tokenizer, check) = match e.fold {
        Some(_) => (
            "AutoTokenizer",
            "python3 scripts/check_bert_init.py (docs/NLI.md)".to_string(),
        ),
        None => (
            "PreTrainedTokenizerFast",
            format!("python3 scripts/check_hf_export.py {}", e.out.display()),
        ),
    };
    writeln!(
        stdout,
        "exported {what} ({}) to `{}`: {} tensors, {:.2} M parameters, as transformers' {class}\n\
         load it with: {class}.from_pretrained(\"{out}\") and {tokenizer}.from_pretrained(\"{out}\")\n\
         check it with: {check}",
        e.checkpoint.display(),
        e.out.display(),
        e.tensors,
        e.parameters as f64 / 1e6,
        class = e.class,
        out = e.out.display(),
    )?;
    Ok(ExitCode::SUCCESS)
}
