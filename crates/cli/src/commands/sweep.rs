//! `kiln train -m` and `kiln cv -m`: Hydra's multirun. The overrides'
//! sweeps (`training.learning_rate=1e-3,3e-4 model.layers=range(2,6,2)`)
//! make the jobs (`kiln_config::sweep`); every job's configuration is
//! resolved and checked before the first starts, so that a bad value of the
//! fifth does not wait for four runs to be refused. The jobs run one after
//! another, each a `kiln train` (or `kiln cv`) of its own in
//! `<sweep>/<job>-<values>/`, a run like any other (resume, export, sample
//! it). `sweep.json` records each job's state and result as it ends, and
//! the sweep ends with a table of them, the best marked. Ctrl-C stops the
//! running job with its checkpoint and the sweep after it; `kiln resume
//! SWEEP` goes on: it skips the finished jobs, resumes a stopped or failed
//! one from its checkpoint and starts the rest. A job that fails is
//! recorded with its error and the sweep goes on with the next.

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use kiln_config::Workload;
use kiln_config::sweep::Axis;
use kiln_hwdetect::HardwareReport;
use serde::{Deserialize, Serialize};

use super::{BadInput, Context, Layers};

/// The record of a sweep, `SWEEP/sweep.json`.
pub(crate) const RECORD: &str = "sweep.json";

/// What a sweep is and how far it got.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    /// `train` or `cv`.
    command: String,
    /// The global flags each job runs with (`--presets`, `--hardware-report`).
    prefix: Vec<String>,
    /// The command's flags each job runs with (`--force`, `--config FILE`).
    flags: Vec<String>,
    /// The workload of every job.
    workload: Workload,
    /// What the sweep compares and which way is better.
    objective: Objective,
    /// The swept keys and their values.
    axes: Vec<Axis>,
    /// How many jobs run at once (`--jobs`).
    #[serde(default = "one")]
    at_once: usize,
    /// The median rule, if the sweep prunes (`--prune`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pruning: Option<Pruning>,
    /// The jobs, in order.
    jobs: Vec<Job>,
}

fn one() -> usize {
    1
}

/// A job of the sweep.
#[derive(Debug, Serialize, Deserialize)]
struct Job {
    /// Its folder in the sweep's.
    dir: String,
    /// Its overrides, the swept ones with its values (`run.dir` aside).
    overrides: Vec<String>,
    /// Its value of each swept key, in the axes' order.
    values: Vec<String>,
    /// Whether it writes TensorBoard files (`logging.tensorboard`): the
    /// sweep then writes its values there for the HParams dashboard.
    #[serde(default)]
    tensorboard: bool,
    /// How far it got.
    status: Status,
    /// How its last attempt ended, when not well (`exit code 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exit: Option<String>,
    /// The error it ended with, when it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// Why it was pruned: at which step, its best loss and the median.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pruned: Option<String>,
    /// What it reached, once finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<JobResult>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    /// Not started yet.
    Pending,
    /// Ran to its end: its summary is written.
    Finished,
    /// Stopped with a checkpoint (Ctrl-C); `kiln resume SWEEP` goes on.
    Interrupted,
    /// Ended with an error; `kiln resume SWEEP` tries it again.
    Failed,
    /// Stopped early with a checkpoint by the median rule (`--prune`): its
    /// best validation loss was above the finished jobs' median at that
    /// step. Done: a resume leaves it.
    Pruned,
}

impl Status {
    /// The state in the table's words.
    fn word(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Finished => "finished",
            Self::Interrupted => "stopped",
            Self::Failed => "failed",
            Self::Pruned => "pruned",
        }
    }

    /// Whether the job has nothing left to run.
    fn done(self) -> bool {
        matches!(self, Self::Finished | Self::Pruned)
    }
}

/// Optuna's `MedianPruner` over a language model's evaluations: a running
/// job whose best validation loss so far is above the median of the
/// finished jobs' losses at its latest evaluation's step stops there.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Pruning {
    /// No pruning before this many jobs have finished (Optuna's
    /// `n_startup_trials`).
    pub(crate) startup: usize,
    /// No pruning at an evaluation before this step (`n_warmup_steps`).
    pub(crate) warmup: u64,
}

/// A language model's evaluations so far, `(step, val_loss)`, from its
/// `metrics.jsonl`.
fn evaluations(dir: &Path) -> Vec<(u64, f64)> {
    let mut watch = Watch::default();
    watch.read(dir);
    watch.evals
}

/// What the sweep has read of a running job's `metrics.jsonl`: up to
/// `offset`, whole lines, its evaluations; and why it is being pruned.
#[derive(Debug, Default)]
struct Watch {
    offset: u64,
    evals: Vec<(u64, f64)>,
    pruned: Option<String>,
}

