//! `kiln`: hardware-aware training. This crate is glue: it parses argv,
//! prints for humans and picks exit codes (0 ok, 2 bad input, 1 failure);
//! the work is done by kiln-hwdetect, kiln-config and the crates after them.

#![allow(clippy::print_stdout, reason = "the CLI prints its results")]
#![allow(clippy::print_stderr, reason = "the CLI prints its errors")]

mod hardware;
mod measure;
mod progress;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};

/// mimalloc keeps freed memory for reuse: with the system allocator every
/// step's large tensors were mapped and unmapped again (page faults took a
/// quarter of the CPU time; docs/PERFORMANCE.md has the profile).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// And mimalloc keeps it: by default it hands freed pages back to the OS
/// after a delay, and a training step frees and reallocates the same large
/// activation buffers every step, so each came back as fresh pages the
/// kernel zeroes on first touch (`clear_page_erms`: 42 % of the main
/// thread's samples in an encoder bench). `MIMALLOC_PURGE_DELAY=-1` turns
/// purging off: +7–10 % samples/s on the encoder bench, system time 2–3.7 s
/// → 0.5–1 s (docs/PERFORMANCE.md). mimalloc reads its options when it
/// starts, before `main` (setting the option later through its API gave
/// inconclusive runs), so the variable is set in a constructor that runs
/// before the allocator reads it. The cost: the
/// process keeps its peak memory until it exits. A value already in the
/// environment wins.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static KEEP_FREED_MEMORY: extern "C" fn() = keep_freed_memory;

#[cfg(target_os = "linux")]
extern "C" fn keep_freed_memory() {
    // SAFETY: runs before `main`, single-threaded; both strings are
    // NUL-terminated literals, and overwrite = 0 keeps a user's value.
    unsafe {
        libc::setenv(c"MIMALLOC_PURGE_DELAY".as_ptr(), c"-1".as_ptr(), 0);
    }
}
use kiln_config::{ConfigError, LoadOptions, ResolvedConfig};
use kiln_hwdetect::HardwareReport;

