//! The training loop every workload shares, as nanoGPT's reads: step,
//! log, evaluate, checkpoint — with early stopping, the best model kept,
//! and Ctrl-C writing a checkpoint. The step itself is [`train_step`];
//! a workload plugs in through [`Task`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use kiln_config::RunConfig;
use kiln_data::Loader;
use kiln_plan::Schedule;

use crate::checkpoint::{self, CheckpointState};
use crate::optim::AdamW;
use crate::params::{host, param_entries, param_values, tensor_from, weights_checksum};
use crate::precision::LossScaler;
use crate::records::{EvalRecord, Record, Skipped, StepMetrics};
use crate::report::{Event, Observer};
use crate::step::{StepState, StepVerdict, Untimed, train_step};
use crate::task::{StopAsked, Task};
use crate::{MemoryTracker, RunDir, TrainError, TrainOptions};

/// Stops a run after `patience` evaluations without a better score, and
/// remembers the best.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct EarlyStopping {
    /// `None`: never stop early.
    pub(crate) patience: Option<usize>,
    pub(crate) best: Option<f64>,
    pub(crate) since_best: usize,
}

impl EarlyStopping {
    /// The state a run had after `records` (for resume).
    pub(crate) fn from_records(patience: Option<usize>, records: &[Record]) -> Self {
        let mut stopping = Self {
            patience,
            ..Self::default()
        };
        for r in records {
            if let Record::Eval(EvalRecord {
                score: Some(score), ..
            }) = r
            {
                stopping.observe(*score);
            }
        }
        stopping
    }

    /// Takes an evaluation's score: whether it is the best so far. A score
    /// that is not finite (a diverged model's NaN loss) is never the best:
    /// as the first, it would be the best for the rest of the run, since
    /// nothing compares greater than NaN.
    pub(crate) fn observe(&mut self, score: f64) -> bool {
        if score.is_finite() && self.best.is_none_or(|b| score > b) {
            self.best = Some(score);
            self.since_best = 0;
            true
        } else {
            self.since_best += 1;
            false
        }
    }

    /// Whether patience has run out.
    pub(crate) fn should_stop(&self) -> bool {
        self.patience.is_some_and(|p| self.since_best >= p)
    }
}

/// Where a loop starts and what it is asked to do.
#[derive(Clone, Debug)]
pub(crate) struct LoopPlan {
    pub(crate) first_step: u64,
    pub(crate) schedule: Schedule,
    pub(crate) loader_start: u64,
    pub(crate) tokens_seen: u64,
    pub(crate) wall_before: f64,
    /// Also evaluate where an epoch ends, besides every `eval.eval_steps`.
    pub(crate) eval_at_epoch_ends: bool,
    pub(crate) stopping: EarlyStopping,
    /// The peak FLOP/s MFU is counted against.
    pub(crate) peak_flops: Option<f64>,
    /// fp16's loss scaler the loop starts from (`None`: bf16 or f32, no
    /// scaling); the step carries it on from there.
    pub(crate) scaler: Option<LossScaler>,
    /// The evaluation after `first_step - 1` was cut short by a stop and
    /// runs before the first step.
    pub(crate) eval_pending: bool,
}

/// How an evaluation ended.
enum Evaluated {
    /// Recorded; whether patience has run out.
    Done { stop_early: bool },
    /// A stop was asked before it ended: nothing recorded.
    CutShort,
}

/// Evaluates the model after `step`, records the evaluation, keeps the best
/// model and counts patience.
fn evaluate_at<T: Task>(
    task: &T,
    model: &T::Model,
    step: u64,
    plan: &mut LoopPlan,
    run: &RunDir,
    observer: &mut dyn Observer,
    stop: StopAsked<'_>,
) -> Result<Evaluated, TrainError> {
    let Some(eval) = task.evaluate(model, step, stop)? else {
        return Ok(Evaluated::CutShort);
    };
    let record = EvalRecord {
        step,
        metrics: eval.metrics,
        score: eval.score,
    };
    run.append(&Record::Eval(record.clone()))?;
    observer.event(&Event::Eval(record));
    let mut stop_early = false;
    if let Some(score) = eval.score {
        if plan.stopping.observe(score) && run.writes() {
            save_model(model, &run.file(checkpoint::BEST_MODEL), step)?;
        }
        stop_early = plan.stopping.should_stop();
    }
    Ok(Evaluated::Done { stop_early })
}

