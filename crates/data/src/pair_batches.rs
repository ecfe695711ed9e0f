//! Batches of encoded sentence pairs, padded per batch (to the longest pair
//! in the batch, not to `max_length`), optionally bucketed by length. Batch
//! `k` is a function of (seed, k): epoch `k / batches_per_epoch` shuffles the
//! pairs with its own seed.

use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::loader::BatchSource;
use crate::{DataError, PairDataset, Tokenizer};

/// One encoded pair and its label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedPair {
    /// `[CLS] premise [SEP] hypothesis [SEP]` as token ids.
    pub ids: Vec<u32>,
    /// Segment ids: 0 for `[CLS]`, the premise and its `[SEP]`, 1 after.
    pub segments: Vec<u32>,
    /// Index into the label names.
    pub label: usize,
}

/// A padded batch, row-major `[batch_size, seq_len]`; padding has id 0 and
/// `mask` false.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairBatch {
    /// Position in the batch sequence (what a resumed run starts from).
    pub index: u64,
    /// Rows (the last batch of an epoch may be smaller).
    pub batch_size: usize,
    /// Columns: the longest pair of the batch.
    pub seq_len: usize,
    /// Token ids, `[batch_size, seq_len]`, padding 0.
    pub ids: Vec<u32>,
    /// Segment ids, `[batch_size, seq_len]`.
    pub segments: Vec<u32>,
    /// True where a token is not padding.
    pub mask: Vec<bool>,
    /// One label index per row.
    pub labels: Vec<usize>,
    /// Tokens that are not padding.
    pub real_tokens: usize,
}

/// Encodes every pair of `data` with `tokenizer` (unlabelled pairs get label 0).
pub fn encode_dataset(
    tokenizer: &Tokenizer,
    data: &PairDataset,
) -> Result<Vec<EncodedPair>, DataError> {
    let texts: Vec<(&str, &str)> = data
        .pairs
        .iter()
        .map(|p| (p.premise.as_str(), p.hypothesis.as_str()))
        .collect();
    Ok(tokenizer
        .encode_pairs(&texts)?
        .into_iter()
        .zip(&data.pairs)
        .map(|((ids, segments), p)| EncodedPair {
            ids,
            segments,
            label: p.label.unwrap_or(0),
        })
        .collect())
}

/// Pads `pairs` into one batch.
pub fn pad_batch(index: u64, pairs: &[&EncodedPair]) -> PairBatch {
    let seq_len = pairs.iter().map(|p| p.ids.len()).max().unwrap_or(1).max(1);
    let n = pairs.len();
    let mut ids = vec![0u32; n * seq_len];
    let mut segments = vec![0u32; n * seq_len];
    let mut mask = vec![false; n * seq_len];
    let mut real_tokens = 0;
    for (row, p) in pairs.iter().enumerate() {
        let at = row * seq_len;
        ids[at..at + p.ids.len()].copy_from_slice(&p.ids);
        segments[at..at + p.segments.len()].copy_from_slice(&p.segments);
        mask[at..at + p.ids.len()]
            .iter_mut()
            .for_each(|m| *m = true);
        real_tokens += p.ids.len();
    }
    PairBatch {
        index,
        batch_size: n,
        seq_len,
        ids,
        segments,
        mask,
        labels: pairs.iter().map(|p| p.label).collect(),
        real_tokens,
    }
}

/// Training batches over encoded pairs, reshuffled every epoch.
#[derive(Clone, Debug)]
pub struct PairBatches {
    pairs: Arc<[EncodedPair]>,
    batch_size: usize,
    seed: u64,
    bucket: bool,
    /// This rank's share of every batch: (rank, world); (0, 1) alone.
    share: (usize, usize),
    /// The plans of the last two epochs asked for: every batch of an epoch
    /// reads its plan, so it is shuffled once, not once per batch (two, for
    /// workers on either side of an epoch boundary).
    plans: Arc<Mutex<Vec<Arc<EpochPlan>>>>,
}

/// The pair order of an epoch, and the order its batches are served in.
#[derive(Debug)]
struct EpochPlan {
    epoch: u64,
    order: Vec<usize>,
    batches: Vec<usize>,
}

