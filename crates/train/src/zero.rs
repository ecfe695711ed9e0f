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
/// values in visiting order; the others' arrive in rank order and replace
/// the parameters this rank did not update.
///
/// Where the job reduces through NCCL and the weights are on a CUDA GPU,
/// they stay there ([`gather_flat`]: `ncclAllGather` into one buffer on the
/// device, the others' parameters views of it); elsewhere they arrive as
/// one host buffer and go to the device one tensor at a time (so the
/// device holds at most one tensor twice).
pub(crate) fn all_gather_weights<M: Module>(
    module: M,
    shard: &Shard,
    group: &Group,
) -> Result<M, DistError> {
    #[cfg(feature = "cuda")]
    if let Some(device) = first_device(&module)
        && group.uses_nccl()
        && crate::params::nccl_through_host(&device).is_none()
    {
        return nccl_gather(module, shard, &device, group);
    }
    struct Mine<'a> {
        shard: &'a Shard,
        values: Vec<f32>,
    }
    impl ModuleVisitor for Mine<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.shard.owns(param.id) {
                crate::params::extend_f32(&mut self.values, param.val().to_data());
            }
        }
    }
    let mut mine = Mine {
        shard,
        values: Vec::with_capacity(shard.counts[shard.rank]),
    };
    module.visit(&mut mine);
    let all = group.all_gather_f32(&mine.values, shard.counts())?;
    drop(mine);
    let mut at = starts(&shard.counts);
    Ok(put_theirs(module, shard, |r, n, device, dtype| {
        let from = at[r];
        at[r] += n;
        tensor_from::<1>(all[from..from + n].to_vec(), &[n], device).cast(dtype)
    }))
}

/// `module` with each parameter another rank owns replaced by
/// `theirs(owner, values, device, dtype)` (flat), called in visiting order.
fn put_theirs<M: Module>(
    module: M,
    shard: &Shard,
    theirs: impl FnMut(usize, usize, &Device, DType) -> Tensor<1>,
) -> M {
    struct Theirs<'a, F> {
        shard: &'a Shard,
        theirs: F,
    }
    impl<F: FnMut(usize, usize, &Device, DType) -> Tensor<1>> ModuleMapper for Theirs<'_, F> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.shard.owner.get(&param.id) {
                Some(&r) if r != self.shard.rank => {
                    let n = param.shape().num_elements();
                    let (id, tensor, mapper) = param.consume();
                    // The values the optimizer updates: without autodiff's
                    // wrapper.
                    let (device, dtype) = {
                        let inner = tensor.clone().inner();
                        (inner.device(), inner.dtype())
                    };
                    let w = (self.theirs)(r, n, &device, dtype);
                    Param::from_mapped_value(id, replaced(&tensor, w), mapper)
                }
                _ => param,
            }
        }
    }
    module.map(&mut Theirs { shard, theirs })
}

/// The device of `module`'s first float parameter.
#[cfg(feature = "cuda")]
fn first_device<M: Module>(module: &M) -> Option<Device> {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().device());
            }
        }
    }
    let mut first = First(None);
    module.visit(&mut first);
    first.0
}

/// The device side of [`all_gather_weights`], for any `gather`: this
/// rank's parameters (f32, in visiting order) laid end to end and padded
/// to the largest share, `send`, and a `recv` of zeros for every rank's,
/// both on `device`; `gather(send, recv)` fills `recv` as an all-gather
/// does (rank `r`'s values from `r ×` the largest share), and each
/// parameter another rank owns becomes a view of it, in its dtype. (The
/// views keep `recv` while they live: one model's worth of f32 until the
/// next gather replaces them, this rank's own share and the padding
/// included, against the host path's one tensor at a time; less than the
/// gradients the backward pass held.)
#[cfg(any(feature = "cuda", test))]
fn gather_flat<M: Module, E>(
    module: M,
    shard: &Shard,
    device: &Device,
    gather: impl FnOnce(Tensor<1>, Tensor<1>) -> Result<Tensor<1>, E>,
) -> Result<M, E> {
    struct Mine<'a> {
        shard: &'a Shard,
        parts: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for Mine<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.shard.owns(param.id) {
                let n = param.shape().num_elements();
                self.parts
                    .push(param.val().inner().reshape([n]).cast(DType::F32));
            }
        }
    }
    let widest = shard.counts.iter().copied().max().unwrap_or(0);
    if widest == 0 {
        return Ok(module);
    }
    let mut mine = Mine {
        shard,
        parts: Vec::new(),
    };
    module.visit(&mut mine);
    let pad = widest - shard.counts[shard.rank];
    if pad > 0 {
        mine.parts.push(Tensor::zeros([pad], (device, DType::F32)));
    }
    let send = Tensor::cat(mine.parts, 0);
    let recv = Tensor::zeros([widest * shard.counts.len()], (device, DType::F32));
    let all = gather(send, recv)?;
    let mut at: Vec<usize> = (0..shard.counts.len()).map(|r| r * widest).collect();
    Ok(put_theirs(module, shard, |r, n, _, dtype| {
        let from = at[r];
        at[r] += n;
        all.clone().narrow(0, from, n).cast(dtype)
    }))
}