/// How a loop ended.
#[derive(Debug)]
pub(crate) enum LoopEnd {
    Finished,
    EarlyStopped,
    Interrupted { step: u64, checkpoint: PathBuf },
}

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
    options.saves_on_stop.store(true, Ordering::SeqCst);
    let saver = Saver {
        run,
        started: Instant::now(),
        config,
        group: options.group.as_deref(),
    };
    let total = plan.schedule.total_steps;
    let mut loader = Loader::new(
        task.source(),
        plan.loader_start,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let mut memory = MemoryTracker::for_device(device);
    let mut state = StepState::new(config, plan.scaler);
    state.group.clone_from(&options.group);
    let world = options.world_size();
    if let Some(group) = &options.group {
        // Every rank starts from the same weights: the same seed, or the
        // same checkpoint, on the same backend.
        group.check_same(
            weights_checksum(&model),
            "the weights every rank starts from",
        )?;
    }
    // In a job, a stop asked of any rank is agreed in the step's reduction
    // and taken by all after that step, or between two of an evaluation's
    // batches, agreed there; alone, it is taken before the next step, or
    // between two of an evaluation's batches.
    let mut stop_agreed = false;
    let stop_asked = match &options.group {
        Some(group) => StopAsked::Agreed {
            flag: &options.interrupt,
            group,
        },
        None => StopAsked::Alone(&options.interrupt),
    };
    if plan.eval_pending {
        let step = plan.first_step - 1;
        observer.event(&Event::Note(format!(
            "the evaluation after step {step} was cut short by the stop: it runs now"
        )));
        let stop_early = match evaluate_at(task, &model, step, plan, run, observer, stop_asked)? {
            Evaluated::CutShort => {
                let checkpoint = checkpoint::path_for(&run.checkpoints(), step);
                return Ok((model, LoopEnd::Interrupted { step, checkpoint }));
            }
            Evaluated::Done { stop_early } => stop_early,
        };
        // The checkpoint no longer owes it: written again without the
        // mark, so that a later resume does not evaluate twice.
        plan.eval_pending = false;
        let path = saver.save(&model, optim, step, plan.loader_start, plan, plan.scaler)?;
        observer.event(&Event::Checkpoint { step, path });
        if stop_early {
            return Ok((model, early_stopped(step, plan, observer)));
        }
    }
    let mut step = plan.first_step;
    while step <= total {
        let stop_now = match &options.group {
            Some(_) => stop_agreed,
            None => options.interrupt.load(Ordering::Relaxed),
        };
        if stop_now {
            let path = saver.save(
                &model,
                optim,
                step - 1,
                loader.position(),
                plan,
                state.scaler,
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
        device.seed(config.training.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let step_started = Instant::now();
        let lr = plan.schedule.lr_at(step);
        state.stop_asked = options.interrupt.load(Ordering::Relaxed);
        let (stepped, report) = train_step(
            task,
            model,
            optim,
            &mut state,
            &mut loader,
            device,
            lr,
            &config.training,
            &mut Untimed,
        )?;
        model = stepped;
        stop_agreed = report.stop;
        let elapsed = step_started.elapsed().as_secs_f64();
        match report.verdict {
            StepVerdict::Apply => {
                if let (Some(scale), Some(scaler)) = (report.scale_grown_to, state.scaler) {
                    run.append(&Record::LossScale {
                        step,
                        scale,
                        why: format!("{} clean steps in a row", scaler.growth_interval),
                    })?;
                }
            }
            StepVerdict::Overflow { to, overflows } => {
                let record = Skipped {
                    step,
                    why: "fp16 gradients overflowed".into(),
                    loss_scale: Some(to),
                    overflows: Some(overflows),
                    in_a_row: None,
                };
                run.append(&Record::Skipped(record.clone()))?;
                observer.event(&Event::Skipped {
                    record,
                    max_bad_steps: state.bad_steps.max,
                });
            }
            StepVerdict::Skip { what, in_a_row } => {
                let record = Skipped {
                    step,
                    why: what,
                    loss_scale: None,
                    overflows: None,
                    in_a_row: Some(in_a_row),
                };
                run.append(&Record::Skipped(record.clone()))?;
                observer.event(&Event::Skipped {
                    record,
                    max_bad_steps: state.bad_steps.max,
                });
            }
            StepVerdict::Stop { what, in_a_row } => {
                return Err(TrainError::NonFinite {
                    step,
                    what,
                    in_a_row,
                });
            }
        }
        let work = report.work;
        plan.tokens_seen += work.tokens as u64;

        let last = step == total;
        if step.is_multiple_of(config.logging.logging_steps as u64)
            || last
            || step == plan.first_step
        {
            let (current, peak_mem) = memory.sample();
            let metrics = StepMetrics {
                step,
                loss: f64::from(report.loss),
                lr,
                grad_norm: report.grad_norm,
                ms_per_step: elapsed * 1e3,
                tokens_per_s: work.tokens as f64 / elapsed,
                samples_per_s: work.samples as f64 / elapsed,
                mfu: plan
                    .peak_flops
                    .map(|p| work.flops / elapsed / (p * world as f64)),
                data_wait_pct: 100.0 * report.waited.as_secs_f64() / elapsed,
                comm_pct: report.reduced_in.map(|d| 100.0 * d.as_secs_f64() / elapsed),
                memory_bytes: current,
                peak_memory_bytes: peak_mem,
                device_memory: memory.on_gpu(),
                tokens_seen: plan.tokens_seen,
            };
            run.append(&Record::Step(metrics.clone()))?;
            observer.event(&Event::Step(metrics));
        }
        let epoch_end = plan.eval_at_epoch_ends && plan.schedule.ends_epoch(step);
        let mut stop = false;
        if step.is_multiple_of(config.eval.eval_steps as u64) || epoch_end || last {
            match evaluate_at(task, &model, step, plan, run, observer, stop_asked)? {
                Evaluated::Done { stop_early } => stop = stop_early,
                Evaluated::CutShort => {
                    // The step is done: its checkpoint owes the evaluation,
                    // which a resume runs first.
                    plan.eval_pending = true;
                    let path =
                        saver.save(&model, optim, step, loader.position(), plan, state.scaler)?;
                    observer.event(&Event::Note(format!(
                        "the evaluation after step {step} was cut short by the stop; \
                         a resume runs it first"
                    )));
                    return Ok((
                        model,
                        LoopEnd::Interrupted {
                            step,
                            checkpoint: path,
                        },
                    ));
                }
            }
        }
        if step.is_multiple_of(config.checkpoint.every_steps as u64) || last || stop {
            if let Some(group) = &options.group {
                // The ranks still hold the same weights (every checkpoint:
                // what rank 0 saves is what every rank trains on).
                group.check_same(
                    weights_checksum(&model),
                    &format!("the weights after step {step}"),
                )?;
            }
            let path = saver.save(&model, optim, step, loader.position(), plan, state.scaler)?;
            observer.event(&Event::Checkpoint { step, path });
        }
        if stop {
            return Ok((model, early_stopped(step, plan, observer)));
        }
        step += 1;
    }
    Ok((model, LoopEnd::Finished))
}

/// Says that the run stops early after `step`'s evaluation.
fn early_stopped(step: u64, plan: &LoopPlan, observer: &mut dyn Observer) -> LoopEnd {
    observer.event(&Event::EarlyStopped {
        step,
        evaluations: plan.stopping.since_best,
    });
    LoopEnd::EarlyStopped
}

/// What a loop's checkpoints are written with, besides the model, the
/// optimizer and the counters.
struct Saver<'a> {
    run: &'a RunDir,
    /// When this session of the run began (the wall time it adds).
    started: Instant,
    config: &'a RunConfig,
    group: Option<&'a kiln_dist::Group>,
}

impl Saver<'_> {
    /// Writes the checkpoint after `step` (in a job, rank 0 writes it and
    /// the others name it).
    fn save<M: Module>(
        &self,
        model: &M,
        optim: &AdamW,
        step: u64,
        loader_position: u64,
        plan: &LoopPlan,
        scaler: Option<LossScaler>,
    ) -> Result<PathBuf, TrainError> {
        let Self {
            run,
            started,
            config,
            group,
        } = *self;
        // ZeRO-1: every rank sends its share of the moments to rank 0.
        let zero_group = group.filter(|_| optim.shard.is_some());
        if !run.writes() && zero_group.is_none() {
            // Rank 0 writes the job's checkpoint; this rank names it.
            return Ok(checkpoint::path_for(&run.checkpoints(), step));
        }
        let ids: HashMap<_, String> = param_entries(model)
            .into_iter()
            .map(|e| (e.id, e.path))
            .collect();
        let mut moments: Vec<(String, Vec<f32>, Vec<f32>)> = optim
            .moments
            .iter()
            .filter_map(|(id, (m, v))| ids.get(id).map(|p| (p.clone(), host(m), host(v))))
            .collect();
        if let Some(group) = zero_group {
            // Rank 0 gathers every rank's moments, so that the checkpoint
            // holds them all (a resume at any world size).
            let Some(all) = group.gather_to_root(&crate::zero::encode_moments(&moments))? else {
                return Ok(checkpoint::path_for(&run.checkpoints(), step));
            };
            for (rank, bytes) in all.iter().enumerate().skip(1) {
                moments.extend(crate::zero::decode_moments(bytes).ok_or_else(|| {
                    kiln_dist::DistError::Diverged(format!(
                        "rank {rank} sent {} bytes of AdamW moments that do not read back",
                        bytes.len()
                    ))
                })?);
            }
        }
        moments.sort_by(|a, b| a.0.cmp(&b.0));
        let state = CheckpointState {
            step,
            loader_position,
            adam_steps: optim.steps,
            tokens_seen: plan.tokens_seen,
            wall_s: plan.wall_before + started.elapsed().as_secs_f64(),
            loss_scale: scaler.map(|s| (s.scale, s.clean)),
            world_size: group.map_or(1, kiln_dist::Group::world_size) as u64,
            eval_pending: plan.eval_pending,
            params: param_values(model),
            moments,
        };
        checkpoint::save(&run.checkpoints(), &state, config.checkpoint.keep)
    }
}

/// Writes the model's parameters alone (the best model so far, after
/// optimizer step `step`).
pub(crate) fn save_model<M: Module>(
    model: &M,
    path: &std::path::Path,
    step: u64,
) -> Result<(), TrainError> {
    checkpoint::save_params(path, step, param_values(model))
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
        if !optim.keeps(*id) {
            // ZeRO-1: another rank's share.
            continue;
        }
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
            eval_pending: state.eval_pending,
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
    /// The checkpoint's evaluation was cut short by a stop.
    pub(crate) eval_pending: bool,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_stopping_counts_evaluations_since_the_best() {
        let mut s = EarlyStopping {
            patience: Some(2),
            ..EarlyStopping::default()
        };
        assert!(s.observe(0.5));
        assert!(!s.observe(0.4));
        assert!(!s.should_stop());
        assert!(!s.observe(0.5), "equal is not better");
        assert!(s.should_stop());
        assert!(s.observe(0.6));
        assert!(!s.should_stop());
        // Never without patience.
        let mut never = EarlyStopping::default();
        for _ in 0..10 {
            never.observe(0.0);
        }
        assert!(!never.should_stop());
    }

    #[test]
    fn a_score_that_is_not_finite_is_never_the_best() {
        let mut s = EarlyStopping::default();
        assert!(!s.observe(f64::NAN), "a first NaN is not a best");
        assert!(s.observe(-3.0), "the first finite score is");
        assert!(!s.observe(f64::NAN));
        assert!(!s.observe(f64::INFINITY));
        assert!(s.observe(-2.0));
        assert_eq!(s.best, Some(-2.0));
        assert_eq!(s.since_best, 0);
    }
}