impl PairBatches {
    /// Batches of `batch_size` over `pairs`, shuffled each epoch from `seed`;
    /// with `bucket`, rows of similar length batched together (less padding).
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] for a `batch_size` of 0.
    pub fn new(
        pairs: Arc<[EncodedPair]>,
        batch_size: usize,
        seed: u64,
        bucket: bool,
    ) -> Result<Self, DataError> {
        if batch_size == 0 {
            return Err(DataError::InvalidArgument {
                what: "batch size",
                why: "a batch of 0 pairs: batch_size must be at least 1".into(),
            });
        }
        Ok(Self {
            pairs,
            batch_size,
            seed,
            bucket,
            share: (0, 1),
            plans: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Rank `rank`'s share of every batch in a data-parallel job of `world`
    /// ranks, as PyTorch's `DistributedSampler` shares an epoch: batch `k`
    /// of the `batch_size` pairs this was made with (a multiple of `world`)
    /// is cut into `world` equal shares, rank `r` taking the `r`-th. The
    /// last batch of an epoch, where smaller, is first made up to a
    /// multiple of `world` with the epoch's first pairs again (fewer than
    /// `world` of them), so that every rank trains on as many pairs as the
    /// others and the mean of the ranks' losses is the batch's. So `world`
    /// ranks of `batch_size / world` pairs train on the batches one process
    /// of `batch_size` pairs would, in the same order.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] where `rank` is not below `world`,
    /// or the batch does not split evenly.
    pub fn share(mut self, rank: usize, world: usize) -> Result<Self, DataError> {
        if world == 0 || rank >= world || !self.batch_size.is_multiple_of(world) {
            return Err(DataError::InvalidArgument {
                what: "a rank's share",
                why: format!(
                    "rank {rank} of {world}: the batch of {} pairs must split evenly",
                    self.batch_size
                ),
            });
        }
        self.share = (rank, world);
        Ok(self)
    }

    /// Batches per pass over the pairs (the last one may be smaller).
    pub fn batches_per_epoch(&self) -> u64 {
        self.pairs.len().div_ceil(self.batch_size).max(1) as u64
    }

    /// The plan of `epoch`, from the cache or made and cached.
    fn plan(&self, epoch: u64) -> Arc<EpochPlan> {
        let mut plans = self
            .plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(plan) = plans.iter().find(|p| p.epoch == epoch) {
            return Arc::clone(plan);
        }
        let plan = Arc::new(self.make_plan(epoch));
        if plans.len() == 2 {
            plans.remove(0);
        }
        plans.push(Arc::clone(&plan));
        plan
    }

    fn make_plan(&self, epoch: u64) -> EpochPlan {
        let mut rng = StdRng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F));
        let mut order: Vec<usize> = (0..self.pairs.len()).collect();
        order.shuffle(&mut rng);
        if self.bucket {
            // Sort within chunks of 50 batches: similar lengths share a batch,
            // and the batch order is shuffled again below.
            for chunk in order.chunks_mut(self.batch_size * 50) {
                chunk.sort_by_key(|&i| self.pairs[i].ids.len());
            }
        }
        let mut batches: Vec<usize> = (0..self.batches_per_epoch() as usize).collect();
        if self.bucket {
            batches.shuffle(&mut rng);
        }
        EpochPlan {
            epoch,
            order,
            batches,
        }
    }
}

impl BatchSource for PairBatches {
    type Batch = PairBatch;

