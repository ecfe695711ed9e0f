//! Training the GPT language model: data, model, the loop, evaluation,
//! checkpoints, samples and the summary.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_config::{Gelu, RunConfig, TokenizerKind as ConfigTokenizer, Workload};
use kiln_data::{
    BatchSource, LmWindows, Loader, Split, TokenBatch, Tokenizer, TokenizerKind, encode_cached,
    read_corpus,
};
use kiln_hwdetect::HardwareReport;
use kiln_model::{GeluKind, Gpt, GptConfig};
use rand::SeedableRng;

use crate::checkpoint::{self, CheckpointState};
use crate::optim::{AdamW, AdamWConfig, global_grad_norm, lr_at};
use crate::params::{host, param_entries, param_values, tensor_from};
use crate::report::{
    EvalMetrics, Event, Observer, StepMetrics, Summary, held_back_by, median, write_plots,
};
use crate::{DeviceChoice, MemoryTracker, RunDir, TrainError, select_device};

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
    /// Stopped by the interrupt flag, after writing this checkpoint.
    Interrupted {
        run: PathBuf,
        step: u64,
        checkpoint: PathBuf,
    },
}

/// Trains the language model of `config` in a new run directory.
pub fn train_lm(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    if config.workload != Workload::Lm {
        return Err(TrainError::Unsupported(
            "the nli workload",
            "sentence-pair training with cross-validation is not built yet; use experiment=shakespeare_char".into(),
        ));
    }
    // Everything that can fail on bad input fails before the run directory exists.
    let device = select_device(config.device.backend)?;
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = make_tokenizer(config, &corpus.text)?;
    let (session, model) = Session::new(config, device, &corpus, tokenizer, None)?;
    let run = RunDir::create(&config.run.dir, &config.experiment)?;
    run.write("config.toml", &toml_of(config))?;
    run.write("config-sources.txt", &(options.sources.join("\n") + "\n"))?;
    run.write(
        "hardware.json",
        &serde_json::to_string_pretty(&options.hardware).unwrap_or_default(),
    )?;
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
    let device = select_device(config.device.backend)?;
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = Tokenizer::load(&run.file("tokenizer.json"))?;
    run.truncate_metrics_after(info.step)?;
    let (session, model) = Session::new(
        &config,
        device,
        &corpus,
        tokenizer,
        Some((info.path, state)),
    )?;
    session.run(model, &run, options, observer)
}

fn toml_of(config: &RunConfig) -> String {
    toml::to_string_pretty(config).unwrap_or_default()
}

