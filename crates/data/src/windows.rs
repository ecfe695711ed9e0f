//! nanoGPT's batches: random windows of `block + 1` tokens, inputs and
//! targets shifted by one. Batch `k` is drawn from an RNG seeded by
//! (seed, split, k) alone, so every worker draws the same batch `k`.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::loader::BatchSource;
use crate::store::{MemoryTokens, TokenSpan};

/// A batch of token windows, row-major `[batch, block]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// Position in the batch sequence (what a resumed run starts from).
    pub index: u64,
    /// Rows.
    pub batch_size: usize,
    /// Tokens per row (the context length).
    pub block: usize,
    /// Input ids, `[batch_size, block]`.
    pub inputs: Vec<u32>,
    /// Target ids: each input's next token.
    pub targets: Vec<u32>,
}

/// Which part of the corpus a sampler draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The training part (the head of the corpus).
    Train,
    /// The validation part (the tail).
    Val,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Train => "training",
            Self::Val => "validation",
        })
    }
}

/// Random windows over one split of a token sequence, in memory or read
/// from a token store's shards.
#[derive(Clone, Debug)]
pub struct LmWindows {
    tokens: Arc<dyn TokenSpan>,
    batch_size: usize,
    block: usize,
    seed: u64,
    split: Split,
    /// The rows of each batch this sampler hands out (all of them, or one
    /// data-parallel rank's share).
    rows: std::ops::Range<usize>,
}

impl LmWindows {
    /// Windows of `block` tokens (and the next one), `batch_size` per batch,
    /// over `tokens`. Errors unless `tokens` holds at least `block + 1` ids
    /// and the sizes are at least 1.
    pub fn new(
        tokens: Arc<[u32]>,
        batch_size: usize,
        block: usize,
        seed: u64,
        split: Split,
    ) -> Result<Self, crate::DataError> {
        Self::over(
            Arc::new(MemoryTokens(tokens)),
            batch_size,
            block,
            seed,
            split,
        )
    }

    /// The same over any token sequence (a store's split, say): batch `k`
    /// is the same windows whatever holds the tokens.
    pub fn over(
        tokens: Arc<dyn TokenSpan>,
        batch_size: usize,
        block: usize,
        seed: u64,
        split: Split,
    ) -> Result<Self, crate::DataError> {
        if batch_size == 0 || block == 0 {
            return Err(crate::DataError::InvalidArgument {
                what: "window sizes",
                why: format!("batch_size {batch_size} and block {block} must be at least 1"),
            });
        }
        if tokens.len() < block + 1 {
            return Err(crate::DataError::TooShort {
                split,
                tokens: tokens.len(),
                block,
            });
        }
        Ok(Self {
            tokens,
            batch_size,
            block,
            seed,
            split,
            rows: 0..batch_size,
        })
    }

    /// Rank `rank`'s share of every batch in a data-parallel job of
    /// `world` ranks: rows `rank·b/world .. (rank+1)·b/world` of the same
    /// batch `k` (b = the batch size this sampler was made with, a multiple
    /// of `world`). So `world` ranks of `b/world` rows train on exactly the
    /// batches one process of `b` rows would, and in the same order.
    pub fn share(mut self, rank: usize, world: usize) -> Result<Self, crate::DataError> {
        if world == 0 || rank >= world || !self.batch_size.is_multiple_of(world) {
            return Err(crate::DataError::InvalidArgument {
                what: "a rank's share",
                why: format!(
                    "rank {rank} of {world}: the batch of {} rows must split evenly",
                    self.batch_size
                ),
            });
        }
        let each = self.batch_size / world;
        self.rows = rank * each..(rank + 1) * each;
        Ok(self)
    }

    /// Tokens in this split.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Batches per pass over the split: tokens / (batch × block), at least 1.
    pub fn batches_per_epoch(&self) -> u64 {
        ((self.tokens.len() / (self.batch_size * self.block).max(1)) as u64).max(1)
    }

