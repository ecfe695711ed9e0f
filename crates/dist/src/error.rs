//! What can go wrong in a job, each naming the rank, the host or the variable.

use std::time::Duration;

/// A distributed job's error.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A launcher's or the environment's value is wrong (exit 2).
    #[error("{what}: {why}")]
    BadLaunch {
        /// The argument or variable, as the user wrote it.
        what: String,
        /// Why it cannot be used, and what would.
        why: String,
    },
    /// The rendezvous port is taken by another process.
    #[error(
        "port {port} is in use on this machine (another job, or an earlier one still ending); choose another with --master-port (MASTER_PORT)"
    )]
    PortInUse {
        /// The port.
        port: u16,
    },
    /// Not every rank joined in time.
    #[error(
        "the rendezvous at {addr} did not complete in {}s: {missing} did not join; {remedy}",
        waited.as_secs()
    )]
    RendezvousTimeout {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// Which ranks, in words.
        missing: String,
        /// How long this rank waited.
        waited: Duration,
        /// What to check (LAUNCHERS_AGREE or STORE_PROTOCOL).
        remedy: &'static str,
    },
    /// A rank died, or its connection broke, or it stopped answering.
    #[error("rank {rank} ({host}) is gone during {during}: {why}")]
    PeerLost {
        /// The rank.
        rank: usize,
        /// Where it ran (`host, pid N`).
        host: String,
        /// What the job was doing.
        during: String,
        /// What was seen: the connection closed, or no answer in time.
        why: String,
    },
    /// The ranks disagree where they must agree (the model, the step).
    #[error("the ranks disagree: {0}")]
    Diverged(String),
    /// Starting a rank failed.
    #[error("could not start rank {rank}: {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// NCCL could not be loaded, set up or run.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// A socket operation failed for another reason.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A rendezvous that timed out between kiln's own ranks: what to check.
pub(crate) const LAUNCHERS_AGREE: &str = "check that every node runs its launcher with the same --master-addr, --master-port and --nnodes, and that the port is reachable";

/// A rendezvous through torchrun's store that timed out or broke: what to
/// check, and the way around a torch whose TCPStore speaks another
/// protocol than the one kiln was checked against (torch 2.x's).
pub(crate) const STORE_PROTOCOL: &str = "check that rank 0 started (its own error says why not); if it did, this torch's TCPStore may speak another protocol than the one kiln knows (torch 2.x's): set KILN_MASTER_PORT to a free port for kiln's own rendezvous, or start the ranks with `kiln launch`";

impl DistError {
    /// Whether the user's input is at fault (kiln exits 2).
    pub fn is_bad_input(&self) -> bool {
        matches!(self, Self::BadLaunch { .. } | Self::PortInUse { .. })
    }
}
