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
/// cross-validation: in the fold where it stopped), with the configuration
/// it saved.
pub fn resume(
    run_dir: &Path,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    resume_with(run_dir, &ResumeRequest::default(), options, observer)
}

/// What a resume changes besides continuing the run (`kiln resume RUN
/// [--from STEP] [key=value ...]`).
#[derive(Clone, Debug, Default)]
pub struct ResumeRequest {
    /// `key=value` overrides over the run's saved configuration.
    pub overrides: Vec<String>,
    /// Continue from this step's checkpoint instead of the newest (a
    /// language model's run only).
    pub from_step: Option<u64>,
}

/// [`resume`] with changes. `request.overrides` go over the saved
/// configuration: to train longer (`training.max_steps`), with a lower
/// learning rate after a divergence, with a smaller micro-batch after
/// running out of memory, on another device. Keys that would change the
/// model, the data or the order it is drawn in are refused
/// ([`kiln_config::fixed_when_resuming`]). The run's `config.toml` takes
/// the new values once the run is set to continue, and
/// `config-sources.txt` records the change, so that a later `resume`
/// continues with them. `request.from_step` goes back to an earlier
/// checkpoint (before a divergence): what the run wrote after it, its newer
/// checkpoints and metric lines, is moved to `checkpoints/after-<step>/`,
/// not deleted.
pub fn resume_with(
    run_dir: &Path,
    request: &ResumeRequest,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let mut run = RunDir::open(run_dir)?;
    if !options.writes() {
        // A data-parallel job's other ranks read the run; rank 0 writes it.
        run = run.reader();
    }
    // One writer at a time: a second `kiln resume` of this run stops here.
    let _lock = run.lock()?;
    let resumed = kiln_config::resume_run_config(&run.file("config.toml"), &request.overrides)?;
    match resumed.config.workload {
        Workload::Lm => lm::resume(&resumed, request.from_step, &run, options, observer),
        Workload::Nli if request.from_step.is_some() => Err(TrainError::Unsupported(
            "kiln resume --from on a cross-validation run",
            "a CV run resumes in the fold it stopped in, from that fold's newest checkpoint".into(),
        )),
        Workload::Nli => nli::resume_cv(&resumed, &run, options, observer),
    }
}
