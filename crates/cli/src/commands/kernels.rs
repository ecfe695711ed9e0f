//! `kiln check-kernels [--only KERNEL,…] [KEY=VALUE…]`: kiln's fused kernels against the
//! composition of Burn operations each replaces, on the configured device
//! (`device.backend=…`). Exit 1 when a kernel disagrees; one that does not
//! run on the device (the composition runs there) is said so. Text for
//! people, `--json` for scripts (CI on llvmpipe, the GPU check on CUDA).

use std::io::Write;
use std::process::ExitCode;

use kiln_train::kiln_model::kernels::{
    KernelCheck, check_adamw, check_attention, check_bias, check_embedding, check_gelu,
    check_layer_norm, check_lm_head_loss, check_matmul, check_sum_of_squares,
};

use super::{BadInput, Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    /// Only these kernels' checks (comma-separated or repeated): adamw,
    /// sum-of-squares, gelu, layer-norm, bias, embedding, attention,
    /// lm-head, matmul
    #[arg(long, value_delimiter = ',', value_name = "KERNEL")]
    only: Vec<String>,
    #[command(flatten)]
    layers: Layers,
}

/// Each check's name for `--only`, and the check.
type Check = fn(&kiln_train::kiln_model::burn::tensor::Device) -> Vec<KernelCheck>;
const CHECKS: [(&str, Check); 9] = [
    ("adamw", |d| vec![check_adamw(d)]),
    ("sum-of-squares", |d| vec![check_sum_of_squares(d)]),
    ("gelu", |d| vec![check_gelu(d)]),
    ("layer-norm", |d| vec![check_layer_norm(d)]),
    ("bias", check_bias),
    ("embedding", check_embedding),
    ("attention", check_attention),
    ("lm-head", |d| vec![check_lm_head_loss(d)]),
    ("matmul", check_matmul),
];

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let names: Vec<&str> = CHECKS.iter().map(|(name, _)| *name).collect();
    if let Some(unknown) = args.only.iter().find(|o| !names.contains(&o.as_str())) {
        return Err(BadInput(format!(
            "unknown kernel `{unknown}` in --only: expected one of {}",
            names.join(", ")
        ))
        .into());
    }
    let resolved = ctx.resolve(&args.layers)?;
    // As a run opens it: CubeCL's settings applied, wgpu's kernel language
    // in the device's name.
    let choice =
        kiln_train::open_device(&resolved.config, ctx.report.gpu_vendor()).map_err(train_error)?;
    let checks: Vec<KernelCheck> = CHECKS
        .iter()
        .filter(|(name, _)| args.only.is_empty() || args.only.iter().any(|o| o == name))
        .flat_map(|(_, check)| check(&choice.device))
        .collect();
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
