//! ZeRO-1 and ZeRO-2 (`optimization.zero_stage = 1 | 2`): in a
//! data-parallel job each rank keeps AdamW's moments for its share of the
//! parameters only and updates that share; the ranks then all-gather the
//! updated weights, so that every rank holds the whole model again before
//! the next forward pass (PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed's
//! stages 1 and 2). Under ZeRO-1 the gradients are all-reduced whole, as in
//! DDP; under ZeRO-2 they are reduce-scattered, each rank receiving the
//! average of its share alone (half an all-reduce's traffic, so the step
//! moves DDP's bytes), and the global norm adds up each tensor's sum of
//! squares from the rank that holds it ([`reduce_scatter_grads`]).
//!
//! A parameter's update is the same arithmetic whichever rank makes it, the
//! norm adds the same per-tensor sums in the same order as one process
//! does, and the collectives move f32 bits unchanged, so a ZeRO job takes
//! exactly the steps of a DDP job of the same world size (over the
//! sockets). Checkpoints hold every moment (gathered at rank 0), so a run
//! resumes at any world size and with or without sharding.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use kiln_config::ReduceDtype;
use kiln_dist::{DistError, Group, Reduce};
use kiln_model::kernels::{Kernels, sum_of_squares};

use crate::checkpoint::{f32_bytes, f32_values};
use crate::params::{param_entries, replaced, tensor_from};

/// Which rank updates each parameter, and whether the gradients are
/// reduce-scattered (ZeRO-2) or all-reduced (ZeRO-1).
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    rank: usize,
    /// `optimization.zero_stage`: 1 or 2.
    stage: u8,
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
    /// same split. `stage` 2 reduce-scatters the gradients.
    pub(crate) fn new<M: Module>(module: &M, rank: usize, world: usize, stage: u8) -> Self {
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
            stage,
            owner,
            counts,
        }
    }

    /// ZeRO-2: the gradients are reduce-scattered between the owners.
    pub(crate) fn scatters_grads(&self) -> bool {
        self.stage >= 2
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
        let (stage, grads) = if self.scatters_grads() {
            (
                "ZeRO-2",
                "the gradients are reduce-scattered (each rank receives its share's average) and ",
            )
        } else {
            ("ZeRO-1", "")
        };
        format!(
            "{stage}: each rank keeps AdamW's moments for its share of the parameters (rank {}: {mine} of {} tensors, {:.2} M of {:.2} M values; the largest share {:.2} M); {grads}the updated weights are all-gathered every step",
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
    let at = starts(&shard.counts);
    Ok(module.map(&mut Theirs {
        shard,
        all: &all,
        at,
    }))
}

/// Where each part of `counts` starts when the parts are laid end to end.
fn starts(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |start, &n| {
            let here = *start;
            *start += n;
            Some(here)
        })
        .collect()
}

