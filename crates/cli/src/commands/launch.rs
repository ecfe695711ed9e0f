//! `kiln launch`: a data-parallel job, one `kiln` process per GPU, as
//! torchrun starts them (the same variables, so `torchrun --no-python kiln
//! train …` and Slurm's `srun kiln train …` start the same ranks).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use kiln_train::kiln_dist::{self, JobEnd, LaunchSpec};

use super::{BadInput, Context};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Processes on this machine, one per GPU [default: this machine's
    /// GPUs, at least 1; one planned trains in this process, alone, while
    /// 1 asked for is a job of one rank, as torchrun's]
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<usize>,
    /// Machines in the job (each runs `kiln launch` with its --node-rank)
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,
    /// This machine's index, 0..M; node 0 hosts the rendezvous
    #[arg(long, value_name = "R", default_value_t = 0)]
    node_rank: usize,
    /// Node 0's address, as every node reaches it
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    master_addr: String,
    /// The rendezvous port on node 0
    #[arg(long, value_name = "PORT", default_value_t = kiln_dist::DEFAULT_PORT)]
    master_port: u16,
    /// When a rank fails (not on bad input, exit 2), restart the job up to
    /// N times, each time resuming the run from its last good checkpoint,
    /// as torchrun's --max-restarts (`train` and `resume`)
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: u32,
    /// What every rank runs: `train [key=value ...]`, `cv [key=value ...]`,
    /// `resume RUN [key=value ...]` or `bench lm|nli [--json] [key=value ...]`
    #[arg(
        value_name = "COMMAND",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<String>,
}

/// `kiln launch … train|cv|resume|bench lm|nli …`. One rank on one machine as
/// planned (the default where there is one GPU, or none) runs `single`
/// with the command's arguments, in this process; `--nproc-per-node 1`
/// starts a job of one rank.
pub(crate) fn run(
    mut args: Args,
    ctx: &Context,
    single: impl FnOnce(Vec<String>) -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    match args.command.first().map(String::as_str) {
        Some(name @ ("train" | "cv")) => {
            // A sweep starts processes of its own: refused here, before
            // any rank starts, as each rank would refuse it.
            if TrainLine::try_parse_from(&args.command[1..]).is_ok_and(|l| l.args.multirun) {
                return Err(BadInput(format!(
                    "`kiln launch … {name} -m`: a sweep starts its jobs as processes of its own; run `kiln {name} -m --jobs N` (a GPU each), or launch each job"
                ))
                .into());
            }
        }
        Some("resume") => {}
        Some("bench") => {
            // Every rank times the training step; the other benches are
            // one process's.
            let workload = args.command[1..]
                .iter()
                .find(|a| ["lm", "nli", "loader", "attention"].contains(&a.as_str()));
            if let Some(w) = workload.filter(|w| !["lm", "nli"].contains(&w.as_str())) {
                return Err(BadInput(format!(
                    "`kiln launch … bench {w}`: a data-parallel job benchmarks `bench lm` or `bench nli`; run `kiln bench {w}` without a launcher"
                ))
                .into());
            }
        }
        other => {
            return Err(BadInput(format!(
                "`kiln launch` runs `train`, `cv`, `resume` or `bench lm|nli` on every rank, not `{}`",
                other.unwrap_or("")
            ))
            .into());
        }
    }
    let restart = match args.max_restarts {
        0 => None,
        _ => Some(Restart::plan(&mut args.command, ctx, args.nnodes)?),
    };
    let planned = super::hardware::ranks(&ctx.report);
    let nproc = args.nproc_per_node.unwrap_or(planned.count);
    if args.nproc_per_node.is_none() {
        eprintln!(
            "kiln launch: {} on this machine — {}",
            kiln_train::counted(nproc, "rank"),
            planned.why
        );
    }
    // One rank where the machine planned one (one GPU, or none) trains in
    // this process; `--nproc-per-node 1` asked for is a job of one rank,
    // as torchrun starts it: its collectives over a world of one (how a
    // job's path is tried on one GPU).
    if nproc == 1 && args.nproc_per_node.is_none() && args.nnodes == 1 && restart.is_none() {
        let mut argv = vec!["kiln".to_string()];
        argv.extend(ctx.prefix());
        argv.extend(args.command);
        return single(argv);
    }
    let spec = LaunchSpec {
        nproc_per_node: nproc,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
    };
    spec.validate().map_err(|e| BadInput(e.to_string()))?;
    let mut env = Vec::new();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // As torchrun sets OMP_NUM_THREADS: ranks sharing a machine's cores
        // split them rather than each starting a thread per core.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        env.push((
            "RAYON_NUM_THREADS".to_string(),
            (cores / nproc).max(1).to_string(),
        ));
    }
    if let Some(dir) = nccl_link_dir(ctx) {
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let path = if path.is_empty() {
            dir.display().to_string()
        } else {
            format!("{}:{path}", dir.display())
        };
        env.push(("LD_LIBRARY_PATH".to_string(), path));
    }
    let host = kiln_dist::hostname();
    eprintln!(
        "kiln launch: {} — {nproc} on {host} (node {} of {}), rendezvous at {}:{}",
        kiln_train::counted(spec.world_size(), "rank"),
        spec.node_rank,
        spec.nnodes,
        spec.master_addr,
        spec.master_port
    );
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\nkiln launch: stopping every rank after this step with a checkpoint (Ctrl-C again to quit at once)"
        );
    })?;
    let program = std::env::current_exe()?;
    let mut command = args.command;
    let mut restarts = 0;
    loop {
        let mut rank_args = ctx.prefix();
        rank_args.extend(command.iter().cloned());
        let end = kiln_dist::launch(
            &spec,
            &program,
            &rank_args,
            &env,
            &stop,
            Duration::from_secs(10),
        )
        .map_err(|e| {
            if e.is_bad_input() {
                anyhow::Error::new(BadInput(e.to_string()))
            } else {
                anyhow::Error::new(e)
            }
        })?;
        let JobEnd::RankFailed {
            rank,
            host,
            pid,
            status,
            code,
        } = end
        else {
            return Ok(if end == JobEnd::Finished {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(130)
            });
        };
        let failed = format!("rank {rank} ({host}, pid {pid}) failed: {status}");
        if let Some(r) = &restart {
            match r.next(
                code,
                restarts,
                args.max_restarts,
                stop.load(Ordering::SeqCst),
            ) {
                Ok((step, resume)) => {
                    restarts += 1;
                    eprintln!(
                        "kiln launch: {failed}; restart {restarts} of {}: every rank resumes `{}` from {step}",
                        args.max_restarts,
                        r.run.display()
                    );
                    command = resume;
                    continue;
                }
                Err(why) => eprintln!("kiln launch: no restart: {why}"),
            }
        }
        // A bench has no run to continue; bad input (exit 2) was refused
        // with its reason, what the run had saved kept; a resume refused
        // says itself how to continue (another number of ranks, say).
        let resume = (command[0] != "bench" && !(code == 2 && command[0] == "resume")).then(|| {
            format!(
                "kiln launch --nproc-per-node {nproc} resume {}",
                restart.as_ref().map_or("<run directory>".to_string(), |r| r
                    .run
                    .display()
                    .to_string())
            )
        });
        let next = match (code == 2, resume) {
            (true, None) => {
                "Its message is above: bad input (exit 2); fix what it names and launch again."
                    .to_string()
            }
            (true, Some(r)) => format!(
                "Its message is above: bad input (exit 2); fix what it names first. What the run had saved is kept; to continue it from a checkpoint: {r}"
            ),
            (false, None) => "Its own message, if it could write one, is above.".to_string(),
            (false, Some(r)) => format!(
                "Its own message, if it could write one, is above. To continue from the run's last checkpoint: {r}"
            ),
        };
        eprintln!("kiln launch: {failed}; the other ranks were stopped.\n{next}");
        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
    }
}