/// [`gather_flat`] through NCCL's all-gather on the GPU, ordered on the
/// thread's CubeCL stream ([`kiln_dist::Group::all_gather_device`]).
#[cfg(feature = "cuda")]
fn nccl_gather<M: Module>(
    module: M,
    shard: &Shard,
    device: &Device,
    group: &Group,
) -> Result<M, DistError> {
    gather_flat(module, shard, device, |send, recv| {
        lend_pair(send, recv, "the weights", |send, recv| {
            // SAFETY: both are tensors `lend_pair` keeps and hands back:
            // their memory outlives the call, and the readers of `recv`
            // (the views) are queued after it on the same stream.
            unsafe { group.all_gather_device(send, recv) }
        })
    })
}

/// `f` with the CUDA buffers of `send` and `recv` (each lent by
/// [`kiln_model::kernels::with_cuda_buffer`]); returns `recv`, holding
/// what `f` queued into it. `send` is dropped after the call was queued:
/// CubeCL hands its memory out again only to work queued later on its
/// stream, which waits for the collective.
#[cfg(feature = "cuda")]
fn lend_pair(
    send: Tensor<1>,
    recv: Tensor<1>,
    what: &str,
    f: impl FnOnce(&kiln_dist::DeviceBuffer, &kiln_dist::DeviceBuffer) -> Result<(), DistError>,
) -> Result<Tensor<1>, DistError> {
    use crate::params::{nccl_buffer, not_on_cuda};
    use kiln_model::kernels::with_cuda_buffer;
    let (recv, done) = with_cuda_buffer(recv, |r| {
        let r = nccl_buffer(r)?;
        let (_send, done) = with_cuda_buffer(send, |s| f(&nccl_buffer(s)?, &r));
        done.unwrap_or_else(|| Err(not_on_cuda(what)))
    });
    done.unwrap_or_else(|| Err(not_on_cuda(what)))?;
    Ok(recv)
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

/// A gradient's place in ZeRO-2's reduce-scatter: its owner and shape.
struct Slot {
    id: ParamId,
    owner: usize,
    dims: Vec<usize>,
    device: Device,
    dtype: DType,
}

impl Slot {
    fn len(&self) -> usize {
        self.dims.iter().product()
    }
}

/// The parameters of `module` that have a gradient in `grads`, in
/// visiting order, each once.
fn slots_of<M: Module>(module: &M, grads: &GradientsParams, shard: &Shard) -> Vec<Slot> {
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
    let mut found = Slots {
        shard,
        grads,
        slots: Vec::new(),
    };
    module.visit(&mut found);
    found.slots
}

/// Values of the gradients each rank owns, in rank order.
fn owned_counts(slots: &[Slot], world: usize) -> Vec<usize> {
    let mut counts = vec![0usize; world];
    for s in slots {
        counts[s.owner] += s.len();
    }
    counts
}

/// Each gradient of `slots` taken out of `grads` (flat, as the module's
/// visiting order meets it) and handed to `take(owner, gradient)`.
fn take_each<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    shard: &Shard,
    take: impl FnMut(usize, Tensor<1>),
) {
    struct Take<'a, F> {
        grads: &'a mut GradientsParams,
        owner: &'a HashMap<ParamId, usize>,
        take: F,
    }
    impl<F: FnMut(usize, Tensor<1>)> ModuleVisitor for Take<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (Some(&r), Some(g)) = (self.owner.get(&param.id), self.grads.remove::<D>(param.id))
            else {
                return;
            };
            let n = g.shape().num_elements();
            (self.take)(r, g.reshape([n]));
        }
    }
    module.visit(&mut Take {
        grads,
        owner: &shard.owner,
        take,
    });
}