/// Hardware-aware training on Burn: detect the machine, pick its preset,
/// train, and report how well the hardware was used.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
struct Cli {
    /// Folder with defaults.toml, hardware/ and experiment/ [default: the
    /// nearest `presets/` from the working directory up]
    #[arg(long, global = true, value_name = "DIR")]
    presets: Option<PathBuf>,
    /// Use a saved hardware report (`kiln check-hardware --json`) instead of
    /// detecting this machine: to plan for another machine, and for tests
    #[arg(long, global = true, value_name = "FILE")]
    hardware_report: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What the machine is and can do, the preset chosen for it and why
    CheckHardware {
        /// Machine-readable output
        #[arg(long)]
        json: bool,
    },
    /// Is there an NVIDIA GPU to train on? Exit 0 if so, 1 if not
    CheckGpu,
    /// The resolved configuration as TOML
    Config {
        /// Each key with its value and the layer that set it
        #[arg(long)]
        explain: bool,
        #[command(flatten)]
        layers: Layers,
    },
    /// Train with the resolved configuration, in a new run directory
    Train {
        /// Run a GPU preset on a machine without that GPU
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        layers: Layers,
    },
    /// k-fold cross-validation of the sentence-pair classifier (`experiment=nli_snli` by default)
    Cv {
        /// Run a GPU preset on a machine without that GPU
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        layers: Layers,
    },
    /// Label sentence pairs with a finished cross-validation run's best fold
    Predict {
        /// The run directory
        run: PathBuf,
        /// Pairs to label (JSONL, TSV or CSV, read as the run's config says)
        #[arg(long, value_name = "FILE")]
        data: PathBuf,
        /// Where to write one JSON line per pair [default: RUN/predictions-<name>.jsonl]
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Continue a run from its newest good checkpoint
    Resume {
        /// The run directory (`runs/<time>-<experiment>`)
        run: PathBuf,
    },
    /// Time training steps: tokens/s, ms/step, MFU, data-wait, peak memory,
    /// the step's phases; or the loader alone
    Bench {
        /// What to time
        #[arg(value_enum)]
        workload: BenchWorkload,
        /// Steps not timed (start-up, caches)
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Steps timed
        #[arg(long, default_value_t = 30)]
        steps: usize,
        /// Keep timing past --steps until the timed steps add up to this many
        /// seconds (short steps are noisy), up to 50 × --steps
        #[arg(long, default_value_t = 0.0)]
        min_seconds: f64,
        /// Batches each loader setting delivers (`bench loader`)
        #[arg(long, default_value_t = 500)]
        batches: usize,
        /// Machine-readable output
        #[arg(long)]
        json: bool,
        /// Pad every pair batch to model.max_length (as the PyTorch reference does)
        #[arg(long)]
        pad_to_max_length: bool,
        #[command(flatten)]
        layers: Layers,
    },
    /// Pre-flight check: device, data against the config, config problems with
    /// their fixes, a memory estimate, and a measured burst of steps.
    /// Exit 2 when a problem would make the run fail
    Diagnose {
        /// Training steps to time for the time estimate and the loader's
        /// verdict (0: none)
        #[arg(long, default_value_t = 10)]
        burst: usize,
        /// Machine-readable output
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        layers: Layers,
    },
    /// Measure this machine's micro-batch, accumulation and loader settings
    /// for the experiment (its effective batch kept) and write them to
    /// presets/tuned/<machine>.toml, used by hardware=tuned
    Tune {
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
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BenchWorkload {
    /// The GPT language model
    Lm,
    /// The sentence-pair encoder (`experiment=nli_snli` unless one is given)
    Nli,
    /// The configured experiment's loader alone, with 0, 1, 2 and 4 workers
    Loader,
}

/// The configuration layers a command takes.
#[derive(Debug, clap::Args)]
struct Layers {
    /// A TOML file layered above the presets and below the environment
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Overrides in Hydra's syntax: `hardware=t4 experiment=nli_snli training.batch_size=20`
    #[arg(value_name = "KEY=VALUE")]
    overrides: Vec<String>,
}

/// An error caused by what the user gave (exit code 2).
#[derive(Debug)]
struct BadInput(String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match on_compute_pool(|| run(cli)) {
        Ok(code) => code,
        Err(err) => {
            if err.chain().any(|e| {
                e.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {err:#}");
            let bad_input = err
                .chain()
                .any(|e| e.is::<ConfigError>() || e.is::<BadInput>());
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// Runs `f` on a thread of a rayon pool (one thread per core, or
/// `RAYON_NUM_THREADS`), the pool the CPU kernels and Burn's flex backend
/// then split their work over. A parallel section started from a pool
/// thread does its share on that thread and wakes one other; started from
/// `main` it hands all of it to the pool and waits. The PEERS-shape GPT bench
/// went from 185–188 % to 189–190 % CPU, +6–9 % tokens/s (docs/PERFORMANCE.md).
/// Where no pool can be built, `f` runs here as before.
fn on_compute_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    // The main thread's stack size: nothing that ran on `main` runs short.
    const STACK: usize = 8 << 20;
    match rayon::ThreadPoolBuilder::new().stack_size(STACK).build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let report = match &cli.hardware_report {
        Some(path) => read_report(path)?,
        None => kiln_hwdetect::detect(),
    };
    let prefix = cli_prefix(&cli);
    let presets = cli.presets.as_deref();
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::CheckHardware { json } => {
            let resolved = resolve(presets, &report, &Layers::none())?;
            if json {
                let value = hardware::json(&report, &resolved);
                writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
            } else {
                write!(out, "{}", hardware::human(&report, &resolved))?;
            }
        }
        Command::CheckGpu => {
            write!(out, "{}", hardware::gpu_lines(&report))?;
            if report.gpus().is_empty() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Config { explain, layers } => {
            let resolved = resolve(presets, &report, &layers)?;
            if explain {
                write!(out, "{}", explain_text(&resolved))?;
                write!(out, "{}", hardware::derived_text(&report, &resolved))?;
            } else {
                write!(out, "{}", header(&resolved))?;
                write!(out, "{}", resolved.to_toml())?;
            }
        }
        Command::Cv { force, layers } => {
            let resolved = resolve_nli(presets, &report, layers)?;
            if resolved.config.workload != kiln_config::Workload::Nli {
                return Err(BadInput(format!(
                    "`kiln cv` cross-validates the nli workload, but experiment `{}` is `{:?}`; use `kiln train`",
                    resolved.config.experiment, resolved.config.workload
                ))
                .into());
            }
            drop(out);
            return train_command(resolved, force, report);
        }
        Command::Predict {
            run,
            data,
            out: output,
        } => {
            let p = kiln_train::predict(&run, &data, output.as_deref(), &report)
                .map_err(train_error)?;
            if let Some(skipped) = &p.skipped {
                eprintln!("kiln: {skipped}");
            }
            writeln!(
                out,
                "predicted {} pairs with fold {}'s model: {}",
                p.rows,
                p.fold,
                p.output.display()
            )?;
            if let Some(s) = &p.scores {
                writeln!(
                    out,
                    "against the file's labels: accuracy {:.1}%, macro-F1 {:.3}",
                    100.0 * s.accuracy,
                    s.macro_f1
                )?;
                for c in &s.per_class {
                    writeln!(
                        out,
                        "  {:<14} precision {:.3}  recall {:.3}  F1 {:.3}  ({} pairs)",
                        c.label, c.precision, c.recall, c.f1, c.support
                    )?;
                }
            }
        }
        Command::Train { force, layers } => {
            let resolved = resolve(presets, &report, &layers)?;
            drop(out);
            return train_command(resolved, force, report);
        }
        Command::Resume { run } => {
            drop(out);
            let options = train_options(report, Vec::new())?;
            let outcome = kiln_train::resume(&run, &options, &mut progress::Printer::new())
                .map_err(train_error)?;
            return Ok(finish(outcome));
        }
        Command::Bench {
            workload,
            warmup,
            steps,
            min_seconds,
            batches,
            json,
            pad_to_max_length,
            layers,
        } => {
            let resolved = if workload == BenchWorkload::Nli {
                resolve_nli(presets, &report, layers)?
            } else {
                resolve(presets, &report, &layers)?
            };
            let config = &resolved.config;
            if workload == BenchWorkload::Loader {
                let result = kiln_train::bench_loader(config, batches).map_err(train_error)?;
                if json {
                    let value = serde_json::to_value(&result)?;
                    write_bench_json(&mut out, LOADER_SCHEMA, "loader", value, &report, config)?;
                } else {
                    write!(out, "{}", loader_text(&result))?;
                }
                return Ok(ExitCode::SUCCESS);
            }
            let options = kiln_train::BenchOptions {
                warmup,
                steps,
                min_seconds,
                pad_to_max_length,
            };
            let result = match workload {
                BenchWorkload::Nli => kiln_train::bench_nli(config, &report, options),
                _ => kiln_train::bench_lm(config, &report, options),
            }
            .map_err(train_error)?;
            if json {
                let value = serde_json::to_value(&result)?;
                write_bench_json(&mut out, BENCH_SCHEMA, "bench", value, &report, config)?;
            } else {
                write!(out, "{}", bench_text(&result))?;
                let m = &config.model;
                writeln!(
                    out,
                    "machine: {} ({}, {} cores{}); experiment `{}`: {} layers × {} wide, {} heads, max_length {}, batch {} (hardware preset `{}`)",
                    report.machine_id(),
                    report.cpu.model,
                    report.cpu.logical_cores,
                    report
                        .gpus()
                        .iter()
                        .map(|g| format!(", {}", g.name))
                        .collect::<String>(),
                    config.experiment,
                    m.layers,
                    m.hidden,
                    m.heads,
                    m.max_length,
                    config.training.batch_size,
                    config.hardware
                )?;
            }
        }
        Command::Diagnose {
            burst,
            json,
            layers,
        } => {
            let resolved = resolve(presets, &report, &layers)?;
            let d = kiln_train::diagnose(&resolved.config, &report, burst).map_err(train_error)?;
            if json {
                let value = serde_json::json!({
                    "schema": "kiln.diagnose/1",
                    "experiment": resolved.config.experiment,
                    "hardware_preset": resolved.config.hardware,
                    "diagnosis": d,
                });
                writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
            } else {
                let mut head = format!(
                    "kiln diagnose: experiment `{}` ({:?}), hardware preset `{}`",
                    resolved.config.experiment, resolved.config.workload, resolved.config.hardware
                );
                if let Some(choice) = &resolved.hardware_choice {
                    head.push_str(&format!(" ({})", choice.why));
                }
                write!(out, "{}", measure::diagnosis_text(&d, &head))?;
            }
            if d.has_errors() {
                return Ok(ExitCode::from(2));
            }
        }
        Command::Tune {
            warmup,
            steps,
            min_seconds,
            sweep,
            dry_run,
            compare_sweep,
            json,
            layers,
        } => {
            let resolved = resolve(presets, &report, &layers)?;
            return tune_command(
                &prefix,
                &resolved,
                &report,
                &layers,
                TuneArgs {
                    warmup,
                    steps,
                    min_seconds,
                    sweep,
                    compare: compare_sweep,
                    write: !dry_run && !sweep && !compare_sweep,
                    json,
                },
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

impl Layers {
    fn none() -> Self {
        Self {
            config: None,
            overrides: Vec::new(),
        }
    }
}

/// Resolves for a sentence-pair command (`cv`, `bench nli`): the experiment
/// any layer chose, or `nli_snli` where none did (the defaults' experiment
/// is the language model's).
fn resolve_nli(
    presets: Option<&Path>,
    report: &HardwareReport,
    mut layers: Layers,
) -> anyhow::Result<ResolvedConfig> {
    let resolved = resolve(presets, report, &layers)?;
    let chosen = resolved
        .sources
        .get("experiment")
        .is_some_and(|s| s.layer != kiln_config::LayerKind::Defaults);
    if chosen || resolved.config.workload == kiln_config::Workload::Nli {
        return Ok(resolved);
    }
    layers
        .overrides
        .insert(0, "experiment=nli_snli".to_string());
    resolve(presets, report, &layers)
}

fn read_report(path: &Path) -> anyhow::Result<HardwareReport> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        BadInput(format!(
            "failed to read hardware report `{}`: {e}",
            path.display()
        ))
    })?;
    // `check-hardware --json` wraps the report; a bare report is accepted too.
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        BadInput(format!(
            "hardware report `{}` line {}: {e}",
            path.display(),
            e.line()
        ))
    })?;
    let inner = value.get("hardware").cloned().unwrap_or(value);
    serde_json::from_value(inner)
        .map_err(|e| BadInput(format!("hardware report `{}`: {e}", path.display())).into())
}

fn resolve(
    presets: Option<&Path>,
    report: &HardwareReport,
    layers: &Layers,
) -> anyhow::Result<ResolvedConfig> {
    let dir = kiln_config::find_presets_dir(presets)?;
    let env: Vec<_> = std::env::vars_os().collect();
    Ok(kiln_config::resolve(&LoadOptions {
        presets_dir: &dir,
        config_file: layers.config.as_deref(),
        overrides: &layers.overrides,
        env: &env,
        hardware: report,
    })?)
}

/// `kiln train` and `kiln cv`: checks that a named GPU preset fits, then trains.
fn train_command(
    resolved: ResolvedConfig,
    force: bool,
    report: HardwareReport,
) -> anyhow::Result<ExitCode> {
    let fit = match resolved.hardware_choice {
        Some(_) => Ok(()),
        None => kiln_config::check_preset_fits(&resolved.config.hardware, &report),
    };
    if let Err(msg) = fit {
        if !force {
            return Err(BadInput(format!(
                "{msg}; pass --force to run it on this machine anyway, or use hardware=auto"
            ))
            .into());
        }
        eprintln!("warning: {msg}; running anyway (--force)");
    }
    if let Some(choice) = &resolved.hardware_choice {
        println!("kiln: hardware = {}: {}", choice.name, choice.why);
    }
    let sources = explain_text(&resolved).lines().map(String::from).collect();
    let options = train_options(report, sources)?;
    let outcome = kiln_train::train(&resolved.config, &options, &mut progress::Printer::new())
        .map_err(train_error)?;
    Ok(finish(outcome))
}

/// Options for a training run: Ctrl-C stops it after the current step with a
/// checkpoint; a second Ctrl-C ends the process at once.
fn train_options(
    hardware: HardwareReport,
    sources: Vec<String>,
) -> anyhow::Result<kiln_train::TrainOptions> {
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&interrupt);
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\nkiln: stopping after this step with a checkpoint (Ctrl-C again to quit at once)"
        );
    })?;
    Ok(kiln_train::TrainOptions {
        interrupt,
        hardware,
        sources,
    })
}

/// Training errors the user can fix are bad input (exit 2).
fn train_error(e: kiln_train::TrainError) -> anyhow::Error {
    if e.is_bad_input() {
        anyhow::Error::new(BadInput(format!("{e:#}")))
    } else {
        anyhow::Error::new(e)
    }
}

fn finish(outcome: kiln_train::Outcome) -> ExitCode {
    match outcome {
        kiln_train::Outcome::Finished { run, .. } | kiln_train::Outcome::CvFinished { run, .. } => {
            println!("run directory: {}", run.display());
            ExitCode::SUCCESS
        }
        kiln_train::Outcome::Interrupted {
            run,
            step,
            checkpoint,
        } => {
            println!(
                "interrupted after step {step}; checkpoint {}\nresume with: kiln resume {}",
                checkpoint.display(),
                run.display()
            );
            ExitCode::from(130)
        }
    }
}

/// The version of `kiln bench --json`'s layout (docs/PERFORMANCE.md).
const BENCH_SCHEMA: &str = "kiln.bench/1";
const LOADER_SCHEMA: &str = "kiln.bench-loader/1";

/// A benchmark's JSON: its schema, the result under `name`, the machine and
/// the resolved configuration.
fn write_bench_json(
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

/// The global flags a child `kiln` needs to see the same presets and machine.
fn cli_prefix(cli: &Cli) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(p) = &cli.presets {
        args.push(format!("--presets={}", p.display()));
    }
    if let Some(r) = &cli.hardware_report {
        args.push(format!("--hardware-report={}", r.display()));
    }
    args
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
    let device = kiln_train::select_device(&config.device, !report.gpus().is_empty())
        .map_err(train_error)?;
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
    if let Some(file) = &layers.config {
        child_layers.push(format!("--config={}", file.display()));
    }
    child_layers.push(format!("experiment={}", config.experiment));
    child_layers.extend(layers.overrides.iter().cloned());
    let mut probe = measure::ChildProbe {
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
        let c = measure::compare_with_sweep(&space, &mut probe, 3)?;
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
            write!(out, "{}", measure::comparison_text(&space, &c))?;
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
        let dir = kiln_config::find_presets_dir(
            prefix
                .iter()
                .find_map(|a| a.strip_prefix("--presets="))
                .map(Path::new),
        )?;
        let path = kiln_config::tuned_path(&dir, report);
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
        write!(out, "{}", measure::tune_text(&space, &result, mode))?;
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

fn bench_text(r: &kiln_train::BenchResult) -> String {
    let p = &r.phases;
    format!(
        "bench {} on {}: {} timed steps after {} warm-up, batch {}\n\
         samples/s: median {:.1}; tokens/s (no padding): median {:.0} (p10 {:.0}, p90 {:.0}; min {:.0}, max {:.0}); with padding {:.0}; {:.1} ms/step\n\
         FLOPs per sample: {:.3} G as computed (padded), {:.3} G on real tokens only\n\
         MFU: {} against {}\n\
         data-wait: {:.2}% of step time; peak memory {:.0} MiB{}; CPU {} during the timed steps\n\
         phases (median ms): data wait {:.2}, host-to-device {:.2}, forward {:.1}, backward {:.1}, optimizer {:.1}\n",
        r.workload,
        r.backend,
        r.timed_steps,
        r.warmup_steps,
        r.batch_size,
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
        p.optimizer_ms,
    )
}

fn header(resolved: &ResolvedConfig) -> String {
    match &resolved.hardware_choice {
        Some(choice) => format!("# hardware = \"{}\": auto, {}\n", choice.name, choice.why),
        None => String::new(),
    }
}

fn explain_text(resolved: &ResolvedConfig) -> String {
    let rows = resolved.explain();
    let width = rows
        .iter()
        .map(|r| r.key.len() + r.value.len() + 3)
        .max()
        .unwrap_or(0);
    let mut text = String::new();
    for row in rows {
        let lhs = format!("{} = {}", row.key, row.value);
        text.push_str(&format!("{lhs:<width$}  # {}\n", row.source));
    }
    text
}
