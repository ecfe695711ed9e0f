//! ZeRO-1 (`optimization.zero_stage = 1`): in a data-parallel job each rank
//! keeps AdamW's moments for its share of the parameters only and updates
//! that share; the ranks then all-gather the updated weights, so that every
//! rank holds the whole model again before the next forward pass (PyTorch's
//! `ZeroRedundancyOptimizer`, DeepSpeed's stage 1). The gradients are still
//! all-reduced whole: the norm and clipping see all of them, as in DDP.
//!
//! A parameter's update is the same arithmetic whichever rank makes it, and
//! the gather moves f32 bits unchanged, so a ZeRO-1 job takes exactly the
//! steps of a DDP job of the same world size. Checkpoints hold every
//! moment (gathered at rank 0), so a run resumes at any world size and
//! with or without sharding.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use kiln_dist::{DistError, Group};

use crate::checkpoint::{f32_bytes, f32_values};
use crate::params::{param_entries, replaced, tensor_from};

/// Which rank updates each parameter.
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    rank: usize,
    /// The rank that owns each float parameter.
    owner: HashMap<ParamId, usize>,
    /// Values each rank owns.
    counts: Vec<usize>,
}

impl Shard {
    /// Splits `module`'s parameters between `world` ranks as PyTorch's
    /// `ZeroRedundancyOptimizer` does: largest first, each to the rank
    /// that owns the fewest values so far (ties: the lower rank), so the
    /// shares are as even as whole tensors allow. Every rank computes the
    /// same split.
    pub(crate) fn new<M: Module>(module: &M, rank: usize, world: usize) -> Self {
        let sizes: Vec<(ParamId, usize)> = param_entries(module)
            .into_iter()
            .map(|e| (e.id, e.shape.iter().product()))
            .collect();
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(sizes[i].1));
        let world = world.max(1);
        let mut counts = vec![0usize; world];
        let mut owner = HashMap::with_capacity(sizes.len());
        for i in order {
            let r = (0..world).min_by_key(|&r| counts[r]).unwrap_or(0);
            owner.insert(sizes[i].0, r);
            counts[r] += sizes[i].1;
        }
        Self {
            rank,
            owner,
            counts,
        }
    }

    /// Whether this rank updates `id` (and keeps its moments).
    pub(crate) fn owns(&self, id: ParamId) -> bool {
        self.owner.get(&id) == Some(&self.rank)
    }

    /// Values each rank owns, in rank order.
    pub(crate) fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The run's line about it: what this rank keeps.
    pub(crate) fn describe(&self) -> String {
        let total: usize = self.counts.iter().sum();
        let mine = self.owner.values().filter(|&&r| r == self.rank).count();
        format!(
            "ZeRO-1: each rank keeps AdamW's moments for its share of the parameters (rank {}: {mine} of {} tensors, {:.2} M of {:.2} M values; the largest share {:.2} M); the updated weights are all-gathered every step",
            self.rank,
            self.owner.len(),
            self.counts[self.rank] as f64 / 1e6,
            total as f64 / 1e6,
            self.counts.iter().copied().max().unwrap_or(0) as f64 / 1e6,
        )
    }
}

/// After this rank updated its share: every rank's updated share gathered
/// into every rank's module, bit for bit. Each rank sends its parameters'
/// values in visiting order; the others' arrive as one host buffer in
/// rank order and replace, one tensor at a time, the parameters this rank
/// did not update (so the device holds at most one tensor twice).
pub(crate) fn all_gather_weights<M: Module>(
    module: M,
    shard: &Shard,
    group: &Group,
) -> Result<M, DistError> {
    struct Mine<'a> {
        shard: &'a Shard,
        values: Vec<f32>,
    }
    impl ModuleVisitor for Mine<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.shard.owns(param.id) {
                self.values.extend(param.val().to_data().iter::<f32>());
            }
        }
    }
    /// Puts the others' values in, in visiting order.
    struct Theirs<'a> {
        shard: &'a Shard,
        all: &'a [f32],
        /// Where each rank's share is read next in `all`.
        at: Vec<usize>,
    }
    impl ModuleMapper for Theirs<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&r) = self.shard.owner.get(&param.id) else {
                return param;
            };
            let n = param.shape().num_elements();
            let from = self.at[r];
            self.at[r] += n;
            if r == self.shard.rank {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            // The values the optimizer updates: without autodiff's wrapper.
            let (device, dtype) = {
                let inner = tensor.clone().inner();
                (inner.device(), inner.dtype())
            };
            let w: Tensor<1> =
                tensor_from::<1>(self.all[from..from + n].to_vec(), &[n], &device).cast(dtype);
            Param::from_mapped_value(id, replaced(&tensor, w), mapper)
        }
    }
    let mut mine = Mine {
        shard,
        values: Vec::with_capacity(shard.counts[shard.rank]),
    };
    module.visit(&mut mine);
    let all = group.all_gather_f32(&mine.values, shard.counts())?;
    drop(mine);
    // Where each rank's share starts in `all`.
    let at = shard
        .counts
        .iter()
        .scan(0, |start, &n| {
            let here = *start;
            *start += n;
            Some(here)
        })
        .collect();
    Ok(module.map(&mut Theirs {
        shard,
        all: &all,
        at,
    }))
}

