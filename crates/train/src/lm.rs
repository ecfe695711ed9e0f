//! Training the GPT language model: data, model, the loop, evaluation,
//! checkpoints, samples and the summary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_config::{Gelu, RunConfig, TokenizerKind as ConfigTokenizer, Workload};
use kiln_data::{
    BatchSource, LmWindows, Split, TokenBatch, Tokenizer, TokenizerKind, encode_cached, read_corpus,
};
use kiln_hwdetect::{GpuInfo, HardwareReport};
use kiln_model::{ComputeDtype, GeluKind, Gpt, GptConfig};
use rand::SeedableRng;

use crate::checkpoint::{self, CheckpointState};
use crate::optim::AdamW;
use crate::precision::{LossScaler, PrecisionChoice};
use crate::report::{
    EvalMetrics, Event, Observer, StepMetrics, Summary, held_back_by, median, write_plots,
};
use crate::trainer::{
    Evaluation, LoopEnd, LoopPlan, LoopPlanStart, Task, Work, init_model, kernels, restore,
    run_loop, train_device,
};
use crate::{DeviceChoice, RunDir, TrainError, open_device};

/// What the caller provides besides the configuration.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Set (by Ctrl-C) to stop after the current step with a checkpoint.
    pub interrupt: Arc<AtomicBool>,
    /// The machine, for the MFU denominator and the saved report.
    pub hardware: HardwareReport,
    /// `kiln config --explain` lines, saved as `config-sources.txt`.
    pub sources: Vec<String>,
}

/// How a run ended.
#[derive(Clone, Debug)]
pub enum Outcome {
    Finished {
        run: PathBuf,
        summary: Summary,
    },
    /// A cross-validation run finished all its folds.
    CvFinished {
        run: PathBuf,
        summary: crate::nli::CvSummary,
    },
    /// Stopped by the interrupt flag, after writing this checkpoint.
    Interrupted {
        run: PathBuf,
        step: u64,
        checkpoint: PathBuf,
    },
}

/// Trains `config` in a new run directory: the language model, or for the
/// `nli` workload k-fold cross-validation ([`crate::train_cv`]).
pub fn train(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    if config.workload == Workload::Nli {
        return crate::nli::train_cv(config, options, observer);
    }
    // Everything that can fail on bad input fails before the run directory exists.
    let device = open_device(config, !options.hardware.gpus().is_empty())?;
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = make_tokenizer(config, &corpus.text)?;
    let (session, model) =
        Session::new(config, device, &options.hardware, &corpus, tokenizer, None)?;
    let run = RunDir::start(config, options)?;
    session.tokenizer.save(&run.file("tokenizer.json"))?;
    session.run(model, &run, options, observer)
}

/// Continues the run in `run_dir` from its newest good checkpoint.
pub fn resume(
    run_dir: &Path,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let run = RunDir::open(run_dir)?;
    let config = kiln_config::read_run_config(&run.file("config.toml"))?;
    if config.workload == Workload::Nli {
        observer.event(&Event::Note(format!(
            "resuming cross-validation run `{}`",
            run.path.display()
        )));
        return crate::nli::resume_cv(&config, &run, options, observer);
    }
    let (info, state, notes) = checkpoint::latest_good(&run.checkpoints())?;
    for note in notes {
        observer.event(&Event::Note(note));
    }
    observer.event(&Event::Note(format!(
        "resuming `{}` from step {} ({})",
        run.path.display(),
        info.step,
        info.path.display()
    )));
    let device = open_device(&config, !options.hardware.gpus().is_empty())?;
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = Tokenizer::load(&run.file("tokenizer.json"))?;
    run.truncate_metrics_after(info.step)?;
    let (session, model) = Session::new(
        &config,
        device,
        &options.hardware,
        &corpus,
        tokenizer,
        Some((info.path, state)),
    )?;
    session.run(model, &run, options, observer)
}

