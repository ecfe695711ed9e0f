//! `kiln check-hardware` and `kiln check-gpu`: the hardware report, the
//! preset chosen and the recommendation; also the derived lines of `kiln
//! config --explain`.

use std::fmt::Write;
use std::process::ExitCode;

use kiln_config::ResolvedConfig;
use kiln_hwdetect::{GpuInfo, HardwareReport};
use kiln_plan::Recommendation;
use serde_json::json;

use super::{Context, Layers};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
}

/// `kiln check-hardware [--json]`.
pub(crate) fn check_hardware(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&Layers::none())?;
    // This machine's products, measured: not for a report read from a file.
    let measured = ctx
        .hardware_report
        .is_none()
        .then(kiln_train::measured_cpu_peak)
        .flatten();
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut value = json(&ctx.report, &resolved);
        value["cpu_products_measured"] = serde_json::to_value(measured)?;
        std::io::Write::write_all(
            &mut out,
            format!("{}\n", serde_json::to_string_pretty(&value)?).as_bytes(),
        )?;
    } else {
        let mut text = human(&ctx.report, &resolved);
        if let Some(m) = measured {
            let _ = writeln!(
                text,
                "  {:<14} {} (what MFU on flex counts against; the CPU's peak above is an estimate from its clock)",
                "CPU products",
                m.describe()
            );
        }
        std::io::Write::write_all(&mut out, text.as_bytes())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln check-gpu`: exit 0 where there is an NVIDIA GPU, 1 where not.
pub(crate) fn check_gpu(ctx: &Context) -> anyhow::Result<ExitCode> {
    std::io::Write::write_all(
        &mut std::io::stdout().lock(),
        ctx.report.gpu.to_string().as_bytes(),
    )?;
    Ok(if ctx.report.gpus().is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The GPU the run would use (`device.index`, which `hardware=auto` sets
/// to the GPU it chose the preset for), if any.
fn chosen_gpu<'a>(report: &'a HardwareReport, resolved: &ResolvedConfig) -> Option<&'a GpuInfo> {
    kiln_plan::run_gpu(&resolved.config, report)
}

/// The readable report of `kiln check-hardware`: the machine, the preset and
/// its recommendation (kiln-hwdetect's and kiln-plan's `Display`), and the
/// backend of this build.
fn human(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let ranks = ranks(report);
    let mut per_gpu = String::new();
    for (i, g) in gpu_backends(report).iter().enumerate() {
        let label = if i == 0 { "GPU backends" } else { "" };
        let _ = writeln!(per_gpu, "  {label:<14} {}: {}", g.gpu, g.line());
    }
    format!(
        "{report}\n{}  {:<14} {}\n{per_gpu}  {:<14} {} — {}; `cargo xtask train-auto` {}\n",
        Recommendation::new(resolved, report),
        "backend",
        backend_line(report, resolved),
        "ranks",
        ranks.count,
        ranks.why,
        if ranks.count > 1 {
            format!("starts `kiln launch --nproc-per-node {}`", ranks.count)
        } else {
            "trains in one process".into()
        }
    )
}

/// Which backend of this build runs one of the machine's GPUs, or what to
/// build for it.
#[derive(Debug, serde::Serialize)]
pub(crate) struct GpuBackend {
    /// The GPU, as the report names it.
    gpu: String,
    /// Whose it is.
    vendor: kiln_hwdetect::GpuVendor,
    /// The backend `device.backend=auto` takes for it in this build.
    backend: Option<&'static str>,
    /// Why that backend, or why none.
    why: String,
    /// What to build where this build has no backend for it.
    build: Option<String>,
}

impl GpuBackend {
    fn line(&self) -> String {
        match (self.backend, &self.build) {
            (Some(b), _) => format!("{b} ({})", self.why),
            (None, Some(build)) => format!("none in this build ({}); {build}", self.why),
            (None, None) => format!("none ({})", self.why),
        }
    }
}

/// For each GPU of the machine (NVIDIA's, then the others), the backend
/// this build runs it on ([`kiln_train::backend_for_vendor`]) or what to
/// build; an integrated GPU is not trained on.
pub(crate) fn gpu_backends(report: &HardwareReport) -> Vec<GpuBackend> {
    use kiln_hwdetect::GpuVendor;
    let built = kiln_train::BACKENDS_BUILT_IN;
    let nvidia = report.gpus().iter().map(|g| {
        (
            format!("GPU {} {}", g.index, g.name),
            GpuVendor::Nvidia,
            true,
        )
    });
    let others = report
        .other_gpus
        .iter()
        .map(|g| (g.name.clone(), g.vendor, g.trainable()));
    nvidia
        .chain(others)
        .map(|(gpu, vendor, usable)| {
            if !usable {
                return GpuBackend {
                    gpu,
                    vendor,
                    backend: None,
                    why: "an integrated GPU, slower than the CPU's kernels: auto trains on the CPU"
                        .into(),
                    build: None,
                };
            }
            match kiln_train::backend_for_vendor(vendor, built) {
                Ok((backend, why)) => GpuBackend {
                    gpu,
                    vendor,
                    backend: Some(backend),
                    why,
                    build: None,
                },
                Err(build) => GpuBackend {
                    gpu,
                    vendor,
                    backend: None,
                    why: format!("backends built in: {}", built.join(", ")),
                    build: Some(build),
                },
            }
        })
        .collect()
}

/// The data-parallel ranks this machine runs with this build.
pub(crate) fn ranks(report: &HardwareReport) -> kiln_plan::Ranks {
    kiln_plan::local_ranks(report, kiln_train::BACKENDS_BUILT_IN)
}

/// `device.backend`, and the device this build of kiln takes for it, and why.
fn backend_line(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let c = &resolved.config;
    let asked = format!("{:?}", c.device.backend).to_lowercase();
    match kiln_train::select_device(&c.device, report.gpu_vendor()) {
        Ok(d) => {
            let gpu = chosen_gpu(report, resolved).filter(|_| d.is_gpu);
            let p = kiln_train::choose_precision(&c.precision, &d, gpu);
            format!(
                "{asked} → {} in this build ({}); computes in {} ({}); backends built in: {}",
                d.name,
                d.why,
                p.label,
                p.why,
                kiln_train::BACKENDS_BUILT_IN.join(", ")
            )
        }
        Err(e) => format!("{asked}: {e}"),
    }
}

/// `kiln check-hardware --json`: the report, the preset and the recommendation.
fn json(report: &HardwareReport, resolved: &ResolvedConfig) -> serde_json::Value {
    let r = Recommendation::new(resolved, report);
    let ranks = ranks(report);
    json!({
        "hardware": report,
        "preset": {
            "name": r.preset,
            "why": resolved.hardware_choice.as_ref().map(|_| r.preset_why.clone()),
            "gpu_index": r.gpu_index,
        },
        "recommended": {
            "experiment": r.experiment,
            "batch_size": r.batch_size,
            "gradient_accumulation_steps": r.gradient_accumulation_steps,
            "effective_batch": r.effective_batch,
            "precision": r.precision,
            "precision_why": r.precision_why,
            "num_workers": r.num_workers,
            "prefetch_factor": r.prefetch_factor,
            "compile": r.compile,
            "gradient_checkpointing": r.gradient_checkpointing,
            "max_length": r.max_length,
            "backend": resolved.config.device.backend,
            "backend_in_this_build": backend_line(report, resolved),
        },
        "gpu_backends": gpu_backends(report),
        "ranks": {
            "count": ranks.count,
            "why": ranks.why,
        },
    })
}

/// What the resolved keys come to on this machine (for `kiln config
/// --explain`): the precision as the GPU's capabilities decide it, and the
/// backend, dtype and compile behaviour of this build.
pub(crate) fn derived_text(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let c = &resolved.config;
    let p = kiln_config::machine_precision(&c.precision, chosen_gpu(report, resolved), report);
    let mut s = String::from("# derived on this machine (not keys):\n");
    let _ = writeln!(s, "#   precision → {} — {}", p.label, p.why);
    let _ = writeln!(s, "#   backend → {}", backend_line(report, resolved));
    let _ = writeln!(
        s,
        "#   compile → CubeCL autotune level {} on GPU backends; not applicable on flex",
        kiln_train::autotune_level(&c.optimization)
    );
    s
}