impl Watch {
    /// Reads the lines written since the last read (all again if the file
    /// was cut, as a resume cuts it); whether it found any.
    fn read(&mut self, dir: &Path) -> bool {
        use std::io::{Read as _, Seek as _};
        let Ok(mut file) = std::fs::File::open(dir.join("metrics.jsonl")) else {
            return false;
        };
        let len = file.metadata().map_or(0, |m| m.len());
        if len < self.offset {
            (self.offset, self.evals) = (0, Vec::new());
        }
        if len == self.offset || file.seek(std::io::SeekFrom::Start(self.offset)).is_err() {
            return false;
        }
        let mut text = String::new();
        if file.read_to_string(&mut text).is_err() {
            return false;
        }
        // Whole lines only: the last may be half written.
        let whole = text.rfind('\n').map_or(0, |i| i + 1);
        self.offset += whole as u64;
        self.evals.extend(
            text[..whole]
                .lines()
                .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
                .filter(|v| v["kind"] == "eval")
                .filter_map(|v| Some((v["step"].as_u64()?, v["val_loss"].as_f64()?))),
        );
        whole > 0
    }
}

/// Why a job with evaluations `own` is pruned, if it is: its latest step,
/// its best loss so far, and the finished jobs' median at that step.
fn prune_at(
    own: &[(u64, f64)],
    finished: &[Vec<(u64, f64)>],
    rule: Pruning,
) -> Option<(u64, f64, f64)> {
    let &(step, _) = own.last()?;
    if step < rule.warmup || finished.is_empty() || finished.len() < rule.startup {
        return None;
    }
    let best = own.iter().map(|&(_, v)| v).fold(f64::INFINITY, f64::min);
    let mut at: Vec<f64> = finished
        .iter()
        .filter_map(|evals| evals.iter().find(|&&(s, _)| s == step).map(|&(_, v)| v))
        .collect();
    if at.is_empty() {
        return None;
    }
    at.sort_by(f64::total_cmp);
    let mid = at.len() / 2;
    let median = if at.len() % 2 == 1 {
        at[mid]
    } else {
        (at[mid - 1] + at[mid]) / 2.0
    };
    (best.is_nan() || best > median).then_some((step, best, median))
}

/// The measure the sweep ranks its jobs by.
#[derive(Debug, Serialize, Deserialize)]
struct Objective {
    /// The key of the job's summary (`best_val_loss`, `macro_f1_mean`).
    name: String,
    /// Whether a larger value is better.
    higher_is_better: bool,
    /// The unit of the jobs' throughput.
    throughput: String,
}

impl Objective {
    fn of(workload: Workload) -> Self {
        match workload {
            Workload::Lm => Self {
                name: "best_val_loss".into(),
                higher_is_better: false,
                throughput: "tokens/s".into(),
            },
            Workload::Nli => Self {
                name: "macro_f1_mean".into(),
                higher_is_better: true,
                throughput: "pairs/s".into(),
            },
        }
    }
}

/// What a finished job reached, from its `summary.json` or `cv_summary.json`.
#[derive(Debug, Serialize, Deserialize)]
struct JobResult {
    /// The objective's value (`None`: the run had no validation).
    objective: Option<f64>,
    /// Median throughput (tokens/s, pairs/s).
    throughput: f64,
    /// Wall time of the run, seconds.
    wall_s: f64,
}

impl JobResult {
    /// The result of the finished run in `dir`, if it is finished.
    fn read(dir: &Path, workload: Workload) -> Option<Self> {
        match workload {
            Workload::Lm => {
                let text = std::fs::read_to_string(dir.join("summary.json")).ok()?;
                let s: kiln_train::Summary = serde_json::from_str(&text).ok()?;
                Some(Self {
                    objective: s.best_val_loss.or(s.final_val_loss),
                    throughput: s.median_tokens_per_s,
                    wall_s: s.wall_s,
                })
            }
            Workload::Nli => {
                let text = std::fs::read_to_string(dir.join("cv_summary.json")).ok()?;
                let s: kiln_train::CvSummary = serde_json::from_str(&text).ok()?;
                Some(Self {
                    objective: Some(s.macro_f1_mean),
                    throughput: s.median_samples_per_s,
                    wall_s: s.wall_s,
                })
            }
        }
    }
}

/// How the sweep's jobs are started.
pub(crate) struct Start<'a> {
    /// `train` or `cv`.
    pub(crate) command: &'static str,
    /// Run a GPU preset on a machine without that GPU.
    pub(crate) force: bool,
    /// Each job in the dashboard.
    pub(crate) tui: bool,
    /// Jobs at once (`--jobs`).
    pub(crate) jobs: usize,
    /// Random search: trials and the draws' seed (`--trials`,
    /// `--search-seed`); `None`: every combination.
    pub(crate) trials: Option<(usize, u64)>,
    /// The median rule (`--prune`).
    pub(crate) pruning: Option<Pruning>,
    /// The configuration layers, sweeps and all.
    pub(crate) layers: &'a Layers,
}