/// Registers this rank's reduced share in `grads`: `pieces` (flat, in the
/// order of this rank's slots) in their parameters' shapes. Returns the
/// gradients and each one's sum of squares, in that order.
fn put_mine<M: Module>(
    module: &M,
    grads: GradientsParams,
    slots: &[Slot],
    rank: usize,
    pieces: impl Iterator<Item = Tensor<1>>,
    kernels: Kernels,
) -> (GradientsParams, Vec<Tensor<1>>) {
    struct Put<'a, I: Iterator<Item = &'a Slot>, P> {
        grads: GradientsParams,
        slots: std::iter::Peekable<I>,
        pieces: P,
        squares: Vec<Tensor<1>>,
        kernels: Kernels,
    }
    impl<'a, I: Iterator<Item = &'a Slot>, P: Iterator<Item = Tensor<1>>> ModuleVisitor
        for Put<'a, I, P>
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(s) = self.slots.next_if(|s| s.id == param.id) else {
                return;
            };
            let flat = self
                .pieces
                .next()
                .expect("a piece for every slot of this rank");
            self.squares
                .extend(sum_of_squares([flat.clone()], self.kernels));
            let dims: [usize; D] = s.dims.clone().try_into().expect("the parameter's rank");
            self.grads.register::<D>(s.id, flat.reshape(dims));
        }
    }
    let mut put = Put {
        grads,
        slots: slots.iter().filter(|s| s.owner == rank).peekable(),
        pieces,
        squares: Vec::new(),
        kernels,
    };
    module.visit(&mut put);
    (put.grads, put.squares)
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
///
/// Where the job reduces through NCCL and the gradients are on a CUDA
/// GPU, they stay there ([`scatter_flat`], `ncclReduceScatter` on the
/// device); elsewhere they cross host memory.
pub(crate) fn reduce_scatter_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    extra: &mut [f32],
    shard: &Shard,
    group: &Group,
    reduce_dtype: ReduceDtype,
    kernels: Kernels,
) -> Result<(GradientsParams, f64), DistError> {
    let slots = slots_of(module, &grads, shard);
    #[cfg(feature = "cuda")]
    if let Some(device) = slots.first().map(|s| s.device.clone())
        && group.uses_nccl()
        && crate::params::nccl_through_host(&device).is_none()
    {
        let wire = match reduce_dtype {
            ReduceDtype::F32 => DType::F32,
            ReduceDtype::Bf16 => DType::BF16,
        };
        let (grads, squares) = scatter_flat(
            module,
            grads,
            &slots,
            shard,
            &device,
            wire,
            kernels,
            crate::params::BUCKET_BYTES,
            |send, recv| {
                lend_pair(send, recv, "the gradients", |send, recv| {
                    // SAFETY: both are tensors `lend_pair` keeps and hands
                    // back: their memory outlives the call, and the readers
                    // of `recv` (the slices) are queued after it on the
                    // same stream.
                    unsafe { group.reduce_scatter_device(send, recv, Reduce::Mean) }
                })
            },
        )?;
        return norm_and_extra(grads, squares, &slots, extra, shard, group);
    }
    let counts = owned_counts(&slots, shard.counts.len());
    let mut flat = vec![0f32; counts.iter().sum()];
    let mut at = starts(&counts);
    take_each(module, &mut grads, shard, |r, g| {
        let n = g.dims()[0];
        let data = g.into_data().convert::<f32>();
        flat[at[r]..at[r] + n].copy_from_slice(crate::params::f32_slice(&data));
        at[r] += n;
    });
    let mine = match reduce_dtype {
        ReduceDtype::F32 => group.reduce_scatter(&mut flat, &counts, Reduce::Mean)?,
        ReduceDtype::Bf16 => group.reduce_scatter_bf16(&mut flat, &counts, Reduce::Mean)?,
    };
    drop(flat);
    // This rank's share back on its device.
    let mut rest = &mine[..];
    let pieces = slots.iter().filter(|s| s.owner == shard.rank).map(|s| {
        let (values, after) = rest.split_at(s.len());
        rest = after;
        tensor_from::<1>(values.to_vec(), &[s.len()], &s.device).cast(s.dtype)
    });
    let (grads, squares) = put_mine(module, grads, &slots, shard.rank, pieces, kernels);
    norm_and_extra(grads, squares, &slots, extra, shard, group)
}