    fn batch(&self, index: u64) -> Result<PairBatch, crate::DataError> {
        let per_epoch = self.batches_per_epoch();
        let plan = self.plan(index / per_epoch);
        let b = plan.batches[(index % per_epoch) as usize];
        let start = b * self.batch_size;
        let end = (start + self.batch_size).min(plan.order.len());
        let mut rows = &plan.order[start..end];
        let made_up: Vec<usize>;
        let (rank, world) = self.share;
        if world > 1 {
            // DistributedSampler's padding: the epoch's first pairs again.
            let short = rows.len().next_multiple_of(world) - rows.len();
            made_up = rows
                .iter()
                .chain(plan.order.iter().cycle().take(short))
                .copied()
                .collect();
            let each = made_up.len() / world;
            rows = &made_up[rank * each..(rank + 1) * each];
        }
        let picked: Vec<&EncodedPair> = rows.iter().map(|&i| &self.pairs[i]).collect();
        Ok(pad_batch(index, &picked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(n: usize) -> Arc<[EncodedPair]> {
        (0..n)
            .map(|i| EncodedPair {
                ids: (0..(3 + i % 7) as u32).collect(),
                segments: vec![0; 3 + i % 7],
                label: i % 3,
            })
            .collect()
    }

    #[test]
    fn an_epoch_serves_every_pair_once_padded_per_batch() {
        let src = PairBatches::new(pairs(23), 5, 1, false).expect("batches");
        assert_eq!(src.batches_per_epoch(), 5);
        let mut seen = 0;
        for k in 0..5 {
            let b = src.batch(k).expect("batch");
            seen += b.batch_size;
            let longest = (0..b.batch_size)
                .map(|r| {
                    b.mask[r * b.seq_len..(r + 1) * b.seq_len]
                        .iter()
                        .filter(|m| **m)
                        .count()
                })
                .max()
                .unwrap_or(0);
            assert_eq!(
                b.seq_len, longest,
                "padded to the batch's longest, not a fixed length"
            );
            assert_eq!(b.real_tokens, b.mask.iter().filter(|m| **m).count());
        }
        assert_eq!(seen, 23);
        assert_ne!(
            src.batch(0).expect("batch").labels,
            src.batch(5).expect("batch").labels,
            "epochs are reshuffled"
        );
    }

    /// A library user's batch size of 0 is an error that names it, not a
    /// batch of 1.
    #[test]
    fn a_batch_of_zero_pairs_is_refused() {
        let err = PairBatches::new(pairs(10), 0, 1, false).expect_err("batch 0");
        assert!(
            matches!(
                err,
                DataError::InvalidArgument {
                    what: "batch size",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("batch_size must be at least 1"),
            "{err}"
        );
    }

    /// Two ranks' shares of every batch are the batch one process draws
    /// (the epoch's last, of 23 mod 8 = 7 pairs, made up to 8 with the
    /// epoch's first pair), each rank as many pairs as the other.
    #[test]
    fn ranks_share_each_batch_one_process_draws() {
        for bucket in [false, true] {
            let one = PairBatches::new(pairs(23), 8, 5, bucket).expect("batches");
            let shares: Vec<PairBatches> = (0..2)
                .map(|r| one.clone().share(r, 2).expect("share"))
                .collect();
            let key = |p: (&[u32], usize)| (p.0.to_vec(), p.1);
            let rows = |b: &PairBatch| -> Vec<(Vec<u32>, usize)> {
                (0..b.batch_size)
                    .map(|r| {
                        let row = &b.ids[r * b.seq_len..(r + 1) * b.seq_len];
                        let n = b.mask[r * b.seq_len..(r + 1) * b.seq_len]
                            .iter()
                            .filter(|m| **m)
                            .count();
                        key((&row[..n], b.labels[r]))
                    })
                    .collect()
            };
            let mut short = 0;
            for k in 0..6 {
                let whole = rows(&one.batch(k).expect("batch"));
                let parts: Vec<PairBatch> = shares
                    .iter()
                    .map(|s| s.batch(k).expect("share's batch"))
                    .collect();
                assert_eq!(parts[0].batch_size, parts[1].batch_size, "batch {k}");
                let joined: Vec<_> = parts.iter().flat_map(rows).collect();
                if whole.len() == 8 {
                    assert_eq!(joined, whole, "batch {k}, bucketed {bucket}");
                } else {
                    short += 1;
                    assert_eq!(whole.len(), 7);
                    assert_eq!(joined[..7], whole[..], "batch {k}");
                    let order = &one.plan(k / 3).order;
                    let first = &one.pairs[order[0]];
                    assert_eq!(joined[7], key((&first.ids, first.label)));
                }
            }
            assert_eq!(short, 2, "one short batch an epoch");
        }
        assert!(
            PairBatches::new(pairs(23), 8, 5, false)
                .expect("batches")
                .share(0, 3)
                .is_err()
        );
    }

    #[test]
    fn bucketing_reduces_padding() {
        let plain = PairBatches::new(pairs(400), 8, 3, false).expect("batches");
        let bucketed = PairBatches::new(pairs(400), 8, 3, true).expect("batches");
        let padded = |s: &PairBatches| {
            (0..50)
                .map(|k| s.batch(k).expect("batch").ids.len())
                .sum::<usize>()
        };
        assert!(
            padded(&bucketed) < padded(&plain),
            "{} vs {}",
            padded(&bucketed),
            padded(&plain)
        );
        assert_eq!(
            bucketed.batch(7).expect("batch"),
            bucketed.batch(7).expect("batch")
        );
    }
}