    fn rng(&self, index: u64) -> StdRng {
        let split = match self.split {
            Split::Train => 0x5452_4149_4e00_0000u64,
            Split::Val => 0x5641_4c00_0000_0000u64,
        };
        StdRng::seed_from_u64(splitmix64(splitmix64(self.seed ^ split) ^ index))
    }
}

impl BatchSource for LmWindows {
    type Batch = TokenBatch;

    fn batch(&self, index: u64) -> Result<TokenBatch, crate::DataError> {
        let mut rng = self.rng(index);
        let span = self.tokens.len().saturating_sub(self.block).max(1);
        let rows = self.rows.len();
        let mut inputs = Vec::with_capacity(rows * self.block);
        let mut targets = Vec::with_capacity(rows * self.block);
        let mut window = vec![0u32; self.block + 1];
        for row in 0..self.batch_size {
            // Every row's start is drawn, so that a share's rows are the
            // whole batch's; only this share's windows are read.
            let start = rng.random_range(0..span);
            if !self.rows.contains(&row) {
                continue;
            }
            let n = (self.block + 1).min(self.tokens.len() - start);
            self.tokens.read(start, &mut window[..n])?;
            inputs.extend_from_slice(&window[..self.block]);
            targets.extend_from_slice(&window[1..n]);
        }
        Ok(TokenBatch {
            index,
            batch_size: rows,
            block: self.block,
            inputs,
            targets,
        })
    }
}

/// A 64-bit mixer (Steele et al.'s SplitMix64 finaliser).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn windows(seed: u64, split: Split) -> LmWindows {
        let tokens: Arc<[u32]> = (0..1000u32).collect();
        LmWindows::new(tokens, 4, 8, seed, split).expect("long enough")
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let b = windows(1, Split::Train).batch(0).expect("batch");
        assert_eq!(b.inputs.len(), 32);
        for row in 0..4 {
            let x = &b.inputs[row * 8..row * 8 + 8];
            let y = &b.targets[row * 8..row * 8 + 8];
            for i in 0..8 {
                assert_eq!(y[i], x[i] + 1);
            }
        }
    }

    #[test]
    fn ranks_shares_put_together_are_the_whole_batch() {
        let whole = windows(3, Split::Train);
        for world in [1, 2, 4] {
            for index in [0, 5, 99] {
                let b = whole.batch(index).expect("batch");
                let mut inputs = Vec::new();
                let mut targets = Vec::new();
                for rank in 0..world {
                    let share = whole.clone().share(rank, world).expect("splits");
                    let s = share.batch(index).expect("batch");
                    assert_eq!(s.batch_size, 4 / world);
                    inputs.extend(s.inputs);
                    targets.extend(s.targets);
                }
                assert_eq!((inputs, targets), (b.inputs.clone(), b.targets.clone()));
            }
        }
        assert!(
            whole.clone().share(0, 3).is_err(),
            "4 rows do not split in 3"
        );
        assert!(whole.share(2, 2).is_err(), "rank out of range");
    }

    #[test]
    fn batches_depend_on_seed_split_and_index_only() {
        let a = windows(7, Split::Train);
        assert_eq!(a.batch(5).expect("batch"), a.batch(5).expect("batch"));
        assert_eq!(
            a.batch(5).expect("batch"),
            windows(7, Split::Train).batch(5).expect("batch")
        );
        assert_ne!(
            a.batch(5).expect("batch").inputs,
            a.batch(6).expect("batch").inputs
        );
        assert_ne!(
            a.batch(5).expect("batch").inputs,
            windows(8, Split::Train).batch(5).expect("batch").inputs
        );
        assert_ne!(
            a.batch(5).expect("batch").inputs,
            windows(7, Split::Val).batch(5).expect("batch").inputs
        );
    }

    #[test]
    fn windows_reach_the_last_token() {
        let tokens: Arc<[u32]> = (0..10u32).collect();
        let w = LmWindows::new(tokens, 64, 9, 3, Split::Train).expect("long enough");
        let b = w.batch(0).expect("batch");
        assert!(b.targets.contains(&9));
        assert!(b.inputs.contains(&0));
    }
}