/// ZeRO-2's reduction of a step's gradients: every rank's gradients, laid
/// out by owner (each rank's share in visiting order, as the weights'
/// all-gather lays them out), reduce-scattered in `reduce_dtype`, so that
/// each rank receives the average of its share alone and gives the others'
/// gradients up (their device memory is freed before the update). Then
/// one small f32 all-reduce sums `extra` (the loss, the stop flag: averaged
/// here) and each gradient's sum of squares, computed by its owner; the
/// global norm adds those in visiting order, as one process's
/// `sum_of_squares` does on the CPU, so that the norm, clipping and every
/// step are DDP's bit for bit over the sockets. Returns this rank's
/// gradients and the global norm (loss scale not divided out).
pub(crate) fn reduce_scatter_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    extra: &mut [f32],
    shard: &Shard,
    group: &Group,
    reduce_dtype: ReduceDtype,
    kernels: Kernels,
) -> Result<(GradientsParams, f64), DistError> {
    /// A gradient's place: its owner and shape.
    struct Slot {
        id: ParamId,
        owner: usize,
        dims: Vec<usize>,
        device: Device,
        dtype: DType,
    }
    /// The parameters that have a gradient, in visiting order.
    struct Slots<'a> {
        shard: &'a Shard,
        grads: &'a GradientsParams,
        slots: Vec<Slot>,
    }
    impl ModuleVisitor for Slots<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (Some(g), Some(&owner)) = (
                self.grads.get::<D>(param.id),
                self.shard.owner.get(&param.id),
            ) else {
                return;
            };
            if self.slots.iter().any(|s| s.id == param.id) {
                // A parameter met twice (shared): reduced once.
                return;
            }
            self.slots.push(Slot {
                id: param.id,
                owner,
                dims: g.dims().to_vec(),
                device: g.device(),
                dtype: g.dtype(),
            });
        }
    }
    /// Takes each gradient off the device into its owner's part of `flat`.
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        flat: &'a mut [f32],
        /// Where each owner's part is written next.
        at: Vec<usize>,
        owner: &'a HashMap<ParamId, usize>,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (Some(&r), Some(g)) = (self.owner.get(&param.id), self.grads.remove::<D>(param.id))
            else {
                return;
            };
            let n = g.shape().num_elements();
            let data = g.into_data();
            for (dst, v) in self.flat[self.at[r]..self.at[r] + n]
                .iter_mut()
                .zip(data.iter::<f32>())
            {
                *dst = v;
            }
            self.at[r] += n;
        }
    }
    /// Puts this rank's reduced share back, in visiting order.
    struct Put<'a, I: Iterator<Item = &'a Slot>> {
        grads: GradientsParams,
        slots: std::iter::Peekable<I>,
        values: &'a [f32],
        squares: Vec<Tensor<1>>,
        kernels: Kernels,
    }
    impl<'a, I: Iterator<Item = &'a Slot>> ModuleVisitor for Put<'a, I> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(s) = self.slots.next_if(|s| s.id == param.id) else {
                return;
            };
            let n: usize = s.dims.iter().product();
            let (values, rest) = self.values.split_at(n);
            self.values = rest;
            let g: Tensor<D> = tensor_from(values.to_vec(), &s.dims, &s.device).cast(s.dtype);
            self.squares
                .extend(sum_of_squares([g.clone().reshape([n])], self.kernels));
            self.grads.register::<D>(s.id, g);
        }
    }
    let mut found = Slots {
        shard,
        grads: &grads,
        slots: Vec::new(),
    };
    module.visit(&mut found);
    let slots = found.slots;
    let size = |s: &Slot| s.dims.iter().product::<usize>();
    let world = shard.counts.len();
    let mut counts = vec![0usize; world];
    for s in &slots {
        counts[s.owner] += size(s);
    }
    let total: usize = counts.iter().sum();
    let mut flat = vec![0f32; total];
    let at = starts(&counts);
    module.visit(&mut Take {
        grads: &mut grads,
        flat: &mut flat,
        at,
        owner: &shard.owner,
    });
    let mine = match reduce_dtype {
        ReduceDtype::F32 => group.reduce_scatter(&mut flat, &counts, Reduce::Mean)?,
        ReduceDtype::Bf16 => group.reduce_scatter_bf16(&mut flat, &counts, Reduce::Mean)?,
    };
    drop(flat);
    // This rank's share back on its device; each one's sum of squares.
    let mut put = Put {
        grads,
        slots: slots.iter().filter(|s| s.owner == shard.rank).peekable(),
        values: &mine,
        squares: Vec::new(),
        kernels,
    };
    module.visit(&mut put);
    let Put { grads, squares, .. } = put;
    let mut small = vec![0f32; extra.len() + slots.len()];
    small[..extra.len()].copy_from_slice(extra);
    if !squares.is_empty() {
        let read: Vec<f32> = Tensor::cat(squares, 0).into_data().iter::<f32>().collect();
        let mine_at = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.owner == shard.rank)
            .map(|(i, _)| extra.len() + i);
        for (i, v) in mine_at.zip(read) {
            small[i] = v;
        }
    }
    group.all_reduce(&mut small, Reduce::Sum)?;
    // The extras' mean as the all-reduce's: their sum divided by the ranks.
    for (e, s) in extra.iter_mut().zip(&small) {
        *e = s / world as f32;
    }
    let sum: f32 = small[extra.len()..].iter().fold(0.0, |total, s| total + s);
    Ok((grads, f64::from(sum).sqrt()))
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
        let _rng = crate::tests::flex_rng();
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
            let shards: Vec<Shard> = (0..world)
                .map(|r| Shard::new(&model, r, world, 1))
                .collect();
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
        assert!(Shard::new(&model, 1, 2, 1).describe().contains("rank 1:"));
        assert!(
            Shard::new(&model, 0, 2, 2)
                .describe()
                .starts_with("ZeRO-2: each rank keeps AdamW's moments")
        );
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
