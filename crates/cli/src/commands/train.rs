//! `kiln train`, `kiln cv`, `kiln resume` and `kiln predict`: runs, with
//! Ctrl-C writing a checkpoint and the progress printed as it goes.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_config::ResolvedConfig;
use kiln_hwdetect::HardwareReport;

use super::{BadInput, Context, Layers, train_error};
use crate::progress;

#[derive(Debug, clap::Args)]
pub(crate) struct TrainArgs {
    /// Run a GPU preset on a machine without that GPU, or a CPU run whose
    /// memory estimate exceeds the available RAM
    #[arg(long)]
    force: bool,
    /// Show the run in a live dashboard (plots of each metric, progress,
    /// time left) instead of lines; `q` opens its menu, Ctrl-C stops with a
    /// checkpoint as always
    #[arg(long)]
    tui: bool,
    /// Hydra's multirun: a job for each combination of the swept values
    /// (`training.learning_rate=1e-3,3e-4 model.layers=range(2,6,2)`,
    /// `choice(a,b)`), one after another in a sweep folder, ranked in a
    /// table at the end; `kiln resume SWEEP` goes on with the rest
    #[arg(short = 'm', long)]
    pub(crate) multirun: bool,
    /// With -m: how many jobs run at once, each on a GPU of its own where
    /// there are enough (`device.index`), with its share of the cores, its
    /// output in its folder's kiln.log
    #[arg(
        short = 'j',
        long,
        value_name = "N",
        default_value_t = 1,
        requires = "multirun"
    )]
    jobs: usize,
    /// With -m: random search instead of every combination, N jobs each
    /// drawing every swept key (`interval(a,b)`, `tag(log, interval(a,b))`,
    /// `int(...)`, or one of a list's values), as Hydra's Optuna sweeper
    /// writes them
    #[arg(long, value_name = "N", requires = "multirun")]
    trials: Option<usize>,
    /// With --trials: the draws' seed (not the runs' training.seed)
    #[arg(long, value_name = "SEED", default_value_t = 0, requires = "trials")]
    search_seed: u64,
    /// With -m, a language model: stop a job early (with a checkpoint)
    /// when its best validation loss is above the median of the finished
    /// jobs' at the same step, as Optuna's MedianPruner
    #[arg(long, requires = "multirun")]
    prune: bool,
    /// With --prune: finished jobs needed before any is pruned
    /// (n_startup_trials)
    #[arg(long, value_name = "N", default_value_t = 5, requires = "prune")]
    prune_startup: usize,
    /// With --prune: no job is pruned at an evaluation before this step
    /// (n_warmup_steps)
    #[arg(long, value_name = "STEP", default_value_t = 0, requires = "prune")]
    prune_warmup: u64,
    #[command(flatten)]
    pub(crate) layers: Layers,
}

