//! `kiln`: hardware-aware training. This crate is glue: it parses argv,
//! prints for humans and picks exit codes (0 ok, 2 bad input, 1 failure);
//! the work is done by kiln-hwdetect, kiln-config and the crates after them.
//! One module per command under `commands/`; `main` dispatches.

#![allow(clippy::print_stdout, reason = "the CLI prints its results")]
#![allow(clippy::print_stderr, reason = "the CLI prints its errors")]

mod commands;
#[cfg(feature = "tui")]
mod dashboard;
mod data;
mod oom;
mod progress;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use commands::{
    Context, bench, config, diagnose, eval, export, hardware, kernels, launch, lr_find, prepare,
    sample, train, tune,
};
use kiln_config::ConfigError;

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
/// Hardware-aware training on Burn: detect the machine, pick its preset,
/// train, and report how well the hardware was used.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
struct Cli {
    /// A folder of presets over the built-in ones: its hardware/<name>.toml
    /// and experiment/<name>.toml (or .yaml, .yml, .json) add or replace
    /// presets, its defaults.toml overrides single defaults [default:
    /// `presets/` in the working directory, if there is one]
    #[arg(long, global = true, value_name = "DIR")]
    presets: Option<PathBuf>,
    /// Use a saved hardware report (`kiln check-hardware --json`) instead of
    /// detecting this machine: to plan for another machine, and for tests
    #[arg(long, global = true, value_name = "FILE")]
    hardware_report: Option<PathBuf>,
    /// Also write the error that ends the command to FILE: how a sweep
    /// (`kiln train -m`) learns why a job failed
    #[arg(long, global = true, value_name = "FILE", hide = true)]
    error_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What the machine is and can do, the preset chosen for it and why
    CheckHardware(hardware::Args),
    /// Is there an NVIDIA GPU to train on? Exit 0 if so, 1 if not
    CheckGpu,
    /// kiln's fused kernels against the Burn operations they replace, on the
    /// configured device. Exit 1 if one disagrees
    CheckKernels(kernels::Args),
    /// The resolved configuration as TOML
    Config(config::Args),
    /// Documents (text, JSON lines, parquet; also .gz, .zst) into a token
    /// store of llm.c-format shards that training reads from disk
    Prepare(prepare::Args),
    /// Train with the resolved configuration, in a new run directory
    Train(train::TrainArgs),
    /// k-fold cross-validation of the sentence-pair classifier (`experiment=nli_snli` by default)
    Cv(train::TrainArgs),
    /// Label sentence pairs with a finished cross-validation run's best fold
    Predict(train::PredictArgs),
    /// Continue a run from its newest good checkpoint
    Resume(train::ResumeArgs),
    /// Data-parallel training: one process per GPU (`--nproc-per-node`),
    /// on one machine or several, as torchrun starts them; the ranks average
    /// their gradients every optimizer step. `kiln launch --nproc-per-node 4
    /// train experiment=gpt2_small`
    Launch(launch::Args),
    /// Write a trained model as a Hugging Face `transformers` folder
    /// (config.json, model.safetensors, tokenizer): a GPT as GPT-2, a
    /// cross-validation run's best fold as BertForSequenceClassification
    /// (or its family's: RoBERTa, ELECTRA, DistilBERT)
    Export(export::Args),
    /// Text from a trained GPT: a language-model run's newest checkpoint, or
    /// a transformers GPT-2 folder (`kiln sample runs/<run> --prompt
    /// "ROMEO:"`)
    Sample(sample::Args),
    /// A language model's loss, perplexity and bits per byte on a text file,
    /// every token scored once: a run's newest checkpoint (or --best), or a
    /// transformers GPT-2 folder (`kiln eval runs/<run> --data test.txt`)
    Eval(eval::Args),
    /// Time training steps: tokens/s, ms/step, MFU, data-wait, peak memory,
    /// the step's phases; or the loader alone
    Bench(bench::Args),
    /// Pre-flight check: device, data against the config, config problems with
    /// their fixes, a memory estimate, and a measured burst of steps.
    /// Exit 2 when a problem would make the run fail
    Diagnose(diagnose::Args),
    /// The learning-rate range test (Lightning's `lr_find`): each step at a
    /// larger rate, the loss against the rate, and the rate where it falls
    /// fastest, for `training.learning_rate`
    LrFind(lr_find::Args),
    /// Measure this machine's micro-batch, accumulation and loader settings
    /// for the experiment (its effective batch kept) and write them to
    /// presets/tuned/<machine>.toml, used by hardware=tuned
    Tune(tune::Args),
}