/// A parameter's AdamW moments as a checkpoint holds them: its path, `m`
/// and `v`, flattened.
pub(crate) type PathMoments = (String, Vec<f32>, Vec<f32>);

/// This rank's moments, `(path, m, v)`, as bytes for the gather to rank 0:
/// for each, the path's length (u32) and bytes, the values' count (u64),
/// then `m` and `v` as little-endian f32.
pub(crate) fn encode_moments(moments: &[PathMoments]) -> Vec<u8> {
    let mut b = Vec::new();
    for (path, m, v) in moments {
        b.extend_from_slice(&(path.len() as u32).to_le_bytes());
        b.extend_from_slice(path.as_bytes());
        b.extend_from_slice(&(m.len() as u64).to_le_bytes());
        b.extend(f32_bytes(m));
        b.extend(f32_bytes(v));
    }
    b
}

/// [`encode_moments`] read back; `None` where the bytes are cut short.
pub(crate) fn decode_moments(mut b: &[u8]) -> Option<Vec<PathMoments>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Some(head)
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let len = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?) as usize;
        let path = String::from_utf8(take(&mut b, len)?.to_vec()).ok()?;
        let n = u64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?) as usize;
        let m = f32_values(take(&mut b, 4 * n)?);
        let v = f32_values(take(&mut b, 4 * n)?);
        out.push((path, m, v));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;
    use kiln_model::GptConfig;

    #[test]
    fn shares_are_whole_tensors_as_even_as_they_allow() {
        let device = Device::flex();
        let model = GptConfig::new(10, 4, 2, 2, 8)
            .with_intermediate(16)
            .init(&device);
        let entries = param_entries(&model);
        let total: usize = entries
            .iter()
            .map(|e| e.shape.iter().product::<usize>())
            .sum();
        let largest = entries
            .iter()
            .map(|e| e.shape.iter().product::<usize>())
            .max()
            .unwrap_or(0);
        for world in [1, 2, 3, 5] {
            let shards: Vec<Shard> = (0..world).map(|r| Shard::new(&model, r, world)).collect();
            let counts = shards[0].counts().to_vec();
            assert_eq!(counts.iter().sum::<usize>(), total, "world {world}");
            // Greedy largest-first: no share exceeds the smallest by more
            // than the largest tensor.
            let (lo, hi) = (counts.iter().min(), counts.iter().max());
            assert!(
                hi.zip(lo).is_some_and(|(h, l)| h - l <= largest),
                "{counts:?}"
            );
            // Every rank computes the same split, and each tensor has
            // exactly one owner.
            for e in &entries {
                let owners = shards.iter().filter(|s| s.owns(e.id)).count();
                assert_eq!(owners, 1, "`{}` in a world of {world}", e.path);
            }
            for s in &shards {
                assert_eq!(s.counts(), &counts[..]);
            }
        }
        assert!(Shard::new(&model, 1, 2).describe().contains("rank 1:"));
    }

    #[test]
    fn moments_travel_as_bytes_and_back() {
        let moments = vec![
            (
                "wte.weight".to_string(),
                vec![1.5, -0.0, f32::MIN_POSITIVE],
                vec![2.0, 3.0, 4.0],
            ),
            ("ln_f.bias".to_string(), vec![], vec![]),
        ];
        let bytes = encode_moments(&moments);
        let back = decode_moments(&bytes).expect("decodes");
        assert_eq!(back.len(), 2);
        for ((p, m, v), (q, n, w)) in moments.iter().zip(&back) {
            assert_eq!(p, q);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(m), bits(n));
            assert_eq!(bits(v), bits(w));
        }
        assert!(decode_moments(&bytes[..bytes.len() - 1]).is_none());
    }
}
