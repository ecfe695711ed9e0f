//! `kiln tune`: the tuner's search (kiln-plan) over child-process probes —
//! each candidate runs as a child `kiln bench --json`, so that a probe that
//! runs out of memory (a panic in Burn, which can leave a GPU unusable) or
//! is killed by the kernel costs only that probe — then the tuned preset
//! written; or the sweep, or the two compared.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use kiln_config::ResolvedConfig;
use kiln_hwdetect::HardwareReport;
use kiln_plan::{Candidate, Measurement, Probe, ProbeResult, TuneResult, TuneSpace, gib};

use super::{Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Steps not timed in each probe
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Steps timed in each probe, at least...
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// ...and at least this many seconds of them
    #[arg(long, default_value_t = 1.0)]
    min_seconds: f64,
    /// Measure the whole grid (micro-batch × workers × prefetch) instead
    /// of searching it; writes nothing (a benchmark for the tuner)
    #[arg(long)]
    sweep: bool,
    /// Measure and print, but do not write the tuned preset
    #[arg(long)]
    dry_run: bool,
    /// Judge the tuner: run it and the sweep, then measure both choices
    /// again head to head (interleaved rounds); writes nothing
    #[arg(long, conflicts_with = "sweep")]
    compare_sweep: bool,
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layers: Layers,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    crate::data::provide_for(&resolved.config)?;
    tune_command(
        &ctx.prefix(),
        &resolved,
        &ctx.report,
        &args.layers,
        TuneArgs {
            warmup: args.warmup,
            steps: args.steps,
            min_seconds: args.min_seconds,
            sweep: args.sweep,
            compare: args.compare_sweep,
            write: !args.dry_run && !args.sweep && !args.compare_sweep,
            json: args.json,
        },
    )
}

#[derive(Clone, Copy, Debug)]
struct TuneArgs {
    warmup: usize,
    steps: usize,
    min_seconds: f64,
    sweep: bool,
    compare: bool,
    write: bool,
    json: bool,
}

