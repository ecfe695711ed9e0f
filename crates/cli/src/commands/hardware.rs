//! `kiln check-hardware` and `kiln check-gpu`: the hardware report, the
//! preset chosen and the recommendation; also the derived lines of `kiln
//! config --explain`.

use std::fmt::Write;
use std::process::ExitCode;

use kiln_config::ResolvedConfig;
use kiln_hwdetect::{GpuInfo, GpuStatus, HardwareReport, PeakFlops};
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
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = json(&ctx.report, &resolved);
        std::io::Write::write_all(
            &mut out,
            format!("{}\n", serde_json::to_string_pretty(&value)?).as_bytes(),
        )?;
    } else {
        std::io::Write::write_all(&mut out, human(&ctx.report, &resolved).as_bytes())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln check-gpu`: exit 0 where there is an NVIDIA GPU, 1 where not.
pub(crate) fn check_gpu(ctx: &Context) -> anyhow::Result<ExitCode> {
    std::io::Write::write_all(
        &mut std::io::stdout().lock(),
        gpu_lines(&ctx.report).as_bytes(),
    )?;
    Ok(if ctx.report.gpus().is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

/// The GPU the run would use (`device.index`, which `hardware=auto` sets
/// to the GPU it chose the preset for), if any.
fn chosen_gpu<'a>(report: &'a HardwareReport, resolved: &ResolvedConfig) -> Option<&'a GpuInfo> {
    kiln_plan::run_gpu(&resolved.config, report)
}

/// The readable report of `kiln check-hardware`.
fn human(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let mut s = String::new();
    let cpu = &report.cpu;
    let family = cpu
        .family
        .map(|f| format!(", family {f:#x}"))
        .unwrap_or_default();
    let _ = writeln!(
        s,
        "CPU      {} ({}{family}), {}",
        cpu.model, cpu.vendor, cpu.arch
    );
    let physical = cpu
        .physical_cores
        .map_or("? physical".to_string(), |p| format!("{p} physical"));
    let clock = cpu.frequency_mhz.map_or("unknown clock".to_string(), |m| {
        format!("{:.2} GHz", m as f64 / 1000.0)
    });
    let _ = writeln!(
        s,
        "         {physical} / {} logical cores at {clock}",
        cpu.logical_cores
    );
    let _ = writeln!(s, "         ISA: {}", cpu.features.names().join(" "));
    match cpu.peak.fp32_flops {
        Some(f) => {
            let _ = writeln!(
                s,
                "         fp32 peak ≈ {:.1} GFLOP/s ({})",
                f / 1e9,
                cpu.peak.how
            );
        }
        None => {
            let _ = writeln!(s, "         fp32 peak {}", cpu.peak.how);
        }
    }
    let _ = writeln!(
        s,
        "Memory   {} total, {} available",
        gib(report.memory.total_bytes),
        gib(report.memory.available_bytes)
    );
    let _ = writeln!(s, "OS       {}", report.os);
    s.push_str(&gpu_lines(report));
    if report.driver.driver_version.is_some() {
        let _ = writeln!(
            s,
            "Driver   {}, CUDA {}",
            report.driver.driver_version.as_deref().unwrap_or("?"),
            report.driver.cuda_version.as_deref().unwrap_or("?")
        );
    }
    let c = &resolved.config;
    let why = resolved
        .hardware_choice
        .as_ref()
        .map_or("set explicitly".to_string(), |c| c.why.clone());
    let _ = writeln!(s, "\nPreset   {} — {why}", c.hardware);
    let kiln_config::EffectivePrecision {
        label: precision,
        why: precision_why,
        ..
    } = kiln_config::effective_precision(&c.precision, chosen_gpu(report, resolved));
    let _ = writeln!(
        s,
        "Recommended (hardware={}, experiment={}; `kiln config --explain` shows every key):",
        c.hardware, c.experiment
    );
    let rows = [
        (
            "batch size",
            format!(
                "{} × {} accumulation = {} per optimizer step",
                c.training.batch_size,
                c.training.gradient_accumulation_steps,
                c.effective_batch()
            ),
        ),
        ("precision", format!("{precision} ({precision_why})")),
        (
            "loader",
            format!(
                "{} workers, prefetch {}",
                c.loader.num_workers, c.loader.prefetch_factor
            ),
        ),
        ("compile", on_off(c.optimization.compile).to_string()),
        (
            "checkpointing",
            format!(
                "gradient checkpointing {}",
                on_off(c.model.gradient_checkpointing)
            ),
        ),
        ("max_length", c.model.max_length.to_string()),
        ("backend", backend_line(report, resolved)),
    ];
    for (k, v) in rows {
        let _ = writeln!(s, "  {k:<14} {v}");
    }
    s
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// One block per GPU, or the reason there is none.
fn gpu_lines(report: &HardwareReport) -> String {
    let mut s = String::new();
    match &report.gpu {
        GpuStatus::None { why } => {
            let _ = writeln!(s, "GPU      none: {why}");
        }
        GpuStatus::Found { gpus } => {
            for g in gpus {
                let (maj, min) = g.compute_capability;
                let _ = writeln!(
                    s,
                    "GPU {:<4} {}, {} ({} free), compute capability {maj}.{min}",
                    g.index,
                    g.name,
                    gib(g.memory_total_bytes),
                    gib(g.memory_free_bytes)
                );
                let c = g.capabilities;
                let yes = |b: bool| if b { "yes" } else { "no" };
                let _ = writeln!(
                    s,
                    "         fp16 {}, bf16 {}, tf32 {}, fp8 {}, tensor cores {}",
                    yes(c.fp16),
                    yes(c.bf16),
                    yes(c.tf32),
                    yes(c.fp8),
                    yes(c.tensor_cores)
                );
                match (&g.peak, &g.peak_source) {
                    (Some(p), Some(src)) => {
                        let _ = writeln!(s, "         dense peak: {} ({src})", peak_text(p));
                    }
                    _ => {
                        let _ = writeln!(
                            s,
                            "         dense peak: not in kiln's table (MFU needs a measured peak)"
                        );
                    }
                }
            }
        }
    }
    s
}

fn peak_text(p: &PeakFlops) -> String {
    let mut parts = vec![format!("fp32 {:.1}", p.fp32 / 1e12)];
    for (name, v) in [
        ("tf32", p.tf32),
        ("bf16", p.bf16),
        ("fp16", p.fp16),
        ("fp8", p.fp8),
    ] {
        if let Some(v) = v {
            parts.push(format!("{name} {:.1}", v / 1e12));
        }
    }
    format!("{} TFLOP/s", parts.join(", "))
}

/// `device.backend`, and the device this build of kiln takes for it, and why.
fn backend_line(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let c = &resolved.config;
    let asked = format!("{:?}", c.device.backend).to_lowercase();
    match kiln_train::select_device(&c.device, !report.gpus().is_empty()) {
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
    let c = &resolved.config;
    let kiln_config::EffectivePrecision {
        label: precision,
        why: precision_why,
        ..
    } = kiln_config::effective_precision(&c.precision, chosen_gpu(report, resolved));
    json!({
        "hardware": report,
        "preset": {
            "name": c.hardware,
            "why": resolved.hardware_choice.as_ref().map(|c| c.why.clone()),
            "gpu_index": resolved.hardware_choice.as_ref().and_then(|c| c.gpu_index),
        },
        "recommended": {
            "experiment": c.experiment,
            "batch_size": c.training.batch_size,
            "gradient_accumulation_steps": c.training.gradient_accumulation_steps,
            "effective_batch": c.effective_batch(),
            "precision": precision,
            "precision_why": precision_why,
            "num_workers": c.loader.num_workers,
            "prefetch_factor": c.loader.prefetch_factor,
            "compile": c.optimization.compile,
            "gradient_checkpointing": c.model.gradient_checkpointing,
            "max_length": c.model.max_length,
            "backend": c.device.backend,
            "backend_in_this_build": backend_line(report, resolved),
        },
    })
}

/// What the resolved keys come to on this machine (for `kiln config
/// --explain`): the precision as the GPU's capabilities decide it, and the
/// backend, dtype and compile behaviour of this build.
pub(crate) fn derived_text(report: &HardwareReport, resolved: &ResolvedConfig) -> String {
    let c = &resolved.config;
    let p = kiln_config::effective_precision(&c.precision, chosen_gpu(report, resolved));
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
