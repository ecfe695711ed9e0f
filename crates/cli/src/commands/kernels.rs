//! `kiln check-kernels [KEY=VALUE…]`: kiln's fused kernels against the
//! composition of Burn operations each replaces, on the configured device
//! (`device.backend=…`). Exit 1 when a kernel disagrees; one that does not
//! run on the device (the composition runs there) is said so. Text for
//! people, `--json` for scripts (CI on llvmpipe, the GPU check on CUDA).

use std::io::Write;
use std::process::ExitCode;

use kiln_train::kiln_model::kernels::{
    KernelCheck, check_adamw, check_attention, check_gelu, check_layer_norm, check_lm_head_loss,
    check_sum_of_squares,
};

use super::{Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layers: Layers,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    let choice = kiln_train::select_device(&resolved.config.device, !ctx.report.gpus().is_empty())
        .map_err(train_error)?;
    let mut checks = vec![
        check_adamw(&choice.device),
        check_sum_of_squares(&choice.device),
    ];
    checks.push(check_gelu(&choice.device));
    checks.push(check_layer_norm(&choice.device));
    checks.extend(check_attention(&choice.device));
    checks.push(check_lm_head_loss(&choice.device));
    let passed = checks.iter().all(KernelCheck::passed);
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = serde_json::json!({
            "schema": "kiln.check-kernels/1",
            "device": choice.name,
            "passed": passed,
            "kernels": checks.iter().map(|c| {
                let mut v = serde_json::to_value(c).unwrap_or_default();
                v["passed"] = c.passed().into();
                v
            }).collect::<Vec<_>>(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        writeln!(out, "kernels on {} ({})", choice.name, choice.why)?;
        for c in &checks {
            let verdict = match (c.fused, c.passed()) {
                (false, _) => "not fused on this device (the composition runs)",
                (true, true) => "ok",
                (true, false) => "DISAGREES",
            };
            writeln!(
                out,
                "  {:<28} max |fused − composition| {:.2e} (tolerance {:.0e}): {verdict}",
                c.kernel, c.max_abs_difference, c.tolerance
            )?;
        }
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
