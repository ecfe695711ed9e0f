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
}

impl WorldSpec {
    /// The job `env` describes: torchrun's and `kiln launch`'s `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; else Slurm's `SLURM_PROCID`, `SLURM_NTASKS`,
    /// `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` with `MASTER_ADDR` (or
    /// `SLURM_LAUNCH_NODE_IPADDR`). `None` where no launcher started the
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
            let addr = get("MASTER_ADDR").or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"));
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
        let master_port =
            match get("MASTER_PORT") {
                None => DEFAULT_PORT,
                Some(p) => p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| {
                    DistError::BadLaunch {
                        what: format!("MASTER_PORT={p}"),
                        why: "a port is a number from 1 to 65535".into(),
                    }
                })?,
            };
        Ok(Some(Self {
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            master_addr: addr_var.unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT`.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
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
