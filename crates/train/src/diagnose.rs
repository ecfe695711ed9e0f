//! `kiln diagnose`: the guides' pre-flight script, measured. Which device
//! and backend; the dataset against the config; config problems, each with
//! its fix; a memory estimate against what the device has; and, from a short
//! measured burst of training steps, the time per epoch and the loader's
//! verdict.
//!
//! The checks are a pure function of the config, the machine and the
//! dataset's size ([`check_config`]), so each can be tested without data.

use std::path::Path;

use kiln_config::{AmpDtype, Backend, RunConfig, Workload};
use kiln_data::{Tokenizer, encode_cached, encode_dataset, read_corpus, read_pairs};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::bench::{BenchOptions, bench_lm, bench_nli};
use crate::lm::{gpt_config, make_tokenizer, run_gpu, run_precision};
use crate::nli::{encoder_config, schema};
use crate::{TrainError, select_device};

/// How bad a finding is: an `Error` makes the run fail or waste itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Note,
    Warning,
    Error,
}

/// One problem with the configuration on this machine and this data.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// The key to change.
    pub key: String,
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
    pub truncated: usize,
    /// Pairs only: the 99th percentile of pair length in tokens.
    pub p99_length: Option<usize>,
}

/// Memory a training step needs, in bytes (f32 everywhere).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoryEstimate {
    pub parameters: usize,
    pub weights: u64,
    pub gradients: u64,
    /// AdamW's two moments.
    pub optimizer: u64,
    /// Activations kept for backward, without gradient checkpointing...
    pub activations: u64,
    /// ...of which attention's scores and probabilities (the T² term).
    pub attention: u64,
    /// Activations with gradient checkpointing (layer inputs, one layer recomputed).
    pub activations_checkpointed: u64,
    /// Weights + gradients + optimizer + activations as configured.
    pub total: u64,
    /// What the device has: free GPU memory, or available RAM.
    pub available: u64,
    pub available_what: String,
}

/// What a short measured burst of training steps showed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Burst {
    pub steps: usize,
    pub ms_per_step: f64,
    pub data_wait_pct: f64,
    pub peak_memory_bytes: u64,
    /// Optimizer steps per epoch and the time they take.
    pub seconds_per_epoch: f64,
    /// The whole run as configured (training steps; evaluation not included).
    pub seconds_total: f64,
    pub loader_verdict: String,
}

/// Everything `kiln diagnose` found.
#[derive(Clone, Debug, Serialize)]
pub struct Diagnosis {
    pub device: String,
    pub device_why: String,
    pub precision: String,
    pub precision_why: String,
    pub data: DataSize,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
    /// Passes over the training data the step budget makes.
    pub epochs: f64,
    pub memory: MemoryEstimate,
    pub findings: Vec<Finding>,
    pub burst: Option<Burst>,
}

impl Diagnosis {
    /// Whether a finding means the run would fail or waste itself.
    pub fn has_errors(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }
}

/// Measures the dataset, estimates memory, checks the config and, with
/// `burst_steps > 0`, times that many training steps.
pub fn diagnose(
    config: &RunConfig,
    hardware: &HardwareReport,
    burst_steps: usize,
) -> Result<Diagnosis, TrainError> {
    let gpu = run_gpu(config, hardware);
    let device = select_device(&config.device, gpu.is_some());
    let (device_name, device_why, is_gpu, backend_error) = match &device {
        Ok(d) => (d.name.clone(), d.why.clone(), d.is_gpu, None),
        Err(e) => (
            "none".to_string(),
            e.to_string(),
            false,
            Some(e.to_string()),
        ),
    };
    let (precision, precision_why) = match &device {
        Ok(d) => {
            let p = run_precision(config, d, hardware);
            (p.label, p.why)
        }
        Err(_) => ("f32".to_string(), "no device".to_string()),
    };
    let (data, vocab) = data_size(config)?;
    let mut memory = estimate_memory(config, vocab);
    match gpu.filter(|_| is_gpu) {
        Some(g) => {
            memory.available = g.memory_free_bytes;
            memory.available_what = format!("free memory of GPU {} ({})", g.index, g.name);
        }
        None => {
            memory.available = hardware.memory.available_bytes;
            memory.available_what = "available RAM".to_string();
        }
    }
    let (steps_per_epoch, total_steps, epochs) = budget(config, &data);
    let mut findings = check_config(&CheckInput {
        config,
        hardware,
        is_gpu,
        data: &data,
        memory: &memory,
        total_steps,
    });
    if let Some(why) = backend_error {
        findings.insert(
            0,
            Finding {
                severity: Severity::Error,
                key: "device.backend".into(),
                problem: why,
                fix: "device.backend=auto".into(),
            },
        );
    }
    let burst = match (burst_steps, device.is_ok(), findings_block_burst(&findings)) {
        (0, _, _) | (_, false, _) | (_, _, true) => None,
        _ => Some(measure_burst(
            config,
            hardware,
            burst_steps,
            steps_per_epoch,
            total_steps,
        )?),
    };
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    Ok(Diagnosis {
        device: device_name,
        device_why,
        precision,
        precision_why,
        data,
        steps_per_epoch,
        total_steps,
        epochs,
        memory,
        findings,
        burst,
    })
}