pub(crate) fn make_tokenizer(config: &RunConfig, text: &str) -> Result<Tokenizer, TrainError> {
    if !config.data.tokenizer_file.is_empty() {
        return Ok(Tokenizer::load(Path::new(&config.data.tokenizer_file))?);
    }
    let kind = match config.data.tokenizer {
        // Characters come from the whole corpus, as nanoGPT does: a character
        // seen only in validation text would otherwise be unencodable.
        ConfigTokenizer::Char => return Ok(Tokenizer::char_level(text)?),
        ConfigTokenizer::Bpe => TokenizerKind::Bpe {
            vocab_size: config.data.vocab_size,
        },
        ConfigTokenizer::Wordpiece => {
            return Err(TrainError::Unsupported(
                "data.tokenizer = wordpiece",
                "WordPiece comes with the nli workload; use char or bpe for a language model"
                    .into(),
            ));
        }
    };
    // Learned tokenizers see the training part of the text only.
    let cut = text
        .char_indices()
        .nth(((text.chars().count() as f64) * (1.0 - config.data.val_fraction)) as usize)
        .map_or(text.len(), |(i, _)| i);
    Ok(Tokenizer::train(kind, &text[..cut])?)
}

/// The model shape of a configuration, for a vocabulary.
pub(crate) fn gpt_config(config: &RunConfig, vocab_size: usize) -> GptConfig {
    let m = &config.model;
    GptConfig {
        vocab_size,
        block_size: m.max_length,
        layers: m.layers,
        heads: m.heads,
        hidden: m.hidden,
        intermediate: m.intermediate,
        dropout: m.dropout,
        gelu: match m.gelu {
            Gelu::Exact => GeluKind::Exact,
            Gelu::Tanh => GeluKind::Tanh,
        },
    }
}

/// The language-model workload for the shared loop.
pub(crate) struct LmTask {
    train: Arc<LmWindows>,
    eval_train: LmWindows,
    eval_val: LmWindows,
    eval_iters: u64,
    /// The device evaluation runs on (no autodiff).
    inner: Device,
    flops_per_token: f64,
}

impl Task for LmTask {
    type Model = Gpt;
    type Source = LmWindows;

    fn source(&self) -> Arc<LmWindows> {
        Arc::clone(&self.train)
    }

    fn loss(&self, model: &Gpt, batch: &TokenBatch, device: &Device) -> Tensor<1> {
        let (x, y) = batch_tensors(batch, device);
        model.loss(x, y)
    }

    fn work(&self, batch: &TokenBatch) -> Work {
        let tokens = batch.batch_size * batch.block;
        Work {
            samples: batch.batch_size,
            tokens,
            flops: self.flops_per_token * tokens as f64,
        }
    }

    /// Mean loss over `eval_iters` fixed batches of each split, without autodiff.
    fn evaluate(&self, model: &Gpt, _step: u64) -> Evaluation {
        let model = model.valid();
        let mean = |windows: &LmWindows| {
            let total: f64 = (0..self.eval_iters)
                .map(|j| {
                    let (x, y) = batch_tensors(&windows.batch(j), &self.inner);
                    f64::from(model.loss(x, y).into_scalar::<f32>())
                })
                .sum();
            total / self.eval_iters as f64
        };
        let (train_loss, val_loss) = (mean(&self.eval_train), mean(&self.eval_val));
        Evaluation {
            record: serde_json::json!({ "train_loss": train_loss, "val_loss": val_loss }),
            line: format!("train loss {train_loss:.4}, val loss {val_loss:.4}"),
            score: None,
        }
    }
}

/// A prepared run: the task, the model shape, and where it starts.
struct Session {
    config: RunConfig,
    device: DeviceChoice,
    train_device: Device,
    tokenizer: Tokenizer,
    optim: AdamW,
    task: LmTask,
    start: LoopPlanStart,
    total_steps: u64,
    notes: Vec<String>,
    precision: PrecisionChoice,
}

