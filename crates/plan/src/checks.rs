//! `kiln diagnose`'s checks: a pure function of the config, the machine,
//! the dataset's size and the memory estimate, so each can be tested
//! without data, a model or a device.

use kiln_config::{AmpDtype, Backend, RunConfig, Workload};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::{MemoryEstimate, Schedule};

/// How bad a finding is: an `Error` makes the run fail or waste itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing; nothing to change.
    Note,
    /// The run works, but slower or worse than it could.
    Warning,
    /// The run would fail: `kiln diagnose` exits 2.
    Error,
}

/// One problem with the configuration on this machine and this data.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// How bad it is.
    pub severity: Severity,
    /// The key to change.
    pub key: String,
    /// What is wrong, naming the keys involved.
    pub problem: String,
    /// What to set instead, in kiln's terms.
    pub fix: String,
}

/// The dataset measured against the config.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DataSize {
    /// "tokens" (language model) or "pairs" (sentence pairs).
    pub unit: String,
    /// Training tokens or pairs (for cross-validation: one fold's training part).
    pub train: usize,
    /// Validation tokens or pairs.
    pub validation: usize,
    /// Samples (windows or pairs) in one pass over the training part.
    pub samples_per_epoch: usize,
    /// Pairs only: the longest pair in tokens before truncation, and how
    /// many pairs are longer than `model.max_length`.
    pub longest: Option<usize>,
    /// Pairs longer than `model.max_length` (truncated when encoded).
    pub truncated: usize,
    /// Pairs only: the 99th percentile of pair length in tokens.
    pub p99_length: Option<usize>,
    /// The splits were fixed when the data was prepared (a token store):
    /// `data.val_fraction` does not change them.
    pub splits_fixed: bool,
}

/// What a short measured burst of training steps showed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Burst {
    /// Optimizer steps timed (each of `gradient_accumulation_steps` micro-batches).
    pub steps: usize,
    /// Median milliseconds of one optimizer step.
    pub ms_per_step: f64,
    /// Share of the step time spent waiting for the loader, in percent.
    pub data_wait_pct: f64,
    /// Peak memory during the burst, in bytes (device or process).
    pub peak_memory_bytes: u64,
    /// One pass over the training data at that speed.
    pub seconds_per_epoch: f64,
    /// The whole run as configured (training steps; evaluation not included).
    pub seconds_total: f64,
    /// Whether the loader kept up, in a sentence (`loader_verdict`).
    pub loader_verdict: String,
}

impl Burst {
    /// The time estimate and the loader's verdict from `steps` measured
    /// optimizer steps, over the run's `schedule`.
    pub fn new(
        steps: usize,
        ms_per_step: f64,
        data_wait_pct: f64,
        peak_memory_bytes: u64,
        schedule: &Schedule,
        workers: usize,
        cores: usize,
    ) -> Self {
        let seconds_per_step = ms_per_step / 1e3;
        Self {
            steps,
            ms_per_step,
            data_wait_pct,
            peak_memory_bytes,
            seconds_per_epoch: seconds_per_step * schedule.steps_per_epoch(),
            seconds_total: seconds_per_step * schedule.total_steps as f64,
            loader_verdict: loader_verdict(data_wait_pct, workers, cores),
        }
    }
}

/// The loader's verdict from the measured share of the step spent waiting.
pub fn loader_verdict(data_wait_pct: f64, workers: usize, cores: usize) -> String {
    if data_wait_pct > 5.0 {
        let more = (workers.max(1) * 2).min(cores.max(1));
        if more > workers {
            format!(
                "data-bound: the step waited for data {data_wait_pct:.1} % of the time; raise loader.num_workers to {more}"
            )
        } else {
            format!(
                "data-bound: the step waited for data {data_wait_pct:.1} % of the time with a worker per core; raise loader.prefetch_factor or make batches cheaper (loader.bucket_by_length)"
            )
        }
    } else {
        format!(
            "not data-bound: the step waited for data {data_wait_pct:.2} % of the time with {}",
            crate::counted(workers, "loader worker")
        )
    }
}

/// What the checks look at.
#[derive(Debug)]
pub struct CheckInput<'a> {
    /// The resolved configuration checked.
    pub config: &'a RunConfig,
    /// The machine it would run on.
    pub hardware: &'a HardwareReport,
    /// Whether the run will be on a GPU.
    pub is_gpu: bool,
    /// What the data comes to at this configuration.
    pub data: &'a DataSize,
    /// The memory estimate of one step.
    pub memory: &'a MemoryEstimate,
    /// The run's steps and epochs.
    pub schedule: &'a Schedule,
}