/// What `--max-restarts` resumes: the run directory, fixed before the
/// ranks start, and the command that continues it.
#[derive(Debug)]
struct Restart {
    run: PathBuf,
    /// `resume RUN [key=value ...]`.
    resume: Vec<String>,
}

/// `train`'s arguments as the ranks parse them.
#[derive(Debug, clap::Parser)]
#[command(no_binary_name = true)]
struct TrainLine {
    #[command(flatten)]
    args: super::train::TrainArgs,
}

/// `resume`'s arguments as the ranks parse them.
#[derive(Debug, clap::Parser)]
#[command(no_binary_name = true)]
struct ResumeLine {
    #[command(flatten)]
    args: super::train::ResumeArgs,
}

impl Restart {
    /// For `train` and `cv`: the run directory its `run.dir` template names now
    /// (the ranks get it as `run.dir=…`, so that the launcher knows what
    /// to resume); for `resume RUN`: RUN, resumed the same way again
    /// (without `--from`, which would go back again). A template with
    /// `{time}` on several nodes is refused: each node's launcher would
    /// name another folder.
    fn plan(command: &mut Vec<String>, ctx: &Context, nnodes: usize) -> anyhow::Result<Self> {
        let bad = |e: clap::Error| BadInput(format!("`kiln launch … {}`: {e}", command[0]));
        match command[0].as_str() {
            name @ ("train" | "cv") => {
                let line = TrainLine::try_parse_from(&command[1..]).map_err(bad)?;
                let resolved = super::train::resolve_for(name, line.args.layers, ctx)?;
                let template = &resolved.config.run_dir_template();
                if nnodes > 1 && template.contains("{time}") {
                    return Err(BadInput(format!(
                        "`kiln launch --max-restarts` on {nnodes} nodes needs a run directory every node names alike, but run.dir is `{template}` (each node's clock fills in {{time}}): set run.dir=<a folder on a shared filesystem> on every node"
                    ))
                    .into());
                }
                let run = kiln_train::RunDir::path_of(
                    template,
                    &resolved.config.experiment,
                    std::time::SystemTime::now(),
                );
                command.push(format!("run.dir={}", run.display()));
                Ok(Self {
                    resume: vec!["resume".into(), run.display().to_string()],
                    run,
                })
            }
            "resume" => {
                let line = ResumeLine::try_parse_from(&command[1..]).map_err(bad)?;
                let run = line.args.run;
                let mut resume = vec!["resume".into(), run.display().to_string()];
                resume.extend(line.args.overrides);
                Ok(Self { run, resume })
            }
            other => Err(BadInput(format!(
                "`kiln launch --max-restarts` resumes a run from its last checkpoint: it restarts `train`, `cv` and `resume`, not `{other}`"
            ))
            .into()),
        }
    }

