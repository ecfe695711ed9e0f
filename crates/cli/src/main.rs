//! `kiln`: hardware-aware training. This crate is glue: it parses argv,
//! prints for humans and picks exit codes (0 ok, 2 bad input, 1 failure);
//! the work is done by kiln-hwdetect, kiln-config and the crates after them.

#![allow(clippy::print_stdout, reason = "the CLI prints its results")]
#![allow(clippy::print_stderr, reason = "the CLI prints its errors")]

mod hardware;
mod progress;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};
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
    /// Time training steps: tokens/s, ms/step, MFU, data-wait, the step's phases
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
        /// Machine-readable output
        #[arg(long)]
        json: bool,
        /// Pad every pair batch to model.max_length (as the PyTorch reference does)
        #[arg(long)]
        pad_to_max_length: bool,
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
    match run(cli) {
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

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let report = match &cli.hardware_report {
        Some(path) => read_report(path)?,
        None => kiln_hwdetect::detect(),
    };
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
            } else {
                write!(out, "{}", header(&resolved))?;
                write!(out, "{}", resolved.to_toml())?;
            }
        }
        Command::Cv { force, mut layers } => {
            layers.default_experiment("nli_snli");
            let resolved = resolve(presets, &report, &layers)?;
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
            json,
            pad_to_max_length,
            mut layers,
        } => {
            if workload == BenchWorkload::Nli {
                layers.default_experiment("nli_snli");
            }
            let resolved = resolve(presets, &report, &layers)?;
            let options = kiln_train::BenchOptions {
                warmup,
                steps,
                pad_to_max_length,
            };
            let result = match workload {
                BenchWorkload::Lm => kiln_train::bench_lm(&resolved.config, &report, options),
                BenchWorkload::Nli => kiln_train::bench_nli(&resolved.config, &report, options),
            }
            .map_err(train_error)?;
            if json {
                let value = serde_json::json!({
                    "bench": result,
                    "hardware": {
                        "cpu": report.cpu.model,
                        "cores": report.cpu.logical_cores,
                        "peak_fp32_flops": report.cpu.peak.fp32_flops,
                        "gpus": report.gpus().iter().map(|g| g.name.clone()).collect::<Vec<_>>(),
                    },
                    "config": resolved.config,
                });
                writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
            } else {
                write!(out, "{}", bench_text(&result))?;
            }
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

    /// Chooses `experiment` unless the command line names one.
    fn default_experiment(&mut self, experiment: &str) {
        if !self.overrides.iter().any(|o| o.starts_with("experiment=")) {
            self.overrides.insert(0, format!("experiment={experiment}"));
        }
    }
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

fn bench_text(r: &kiln_train::BenchResult) -> String {
    let p = &r.phases;
    format!(
        "bench {} on {}: {} timed steps after {} warm-up, batch {}\n\
         samples/s: median {:.1}; tokens/s (no padding): median {:.0} (min {:.0}, max {:.0}); with padding {:.0}; {:.1} ms/step\n\
         FLOPs per sample: {:.3} G as computed (padded), {:.3} G on real tokens only\n\
         MFU: {} against {}\n\
         data-wait: {:.2}% of step time; peak memory {:.0} MiB{}\n\
         phases (median ms): data wait {:.2}, host-to-device {:.2}, forward {:.1}, backward {:.1}, optimizer {:.1}\n",
        r.workload,
        r.backend,
        r.timed_steps,
        r.warmup_steps,
        r.batch_size,
        r.samples_per_s_median,
        r.tokens_per_s_median,
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