/// The device side of [`reduce_scatter_grads`], for any `scatter`: each
/// rank's gradients (cast to `wire`) laid end to end in visiting order,
/// its share, padded to the largest; then, bucket by bucket, the same
/// stretch of every rank's share (`bucket_bytes` in all, DDP's buckets)
/// laid end to end in rank order, `send`, and a `recv` of zeros for one
/// stretch, both on `device`. `scatter(send, recv)` fills `recv` as a
/// reduce-scatter does (this rank's stretch, reduced), and the gradients
/// taken into `send` are freed as the buckets go, so the device holds one
/// bucket beside them (one buffer of them all would hold them twice).
/// This rank's stretches, end to end, are its share, out of which its
/// gradients are read (views, or copies back to f32 from bf16). Returns
/// them and their sums of squares.
#[cfg(any(feature = "cuda", test))]
#[allow(clippy::too_many_arguments)]
fn scatter_flat<M: Module, E>(
    module: &M,
    mut grads: GradientsParams,
    slots: &[Slot],
    shard: &Shard,
    device: &Device,
    wire: DType,
    kernels: Kernels,
    bucket_bytes: usize,
    mut scatter: impl FnMut(Tensor<1>, Tensor<1>) -> Result<Tensor<1>, E>,
) -> Result<(GradientsParams, Vec<Tensor<1>>), E> {
    let world = shard.counts.len();
    let counts = owned_counts(slots, world);
    let widest = counts.iter().copied().max().unwrap_or(0);
    if widest == 0 {
        return Ok((grads, Vec::new()));
    }
    let mut shares: Vec<std::collections::VecDeque<Tensor<1>>> =
        vec![std::collections::VecDeque::new(); world];
    take_each(module, &mut grads, shard, |r, g| {
        shares[r].push_back(g.cast(wire))
    });
    // Values of each rank's share a bucket.
    let stretch = (bucket_bytes / (wire.size() * world)).clamp(1, widest);
    let mut mine = Vec::with_capacity(widest.div_ceil(stretch));
    let mut start = 0;
    while start < widest {
        let n = stretch.min(widest - start);
        let mut send = Vec::new();
        for (share, &count) in shares.iter_mut().zip(&counts) {
            let real = count.saturating_sub(start).min(n);
            take_front(share, real, &mut send);
            if real < n {
                send.push(Tensor::zeros([n - real], (device, wire)));
            }
        }
        let recv = Tensor::zeros([n], (device, wire));
        mine.push(scatter(Tensor::cat(send, 0), recv)?);
        start += n;
    }
    let mine = if mine.len() == 1 {
        mine.swap_remove(0)
    } else {
        Tensor::cat(mine, 0)
    };
    let mut at = 0;
    let pieces = slots.iter().filter(|s| s.owner == shard.rank).map(|s| {
        let piece = mine.clone().narrow(0, at, s.len()).cast(s.dtype);
        at += s.len();
        piece
    });
    Ok(put_mine(module, grads, slots, shard.rank, pieces, kernels))
}

/// The first `n` values of `share` (flat tensors end to end) moved to
/// `out`: whole tensors, and the front of one cut in two, whose rest
/// stays at the front.
#[cfg(any(feature = "cuda", test))]
fn take_front(
    share: &mut std::collections::VecDeque<Tensor<1>>,
    mut n: usize,
    out: &mut Vec<Tensor<1>>,
) {
    while n > 0 {
        let Some(t) = share.pop_front() else {
            return;
        };
        let len = t.dims()[0];
        if len <= n {
            out.push(t);
            n -= len;
        } else {
            out.push(t.clone().narrow(0, 0, n));
            share.push_front(t.narrow(0, n, len - n));
            n = 0;
        }
    }
}

