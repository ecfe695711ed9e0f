//! The entry points of a run: train a config in a new run directory, or
//! continue one; each hands the work to its workload.

use std::path::Path;

use kiln_config::{RunConfig, Workload};

use crate::report::Observer;
use crate::workload::{lm, nli};
use crate::{Outcome, RunDir, TrainError, TrainOptions};

/// Trains `config` in a new run directory: the language model, or for the
/// `nli` workload k-fold cross-validation ([`train_cv`]).
pub fn train(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    match config.workload {
        Workload::Lm => lm::train(config, options, observer),
        Workload::Nli => nli::train_cv(config, options, observer),
    }
}

/// Trains the NLI workload of `config` with k-fold cross-validation in a
/// new run directory.
pub fn train_cv(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    nli::train_cv(config, options, observer)
}

/// Continues the run in `run_dir` from its newest good checkpoint (for
/// cross-validation: in the fold where it stopped).
pub fn resume(
    run_dir: &Path,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let run = RunDir::open(run_dir)?;
    // One writer at a time: a second `kiln resume` of this run stops here.
    let _lock = run.lock()?;
    let config = kiln_config::read_run_config(&run.file("config.toml"))?;
    match config.workload {
        Workload::Lm => lm::resume(&config, &run, options, observer),
        Workload::Nli => nli::resume_cv(&config, &run, options, observer),
    }
}
