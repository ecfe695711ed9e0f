#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! kiln-config: the typed, validated run configuration and where each value
//! came from.
//!
//! Layers, later wins: `defaults.toml` < `hardware/<name>.toml` <
//! `experiment/<name>.toml` < each `--config FILE` (TOML, or YAML or JSON
//! by its name, as presets in a directory may be) < `KILN_*` environment
//! variables (`KILN_TRAINING__BATCH_SIZE=7`) < command-line overrides in
//! Hydra's syntax (`hardware=t4 training.batch_size=20`). Unknown keys, wrong
//! types and out-of-range values are errors that name the key, the value and
//! the layer (with file and line) that set them.
//!
//! kiln's presets are built into this crate ([`Presets::built_in`]); a
//! directory of presets can go over them ([`Presets::with_dir`]).
//! `hardware=auto` asks [`choose_preset`], a pure function of a
//! [`kiln_hwdetect::HardwareReport`] (re-exported).
//!
//! This crate is the only one in kiln that reads preset files or environment
//! variables; it depends on no ML framework.

#![warn(missing_docs)]

/// kiln-hwdetect, whose [`HardwareReport`](kiln_hwdetect::HardwareReport)
/// [`LoadOptions`] and [`choose_preset`] take.
pub use kiln_hwdetect;

mod error;
mod foreign;
mod layer;
mod load;
mod preset;
mod presets;
mod schema;
pub mod sweep;
mod tuned;

pub use error::ConfigError;
pub use foreign::{FOREIGN_NAMES, foreign_setting};
pub use layer::{LayerKind, Source};
pub use load::{
    ExplainRow, LoadOptions, NOT_CONFIGURATION, ResolvedConfig, ResumeChange, ResumedConfig,
    experiment_chosen, fixed_when_resuming, read_run_config, resolve, resolve_overrides,
    resume_run_config, tuned_path,
};
pub use preset::{
    ANY_GPU_PRESETS, APPLE_PRESET, EffectivePrecision, PRESET_GPUS, PRESET_OTHER_GPUS,
    PresetChoice, PresetMismatch, check_preset_fits, choose_preset, effective_precision,
    machine_precision, other_gpu_precision,
};
pub use presets::Presets;
pub use schema::*;
pub use tuned::write_tuned;