impl Session {
    fn new(
        config: &RunConfig,
        device: DeviceChoice,
        hardware: &HardwareReport,
        corpus: &kiln_data::Corpus,
        tokenizer: Tokenizer,
        resume_from: Option<(PathBuf, CheckpointState)>,
    ) -> Result<(Self, Gpt), TrainError> {
        let cache = Path::new(&config.data.cache_dir);
        let (ids, cached) = encode_cached(&tokenizer, corpus, cache)?;
        let mut notes = vec![format!(
            "data: {} — {} tokens ({}), vocabulary {}",
            corpus.path.display(),
            ids.len(),
            if cached.hit {
                "from the token cache"
            } else {
                "encoded and cached"
            },
            tokenizer.vocab_size()
        )];
        let block = config.model.max_length;
        let n_train = ((ids.len() as f64) * (1.0 - config.data.val_fraction)) as usize;
        let (train_ids, val_ids) = ids.split_at(n_train);
        for (split, part) in [("train", train_ids), ("validation", val_ids)] {
            if part.len() < block + 1 {
                return Err(kiln_data::DataError::TooShort {
                    path: corpus.path.clone(),
                    split,
                    tokens: part.len(),
                    need: block + 1,
                }
                .into());
            }
        }
        let t = &config.training;
        let seed = t.seed;
        let train_tokens: Arc<[u32]> = train_ids.into();
        let val_tokens: Arc<[u32]> = val_ids.into();
        let train = Arc::new(LmWindows::new(
            Arc::clone(&train_tokens),
            t.batch_size,
            block,
            seed,
            Split::Train,
        ));
        let eval_seed = seed ^ 0xE7A1_0000_0000_0000;
        let total_steps = if t.max_steps > 0 {
            t.max_steps as u64
        } else {
            (train.batches_per_epoch() * t.epochs as u64 / t.gradient_accumulation_steps as u64)
                .max(1)
        };
        let gpt = gpt_config(config, tokenizer.vocab_size());
        let train_device = train_device(config, &device.device, seed);
        let precision = run_precision(config, &device, hardware);
        let mut model = init_model(config, &train_device, device.is_gpu, seed, |d| gpt.init(d));
        let mut optim = AdamW::for_training(t);
        let mut start = LoopPlanStart {
            first_step: 1,
            ..LoopPlanStart::default()
        };
        if let Some((path, state)) = resume_from {
            (model, start) = restore(
                model,
                &mut optim,
                state,
                &path,
                &train_device,
                &device.device,
            )?;
        }
        let model = model
            .with_compute(precision.compute)
            .with_kernels(kernels(config));
        notes.push(format!(
            "model: GPT, {} layers × {} heads × {} wide, block {}, {:.2} M parameters, {:.2} M FLOPs per token",
            gpt.layers,
            gpt.heads,
            gpt.hidden,
            gpt.block_size,
            gpt.num_params() as f64 / 1e6,
            gpt.flops_per_token() / 1e6
        ));
        let task = LmTask {
            train,
            eval_train: LmWindows::new(
                train_tokens,
                config.eval.batch_size,
                block,
                eval_seed,
                Split::Train,
            ),
            eval_val: LmWindows::new(
                val_tokens,
                config.eval.batch_size,
                block,
                eval_seed,
                Split::Val,
            ),
            eval_iters: config.eval.eval_iters as u64,
            inner: device.device.clone(),
            flops_per_token: gpt.flops_per_token(),
        };
        let session = Self {
            config: config.clone(),
            device,
            precision,
            train_device,
            tokenizer,
            optim,
            task,
            start,
            total_steps,
            notes,
        };
        Ok((session, model))
    }

