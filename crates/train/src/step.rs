//! One optimizer step, the function training runs and `kiln bench` times:
//! `gradient_accumulation_steps` micro-batches (data, upload, forward,
//! backward with the loss scaled for fp16 and divided by the accumulation,
//! so that the summed gradients are their mean), the global gradient norm,
//! the non-finite check and fp16's loss scaler, then the clipped AdamW
//! update — or none, where the step is skipped.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use kiln_config::{RunConfig, TrainingSection};
use kiln_data::Loader;

use crate::TrainError;
use crate::optim::{AdamW, global_grad_norm};
use crate::precision::{LossScaler, ScaleVerdict};
use crate::task::{Task, Work};

/// The phases of a step, in the order they end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for the loader.
    Data,
    /// The host-to-device copy.
    Upload,
    Forward,
    Backward,
    /// In a data-parallel job: the gradients' all-reduce, or ZeRO-2's
    /// reduce-scatter and the norm's small all-reduce (the wait for the
    /// slowest rank included).
    Reduce,
    /// Norm, checks and the update.
    Optimizer,
    /// ZeRO-1 or ZeRO-2 in a job: the all-gather of the updated weights.
    Gather,
}

/// Told when each phase of a step ends (once per micro-batch for the first
/// four). Training's timer does nothing; `kiln bench`'s synchronises the
/// device and records the phase's time.
pub(crate) trait PhaseTimer {
    fn end(&mut self, phase: Phase);
}

/// The timer of a training run: no synchronisation, nothing recorded.
#[derive(Debug)]
pub(crate) struct Untimed;

impl PhaseTimer for Untimed {
    fn end(&mut self, _: Phase) {}
}

/// Counts steps in a row whose loss or gradient norm is not finite.
#[derive(Debug)]
pub(crate) struct BadSteps {
    pub(crate) max: usize,
    in_a_row: usize,
}

/// What became of a step's gradients.
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

/// What carries from one step to the next besides the model and the
/// optimizer: fp16's loss scaler and the count of bad steps.
#[derive(Debug)]
pub(crate) struct StepState {
    pub(crate) scaler: Option<LossScaler>,
    pub(crate) bad_steps: BadSteps,
    /// The data-parallel job this process is a rank of, if any.
    pub(crate) group: Option<Arc<kiln_dist::Group>>,
    /// Set by the loop before a step: this rank was asked to stop (Ctrl-C,
    /// SIGTERM). In a job the ranks agree on it in the step's reduction.
    pub(crate) stop_asked: bool,
    /// In a job: the type the gradients are averaged in.
    pub(crate) reduce_dtype: kiln_config::ReduceDtype,
}

impl StepState {
    pub(crate) fn new(config: &RunConfig, scaler: Option<LossScaler>) -> Self {
        Self {
            scaler,
            bad_steps: BadSteps::new(config.precision.max_bad_steps),
            group: None,
            stop_asked: false,
            reduce_dtype: config.precision.reduce_dtype,
        }
    }
}

/// What one step did.
#[derive(Debug)]
pub(crate) struct StepReport {
    /// The mean loss over the micro-batches.
    pub(crate) loss: f32,
    /// The global gradient norm, unscaled, before clipping.
    pub(crate) grad_norm: f64,
    pub(crate) verdict: StepVerdict,
    /// fp16: the loss scale after it grew in this step.
    pub(crate) scale_grown_to: Option<f64>,
    pub(crate) work: Work,
    /// Time spent waiting for the loader.
    pub(crate) waited: Duration,
    /// Some rank was asked to stop: every rank stops after this step.
    pub(crate) stop: bool,
    /// In a job: the time the gradients' all-reduce took (the wait for the
    /// slowest rank and the copies to and from the host included), and
    /// under ZeRO the all-gather of the updated weights.
    pub(crate) reduced_in: Option<Duration>,
}

thread_local! {
    static STEPS_RUN: Cell<u64> = const { Cell::new(0) };
}

/// How many times [`train_step`] has run on this thread (for tests that
/// check which step a caller runs).
#[cfg(test)]
pub(crate) fn steps_run() -> u64 {
    STEPS_RUN.with(Cell::get)
}

