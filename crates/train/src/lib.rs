#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! kiln-train: the only crate that owns a training loop, a device and a
//! checkpoint.
//!
//! - [`train`]: trains a [`RunConfig`] in a run directory — the GPT language
//!   model, or the sentence-pair encoder with grouped, stratified k-fold
//!   cross-validation ([`train_cv`]) — reporting each step through an
//!   [`Observer`], writing metrics ([`Record`]), plots and checkpoints;
//!   [`resume`] continues a run (in the right fold) from its last good
//!   checkpoint, bitwise where the backend is deterministic ([`resume_with`]:
//!   with overrides, to train longer or change the learning rate); [`predict`]
//!   labels pairs with a finished CV run's best fold.
//! - [`bench_lm`], [`bench_nli`]: the training step timed, split into its
//!   phases; [`bench_loader`]: the loader alone.
//! - [`diagnose`]: the pre-flight check, measured (kiln-plan decides).
//! - [`AdamW`]: the optimizer, written out so that its state is ours to
//!   checkpoint.
//!
//! Inside, each decision lives once: `workload/` prepares each workload
//! for the run, bench and diagnose alike; `step.rs` is the one optimizer
//! step the loop (`trainer.rs`) runs and bench times; `setup.rs` the
//! device, precision and first weights; `translate.rs` the mapping of
//! config types to library types.
//!
//! [`RunConfig`]: kiln_config::RunConfig
#![warn(missing_docs)]

/// The crates whose types this crate's API takes and returns: the
/// configuration, the machine, the data and the models.
pub use {kiln_config, kiln_data, kiln_dist, kiln_hwdetect, kiln_model, kiln_plan};

mod bench;
mod bench_attention;
mod checkpoint;
mod compile;
mod device;
mod diagnose;
mod error;
mod export;
mod generate;
mod kernel_profile;
mod lr_find;
mod memory;
mod optim;
mod options;
mod params;
mod perplexity;
mod precision;
mod pretrained;
mod records;
mod report;
mod run;
mod rundir;
mod setup;
mod step;
mod task;
mod tensorboard;
mod tokens;
mod trainer;
mod translate;
mod workload;
mod zero;

pub use bench::{
    BenchOptions, BenchResult, LoaderBenchResult, LoaderRow, PhaseTimes, bench_lm, bench_lm_job,
    bench_loader, bench_nli, bench_nli_job,
};
pub use bench_attention::{AttentionBenchResult, AttentionRow, bench_attention};
pub use checkpoint::{CheckpointInfo, latest_good_checkpoint};
pub use compile::{FUSION_BUILT_IN, apply_compile, autotune_level};
pub use device::{BACKENDS_BUILT_IN, DeviceChoice, backend_for_vendor, select_device};
pub use diagnose::{Diagnosis, diagnose};
pub use error::TrainError;
pub use export::{Exported, export_hf};
pub use generate::{SampleRequest, Samples, sample};
pub use kernel_profile::{KernelProfile, KernelRow};
pub use kiln_data::{PrepareOutcome, PrepareProgress};
pub use kiln_plan::counted;
pub use lr_find::{LrFind, LrFindOptions, LrPoint, lr_find, write_lr_plot};
pub use memory::MemoryTracker;
pub use optim::AdamW;
pub use options::{Outcome, TrainOptions};
pub use perplexity::{EvalRequest, TextEval, evaluate_text};
pub use precision::{
    LossScaler, PrecisionChoice, ScaleVerdict, choose_precision, choose_precision_with,
};
pub use pretrained::hf_name;
pub use records::{
    ClassMetrics, CvSummary, EvalMetrics, EvalRecord, FoldResult, Record, Scores, Skipped,
    StepMetrics,
};
pub use report::{Event, Observer, Silent, Summary, median};
pub use run::{ResumeRequest, resume, resume_with, train, train_cv};
pub use rundir::{RunDir, RunLock, utc_stamp, write_atomic};
pub use setup::{measured_cpu_peak, open_device};
pub use tensorboard::{HPARAMS_SUFFIX, HParam, write_hparams};
pub use tokens::{MEMORY_TEXT_LIMIT, StoreRead, prepare_store};
pub use workload::nli::{Prediction, bert_folder_overrides, predict, predict_folder};

#[cfg(test)]
pub(crate) mod tests {
    use kiln_config::RunConfig;

    /// Flex's random generator is one for the whole process (burn-flex's
    /// `SEED`), and the tests run on threads side by side. A test that
    /// seeds it and compares what it draws holds this lock, and so does
    /// every test that draws from it (a model's first use draws its
    /// weights), so that nothing draws in between. (CI once saw
    /// `initial_weights_come_from_the_seed_not_the_first_step` get another
    /// test's draw.)
    pub(crate) fn flex_rng() -> std::sync::MutexGuard<'static, ()> {
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        // A test that failed holding it leaves it poisoned: the lock is
        // still good for the others.
        RNG.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The configuration the shipped presets resolve to on a machine without
    /// a GPU, with `overrides`.
    pub(crate) fn config(overrides: &[&str]) -> RunConfig {
        let presets = kiln_config::Presets::built_in();
        kiln_config::resolve_overrides(&presets, overrides, &kiln_hwdetect::detect_cpu_only())
            .expect("resolves")
            .config
    }
}