fn make_tokenizer(config: &RunConfig, text: &str) -> Result<Tokenizer, TrainError> {
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

/// A prepared run: data, model, optimizer and counters.
struct Session {
    config: RunConfig,
    device: DeviceChoice,
    train_device: Device,
    tokenizer: Tokenizer,
    gpt: GptConfig,
    optim: AdamW,
    train: Arc<LmWindows>,
    eval_train: LmWindows,
    eval_val: LmWindows,
    first_step: u64,
    loader_start: u64,
    tokens_seen: u64,
    wall_before: f64,
    total_steps: u64,
    notes: Vec<String>,
}

impl Session {
    fn new(
        config: &RunConfig,
        device: DeviceChoice,
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
        let seed = config.training.seed;
        let train_tokens: Arc<[u32]> = train_ids.into();
        let val_tokens: Arc<[u32]> = val_ids.into();
        let t = &config.training;
        let train = Arc::new(LmWindows::new(
            Arc::clone(&train_tokens),
            t.batch_size,
            block,
            seed,
            Split::Train,
        ));
        let eval_seed = seed ^ 0xE7A1_0000_0000_0000;
        let eval_train = LmWindows::new(
            train_tokens,
            config.eval.batch_size,
            block,
            eval_seed,
            Split::Train,
        );
        let eval_val = LmWindows::new(
            val_tokens,
            config.eval.batch_size,
            block,
            eval_seed,
            Split::Val,
        );
        let total_steps = if t.max_steps > 0 {
            t.max_steps as u64
        } else {
            (train.batches_per_epoch() * t.epochs as u64 / t.gradient_accumulation_steps as u64)
                .max(1)
        };
        let gpt = GptConfig {
            vocab_size: tokenizer.vocab_size(),
            block_size: block,
            layers: config.model.layers,
            heads: config.model.heads,
            hidden: config.model.hidden,
            intermediate: config.model.intermediate,
            dropout: config.model.dropout,
            gelu: match config.model.gelu {
                Gelu::Exact => GeluKind::Exact,
                Gelu::Tanh => GeluKind::Tanh,
            },
        };
        let mut train_device = device.device.clone().autodiff();
        if config.model.gradient_checkpointing {
            train_device = train_device.gradient_checkpointing();
        }
        train_device.seed(seed);
        let mut model = gpt.init(&train_device);
        let mut optim = AdamW::new(AdamWConfig {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            weight_decay: t.weight_decay,
        });
        let (mut first_step, mut loader_start, mut tokens_seen, mut wall_before) = (1, 0, 0, 0.0);
        if let Some((path, state)) = resume_from {
            let values: HashMap<String, (Vec<usize>, Vec<f32>)> = state
                .params
                .into_iter()
                .map(|(p, shape, v)| (p, (shape, v)))
                .collect();
            model = crate::params::load_values(model, values, &train_device).map_err(|why| {
                TrainError::CheckpointMismatch {
                    path: path.clone(),
                    why,
                }
            })?;
            let ids: HashMap<String, _> = param_entries(&model)
                .into_iter()
                .map(|e| (e.path, e.id))
                .collect();
            for (p, m, v) in state.moments {
                let id = ids.get(&p).ok_or_else(|| TrainError::CheckpointMismatch {
                    path: path.clone(),
                    why: format!("optimizer state for `{p}`, which the model lacks"),
                })?;
                let n = m.len();
                let inner = &device.device;
                optim.moments.insert(
                    *id,
                    (
                        tensor_from::<1>(m, &[n], inner),
                        tensor_from::<1>(v, &[n], inner),
                    ),
                );
            }
            optim.steps = state.adam_steps;
            first_step = state.step + 1;
            loader_start = state.loader_position;
            tokens_seen = state.tokens_seen;
            wall_before = state.wall_s;
        }
        notes.push(format!(
            "model: GPT, {} layers × {} heads × {} wide, block {}, {:.2} M parameters, {:.2} M FLOPs per token",
            gpt.layers,
            gpt.heads,
            gpt.hidden,
            gpt.block_size,
            gpt.num_params() as f64 / 1e6,
            gpt.flops_per_token() / 1e6
        ));
        let session = Self {
            config: config.clone(),
            device,
            train_device,
            tokenizer,
            gpt,
            optim,
            train,
            eval_train,
            eval_val,
            first_step,
            loader_start,
            tokens_seen,
            wall_before,
            total_steps,
            notes,
        };
        Ok((session, model))
    }

    /// The fp32 peak the MFU is measured against, and its name.
    fn peak(&self, hardware: &HardwareReport) -> (Option<f64>, String) {
        if self.device.is_gpu {
            return (None, "no GPU peak on this backend".to_string());
        }
        match hardware.cpu.peak.fp32_flops {
            Some(p) => (
                Some(p),
                format!(
                    "{:.1} GFLOP/s fp32, the CPU {}",
                    p / 1e9,
                    hardware.cpu.peak.how
                ),
            ),
            None => (None, format!("unknown ({})", hardware.cpu.peak.how)),
        }
    }

    fn start_lines(&self, options: &TrainOptions, peak_name: &str) -> Vec<String> {
        let c = &self.config;
        let t = &c.training;
        let (precision, precision_why) = kiln_config::effective_precision(&c.precision, None);
        let mut lines = self.notes.clone();
        lines.extend([
            format!("backend: {} — {}", self.device.name, self.device.why),
            format!("precision: {precision} — {precision_why}"),
            format!(
                "compile: {} — fusion and autotuning are GPU (CubeCL) features, not applicable on flex",
                if c.optimization.compile { "asked for, not applicable" } else { "off" }
            ),
            format!(
                "loader: {} worker thread{}, {} batches ahead each",
                c.loader.num_workers,
                if c.loader.num_workers == 1 { "" } else { "s" },
                c.loader.prefetch_factor
            ),
            format!(
                "batch: {} × {} tokens, accumulation {} → {} sequences ({} tokens) per optimizer step",
                t.batch_size,
                c.model.max_length,
                t.gradient_accumulation_steps,
                c.effective_batch(),
                c.effective_batch() * c.model.max_length
            ),
            format!(
                "schedule: {} steps, AdamW lr {} (warm-up {}, cosine to {}), β {}/{}, weight decay {} on matrices, clip {}",
                self.total_steps, t.learning_rate, t.warmup_steps, t.min_lr, t.beta1, t.beta2, t.weight_decay, t.grad_clip
            ),
            format!("MFU is measured against {peak_name}"),
            format!("threads: {} cores for compute", options.hardware.cpu.logical_cores),
        ]);
        if c.model.gradient_checkpointing {
            lines.push("gradient checkpointing: on (activations recomputed in backward)".into());
        }
        lines
    }

    fn run(
        mut self,
        mut model: Gpt,
        run: &RunDir,
        options: &TrainOptions,
        observer: &mut dyn Observer,
    ) -> Result<Outcome, TrainError> {
        let started = Instant::now();
        let (peak, peak_name) = self.peak(&options.hardware);
        observer.event(&Event::Start {
            lines: self.start_lines(options, &peak_name),
            first_step: self.first_step,
            total_steps: self.total_steps,
        });
        let c = self.config.clone();
        let t = &c.training;
        let accum = t.gradient_accumulation_steps;
        let tokens_per_step = (t.batch_size * accum * c.model.max_length) as u64;
        let mut loader = Loader::new(
            Arc::clone(&self.train),
            self.loader_start,
            c.loader.num_workers,
            c.loader.prefetch_factor,
        );
        let mut memory = MemoryTracker::new();
        let mut last_checkpoint: Option<PathBuf> = None;
        let mut step = self.first_step;
        while step <= self.total_steps {
            if options.interrupt.load(Ordering::Relaxed) {
                let path = self.checkpoint(&model, run, step - 1, loader.position(), started)?;
                return Ok(Outcome::Interrupted {
                    run: run.path.clone(),
                    step: step - 1,
                    checkpoint: path,
                });
            }
            // Dropout draws from the device RNG: seeding it per step makes a
            // resumed run draw what the uninterrupted one would have.
            self.train_device
                .seed(t.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let step_started = Instant::now();
            let mut waited = Duration::ZERO;
            let mut loss_sum: Option<Tensor<1>> = None;
            let mut accumulator = GradientsAccumulator::<Gpt>::new();
            let mut single: Option<GradientsParams> = None;
            for _ in 0..accum {
                let loaded = loader.next_batch();
                waited += loaded.wait;
                let (x, y) = batch_tensors(&loaded.batch, &self.train_device);
                let loss = model.loss(x, y);
                loss_sum = Some(match loss_sum.take() {
                    Some(s) => s.add(loss.clone().detach()),
                    None => loss.clone().detach(),
                });
                // Dividing by the accumulation steps makes the summed
                // gradients an average.
                let loss = if accum > 1 {
                    loss.div_scalar(accum as f64)
                } else {
                    loss
                };
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                if accum > 1 {
                    accumulator.accumulate(&model, grads);
                } else {
                    single = Some(grads);
                }
            }
            let grads = single.unwrap_or_else(|| accumulator.grads());
            let loss = loss_sum.map_or(f32::NAN, |l| l.into_scalar::<f32>()) / accum as f32;
            if !loss.is_finite() {
                return Err(TrainError::NonFinite { step, value: loss });
            }
            let norm = global_grad_norm(&model, &grads);
            let scale = if t.grad_clip > 0.0 && norm > t.grad_clip {
                t.grad_clip / (norm + 1e-6)
            } else {
                1.0
            };
            let lr = lr_at(
                step,
                t.learning_rate,
                t.min_lr,
                t.warmup_steps as u64,
                self.total_steps,
            );
            model = self.optim.step(model, grads, lr, scale);
            self.tokens_seen += tokens_per_step;
            let elapsed = step_started.elapsed().as_secs_f64();

            let last = step == self.total_steps;
            if step.is_multiple_of(c.logging.logging_steps as u64) || last || step == self.first_step {
                let (current, peak_mem) = memory.sample();
                let tokens_per_s = tokens_per_step as f64 / elapsed;
                let metrics = StepMetrics {
                    step,
                    loss: f64::from(loss),
                    lr,
                    grad_norm: norm,
                    ms_per_step: elapsed * 1e3,
                    tokens_per_s,
                    mfu: peak.map(|p| self.gpt.flops_per_token() * tokens_per_s / p),
                    data_wait_pct: 100.0 * waited.as_secs_f64() / elapsed,
                    memory_bytes: current,
                    peak_memory_bytes: peak_mem,
                    tokens_seen: self.tokens_seen,
                };
                run.append_metric(&tagged("step", &metrics))?;
                observer.event(&Event::Step(metrics));
            }
            if step.is_multiple_of(c.eval.eval_steps as u64) || last {
                let eval = self.evaluate(&model, step);
                run.append_metric(&tagged("eval", &eval))?;
                observer.event(&Event::Eval(eval));
            }
            if step.is_multiple_of(c.checkpoint.every_steps as u64) || last {
                let path = self.checkpoint(&model, run, step, loader.position(), started)?;
                observer.event(&Event::Checkpoint {
                    step,
                    path: path.clone(),
                });
                last_checkpoint = Some(path);
            }
            step += 1;
        }
        drop(loader);
        let _ = last_checkpoint;
        self.write_samples(&model, run)?;
        let summary = self.summarise(run, &peak_name, &options.hardware, started);
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

    /// Mean loss over `eval_iters` fixed batches of each split, without autodiff.
    fn evaluate(&self, model: &Gpt, step: u64) -> EvalMetrics {
        let model = model.valid();
        let device = &self.device.device;
        let iters = self.config.eval.eval_iters as u64;
        let mean = |windows: &LmWindows| {
            let total: f64 = (0..iters)
                .map(|j| {
                    let (x, y) = batch_tensors(&windows.batch(j), device);
                    f64::from(model.loss(x, y).into_scalar::<f32>())
                })
                .sum();
            total / iters as f64
        };
        EvalMetrics {
            step,
            train_loss: mean(&self.eval_train),
            val_loss: mean(&self.eval_val),
        }
    }

    fn checkpoint(
        &self,
        model: &Gpt,
        run: &RunDir,
        step: u64,
        loader_position: u64,
        started: Instant,
    ) -> Result<PathBuf, TrainError> {
        let ids: HashMap<_, String> = param_entries(model)
            .into_iter()
            .map(|e| (e.id, e.path))
            .collect();
        let mut moments: Vec<(String, Vec<f32>, Vec<f32>)> = self
            .optim
            .moments
            .iter()
            .filter_map(|(id, (m, v))| ids.get(id).map(|p| (p.clone(), host(m), host(v))))
            .collect();
        moments.sort_by(|a, b| a.0.cmp(&b.0));
        let state = CheckpointState {
            step,
            loader_position,
            adam_steps: self.optim.steps,
            tokens_seen: self.tokens_seen,
            wall_s: self.wall_before + started.elapsed().as_secs_f64(),
            params: param_values(model),
            moments,
        };
        checkpoint::save(&run.checkpoints(), &state, self.config.checkpoint.keep)
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
        started: Instant,
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
            tokens_seen: self.tokens_seen,
            final_train_loss: evals.last().map(|e| e.train_loss),
            final_val_loss: evals.last().map(|e| e.val_loss),
            best_val_loss: evals.iter().map(|e| e.val_loss).min_by(f64::total_cmp),
            median_tokens_per_s: median(&mut tps),
            median_ms_per_step: median(&mut ms),
            median_mfu,
            mfu_peak: peak_name.to_string(),
            data_wait_pct,
            peak_memory_bytes: peak_memory,
            wall_s: self.wall_before + started.elapsed().as_secs_f64(),
            held_back_by: held_back_by(
                data_wait_pct,
                peak_memory,
                hardware.memory.total_bytes,
                median_mfu,
            ),
        }
    }
}

/// A JSON object of `value` with `"kind": kind` added.
fn tagged<T: serde::Serialize>(kind: &str, value: &T) -> serde_json::Value {
    let mut v = serde_json::to_value(value).unwrap_or_default();
    if let Some(map) = v.as_object_mut() {
        map.insert("kind".into(), kind.into());
    }
    v
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