/// A burst is not attempted where it could not run or would exhaust memory.
fn findings_block_burst(findings: &[Finding]) -> bool {
    findings.iter().any(|f| {
        f.severity == Severity::Error
            && (f.key == "training.batch_size" || f.key == "model.max_length")
    })
}

fn measure_burst(
    config: &RunConfig,
    hardware: &HardwareReport,
    steps: usize,
    steps_per_epoch: usize,
    total_steps: usize,
) -> Result<Burst, TrainError> {
    let options = BenchOptions {
        warmup: 2,
        steps,
        min_seconds: 0.0,
        pad_to_max_length: false,
    };
    let r = match config.workload {
        Workload::Lm => bench_lm(config, hardware, options)?,
        Workload::Nli => bench_nli(config, hardware, options)?,
    };
    let accum = config.training.gradient_accumulation_steps.max(1) as f64;
    let per_optimizer_step = r.ms_per_step_median * accum / 1e3;
    Ok(Burst {
        steps,
        ms_per_step: r.ms_per_step_median,
        data_wait_pct: r.data_wait_pct,
        peak_memory_bytes: r.peak_memory_bytes,
        seconds_per_epoch: per_optimizer_step * steps_per_epoch as f64,
        seconds_total: per_optimizer_step * total_steps as f64,
        loader_verdict: loader_verdict(
            r.data_wait_pct,
            config.loader.num_workers,
            hardware.cpu.logical_cores,
        ),
    })
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
            "not data-bound: the step waited for data {data_wait_pct:.2} % of the time with {workers} loader worker(s)"
        )
    }
}

/// Optimizer steps per epoch, steps the run makes, and the epochs that is.
fn budget(config: &RunConfig, data: &DataSize) -> (usize, usize, f64) {
    let t = &config.training;
    let per_step = t.batch_size * t.gradient_accumulation_steps.max(1);
    let steps_per_epoch = (data.samples_per_epoch / per_step.max(1)).max(1);
    let total = if t.max_steps > 0 {
        t.max_steps
    } else {
        steps_per_epoch * t.epochs
    };
    let epochs = total as f64 * per_step as f64 / data.samples_per_epoch.max(1) as f64;
    (steps_per_epoch, total, epochs)
}

/// Reads the data as the run will and measures it; also returns the
/// vocabulary size the model will have.
fn data_size(config: &RunConfig) -> Result<(DataSize, usize), TrainError> {
    match config.workload {
        Workload::Lm => {
            let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
            let tokenizer = make_tokenizer(config, &corpus.text)?;
            let (ids, _) = encode_cached(&tokenizer, &corpus, Path::new(&config.data.cache_dir))?;
            let train = ((ids.len() as f64) * (1.0 - config.data.val_fraction)) as usize;
            Ok((
                DataSize {
                    unit: "tokens".into(),
                    train,
                    validation: ids.len() - train,
                    samples_per_epoch: train / config.model.max_length.max(1),
                    ..DataSize::default()
                },
                tokenizer.vocab_size(),
            ))
        }
        Workload::Nli => {
            let data = read_pairs(Path::new(&config.data.path), &schema(config, true))?;
            // Lengths before truncation: a vocabulary without a length limit.
            let texts = || {
                data.pairs
                    .iter()
                    .flat_map(|p| [p.premise.as_str(), p.hypothesis.as_str()])
            };
            let untruncated = Tokenizer::wordpiece(texts(), config.data.vocab_size, 1 << 20)?;
            let mut lengths: Vec<usize> = encode_dataset(&untruncated, &data)?
                .iter()
                .map(|p| p.ids.len())
                .collect();
            lengths.sort_unstable();
            let vocab = untruncated.vocab_size();
            let n = lengths.len();
            let k = config.cv.folds.max(2);
            let train = n * (k - 1) / k;
            let max_len = config.model.max_length;
            Ok((
                DataSize {
                    unit: "pairs".into(),
                    train,
                    validation: n - train,
                    samples_per_epoch: train,
                    longest: lengths.last().copied(),
                    truncated: lengths.iter().filter(|l| **l > max_len).count(),
                    p99_length: lengths.get((n.saturating_sub(1)) * 99 / 100).copied(),
                },
                vocab,
            ))
        }
    }
}

