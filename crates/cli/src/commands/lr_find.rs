//! `kiln lr-find [key=value ...]`: the learning-rate range test
//! (kiln-train's `lr_find`, Lightning's `Tuner.lr_find`) on the configured
//! model and data: a rate for `training.learning_rate`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The first step's rate
    #[arg(long, value_name = "LR", default_value_t = 1e-8)]
    min_lr: f64,
    /// The last step's rate
    #[arg(long, value_name = "LR", default_value_t = 1.0)]
    max_lr: f64,
    /// Optimizer steps from the first rate to the last
    #[arg(long, value_name = "N", default_value_t = 100)]
    steps: usize,
    /// Write the loss against the rate as an SVG
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// One JSON object: every step, the suggestion
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layers: Layers,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    let config = &resolved.config;
    crate::data::provide_for(config)?;
    let options = kiln_train::LrFindOptions::new(args.min_lr, args.max_lr, args.steps);
    let found = kiln_train::lr_find(config, &ctx.report, options).map_err(train_error)?;
    if let Some(path) = &args.plot {
        kiln_train::write_lr_plot(&found, path).map_err(train_error)?;
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&found)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "learning-rate range test of `{}` ({}) on {}: {} steps from {:.0e} to {:.0e}",
        config.experiment,
        found.workload,
        found.device,
        found.points.len(),
        args.min_lr,
        args.max_lr
    )?;
    writeln!(out, "  {:>9}  {:>8}  {:>8}", "lr", "loss", "smoothed")?;
    let every = found.points.len().div_ceil(20).max(1);
    for (i, p) in found.points.iter().enumerate() {
        if i % every == 0 || i + 1 == found.points.len() {
            writeln!(
                out,
                "  {:>9.2e}  {:>8.4}  {:>8.4}",
                p.lr, p.loss, p.smoothed
            )?;
        }
    }
    match found.suggestion {
        Some(lr) => writeln!(
            out,
            "suggested learning rate: {lr:.2e} (where the smoothed loss falls fastest against log(rate) before its lowest point): training.learning_rate={lr:.1e}"
        )?,
        None if !found.fell => writeln!(
            out,
            "no suggestion: the smoothed loss was lowest within the first 10 steps, so no rate of the range lowered it in {} steps; take more --steps or a larger batch (a noisy loss), or keep the configured rate",
            found.points.len()
        )?,
        None => writeln!(
            out,
            "no suggestion: {} steps before the loss diverged; widen the range or take more --steps",
            found.points.len()
        )?,
    }
    writeln!(
        out,
        "lowest smoothed loss at {:.2e}{}; the configuration's rate is {:.1e}",
        found.min_loss_lr,
        if found.diverged {
            format!(
                "; diverged after {:.2e}",
                found.points.last().map_or(args.min_lr, |p| p.lr)
            )
        } else {
            String::new()
        },
        config.training.learning_rate
    )?;
    if let Some(path) = &args.plot {
        writeln!(out, "plot: {}", path.display())?;
    }
    Ok(ExitCode::SUCCESS)
}