    fn start_lines(&self, options: &TrainOptions, peak_name: &str) -> Vec<String> {
        let c = &self.config;
        let t = &c.training;
        let mut lines = self.notes.clone();
        lines.extend(device_lines(
            c,
            &self.device,
            &self.precision,
            options,
            peak_name,
        ));
        lines.push(format!(
            "batch: {} × {} tokens, accumulation {} → {} sequences ({} tokens) per optimizer step",
            t.batch_size,
            c.model.max_length,
            t.gradient_accumulation_steps,
            c.effective_batch(),
            c.effective_batch() * c.model.max_length
        ));
        lines.push(schedule_line(c, self.total_steps));
        lines
    }

    fn run(
        mut self,
        model: Gpt,
        run: &RunDir,
        options: &TrainOptions,
        observer: &mut dyn Observer,
    ) -> Result<Outcome, TrainError> {
        let started = Instant::now();
        let (peak, peak_name) = mfu_peak(&self.device, &self.precision, &options.hardware);
        observer.event(&Event::Start {
            lines: self.start_lines(options, &peak_name),
            first_step: self.start.first_step,
            total_steps: self.total_steps,
        });
        let mut plan = LoopPlan {
            first_step: self.start.first_step,
            total_steps: self.total_steps,
            loader_start: self.start.loader_start,
            tokens_seen: self.start.tokens_seen,
            wall_before: self.start.wall_before,
            eval_every_epoch: None,
            patience: None,
            best: None,
            since_best: 0,
            peak_flops: peak,
            scaler: self
                .start
                .scaler(self.precision.loss_scaling(), &self.config),
        };
        let (model, end) = run_loop(
            &self.task,
            model,
            &mut self.optim,
            &self.train_device,
            &self.config,
            &mut plan,
            run,
            options,
            observer,
        )?;
        if let LoopEnd::Interrupted { step, checkpoint } = end {
            return Ok(Outcome::Interrupted {
                run: run.path.clone(),
                step,
                checkpoint,
            });
        }
        self.write_samples(&model, run)?;
        let summary = self.summarise(
            run,
            &peak_name,
            &options.hardware,
            plan.tokens_seen,
            self.start.wall_before + started.elapsed().as_secs_f64(),
        );
        run.write(
            "summary.json",
            &serde_json::to_string_pretty(&summary).unwrap_or_default(),
        )?;
        observer.event(&Event::Done(summary.clone()));
        Ok(Outcome::Finished {
            run: run.path.clone(),
            summary,
        })
    }

