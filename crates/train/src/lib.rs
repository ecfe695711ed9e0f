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
//! - [`bench_lm`], [`bench_nli`]: timed steps with the step split into its phases.
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
mod nli;
mod optim;
mod params;
mod report;
mod rundir;
mod trainer;

pub use bench::{BenchOptions, BenchResult, PhaseTimes, bench_lm, bench_nli};
pub use checkpoint::{CheckpointInfo, latest_good_checkpoint};
pub use device::{DeviceChoice, select_device};
pub use error::TrainError;
pub use lm::{Outcome, TrainOptions, resume, train};
pub use memory::MemoryTracker;
pub use nli::{ClassMetrics, CvSummary, FoldResult, Prediction, Scores, predict, train_cv};
pub use optim::{AdamW, lr_at};
pub use report::{Event, Observer, StepMetrics, Summary};
pub use rundir::RunDir;