/// `kiln train -m` / `kiln cv -m`: checks every job, then runs them.
pub(crate) fn run(start: &Start<'_>, ctx: &Context) -> anyhow::Result<ExitCode> {
    refuse_in_a_job(&format!("kiln {} -m", start.command))?;
    let pace = Pace::new(start.tui, start.jobs, &ctx.report)?;
    let (axes, jobs) = match start.trials {
        Some((trials, seed)) => kiln_config::sweep::draw(&start.layers.overrides, trials, seed)?,
        None => kiln_config::sweep::expand(&start.layers.overrides)?,
    };
    if let Some(axis) = axes.iter().find(|a| a.key == "run.dir") {
        return Err(BadInput(format!(
            "`run.dir` cannot be swept ({}={}): the sweep's folder is run.dir's, and each job's is a folder in it",
            axis.key,
            axis.values.join(",")
        ))
        .into());
    }
    let configs = check_jobs(start, &jobs, ctx)?;
    let workload = configs[0].workload;
    if start.pruning.is_some() && workload != Workload::Lm {
        return Err(BadInput(
            "--prune compares a language model's evaluations at each step; a cross-validation's folds each have cv.patience"
                .into(),
        )
        .into());
    }
    let experiment = &configs[0].experiment;
    let name = if configs.iter().all(|c| &c.experiment == experiment) {
        format!("{experiment}-sweep")
    } else {
        "sweep".to_string()
    };
    let template = configs[0]
        .run
        .dir
        .replace("{data}", &configs[0].data_name());
    let dir = kiln_train::RunDir::path_of(&template, &name, std::time::SystemTime::now());
    if dir.join(RECORD).exists() || dir.join("config.toml").exists() {
        return Err(BadInput(format!(
            "`{}` already holds a {}; resume it with `kiln resume {}`, or choose another run.dir",
            dir.display(),
            if dir.join(RECORD).exists() {
                "sweep"
            } else {
                "run"
            },
            dir.display()
        ))
        .into());
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("creating `{}`: {e}", dir.display()))?;
    let mut flags = Vec::new();
    if start.force {
        flags.push("--force".to_string());
    }
    for config in &start.layers.config {
        // Absolute, so that a resume from another folder reads the same file.
        let config = std::path::absolute(config).unwrap_or_else(|_| config.clone());
        flags.extend(["--config".to_string(), config.display().to_string()]);
    }
    let record = Record {
        command: start.command.to_string(),
        prefix: ctx.prefix(),
        flags,
        workload,
        objective: Objective::of(workload),
        jobs: jobs
            .iter()
            .enumerate()
            .map(|(n, job)| Job {
                dir: job_dir(n, &job.swept),
                overrides: job.overrides.clone(),
                values: job.swept.iter().map(|(_, v)| v.clone()).collect(),
                tensorboard: configs[n].logging.tensorboard,
                status: Status::Pending,
                exit: None,
                error: None,
                pruned: None,
                result: None,
            })
            .collect(),
        axes,
        at_once: pace.jobs,
        pruning: start.pruning,
    };
    let over = record
        .axes
        .iter()
        .map(|a| match &a.drawn_from {
            Some(from) => format!("{} from {from}", a.key),
            None => format!("{} ({})", a.key, a.values.join(", ")),
        })
        .collect::<Vec<_>>();
    println!(
        "kiln: {} of {} jobs in {}{}",
        match start.trials {
            Some((_, seed)) => format!("random search (seed {seed})"),
            None => "sweep".into(),
        },
        record.jobs.len(),
        dir.display(),
        match over.as_slice() {
            [] => String::new(),
            _ if start.trials.is_some() => format!(" drawing {}", over.join(", ")),
            _ => format!(" over {}", over.join(" × ")),
        }
    );
    run_jobs(record, &dir, pace)
}

/// Every job's configuration, resolved and checked as `kiln train` would
/// (a GPU preset's fit too, unless `--force`), before any job runs: the
/// jobs refused are named together; a sweep is of one workload.
fn check_jobs(
    start: &Start<'_>,
    jobs: &[kiln_config::sweep::SweepJob],
    ctx: &Context,
) -> anyhow::Result<Vec<kiln_config::RunConfig>> {
    let mut configs = Vec::new();
    let mut problems = Vec::new();
    for (n, job) in jobs.iter().enumerate() {
        let layers = Layers {
            config: start.layers.config.clone(),
            overrides: job.overrides.clone(),
        };
        let checked = super::train::resolve_for(start.command, layers, ctx).and_then(|r| {
            match super::train::preset_fit(&r, &ctx.report) {
                Err(msg) if !start.force => Err(BadInput(format!(
                    "{msg}; pass --force to run it on this machine anyway, or use hardware=auto"
                ))
                .into()),
                _ => Ok(r),
            }
        });
        match checked {
            Ok(r) => configs.push(r.config),
            Err(e) => problems.push(format!("job {n} ({}): {e:#}", label(&job.swept, " "))),
        }
    }
    if !problems.is_empty() {
        return Err(BadInput(format!(
            "{} of the sweep's {} jobs would be refused; none was started:\n{}",
            problems.len(),
            jobs.len(),
            problems.join("\n")
        ))
        .into());
    }
    let workload = configs[0].workload;
    if let Some((n, c)) = configs
        .iter()
        .enumerate()
        .find(|(_, c)| c.workload != workload)
    {
        return Err(BadInput(format!(
            "job {n} ({}) is a {:?} run and job 0 a {workload:?} run: a sweep compares runs of one workload",
            label(&jobs[n].swept, " "),
            c.workload
        ))
        .into());
    }
    Ok(configs)
}