/// The config problems kiln knows, each with its fix.
pub fn check_config(input: &CheckInput<'_>) -> Vec<Finding> {
    let CheckInput {
        config: c,
        hardware,
        is_gpu,
        data,
        memory,
        schedule,
    } = *input;
    let mut out = Vec::new();
    let mut add = |severity, key: &str, problem: String, fix: String| {
        out.push(Finding {
            severity,
            key: key.to_string(),
            problem,
            fix,
        });
    };
    let t = &c.training;
    let block = c.model.max_length;

    // The GPU preset on a machine without its GPU.
    if let Err(mismatch) = kiln_config::check_preset_fits(&c.hardware, hardware) {
        add(
            Severity::Error,
            "hardware",
            mismatch.to_string(),
            "hardware=auto (or --force to run this preset here anyway)".into(),
        );
    }

    // The batch against the dataset.
    let samples = match c.workload {
        Workload::Lm => data.train / block.max(1),
        Workload::Nli => data.train,
    };
    if t.batch_size > samples {
        add(
            Severity::Error,
            "training.batch_size",
            format!(
                "batch {} is larger than the training data: {} {} make {samples} samples",
                t.batch_size, data.train, data.unit
            ),
            format!("training.batch_size={}", samples.max(1)),
        );
    }

    // Sequence length against the data.
    match c.workload {
        Workload::Lm => {
            if data.validation < block + 1 {
                let share = if data.splits_fixed {
                    "the store prepared again (into a new folder) with a larger data.val_fraction: its splits are fixed"
                } else {
                    "a larger data.val_fraction"
                };
                // The block that fits, where one of 2 tokens or more does.
                let fix = match data.validation.checked_sub(1).filter(|&b| b >= 2) {
                    Some(fits) => format!("model.max_length={fits} or {share}"),
                    None => share.to_string(),
                };
                add(
                    Severity::Error,
                    "model.max_length",
                    format!(
                        "block {block} needs {} tokens per window, but the validation split has {}",
                        block + 1,
                        data.validation
                    ),
                    fix,
                );
            }
        }
        Workload::Nli => {
            if data.truncated > 0 && data.truncated * 100 >= data.train + data.validation {
                add(
                    Severity::Warning,
                    "model.max_length",
                    format!(
                        "{} pairs ({:.1} %) are longer than model.max_length={block} (the longest: {} tokens) and lose their end",
                        data.truncated,
                        100.0 * data.truncated as f64
                            / (data.train + data.validation).max(1) as f64,
                        data.longest.unwrap_or(0)
                    ),
                    format!(
                        "model.max_length={} (99 % of pairs fit)",
                        data.p99_length.unwrap_or(block)
                    ),
                );
            }
        }
    }

    for f in check_schedule(c, schedule) {
        add(f.severity, &f.key, f.problem, f.fix);
    }

    // Loader workers against cores.
    let cores = hardware.cpu.logical_cores.max(1);
    if c.loader.num_workers > cores {
        add(
            Severity::Warning,
            "loader.num_workers",
            format!(
                "{} loader workers on {cores} cores: they compete with training for the CPU",
                c.loader.num_workers
            ),
            format!(
                "loader.num_workers={}",
                if is_gpu {
                    cores.saturating_sub(1).max(1)
                } else {
                    1
                }
            ),
        );
    }

    // Precision and compile on the device. The GPU's own limits apply to
    // what a GPU build does on it, even where this build runs on the CPU.
    let gpu = crate::run_gpu(c, hardware);
    if let Some(g) = gpu {
        let caps = g.capabilities;
        if c.precision.amp && c.precision.amp_dtype == AmpDtype::Bf16 && !caps.bf16 {
            add(
                Severity::Warning,
                "precision.amp_dtype",
                format!(
                    "bf16 asked for, but the {} (compute capability {}.{}) has no bf16: kiln falls back to fp16 with loss scaling",
                    g.name, g.compute_capability.0, g.compute_capability.1
                ),
                "precision.amp_dtype=fp16".into(),
            );
        }
        if c.precision.tf32 && !caps.tf32 {
            add(
                Severity::Note,
                "precision.tf32",
                format!(
                    "the {} has no TF32 (Ampere and newer): f32 matmuls stay f32",
                    g.name
                ),
                "precision.tf32=false".into(),
            );
        }
        if !is_gpu && c.device.backend == Backend::Auto {
            add(
                Severity::Warning,
                "device.backend",
                format!(
                    "the {} is present, but this build of kiln has no GPU backend: the run uses the CPU",
                    g.name
                ),
                "rebuild with the GPU backend: cargo build --release -p kiln-cli --features wgpu"
                    .into(),
            );
        }
    } else if c.precision.tf32 {
        add(
            Severity::Note,
            "precision.tf32",
            "TF32 is an NVIDIA Ampere+ feature: nothing changes on the CPU".into(),
            "precision.tf32=false".into(),
        );
    }
    if !is_gpu {
        if c.precision.amp {
            add(
                Severity::Warning,
                "precision.amp",
                format!(
                    "mixed precision ({}) asked for on the CPU, which has no fast bf16/fp16 path: flex converts the products to f32, so the run is slower than in f32",
                    c.precision.amp_dtype.name()
                ),
                "precision.amp=false".into(),
            );
        }
        if c.optimization.compile {
            add(
                Severity::Warning,
                "optimization.compile",
                "compile (fusion and autotuning) is a GPU (CubeCL) feature: not applicable on the CPU backend".into(),
                "optimization.compile=false".into(),
            );
        }
    }
    if matches!(
        c.device.backend,
        Backend::Cuda | Backend::Rocm | Backend::Wgpu
    ) && !is_gpu
    {
        add(
            Severity::Error,
            "device.backend",
            "a GPU backend is asked for, but no GPU will be used".into(),
            "device.backend=auto".into(),
        );
    }

    // Small micro-batches accumulated where memory has room for larger.
    if memory.fits()
        && let Some((micro, bytes)) = larger_micro_batch(c, memory)
    {
        let effective = t.batch_size * t.gradient_accumulation_steps.max(1);
        add(
            Severity::Warning,
            "training.batch_size",
            format!(
                "micro-batches of {} × {block} tokens (model.max_length), {} a step, are small for {}: memory has room for micro-batches of {micro} (about {} estimated of {} {})",
                t.batch_size,
                t.gradient_accumulation_steps,
                if is_gpu {
                    "the GPU"
                } else {
                    "the CPU's matrix products"
                },
                gib(bytes),
                gib(memory.available),
                memory.available_what,
            ),
            format!(
                "training.batch_size={micro} with training.gradient_accumulation_steps={} keeps the effective batch of {effective} (`kiln tune` measures the choice)",
                effective / micro
            ),
        );
    }

    // Memory.
    out.extend(memory_finding(c, memory));
    out.extend(eval_memory_finding(c, memory));
    out
}

