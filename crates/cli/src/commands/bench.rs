//! `kiln bench lm | nli | loader | attention`: the training step timed
//! (tokens/s, ms/step, MFU, data-wait, peak memory, its phases), the
//! loader alone, or the model's self-attention alone; text for people,
//! `--json` by the schema in docs/PERFORMANCE.md.

use std::io::Write;
use std::process::ExitCode;

use kiln_hwdetect::HardwareReport;

use super::{BadInput, Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// What to time
    #[arg(value_enum)]
    workload: Workload,
    /// Steps not timed (start-up, caches); the last one given counts
    #[arg(long, default_value_t = 5, overrides_with = "warmup")]
    warmup: usize,
    /// Steps timed; the last one given counts (`cargo xtask bench --steps=N`
    /// over a standard entry's own)
    #[arg(long, default_value_t = 30, overrides_with = "steps", value_parser = super::at_least_one)]
    steps: usize,
    /// Keep timing past --steps until the timed steps add up to this many
    /// seconds (short steps are noisy), up to 50 × --steps
    #[arg(long, default_value_t = 0.0)]
    min_seconds: f64,
    /// Batches each loader setting delivers (`bench loader`)
    #[arg(long, default_value_t = 500, value_parser = super::at_least_one)]
    batches: usize,
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    /// Pad every pair batch to model.max_length (as the PyTorch reference does)
    #[arg(long)]
    pad_to_max_length: bool,
    /// After the timed steps, run this many more with every kernel launch
    /// timed on the device, and list where the step's device time went
    /// (wgpu and CUDA only; 2 steps unless given as --kernel-profile=N)
    #[arg(long, value_name = "STEPS", num_args = 0..=1, require_equals = true, default_missing_value = "2", default_value_t = 0)]
    kernel_profile: usize,
    #[command(flatten)]
    layers: Layers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Workload {
    /// The GPT language model
    Lm,
    /// The sentence-pair encoder (`experiment=nli_snli` unless one is given)
    Nli,
    /// The configured experiment's loader alone, with 0, 1, 2 and 4 workers
    Loader,
    /// The model's self-attention alone at the configured shape and dtype,
    /// forward and backward, with each implementation the device has
    /// (`--steps` timed calls after `--warmup`)
    Attention,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let Args {
        workload,
        warmup,
        steps,
        min_seconds,
        batches,
        json,
        pad_to_max_length,
        kernel_profile,
        layers,
    } = args;
    let report = &ctx.report;
    // A rank of a data-parallel job (`kiln launch … bench lm|nli`,
    // torchrun, Slurm): the training step, timed over every rank.
    let group = if matches!(workload, Workload::Lm | Workload::Nli) {
        super::train::join_job()?
    } else {
        let env = kiln_train::kiln_dist::process_env();
        if let Ok(Some(spec)) = kiln_train::kiln_dist::WorldSpec::from_env(&env) {
            let name = clap::ValueEnum::to_possible_value(&workload)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default();
            return Err(BadInput(format!(
                "rank {} of {}: `bench {name}` runs in one process; a data-parallel job benchmarks `bench lm` or `bench nli`",
                spec.rank, spec.world_size
            ))
            .into());
        }
        None
    };
    let resolved = if workload == Workload::Nli {
        ctx.resolve_nli(layers)?
    } else {
        ctx.resolve(&layers)?
    };
    crate::data::provide_for(&resolved.config)?;
    let mut out = std::io::stdout().lock();
    let config = &resolved.config;
    let options = kiln_train::BenchOptions {
        warmup,
        steps,
        min_seconds,
        pad_to_max_length,
        kernel_profile_steps: kernel_profile,
    };
    if workload == Workload::Attention {
        if kernel_profile > 0 {
            return Err(BadInput(
                "--kernel-profile times training steps: `bench attention` times its calls itself"
                    .to_string(),
            )
            .into());
        }
        let result = kiln_train::bench_attention(config, report, options).map_err(train_error)?;
        if json {
            let value = serde_json::to_value(&result)?;
            write_json(
                &mut out,
                ATTENTION_SCHEMA,
                "attention",
                value,
                report,
                config,
            )?;
        } else {
            write!(out, "{}", attention_text(&result))?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    if workload == Workload::Loader {
        let result = kiln_train::bench_loader(config, batches).map_err(train_error)?;
        if json {
            let value = serde_json::to_value(&result)?;
            write_json(&mut out, LOADER_SCHEMA, "loader", value, report, config)?;
        } else {
            write!(out, "{}", loader_text(&result))?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let result = match workload {
        Workload::Nli => kiln_train::bench_nli_job(config, report, options, group.as_ref()),
        _ => kiln_train::bench_lm_job(config, report, options, group.as_ref()),
    }
    .map_err(|e| super::train::in_rank(group.as_deref(), e))?;
    if group.as_ref().is_some_and(|g| !g.is_root()) {
        // Rank 0 reports the job.
        return Ok(ExitCode::SUCCESS);
    }
    if json {
        let value = serde_json::to_value(&result)?;
        write_json(&mut out, BENCH_SCHEMA, "bench", value, report, config)?;
    } else {
        write!(out, "{}", bench_text(&result))?;
        let m = &config.model;
        writeln!(
            out,
            "machine: {} ({}, {} cores{}); experiment `{}`: {} × {} wide, {}, max_length {}, batch {} (hardware preset `{}`)",
            report.machine_id(),
            report.cpu.model,
            report.cpu.logical_cores,
            report
                .gpus()
                .iter()
                .map(|g| format!(", {}", g.name))
                .collect::<String>(),
            config.experiment,
            kiln_train::counted(m.layers, "layer"),
            m.hidden,
            kiln_train::counted(m.heads, "head"),
            m.max_length,
            batch_text(
                config.training.batch_size,
                config.training.gradient_accumulation_steps
            ),
            config.hardware
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The version of `kiln bench --json`'s layout (docs/PERFORMANCE.md).
const BENCH_SCHEMA: &str = "kiln.bench/1";
const LOADER_SCHEMA: &str = "kiln.bench-loader/1";
const ATTENTION_SCHEMA: &str = "kiln.bench-attention/1";

/// A benchmark's JSON: its schema, the result under `name`, the machine and
/// the resolved configuration.
fn write_json(
    out: &mut impl Write,
    schema: &str,
    name: &str,
    result: serde_json::Value,
    report: &HardwareReport,
    config: &kiln_config::RunConfig,
) -> anyhow::Result<()> {
    let mut value = serde_json::json!({
        "schema": schema,
        "hardware": hardware_summary(report),
        "config": config,
    });
    value[name] = result;
    writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    Ok(())
}

/// The machine in a benchmark's output.
fn hardware_summary(report: &HardwareReport) -> serde_json::Value {
    serde_json::json!({
        "machine": report.machine_id(),
        "cpu": report.cpu.model,
        "cores": report.cpu.logical_cores,
        "peak_fp32_flops": report.cpu.peak.fp32_flops,
        "memory_total_bytes": report.memory.total_bytes,
        "gpus": report.gpus().iter().map(|g| g.name.clone()).collect::<Vec<_>>(),
    })
}

fn loader_text(r: &kiln_train::LoaderBenchResult) -> String {
    let mut s = format!(
        "bench loader ({}): {} batches of {} per setting, nothing else running
{:>7} {:>8} {:>10} {:>10} {:>12}
",
        r.workload,
        r.batches,
        r.batch_size,
        "workers",
        "prefetch",
        "batches/s",
        "samples/s",
        "mean wait ms"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:>7} {:>8} {:>10.1} {:>10.1} {:>12.3}{}
",
            row.num_workers,
            row.prefetch_factor,
            row.batches_per_s,
            row.samples_per_s,
            row.mean_wait_ms,
            if row.configured { "  (configured)" } else { "" }
        ));
    }
    s.push_str("compare samples/s with `kiln bench`'s: a loader slower than the step makes the run data-bound
");
    s
}

fn attention_text(r: &kiln_train::AttentionBenchResult) -> String {
    let mut s = format!(
        "bench attention on {}: batch {} × {} tokens, {} head{} {} wide, {}{}; at least {} timed calls a pass after {} warm-up\n\
         FLOPs (FlashAttention's count): {:.2} G forward, {:.2} G backward\n",
        r.backend,
        r.batch,
        r.seq,
        r.heads,
        if r.heads == 1 { "" } else { "s" },
        r.head_dim,
        r.dtype,
        if r.causal { ", causal" } else { "" },
        r.calls,
        r.warmup,
        r.forward_flops / 1e9,
        r.backward_flops / 1e9,
    );
    let rate = |t: Option<f64>| match t {
        None => "n/a".to_string(),
        Some(t) if t < 1.0 => format!("{:.1} GFLOP/s", t * 1e3),
        Some(t) => format!("{t:.1} TFLOP/s"),
    };
    for row in &r.rows {
        match (&row.skipped, row.forward_ms, row.forward_backward_ms) {
            (Some(why), _, _) => {
                s.push_str(&format!("  {}: skipped: {why}\n", row.attention));
            }
            (None, Some(forward), Some(both)) => s.push_str(&format!(
                "  {} ({}): forward {forward:.3} ms ({}), forward + backward {both:.3} ms (backward {})\n",
                row.attention,
                row.runs,
                rate(row.forward_tflops),
                rate(row.backward_tflops),
            )),
            _ => {}
        }
    }
    s
}

/// "32", or "32 × 8 micro-batches an optimizer step" when the step
/// accumulates: a reader comparing against a reference that steps its
/// optimizer every batch must see that a timed step is several batches.
fn batch_text(batch_size: usize, accumulation: usize) -> String {
    if accumulation > 1 {
        format!("{batch_size} × {accumulation} micro-batches an optimizer step")
    } else {
        batch_size.to_string()
    }
}

fn bench_text(r: &kiln_train::BenchResult) -> String {
    let p = &r.phases;
    format!(
        "bench {} on {}: {} timed steps after {} warm-up, batch {}\n\
         samples/s: median {:.1}; tokens/s (no padding): median {:.0} (p10 {:.0}, p90 {:.0}; min {:.0}, max {:.0}); with padding {:.0}; {:.1} ms/step\n\
         FLOPs per sample: {:.3} G as computed (padded), {:.3} G on real tokens only\n\
         MFU: {} against {}\n\
         data-wait: {:.2}% of step time; peak memory {:.0} MiB{}; CPU {} during the timed steps\n\
         phases (median ms): data wait {:.2}, host-to-device {:.2}, forward {:.1}, backward {:.1}, {}optimizer {:.1}\n{}{}",
        r.workload,
        r.backend,
        r.timed_steps,
        r.warmup_steps,
        batch_text(r.batch_size, r.gradient_accumulation_steps)
            + &if r.world_size > 1 {
                format!(" a rank × {} ranks", r.world_size)
            } else {
                String::new()
            },
        r.samples_per_s_median,
        r.tokens_per_s_median,
        r.tokens_per_s_p10,
        r.tokens_per_s_p90,
        r.tokens_per_s_min,
        r.tokens_per_s_max,
        r.padded_tokens_per_s_median,
        r.ms_per_step_median,
        r.flops_per_sample_padded / 1e9,
        r.flops_per_sample_real / 1e9,
        r.mfu
            .map_or("n/a".to_string(), |m| format!("{:.1}%", m * 100.0)),
        r.mfu_peak,
        r.data_wait_pct,
        r.peak_memory_bytes as f64 / f64::from(1u32 << 20),
        if r.gradient_checkpointing {
            " (gradient checkpointing on)"
        } else {
            ""
        },
        r.cpu_util_pct
            .map_or("n/a".to_string(), |c| format!("{c:.0}% of one core")),
        p.data_wait_ms,
        p.host_to_device_ms,
        p.forward_ms,
        p.backward_ms,
        match (r.world_size > 1, p.all_gather_ms > 0.0) {
            (false, _) => String::new(),
            (true, false) => format!("gradients' reduction {:.1}, ", p.all_reduce_ms),
            (true, true) => format!(
                "gradients' reduction {:.1}, weights' all-gather {:.1}, ",
                p.all_reduce_ms, p.all_gather_ms
            ),
        },
        p.optimizer_ms,
        job_text(r),
        r.isa.as_ref().map_or(String::new(), |i| format!(
            "instruction sets: gemm {}, kiln's loops {}, Burn's element-wise loops {}\n",
            i.gemm, i.kernels, i.elementwise
        )),
    ) + &r
        .kernel_profile
        .as_ref()
        .map_or(String::new(), kernel_profile_text)
}

/// A data-parallel job's line: its ranks, what reduced the gradients, and
/// the share of the step spent communicating.
fn job_text(r: &kiln_train::BenchResult) -> String {
    let (Some(how), Some(comm)) = (&r.collectives, r.comm_pct) else {
        return String::new();
    };
    format!(
        "job: {}, the rates and MFU over all of them (memory and phases: rank 0's); communication {comm:.1}% of the step; {how}\n",
        kiln_train::kiln_plan::counted(r.world_size, "rank")
    )
}

/// `--kernel-profile`: the device's busy share and the largest kernels.
fn kernel_profile_text(p: &kiln_train::KernelProfile) -> String {
    let mut text = format!(
        "kernels ({} profiled steps, {} timing): {:.0} launches and {:.2} ms of device time a step, {:.0}% of the median step{}\n",
        p.profiled_steps,
        p.timing,
        p.launches_per_step,
        p.device_ms_per_step,
        p.device_busy_pct,
        if p.untimed_launches > 0 {
            format!("; {} launches untimed", p.untimed_launches)
        } else {
            String::new()
        },
    );
    for k in &p.kernels {
        text += &format!(
            "  {:>9.3} ms {:>5.1}% {:>7.1}× {}\n",
            k.ms_per_step,
            k.share_pct,
            k.launches_per_step,
            truncate(&k.name, 110)
        );
    }
    text
}

/// `name` cut to `max` characters, with an ellipsis when cut.
fn truncate(name: &str, max: usize) -> String {
    if name.chars().count() <= max {
        name.to_string()
    } else {
        name.chars().take(max - 1).collect::<String>() + "…"
    }
}