/// A sweep's jobs as another command reads them: each one's label
/// (`training.learning_rate=3e-3 model.layers=2`), folder and state (in
/// the table's words).
pub(crate) fn jobs_of(dir: &Path) -> anyhow::Result<Vec<(String, std::path::PathBuf, String)>> {
    let record = read_record(dir)?;
    Ok((0..record.jobs.len())
        .map(|n| {
            let job = &record.jobs[n];
            (
                label_of(&record, n, " "),
                dir.join(&job.dir),
                job.status.word().to_string(),
            )
        })
        .collect())
}

/// `dir`'s `sweep.json`.
fn read_record(dir: &Path) -> anyhow::Result<Record> {
    let path = dir.join(RECORD);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| BadInput(format!("failed to read `{}`: {e}", path.display())))?;
    Ok(serde_json::from_str(&text)
        .map_err(|e| BadInput(format!("`{}` line {}: {e}", path.display(), e.line())))?)
}

/// `kiln resume SWEEP`: goes on with the jobs not finished.
pub(crate) fn resume(dir: &Path, tui: bool) -> anyhow::Result<ExitCode> {
    refuse_in_a_job("kiln resume SWEEP")?;
    let record = read_record(dir)?;
    let left = record.jobs.iter().filter(|j| !j.status.done()).count();
    // The machine the jobs see: the sweep's `--hardware-report`, if it had one.
    let ctx = Context::from_prefix(&record.prefix)?;
    let pace = Pace::new(tui, record.at_once, &ctx.report)?;
    println!(
        "kiln: resuming the sweep in {}: {left} of {} jobs to run",
        dir.display(),
        record.jobs.len()
    );
    run_jobs(record, dir, pace)
}

/// A sweep starts processes of its own, one job at a time: not as a rank of
/// a data-parallel job.
fn refuse_in_a_job(what: &str) -> anyhow::Result<()> {
    let env = kiln_train::kiln_dist::process_env();
    if matches!(
        kiln_train::kiln_dist::WorldSpec::from_env(&env),
        Ok(Some(_))
    ) {
        return Err(BadInput(format!(
            "{what} starts its jobs as processes of its own on this machine; it cannot be a rank of a data-parallel job (WORLD_SIZE is set)"
        ))
        .into());
    }
    Ok(())
}

/// The jobs running now, by slot (0: none), and whether each has a process
/// group of its own, for the Ctrl-C handler.
struct Running {
    pids: Vec<AtomicI32>,
    own_group: bool,
    stop: AtomicBool,
}

impl Running {
    /// Passes Ctrl-C on to every job running in a group of its own.
    fn interrupt_all(&self) {
        if !self.own_group {
            return;
        }
        for pid in &self.pids {
            let pid = pid.load(Ordering::SeqCst);
            if pid > 0 {
                // SAFETY: kill(2) on a job this process started; its slot is
                // cleared as soon as it has been reaped.
                unsafe {
                    libc::kill(pid, libc::SIGINT);
                }
            }
        }
    }
}

/// How the jobs run: the dashboard, and how many at once with which
/// devices.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pace {
    /// Each job in the dashboard (one at a time).
    pub(crate) tui: bool,
    /// Jobs at once.
    pub(crate) jobs: usize,
    /// The GPUs to spread them over (`device.index`), 0 on the CPU.
    pub(crate) gpus: usize,
}

impl Pace {
    /// `jobs` at once on the machine of `report`; refused with the dashboard.
    pub(crate) fn new(tui: bool, jobs: usize, report: &HardwareReport) -> anyhow::Result<Self> {
        if jobs == 0 {
            return Err(
                BadInput("--jobs 0: a sweep runs at least one job at a time".into()).into(),
            );
        }
        if tui && jobs > 1 {
            return Err(BadInput(format!(
                "--tui shows one job; with --jobs {jobs} each job writes its output to its folder's {LOG}"
            ))
            .into());
        }
        Ok(Self {
            tui,
            jobs,
            gpus: report.gpus().len(),
        })
    }
}

/// A job's output when several run at once, in its folder.
const LOG: &str = "kiln.log";

/// A job started: its number, its process, where its error goes.
struct Started {
    n: usize,
    child: std::process::Child,
    error_file: std::path::PathBuf,
}

