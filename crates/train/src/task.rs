//! What a workload gives the step and the loop: its batches, how a batch
//! reaches the device, its loss, the work a batch represents and its
//! evaluation.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use kiln_data::BatchSource;

/// The work one batch represents.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Work {
    pub(crate) samples: usize,
    /// Tokens that carry data (no padding).
    pub(crate) tokens: usize,
    /// Tokens computed on, padding included.
    pub(crate) padded_tokens: usize,
    /// Model FLOPs of one training step (forward and backward) on the batch.
    pub(crate) flops: f64,
}

impl Work {
    /// The work of `n` ranks that each did this (a data-parallel job's step).
    pub(crate) fn times(self, n: usize) -> Self {
        Self {
            samples: self.samples * n,
            tokens: self.tokens * n,
            padded_tokens: self.padded_tokens * n,
            flops: self.flops * n as f64,
        }
    }
}

impl std::ops::AddAssign for Work {
    fn add_assign(&mut self, w: Self) {
        self.samples += w.samples;
        self.tokens += w.tokens;
        self.padded_tokens += w.padded_tokens;
        self.flops += w.flops;
    }
}

/// One evaluation: its metrics, and a score (higher is better) for keeping
/// the best model and early stopping.
#[derive(Clone, Debug)]
pub(crate) struct Evaluation {
    pub(crate) metrics: crate::records::EvalMetrics,
    pub(crate) score: Option<f64>,
}

/// What an evaluation asks between its batches: whether a stop (Ctrl-C,
/// SIGTERM) was asked, so that a long evaluation does not outlast a
/// scheduler's grace period.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StopAsked<'a> {
    /// A run alone: its own flag.
    Alone(&'a AtomicBool),
    /// A rank of a job: whether any rank's flag is set, agreed by a
    /// reduction each time it is asked, so that every rank cuts the
    /// evaluation short at the same batch (one cut short alone would leave
    /// the others waiting in a collective). Every rank evaluates the same
    /// batches, so each asks as often.
    Agreed {
        flag: &'a AtomicBool,
        group: &'a kiln_dist::Group,
    },
}

impl StopAsked<'_> {
    /// Whether to stop now; an error where a rank could not be reached.
    pub(crate) fn now(self) -> Result<bool, crate::TrainError> {
        match self {
            Self::Alone(flag) => Ok(flag.load(Ordering::Relaxed)),
            Self::Agreed { flag, group } => {
                let mut asked = [if flag.load(Ordering::Relaxed) {
                    1.0
                } else {
                    0.0
                }];
                group.all_reduce(&mut asked, kiln_dist::Reduce::Max)?;
                Ok(asked[0] > 0.0)
            }
        }
    }
}

/// A workload: its model, its batches, its loss and its evaluation.
pub(crate) trait Task {
    type Model: Module;
    type Source: BatchSource;
    /// A batch as tensors on the device.
    type Inputs;

    fn source(&self) -> Arc<Self::Source>;
    /// The host-to-device copy of a batch.
    fn upload(&self, batch: &<Self::Source as BatchSource>::Batch, device: &Device)
    -> Self::Inputs;
    /// The forward pass to the mean loss of the batch.
    fn loss(&self, model: &Self::Model, inputs: Self::Inputs) -> Tensor<1>;
    fn work(&self, batch: &<Self::Source as BatchSource>::Batch) -> Work;
    /// The evaluation after optimizer step `step`: `None` where a stop
    /// was asked before it ended; an error where its data can no longer be
    /// read.
    fn evaluate(
        &self,
        model: &Self::Model,
        step: u64,
        stop: StopAsked<'_>,
    ) -> Result<Option<Evaluation>, crate::TrainError>;
}
