//! What a run is given besides its configuration, and how it ended.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use kiln_hwdetect::HardwareReport;

use crate::records::CvSummary;
use crate::report::Summary;

/// What the caller provides besides the configuration
/// ([`TrainOptions::new`], then its fields as needed).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TrainOptions {
    /// Set (by Ctrl-C) to stop after the current step with a checkpoint.
    pub interrupt: Arc<AtomicBool>,
    /// Set by the training loop as it begins: from then on a stop writes
    /// a checkpoint. Before it nothing of the run's is lost by ending the
    /// process at once (a token store's preparation goes on from where it
    /// stopped, and the run's files are written whole or not at all), so a
    /// handler of Ctrl-C can exit rather than wait for the first step.
    /// A job's rank sets it from the start: its ranks take a stop together,
    /// in a step's reduction.
    pub saves_on_stop: Arc<AtomicBool>,
    /// The machine, for the MFU denominator and the saved report.
    pub hardware: HardwareReport,
    /// `kiln config --explain` lines, saved as `config-sources.txt`.
    pub sources: Vec<String>,
    /// The data-parallel job this process is a rank of (`kiln launch`,
    /// torchrun, Slurm), or `None` to train alone. Each rank trains on its
    /// share of every batch; gradients are averaged once per optimizer
    /// step; rank 0 alone writes the run directory.
    pub group: Option<Arc<kiln_dist::Group>>,
    /// Train even where, on the CPU, the step's memory estimate exceeds
    /// the available RAM (`--force`; refused otherwise, exit 2).
    pub force: bool,
}

impl TrainOptions {
    /// A run alone on `hardware`: no interrupt set, no sources, no job,
    /// not forced.
    pub fn new(hardware: HardwareReport) -> Self {
        Self {
            interrupt: Arc::default(),
            saves_on_stop: Arc::default(),
            hardware,
            sources: Vec::new(),
            group: None,
            force: false,
        }
    }

    /// Processes in the job (1 alone).
    pub fn world_size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.world_size())
    }

    /// Whether this process writes the run directory (rank 0, or alone).
    pub fn writes(&self) -> bool {
        self.group.as_ref().is_none_or(|g| g.is_root())
    }
}

/// How a run ended.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The run (or one fold's) finished its steps.
    Finished {
        /// The run's folder.
        run: PathBuf,
        /// Its summary (also in `summary.json`).
        summary: Summary,
    },
    /// A cross-validation run finished all its folds.
    CvFinished {
        /// The run's folder.
        run: PathBuf,
        /// The folds' results (also in `cv_summary.json`).
        summary: CvSummary,
    },
    /// Stopped by the interrupt flag, after writing this checkpoint.
    Interrupted {
        /// The run's folder.
        run: PathBuf,
        /// The optimizer steps taken.
        step: u64,
        /// The checkpoint written: `kiln resume` continues from it.
        checkpoint: PathBuf,
    },
}
