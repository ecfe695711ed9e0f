//! kiln-train: the only crate that owns a training loop, a device and a
//! checkpoint.
//!
//! - [`train`]: trains a [`RunConfig`] in a run directory — the GPT language
//!   model, or the sentence-pair encoder with grouped, stratified k-fold
//!   cross-validation ([`train_cv`]) — reporting each step through an
//!   [`Observer`], writing metrics, plots and checkpoints; [`resume`]
//!   continues a run (in the right fold) from its last good checkpoint,
//!   bitwise where the backend is deterministic; [`predict`] labels pairs
//!   with a finished CV run's best fold.
//! - [`bench_lm`], [`bench_nli`]: timed steps with the step split into its
//!   phases; [`bench_loader`]: the loader alone.
//! - [`diagnose`]: the pre-flight check (device, data, config problems with
//!   their fixes, memory, a measured burst); [`tune`]: micro-batch,
//!   accumulation and loader settings measured for this machine.
//! - [`AdamW`], [`lr_at`]: the optimizer and schedule, written out so that
//!   their state is ours to checkpoint.
//!
//! [`RunConfig`]: kiln_config::RunConfig

mod bench;
mod checkpoint;
mod compile;
mod device;
mod diagnose;
mod error;
mod lm;
mod memory;
mod nli;
mod optim;
mod params;
mod precision;
mod report;
mod rundir;
mod trainer;
mod tune;

pub use bench::{
    BenchOptions, BenchResult, LoaderBenchResult, LoaderRow, PhaseTimes, bench_lm, bench_loader,
    bench_nli,
};
pub use checkpoint::{CheckpointInfo, latest_good_checkpoint};
pub use compile::{FUSION_BUILT_IN, apply_compile, autotune_level};
pub use device::{BACKENDS_BUILT_IN, DeviceChoice, open_device, select_device};
pub use diagnose::{
    Burst, CheckInput, DataSize, Diagnosis, Finding, MemoryEstimate, Severity, check_config,
    diagnose, estimate_memory, gib, loader_verdict,
};
pub use error::TrainError;
pub use lm::{Outcome, TrainOptions, resume, train};
pub use memory::MemoryTracker;
pub use nli::{ClassMetrics, CvSummary, FoldResult, Prediction, Scores, predict, train_cv};
pub use optim::{AdamW, lr_at};
pub use precision::{
    LossScaler, PrecisionChoice, ScaleVerdict, choose_precision, choose_precision_with,
};
pub use report::{Event, Observer, StepMetrics, Summary, median};
pub use rundir::{RunDir, utc_stamp};
pub use tune::{
    Candidate, Measurement, NothingRan, Probe, ProbeResult, Trial, TuneResult, TuneSpace, divisors,
    sweep, tune, tuned_block, write_tuned,
};
