//! Training errors. `is_bad_input` tells the CLI which are the user's to fix.

use std::path::PathBuf;

/// Why training, resuming, benchmarking or predicting failed. New variants
/// may come (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// Reading, tokenizing or batching the data failed.
    #[error(transparent)]
    Data(#[from] kiln_data::DataError),

    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] kiln_config::ConfigError),

    /// The corpus is too short for one window of a split.
    #[error("`{}` is too short: {why}; {remedy}", path.display())]
    CorpusTooShort {
        /// The corpus.
        path: PathBuf,
        /// Which split is short, by how much.
        why: String,
        /// What lengthens it: a token store's splits were fixed when it
        /// was prepared.
        remedy: String,
    },

    /// A file of the run could not be written.
    #[error("failed to write `{}`", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// A file could not be read.
    #[error("failed to read `{}`", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// A path to write (`run.dir`, an `--out`) under a regular file, or
    /// a folder to make that is one.
    #[error(
        "invalid {what} `{}`: `{}` is a file, not a folder; choose another {what}",
        path.display(),
        file.display()
    )]
    PathUnderFile {
        /// What named the path (`run.dir`, `--out`).
        what: &'static str,
        /// The path asked for.
        path: PathBuf,
        /// The file in its way.
        file: PathBuf,
    },

    /// The folder given as a run is not one.
    #[error("`{}` is not a kiln run directory: {why}", path.display())]
    NotARun {
        /// The folder.
        path: PathBuf,
        /// What it lacks.
        why: String,
    },

    /// `run.dir` names a folder that already holds a run.
    #[error(
        "run.dir `{}` already holds a run: resume it with `kiln resume {}`, or choose another run.dir",
        path.display(),
        path.display()
    )]
    RunExists {
        /// The folder.
        path: PathBuf,
    },

    /// Another process holds the run's lock.
    #[error(
        "run `{}` is in use by another kiln process{}: one process writes a run at a time; wait for it to end, or stop it",
        path.display(),
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    RunInUse {
        /// The run.
        path: PathBuf,
        /// The holder's process id, where it wrote one.
        pid: Option<u32>,
    },

    /// A checkpoint could not be written; the earlier ones are intact.
    #[error(
        "failed to write checkpoint `{}` ({} needed); the earlier checkpoints are intact{hint}",
        path.display(),
        kiln_plan::gib(*bytes)
    )]
    CheckpointWrite {
        /// The checkpoint file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// What to do, where kiln knows ("" or "; …").
        hint: String,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// No checkpoint of a run can be read.
    #[error("no usable checkpoint in `{}`: {why}", dir.display())]
    NoCheckpoint {
        /// The checkpoints' folder.
        dir: PathBuf,
        /// Why each was refused.
        why: String,
    },

    /// A checkpoint holds another model's shapes.
    #[error("checkpoint `{}` does not fit this model: {why}", path.display())]
    CheckpointMismatch {
        /// The checkpoint file.
        path: PathBuf,
        /// What does not fit.
        why: String,
    },

    /// `model.init_from` names weights the run cannot start from.
    #[error("model.init_from: `{}` {why}", path.display())]
    Pretrained {
        /// The folder (or the file in it at fault).
        path: PathBuf,
        /// What is wrong, and the fix.
        why: String,
    },

    /// The `transformers` GPT-2 folder `kiln sample` or `kiln eval` reads
    /// cannot serve (the same checks as `model.init_from`'s).
    #[error("`{}` {why}", path.display())]
    PretrainedFolder {
        /// The folder (or the file in it at fault).
        path: PathBuf,
        /// What is wrong, and the fix.
        why: String,
    },

    /// A prompt the tokenizer cannot encode (`kiln sample`).
    #[error("the prompt cannot be encoded: {why}")]
    Prompt {
        /// Which characters, and why.
        why: String,
    },

    /// A text the model's tokenizer cannot encode (`kiln eval`).
    #[error("`{}` cannot be encoded by the model's tokenizer: {why}", path.display())]
    TextNotEncodable {
        /// The file.
        path: std::path::PathBuf,
        /// Which characters, and why.
        why: String,
    },

    /// The backend asked for is not built in or has no device.
    #[error("backend `{backend}` is not available: {why}")]
    Backend {
        /// The backend (`cuda`, `wgpu`).
        backend: String,
        /// Why not, and what to do.
        why: String,
    },

    /// `optimization.attention = "flash"` where the matrix-unit kernels
    /// cannot run.
    #[error(
        "optimization.attention = \"flash\" cannot run here: {why}; set optimization.attention = \"auto\" to run the best attention this device has"
    )]
    FlashAttentionNotHere {
        /// What is missing: the dtype, the device's matrix unit, the head width.
        why: String,
    },

    /// `optimization.matmul = "cublas"` where cuBLAS cannot run.
    #[error(
        "optimization.matmul = \"cublas\" cannot run here: {why}; set optimization.matmul = \"burn\" to run Burn's products"
    )]
    CublasNotHere {
        /// What is missing: a CUDA device, a CUDA build, the library.
        why: String,
    },

    /// Too many steps in a row had a non-finite loss or gradients.
    #[error(
        "{what} at step {step}, {in_a_row} step(s) in a row (precision.max_bad_steps): training diverged; the non-finite steps were skipped, so the last good checkpoint is intact; lower training.learning_rate or raise training.warmup_steps"
    )]
    NonFinite {
        /// The last bad step.
        step: u64,
        /// What was not finite (the loss, the gradient norm).
        what: String,
        /// Bad steps in a row.
        in_a_row: usize,
    },

    /// A model that gives logits that are not finite: weights training
    /// diverged to NaN or infinity.
    #[error(
        "{model}: {why}; sample a model from before the divergence (`--best` takes the best evaluation's, where there was a finite one), or train again with a lower training.learning_rate or more training.warmup_steps"
    )]
    Diverged {
        /// The model (the step of a run, a GPT-2 folder).
        model: String,
        /// What was not finite.
        why: String,
    },

    /// A CPU run whose step needs over twice the memory the machine has.
    #[error(
        "{key}: {problem}, over twice what it has; fix: {fix} (`kiln diagnose` shows the estimate by part; --force runs it anyway)"
    )]
    OverMemory {
        /// The key to change.
        key: String,
        /// The estimate against the memory available.
        problem: String,
        /// The batch that fits.
        fix: String,
    },

    /// `kiln export`'s destination exists.
    #[error("`{}` exists already; kiln export writes a new folder and overwrites nothing (remove it, or choose another --out)", path.display())]
    ExportExists {
        /// The destination.
        path: PathBuf,
    },

    /// A resume under another world size that changes the global batch.
    #[error("cannot resume with {}: {why}", kiln_plan::counted(*world, "rank"))]
    WorldSize {
        /// The ranks of the resuming job.
        world: usize,
        /// The batches before and after, and what would keep them.
        why: String,
    },

    /// A data-parallel job failed: a rank gone, a rendezvous incomplete.
    #[error(transparent)]
    Dist(#[from] kiln_dist::DistError),

    /// A combination kiln does not support yet: what, and why.
    #[error("{0} is not supported yet: {1}")]
    Unsupported(&'static str, String),
}

impl TrainError {
    /// Whether the error is caused by what the user gave (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        // A file that could not be written (a full disk), or a shard read
        // before that can no longer be, is the machine's failure, not the
        // input's.
        if let Self::Data(
            kiln_data::DataError::Write { .. } | kiln_data::DataError::ShardUnreadable { .. },
        ) = self
        {
            return false;
        }
        matches!(
            self,
            Self::Data(_)
                | Self::Config(_)
                | Self::CorpusTooShort { .. }
                | Self::NotARun { .. }
                | Self::RunExists { .. }
                | Self::PathUnderFile { .. }
                | Self::RunInUse { .. }
                | Self::NoCheckpoint { .. }
                | Self::CheckpointMismatch { .. }
                | Self::Pretrained { .. }
                | Self::PretrainedFolder { .. }
                | Self::Prompt { .. }
                | Self::TextNotEncodable { .. }
                | Self::Backend { .. }
                | Self::FlashAttentionNotHere { .. }
                | Self::CublasNotHere { .. }
                | Self::ExportExists { .. }
                | Self::Diverged { .. }
                | Self::OverMemory { .. }
                | Self::Unsupported(..)
                | Self::WorldSize { .. }
        ) || matches!(self, Self::Dist(e) if e.is_bad_input())
    }
}
