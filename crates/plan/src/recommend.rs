//! The recommendation of `kiln check-hardware`: what the chosen preset comes
//! to on this machine, in the terms of the hand-written guides (batch,
//! precision, loader, compile, checkpointing, sequence length).

use std::fmt;

use kiln_config::{EffectivePrecision, ResolvedConfig, machine_precision};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::run_gpu;

/// What a resolved configuration recommends on a machine.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Recommendation {
    /// The hardware preset, and why it was chosen ("set explicitly" when a
    /// layer named it).
    pub preset: String,
    /// Why that preset.
    pub preset_why: String,
    /// The GPU the preset was chosen for, if any.
    pub gpu_index: Option<u32>,
    /// The experiment the recommendation is for.
    pub experiment: String,
    /// Micro-batch size (`training.batch_size`).
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Samples per optimizer step: batch × accumulation.
    pub effective_batch: usize,
    /// The precision as the run's GPU decides it, and why.
    pub precision: String,
    /// Why that precision.
    pub precision_why: String,
    /// Loader worker threads.
    pub num_workers: usize,
    /// Batches each worker keeps ready.
    pub prefetch_factor: usize,
    /// `optimization.compile`: CubeCL's autotune on GPU backends.
    pub compile: bool,
    /// Whether activations are recomputed in backward.
    pub gradient_checkpointing: bool,
    /// Block size of the LM, longest pair of the encoder.
    pub max_length: usize,
}

impl Recommendation {
    /// What `resolved` recommends on `hardware`.
    pub fn new(resolved: &ResolvedConfig, hardware: &HardwareReport) -> Self {
        let c = &resolved.config;
        let EffectivePrecision {
            label: precision,
            why: precision_why,
            ..
        } = machine_precision(&c.precision, run_gpu(c, hardware), hardware);
        Self {
            preset: c.hardware.clone(),
            preset_why: resolved
                .hardware_choice
                .as_ref()
                .map_or("set explicitly".to_string(), |c| c.why.clone()),
            gpu_index: resolved.hardware_choice.as_ref().and_then(|c| c.gpu_index),
            experiment: c.experiment.clone(),
            batch_size: c.training.batch_size,
            gradient_accumulation_steps: c.training.gradient_accumulation_steps,
            effective_batch: c.effective_batch(),
            precision,
            precision_why,
            num_workers: c.loader.num_workers,
            prefetch_factor: c.loader.prefetch_factor,
            compile: c.optimization.compile,
            gradient_checkpointing: c.model.gradient_checkpointing,
            max_length: c.model.max_length,
        }
    }

    /// The rows of the recommendation, label and value.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        let on_off = |b: bool| if b { "on" } else { "off" };
        vec![
            (
                "batch size",
                format!(
                    "{} × {} accumulation = {} per optimizer step",
                    self.batch_size, self.gradient_accumulation_steps, self.effective_batch
                ),
            ),
            (
                "precision",
                format!("{} ({})", self.precision, self.precision_why),
            ),
            (
                "loader",
                format!(
                    "{} worker{}, prefetch {}",
                    self.num_workers,
                    if self.num_workers == 1 { "" } else { "s" },
                    self.prefetch_factor
                ),
            ),
            ("compile", on_off(self.compile).to_string()),
            (
                "checkpointing",
                format!(
                    "gradient checkpointing {}",
                    on_off(self.gradient_checkpointing)
                ),
            ),
            ("max_length", self.max_length.to_string()),
        ]
    }
}

impl fmt::Display for Recommendation {
    /// The preset line and the rows, as `kiln check-hardware` prints them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Preset   {} — {}", self.preset, self.preset_why)?;
        writeln!(
            f,
            "Recommended (hardware={}, experiment={}; `kiln config --explain` shows every key):",
            self.preset, self.experiment
        )?;
        for (k, v) in self.rows() {
            writeln!(f, "  {k:<14} {v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kiln_hwdetect::{DriverInfo, FixedProbe, GpuInfo, GpuStatus, detect_with};

    use super::*;

    #[test]
    fn a_t4_is_recommended_fp16_and_its_preset() {
        let gpu = GpuInfo::new(0, "Tesla T4", 15 << 30, 14 << 30, (7, 5));
        let t4 = detect_with(&FixedProbe(
            GpuStatus::Found { gpus: vec![gpu] },
            DriverInfo::default(),
        ));
        let resolved = kiln_config::resolve_overrides(&kiln_config::Presets::built_in(), &[], &t4)
            .expect("resolves");
        let r = Recommendation::new(&resolved, &t4);
        assert_eq!(r.preset, "t4");
        assert_eq!(r.gpu_index, Some(0));
        assert!(r.precision.contains("fp16"), "{r:?}");
        let text = r.to_string();
        assert!(text.starts_with("Preset   t4 — "), "{text}");
        assert!(text.contains("  batch size     "), "{text}");
    }
}
