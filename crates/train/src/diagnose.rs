//! `kiln diagnose`: the guides' pre-flight script, measured. The workload
//! is prepared as the run prepares it (the first fold for
//! cross-validation); kiln-plan checks it against the config and the
//! machine and estimates memory; a short burst of the run's own training
//! step gives the time per epoch and the loader's verdict.

use kiln_config::{RunConfig, Workload};
use kiln_data::{Tokenizer, encode_dataset};
use kiln_hwdetect::HardwareReport;
use kiln_plan::{
    AttentionMemory, Burst, CheckInput, DataSize, Finding, LogitsMemory, MemoryEstimate, ModelSize,
    Schedule, Severity, check_config, estimate_memory_with, run_gpu,
};
use serde::Serialize;

use crate::bench::{BenchOptions, bench_lm, bench_nli};
use crate::setup::{kept_memory, run_precision};
use crate::workload::{lm, nli};
use crate::{TrainError, select_device};

/// Everything `kiln diagnose` found.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Diagnosis {
    /// The device the run would train on ("cuda (GPU 0)", "flex (CPU)").
    pub device: String,
    /// Why that device.
    pub device_why: String,
    /// What the run would compute in ("bf16 compute, f32 master weights", "f32").
    pub precision: String,
    /// Why that precision.
    pub precision_why: String,
    /// The training data: rows or tokens, batches per epoch.
    pub data: DataSize,
    /// Optimizer steps per pass over the training data (a fraction where
    /// the accumulation does not divide the batches).
    pub steps_per_epoch: f64,
    /// Optimizer steps the run makes (for cross-validation: per fold).
    pub total_steps: u64,
    /// Passes over the training data the step budget makes.
    pub epochs: f64,
    /// The memory the run would need, by part, against what the device has.
    pub memory: MemoryEstimate,
    /// What holds the run back, worst first.
    pub findings: Vec<Finding>,
    /// A short measured burst of training steps, when asked for.
    pub burst: Option<Burst>,
    /// Training from a token store: its read rate against the run's need.
    pub store: Option<crate::tokens::StoreRead>,
    /// With several data-parallel ranks: the gradients' all-reduce per
    /// step over each link (the ring's model, docs/DISTRIBUTED.md).
    pub reduction: Option<kiln_plan::ReductionEstimate>,
}

impl Diagnosis {
    /// Whether a finding means the run would fail or waste itself.
    pub fn has_errors(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }
}

