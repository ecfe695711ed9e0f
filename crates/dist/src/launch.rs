//! `kiln launch`: one process per local rank, as torchrun starts them, with
//! the variables set; the job ends, naming the rank, when one of them fails.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::DistError;

/// What `kiln launch` is asked to start on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Processes on this machine (one per GPU).
    pub nproc_per_node: usize,
    /// Machines in the job.
    pub nnodes: usize,
    /// This machine's index, `0..nnodes`; node 0 hosts the rendezvous.
    pub node_rank: usize,
    /// Node 0's address, as every node reaches it.
    pub master_addr: String,
    /// The rendezvous port.
    pub master_port: u16,
}

impl LaunchSpec {
    /// Processes in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// Refuses counts of 0, a node rank outside the job, port 0, and (on
    /// node 0) a port another process holds.
    pub fn validate(&self) -> Result<(), DistError> {
        let bad = |what: String, why: &str| {
            Err(DistError::BadLaunch {
                what,
                why: why.into(),
            })
        };
        if self.nproc_per_node == 0 {
            return bad(
                "--nproc-per-node 0".into(),
                "a node runs at least one process (one per GPU)",
            );
        }
        if self.nproc_per_node > 1024 {
            return bad(
                format!("--nproc-per-node {}", self.nproc_per_node),
                "a node runs at most 1024 processes (one per GPU, or ranks sharing the CPU's cores)",
            );
        }
        if self.nnodes == 0 {
            return bad("--nnodes 0".into(), "a job has at least one node");
        }
        if self.node_rank >= self.nnodes {
            return bad(
                format!("--node-rank {}", self.node_rank),
                &format!(
                    "out of range for --nnodes {} (node ranks are 0..{})",
                    self.nnodes, self.nnodes
                ),
            );
        }
        if self.master_port == 0 {
            return bad("--master-port 0".into(), "choose a port from 1 to 65535");
        }
        if self.node_rank == 0 {
            // Rank 0 will listen there: a port already taken fails now, not
            // after the ranks have loaded their data.
            match std::net::TcpListener::bind(("0.0.0.0", self.master_port)) {
                Ok(l) => drop(l),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    return Err(DistError::PortInUse {
                        port: self.master_port,
                    });
                }
                Err(source) => {
                    return Err(DistError::Io {
                        what: format!("checking port {}", self.master_port),
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

/// How a job ended on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobEnd {
    /// Every rank exited 0.
    Finished,
    /// Stopped on request: every rank ended (exit 130 from a checkpointed
    /// stop, or 0 where it had finished).
    Interrupted,
    /// A rank failed first; the others were stopped.
    RankFailed {
        /// Its global rank.
        rank: usize,
        /// Where it ran.
        host: String,
        /// Its pid.
        pid: u32,
        /// How it ended, in words (`exit code 1`, `killed by signal 9 (SIGKILL)`).
        status: String,
        /// The exit code the launcher passes on.
        code: i32,
    },
}

/// Starts `spec.nproc_per_node` copies of `program args`, each with
/// `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT` set (and `env`), in their own process group (a
/// terminal's Ctrl-C reaches the launcher alone, which passes on one
/// SIGTERM) and ended by the kernel if the launcher dies. Waits for them:
/// when `stop` is set, each gets SIGTERM once (kiln checkpoints and stops);
/// when one fails, the others get SIGTERM and, `grace` later, SIGKILL.
pub fn launch(
    spec: &LaunchSpec,
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    stop: &AtomicBool,
    grace: Duration,
) -> Result<JobEnd, DistError> {
    spec.validate()?;
    let host = crate::hostname();
    let mut ranks: Vec<(usize, Child)> = Vec::new();
    for local in 0..spec.nproc_per_node {
        let rank = spec.node_rank * spec.nproc_per_node + local;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", spec.world_size().to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; the closure touches nothing
        // of the parent's.
        unsafe {
            cmd.pre_exec(|| {
                #[cfg(target_os = "linux")]
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => ranks.push((rank, child)),
            Err(source) => {
                kill_all(&mut ranks, libc::SIGKILL);
                return Err(DistError::Spawn { rank, source });
            }
        }
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; ranks.len()];
    let mut failed: Option<JobEnd> = None;
    let mut failed_at: Option<Instant> = None;
    let mut failed_by_signal = false;
    let mut stopping = false;
    loop {
        for (i, (rank, child)) in ranks.iter_mut().enumerate() {
            if statuses[i].is_some() {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                statuses[i] = Some(status);
                let ok = status.success() || (stopping && status.code() == Some(130));
                // The cause, not its echo: a rank killed by a signal rather
                // than one that failed because its peer was gone.
                let replaces = failed.is_none()
                    || (status.signal().is_some() && !failed_by_signal && failed_at.is_none());
                if !ok && replaces {
                    failed_by_signal = status.signal().is_some();
                    failed = Some(JobEnd::RankFailed {
                        rank: *rank,
                        host: host.clone(),
                        pid: child.id(),
                        status: describe_exit(status),
                        code: status.code().filter(|&c| c != 0).unwrap_or(1),
                    });
                }
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if failed.is_some() && failed_at.is_none() {
            failed_at = Some(Instant::now());
            signal_running(&mut ranks, &statuses, libc::SIGTERM);
        }
        if failed_at.is_some_and(|t| t.elapsed() > grace) {
            signal_running(&mut ranks, &statuses, libc::SIGKILL);
        }
        if stop.load(Ordering::Relaxed) && !stopping {
            stopping = true;
            signal_running(&mut ranks, &statuses, libc::SIGTERM);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(match failed {
        Some(end) => end,
        None if stopping || statuses.iter().flatten().any(|s| s.code() == Some(130)) => {
            JobEnd::Interrupted
        }
        None => JobEnd::Finished,
    })
}

fn signal_running(ranks: &mut [(usize, Child)], statuses: &[Option<ExitStatus>], signal: i32) {
    for ((_, child), status) in ranks.iter_mut().zip(statuses) {
        if status.is_none() {
            // SAFETY: kill(2) on a child this process started and has not reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, signal);
            }
        }
    }
}

fn kill_all(ranks: &mut [(usize, Child)], signal: i32) {
    for (_, child) in ranks.iter_mut() {
        // SAFETY: as above.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
        let _ = child.wait();
    }
}

/// `exit code 3`, `killed by signal 9 (SIGKILL)`.
pub fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => {
            let name = match s {
                libc::SIGKILL => " (SIGKILL: killed, often by the kernel's out-of-memory killer)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGBUS => " (SIGBUS)",
                _ => "",
            };
            format!("killed by signal {s}{name}")
        }
        _ => "ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: usize) -> LaunchSpec {
        LaunchSpec {
            nproc_per_node: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a port"),
        }
    }

    #[test]
    fn bad_arguments_are_refused_with_the_reason() {
        let e = LaunchSpec {
            nproc_per_node: 0,
            ..spec(1)
        }
        .validate()
        .expect_err("0");
        assert!(e.to_string().contains("--nproc-per-node 0") && e.is_bad_input());
        let e = LaunchSpec {
            nnodes: 2,
            node_rank: 2,
            ..spec(1)
        }
        .validate()
        .expect_err("rank");
        assert!(e.to_string().contains("--node-rank 2"), "{e}");
        let held = std::net::TcpListener::bind("0.0.0.0:0").expect("binds");
        let port = held.local_addr().expect("addr").port();
        let e = LaunchSpec {
            master_port: port,
            ..spec(1)
        }
        .validate()
        .expect_err("in use");
        assert!(
            e.to_string().contains(&format!("port {port} is in use")),
            "{e}"
        );
    }

    #[test]
    fn ranks_get_their_variables_and_a_failure_ends_the_job() {
        let stop = AtomicBool::new(false);
        let sh = Path::new("/bin/sh");
        let ok = launch(
            &spec(3),
            sh,
            &[
                "-c".into(),
                "test \"$WORLD_SIZE\" = 3 && test \"$RANK\" = \"$LOCAL_RANK\"".into(),
            ],
            &[],
            &stop,
            Duration::from_secs(5),
        )
        .expect("starts");
        assert_eq!(ok, JobEnd::Finished);
        let started = Instant::now();
        let end = launch(
            &spec(2),
            sh,
            &[
                "-c".into(),
                "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 30".into(),
            ],
            &[],
            &stop,
            Duration::from_secs(2),
        )
        .expect("starts");
        assert!(
            matches!(&end, JobEnd::RankFailed { rank: 1, status, .. } if status.contains("SIGKILL")),
            "{end:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the sleeping rank was stopped"
        );
    }
}