    fn write_samples(&self, model: &Gpt, run: &RunDir) -> Result<(), TrainError> {
        let s = &self.config.sample;
        let model = model.valid();
        let prompt = self.tokenizer.encode("\n").unwrap_or_default();
        let prompt = if prompt.is_empty() { vec![0] } else { prompt };
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.config.training.seed);
        let mut text = String::new();
        for i in 0..s.count {
            let ids = model.generate(
                &prompt,
                s.tokens,
                s.temperature,
                s.top_k,
                &mut rng,
                &self.device.device,
            );
            let sample = self.tokenizer.decode(&ids[prompt.len()..])?;
            text.push_str(&format!(
                "--- sample {} (temperature {}, top-k {})\n{sample}\n",
                i + 1,
                s.temperature,
                s.top_k
            ));
        }
        run.write("samples.txt", &text)
    }

    fn summarise(
        &self,
        run: &RunDir,
        peak_name: &str,
        hardware: &HardwareReport,
        tokens_seen: u64,
        wall_s: f64,
    ) -> Summary {
        let metrics = run.metrics();
        let steps: Vec<StepMetrics> = metrics
            .iter()
            .filter(|m| m["kind"] == "step")
            .filter_map(|m| serde_json::from_value(m.clone()).ok())
            .collect();
        let evals: Vec<EvalMetrics> = metrics
            .iter()
            .filter(|m| m["kind"] == "eval")
            .filter_map(|m| serde_json::from_value(m.clone()).ok())
            .collect();
        let _ = write_plots(&run.path, &steps, &evals);
        // The first logged steps include start-up costs: leave them out of the medians.
        let steady: Vec<&StepMetrics> = steps.iter().filter(|s| s.step > 3).collect();
        let steady = if steady.is_empty() {
            steps.iter().collect()
        } else {
            steady
        };
        let mut tps: Vec<f64> = steady.iter().map(|s| s.tokens_per_s).collect();
        let mut ms: Vec<f64> = steady.iter().map(|s| s.ms_per_step).collect();
        let mut mfu: Vec<f64> = steady.iter().filter_map(|s| s.mfu).collect();
        let mut wait: Vec<f64> = steady.iter().map(|s| s.data_wait_pct).collect();
        let median_mfu = (!mfu.is_empty()).then(|| median(&mut mfu));
        let data_wait_pct = median(&mut wait);
        let peak_memory = steps.iter().map(|s| s.peak_memory_bytes).max().unwrap_or(0);
        Summary {
            steps: steps.last().map_or(0, |s| s.step),
            tokens_seen,
            final_train_loss: evals.last().map(|e| e.train_loss),
            final_val_loss: evals.last().map(|e| e.val_loss),
            best_val_loss: evals.iter().map(|e| e.val_loss).min_by(f64::total_cmp),
            median_tokens_per_s: median(&mut tps),
            median_ms_per_step: median(&mut ms),
            median_mfu,
            mfu_peak: peak_name.to_string(),
            data_wait_pct,
            peak_memory_bytes: peak_memory,
            wall_s,
            held_back_by: held_back_by(
                data_wait_pct,
                peak_memory,
                hardware.memory.total_bytes,
                median_mfu,
            ),
        }
    }
}

/// The GPU a run on a GPU backend uses, from the hardware report.
pub(crate) fn run_gpu<'a>(c: &RunConfig, hardware: &'a HardwareReport) -> Option<&'a GpuInfo> {
    let gpus = hardware.gpus();
    gpus.iter()
        .find(|g| g.index as usize == c.device.index)
        .or(gpus.first())
}

/// The peak FLOP/s MFU is counted against on this device for the dtype the
/// products compute in, and where it came from: on a CubeCL GPU measured by
/// Burn's `performance_stats` (cached by CubeCL), else kiln-hwdetect's table
/// for the GPU and dtype; on the CPU the estimated fp32 peak (flex converts
/// bf16/fp16 products to f32, so that is their ceiling too). Mixed
/// precision counts against the bf16/fp16 peak, as the guides count MFU.
pub(crate) fn mfu_peak(
    device: &DeviceChoice,
    precision: &PrecisionChoice,
    hardware: &HardwareReport,
) -> (Option<f64>, String) {
    let dtype = precision.compute.name();
    if device.is_gpu {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some(p) = crate::precision::measured_peak(&device.device, precision.compute) {
            return (
                Some(p),
                format!(
                    "{} {dtype} of {}, measured by Burn's performance_stats (cached by CubeCL)",
                    flops_rate(p),
                    device.name
                ),
            );
        }
        let Some(gpu) = hardware.gpus().first() else {
            return (
                None,
                format!(
                    "no peak: {} reported none and it is not an NVIDIA GPU kiln knows",
                    device.name
                ),
            );
        };
        let (Some(peak), Some(source)) = (&gpu.peak, &gpu.peak_source) else {
            return (
                None,
                format!("no peak: the {} is not in kiln's table", gpu.name),
            );
        };
        let value = match precision.compute {
            ComputeDtype::F32 => Some(peak.fp32),
            ComputeDtype::Bf16 => peak.bf16,
            ComputeDtype::F16 => peak.fp16,
        };
        return match value {
            Some(p) => (
                Some(p),
                format!(
                    "{} {dtype} of the {} ({source}; not measured on this device)",
                    flops_rate(p),
                    gpu.name
                ),
            ),
            None => (
                None,
                format!(
                    "no peak: kiln's table has no {dtype} figure for the {}",
                    gpu.name
                ),
            ),
        };
    }
    match hardware.cpu.peak.fp32_flops {
        Some(p) => (
            Some(p),
            format!(
                "{:.1} GFLOP/s fp32, the CPU {}{}",
                p / 1e9,
                hardware.cpu.peak.how,
                if precision.compute.is_reduced() {
                    " (flex computes bf16/fp16 products in f32, so this is their ceiling too)"
                } else {
                    ""
                }
            ),
        ),
        None => (None, format!("unknown ({})", hardware.cpu.peak.how)),
    }
}