/// Runs one optimizer step of `task` at learning rate `lr`. In a
/// data-parallel job the gradients, the loss and the stop flag are
/// averaged across the ranks after the last micro-batch (none during
/// accumulation, as DDP's `no_sync`), before the norm, the checks and
/// clipping; the work reported is the whole job's. Fails only where the
/// job does (a rank gone).
#[allow(clippy::too_many_arguments, reason = "the parts of a step")]
pub(crate) fn train_step<T: Task>(
    task: &T,
    model: T::Model,
    optim: &mut AdamW,
    state: &mut StepState,
    loader: &mut Loader<T::Source>,
    device: &Device,
    lr: f64,
    training: &TrainingSection,
    timer: &mut dyn PhaseTimer,
) -> Result<(T::Model, StepReport), TrainError> {
    STEPS_RUN.with(|n| n.set(n.get() + 1));
    let accum = training.gradient_accumulation_steps.max(1);
    let loss_scale = state.scaler.map_or(1.0, |s| s.scale);
    // Dividing by the accumulation steps makes the summed gradients an
    // average; fp16's loss scale multiplies them (the update divides it out).
    let factor = loss_scale / accum as f64;
    let mut work = Work::default();
    let mut waited = Duration::ZERO;
    let mut loss_sum: Option<Tensor<1>> = None;
    let mut accumulator = GradientsAccumulator::<T::Model>::new();
    let mut single: Option<GradientsParams> = None;
    for _ in 0..accum {
        let loaded = loader.next_batch()?;
        waited += loaded.wait;
        timer.end(Phase::Data);
        work += task.work(&loaded.batch);
        let inputs = task.upload(&loaded.batch, device);
        timer.end(Phase::Upload);
        let loss = task.loss(&model, inputs);
        timer.end(Phase::Forward);
        loss_sum = Some(match loss_sum.take() {
            Some(s) => s.add(loss.clone().detach()),
            None => loss.clone().detach(),
        });
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
        timer.end(Phase::Backward);
    }
    let mut grads = single.unwrap_or_else(|| accumulator.grads());
    let mut loss = loss_sum.map_or(f32::NAN, |l| l.into_scalar::<f32>()) / accum as f32;
    let mut stop = state.stop_asked;
    let mut reduced_in = None;
    // ZeRO-2: the norm comes with the reduce-scatter, each rank holding
    // its share of the gradients alone.
    let mut scattered_norm = None;
    if let Some(group) = &state.group {
        let started = std::time::Instant::now();
        let mut extra = [loss, if stop { 1.0 } else { 0.0 }];
        match optim.shard.as_ref().filter(|s| s.scatters_grads()) {
            Some(shard) => {
                let (mine, norm) = crate::zero::reduce_scatter_grads(
                    &model,
                    grads,
                    &mut extra,
                    shard,
                    group,
                    state.reduce_dtype,
                    optim.kernels,
                )?;
                grads = mine;
                scattered_norm = Some(norm);
            }
            None => {
                grads = crate::params::all_reduce_grads(
                    &model,
                    grads,
                    &mut extra,
                    group,
                    state.reduce_dtype,
                )?;
            }
        }
        loss = extra[0];
        stop = extra[1] > 0.0;
        reduced_in = Some(started.elapsed());
        work = work.times(group.world_size());
        timer.end(Phase::Reduce);
    }
    let grad_norm = scattered_norm
        .unwrap_or_else(|| global_grad_norm(&model, &grads, optim.kernels))
        / loss_scale;
    let verdict = match state.scaler.as_mut() {
        Some(scaler) if loss.is_finite() && !grad_norm.is_finite() && scaler.can_back_off() => {
            scaler.update(false);
            StepVerdict::Overflow {
                to: scaler.scale,
                overflows: scaler.overflows,
            }
        }
        _ => state.bad_steps.check(loss, grad_norm),
    };
    let mut scale_grown_to = None;
    let model = if verdict == StepVerdict::Apply {
        let clip = if training.grad_clip > 0.0 && grad_norm > training.grad_clip {
            training.grad_clip / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let mut model = optim.step(model, grads, lr, clip / loss_scale);
        timer.end(Phase::Optimizer);
        if let (Some(shard), Some(group)) = (&optim.shard, &state.group) {
            // ZeRO: this rank updated its share; every rank gets the rest.
            let started = std::time::Instant::now();
            model = crate::zero::all_gather_weights(model, shard, group)?;
            reduced_in = reduced_in.map(|d| d + started.elapsed());
            timer.end(Phase::Gather);
        }
        if let Some(scaler) = state.scaler.as_mut()
            && scaler.update(true) == (ScaleVerdict::Apply { grown: true })
        {
            scale_grown_to = Some(scaler.scale);
        }
        model
    } else {
        // No update: the weights and the optimizer state stay as they
        // were, finite, and so does every checkpoint. (Every rank has the
        // same verdict: the reduced loss and norm are the same bits.)
        timer.end(Phase::Optimizer);
        model
    };
    let report = StepReport {
        loss,
        grad_norm,
        verdict,
        scale_grown_to,
        work,
        waited,
        stop,
        reduced_in,
    };
    Ok((model, report))
}

#[cfg(test)]
mod tests {
    use super::*;

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