#[derive(Debug, clap::Args)]
pub(crate) struct PredictArgs {
    /// A finished cross-validation run's directory (its best fold
    /// predicts), or a transformers BERT, RoBERTa, ELECTRA or DistilBERT folder whose
    /// classifier was trained for the labels (config.json,
    /// model.safetensors, tokenizer.json: a MultiNLI fine-tune, a `kiln
    /// export`)
    from: PathBuf,
    /// Pairs to label (JSONL, TSV or CSV, read as the run's config says)
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Where to write one JSON line per pair: a file, or an existing
    /// folder to write predictions-<name>.jsonl in [default:
    /// RUN/predictions-<name>.jsonl; for a transformers folder,
    /// predictions-<name>.jsonl here]
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// For a transformers folder only (a run predicts as it was
    /// configured): how to read the pairs and name the labels
    /// (`experiment=nli_mnli`, `data.labels=[...]`, `model.init_labels=[...]`
    /// for a folder whose id2label says LABEL_0, ...), over the folder's
    /// shape
    #[command(flatten)]
    layers: Layers,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ResumeArgs {
    /// The run directory (`runs/<time>-<experiment>`), or a sweep's
    /// (`kiln train -m`): its jobs not finished run
    pub(crate) run: PathBuf,
    /// Continue from the checkpoint of this step instead of the newest (a
    /// language model's run: to go back before a divergence); what the run
    /// wrote after it is kept in RUN/checkpoints/after-STEP/
    #[arg(long, value_name = "STEP")]
    from: Option<u64>,
    /// Show the run in a live dashboard instead of lines (as `kiln train --tui`)
    #[arg(long)]
    tui: bool,
    /// Resume a CPU run even where its memory estimate exceeds the
    /// available RAM (as `kiln train --force`)
    #[arg(long)]
    force: bool,
    /// Changes to the saved configuration, `key=value`: for a language model
    /// the run's length (`training.max_steps=6000`), the optimizer's
    /// settings (`training.learning_rate=5e-4`), the micro-batch
    /// (`training.batch_size=6 training.gradient_accumulation_steps=2`) and
    /// evaluation; for any run precision, device, loader, logging and
    /// checkpoints. Not the model, the data or the seed
    #[arg(value_name = "KEY=VALUE")]
    pub(crate) overrides: Vec<String>,
}

/// `kiln train` (`-m`: a sweep).
pub(crate) fn train(args: TrainArgs, ctx: Context) -> anyhow::Result<ExitCode> {
    run_command("train", args, ctx)
}

/// `kiln cv`: the nli workload only (`-m`: a sweep).
pub(crate) fn cv(args: TrainArgs, ctx: Context) -> anyhow::Result<ExitCode> {
    run_command("cv", args, ctx)
}

fn run_command(command: &'static str, args: TrainArgs, ctx: Context) -> anyhow::Result<ExitCode> {
    if args.multirun {
        let start = super::sweep::Start {
            command,
            force: args.force,
            tui: args.tui,
            jobs: args.jobs,
            trials: args.trials.map(|n| (n, args.search_seed)),
            pruning: args.prune.then_some(super::sweep::Pruning {
                startup: args.prune_startup,
                warmup: args.prune_warmup,
            }),
            layers: &args.layers,
        };
        return super::sweep::run(&start, &ctx);
    }
    let resolved = resolve_for(command, args.layers, &ctx)?;
    if let Some(run) = torchrun_restart(&resolved, &kiln_train::kiln_dist::process_env())? {
        let resume_args = ResumeArgs {
            run,
            from: None,
            tui: args.tui,
            force: args.force,
            overrides: Vec::new(),
        };
        return resume(resume_args, ctx);
    }
    train_command(resolved, (args.force, args.tui), ctx.report)
}

/// Under torchrun's `--max-restarts`, which starts the same `kiln train`
/// (or `kiln cv`) again after a rank failed (`TORCHELASTIC_RESTART_COUNT` ≥ 1): the run
/// the attempts before it started, to resume from its last good
/// checkpoint, as `kiln launch --max-restarts` resumes, where training
/// again would begin at step 0 (or be refused, the folder holding a run).
/// `None` for a first attempt, without restarts, and where no run was
/// started yet. A `run.dir` with `{time}` is refused where restarts may
/// come: each attempt's clock would name another folder.
fn torchrun_restart(
    resolved: &ResolvedConfig,
    env: &[(String, String)],
) -> anyhow::Result<Option<std::path::PathBuf>> {
    let (attempt, max) = torchrun_attempt(env);
    if max == 0 {
        return Ok(None);
    }
    let template = resolved.config.run_dir_template();
    if template.contains("{time}") {
        return Err(BadInput(format!(
            "under torchrun --max-restarts {max}, run.dir must name one folder, but it is `{template}`: each attempt would fill in its own {{time}} and a restart would train again from step 0 in a new folder; set run.dir=<folder> (on several nodes, one on a shared filesystem)"
        ))
        .into());
    }
    let run = kiln_train::RunDir::path_of(
        &template,
        &resolved.config.experiment,
        std::time::SystemTime::now(),
    );
    if attempt == 0 || !run.join("config.toml").is_file() {
        return Ok(None);
    }
    eprintln!(
        "kiln: torchrun's restart {attempt} of {max}: resuming `{}` from its last good checkpoint",
        run.display()
    );
    Ok(Some(run))
}

/// torchrun's attempt (`TORCHELASTIC_RESTART_COUNT`, 0 for the first) and
/// its `--max-restarts` (`TORCHELASTIC_MAX_RESTARTS`, 0 without restarts or
/// torchrun).
fn torchrun_attempt(env: &[(String, String)]) -> (u32, u32) {
    let number = |name: &str| {
        env.iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.trim().parse::<u32>().ok())
            .unwrap_or(0)
    };
    (
        number("TORCHELASTIC_RESTART_COUNT"),
        number("TORCHELASTIC_MAX_RESTARTS"),
    )
}

