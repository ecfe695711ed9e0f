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
    /// the others waiting in a collective). The ranks share an
    /// evaluation's batches ([`evaluate_shared`]), each asking as often.
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

/// Runs an evaluation's `n` batches, `run(i)` giving batch `i`'s result
/// (its loss, the classes predicted), and returns every result in batch order; `None` where `stop`
/// was asked between two of them. A job's ranks share the batches, as
/// their training batches are: rank `r` runs those with `i % world == r`
/// (asking `stop` before each round of `world`, every rank as often), and
/// one all-gather gives every rank all the results. So a job evaluates in
/// `1/world` of the time, and every rank holds the same results — the
/// ones a single process would, batch for batch — whence the same
/// metrics, best model and early stop.
pub(crate) fn evaluate_shared(
    n: usize,
    stop: StopAsked<'_>,
    mut run: impl FnMut(usize) -> Result<Vec<f32>, crate::TrainError>,
) -> Result<Option<Vec<Vec<f32>>>, crate::TrainError> {
    let group = match stop {
        StopAsked::Alone(_) => None,
        StopAsked::Agreed { group, .. } => Some(group),
    };
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let mut mine = Vec::new();
    for round in 0..n.div_ceil(world) {
        if stop.now()? {
            return Ok(None);
        }
        let i = round * world + rank;
        if i < n {
            mine.push(run(i)?);
        }
    }
    let Some(group) = group else {
        return Ok(Some(mine));
    };
    // Each rank's results, each after its length, in one message of f32s
    // (bit for bit; a length is exact in an f32 below 2^24).
    let mut frame = Vec::new();
    for r in &mine {
        frame.extend_from_slice(&(r.len() as f32).to_le_bytes());
        frame.extend(r.iter().flat_map(|v| v.to_le_bytes()));
    }
    let gathered = group.all_gather(&frame)?;
    let mut per_rank: Vec<std::vec::IntoIter<Vec<f32>>> = Vec::with_capacity(world);
    for (from, bytes) in gathered.iter().enumerate() {
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut results = Vec::new();
        let mut rest = values.as_slice();
        while let Some((&len, after)) = rest.split_first() {
            let (result, after) = after.split_at_checked(len as usize).ok_or_else(|| {
                kiln_dist::DistError::Diverged(format!(
                    "rank {from} sent an evaluation's results cut short"
                ))
            })?;
            results.push(result.to_vec());
            rest = after;
        }
        per_rank.push(results.into_iter());
    }
    // Batch i is rank i % world's (i / world)-th, taken in turn.
    let mut all = Vec::new();
    for i in 0..n {
        let result = per_rank[i % world].next().ok_or_else(|| {
            kiln_dist::DistError::Diverged(format!(
                "rank {} sent fewer evaluation results than its batches {}, {}, …",
                i % world,
                i % world,
                i % world + world
            ))
        })?;
        all.push(result);
    }
    Ok(Some(all))
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use kiln_dist::{Group, WorldSpec};

    use super::{StopAsked, evaluate_shared};

    /// `f(group)` on `world` ranks, threads of this process.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(Group) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let spec = WorldSpec::local(rank, world, port);
                    f(Group::connect(&spec, Duration::from_secs(20)).expect("joins"))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().expect("rank")).collect()
    }

    /// Batch `i`'s result: its index, and as many values again.
    fn result(i: usize) -> Vec<f32> {
        std::iter::once(i as f32)
            .chain((0..i).map(|v| v as f32 / 3.0))
            .collect()
    }

    #[test]
    fn ranks_share_an_evaluations_batches_and_all_get_every_result_in_order() {
        let alone = AtomicBool::new(false);
        let one = evaluate_shared(7, StopAsked::Alone(&alone), |i| Ok(result(i)))
            .expect("evaluates")
            .expect("not stopped");
        assert_eq!(one, (0..7).map(result).collect::<Vec<_>>());
        let out = on_ranks(3, |group| {
            let flag = AtomicBool::new(false);
            let mut ran = Vec::new();
            let stop = StopAsked::Agreed {
                flag: &flag,
                group: &group,
            };
            let all = evaluate_shared(7, stop, |i| {
                ran.push(i);
                Ok(result(i))
            })
            .expect("evaluates");
            (group.rank(), ran, all)
        });
        for (rank, ran, all) in out {
            let share: Vec<usize> = (0..7).filter(|i| i % 3 == rank).collect();
            assert_eq!(ran, share, "rank {rank} ran its share alone");
            assert_eq!(all.as_ref(), Some(&one), "rank {rank}");
        }
    }

    #[test]
    fn a_stop_asked_of_one_rank_cuts_every_ranks_evaluation_short() {
        let out = on_ranks(2, |group| {
            let flag = AtomicBool::new(false);
            let rank = group.rank();
            let stop = StopAsked::Agreed {
                flag: &flag,
                group: &group,
            };
            let mut ran = 0;
            let all = evaluate_shared(9, stop, |i| {
                ran += 1;
                // Rank 1 is asked to stop during its second batch.
                if rank == 1 && i == 3 {
                    flag.store(true, Ordering::SeqCst);
                }
                Ok(result(i))
            })
            .expect("evaluates");
            (all, ran)
        });
        for (all, ran) in out {
            assert_eq!(all, None);
            assert_eq!(ran, 2, "the round after the stop ran on no rank");
        }
    }
}
