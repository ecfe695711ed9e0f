//! Who this process is in a job: the variables torchrun sets (and `kiln
//! launch`, which sets the same), else Slurm's.

use crate::DistError;

/// torchrun's default `MASTER_PORT`.
pub const DEFAULT_PORT: u16 = 29500;

/// A process's place in a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldSpec {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Its rank on this machine (which GPU it takes).
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Where rank 0 hosts the rendezvous.
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
    /// Under torchrun, whose agent holds `MASTER_PORT` with PyTorch's
    /// TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`): the key of that
    /// store under which rank 0 writes the port it listens at instead
    /// (a free one), and the other ranks read it. `None` elsewhere, and
    /// where `KILN_MASTER_PORT` names the port.
    pub torchrun_store_key: Option<String>,
}

impl WorldSpec {
    /// Rank `rank` of a job of `world` ranks all on this machine, with the
    /// rendezvous at `127.0.0.1:port` (threads or processes of one machine:
    /// tests, examples).
    pub fn local(rank: usize, world: usize, port: u16) -> Self {
        Self {
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            torchrun_store_key: None,
        }
    }

    /// The job `env` describes: torchrun's and `kiln launch`'s `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; else Slurm's `SLURM_PROCID`, `SLURM_NTASKS`,
    /// `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` with `MASTER_ADDR` (else
    /// the first host of `SLURM_JOB_NODELIST`, where Slurm puts task 0,
    /// else `SLURM_LAUNCH_NODE_IPADDR`) and `MASTER_PORT` (else 15000 plus
    /// the last four digits of `SLURM_JOB_ID`). `None` where no launcher started the
    /// process, or Slurm started it alone (`SLURM_NTASKS=1`, as every
    /// single task has). A job of one rank (`WORLD_SIZE=1`, torchrun's or
    /// `kiln launch`'s `--nproc-per-node 1`) is a job, as nanoGPT and
    /// Hugging Face's Trainer make it one under torchrun: its collectives
    /// run over a world of one, the way to try a job's path on one GPU. A
    /// value that is not a number, or a rank outside the world, is an error
    /// naming the variable.
    pub fn from_env<K: AsRef<str>, V: AsRef<str>>(
        env: &[(K, V)],
    ) -> Result<Option<Self>, DistError> {
        let get = |name: &str| {
            env.iter()
                .find(|(k, _)| k.as_ref() == name)
                .map(|(_, v)| v.as_ref().trim().to_string())
        };
        let number = |name: &str| -> Result<Option<usize>, DistError> {
            get(name)
                .map(|v| {
                    // Slurm writes per-node counts as `4(x2)`.
                    let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
                    digits.parse().map_err(|_| DistError::BadLaunch {
                        what: format!("{name}={v}"),
                        why: "not a whole number".into(),
                    })
                })
                .transpose()
        };
        let launched = get("WORLD_SIZE").is_some();
        let (rank, world, local_rank, local_world, addr_var) = if launched {
            let world = number("WORLD_SIZE")?.unwrap_or(1);
            let rank = number("RANK")?.ok_or_else(|| DistError::BadLaunch {
                what: "RANK".into(),
                why: "WORLD_SIZE is set but RANK is not: start the ranks with `kiln launch` or torchrun, which set both".into(),
            })?;
            let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
            let local_world = number("LOCAL_WORLD_SIZE")?.unwrap_or(world);
            (rank, world, local_rank, local_world, get("MASTER_ADDR"))
        } else if let (Some(rank), Some(world)) = (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
        {
            let local_rank = number("SLURM_LOCALID")?.unwrap_or(0);
            let local_world = number("SLURM_NTASKS_PER_NODE")?.unwrap_or(1);
            // Rank 0 runs on the allocation's first node; the node srun
            // was started from is it in a batch script, but a login node
            // where srun is typed by hand.
            let addr = get("MASTER_ADDR")
                .or_else(|| {
                    get("SLURM_JOB_NODELIST")
                        .or_else(|| get("SLURM_NODELIST"))
                        .and_then(|list| first_host(&list))
                })
                .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"));
            (rank, world, local_rank, local_world, addr)
        } else {
            return Ok(None);
        };
        if world == 0 {
            return Err(DistError::BadLaunch {
                what: "WORLD_SIZE=0".into(),
                why: "a job has at least one process".into(),
            });
        }
        if rank >= world {
            return Err(DistError::BadLaunch {
                what: format!("RANK={rank}"),
                why: format!("out of range for WORLD_SIZE={world} (ranks are 0..{world})"),
            });
        }
        if local_rank >= local_world.max(1) {
            return Err(DistError::BadLaunch {
                what: format!("LOCAL_RANK={local_rank}"),
                why: format!("out of range for LOCAL_WORLD_SIZE={local_world}"),
            });
        }
        if world == 1 && !launched {
            // Every single task of Slurm's says SLURM_NTASKS=1: alone.
            return Ok(None);
        }
        let port = |name: &str| -> Result<Option<u16>, DistError> {
            get(name)
                .map(|p| {
                    p.parse::<u16>()
                        .ok()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| DistError::BadLaunch {
                            what: format!("{name}={p}"),
                            why: "a port is a number from 1 to 65535".into(),
                        })
                })
                .transpose()
        };
        // Under Slurm, jobs that share a node would meet at one default
        // port: each takes one of its own from its job id (Lightning's
        // rule), the same on every task.
        let slurm_port = (!launched)
            .then(|| number("SLURM_JOB_ID").ok().flatten())
            .flatten()
            .map(|id| 15000 + (id % 10000) as u16);
        let master_port = port("MASTER_PORT")?.or(slurm_port).unwrap_or(DEFAULT_PORT);
        // torchrun's agent listens at MASTER_PORT itself (its TCPStore);
        // kiln's rendezvous goes where KILN_MASTER_PORT says, or where
        // rank 0 writes into that store.
        let (master_port, torchrun_store_key) = match port("KILN_MASTER_PORT")? {
            Some(p) => (p, None),
            None if launched
                && get("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true")) =>
            {
                let key = crate::store::rendezvous_key(
                    &get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
                    &get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into()),
                );
                (master_port, Some(key))
            }
            None => (master_port, None),
        };
        Ok(Some(Self {
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            master_addr: addr_var.unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            torchrun_store_key,
        }))
    }

    /// This job with rank 0 listening at `port` of `MASTER_ADDR`, found
    /// (no store to ask any more).
    pub(crate) fn at_port(&self, port: u16) -> Self {
        Self {
            master_port: port,
            torchrun_store_key: None,
            ..self.clone()
        }
    }

    /// `MASTER_ADDR:MASTER_PORT`.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// The first host of a Slurm node list (`node[01-04,07],gpu5` →
