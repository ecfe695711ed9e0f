//! `kiln launch`: a data-parallel job, one `kiln` process per GPU, as
//! torchrun starts them (the same variables, so `torchrun --no-python kiln
//! train …` and Slurm's `srun kiln train …` start the same ranks).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kiln_train::kiln_dist::{self, JobEnd, LaunchSpec};

use super::{BadInput, Context};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Processes on this machine, one per GPU [default: this machine's
    /// GPUs, at least 1]
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
    /// What every rank runs: `train [key=value ...]`, `resume RUN [key=value
    /// ...]` or `bench lm [--json] [key=value ...]`
    #[arg(
        value_name = "COMMAND",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<String>,
}

/// `kiln launch … train|resume|bench lm …`. One rank on one machine (the default
/// where there is one GPU, or none) runs `single` with the command's
/// arguments, in this process.
pub(crate) fn run(
    args: Args,
    ctx: &Context,
    single: impl FnOnce(Vec<String>) -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    match args.command.first().map(String::as_str) {
        Some("train" | "resume") => {}
        Some("bench") => {
            // Every rank times the language model's step; the other
            // benches are one process's.
            let workload = args.command[1..]
                .iter()
                .find(|a| ["lm", "nli", "loader"].contains(&a.as_str()));
            if let Some(w) = workload.filter(|w| *w != "lm") {
                return Err(BadInput(format!(
                    "`kiln launch … bench {w}`: a data-parallel job benchmarks `bench lm`; run `kiln bench {w}` without a launcher"
                ))
                .into());
            }
        }
        Some("cv") => {
            return Err(BadInput(
                "`kiln launch … cv`: cross-validation trains in one process so far; run `kiln cv` without a launcher".into(),
            )
            .into());
        }
        other => {
            return Err(BadInput(format!(
                "`kiln launch` runs `train`, `resume` or `bench lm` on every rank, not `{}`",
                other.unwrap_or("")
            ))
            .into());
        }
    }
    let planned = super::hardware::ranks(&ctx.report);
    let nproc = args.nproc_per_node.unwrap_or(planned.count);
    if args.nproc_per_node.is_none() {
        eprintln!(
            "kiln launch: {nproc} rank(s) on this machine — {}",
            planned.why
        );
    }
    if nproc == 1 && args.nnodes == 1 {
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
        "kiln launch: {} ranks — {nproc} on {host} (node {} of {}), rendezvous at {}:{}",
        spec.world_size(),
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
    let mut rank_args = ctx.prefix();
    rank_args.extend(args.command.iter().cloned());
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
    Ok(match end {
        JobEnd::Finished => ExitCode::SUCCESS,
        JobEnd::Interrupted => ExitCode::from(130),
        JobEnd::RankFailed {
            rank,
            host,
            pid,
            status,
            code,
        } => {
            eprintln!(
                "kiln launch: rank {rank} ({host}, pid {pid}) failed: {status}; the other ranks were stopped.\n\
                 Its own message, if it could write one, is above. To continue from the run's last checkpoint: kiln launch --nproc-per-node {nproc} resume <run directory>"
            );
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    })
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
    let env: Vec<(String, String)> = std::env::vars().collect();
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