/// Bytes of f32.
const F32: u64 = 4;

/// Memory of a training step at the configured micro-batch. Activations are
/// counted as Burn's autodiff keeps them for these models, per token and
/// layer: about 16·hidden + 4·intermediate floats (inputs of the linear
/// layers, LayerNorm and GELU intermediates, the residual stream) plus
/// 3·heads·T for attention (scores, mask, probabilities); and per token at
/// the output, 2·vocab for the language model's logits and their softmax.
/// With gradient checkpointing a layer keeps only its input and one layer's
/// activations exist at a time.
pub fn estimate_memory(config: &RunConfig, vocab: usize) -> MemoryEstimate {
    let m = &config.model;
    let (b, s) = (config.training.batch_size as u64, m.max_length as u64);
    let (h, i, a, l) = (
        m.hidden as u64,
        m.intermediate as u64,
        m.heads as u64,
        m.layers as u64,
    );
    let parameters = match config.workload {
        Workload::Lm => gpt_config(config, vocab).num_params(),
        Workload::Nli => encoder_config(config, vocab).num_params(),
    };
    let p = parameters as u64;
    let tokens = b * s;
    let attention_layer = 3 * a * s * tokens * F32;
    let layer = (16 * h + 4 * i) * tokens * F32 + attention_layer;
    let output = match config.workload {
        Workload::Lm => 2 * vocab as u64 * tokens * F32,
        Workload::Nli => 2 * h * b * F32,
    };
    let embed = 3 * h * tokens * F32;
    let activations = l * layer + output + embed;
    let checkpointed = l * h * tokens * F32 + layer + output + embed;
    let trainable = if m.freeze_encoder && config.workload == Workload::Nli {
        encoder_config(config, vocab).head_params() as u64
    } else {
        p
    };
    let weights = p * F32;
    let gradients = trainable * F32;
    let optimizer = 2 * trainable * F32;
    let kept = if m.gradient_checkpointing {
        checkpointed
    } else {
        activations
    };
    MemoryEstimate {
        parameters,
        weights,
        gradients,
        optimizer,
        activations,
        attention: l * attention_layer,
        activations_checkpointed: checkpointed,
        total: weights + gradients + optimizer + kept,
        available: 0,
        available_what: String::new(),
    }
}

/// What the checks look at.
#[derive(Debug)]
pub struct CheckInput<'a> {
    pub config: &'a RunConfig,
    pub hardware: &'a HardwareReport,
    /// Whether the run will be on a GPU.
    pub is_gpu: bool,
    pub data: &'a DataSize,
    pub memory: &'a MemoryEstimate,
    pub total_steps: usize,
}

