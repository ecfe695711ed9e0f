//! The training loop every workload shares: loader, accumulation that
//! averages, global-norm clipping, AdamW with warm-up + cosine, logging,
//! evaluation, best-model keeping and early stopping, checkpoints, interrupt.
//! A workload plugs in through [`Task`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use kiln_config::RunConfig;
use kiln_data::{BatchSource, Loader};

use crate::checkpoint::{self, CheckpointState};
use crate::optim::{AdamW, global_grad_norm, lr_at};
use crate::params::{host, param_entries, param_values, tensor_from};
use crate::precision::{LossScaler, ScaleVerdict};
use crate::report::{Event, Observer, StepMetrics};
use crate::{MemoryTracker, RunDir, TrainError, TrainOptions};

/// The work one batch represents.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Work {
    pub(crate) samples: usize,
    /// Tokens that carry data (no padding).
    pub(crate) tokens: usize,
    /// Model FLOPs of one training step (forward and backward) on the batch.
    pub(crate) flops: f64,
}

/// One evaluation: the record for `metrics.jsonl`, a line to print, and a
/// score (higher is better) for keeping the best model and early stopping.
#[derive(Clone, Debug)]
pub(crate) struct Evaluation {
    pub(crate) record: serde_json::Value,
    pub(crate) line: String,
    pub(crate) score: Option<f64>,
}

/// A workload: its model, its batches, its loss and its evaluation.
pub(crate) trait Task {
    type Model: Module;
    type Source: BatchSource;

    fn source(&self) -> Arc<Self::Source>;
    fn loss(
        &self,
        model: &Self::Model,
        batch: &<Self::Source as BatchSource>::Batch,
        device: &Device,
    ) -> Tensor<1>;
    fn work(&self, batch: &<Self::Source as BatchSource>::Batch) -> Work;
    fn evaluate(&self, model: &Self::Model, step: u64) -> Evaluation;
}

/// Counts steps in a row whose loss or gradient norm is not finite.
#[derive(Debug)]
pub(crate) struct BadSteps {
    pub(crate) max: usize,
    in_a_row: usize,
}

/// What to do with a step's gradients.
#[derive(Debug, PartialEq)]
pub(crate) enum StepVerdict {
    Apply,
    /// fp16's gradients overflowed at the loss scale: skip the update; the
    /// scale was halved to `to`. Not a bad step while the scale can shrink.
    Overflow {
        to: f64,
        overflows: u64,
    },
    /// Not finite: skip the update.
    Skip {
        what: String,
        in_a_row: usize,
    },
    /// `max` non-finite steps in a row: stop the run.
    Stop {
        what: String,
        in_a_row: usize,
    },
}

impl BadSteps {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            in_a_row: 0,
        }
    }

    pub(crate) fn check(&mut self, loss: f32, grad_norm: f64) -> StepVerdict {
        let what = if !loss.is_finite() {
            format!("the loss is {loss}")
        } else if !grad_norm.is_finite() {
            format!("the gradient norm is {grad_norm}")
        } else {
            self.in_a_row = 0;
            return StepVerdict::Apply;
        };
        self.in_a_row += 1;
        if self.in_a_row >= self.max {
            StepVerdict::Stop {
                what,
                in_a_row: self.in_a_row,
            }
        } else {
            StepVerdict::Skip {
                what,
                in_a_row: self.in_a_row,
            }
        }
    }
}

/// Where a loop starts and what it is asked to do.
#[derive(Clone, Debug)]
pub(crate) struct LoopPlan {
    pub(crate) first_step: u64,
    pub(crate) total_steps: u64,
    pub(crate) loader_start: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) wall_before: f64,
    /// Also evaluate every this many steps (epoch ends), besides `eval.eval_steps`.
    pub(crate) eval_every_epoch: Option<u64>,
    /// Stop after this many evaluations without a better score.
    pub(crate) patience: Option<usize>,
    /// Best score so far and evaluations since (from the metrics when resuming).
    pub(crate) best: Option<f64>,
    pub(crate) since_best: usize,
    /// The peak FLOP/s MFU is counted against.
    pub(crate) peak_flops: Option<f64>,
    /// fp16's dynamic loss scaling (`None`: bf16 or f32, no scaling).
    pub(crate) scaler: Option<LossScaler>,
}