/// The error of a step whose estimated memory exceeds what is available,
/// with the batch (and accumulation, keeping the effective batch) that
/// fits: `kiln diagnose`'s finding, and `kiln train`'s refusal on the CPU.
pub fn memory_finding(c: &RunConfig, memory: &MemoryEstimate) -> Option<Finding> {
    if memory.fits() {
        return None;
    }
    let t = &c.training;
    let (fixed, per_sample) = fixed_and_per_sample(memory, t.batch_size);
    let room = (0.9 * memory.available as f64) as u64;
    let fits = (room.saturating_sub(fixed) / per_sample.max(1)) as usize;
    // The largest divisor of the effective batch that fits keeps it exactly.
    let effective = t.batch_size * t.gradient_accumulation_steps.max(1);
    let micro = crate::divisors(effective)
        .into_iter()
        .rev()
        .find(|d| *d <= fits)
        .unwrap_or(1);
    if fixed > room {
        return Some(Finding {
            severity: Severity::Error,
            key: "model".into(),
            problem: format!(
                "the model's {} parameters need about {} (their weights, gradients and AdamW's moments, before any activation) but {} is {}",
                memory.parameters,
                gib(fixed),
                memory.available_what,
                gib(memory.available)
            ),
            fix: "a smaller model: fewer model.layers, a lower model.hidden or model.intermediate"
                .into(),
        });
    }
    let mut fix = format!(
        "training.batch_size={micro} with training.gradient_accumulation_steps={} keeps the effective batch of {effective}",
        effective / micro
    );
    if fits == 0 {
        fix = "lower model.max_length, or model.gradient_checkpointing=true".into();
    } else if !c.model.gradient_checkpointing {
        fix.push_str("; or model.gradient_checkpointing=true");
    }
    Some(Finding {
        severity: Severity::Error,
        key: "training.batch_size".into(),
        problem: format!(
            "the step needs about {} (estimate) but {} is {}",
            gib(memory.total),
            memory.available_what,
            gib(memory.available)
        ),
        fix,
    })
}