/// The config problems kiln knows, each with its fix.
pub fn check_config(input: &CheckInput<'_>) -> Vec<Finding> {
    let CheckInput {
        config: c,
        hardware,
        is_gpu,
        data,
        memory,
        total_steps,
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
    if let Err(msg) = kiln_config::check_preset_fits(&c.hardware, hardware) {
        add(
            Severity::Error,
            "hardware",
            msg,
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
                add(
                    Severity::Error,
                    "model.max_length",
                    format!(
                        "block {block} needs {} tokens per window, but the validation split has {}",
                        block + 1,
                        data.validation
                    ),
                    format!(
                        "model.max_length={} or a larger data.val_fraction",
                        data.validation.saturating_sub(1).max(1)
                    ),
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

    // Step budget against evaluation, logging, checkpoints and warm-up:
    // (value, key, severity, what follows, the fix as a fraction of the run).
    let cadences = [
        (
            c.eval.eval_steps,
            "eval.eval_steps",
            Severity::Warning,
            "no evaluation before the end",
            4,
        ),
        (
            c.logging.logging_steps,
            "logging.logging_steps",
            Severity::Warning,
            "nothing is logged",
            20,
        ),
        (
            c.checkpoint.every_steps,
            "checkpoint.every_steps",
            Severity::Note,
            "only the final checkpoint is written, so a crash loses the run",
            4,
        ),
    ];
    for (value, key, severity, consequence, part) in cadences {
        if value > total_steps {
            add(
                severity,
                key,
                format!("{key}={value} is beyond the run's {total_steps} steps: {consequence}"),
                format!("{key}={}", (total_steps / part).max(1)),
            );
        }
    }
    if t.warmup_steps >= total_steps {
        add(
            Severity::Warning,
            "training.warmup_steps",
            format!(
                "training.warmup_steps={} is not below the run's {total_steps} steps: the learning rate never reaches training.learning_rate",
                t.warmup_steps
            ),
            format!("training.warmup_steps={}", total_steps / 10),
        );
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
    let gpu = hardware
        .gpus()
        .iter()
        .find(|g| g.index as usize == c.device.index)
        .or(hardware.gpus().first());
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
    if matches!(c.device.backend, Backend::Cuda | Backend::Wgpu) && !is_gpu {
        add(
            Severity::Error,
            "device.backend",
            "a GPU backend is asked for, but no GPU will be used".into(),
            "device.backend=auto".into(),
        );
    }

    // Memory.
    if memory.available > 0 && memory.total as f64 > 0.9 * memory.available as f64 {
        let per_sample = (memory.total - memory.weights - memory.gradients - memory.optimizer)
            / t.batch_size.max(1) as u64;
        let room = (0.9 * memory.available as f64) as u64;
        let fixed = memory.weights + memory.gradients + memory.optimizer;
        let fits = (room.saturating_sub(fixed) / per_sample.max(1)) as usize;
        // The largest divisor of the effective batch that fits keeps it exactly.
        let effective = t.batch_size * t.gradient_accumulation_steps.max(1);
        let micro = crate::tune::divisors(effective)
            .into_iter()
            .rev()
            .find(|d| *d <= fits)
            .unwrap_or(1);
        let mut fix = format!(
            "training.batch_size={micro} with training.gradient_accumulation_steps={} keeps the effective batch of {effective}",
            effective / micro
        );
        if fits == 0 {
            fix = "lower model.max_length, or model.gradient_checkpointing=true".into();
        } else if !c.model.gradient_checkpointing {
            fix.push_str("; or model.gradient_checkpointing=true");
        }
        add(
            Severity::Error,
            "training.batch_size",
            format!(
                "the step needs about {} (estimate) but {} is {}",
                gib(memory.total),
                memory.available_what,
                gib(memory.available)
            ),
            fix,
        );
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
pub(crate) mod tests {
    use super::*;

    /// The configuration the shipped presets resolve to on a machine without
    /// a GPU, with `overrides`.
    pub(crate) fn config(overrides: &[&str]) -> RunConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../presets");
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let report = kiln_hwdetect::detect_with(&kiln_hwdetect::FixedProbe(
            kiln_hwdetect::GpuStatus::None { why: String::new() },
            kiln_hwdetect::DriverInfo::default(),
        ));
        kiln_config::resolve(&kiln_config::LoadOptions {
            presets_dir: &dir,
            config_file: None,
            overrides: &overrides,
            env: &[],
            hardware: &report,
        })
        .expect("resolves")
        .config
    }

    #[test]
    fn memory_estimate_grows_as_the_shapes_say() {
        let base = estimate_memory(&config(&[]), 65);
        let twice_batch = estimate_memory(&config(&["training.batch_size=24"]), 65);
        let twice_len = estimate_memory(&config(&["model.max_length=128"]), 65);
        // Activations are linear in the batch; attention is quadratic in T.
        assert_eq!(twice_batch.activations, 2 * base.activations);
        assert_eq!(twice_len.attention, 4 * base.attention);
        assert_eq!(twice_batch.weights, base.weights);
        // Weights, gradients and AdamW: 4 + 4 + 8 bytes per parameter.
        assert_eq!(base.weights, 4 * base.parameters as u64);
        assert_eq!(base.optimizer, 2 * base.gradients);
        assert!(base.activations_checkpointed < base.activations);
        let ckpt = estimate_memory(&config(&["model.gradient_checkpointing=true"]), 65);
        assert_eq!(
            ckpt.total,
            base.total - base.activations + base.activations_checkpointed
        );
        // A frozen encoder keeps gradients and moments for the head only.
        let nli = estimate_memory(&config(&["experiment=nli_snli"]), 8000);
        let frozen = estimate_memory(
            &config(&["experiment=nli_snli", "model.freeze_encoder=true"]),
            8000,
        );
        assert!(frozen.gradients * 100 < nli.gradients);
    }

    #[test]
    fn loader_verdicts_name_the_fix() {
        assert!(loader_verdict(0.1, 1, 2).starts_with("not data-bound"));
        assert!(loader_verdict(12.0, 1, 8).contains("raise loader.num_workers to 2"));
        assert!(loader_verdict(12.0, 2, 2).contains("prefetch_factor"));
    }
}