/// The configuration `kiln train` or `kiln cv` runs with `layers`.
pub(crate) fn resolve_for(
    command: &str,
    layers: Layers,
    ctx: &Context,
) -> anyhow::Result<ResolvedConfig> {
    if command == "train" {
        return ctx.resolve(&layers);
    }
    let resolved = ctx.resolve_nli(layers)?;
    if resolved.config.workload != kiln_config::Workload::Nli {
        return Err(BadInput(format!(
            "`kiln cv` cross-validates the nli workload, but experiment `{}` is `{:?}`; use `kiln train`",
            resolved.config.experiment, resolved.config.workload
        ))
        .into());
    }
    Ok(resolved)
}

/// Whether the GPU preset `resolved` names by hand fits this machine
/// (`hardware=auto` chose one that does).
pub(crate) fn preset_fit(
    resolved: &ResolvedConfig,
    report: &HardwareReport,
) -> Result<(), kiln_config::PresetMismatch> {
    match resolved.hardware_choice {
        Some(_) => Ok(()),
        None => kiln_config::check_preset_fits(&resolved.config.hardware, report),
    }
}

/// `kiln resume RUN` (or `SWEEP`).
pub(crate) fn resume(args: ResumeArgs, ctx: Context) -> anyhow::Result<ExitCode> {
    if args.run.join(super::sweep::RECORD).is_file() {
        if !args.overrides.is_empty() || args.from.is_some() {
            return Err(BadInput(format!(
                "`{}` is a sweep: it resumes its jobs as they were configured; to change one, resume its folder (`kiln resume {}/<job> key=value`)",
                args.run.display(),
                args.run.display()
            ))
            .into());
        }
        return super::sweep::resume(&args.run, args.tui);
    }
    // torchrun's restart runs `kiln resume RUN --from STEP` again: the
    // first attempt went back to STEP, and this one goes on from where that
    // attempt got to, not back to STEP again.
    let from_step = match (
        args.from,
        torchrun_attempt(&kiln_train::kiln_dist::process_env()),
    ) {
        (Some(step), (attempt, max)) if attempt >= 1 && max >= 1 => {
            eprintln!(
                "kiln: torchrun's restart {attempt} of {max}: resuming `{}` from its last good checkpoint, not --from {step} again (the first attempt went back to step {step})",
                args.run.display()
            );
            None
        }
        (from, _) => from,
    };
    let mut options = train_options(ctx.report, Vec::new())?;
    options.force = args.force;
    let mut observer = observer(&options, args.tui)?;
    let request = kiln_train::ResumeRequest {
        overrides: args.overrides,
        from_step,
    };
    let outcome = kiln_train::resume_with(&args.run, &request, &options, &mut *observer);
    // The dashboard closes before the outcome is printed.
    drop(observer);
    let outcome = outcome.map_err(|e| rank_error(&options, e))?;
    Ok(finish(outcome, &options))
}