/// `node01`; `rack[2-3]-n[5-6]` → `rack2-n5`), as `scontrol show
/// hostnames | head -1` prints it; `None` for an empty or unbalanced one.
fn first_host(list: &str) -> Option<String> {
    // The first entry: up to a comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let mut rest = list[..end].trim();
    let mut host = String::new();
    // Each bracket group by its first value (`01-04,07` → `01`).
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        host.push_str(&rest[..open]);
        let first = rest[open + 1..close].split([',', '-']).next()?;
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(vars: &[(&str, &str)]) -> Result<Option<WorldSpec>, DistError> {
        WorldSpec::from_env(vars)
    }

    #[test]
    fn torchrun_variables() {
        let s = spec(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .expect("valid")
        .expect("a job");
        assert_eq!((s.rank, s.world_size, s.local_rank), (3, 8, 1));
        assert_eq!(s.addr(), "node0:1234");
    }

    #[test]
    fn under_torchruns_agent_store_rank_0_publishes_its_port() {
        let torchrun = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "42051"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ];
        let s = spec(&torchrun).expect("valid").expect("a job");
        assert_eq!(s.addr(), "node0:42051", "the store's address");
        assert_eq!(
            s.torchrun_store_key.as_deref(),
            Some("kiln/abc/attempt_2/rendezvous_port")
        );
        // KILN_MASTER_PORT: kiln's own rendezvous there, no store.
        let with_port = |p: &'static str| {
            let mut v = torchrun.to_vec();
            v.push(("KILN_MASTER_PORT", p));
            v
        };
        let s = spec(&with_port("29600")).expect("valid").expect("a job");
        assert_eq!(
            (s.addr().as_str(), s.torchrun_store_key),
            ("node0:29600", None)
        );
        let e = spec(&with_port("0")).expect_err("port 0");
        assert!(e.to_string().contains("KILN_MASTER_PORT=0"), "{e}");
        // kiln launch's ranks: no agent store.
        let s = spec(&torchrun[..4]).expect("valid").expect("a job");
        assert_eq!(s.torchrun_store_key, None);
    }

    #[test]
    fn slurm_variables_with_defaults() {
        let s = spec(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_NTASKS_PER_NODE", "8(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.1"),
        ])
        .expect("valid")
        .expect("a job");
        assert_eq!((s.rank, s.world_size, s.local_world_size), (5, 16, 8));
        assert_eq!(s.addr(), "10.0.0.1:29500");
    }

    #[test]
    fn slurms_rank_0_is_on_the_first_node_of_the_allocation() {
        for (list, first) in [
            ("node[01-04,07],gpu5", Some("node01")),
            ("gpu5,node[1-2]", Some("gpu5")),
            ("rack[2-3]-n[5-6]", Some("rack2-n5")),
            ("a-b-[3,9]-ib", Some("a-b-3-ib")),
            ("single", Some("single")),
            ("node[1-2", None),
            ("", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
        let slurm = [
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.250"),
        ];
        let s = spec(&slurm).expect("valid").expect("a job");
        assert_eq!(s.master_addr, "gpu07", "not the node srun ran on");
        let mut given = slurm.to_vec();
        given.push(("MASTER_ADDR", "10.1.1.1"));
        let s = spec(&given).expect("valid").expect("a job");
        assert_eq!(s.master_addr, "10.1.1.1", "MASTER_ADDR first");
        // A port from the job's id, where MASTER_PORT is unset: two jobs
        // on one node do not meet at 29500.
        let mut job = slurm.to_vec();
        job.push(("SLURM_JOB_ID", "4123456"));
        assert_eq!(
            spec(&job).expect("valid").expect("a job").master_port,
            18456
        );
        job.push(("MASTER_PORT", "29400"));
        assert_eq!(
            spec(&job).expect("valid").expect("a job").master_port,
            29400
        );
    }

    #[test]
    fn no_launcher_or_slurms_single_task_is_a_single_process() {
        assert_eq!(spec(&[("HOME", "/root")]).expect("valid"), None);
        assert_eq!(
            spec(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).expect("valid"),
            None
        );
        // A launcher's job of one rank is a job.
        let one = spec(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .expect("valid")
            .expect("a job of one");
        assert_eq!((one.rank, one.world_size, one.local_world_size), (0, 1, 1));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = spec(&[("RANK", "2"), ("WORLD_SIZE", "2")]).expect_err("out of range");
        assert!(e.to_string().contains("RANK=2") && e.is_bad_input(), "{e}");
        let e = spec(&[("RANK", "x"), ("WORLD_SIZE", "2")]).expect_err("not a number");
        assert!(e.to_string().contains("RANK=x"), "{e}");
        let e = spec(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")])
            .expect_err("port");
        assert!(e.to_string().contains("MASTER_PORT=70000"), "{e}");
        let e = spec(&[("WORLD_SIZE", "2")]).expect_err("no rank");
        assert!(e.to_string().contains("RANK"), "{e}");
    }
}