/// The end of ZeRO-2's reduction: one small f32 all-reduce of `extra` and
/// of each gradient's sum of squares (`squares`: this rank's, in the order
/// of its slots), whose sum in visiting order is the global norm's square.
fn norm_and_extra(
    grads: GradientsParams,
    squares: Vec<Tensor<1>>,
    slots: &[Slot],
    extra: &mut [f32],
    shard: &Shard,
    group: &Group,
) -> Result<(GradientsParams, f64), DistError> {
    let world = shard.counts.len();
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

    fn tiny(device: &Device, seed: u64, vocab: usize) -> kiln_model::Gpt {
        device.seed(seed);
        GptConfig::new(vocab, 4, 2, 2, 8)
            .with_intermediate(16)
            .init(device)
    }

    /// A gradient for every parameter of `m`: its weights times `factor`.
    fn grads_of(m: &kiln_model::Gpt, factor: f32) -> GradientsParams {
        struct Register(GradientsParams, f32);
        impl ModuleVisitor for Register {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0
                    .register::<D>(param.id, param.val().mul_scalar(self.1));
            }
        }
        let mut register = Register(GradientsParams::new(), factor);
        m.visit(&mut register);
        register.0
    }

    /// `grads`' gradient of each parameter of `m` (by path), where it has one.
    fn grads_by_path(
        m: &kiln_model::Gpt,
        grads: &GradientsParams,
    ) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
        let host = |data: burn::tensor::TensorData| data.iter::<f32>().collect::<Vec<_>>();
        param_entries(m)
            .into_iter()
            .filter_map(|e| {
                let got = match e.shape.len() {
                    1 => grads
                        .get::<1>(e.id)
                        .map(|g| (g.dims().to_vec(), host(g.into_data()))),
                    2 => grads
                        .get::<2>(e.id)
                        .map(|g| (g.dims().to_vec(), host(g.into_data()))),
                    d => panic!("a parameter of rank {d}"),
                };
                got.map(|g| (e.path, g))
            })
            .collect()
    }

    /// [`scatter_flat`] of `m`'s weights times `factor` as `shard`'s rank
    /// (the GPU's device standing in), sent as `wire` in buckets of
    /// `bucket_bytes`.
    fn scatter_scaled<E>(
        m: &kiln_model::Gpt,
        slots: &[Slot],
        shard: &Shard,
        factor: f32,
        wire: DType,
        bucket_bytes: usize,
        scatter: impl FnMut(Tensor<1>, Tensor<1>) -> Result<Tensor<1>, E>,
    ) -> Result<(GradientsParams, Vec<Tensor<1>>), E> {
        let device = m.devices()[0].clone();
        let grads = grads_of(m, factor);
        scatter_flat(
            m,
            grads,
            slots,
            shard,
            &device,
            wire,
            Kernels::Fused,
            bucket_bytes,
            scatter,
        )
    }

    /// ZeRO-2's reduce-scatter on the device (NCCL's on a GPU), here two
    /// ranks on flex, rank 1's `send` kept and rank 0's `scatter` doing
    /// what `ncclReduceScatter`'s average does with the two: each rank's
    /// share laid out by owner and padded to the largest (in one bucket,
    /// or the same stretch of each a bucket), and rank 0 left with its own
    /// parameters' gradients alone, each the two ranks' average, in its
    /// place and shape, with its sum of squares.
    #[test]
    fn gradients_scatter_on_the_device_by_owner() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex();
        // An odd vocabulary: shares of unequal sizes.
        let m = tiny(&device, 3, 11);
        let shards = [Shard::new(&m, 0, 2, 2), Shard::new(&m, 1, 2, 2)];
        let counts = shards[0].counts().to_vec();
        assert_ne!(counts[0], counts[1], "the test wants padding: {counts:?}");
        let widest = counts.iter().copied().max().unwrap_or(0);
        let slots = slots_of(&m, &grads_of(&m, 1.5), &shards[1]);
        assert_eq!(slots.len(), param_entries(&m).len());
        // Two ranks in buckets of `cap` bytes: rank 1's sends kept, rank
        // 0's reduce-scatter averaging its send with rank 1's of the same
        // bucket and keeping its own stretch (the first). Returns rank 0's
        // gradients, sums of squares, and each send and stretch.
        type Sent = Vec<(Vec<f32>, usize)>;
        let two_ranks = |cap: usize| -> (GradientsParams, Vec<Tensor<1>>, Sent) {
            let mut theirs = Vec::new();
            let (left, squares) = scatter_scaled(
                &m,
                &slots,
                &shards[1],
                1.5,
                DType::F32,
                cap,
                |send, recv| {
                    theirs.push(send);
                    Ok::<_, ()>(recv)
                },
            )
            .expect("scatters");
            assert_eq!(squares.len(), left.len(), "rank 1's own, each squared");
            let mut theirs = theirs.into_iter();
            let mut sent = Vec::new();
            let (grads, squares) = scatter_scaled(
                &m,
                &slots,
                &shards[0],
                0.5,
                DType::F32,
                cap,
                |send, recv| {
                    let n = recv.dims()[0];
                    sent.push((send.clone().into_data().iter::<f32>().collect(), n));
                    let other = theirs.next().expect("rank 1 sent this bucket");
                    Ok::<_, ()>(send.add(other).div_scalar(2.0).narrow(0, 0, n))
                },
            )
            .expect("scatters");
            assert!(theirs.next().is_none(), "as many buckets on each rank");
            (grads, squares, sent)
        };
        let (grads, squares, sent) = two_ranks(usize::MAX);
        let [(send, stretch)] = &sent[..] else {
            panic!("one bucket, not {}", sent.len());
        };
        assert_eq!((send.len(), *stretch), (2 * widest, widest));

        // `send`: rank 0's parameters' gradients in visiting order, then
        // zeros to the largest share, then rank 1's, then zeros.
        let want = grads_by_path(&m, &grads_of(&m, 0.5));
        let mut laid = vec![Vec::new(), Vec::new()];
        for e in param_entries(&m) {
            let r = usize::from(!shards[0].owns(e.id));
            laid[r].extend(want[&e.path].1.iter().copied());
        }
        for part in &mut laid {
            part.resize(widest, 0.0);
        }
        assert_eq!(send, &laid.concat(), "laid out by owner, padded");

        // Buckets of 64 bytes: 8 values of each rank's share a bucket, the
        // same stretch of each, cutting through tensors; the same
        // gradients and sums at the end.
        let (bucketed, bucketed_squares, sent) = two_ranks(64);
        assert_eq!(sent.len(), widest.div_ceil(8));
        for (k, (send, n)) in sent.iter().enumerate() {
            let at = 8 * k;
            assert_eq!(*n, 8.min(widest - at), "bucket {k}");
            let want = [&laid[0][at..at + n], &laid[1][at..at + n]].concat();
            assert_eq!(send, &want, "bucket {k}: each rank's stretch");
        }
        assert_eq!(grads_by_path(&m, &bucketed), grads_by_path(&m, &grads));
        let scalars = |t: &[Tensor<1>]| -> Vec<f32> {
            t.iter().map(|t| t.clone().into_scalar::<f32>()).collect()
        };
        assert_eq!(scalars(&bucketed_squares), scalars(&squares));

        // Rank 0 keeps its own parameters' gradients alone: the average.
        let got = grads_by_path(&m, &grads);
        let (half, three_halves) = (
            grads_by_path(&m, &grads_of(&m, 0.5)),
            grads_by_path(&m, &grads_of(&m, 1.5)),
        );
        let mut own = 0;
        for e in param_entries(&m) {
            if !shards[0].owns(e.id) {
                assert!(!got.contains_key(&e.path), "`{}` is rank 1's", e.path);
                continue;
            }
            own += 1;
            let (dims, values) = &got[&e.path];
            assert_eq!(dims, &e.shape, "{}", e.path);
            let mean: Vec<f32> = half[&e.path]
                .1
                .iter()
                .zip(&three_halves[&e.path].1)
                .map(|(a, b)| (a + b) / 2.0)
                .collect();
            assert_eq!(values, &mean, "{}", e.path);
        }
        assert_eq!(got.len(), own);
        // Each own gradient's sum of squares, in visiting order.
        let sums: Vec<f32> = squares
            .into_iter()
            .map(|t| t.into_scalar::<f32>())
            .collect();
        let own_paths: Vec<String> = param_entries(&m)
            .into_iter()
            .filter(|e| shards[0].owns(e.id))
            .map(|e| e.path)
            .collect();
        assert_eq!(sums.len(), own_paths.len());
        for (path, sum) in own_paths.iter().zip(&sums) {
            let want: f32 = got[path].1.iter().map(|v| v * v).sum();
            assert!(
                (sum - want).abs() <= 1e-5 * want.max(1.0),
                "{path}: {sum} against {want}"
            );
        }

        // bf16 on the wire: the same shapes, each value rounded once and
        // back in f32.
        let (grads, _) = scatter_scaled(
            &m,
            &slots,
            &shards[0],
            0.5,
            DType::BF16,
            usize::MAX,
            |send, recv| -> Result<Tensor<1>, ()> {
                assert_eq!((send.dtype(), recv.dtype()), (DType::BF16, DType::BF16));
                Ok(send.narrow(0, 0, widest))
            },
        )
        .expect("scatters");
        for (path, (_, values)) in grads_by_path(&m, &grads) {
            let rounded: Vec<f32> = half[&path]
                .1
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            assert_eq!(values, rounded, "{path}");
        }

        // A failed collective is the caller's error.
        let failed = scatter_scaled(&m, &slots, &shards[0], 0.5, DType::F32, 64, |_, _| {
            Err("the collective failed")
        });
        assert_eq!(failed.err(), Some("the collective failed"));
    }

    /// ZeRO's all-gather of the weights on the device (NCCL's on a GPU),
    /// here three ranks on flex whose models differ, ranks 1 and 2's
    /// `send` kept and rank 0's `gather` laying the three end to end as
    /// `ncclAllGather` does: rank 0 ends with its own parameters and the
    /// others', each from its owner, bit for bit.
    #[test]
    fn weights_gather_on_the_device_bit_for_bit() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex();
        let m0 = tiny(&device, 1, 10);
        // The ranks of one job: the same parameter ids, other values.
        let models: Vec<kiln_model::Gpt> = (1..=3)
            .map(|seed| {
                let values = crate::params::param_values(&tiny(&device, seed, 10));
                crate::params::load_values(
                    m0.clone(),
                    values.into_iter().map(|(p, s, v)| (p, (s, v))).collect(),
                    &device,
                )
                .expect("loads")
            })
            .collect();
        let shards: Vec<Shard> = (0..3).map(|r| Shard::new(&m0, r, 3, 1)).collect();
        let counts = shards[0].counts();
        let widest = counts.iter().copied().max().unwrap_or(0);
        assert!(
            counts[..2].iter().any(|&n| n < widest),
            "the test wants padding before rank 2's share: {counts:?}"
        );
        let sends: Vec<Tensor<1>> = (1..3)
            .map(|r| {
                let mut sent = None;
                let _ = gather_flat(models[r].clone(), &shards[r], &device, |send, recv| {
                    sent = Some(send);
                    Ok::<_, ()>(recv)
                })
                .expect("gathers");
                sent.expect("sent")
            })
            .collect();
        let gathered = gather_flat(models[0].clone(), &shards[0], &device, |send, recv| {
            assert_eq!((send.dims(), recv.dims()), ([widest], [3 * widest]));
            let mut all = vec![send];
            all.extend(sends.iter().cloned());
            Ok::<_, ()>(Tensor::cat(all, 0))
        })
        .expect("gathers");
        let values: Vec<_> = models.iter().map(crate::params::param_values).collect();
        let after = crate::params::param_values(&gathered);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut from = [0; 3];
        for (i, e) in param_entries(&m0).iter().enumerate() {
            let owner = (0..3).find(|&r| shards[r].owns(e.id)).expect("an owner");
            from[owner] += 1;
            assert_eq!(bits(&after[i].2), bits(&values[owner][i].2), "{}", e.path);
            assert_eq!(after[i].1, e.shape);
        }
        assert!(from.iter().all(|&n| n > 0), "each rank owns some: {from:?}");
        let m0 = models[0].clone();
        // Autodiff's properties kept: the gathered weights still train.
        let mut trainable = 0;
        struct Count<'a>(&'a mut usize);
        impl ModuleVisitor for Count<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                *self.0 += usize::from(param.val().is_require_grad());
            }
        }
        m0.visit(&mut Count(&mut trainable));
        let mut after_trainable = 0;
        gathered.visit(&mut Count(&mut after_trainable));
        assert_eq!(after_trainable, trainable);
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
