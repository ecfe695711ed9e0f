//! kiln-train: the only crate that owns a training loop, a device and a
//! checkpoint.
//!
//! - [`train_lm`]: trains the GPT language model of a [`RunConfig`] in a run
//!   directory, reporting each step through an [`Observer`], writing
//!   metrics, plots, samples and checkpoints; [`resume`] continues a run from
//!   its last good checkpoint, bitwise where the backend is deterministic.
//! - [`bench_lm`]: timed steps with the step split into its phases.
//! - [`AdamW`], [`lr_at`]: the optimizer and schedule, written out so that
//!   their state is ours to checkpoint.
//!
//! [`RunConfig`]: kiln_config::RunConfig

mod bench;
mod checkpoint;
mod device;
mod error;
mod lm;
mod memory;
mod optim;
mod params;
mod report;
mod rundir;
mod trainer;

pub use bench::{BenchOptions, BenchResult, PhaseTimes, bench_lm};
pub use checkpoint::{CheckpointInfo, latest_good_checkpoint};
pub use device::{DeviceChoice, select_device};
pub use error::TrainError;
pub use lm::{Outcome, TrainOptions, resume, train_lm};
pub use memory::MemoryTracker;
pub use optim::{AdamW, lr_at};
pub use report::{Event, Observer, StepMetrics, Summary};
pub use rundir::RunDir;
