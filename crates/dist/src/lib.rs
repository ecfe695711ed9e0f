#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! - [`WorldSpec`]: who this process is in a job, from the variables
//!   `kiln launch`, torchrun or Slurm set.
//! - [`Group`]: the connected job: [`Group::all_reduce`] (gradients, losses,
//!   stop flags) and [`Group::all_gather`] (checksums), the same bytes on
//!   every rank; a rank that dies or stops answering is an error naming it.
//! - [`launch`]: one process per local rank, with the variables set; the
//!   first one to fail ends the job.
//! - [`nccl_lib`]: finding NCCL's library by the name cudarc opens; with the
//!   `nccl` feature, [`Group::use_nccl`] routes the all-reduce through NCCL,
//!   and [`Group::all_reduce_device`] reduces a CUDA buffer in place
//!   ([`Group::reduce_scatter_device`] and [`Group::all_gather_device`]
//!   for ZeRO's gradients and weights).
#![warn(missing_docs)]

mod env;
mod error;
mod group;
mod launch;
#[cfg(feature = "nccl")]
mod nccl;
pub mod nccl_lib;
mod store;

pub use env::{DEFAULT_PORT, WorldSpec};
pub use error::DistError;
#[cfg(feature = "nccl")]
pub use group::{DeviceBuffer, DeviceDtype};
pub use group::{Group, Reduce};
pub use launch::{JobEnd, LaunchSpec, describe_exit, launch};

/// This process's environment variables whose names and values are
/// UTF-8, for [`WorldSpec::from_env`]: the others (which no launcher
/// sets) are left out, where `std::env::vars` would panic on them.
pub fn process_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// This machine's host name (for messages that name where a rank ran).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // within it or truncates.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