    /// After a rank failed with `code`, having restarted `done` of `max`
    /// times: the step the job would resume from and the command that
    /// does, or why it does not restart.
    fn next(
        &self,
        code: i32,
        done: u32,
        max: u32,
        stopping: bool,
    ) -> Result<(String, Vec<String>), String> {
        if stopping {
            return Err("the job was asked to stop".into());
        }
        if code == 2 {
            return Err(
                "the rank's input is at fault (exit code 2); a restart would fail alike".into(),
            );
        }
        if done >= max {
            return Err(format!(
                "the job restarted {} already (--max-restarts {max})",
                kiln_train::counted(max, "time")
            ));
        }
        resume_point(&self.run).map(|from| (from, self.resume.clone()))
    }
}

/// Where a resume of `run` continues, as the restart's line says it
/// ("its checkpoint of step 600"; a cross-validation's: "fold 2's
/// checkpoint of step 20", or "fold 3's start" after two finished folds),
/// or why there is nothing to resume.
fn resume_point(run: &Path) -> Result<String, String> {
    let nothing = |checkpoints: &Path, e: kiln_train::TrainError| {
        format!(
            "nothing to resume from in `{}` ({e}); checkpoint.every_steps sets how often a run saves one",
            checkpoints.display()
        )
    };
    if !run.join("folds.json").is_file() {
        let checkpoints = run.join("checkpoints");
        return kiln_train::latest_good_checkpoint(&checkpoints)
            .map(|(info, _)| format!("its checkpoint of step {}", info.step))
            .map_err(|e| nothing(&checkpoints, e));
    }
    // A cross-validation: its folds in turn, the finished ones kept.
    let mut fold = 1;
    while run.join(format!("fold-{fold}/result.json")).is_file() {
        fold += 1;
    }
    let checkpoints = run.join(format!("fold-{fold}/checkpoints"));
    match kiln_train::latest_good_checkpoint(&checkpoints) {
        Ok((info, _)) => Ok(format!("fold {fold}'s checkpoint of step {}", info.step)),
        Err(_) if fold > 1 => Ok(format!(
            "fold {fold}'s start ({} finished)",
            kiln_train::counted(fold - 1, "fold")
        )),
        Err(e) => Err(nothing(&checkpoints, e)),
    }
}

/// On a machine with NVIDIA GPUs and a CUDA build, where the dynamic loader
/// does not find `libnccl.so` (the name cudarc opens) but NCCL is installed
/// as `libnccl.so.2` (PyPI's `nvidia-nccl-cu12`, `libnccl2` without its
/// `-dev` package): links it as `libnccl.so` in kiln's cache and returns
/// that folder for the ranks' `LD_LIBRARY_PATH`. Says what it did, or what
/// is missing (the ranks then fail before training, with the fix).
fn nccl_link_dir(ctx: &Context) -> Option<std::path::PathBuf> {
    use kiln_dist::nccl_lib;
    let cuda = kiln_train::BACKENDS_BUILT_IN.contains(&"cuda");
    if !cuda || ctx.report.gpus().is_empty() || nccl_lib::loader_finds_libnccl() {
        return None;
    }
    let env = kiln_train::kiln_dist::process_env();
    let Some(found) = nccl_lib::find_soname(&nccl_lib::search_dirs(&env)) else {
        eprintln!("kiln launch: warning: {}", nccl_lib::missing_advice(None));
        return None;
    };
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    let dir = cache.join("kiln").join("nccl");
    match nccl_lib::link_as_libnccl(&found, &dir) {
        Ok(link) => {
            eprintln!(
                "kiln launch: NCCL is installed as `{}`; linked as `{}` for the ranks (cudarc opens that name)",
                found.display(),
                link.display()
            );
            Some(dir)
        }
        Err(e) => {
            eprintln!(
                "kiln launch: warning: could not link `{}` into `{}` ({e}); {}",
                found.display(),
                dir.display(),
                nccl_lib::missing_advice(Some(&found))
            );
            None
        }
    }
}