/// `kiln tune`: search (or sweep) with child-process probes, then write the
/// tuned preset.
fn tune_command(
    prefix: &[String],
    resolved: &ResolvedConfig,
    report: &HardwareReport,
    layers: &Layers,
    args: TuneArgs,
) -> anyhow::Result<ExitCode> {
    let config = &resolved.config;
    let t = &config.training;
    let effective = t.batch_size * t.gradient_accumulation_steps.max(1);
    let device =
        kiln_train::select_device(&config.device, report.gpu_vendor()).map_err(train_error)?;
    let (limit, what) = kiln_plan::memory_limit(config, report, device.is_gpu);
    let gpu = kiln_plan::run_gpu(config, report).filter(|_| device.is_gpu);
    let space = kiln_plan::TuneSpace::new(
        effective,
        config.loader.num_workers,
        config.loader.prefetch_factor,
        report.cpu.logical_cores,
        limit,
        what,
        device.is_gpu,
    );
    let workload = match config.workload {
        kiln_config::Workload::Lm => "lm",
        kiln_config::Workload::Nli => "nli",
    };
    let mut child_layers = Vec::new();
    for file in &layers.config {
        child_layers.push(format!("--config={}", file.display()));
    }
    child_layers.push(format!("experiment={}", config.experiment));
    child_layers.extend(layers.overrides.iter().cloned());
    let mut probe = ChildProbe {
        exe: std::env::current_exe()?,
        prefix: prefix
            .iter()
            .cloned()
            .chain(["bench".to_string(), workload.to_string()])
            .collect(),
        layers: child_layers,
        warmup: args.warmup,
        steps: args.steps,
        min_seconds: args.min_seconds,
        timeout: std::time::Duration::from_secs(600),
    };
    let mode = match (args.sweep, args.compare) {
        (true, _) => "sweep",
        (_, true) => "compare-sweep",
        _ => "tune",
    };
    if !args.json {
        eprintln!(
            "kiln {mode}: experiment `{}` on {} ({}), each probe a child `kiln bench {workload}` of {} warm-up + at least {} timed steps and {} s",
            config.experiment,
            device.name,
            report.machine_id(),
            args.warmup,
            args.steps,
            args.min_seconds
        );
    }
    if args.compare {
        let c = compare_with_sweep(&space, &mut probe, 3)?;
        let mut out = std::io::stdout().lock();
        if args.json {
            let value = serde_json::json!({
                "schema": "kiln.tune-compare/1",
                "experiment": config.experiment,
                "machine": report.machine_id(),
                "space": space,
                "comparison": c,
            });
            writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        } else {
            write!(out, "{}", comparison_text(&space, &c))?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let result = if args.sweep {
        kiln_plan::sweep(&space, &mut probe)
    } else {
        kiln_plan::tune(&space, &mut probe)
    }?;
    let mut written = None;
    if args.write {
        let presets = kiln_config::Presets::discover(
            prefix
                .iter()
                .find_map(|a| a.strip_prefix("--presets="))
                .map(Path::new),
        )?;
        let path = kiln_config::tuned_path(&presets, report);
        let header = format!(
            "kiln tune, {} UTC, on {}: {} ({} cores){}; {}; {} probes of {} warm-up + at least {} timed steps and {} s, {:.0} s in all",
            kiln_train::utc_stamp(std::time::SystemTime::now()),
            report.machine_id(),
            report.cpu.model,
            report.cpu.logical_cores,
            gpu.map(|g| format!(", {}", g.name)).unwrap_or_default(),
            device.name,
            result.trials.len(),
            args.warmup,
            args.steps,
            args.min_seconds,
            result.seconds
        );
        let block = kiln_plan::tuned_block(&config.experiment, &header, &space, &result);
        kiln_config::write_tuned(&path, &config.experiment, &block)
            .map_err(|e| anyhow::anyhow!("failed to write `{}`: {e}", path.display()))?;
        written = Some(path);
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = serde_json::json!({
            "schema": "kiln.tune/1",
            "mode": mode,
            "experiment": config.experiment,
            "machine": report.machine_id(),
            "space": space,
            "result": result,
            "written": written,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        write!(out, "{}", tune_text(&space, &result, mode))?;
        if let Some(path) = written {
            writeln!(
                out,
                "wrote {}
use it with: kiln train hardware=tuned experiment={}",
                path.display(),
                config.experiment
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs a candidate as `kiln [global flags] bench <workload> --json ...`.
#[derive(Clone, Debug)]
struct ChildProbe {
    exe: PathBuf,
    /// `--presets`/`--hardware-report` and the workload: `bench lm`.
    prefix: Vec<String>,
    /// `--config FILE` and the user's overrides.
    layers: Vec<String>,
    warmup: usize,
    steps: usize,
    min_seconds: f64,
    timeout: Duration,
}

impl Probe for ChildProbe {
    fn probe(&mut self, c: &Candidate) -> ProbeResult {
        let started = Instant::now();
        let failed = |why: String| ProbeResult::Failed {
            why,
            seconds: started.elapsed().as_secs_f64(),
        };
        let mut cmd = Command::new(&self.exe);
        cmd.args(&self.prefix)
            .args([
                "--json".to_string(),
                format!("--warmup={}", self.warmup),
                format!("--steps={}", self.steps),
                format!("--min-seconds={}", self.min_seconds),
            ])
            .args(&self.layers)
            .args([
                format!("training.batch_size={}", c.micro_batch),
                format!("training.gradient_accumulation_steps={}", c.accumulation),
                format!("loader.num_workers={}", c.num_workers),
                format!("loader.prefetch_factor={}", c.prefetch_factor),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => return failed(format!("could not start {}: {e}", self.exe.display())),
        };
        // Read both pipes on threads so that a chatty child cannot block.
        let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_string(&mut text);
                }
                text
            })
        };
        let out = read(child.stdout.take().map(|p| Box::new(p) as _));
        let err = read(child.stderr.take().map(|p| Box::new(p) as _));
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if started.elapsed() > self.timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(format!(
                        "no result within {} s: killed",
                        self.timeout.as_secs()
                    ));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => break Err(format!("waiting for the probe: {e}")),
            }
        };
        let stdout = out.join().unwrap_or_default();
        let stderr = err.join().unwrap_or_default();
        let status = match status {
            Ok(s) => s,
            Err(why) => return failed(why),
        };
        if !status.success() {
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no message");
            let how = match status.code() {
                Some(code) => format!("exit {code}"),
                None => "killed by a signal (out of memory?)".to_string(),
            };
            return failed(format!("{how}: {last}"));
        }
        match measurement(&stdout, c, started.elapsed().as_secs_f64()) {
            Some(m) => ProbeResult::Ran(m),
            None => failed("the probe printed no benchmark result".into()),
        }
    }
}

/// Reads a `kiln bench --json` result as the tuner's measurement: the bench
/// times whole optimizer steps (`accumulation` micro-steps and one update).
fn measurement(json: &str, c: &Candidate, seconds: f64) -> Option<Measurement> {
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    let b = value.get("bench")?;
    let num = |k: &str| b.get(k).and_then(serde_json::Value::as_f64);
    let step_ms = num("ms_per_step_median")?;
    let optimizer_ms = b.get("phases")?.get("optimizer_ms")?.as_f64()?;
    let micro_ms = (step_ms - optimizer_ms).max(0.0) / c.accumulation.max(1) as f64;
    let effective = (c.micro_batch * c.accumulation) as f64;
    Some(Measurement {
        samples_per_s: if step_ms > 0.0 {
            effective * 1e3 / step_ms
        } else {
            0.0
        },
        ms_per_micro_step: micro_ms,
        data_wait_pct: num("data_wait_pct")?,
        peak_memory_bytes: b.get("peak_memory_bytes")?.as_u64()?,
        device_memory_used_bytes: b
            .get("device_memory_used_bytes")
            .and_then(serde_json::Value::as_u64),
        device_memory_peak_bytes: b
            .get("device_memory_peak_bytes")
            .and_then(serde_json::Value::as_u64),
        seconds,
    })
}

/// The tuner judged against the exhaustive sweep.
#[derive(Debug, serde::Serialize)]
struct Comparison {
    pub(crate) tune: TuneResult,
    pub(crate) sweep: TuneResult,
    /// The tuner's probing time as a share of the sweep's.
    pub(crate) time_share: f64,
    /// Throughput as each search measured it (the sweep's best is the
    /// largest of many noisy measurements, so biased upward).
    pub(crate) ratio_as_searched: f64,
    /// Both choices measured again, interleaved, `rounds` times each with
    /// three times the probe's minimum time: samples/s, in order.
    pub(crate) rounds: usize,
    pub(crate) tune_again: Vec<f64>,
    pub(crate) sweep_again: Vec<f64>,
    /// Median of `tune_again` over median of `sweep_again`.
    pub(crate) ratio_head_to_head: f64,
}

/// Runs the tuner and the sweep, then both choices again head to head.
fn compare_with_sweep(
    space: &TuneSpace,
    probe: &mut ChildProbe,
    rounds: usize,
) -> anyhow::Result<Comparison> {
    let tune = kiln_plan::tune(space, probe)?;
    let sweep = kiln_plan::sweep(space, probe)?;
    let mut long = probe.clone();
    long.min_seconds = (probe.min_seconds * 3.0).max(1.0);
    let mut rate = |c: &Candidate| match long.probe(c) {
        ProbeResult::Ran(m) => Ok(m.samples_per_s),
        ProbeResult::Failed { why, .. } => Err(anyhow::anyhow!(
            "re-measuring batch {}: {why}",
            c.micro_batch
        )),
    };
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        a.push(rate(&tune.chosen)?);
        b.push(rate(&sweep.chosen)?);
    }
    let median = |v: &[f64]| kiln_train::median(&mut v.to_vec());
    Ok(Comparison {
        time_share: tune.seconds / sweep.seconds.max(1e-9),
        ratio_as_searched: tune.measurement.samples_per_s
            / sweep.measurement.samples_per_s.max(1e-9),
        ratio_head_to_head: median(&a) / median(&b).max(1e-9),
        rounds,
        tune_again: a,
        sweep_again: b,
        tune,
        sweep,
    })
}

/// [`Comparison`] for people.
fn comparison_text(space: &TuneSpace, c: &Comparison) -> String {
    let show = |c: &Candidate| {
        format!(
            "batch {} × accumulation {}, {}, prefetch {}",
            c.micro_batch,
            c.accumulation,
            kiln_train::counted(c.num_workers, "worker"),
            c.prefetch_factor
        )
    };
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{}
{}
         tuner: {} — {} probes, {:.1} s
         sweep: {} — {} probes, {:.1} s
         time: the tuner took {:.1} % of the sweep's
         throughput as searched: {:.1} vs {:.1} samples/s = {:.1} %
         head to head ({} interleaved rounds): tuner's choice {} vs sweep's {} samples/s = {:.1} %
",
        tune_text(space, &c.tune, "tune"),
        tune_text(space, &c.sweep, "sweep"),
        show(&c.tune.chosen),
        c.tune.trials.len(),
        c.tune.seconds,
        show(&c.sweep.chosen),
        c.sweep.trials.len(),
        c.sweep.seconds,
        100.0 * c.time_share,
        c.tune.measurement.samples_per_s,
        c.sweep.measurement.samples_per_s,
        100.0 * c.ratio_as_searched,
        c.rounds,
        list(&c.tune_again),
        list(&c.sweep_again),
        100.0 * c.ratio_head_to_head,
    )
}

/// The tuner's trials and choice, for people.
fn tune_text(space: &TuneSpace, r: &TuneResult, what: &str) -> String {
    let mut s = format!(
        "{what}: effective batch {} kept; memory limit {} ({})\n\
         {:>5} {:>5} {:>7} {:>8} {:>10} {:>9} {:>9} {:>9}\n",
        space.effective_batch,
        gib(space.memory_limit),
        space.memory_limit_what,
        "batch",
        "accum",
        "workers",
        "prefetch",
        "samples/s",
        "wait %",
        "peak RAM",
        "seconds",
    );
    for t in &r.trials {
        let c = t.candidate;
        let _ = write!(
            s,
            "{:>5} {:>5} {:>7} {:>8} ",
            c.micro_batch, c.accumulation, c.num_workers, c.prefetch_factor
        );
        match &t.result {
            ProbeResult::Ran(m) => {
                let _ = write!(
                    s,
                    "{:>10.1} {:>9.2} {:>9} {:>9.1}",
                    m.samples_per_s,
                    m.data_wait_pct,
                    gib(m.peak_memory_bytes),
                    m.seconds
                );
            }
            ProbeResult::Failed { seconds, .. } => {
                let _ = write!(s, "{:>10} {:>9} {:>9} {:>9.1}", "-", "-", "-", seconds);
            }
        }
        if !t.note.is_empty() {
            let _ = write!(s, "  {}", t.note);
        }
        s.push('\n');
    }
    let c = r.chosen;
    let _ = writeln!(
        s,
        "chosen: training.batch_size={} training.gradient_accumulation_steps={} loader.num_workers={} loader.prefetch_factor={}: {:.1} samples/s\n\
         loader: {}\n\
         {} probes, {:.1} s",
        c.micro_batch,
        c.accumulation,
        c.num_workers,
        c.prefetch_factor,
        r.measurement.samples_per_s,
        r.loader_why,
        r.trials.len(),
        r.seconds
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bench_result_becomes_whole_optimizer_steps() {
        // The bench times whole steps: 3 micro-steps of 10 ms and one
        // optimizer step of 2 ms.
        let json = r#"{"bench": {"ms_per_step_median": 32.0, "phases": {"optimizer_ms": 2.0},
            "data_wait_pct": 0.5, "peak_memory_bytes": 1024, "device_memory_used_bytes": null}}"#;
        let c = Candidate {
            micro_batch: 4,
            accumulation: 3,
            num_workers: 1,
            prefetch_factor: 2,
        };
        let m = measurement(json, &c, 1.5).expect("parsed");
        // They carry 12 samples.
        assert!((m.samples_per_s - 12.0 * 1e3 / 32.0).abs() < 1e-9, "{m:?}");
        assert!((m.ms_per_micro_step - 10.0).abs() < 1e-9, "{m:?}");
        assert_eq!(m.peak_memory_bytes, 1024);
        assert!(measurement("not json", &c, 1.0).is_none());
    }
}