/// A peak in TFLOP/s, or GFLOP/s below one TFLOP/s (software devices).
fn flops_rate(flops: f64) -> String {
    if flops >= 1e12 {
        format!("{:.1} TFLOP/s", flops / 1e12)
    } else {
        format!("{:.1} GFLOP/s", flops / 1e9)
    }
}

/// The precision a run computes in on its device, and why.
pub(crate) fn run_precision(
    c: &RunConfig,
    device: &DeviceChoice,
    hardware: &HardwareReport,
) -> PrecisionChoice {
    crate::precision::choose_precision(&c.precision, device, run_gpu(c, hardware))
}

/// Start lines about the device, precision, compile, loader and MFU.
pub(crate) fn device_lines(
    c: &RunConfig,
    device: &DeviceChoice,
    precision: &PrecisionChoice,
    options: &TrainOptions,
    peak_name: &str,
) -> Vec<String> {
    let tf32 = match (device.is_gpu, run_gpu(c, &options.hardware)) {
        (true, Some(gpu)) if gpu.capabilities.tf32 => format!(
            "; TF32: the {} has it, and CubeCL's matmul autotuner may pick TF32 tensor-core kernels for f32 products whatever precision.tf32 says",
            gpu.name
        ),
        (true, _) => "; TF32: not on this device".to_string(),
        (false, _) => String::new(),
    };
    let mut lines = vec![
        format!("backend: {} — {}", device.name, device.why),
        format!("precision: {} — {}{tf32}", precision.label, precision.why),
        device.compile.clone(),
        format!(
            "loader: {} worker thread{}, {} batches ahead each",
            c.loader.num_workers,
            if c.loader.num_workers == 1 { "" } else { "s" },
            c.loader.prefetch_factor
        ),
        format!("MFU is measured against {peak_name}"),
        match (device.is_gpu, options.hardware.gpus().first()) {
            (true, Some(gpu)) => format!("device: {}", gpu.name),
            _ => format!(
                "threads: {} cores for compute",
                options.hardware.cpu.logical_cores
            ),
        },
    ];
    if precision.loss_scaling() {
        lines.push(format!(
            "loss scaling: dynamic, from {} (×2 after {} clean steps, ×0.5 and the step skipped on overflow)",
            LossScaler::INITIAL,
            LossScaler::GROWTH_INTERVAL
        ));
    }
    if c.model.gradient_checkpointing {
        lines.push("gradient checkpointing: on (activations recomputed in backward)".into());
    }
    lines
}

/// The schedule, in one line.
pub(crate) fn schedule_line(c: &RunConfig, total_steps: u64) -> String {
    let t = &c.training;
    format!(
        "schedule: {} steps, AdamW lr {} (warm-up {}, cosine to {}), β {}/{}, weight decay {} on matrices, clip {}",
        total_steps,
        t.learning_rate,
        t.warmup_steps,
        t.min_lr,
        t.beta1,
        t.beta2,
        t.weight_decay,
        t.grad_clip
    )
}

/// Input and target tensors of a batch on `device` (the host-to-device copy).
pub(crate) fn batch_tensors(
    batch: &TokenBatch,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let shape = [batch.batch_size, batch.block];
    let to = |ids: &[u32]| {
        let data: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(data, shape), device)
    };
    (to(&batch.inputs), to(&batch.targets))
}