/// Measures the dataset, estimates memory, checks the config and, with
/// `burst_steps > 0`, times that many training steps; with `ranks > 1`,
/// estimates the gradients' all-reduce of a data-parallel job against the
/// measured step.
pub fn diagnose(
    config: &RunConfig,
    hardware: &HardwareReport,
    burst_steps: usize,
    ranks: usize,
) -> Result<Diagnosis, TrainError> {
    let gpu = run_gpu(config, hardware);
    let device = select_device(&config.device, hardware.gpu_vendor());
    let (device_name, device_why, is_gpu, backend_error) = match &device {
        Ok(d) => (d.name.clone(), d.why.clone(), d.is_gpu, None),
        Err(e) => (
            "none".to_string(),
            e.to_string(),
            false,
            Some(e.to_string()),
        ),
    };
    let (precision, precision_why, attention, logits) = match &device {
        Ok(d) => {
            let p = run_precision(config, d, hardware);
            let (attention, logits) = kept_memory(config, d, p.compute);
            (p.label, p.why, attention, logits)
        }
        Err(_) => (
            "f32".to_string(),
            "no device".to_string(),
            AttentionMemory::Scores,
            LogitsMemory::All,
        ),
    };
    let Measured {
        data,
        schedule,
        vocab,
        size,
        store,
        init_from,
    } = measure(config, ranks)?;
    let mut memory = estimate_memory_with(config, vocab, size, attention, logits);
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
    let unsharded = memory.clone();
    let sharded = memory.clone().sharded(ranks);
    if ranks > 1 && config.optimization.zero_stage >= 1 {
        memory = sharded.clone();
    }
    let mut findings = check_config(&CheckInput {
        config,
        hardware,
        is_gpu,
        data: &data,
        memory: &memory,
        schedule: &schedule,
    });
    if ranks > 1 && config.optimization.zero_stage == 0 && !unsharded.fits() && sharded.fits() {
        findings.push(Finding {
            severity: Severity::Warning,
            key: "optimization.zero_stage".into(),
            problem: format!(
                "each of the {ranks} ranks would keep all of AdamW's moments ({}); split between them (ZeRO), a rank's step needs about {} of its {}",
                kiln_plan::gib(unsharded.optimizer),
                kiln_plan::gib(sharded.total),
                kiln_plan::gib(sharded.available)
            ),
            fix: "optimization.zero_stage=2 (the gradients reduce-scattered and the weights all-gathered: DDP's bytes a step; or 1, an all-reduce and the all-gather)".into(),
        });
    }
    findings.extend(init_from);
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
        _ => Some(measure_burst(config, hardware, burst_steps, &schedule)?),
    };
    let store = match store {
        Some(mut read) => {
            if let Some(b) = &burst {
                // Each micro-batch reads its windows (block + 1 tokens a row).
                let t = &config.training;
                let bytes = (t.batch_size
                    * (config.model.max_length + 1)
                    * t.gradient_accumulation_steps
                    * read.bytes_per_token) as f64;
                let needed = bytes / (b.ms_per_step / 1e3).max(1e-9) / 1e6;
                read.needed_mb_per_s = Some(needed);
                if needed > 0.5 * read.disk_mb_per_s {
                    findings.push(Finding {
                        severity: Severity::Warning,
                        key: "data.path".into(),
                        problem: format!(
                            "the run reads {needed:.1} MB/s of windows from the token store, and its disk gave {:.1} MB/s just now: reading may hold training back",
                            read.disk_mb_per_s
                        ),
                        fix: "put the store on a local SSD, or raise loader.num_workers".into(),
                    });
                }
            }
            Some(read)
        }
        None => None,
    };
    let reduction = kiln_plan::ReductionEstimate::new(
        memory.parameters,
        ranks,
        config.precision.reduce_dtype,
        config.optimization.zero_stage,
    );
    if let (Some(r), Some(b)) = (&reduction, &burst)
        && let Some(f) = r.finding(b.ms_per_step)
    {
        findings.push(f);
    }
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    Ok(Diagnosis {
        reduction,
        store,
        device: device_name,
        device_why,
        precision,
        precision_why,
        data,
        steps_per_epoch: schedule.steps_per_epoch(),
        total_steps: schedule.total_steps,
        epochs: schedule.epochs(),
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

/// `steps` optimizer steps of the run's own step, timed by `kiln bench`.
fn measure_burst(
    config: &RunConfig,
    hardware: &HardwareReport,
    steps: usize,
    schedule: &Schedule,
) -> Result<Burst, TrainError> {
    let options = BenchOptions {
        warmup: 2,
        steps,
        min_seconds: 0.0,
        pad_to_max_length: false,
        kernel_profile_steps: 0,
    };
    let r = match config.workload {
        Workload::Lm => bench_lm(config, hardware, options)?,
        Workload::Nli => bench_nli(config, hardware, options)?,
    };
    Ok(Burst::new(
        steps,
        r.ms_per_step_median,
        r.data_wait_pct,
        r.peak_memory_bytes,
        schedule,
        config.loader.num_workers,
        hardware.cpu.logical_cores,
    ))
}

/// What [`measure`] found of the workload.
struct Measured {
    data: DataSize,
    schedule: Schedule,
    vocab: usize,
    size: ModelSize,
    store: Option<crate::tokens::StoreRead>,
    /// Why the weights `model.init_from` names cannot start the run.
    init_from: Option<Finding>,
}

/// Prepares the workload as the run does and measures it: the data against
/// the config, the run's schedule, the vocabulary, the model's size, from
/// a token store its read rate, and the weights `model.init_from` names
/// against the run (everything but their values, which the run reads): a
/// mismatch is a finding, so that the rest is still diagnosed. A
/// cross-validation's schedule is that of a job of `ranks` (each fold's
/// batches shared by them).
fn measure(config: &RunConfig, ranks: usize) -> Result<Measured, TrainError> {
    match config.workload {
        Workload::Lm => {
            let p = lm::prepare(config, lm::TokenizerFrom::Config)?;
            let init_from = match crate::pretrained::open(config, &p.tokenizer) {
                Ok(_) => None,
                Err(e) => Some(init_from_finding(e)?),
            };
            Ok(Measured {
                data: p.data_size(config),
                schedule: p.schedule,
                vocab: p.tokenizer.vocab_size(),
                size: p.model_size(),
                store: match &p.store {
                    Some(store) => {
                        crate::tokens::measure_store_read(store, config.model.max_length)?
                    }
                    None => None,
                },
                init_from,
            })
        }
        Workload::Nli => {
            let pairs = nli::read(config)?;
            // Weights that do not fit are a finding; the rest is measured
            // as a run from random weights would be.
            let (bert, init_from) = match crate::pretrained::bert::open(config) {
                Ok(bert) => (bert, None),
                Err(e) => (None, Some(init_from_finding(e)?)),
            };
            let mut usable = config.clone();
            if init_from.is_some() {
                usable.model.init_from = None;
            }
            // A job's folds step through the global batch of every rank's
            // pairs: its schedule is the job's.
            let p = nli::prepare(&usable, &pairs, 0, None, (0, ranks.max(1)))?;
            let data = &pairs.data;
            // Lengths before truncation: a vocabulary without a length limit.
            let texts = || {
                data.pairs
                    .iter()
                    .flat_map(|p| [p.premise.as_str(), p.hypothesis.as_str()])
            };
            let untruncated = match bert {
                Some(bert) => {
                    let mut tokenizer = bert.tokenizer;
                    tokenizer.set_pair_template(1 << 20)?;
                    tokenizer
                }
                None => Tokenizer::wordpiece(texts(), config.data.vocab_size, 1 << 20)?,
            };
            let mut lengths: Vec<usize> = encode_dataset(&untruncated, data)?
                .iter()
                .map(|p| p.ids.len())
                .collect();
            lengths.sort_unstable();
            let n = lengths.len();
            let max_len = config.model.max_length;
            let size = DataSize {
                unit: "pairs".into(),
                train: p.train_pairs,
                validation: p.held_out_pairs,
                samples_per_epoch: p.train_pairs,
                longest: lengths.last().copied(),
                truncated: lengths.iter().filter(|l| **l > max_len).count(),
                p99_length: lengths.get((n.saturating_sub(1)) * 99 / 100).copied(),
                splits_fixed: false,
            };
            Ok(Measured {
                data: size,
                schedule: p.schedule,
                vocab: p.tokenizer.vocab_size(),
                size: p.model_size(config),
                store: None,
                init_from,
            })
        }
    }
}

/// A `model.init_from` folder that cannot start the run, as a finding;
/// any other error stays one.
fn init_from_finding(e: TrainError) -> Result<Finding, TrainError> {
    match e {
        TrainError::Pretrained { path, why } => Ok(Finding {
            severity: Severity::Error,
            key: "model.init_from".into(),
            problem: format!("`{}` {why}", path.display()),
            fix: "set the run's keys to the weights' as the problem says, or name another folder (model.init_from=none: random weights)".into(),
        }),
        other => Err(other),
    }
}