/// `kiln predict RUN --data FILE`.
pub(crate) fn predict(args: PredictArgs, ctx: &Context) -> anyhow::Result<ExitCode> {
    let (run, folder) = (
        args.from.join("config.toml").is_file(),
        args.from.join("config.json").is_file(),
    );
    let layers = args.layers;
    let unused = !layers.config.is_empty() || !layers.overrides.is_empty();
    let p = match (run, folder) {
        (true, _) if unused => {
            return Err(BadInput(format!(
                "`{}` is a run: it predicts as it was configured; --config and KEY=VALUE overrides are for a transformers folder",
                args.from.display()
            ))
            .into());
        }
        (true, _) => kiln_train::predict(&args.from, &args.data, args.out.as_deref(), &ctx.report),
        (false, true) => {
            let mut layers = layers;
            let shape = kiln_train::bert_folder_overrides(&args.from).map_err(train_error)?;
            layers.overrides.splice(0..0, shape);
            let config = ctx.resolve_nli(layers)?.config;
            kiln_train::predict_folder(&config, &args.data, args.out.as_deref(), &ctx.report)
        }
        (false, false) => {
            return Err(BadInput(format!(
                "`{}` is neither a kiln run (config.toml) nor a transformers folder (config.json)",
                args.from.display()
            ))
            .into());
        }
    }
    .map_err(train_error)?;
    let by = match p.fold {
        Some(fold) => format!("fold {fold}'s model"),
        None => format!("the classifier of {}", args.from.display()),
    };
    if let Some(skipped) = &p.skipped {
        eprintln!("kiln: {skipped}");
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "predicted {} with {by}: {}",
        kiln_train::counted(p.rows, "pair"),
        p.output.display()
    )?;
    if let Some(s) = &p.scores {
        writeln!(
            out,
            "against the file's labels: accuracy {:.1}%, macro-F1 {:.3}",
            100.0 * s.accuracy,
            s.macro_f1
        )?;
        for line in crate::progress::per_class_lines(s) {
            writeln!(out, "{line}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln train` and `kiln cv`: checks that a named GPU preset fits, then
/// trains (`--force`: even if it does not; `--tui`: in the dashboard).
fn train_command(
    resolved: ResolvedConfig,
    (force, tui): (bool, bool),
    report: HardwareReport,
) -> anyhow::Result<ExitCode> {
    crate::data::provide_for(&resolved.config)?;
    if let Err(msg) = preset_fit(&resolved, &report) {
        if !force {
            return Err(BadInput(format!(
                "{msg}; pass --force to run it on this machine anyway, or use hardware=auto"
            ))
            .into());
        }
        eprintln!("warning: {msg}; running anyway (--force)");
    }
    let sources = super::config::explain_text(&resolved)
        .lines()
        .map(String::from)
        .collect();
    let mut options = train_options(report, sources)?;
    options.force = force;
    if let Some(choice) = &resolved.hardware_choice
        && options.writes()
    {
        println!("kiln: hardware = {}: {}", choice.name, choice.why);
    }
    let mut observer = observer(&options, tui)?;
    let outcome = kiln_train::train(&resolved.config, &options, &mut *observer);
    // The dashboard closes before the outcome is printed.
    drop(observer);
    let outcome = outcome.map_err(|e| rank_error(&options, e))?;
    Ok(finish(outcome, &options))
}

/// Rank 0 (or a single process) prints the run, as lines or (`--tui`, on a
/// terminal) in the dashboard; a job's other ranks print nothing but their
/// errors.
fn observer(
    options: &kiln_train::TrainOptions,
    tui: bool,
) -> anyhow::Result<Box<dyn kiln_train::Observer>> {
    if !options.writes() {
        return Ok(Box::new(kiln_train::Silent));
    }
    if tui {
        #[cfg(feature = "tui")]
        {
            use std::io::IsTerminal;
            if std::io::stdout().is_terminal() {
                return Ok(Box::new(crate::dashboard::Dashboard::new(Arc::clone(
                    &options.interrupt,
                ))));
            }
            eprintln!("kiln: --tui needs a terminal on standard output; printing lines");
        }
        #[cfg(not(feature = "tui"))]
        {
            return Err(BadInput(
                "--tui: this kiln was built without its `tui` feature (on by default); build it with `--features tui`".to_string(),
            )
            .into());
        }
    }
    Ok(Box::new(progress::Printer::new()))
}

/// A training error, naming the rank and the host in a job.
fn rank_error(options: &kiln_train::TrainOptions, e: kiln_train::TrainError) -> anyhow::Error {
    in_rank(options.group.as_deref(), e)
}

/// `e`, naming the rank of `group` and its host in a job (`kiln train`,
/// `kiln bench lm` under a launcher).
pub(crate) fn in_rank(
    group: Option<&kiln_train::kiln_dist::Group>,
    e: kiln_train::TrainError,
) -> anyhow::Error {
    let err = train_error(e);
    match group {
        Some(g) => err.context(format!(
            "rank {} of {} on {}",
            g.rank(),
            g.world_size(),
            kiln_train::kiln_dist::hostname()
        )),
        None => err,
    }
}

/// Joins the data-parallel job this process was started in (by `kiln
/// launch`, torchrun or Slurm), or `None` alone. Waits up to
/// `RENDEZVOUS_TIMEOUT` seconds (300) for every rank.
pub(crate) fn join_job() -> anyhow::Result<Option<Arc<kiln_train::kiln_dist::Group>>> {
    use kiln_train::kiln_dist::{Group, WorldSpec};
    let env = kiln_train::kiln_dist::process_env();
    let spec = WorldSpec::from_env(&env).map_err(|e| train_error(e.into()))?;
    let Some(spec) = spec else {
        return Ok(None);
    };
    let timeout = std::env::var("RENDEZVOUS_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(
            std::time::Duration::from_secs(300),
            std::time::Duration::from_secs,
        );
    let group = Group::connect(&spec, timeout).map_err(|e| {
        train_error(e.into()).context(format!(
            "rank {} of {} joining the job at {}",
            spec.rank,
            spec.world_size,
            spec.addr()
        ))
    })?;
    Ok(Some(Arc::new(group)))
}

/// Options for a training run: Ctrl-C stops it after the current step with a
/// checkpoint; a second Ctrl-C ends the process at once, as does the first
/// before the first step (while the data is prepared: nothing to save).
fn train_options(
    hardware: HardwareReport,
    sources: Vec<String>,
) -> anyhow::Result<kiln_train::TrainOptions> {
    let mut options = kiln_train::TrainOptions::new(hardware);
    let flag = Arc::clone(&options.interrupt);
    let saves = Arc::clone(&options.saves_on_stop);
    ctrlc::set_handler(move || {
        let again = flag.swap(true, Ordering::SeqCst);
        let before_the_loop = !saves.load(Ordering::SeqCst);
        if again || before_the_loop {
            if !again {
                eprintln!(
                    "\nkiln: stopped before the first step: nothing to save yet (a token \
                     store's preparation goes on from where it stopped when run again)"
                );
            }
            // The dashboard, if open, has no chance to put the terminal back.
            #[cfg(feature = "tui")]
            crate::dashboard::restore_terminal();
            std::process::exit(130);
        }
        eprintln!(
            "\nkiln: stopping after this step with a checkpoint (Ctrl-C again to quit at once)"
        );
    })?;
    options.sources = sources;
    options.group = join_job()?;
    if options.group.is_some() {
        // A job's ranks take a stop together, in a step's reduction: one
        // that ended at once while another waited on it in a collective
        // would fail the other.
        options.saves_on_stop.store(true, Ordering::SeqCst);
    }
    Ok(options)
}

fn finish(outcome: kiln_train::Outcome, options: &kiln_train::TrainOptions) -> ExitCode {
    if !options.writes() {
        // Rank 0 says how the job ended.
        return match outcome {
            kiln_train::Outcome::Interrupted { .. } => ExitCode::from(130),
            _ => ExitCode::SUCCESS,
        };
    }
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