fn main() -> ExitCode {
    oom::install_hook();
    kiln_train::kiln_data::store::raise_open_files_limit();
    let cli = Cli::parse();
    if let Some(path) = &cli.error_file {
        let _ = ERROR_FILE.set(path.clone());
    }
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
            write_error_file(&format!("{err:#}"));
            let bad_input = err
                .chain()
                .any(|e| e.is::<ConfigError>() || e.is::<commands::BadInput>());
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// `--error-file`'s path, once parsed.
static ERROR_FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Writes the error ending this process to `--error-file`, if one was
/// given, and under torchrun to its `TORCHELASTIC_ERROR_FILE` (the JSON
/// torch's `record` writes, `{"message", "timestamp"}`), which torchrun's
/// summary of a failed job shows for the rank instead of "error_file:
/// <N/A>". Best effort: the message is on stderr already.
pub(crate) fn write_error_file(message: &str) {
    if let Some(path) = ERROR_FILE.get() {
        let _ = std::fs::write(path, message);
    }
    if let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let record = serde_json::json!({ "message": message, "timestamp": now });
        let _ = std::fs::write(path, record.to_string());
    }
}

/// Runs `f` on a thread of a rayon pool (one thread per core, or
/// `RAYON_NUM_THREADS`), the pool the CPU kernels and Burn's flex backend
/// then split their work over. A parallel section started from a pool
/// thread does its share on that thread and wakes one other; started from
/// `main` it hands all of it to the pool and waits. The PEERS-shape GPT bench
/// went from 185–188 % to 189–190 % CPU, +6–9 % tokens/s (docs/PERFORMANCE.md).
/// Where no pool can be built, `f` runs here as before. A rank that
/// shares its machine with others takes its share of the cores
/// ([`rank_threads`]).
fn on_compute_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    // The main thread's stack size: nothing that ran on `main` runs short.
    const STACK: usize = 8 << 20;
    let mut builder = rayon::ThreadPoolBuilder::new().stack_size(STACK);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let env = kiln_train::kiln_dist::process_env();
    if let Some(threads) = rank_threads(&env, cores) {
        builder = builder.num_threads(threads);
    }
    match builder.build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// The threads of a rank that torchrun or Slurm started beside others on
/// its machine (`LOCAL_WORLD_SIZE`, `SLURM_NTASKS_PER_NODE`): its share of
/// the `cores`, as `kiln launch` gives its ranks through
/// `RAYON_NUM_THREADS`, where each would otherwise start a thread per
/// core. `None` (rayon's default, or the `RAYON_NUM_THREADS` it reads)
/// for a process alone and wherever `RAYON_NUM_THREADS` is set.
fn rank_threads(env: &[(String, String)], cores: usize) -> Option<usize> {
    if env.iter().any(|(k, _)| k == "RAYON_NUM_THREADS") {
        return None;
    }
    let spec = kiln_train::kiln_dist::WorldSpec::from_env(env).ok()??;
    (spec.local_world_size > 1).then(|| (cores / spec.local_world_size).max(1))
}

/// One command, run with the machine and the presets the global flags name.
fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let ctx = Context::new(cli.presets, cli.hardware_report)?;
    match cli.command {
        Command::CheckHardware(args) => hardware::check_hardware(args, &ctx),
        Command::CheckGpu => hardware::check_gpu(&ctx),
        Command::CheckKernels(args) => kernels::run(args, &ctx),
        Command::Config(args) => config::run(args, &ctx),
        Command::Prepare(args) => prepare::run(args, &ctx),
        Command::Train(args) => train::train(args, ctx),
        Command::Cv(args) => train::cv(args, ctx),
        Command::Predict(args) => train::predict(args, &ctx),
        Command::Resume(args) => train::resume(args, ctx),
        Command::Launch(args) => launch::run(args, &ctx, |argv| {
            let cli = Cli::try_parse_from(argv)
                .map_err(|e| commands::BadInput(format!("kiln launch: {e}")))?;
            run(cli)
        }),
        Command::Export(args) => export::run(args),
        Command::Sample(args) => sample::run(args, &ctx),
        Command::Eval(args) => eval::run(args, &ctx),
        Command::Bench(args) => bench::run(args, &ctx),
        Command::Diagnose(args) => diagnose::run(args, &ctx),
        Command::Tune(args) => tune::run(args, &ctx),
        Command::LrFind(args) => lr_find::run(args, &ctx),
    }
}

#[cfg(test)]
mod tests {
    use super::rank_threads;

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_rank_beside_others_takes_its_share_of_the_cores() {
        let torchrun = [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        assert_eq!(rank_threads(&env(&torchrun), 16), Some(4));
        assert_eq!(rank_threads(&env(&torchrun), 2), Some(1));
        // RAYON_NUM_THREADS (what `kiln launch` sets) is rayon's to read.
        let mut set = torchrun.to_vec();
        set.push(("RAYON_NUM_THREADS", "3"));
        assert_eq!(rank_threads(&env(&set), 16), None);
        // Alone, or one rank a machine: every core.
        assert_eq!(rank_threads(&env(&[("HOME", "/root")]), 16), None);
        let one_a_machine = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "1"),
        ];
        assert_eq!(rank_threads(&env(&one_a_machine), 16), None);
        let slurm = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
        ];
        assert_eq!(rank_threads(&env(&slurm), 16), Some(4));
    }
}
