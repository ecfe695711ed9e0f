//! `kiln export RUN [--out DIR]`: a trained GPT as a Hugging Face
//! `transformers` GPT-2 folder (kiln-train's `export_hf`).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use super::train_error;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The run directory of a language-model run (`runs/<time>-<experiment>`)
    run: PathBuf,
    /// The folder to write; it must not exist [default: RUN/hf]
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let out = args.out.unwrap_or_else(|| args.run.join("hf"));
    let e = kiln_train::export_hf(&args.run, &out).map_err(train_error)?;
    let mut stdout = std::io::stdout().lock();
    for note in &e.notes {
        writeln!(stdout, "note: {note}")?;
    }
    writeln!(
        stdout,
        "exported step {} ({}) to `{}`: {} tensors, {:.2} M parameters, as transformers' GPT2LMHeadModel\n\
         load it with: GPT2LMHeadModel.from_pretrained(\"{}\") and PreTrainedTokenizerFast.from_pretrained(\"{}\")\n\
         check it with: python3 scripts/check_hf_export.py {}",
        e.step,
        e.checkpoint.display(),
        e.out.display(),
        e.tensors,
        e.parameters as f64 / 1e6,
        e.out.display(),
        e.out.display(),
        e.out.display()
    )?;
    Ok(ExitCode::SUCCESS)
}