/// Runs the jobs not finished, `pace.jobs` at a time, recording each as it
/// ends; prints the table.
fn run_jobs(mut record: Record, dir: &Path, pace: Pace) -> anyhow::Result<ExitCode> {
    let _lock = lock(dir)?;
    // With the dashboard the job shares the terminal's process group, which
    // sends it Ctrl-C itself; else each job has a group of its own (as a
    // launcher's ranks), and each Ctrl-C here is passed on once.
    let running = Arc::new(Running {
        pids: (0..pace.jobs).map(|_| AtomicI32::new(0)).collect(),
        own_group: !pace.tui,
        stop: AtomicBool::new(false),
    });
    let handler = Arc::clone(&running);
    ctrlc::set_handler(move || {
        // (Not over the dashboard, which has the terminal.)
        if !handler.stop.swap(true, Ordering::SeqCst) && handler.own_group {
            eprintln!(
                "\nkiln: the sweep stops after its running jobs have written their checkpoints"
            );
        }
        handler.interrupt_all();
    })?;
    let program = std::env::current_exe()?;
    let to_run: Vec<usize> = (0..record.jobs.len())
        .filter(|&n| !record.jobs[n].status.done())
        .collect();
    // The finished jobs' evaluations, for the median rule.
    let mut finished: Vec<Vec<(u64, f64)>> = record
        .jobs
        .iter()
        .filter(|j| j.status == Status::Finished && record.pruning.is_some())
        .map(|j| evaluations(&dir.join(&j.dir)))
        .collect();
    // What has been read of each running job's metrics.
    let mut seen: Vec<Watch> = (0..pace.jobs).map(|_| Watch::default()).collect();
    let mut queue = to_run.into_iter();
    let mut slots: Vec<Option<Started>> = (0..pace.jobs).map(|_| None).collect();
    loop {
        for (slot, place) in slots.iter_mut().enumerate() {
            if place.is_some() || running.stop.load(Ordering::SeqCst) {
                continue;
            }
            let Some(n) = queue.next() else { break };
            let started = start_job(&record, n, dir, &program, pace, slot)?;
            running.pids[slot].store(started.child.id() as i32, Ordering::SeqCst);
            seen[slot] = Watch::default();
            if running.stop.load(Ordering::SeqCst) && running.own_group {
                // Ctrl-C came while it started, maybe before the handler
                // could see its pid: this job alone is told here (the
                // others heard it once; a second would stop them at once).
                // Had the handler reached it too, it stops at once, with
                // nothing to lose yet.
                // SAFETY: kill(2) on the job just started, not yet reaped.
                unsafe {
                    libc::kill(started.child.id() as i32, libc::SIGINT);
                }
            }
            *place = Some(started);
        }
        if slots.iter().all(Option::is_none) {
            break;
        }
        let mut ended = false;
        for (slot, place) in slots.iter_mut().enumerate() {
            let Some(started) = place else { continue };
            let Some(status) = started.child.try_wait()? else {
                if let Some(rule) = record.pruning {
                    prune_if_behind(&record, started, &mut seen[slot], &finished, rule, dir);
                }
                continue;
            };
            running.pids[slot].store(0, Ordering::SeqCst);
            let Started { n, error_file, .. } = place.take().expect("a job in the slot");
            let ending = Ending {
                status,
                error_file: &error_file,
                pruned: seen[slot].pruned.take(),
            };
            end_job(&mut record, n, dir, ending, pace);
            match record.jobs[n].status {
                Status::Interrupted => running.stop.store(true, Ordering::SeqCst),
                Status::Finished if record.pruning.is_some() => {
                    finished.push(evaluations(&dir.join(&record.jobs[n].dir)));
                }
                _ => {}
            }
            kiln_train::write_atomic(
                &dir.join(RECORD),
                serde_json::to_string_pretty(&record)?.as_bytes(),
            )?;
            ended = true;
        }
        if !ended {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    // A sweep stopped before its first job still has its record.
    kiln_train::write_atomic(
        &dir.join(RECORD),
        serde_json::to_string_pretty(&record)?.as_bytes(),
    )?;
    print!("{}", table(&record, dir));
    let unfinished = record.jobs.iter().filter(|j| !j.status.done()).count();
    Ok(if running.stop.load(Ordering::SeqCst) && unfinished > 0 {
        println!(
            "sweep stopped with {unfinished} jobs to run\nresume with: kiln resume {}",
            dir.display()
        );
        ExitCode::from(130)
    } else if record.jobs.iter().any(|j| j.status == Status::Failed) {
        println!(
            "some jobs failed; `kiln resume {}` runs them again",
            dir.display()
        );
        ExitCode::FAILURE
    } else {
        println!("sweep directory: {}", dir.display());
        ExitCode::SUCCESS
    })
}

/// Reads what the running job logged since the last look and, where the
/// median rule says so, stops it with a checkpoint (once), saying why.
fn prune_if_behind(
    record: &Record,
    started: &Started,
    seen: &mut Watch,
    finished: &[Vec<(u64, f64)>],
    rule: Pruning,
    dir: &Path,
) {
    if seen.pruned.is_some() || !seen.read(&dir.join(&record.jobs[started.n].dir)) {
        return;
    }
    let Some((step, best, median)) = prune_at(&seen.evals, finished, rule) else {
        return;
    };
    let why = format!(
        "at step {step}: best val loss {best:.4} above the finished jobs' median {median:.4}"
    );
    println!("kiln: job {} pruned {why}", started.n);
    seen.pruned = Some(why);
    // SAFETY: kill(2) on a job this process started and has not reaped.
    unsafe {
        libc::kill(started.child.id() as i32, libc::SIGINT);
    }
}

/// Starts job `n` in `slot`: a `kiln train` (or `cv`) of its overrides, or
/// a `kiln resume` of its folder where it has begun. One job at a time
/// prints to the terminal; several write to their folders' `kiln.log`, each
/// on a GPU of its own where there are enough (`device.index`, unless the
/// job sets it) and with its share of the CPU's cores.
fn start_job(
    record: &Record,
    n: usize,
    dir: &Path,
    program: &Path,
    pace: Pace,
    slot: usize,
) -> anyhow::Result<Started> {
    use std::os::unix::process::CommandExt as _;
    let job = &record.jobs[n];
    let job_dir = dir.join(&job.dir);
    let error_file = dir.join(format!(".job-{n}.error"));
    let _ = std::fs::remove_file(&error_file);
    let mut args = record.prefix.clone();
    args.push(format!("--error-file={}", error_file.display()));
    let resuming = job_dir.join("config.toml").is_file();
    let device = (pace.jobs > 1
        && pace.gpus > 0
        && !job.overrides.iter().any(|o| o.starts_with("device.index=")))
    .then(|| slot % pace.gpus);
    if resuming {
        args.push("resume".into());
        if pace.tui {
            args.push("--tui".into());
        }
        args.push(job_dir.display().to_string());
        // The device is not the run's to keep: a resume may take another.
        args.extend(device.map(|d| format!("device.index={d}")));
    } else {
        args.push(record.command.clone());
        args.extend(record.flags.iter().cloned());
        if pace.tui {
            args.push("--tui".into());
        }
        args.extend(job.overrides.iter().cloned());
        // Quoted: a folder's name is a string, whatever it looks like.
        args.push(format!(
            "run.dir={}",
            serde_json::to_string(&job_dir.display().to_string())?
        ));
        args.extend(device.map(|d| format!("device.index={d}")));
    }
    if !resuming && job.tensorboard && !record.axes.is_empty() {
        // The job's values, for TensorBoard's HParams dashboard: a table of
        // the sweep's jobs with their scalars' last values.
        let hparams: Vec<(String, kiln_train::HParam)> = record
            .axes
            .iter()
            .zip(&job.values)
            .map(|(a, v)| (a.key.clone(), kiln_train::HParam::parse(v)))
            .collect();
        kiln_train::write_hparams(&job_dir.join("tensorboard"), &hparams)?;
    }
    let mut command = std::process::Command::new(program);
    command.args(&args);
    let on = device.map_or(String::new(), |d| format!(" on GPU {d}"));
    if pace.jobs > 1 {
        std::fs::create_dir_all(&job_dir)
            .map_err(|e| anyhow::anyhow!("creating `{}`: {e}", job_dir.display()))?;
        let log_path = job_dir.join(LOG);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| anyhow::anyhow!("opening `{}`: {e}", log_path.display()))?;
        command
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // As `kiln launch` splits the cores among its ranks.
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            command.env("RAYON_NUM_THREADS", (cores / pace.jobs).max(1).to_string());
        }
        println!(
            "kiln: job {n} ({}){}{on}: {}",
            label_of(record, n, " "),
            if resuming { " resumed" } else { " started" },
            log_path.display()
        );
    } else {
        println!(
            "kiln: sweep job {n} of 0–{} ({}){}{on}: {}",
            record.jobs.len() - 1,
            label_of(record, n, " "),
            if resuming { ", resumed" } else { "" },
            job_dir.display()
        );
    }
    std::io::stdout().flush()?;
    if !pace.tui {
        command.process_group(0);
    }
    // SAFETY: prctl is async-signal-safe; the closure touches nothing of
    // the parent's. A job whose sweep is killed stops with its checkpoint
    // (SIGTERM is Ctrl-C's to kiln).
    unsafe {
        command.pre_exec(|| {
            #[cfg(target_os = "linux")]
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let child = command
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting `{}`: {e}", program.display()))?;
    Ok(Started {
        n,
        child,
        error_file,
    })
}

/// How a job's process ended.
struct Ending<'a> {
    status: std::process::ExitStatus,
    /// Where it wrote its error, if it failed.
    error_file: &'a Path,
    /// Why the sweep stopped it, if the median rule did.
    pruned: Option<String>,
}

/// Whether run directory `run` holds a checkpoint file.
fn has_checkpoint(run: &Path) -> bool {
    std::fs::read_dir(run.join("checkpoints")).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
    })
}