/// The error of an evaluation pass (at `eval.batch_size`) whose estimated
/// memory exceeds what is available, with the evaluation batch that fits.
pub fn eval_memory_finding(c: &RunConfig, memory: &MemoryEstimate) -> Option<Finding> {
    if memory.eval_fits() {
        return None;
    }
    let room = (0.9 * memory.available as f64) as u64;
    let fixed = memory.weights + memory.optimizer;
    let per_sample = memory.eval.saturating_sub(fixed) / c.eval.batch_size.max(1) as u64;
    let fits = (room.saturating_sub(fixed) / per_sample.max(1)).max(1);
    Some(Finding {
        severity: Severity::Error,
        key: "eval.batch_size".into(),
        problem: format!(
            "an evaluation pass of {} needs about {} (estimate) but {} is {}",
            crate::counted(c.eval.batch_size, "sequence"),
            gib(memory.eval),
            memory.available_what,
            gib(memory.available)
        ),
        fix: format!("eval.batch_size={}", fits.min(c.eval.batch_size as u64)),
    })
}

/// Tokens in a micro-batch (`batch_size × model.max_length`) below which
/// accumulating several of them leaves the matrix products too small to
/// keep the cores busy. Measured on the encoder on 2 cores (the same 16
/// pairs a step, padded to 128): 2 × 8 171–177 samples/s, 4 × 4 221–228,
/// 8 × 2 245–248, 16 × 1 247–249 (docs/PERFORMANCE.md, "The `cpu`
/// preset's encoder batch"); a GPU's products want more still.
pub const SMALL_MICRO_BATCH_TOKENS: usize = 1024;

/// Where the config accumulates micro-batches of fewer than
/// [`SMALL_MICRO_BATCH_TOKENS`] tokens and memory has room for larger ones
/// (the estimate within half of what is available): the smallest divisor
/// of the effective batch that reaches that many tokens (or the whole
/// effective batch), and the step's estimated memory with it.
fn larger_micro_batch(c: &RunConfig, memory: &MemoryEstimate) -> Option<(usize, u64)> {
    let t = &c.training;
    let len = c.model.max_length.max(1);
    if t.gradient_accumulation_steps <= 1 || t.batch_size * len >= SMALL_MICRO_BATCH_TOKENS {
        return None;
    }
    let effective = t.batch_size * t.gradient_accumulation_steps;
    let micro = crate::divisors(effective)
        .into_iter()
        .find(|d| d * len >= SMALL_MICRO_BATCH_TOKENS)
        .unwrap_or(effective);
    let (fixed, per_sample) = fixed_and_per_sample(memory, t.batch_size);
    let bytes = fixed + per_sample * micro as u64;
    (micro > t.batch_size && bytes <= memory.available / 2).then_some((micro, bytes))
}

/// The estimate's bytes that do not grow with the micro-batch (weights,
/// gradients, AdamW's moments) and those each of its `batch` samples adds.
fn fixed_and_per_sample(memory: &MemoryEstimate, batch: usize) -> (u64, u64) {
    let fixed = memory.weights + memory.gradients + memory.optimizer;
    let per_sample = memory.total.saturating_sub(fixed) / batch.max(1) as u64;
    (fixed, per_sample)
}

/// The checks of the step budget against evaluation, logging, checkpoints
/// and the warm-up: what `kiln train` warns of as it starts, and part of
/// [`check_config`]. A pure function of the config and the run's schedule.
pub fn check_schedule(c: &RunConfig, schedule: &Schedule) -> Vec<Finding> {
    let total_steps = schedule.total_steps as usize;
    // The sentence-pair classifier also evaluates at each epoch's end, so
    // its interval matters only in a run of one epoch or less.
    let epoch_ends = c.workload == Workload::Nli && schedule.epochs() > 1.0;
    // (whether it applies, value, key, severity, what follows, the fix as
    // a fraction of the run).
    let cadences = [
        (
            !epoch_ends,
            c.eval.eval_steps,
            "eval.eval_steps",
            Severity::Warning,
            "no evaluation before the end",
            4,
        ),
        (
            true,
            c.logging.logging_steps,
            "logging.logging_steps",
            Severity::Note,
            "only its first and last steps are logged",
            20,
        ),
        (
            true,
            c.checkpoint.every_steps,
            "checkpoint.every_steps",
            Severity::Note,
            "only the final checkpoint is written, so a crash loses the run",
            4,
        ),
    ];
    let mut out = Vec::new();
    for (applies, value, key, severity, consequence, part) in cadences {
        if applies && value > total_steps {
            out.push(Finding {
                severity,
                key: key.to_string(),
                problem: format!(
                    "{key}={value} is beyond the run's {total_steps} steps: {consequence}"
                ),
                fix: format!("{key}={}", (total_steps / part).max(1)),
            });
        }
    }
    if schedule.warmup_steps >= total_steps as u64 {
        let (key, problem, fix) = match c.training.warmup_ratio {
            ratio if ratio > 0.0 => (
                "training.warmup_ratio",
                format!(
                    "training.warmup_ratio={ratio} warms up for {} of the run's {total_steps} steps: the learning rate never reaches training.learning_rate",
                    schedule.warmup_steps
                ),
                format!(
                    "training.warmup_ratio=0 with training.warmup_steps={}",
                    total_steps / 10
                ),
            ),
            _ => (
                "training.warmup_steps",
                format!(
                    "training.warmup_steps={} is not below the run's {total_steps} steps: the learning rate never reaches training.learning_rate",
                    c.training.warmup_steps
                ),
                format!("training.warmup_steps={}", total_steps / 10),
            ),
        };
        out.push(Finding {
            severity: Severity::Warning,
            key: key.into(),
            problem,
            fix,
        });
    }
    out
}

