#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! kiln-plan: what kiln decides before a device exists, without an ML
//! framework. kiln-train measures; this crate decides.
//!
//! - [`Schedule`]: optimizer steps per run and per epoch, where epochs end,
//!   the learning rate at each step — for the run, `kiln diagnose` and its
//!   time estimate alike.
//! - [`check_config`]: `kiln diagnose`'s checks, each problem with its fix
//!   ([`check_schedule`], the schedule's part, also warns as `kiln train`
//!   starts);
//!   [`estimate_memory`]: what a step needs, from the shapes.
//! - [`tune`] and [`sweep`]: the tuner's search over a [`Probe`] (a child
//!   `kiln bench` in the CLI, a fake machine in tests), and the block it
//!   writes ([`tuned_block`]; kiln-config writes and reads the file).
//! - [`run_gpu`]: the GPU of the machine a run uses; [`Recommendation`]:
//!   what the chosen preset comes to on it (`kiln check-hardware`).
#![warn(missing_docs)]

/// The crates whose types this crate's API takes.
pub use {kiln_config, kiln_hwdetect};

mod checks;
mod memory;
mod ranks;
mod recommend;
mod schedule;
mod tune;

use kiln_config::RunConfig;
use kiln_hwdetect::{GpuInfo, HardwareReport};

pub use checks::{
    Burst, CheckInput, DataSize, Finding, SMALL_MICRO_BATCH_TOKENS, Severity, check_config,
    check_schedule, eval_memory_finding, gib, loader_verdict, memory_finding,
};
pub use memory::{
    AttentionMemory, LogitsMemory, MemoryEstimate, ModelSize, estimate_memory, estimate_memory_with,
};
pub use ranks::{
    LINKS, Link, Ranks, ReductionEstimate, allgather_seconds, allreduce_seconds, local_ranks,
    rank_gpu_count,
};
pub use recommend::Recommendation;
pub use schedule::{Schedule, lr_at};
pub use tune::{
    Candidate, Measurement, NothingRan, Probe, ProbeResult, Trial, TuneResult, TuneSpace, divisors,
    memory_limit, sweep, tune, tuned_block,
};

/// The GPU of `hardware` a run of `config` uses: the one at `device.index`
/// (which `hardware=auto` sets to the GPU it chose the preset for), else
/// the first. `None` on a machine without an NVIDIA GPU.
pub fn run_gpu<'a>(config: &RunConfig, hardware: &'a HardwareReport) -> Option<&'a GpuInfo> {
    let gpus = hardware.gpus();
    gpus.iter()
        .find(|g| g.index as usize == config.device.index)
        .or(gpus.first())
}

/// `n` and its noun, singular for one: `counted(1, "layer")` is "1 layer",
/// `counted(4, "layer")` "4 layers" (the nouns kiln counts take an "s").
///
/// ```
/// assert_eq!(kiln_plan::counted(1, "head"), "1 head");
/// assert_eq!(kiln_plan::counted(12, "head"), "12 heads");
/// ```
pub fn counted<N: std::fmt::Display + PartialEq + From<u8>>(n: N, noun: &str) -> String {
    if n == N::from(1) {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use kiln_config::{RunConfig, TrainingSection};

    /// The configuration the shipped presets resolve to on a machine
    /// without a GPU, with `overrides`.
    pub(crate) fn config(overrides: &[&str]) -> RunConfig {
        let presets = kiln_config::Presets::built_in();
        kiln_config::resolve_overrides(&presets, overrides, &kiln_hwdetect::detect_cpu_only())
            .expect("resolves")
            .config
    }

    pub(crate) fn training() -> TrainingSection {
        config(&[]).training
    }
}