/// Records how job `n` ended: its state, error and result.
fn end_job(record: &mut Record, n: usize, dir: &Path, ending: Ending<'_>, pace: Pace) {
    let workload = record.workload;
    let job = &mut record.jobs[n];
    let status = ending.status;
    job.error = std::fs::read_to_string(ending.error_file).ok();
    let _ = std::fs::remove_file(ending.error_file);
    job.result = JobResult::read(&dir.join(&job.dir), workload);
    job.pruned = None;
    (job.status, job.exit) = match (status.success(), status.code()) {
        (true, _) if job.result.is_some() => (Status::Finished, None),
        (_, Some(130)) if ending.pruned.is_some() => {
            job.pruned = ending.pruned;
            (Status::Pruned, None)
        }
        (_, Some(130)) => (Status::Interrupted, None),
        _ => (
            Status::Failed,
            Some(kiln_train::kiln_dist::describe_exit(status)),
        ),
    };
    if pace.jobs > 1 {
        // The jobs' own lines are in their logs: one line here as each ends.
        let how = match (&job.status, &job.result) {
            (Status::Finished, Some(r)) => format!(
                "finished: {} {} in {:.0} s",
                record.objective.name,
                r.objective.map_or("-".into(), |v| format!("{v:.4}")),
                r.wall_s
            ),
            // A job stopped while it prepared its data ends at once, with
            // nothing to save: its resume starts it again.
            (Status::Interrupted, _) if !has_checkpoint(&dir.join(&job.dir)) => {
                "stopped before its first step".into()
            }
            (Status::Interrupted, _) => "stopped with a checkpoint".into(),
            (Status::Pruned, _) => "stopped with a checkpoint (pruned)".into(),
            _ => format!(
                "failed: {}",
                job.error
                    .as_deref()
                    .and_then(|e| e.lines().next())
                    .or(job.exit.as_deref())
                    .unwrap_or_default()
            ),
        };
        println!("kiln: job {n} {how}");
    }
}

