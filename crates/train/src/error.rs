//! Training errors. `is_bad_input` tells the CLI which are the user's to fix.

use std::path::PathBuf;

/// Why training, resuming, benchmarking or predicting failed. New variants
/// may come (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] kiln_data::DataError),

    #[error(transparent)]
    Config(#[from] kiln_config::ConfigError),

    #[error("`{}` is too short: {why}; use a longer corpus, a smaller model.max_length or data.val_fraction", path.display())]
    CorpusTooShort { path: PathBuf, why: String },

    #[error("failed to write `{}`", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("failed to read `{}`", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("`{}` is not a kiln run directory: {why}", path.display())]
    NotARun { path: PathBuf, why: String },

    #[error(
        "run `{}` is in use by another kiln process{}: one process writes a run at a time; wait for it to end, or stop it",
        path.display(),
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    RunInUse { path: PathBuf, pid: Option<u32> },

    #[error(
        "failed to write checkpoint `{}` ({} needed); the earlier checkpoints are intact",
        path.display(),
        size(*bytes)
    )]
    CheckpointWrite {
        path: PathBuf,
        bytes: u64,
        #[source]
        source: std::io::Error,
    },

    #[error("no usable checkpoint in `{}`: {why}", dir.display())]
    NoCheckpoint { dir: PathBuf, why: String },

    #[error("checkpoint `{}` does not fit this model: {why}", path.display())]
    CheckpointMismatch { path: PathBuf, why: String },

    #[error("backend `{backend}` is not available: {why}")]
    Backend { backend: String, why: String },

    #[error(
        "{what} at step {step}, {in_a_row} step(s) in a row (precision.max_bad_steps): training diverged; the non-finite steps were skipped, so the last good checkpoint is intact; lower training.learning_rate or raise training.warmup_steps"
    )]
    NonFinite {
        step: u64,
        what: String,
        in_a_row: usize,
    },

    #[error("`{}` exists already; kiln export writes a new folder and overwrites nothing (remove it, or choose another --out)", path.display())]
    ExportExists { path: PathBuf },

    #[error("{0} is not supported yet: {1}")]
    Unsupported(&'static str, String),
}

/// Bytes in MiB (or GiB from one GiB), for messages.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= f64::from(1u32 << 30) {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    }
}

impl TrainError {
    /// Whether the error is caused by what the user gave (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Self::Data(_)
                | Self::Config(_)
                | Self::CorpusTooShort { .. }
                | Self::NotARun { .. }
                | Self::RunInUse { .. }
                | Self::NoCheckpoint { .. }
                | Self::CheckpointMismatch { .. }
                | Self::Backend { .. }
                | Self::ExportExists { .. }
                | Self::Unsupported(..)
        )
    }
}