/// Bytes in GiB (or MiB below one GiB), for messages.
pub fn gib(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= f64::from(1u32 << 30) {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else {
        format!("{:.0} MiB", b / f64::from(1u32 << 20))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::config;
    use crate::{ModelSize, estimate_memory};

    /// The micro-batch [`larger_micro_batch`] raises the encoder's to with
    /// `available` bytes, for `batch × accumulation` (or the preset's).
    fn raised(batch: Option<(usize, usize)>, available: u64) -> Option<usize> {
        let mut overrides = vec!["experiment=nli_snli".to_string()];
        if let Some((b, a)) = batch {
            overrides.push(format!("training.batch_size={b}"));
            overrides.push(format!("training.gradient_accumulation_steps={a}"));
        }
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let c = config(&refs);
        let size = ModelSize {
            parameters: 5_000_000,
            trainable: 5_000_000,
        };
        let mut memory = estimate_memory(&c, 8000, size);
        memory.available = available;
        larger_micro_batch(&c, &memory).map(|(micro, _)| micro)
    }

    #[test]
    fn small_accumulated_micro_batches_are_raised_where_memory_has_room() {
        let ample = 24 << 30;
        // Pairs of 128 tokens: 8 of them are the 1,024 tokens, the fewest
        // that divide the effective batch of 16.
        assert_eq!(raised(Some((2, 8)), ample), Some(8));
        assert_eq!(raised(Some((4, 4)), ample), Some(8));
        // The `cpu` preset's 8 × 2 and no accumulation are left alone.
        assert_eq!(raised(None, ample), None);
        assert_eq!(raised(Some((8, 2)), ample), None);
        assert_eq!(raised(Some((2, 1)), ample), None);
        // No divisor of 2 × 3 reaches 1,024 tokens: the whole batch.
        assert_eq!(raised(Some((2, 3)), ample), Some(6));
        // Without room (the estimate above half of what is available).
        assert_eq!(raised(Some((2, 8)), 64 << 20), None);
    }

    #[test]
    fn an_evaluation_batch_too_large_gets_one_that_fits() {
        let size = ModelSize {
            parameters: 800_000,
            trainable: 800_000,
        };
        let estimate = |eval_batch: &str| {
            let c = config(&[eval_batch]);
            let mut m = estimate_memory(&c, 65, size);
            m.available = 1 << 30;
            (c, m)
        };
        let (c, m) = estimate("eval.batch_size=12");
        assert!(m.eval < m.total, "{} {}", m.eval, m.total);
        assert_eq!(eval_memory_finding(&c, &m), None);
        let (c, m) = estimate("eval.batch_size=100000");
        let f = eval_memory_finding(&c, &m).expect("over");
        assert_eq!(f.key, "eval.batch_size");
        let fits: usize = f.fix["eval.batch_size=".len()..].parse().expect("a batch");
        assert!((1..100_000).contains(&fits), "{}", f.fix);
        let (c, m) = estimate(&format!("eval.batch_size={fits}"));
        assert!(m.eval_fits(), "{} of {}", m.eval, m.available);
        assert_eq!(eval_memory_finding(&c, &m), None);
        let (_, m) = estimate(&format!("eval.batch_size={}", fits + 2));
        assert!(!m.eval_fits(), "{fits} is not the largest that fits");
    }
}