/// One sweep at a time in a folder.
fn lock(dir: &Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("sweep.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("opening `{}`: {e}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(BadInput(format!(
            "the sweep in `{}` is running in another process",
            dir.display()
        ))
        .into()),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(anyhow::anyhow!("locking `{}`: {e}", path.display()))
        }
    }
}

/// A job's folder: its number, then its values (`3-learning_rate=3e-4,layers=4`),
/// with what a folder's name should not hold made `_`.
fn job_dir(n: usize, swept: &[(String, String)]) -> String {
    let values: String = swept
        .iter()
        .map(|(k, v)| format!("{}={v}", k.rsplit('.').next().unwrap_or(k)))
        .collect::<Vec<_>>()
        .join(",")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._=,+-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(80)
        .collect();
    if values.is_empty() {
        n.to_string()
    } else {
        format!("{n}-{values}")
    }
}

/// `key=value` of each swept key, joined by `sep`.
fn label(swept: &[(String, String)], sep: &str) -> String {
    swept
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(sep)
}

fn label_of(record: &Record, n: usize, sep: &str) -> String {
    let swept: Vec<(String, String)> = record
        .axes
        .iter()
        .zip(&record.jobs[n].values)
        .map(|(a, v)| (a.key.clone(), v.clone()))
        .collect();
    label(&swept, sep)
}

