//! How many optimizer steps a run makes, where its epochs end, and its
//! learning rate at each step: counted once, here, for the run, `kiln
//! diagnose` and the time estimate alike.

use std::f64::consts::PI;

use kiln_config::{LrSchedule, TrainingSection};

/// A run's step schedule. The loader is one stream of micro-batches (epoch
/// after epoch, reshuffled); an optimizer step takes
/// `gradient_accumulation_steps` of them. A run by epochs takes every full
/// group of `epochs` passes (`⌊batches_per_epoch · epochs / accumulation⌋`
/// steps, at least one); a run by `max_steps` takes that many.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    /// Micro-batches in one pass over the training data.
    pub batches_per_epoch: u64,
    /// Micro-batches per optimizer step.
    pub accumulation: u64,
    /// Optimizer steps the run makes.
    pub total_steps: u64,
    /// Linear warm-up steps before the decay: `warmup_steps`, or
    /// ⌈`warmup_ratio` × `total_steps`⌉ where the ratio is above 0.
    pub warmup_steps: u64,
    /// The peak learning rate.
    pub learning_rate: f64,
    /// Where the decay ends.
    pub min_lr: f64,
    /// The course after the warm-up.
    pub kind: LrSchedule,
    /// `LrSchedule::Wsd`: the share of the steps after the warm-up that
    /// decay.
    pub decay_fraction: f64,
}

impl Schedule {
    /// The schedule of `training` over data of `batches_per_epoch` micro-batches.
    pub fn new(training: &TrainingSection, batches_per_epoch: u64) -> Self {
        let batches_per_epoch = batches_per_epoch.max(1);
        let accumulation = (training.gradient_accumulation_steps as u64).max(1);
        let total_steps = if training.max_steps > 0 {
            training.max_steps as u64
        } else {
            (batches_per_epoch * training.epochs as u64 / accumulation).max(1)
        };
        Self {
            batches_per_epoch,
            accumulation,
            total_steps,
            warmup_steps: if training.warmup_ratio > 0.0 {
                (training.warmup_ratio * total_steps as f64).ceil() as u64
            } else {
                training.warmup_steps as u64
            },
            learning_rate: training.learning_rate,
            min_lr: training.min_lr,
            kind: training.lr_schedule,
            decay_fraction: training.decay_fraction,
        }
    }

    /// Optimizer steps per pass over the data (a fraction where the
    /// accumulation does not divide the batches).
    pub fn steps_per_epoch(&self) -> f64 {
        self.batches_per_epoch as f64 / self.accumulation as f64
    }

    /// Passes over the training data the run makes.
    pub fn epochs(&self) -> f64 {
        (self.total_steps * self.accumulation) as f64 / self.batches_per_epoch as f64
    }

    /// Whether optimizer step `step` (1-based) takes the last micro-batch of
    /// an epoch: where a run by epochs evaluates.
    pub fn ends_epoch(&self, step: u64) -> bool {
        let epoch_of = |micro_batches: u64| micro_batches / self.batches_per_epoch;
        step > 0 && epoch_of(step * self.accumulation) > epoch_of((step - 1) * self.accumulation)
    }

    /// The learning rate at `step` (1-based): linear warm-up to the peak
    /// over the warm-up steps, then [`LrSchedule`]'s course ([`lr_at`] for
    /// the cosine).
    pub fn lr_at(&self, step: u64) -> f64 {
        let (max_lr, min_lr) = (self.learning_rate, self.min_lr);
        let (warmup, total) = (self.warmup_steps, self.total_steps);
        if warmup > 0 && step <= warmup {
            return max_lr * step as f64 / warmup as f64;
        }
        // A line from the peak after step `from` to min_lr at the last step.
        let line_from = |from: u64| {
            let into = step.saturating_sub(from) as f64 / total.saturating_sub(from).max(1) as f64;
            max_lr + into.min(1.0) * (min_lr - max_lr)
        };
        match self.kind {
            LrSchedule::Cosine => lr_at(step, max_lr, min_lr, warmup, total),
            LrSchedule::Linear => line_from(warmup),
            LrSchedule::Constant => max_lr,
            LrSchedule::Wsd => line_from(total.saturating_sub(self.decay_steps()).max(warmup)),
        }
    }

    /// `LrSchedule::Wsd`'s decay: `decay_fraction` of the steps after the
    /// warm-up, rounded, at least one.
    pub fn decay_steps(&self) -> u64 {
        let after = self.total_steps.saturating_sub(self.warmup_steps);
        ((after as f64 * self.decay_fraction).round() as u64).clamp(1, after.max(1))
    }
}