/// How a loop ended.
#[derive(Debug)]
pub(crate) enum LoopEnd {
    Finished,
    EarlyStopped,
    Interrupted { step: u64, checkpoint: PathBuf },
}

/// The model file kept for the best evaluation score.
pub(crate) const BEST_MODEL: &str = "best.safetensors";

/// Runs `plan` over `task` with `model` and `optim`, writing metrics and
/// checkpoints into `run`. Returns the final model and how it ended.
#[allow(
    clippy::too_many_arguments,
    reason = "the loop's inputs, each distinct"
)]
pub(crate) fn run_loop<T: Task>(
    task: &T,
    mut model: T::Model,
    optim: &mut AdamW,
    device: &Device,
    config: &RunConfig,
    plan: &mut LoopPlan,
    run: &RunDir,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<(T::Model, LoopEnd), TrainError> {
    let started = Instant::now();
    let t = &config.training;
    let accum = t.gradient_accumulation_steps;
    let mut loader = Loader::new(
        task.source(),
        plan.loader_start,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let mut memory = MemoryTracker::new();
    let mut bad_steps = BadSteps::new(config.precision.max_bad_steps);
    let mut step = plan.first_step;
    while step <= plan.total_steps {
        if options.interrupt.load(Ordering::Relaxed) {
            let path = save_checkpoint(
                &model,
                optim,
                run,
                step - 1,
                loader.position(),
                plan,
                started,
                config,
            )?;
            return Ok((
                model,
                LoopEnd::Interrupted {
                    step: step - 1,
                    checkpoint: path,
                },
            ));
        }
        // Dropout draws from the device RNG: seeding it per step makes a
        // resumed run draw what the uninterrupted one would have.
        device.seed(t.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let step_started = Instant::now();
        let mut waited = Duration::ZERO;
        let mut work = Work::default();
        let mut loss_sum: Option<Tensor<1>> = None;
        let mut accumulator = GradientsAccumulator::<T::Model>::new();
        let mut single: Option<GradientsParams> = None;
        let loss_scale = plan.scaler.map_or(1.0, |s| s.scale);
        for _ in 0..accum {
            let loaded = loader.next_batch();
            waited += loaded.wait;
            let w = task.work(&loaded.batch);
            work.samples += w.samples;
            work.tokens += w.tokens;
            work.flops += w.flops;
            let loss = task.loss(&model, &loaded.batch, device);
            loss_sum = Some(match loss_sum.take() {
                Some(s) => s.add(loss.clone().detach()),
                None => loss.clone().detach(),
            });
            // Dividing by the accumulation steps makes the summed gradients
            // an average; fp16's loss scale multiplies them (and the update
            // divides it out again).
            let factor = loss_scale / accum as f64;
            let loss = if factor == 1.0 {
                loss
            } else {
                loss.mul_scalar(factor)
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
        let norm = global_grad_norm(&model, &grads) / loss_scale;
        let lr = lr_at(
            step,
            t.learning_rate,
            t.min_lr,
            t.warmup_steps as u64,
            plan.total_steps,
        );
        let verdict = match plan.scaler.as_mut() {
            Some(scaler) if loss.is_finite() && !norm.is_finite() && scaler.can_back_off() => {
                scaler.update(false);
                StepVerdict::Overflow {
                    to: scaler.scale,
                    overflows: scaler.overflows,
                }
            }
            _ => bad_steps.check(loss, norm),
        };
        match verdict {
            StepVerdict::Overflow { to, overflows } => {
                run.append_metric(&serde_json::json!({
                    "kind": "skipped",
                    "step": step,
                    "why": "fp16 gradients overflowed",
                    "loss_scale": to,
                    "overflows": overflows,
                }))?;
                observer.event(&Event::Note(format!(
                    "step {step}: fp16 gradients overflowed at loss scale {}: step skipped, scale halved to {to} ({overflows} overflows so far)",
                    to * 2.0
                )));
            }
            StepVerdict::Apply => {
                let clip = if t.grad_clip > 0.0 && norm > t.grad_clip {
                    t.grad_clip / (norm + 1e-6)
                } else {
                    1.0
                };
                model = optim.step(model, grads, lr, clip / loss_scale);
                if let Some(scaler) = plan.scaler.as_mut()
                    && scaler.update(true) == (ScaleVerdict::Apply { grown: true })
                {
                    run.append_metric(&serde_json::json!({
                        "kind": "loss_scale",
                        "step": step,
                        "scale": scaler.scale,
                        "why": format!("{} clean steps in a row", scaler.growth_interval),
                    }))?;
                }
            }
            StepVerdict::Skip { what, in_a_row } => {
                // No update: the weights and the optimizer state stay as
                // they were, finite, and so does every checkpoint.
                run.append_metric(&serde_json::json!({
                    "kind": "skipped",
                    "step": step,
                    "why": what,
                    "in_a_row": in_a_row,
                }))?;
                observer.event(&Event::Note(format!(
                    "step {step}: {what}: step skipped, no update ({in_a_row} in a row; precision.max_bad_steps = {})",
                    bad_steps.max
                )));
            }
            StepVerdict::Stop { what, in_a_row } => {
                return Err(TrainError::NonFinite {
                    step,
                    what,
                    in_a_row,
                });
            }
        }
        plan.tokens_seen += work.tokens as u64;
        let elapsed = step_started.elapsed().as_secs_f64();

        let last = step == plan.total_steps;
        if step.is_multiple_of(config.logging.logging_steps as u64)
            || last
            || step == plan.first_step
        {
            let (current, peak_mem) = memory.sample();
            let metrics = StepMetrics {
                step,
                loss: f64::from(loss),
                lr,
                grad_norm: norm,
                ms_per_step: elapsed * 1e3,
                tokens_per_s: work.tokens as f64 / elapsed,
                samples_per_s: work.samples as f64 / elapsed,
                mfu: plan.peak_flops.map(|p| work.flops / elapsed / p),
                data_wait_pct: 100.0 * waited.as_secs_f64() / elapsed,
                memory_bytes: current,
                peak_memory_bytes: peak_mem,
                tokens_seen: plan.tokens_seen,
            };
            run.append_metric(&tagged("step", &metrics))?;
            observer.event(&Event::Step(metrics));
        }
        let epoch_end = plan
            .eval_every_epoch
            .is_some_and(|e| step.is_multiple_of(e.max(1)));
        let mut stop = false;
        if step.is_multiple_of(config.eval.eval_steps as u64) || epoch_end || last {
            let eval = task.evaluate(&model, step);
            let mut record = eval.record.clone();
            if let Some(map) = record.as_object_mut() {
                map.insert("kind".into(), "eval".into());
                map.insert("step".into(), step.into());
                if let Some(score) = eval.score {
                    map.insert("score".into(), score.into());
                }
            }
            run.append_metric(&record)?;
            observer.event(&Event::Eval {
                step,
                line: eval.line,
            });
            if let Some(score) = eval.score {
                if plan.best.is_none_or(|b| score > b) {
                    plan.best = Some(score);
                    plan.since_best = 0;
                    save_model(&model, &run.file(BEST_MODEL))?;
                } else {
                    plan.since_best += 1;
                    stop = plan.patience.is_some_and(|p| plan.since_best >= p);
                }
            }
        }
        if step.is_multiple_of(config.checkpoint.every_steps as u64) || last || stop {
            let path = save_checkpoint(
                &model,
                optim,
                run,
                step,
                loader.position(),
                plan,
                started,
                config,
            )?;
            observer.event(&Event::Checkpoint { step, path });
        }
        if stop {
            observer.event(&Event::Note(format!(
                "early stop at step {step}: no better score in {} evaluations",
                plan.since_best
            )));
            return Ok((model, LoopEnd::EarlyStopped));
        }
        step += 1;
    }
    Ok((model, LoopEnd::Finished))
}

/// The device a model trains on: `inner` with autodiff (and gradient
/// checkpointing when the config asks), its RNG seeded with `seed`.
pub(crate) fn train_device(config: &RunConfig, inner: &Device, seed: u64) -> Device {
    let mut device = inner.clone().autodiff();
    if config.model.gradient_checkpointing {
        device = device.gradient_checkpointing();
    }
    device.seed(seed);
    device
}

/// The kernels `optimization.kernels` asks the models to run.
pub(crate) fn kernels(config: &RunConfig) -> kiln_model::Kernels {
    match config.optimization.kernels {
        kiln_config::KernelChoice::Fused => kiln_model::Kernels::Fused,
        kiln_config::KernelChoice::Reference => kiln_model::Kernels::Reference,
    }
}

/// Builds a model whose initial weights depend on `seed` alone, not on the
/// device or on what draws from the device's RNG later. Burn initialises a
/// parameter lazily, at its first use: left alone, the draw would happen in
/// the first training step, after the loop has reseeded the RNG for that
/// step, and a model drawn on the CPU and copied over would not match. So
/// every parameter is materialised here; on a GPU the values are drawn on
/// the CPU (`flex`, seeded as `device` is) and copied over, so a wgpu or
/// CUDA run starts from the weights a flex run of the same seed starts from,
/// and the two can be compared step by step.
pub(crate) fn init_model<M: Module>(
    config: &RunConfig,
    device: &Device,
    is_gpu: bool,
    seed: u64,
    init: impl Fn(&Device) -> M,
) -> M {
    #[cfg(feature = "flex")]
    if is_gpu {
        let cpu = train_device(config, &Device::flex(), seed);
        let values = crate::params::param_values(&init(&cpu))
            .into_iter()
            .map(|(path, shape, v)| (path, (shape, v)))
            .collect();
        // Same model, same paths: loading cannot fail; if it did, the
        // device's own draw is still a valid start.
        if let Ok(model) = crate::params::load_values(init(device), values, device) {
            return model;
        }
    }
    let _ = (config, is_gpu, seed);
    let model = init(device);
    // Visiting reads every parameter, which materialises it now, in order.
    let _ = param_entries(&model);
    model
}

/// A JSON object of `value` with `"kind": kind` added.
pub(crate) fn tagged<T: serde::Serialize>(kind: &str, value: &T) -> serde_json::Value {
    let mut v = serde_json::to_value(value).unwrap_or_default();
    if let Some(map) = v.as_object_mut() {
        map.insert("kind".into(), kind.into());
    }
    v
}

#[allow(clippy::too_many_arguments, reason = "the parts of a checkpoint")]
fn save_checkpoint<M: Module>(
    model: &M,
    optim: &AdamW,
    run: &RunDir,
    step: u64,
    loader_position: u64,
    plan: &LoopPlan,
    started: Instant,
    config: &RunConfig,
) -> Result<PathBuf, TrainError> {
    let ids: HashMap<_, String> = param_entries(model)
        .into_iter()
        .map(|e| (e.id, e.path))
        .collect();
    let mut moments: Vec<(String, Vec<f32>, Vec<f32>)> = optim
        .moments
        .iter()
        .filter_map(|(id, (m, v))| ids.get(id).map(|p| (p.clone(), host(m), host(v))))
        .collect();
    moments.sort_by(|a, b| a.0.cmp(&b.0));
    let state = CheckpointState {
        step,
        loader_position,
        adam_steps: optim.steps,
        tokens_seen: plan.tokens_seen,
        wall_s: plan.wall_before + started.elapsed().as_secs_f64(),
        loss_scale: plan.scaler.map(|s| (s.scale, s.clean)),
        params: param_values(model),
        moments,
    };
    checkpoint::save(&run.checkpoints(), &state, config.checkpoint.keep)
}

/// Writes the model's parameters alone (the best model so far).
pub(crate) fn save_model<M: Module>(model: &M, path: &std::path::Path) -> Result<(), TrainError> {
    let state = CheckpointState {
        step: 0,
        loader_position: 0,
        adam_steps: 0,
        tokens_seen: 0,
        wall_s: 0.0,
        loss_scale: None,
        params: param_values(model),
        moments: Vec::new(),
    };
    checkpoint::save_file(path, &state)
}

/// Restores model, optimizer and counters from a checkpoint.
pub(crate) fn restore<M: Module>(
    model: M,
    optim: &mut AdamW,
    state: CheckpointState,
    path: &std::path::Path,
    train_device: &Device,
    optim_device: &Device,
) -> Result<(M, LoopPlanStart), TrainError> {
    let values: HashMap<String, (Vec<usize>, Vec<f32>)> = state
        .params
        .into_iter()
        .map(|(p, shape, v)| (p, (shape, v)))
        .collect();
    let model = crate::params::load_values(model, values, train_device).map_err(|why| {
        TrainError::CheckpointMismatch {
            path: path.to_path_buf(),
            why,
        }
    })?;
    let ids: HashMap<String, _> = param_entries(&model)
        .into_iter()
        .map(|e| (e.path, e.id))
        .collect();
    for (p, m, v) in state.moments {
        let id = ids.get(&p).ok_or_else(|| TrainError::CheckpointMismatch {
            path: path.to_path_buf(),
            why: format!("optimizer state for `{p}`, which the model lacks"),
        })?;
        let n = m.len();
        optim.moments.insert(
            *id,
            (
                tensor_from::<1>(m, &[n], optim_device),
                tensor_from::<1>(v, &[n], optim_device),
            ),
        );
    }
    optim.steps = state.adam_steps;
    Ok((
        model,
        LoopPlanStart {
            first_step: state.step + 1,
            loader_start: state.loader_position,
            tokens_seen: state.tokens_seen,
            wall_before: state.wall_s,
            loss_scale: state.loss_scale,
        },
    ))
}

/// The counters a restored run starts from.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LoopPlanStart {
    pub(crate) first_step: u64,
    pub(crate) loader_start: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) wall_before: f64,
    /// fp16's loss scale and its clean steps, where the run scaled its loss.
    pub(crate) loss_scale: Option<(f64, u64)>,
}

impl LoopPlanStart {
    /// The loss scaler a run continues with: the checkpoint's scale, else a
    /// fresh one as `config` sets it.
    pub(crate) fn scaler(&self, scaling: bool, config: &RunConfig) -> Option<LossScaler> {
        scaling.then(|| {
            let fresh = LossScaler::from_config(&config.precision);
            match self.loss_scale {
                Some((scale, clean)) => LossScaler {
                    scale,
                    clean,
                    ..fresh
                },
                None => fresh,
            }
        })
    }
}

/// Best score and evaluations since it, from a run's metric lines (for resume).
pub(crate) fn best_from_metrics(metrics: &[serde_json::Value]) -> (Option<f64>, usize) {
    let mut best: Option<f64> = None;
    let mut since = 0;
    for m in metrics.iter().filter(|m| m["kind"] == "eval") {
        if let Some(score) = m["score"].as_f64() {
            if best.is_none_or(|b| score > b) {
                best = Some(score);
                since = 0;
            } else {
                since += 1;
            }
        }
    }
    (best, since)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_weights_come_from_the_seed_not_the_first_step() {
        let config = crate::diagnose::tests::config(&[]);
        let gpt = kiln_model::GptConfig {
            vocab_size: 11,
            block_size: 8,
            layers: 1,
            heads: 2,
            hidden: 8,
            intermediate: 16,
            dropout: 0.0,
            gelu: kiln_model::GeluKind::Exact,
        };
        let draw = |reseed: bool| {
            let device = train_device(&config, &Device::flex(), 7);
            let model = init_model(&config, &device, false, 7, |d| gpt.init(d));
            if reseed {
                // What the loop does before each step.
                device.seed(12345);
            }
            param_values(&model)
        };
        assert_eq!(draw(false), draw(true));
    }

    #[test]
    fn non_finite_steps_are_skipped_then_stop_the_run() {
        let mut bad = BadSteps::new(3);
        assert_eq!(bad.check(1.0, 0.5), StepVerdict::Apply);
        assert!(matches!(
            bad.check(f32::NAN, 0.5),
            StepVerdict::Skip { in_a_row: 1, .. }
        ));
        assert!(matches!(
            bad.check(1.0, f64::INFINITY),
            StepVerdict::Skip { in_a_row: 2, ref what } if what.contains("gradient norm is inf")
        ));
        // A finite step resets the count.
        assert_eq!(bad.check(2.0, 1.0), StepVerdict::Apply);
        assert!(matches!(
            bad.check(f32::INFINITY, 1.0),
            StepVerdict::Skip { in_a_row: 1, .. }
        ));
        assert!(matches!(
            bad.check(f32::NAN, 1.0),
            StepVerdict::Skip { in_a_row: 2, .. }
        ));
        assert!(matches!(
            bad.check(f32::NAN, f64::NAN),
            StepVerdict::Stop { in_a_row: 3, ref what } if what.contains("loss is NaN")
        ));
        // max_bad_steps = 1 stops at the first.
        assert!(matches!(
            BadSteps::new(1).check(f32::NAN, 0.0),
            StepVerdict::Stop { .. }
        ));
    }
}