/// The jobs as a table, the best finished one marked; then where the best
/// is, and why each failed one failed.
fn table(record: &Record, dir: &Path) -> String {
    let objective = &record.objective;
    let best = record
        .jobs
        .iter()
        .enumerate()
        .filter_map(|(n, j)| Some((n, j.result.as_ref()?.objective?)))
        .reduce(|a, b| {
            let better = if objective.higher_is_better {
                b.1 > a.1
            } else {
                b.1 < a.1
            };
            if better { b } else { a }
        });
    let mut header: Vec<String> = vec!["job".into()];
    header.extend(record.axes.iter().map(|a| a.key.clone()));
    header.extend([
        "status".into(),
        objective.name.clone(),
        objective.throughput.clone(),
        "wall".into(),
    ]);
    let rows: Vec<Vec<String>> = record
        .jobs
        .iter()
        .enumerate()
        .map(|(n, j)| {
            let mark = if best.is_some_and(|(b, _)| b == n) {
                " *"
            } else {
                ""
            };
            let mut row = vec![format!("{n}{mark}")];
            row.extend(j.values.iter().cloned());
            row.push(j.status.word().into());
            match &j.result {
                Some(r) => row.extend([
                    r.objective.map_or("-".into(), |v| format!("{v:.4}")),
                    format!("{:.0}", r.throughput),
                    format!("{:.0} s", r.wall_s),
                ]),
                None => row.extend(["-".into(), "-".into(), "-".into()]),
            }
            row
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([header[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        format!("  {}\n", text.join("  ").trim_end())
    };
    let mut out = format!("sweep: {}\n", dir.display());
    out.push_str(&line(&header));
    for row in &rows {
        out.push_str(&line(row));
    }
    if let Some((n, value)) = best {
        out.push_str(&format!(
            "best (*): job {n} ({}), {} {value:.4}: {}\n",
            label_of(record, n, " "),
            objective.name,
            dir.join(&record.jobs[n].dir).display()
        ));
    }
    for (n, j) in record.jobs.iter().enumerate() {
        if let (Status::Pruned, Some(why)) = (j.status, &j.pruned) {
            out.push_str(&format!("job {n} pruned {why}\n"));
        }
        if j.status == Status::Failed {
            let why = j.error.as_deref().map_or_else(
                || j.exit.clone().unwrap_or_default(),
                |e| e.lines().next().unwrap_or_default().to_string(),
            );
            out.push_str(&format!("job {n} failed: {why}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swept(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_jobs_folder_names_its_values_with_what_a_folder_may_hold() {
        assert_eq!(
            job_dir(
                3,
                &swept(&[("training.learning_rate", "3e-4"), ("model.layers", "4")])
            ),
            "3-learning_rate=3e-4,layers=4"
        );
        assert_eq!(
            job_dir(1, &swept(&[("data.path", "\"a b/c.txt\"")])),
            "1-path=_a_b_c.txt_"
        );
        assert_eq!(job_dir(0, &[]), "0");
        assert!(job_dir(7, &swept(&[("k", &"x".repeat(200))])).len() <= 82);
    }

    #[test]
    fn the_median_rule_compares_the_best_so_far_with_the_finished_jobs_at_that_step() {
        let rule = Pruning {
            startup: 2,
            warmup: 0,
        };
        let finished = vec![vec![(100, 3.0), (200, 2.0)], vec![(100, 3.4), (200, 2.4)]];
        // Median at 200: 2.2. Best so far 2.1 (at 100) is below it.
        assert_eq!(prune_at(&[(100, 2.1), (200, 2.3)], &finished, rule), None);
        let (step, best, median) =
            prune_at(&[(100, 3.5), (200, 2.3)], &finished, rule).expect("pruned");
        assert_eq!(step, 200);
        assert_eq!(best, 2.3);
        assert!((median - 2.2).abs() < 1e-12);
        // Too few finished, before the warm-up, or no finished job at that step.
        assert_eq!(prune_at(&[(100, 9.0)], &finished[..1], rule), None);
        let warm = Pruning {
            startup: 2,
            warmup: 150,
        };
        assert_eq!(prune_at(&[(100, 9.0)], &finished, warm), None);
        assert!(prune_at(&[(100, 9.0), (200, 9.0)], &finished, warm).is_some());
        assert_eq!(prune_at(&[(150, 9.0)], &finished, rule), None);
        // A loss gone to NaN is pruned.
        assert!(prune_at(&[(100, f64::NAN)], &finished, rule).is_some());
    }

    #[test]
    fn a_running_jobs_metrics_are_read_as_they_grow_whole_lines_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let eval =
            |step: u64, loss: f64| format!(r#"{{"kind":"eval","step":{step},"val_loss":{loss}}}"#);
        let step = r#"{"kind":"step","step":5,"loss":3.0}"#;
        let mut watch = Watch::default();
        assert!(!watch.read(dir.path()), "no file yet");
        // A line half written is left for the next read.
        let first = format!("{step}\n{}\n", eval(10, 2.5));
        let half = &eval(20, 2.25)[..12];
        std::fs::write(&path, format!("{first}{half}")).expect("write");
        assert!(watch.read(dir.path()));
        assert_eq!(watch.evals, [(10, 2.5)]);
        std::fs::write(&path, format!("{first}{}\n", eval(20, 2.25))).expect("write");
        assert!(watch.read(dir.path()));
        assert_eq!(watch.evals, [(10, 2.5), (20, 2.25)]);
        assert!(!watch.read(dir.path()), "nothing new");
        // Cut, as a resume cuts it: read again from the start.
        std::fs::write(&path, format!("{}\n", eval(10, 2.4))).expect("write");
        assert!(watch.read(dir.path()));
        assert_eq!(watch.evals, [(10, 2.4)]);
        assert_eq!(evaluations(dir.path()), [(10, 2.4)]);
    }

    fn record(objectives: &[Option<f64>], higher_is_better: bool) -> Record {
        Record {
            command: "train".into(),
            prefix: Vec::new(),
            flags: Vec::new(),
            workload: Workload::Lm,
            objective: Objective {
                name: "m".into(),
                higher_is_better,
                throughput: "tokens/s".into(),
            },
            at_once: 1,
            pruning: None,
            axes: vec![Axis {
                key: "training.learning_rate".into(),
                values: (0..objectives.len()).map(|i| i.to_string()).collect(),
                drawn_from: None,
            }],
            jobs: objectives
                .iter()
                .enumerate()
                .map(|(i, o)| Job {
                    dir: format!("{i}"),
                    overrides: Vec::new(),
                    values: vec![i.to_string()],
                    tensorboard: false,
                    status: if o.is_some() {
                        Status::Finished
                    } else {
                        Status::Failed
                    },
                    exit: o.is_none().then(|| "exit code 1".into()),
                    error: o.is_none().then(|| "out of memory\ncaused by".into()),
                    pruned: None,
                    result: o.map(|v| JobResult {
                        objective: Some(v),
                        throughput: 100.0,
                        wall_s: 5.0,
                    }),
                })
                .collect(),
        }
    }

    #[test]
    fn the_table_marks_the_best_job_either_way_and_says_why_one_failed() {
        let dir = Path::new("s");
        let low = table(
            &record(&[Some(2.0), None, Some(1.5), Some(1.7)], false),
            dir,
        );
        assert!(
            low.contains("best (*): job 2 (training.learning_rate=2), m 1.5000: s/2"),
            "{low}"
        );
        assert!(low.contains("  2 *  2"), "{low}");
        assert!(low.contains("job 1 failed: out of memory\n"), "{low}");
        let high = table(&record(&[Some(0.2), Some(0.7), Some(0.5)], true), dir);
        assert!(high.contains("best (*): job 1 "), "{high}");
        let none = table(&record(&[None], true), dir);
        assert!(!none.contains("best"), "{none}");
    }
}