/// The learning rate at optimizer step `step` (1-based): linear warm-up to
/// `max_lr` over `warmup` steps, then cosine decay to `min_lr` at `total`.
pub fn lr_at(step: u64, max_lr: f64, min_lr: f64, warmup: u64, total: u64) -> f64 {
    if warmup > 0 && step <= warmup {
        return max_lr * step as f64 / warmup as f64;
    }
    if step >= total {
        return min_lr;
    }
    let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
    min_lr + 0.5 * (1.0 + (PI * progress).cos()) * (max_lr - min_lr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn training(accumulation: usize, epochs: usize, max_steps: usize) -> TrainingSection {
        let mut t = crate::tests::training();
        t.gradient_accumulation_steps = accumulation;
        t.epochs = epochs;
        t.max_steps = max_steps;
        t
    }

    #[test]
    fn epochs_take_every_full_accumulation_group() {
        // 10 batches an epoch, 3 epochs, accumulation 4: 30 micro-batches,
        // 7 whole steps (the loader streams on across epoch ends).
        let s = Schedule::new(&training(4, 3, 0), 10);
        assert_eq!(s.total_steps, 7);
        assert!((s.steps_per_epoch() - 2.5).abs() < 1e-12);
        // Epochs end in steps 3 (micro-batch 10 of 9..12), 5 (20) and — the
        // third epoch's last two micro-batches are left over — none after.
        let ends: Vec<u64> = (1..=s.total_steps).filter(|&k| s.ends_epoch(k)).collect();
        assert_eq!(ends, vec![3, 5]);
        // Without accumulation every batch is a step.
        let plain = Schedule::new(&training(1, 3, 0), 10);
        assert_eq!(plain.total_steps, 30);
        let ends: Vec<u64> = (1..=30).filter(|&k| plain.ends_epoch(k)).collect();
        assert_eq!(ends, vec![10, 20, 30]);
        // max_steps wins; a tiny data set still makes one step.
        assert_eq!(Schedule::new(&training(4, 3, 100), 10).total_steps, 100);
        assert_eq!(Schedule::new(&training(8, 1, 0), 3).total_steps, 1);
    }

    #[test]
    fn a_warm_up_ratio_is_that_share_of_the_run_rounded_up_in_place_of_its_steps() {
        let mut t = training(1, 3, 0);
        (t.warmup_steps, t.warmup_ratio) = (100, 0.1);
        // 3 epochs of 75 batches: 225 steps, 22.5 of them warm up → 23.
        let s = Schedule::new(&t, 75);
        assert_eq!((s.total_steps, s.warmup_steps), (225, 23));
        assert!((s.lr_at(23) - t.learning_rate).abs() < 1e-15);
        assert!(s.lr_at(22) < t.learning_rate);
        // The same share of a corpus ten times the size.
        assert_eq!(Schedule::new(&t, 750).warmup_steps, 225);
        // 0: the steps decide.
        t.warmup_ratio = 0.0;
        assert_eq!(Schedule::new(&t, 75).warmup_steps, 100);
    }

    #[test]
    fn linear_and_constant_warm_up_alike_then_decay_in_a_line_or_hold() {
        let mut t = training(1, 1, 110);
        (t.learning_rate, t.min_lr, t.warmup_steps) = (1e-3, 1e-4, 10);
        let at = |kind, step| {
            let mut t = t.clone();
            t.lr_schedule = kind;
            Schedule::new(&t, 10).lr_at(step)
        };
        for kind in [LrSchedule::Linear, LrSchedule::Constant, LrSchedule::Cosine] {
            assert!((at(kind, 5) - 5e-4).abs() < 1e-12, "{kind:?}");
            assert!((at(kind, 10) - 1e-3).abs() < 1e-12, "{kind:?}");
        }
        // Linear: halfway down at the middle of the decay, min_lr at the end.
        assert!((at(LrSchedule::Linear, 60) - 5.5e-4).abs() < 1e-12);
        assert!((at(LrSchedule::Linear, 35) - 7.75e-4).abs() < 1e-12);
        assert!((at(LrSchedule::Linear, 110) - 1e-4).abs() < 1e-12);
        // The cosine is above the line in the first half of the decay.
        assert!(at(LrSchedule::Cosine, 35) > at(LrSchedule::Linear, 35));
        assert!((at(LrSchedule::Constant, 109) - 1e-3).abs() < 1e-12);
    }

    #[test]
    fn wsd_holds_the_peak_then_decays_in_a_line_over_its_share() {
        let mut t = training(1, 1, 110);
        (t.learning_rate, t.min_lr, t.warmup_steps) = (1e-3, 1e-4, 10);
        (t.lr_schedule, t.decay_fraction) = (LrSchedule::Wsd, 0.2);
        let s = Schedule::new(&t, 10);
        // 100 steps after the warm-up: the last 20 decay, 90 → 110.
        assert_eq!(s.decay_steps(), 20);
        assert!((s.lr_at(5) - 5e-4).abs() < 1e-12);
        for step in [10, 11, 60, 90] {
            assert!((s.lr_at(step) - 1e-3).abs() < 1e-12, "step {step}");
        }
        assert!((s.lr_at(100) - 5.5e-4).abs() < 1e-12, "{}", s.lr_at(100));
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-12);
        assert!((s.lr_at(111) - 1e-4).abs() < 1e-12);
        // All of it: the linear schedule.
        t.decay_fraction = 1.0;
        let all = Schedule::new(&t, 10);
        t.lr_schedule = LrSchedule::Linear;
        let linear = Schedule::new(&t, 10);
        for step in [1, 10, 35, 60, 109, 110] {
            assert!(
                (all.lr_at(step) - linear.lr_at(step)).abs() < 1e-15,
                "step {step}"
            );
        }
        // A tiny share of a short run still decays over one step.
        t.max_steps = 12;
        (t.lr_schedule, t.decay_fraction) = (LrSchedule::Wsd, 0.01);
        let short = Schedule::new(&t, 10);
        assert_eq!(short.decay_steps(), 1);
        assert!((short.lr_at(11) - 1e-3).abs() < 1e-12);
        assert!((short.lr_at(12) - 1e-4).abs() < 1e-12);
    }

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let lr = |s| lr_at(s, 1e-3, 1e-4, 10, 110);
        assert!((lr(1) - 1e-4).abs() < 1e-12);
        assert!((lr(10) - 1e-3).abs() < 1e-12);
        assert!((lr(60) - 5.5e-4).abs() < 1e-9, "{}", lr(60));
        assert!((lr(110) - 1e-4).abs() < 1e-12);
        assert!((lr(500) - 1e-4).abs() < 1e-12);
    }
}
