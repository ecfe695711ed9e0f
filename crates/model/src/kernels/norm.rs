//! The sum of squares of many tensors (the square of the global gradient
//! norm that clipping needs) in one kernel launch per group of tensors.
//!
//! Composed of Burn operations, the global norm is three operations per
//! parameter (square, sum, add to the running total), and a sum is itself
//! one or two reduction kernels: on a GPU about four launches per
//! parameter, more than the fused AdamW update that follows it (one per
//! parameter). Where a step is short the launches, not the bytes, are its
//! cost (the tiny GPT on an H100: about 20 µs a launch). The kernel here
//! reads a group of tensors (up to 32, fewer where the device binds fewer
//! buffers) and adds the squares of their elements into a fixed set of
//! [`SLOTS`] partial sums (slot `u` takes each tensor's elements `u`,
//! `u + SLOTS`, `u + 2·SLOTS`, …: neighbouring units read neighbouring
//! elements), so `n` tensors cost `⌈n/32⌉` launches plus one to zero the
//! slots and one sum at the end. The order of the additions is fixed by
//! `SLOTS` alone (tensor after tensor in each slot), so the result is the
//! same on every run, whatever the group size; it differs from the
//! composition's in the last bits (another order of the same additions).
//!
//! CubeCL GPUs (wgpu, CUDA) without Burn's `fusion` (which fuses the
//! composition itself, as for AdamW); elsewhere, and with `Reference`, the
//! composition runs.

use burn::tensor::Tensor;

use super::Kernels;

/// The partial sums every tensor's kernel adds into: 64 cubes of 256 units.
pub(crate) const SLOTS: usize = 16_384;

/// The sum of the squares of every element of `tensors`, as a one-element
/// tensor (f32 from the kernel; the tensors' dtype from the composition);
/// `None` for no tensors. See the module's documentation for which runs.
pub fn sum_of_squares(
    tensors: impl IntoIterator<Item = Tensor<1>>,
    kernels: Kernels,
) -> Option<Tensor<1>> {
    let mut tensors = tensors.into_iter().peekable();
    let first = tensors.peek()?;
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused && fused::runs(first) {
        return Some(fused::sum_of_squares(tensors));
    }
    let _ = (kernels, first);
    tensors
        .map(|t| t.powi_scalar(2).sum())
        .reduce(|total, sum| total.add(sum))
}

/// [`sum_of_squares`] as a number, read back once. With the kernel, its
/// [`SLOTS`] partial sums are read back (64 KiB) and added on the host in
/// a fixed order (in f64), not by a device-side sum whose kernel CubeCL's
/// autotune picks by timing in each process: the ranks of a job clip
/// their copies of the same averaged gradients by this norm, and must
/// agree to the last bit (the 2026-12-04 H200 check: two ranks on one GPU,
/// each tuning its own reductions, ended 100 steps with other weights).
pub fn sum_of_squares_value(
    tensors: impl IntoIterator<Item = Tensor<1>>,
    kernels: Kernels,
) -> Option<f64> {
    let mut tensors = tensors.into_iter().peekable();
    let first = tensors.peek()?;
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused && fused::runs(first) {
        let data = fused::partials(tensors).into_data();
        let partials = data.try_to_vec::<f32>().expect("f32 partial sums");
        return Some(partials.iter().map(|&p| f64::from(p)).sum());
    }
    let _ = first;
    sum_of_squares(tensors, kernels).map(|s| f64::from(s.into_scalar::<f32>()))
}

/// Whether [`sum_of_squares`] runs its kernel for tensors like `t`.
pub(crate) fn fused_here(t: &Tensor<1>) -> bool {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    return fused::runs(t);
    #[cfg(not(all(feature = "cube", not(feature = "fusion"))))]
    {
        let _ = t;
        false
    }
}

#[cfg(all(feature = "cuda", not(feature = "fusion")))]
pub(super) use fused::offline_kernels;

#[cfg(all(feature = "cube", not(feature = "fusion")))]
mod fused {
    //! The kernel and the grouping of tensors into its launches.

    use burn::tensor::{FloatDType, Tensor};
    use burn_backend::cubecl::dtype_to_storage_type;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeDim, calculate_cube_count_elemwise};

    use super::super::{from_cube, into_cube};
    use super::SLOTS;

    /// Units per cube.
    const CUBE_UNITS: usize = 256;

    /// The most tensors one launch reads: the kernel's code holds one loop
    /// per tensor, and each count is compiled once. Fewer where the device
    /// binds fewer buffers (wgpu on Metal: 31).
    const MAX_GROUP: usize = 32;

    /// Bindings kept for the partial sums (written in place), the launch's
    /// metadata and scalars, with room to spare.
    const RESERVED_BINDINGS: u32 = 6;

    /// Whether `t` lives on a CubeCL GPU in a dtype the kernel reads.
    pub(super) fn runs(t: &Tensor<1>) -> bool {
        super::super::cube_gpu_float(t)
    }

    /// The squares of `tensors` added into [`SLOTS`] partial sums (see
    /// [`partials`]), then summed.
    pub(super) fn sum_of_squares(tensors: impl Iterator<Item = Tensor<1>>) -> Tensor<1> {
        partials(tensors).sum()
    }

    /// The squares of `tensors` added into [`SLOTS`] partial sums (f32) in
    /// as few launches as the device's bindings allow (one dtype a launch).
    pub(super) fn partials(tensors: impl Iterator<Item = Tensor<1>>) -> Tensor<1> {
        let mut tensors = tensors.peekable();
        let device = tensors.peek().expect("at least one tensor").device();
        let start = Tensor::<1>::zeros([SLOTS], &device).cast(FloatDType::F32);
        let mut partials = into_cube(start);
        let bindings = partials.client.properties().hardware.max_bindings;
        let per_launch = (bindings.saturating_sub(RESERVED_BINDINGS) as usize).clamp(1, MAX_GROUP);
        let mut group: Vec<CubeTensor> = Vec::new();
        for x in tensors.map(into_cube) {
            if group.len() == per_launch || group.first().is_some_and(|g| g.dtype != x.dtype) {
                partials = add_squares(std::mem::take(&mut group), partials);
            }
            group.push(x);
        }
        if !group.is_empty() {
            partials = add_squares(group, partials);
        }
        from_cube(partials)
    }

    /// Unit `u` adds, tensor after tensor, the squares of the tensor's
    /// elements `u`, `u + slots`, … (in `rounds[k]` rounds) to its slot:
    /// the same additions in the same order as one launch per tensor.
    #[cube(launch)]
    fn add_squares_kernel<E: Float>(
        xs: &Sequence<OwnedTensor<E>>,
        partials: &mut [f32],
        rounds: Sequence<usize>,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = ABSOLUTE_POS;
        let slots = partials.len();
        if unit >= slots {
            terminate!();
        }
        let mut total = partials[unit];
        let count = comptime![xs.len()];
        #[unroll]
        for k in 0..count {
            let x = &xs[k];
            let n = x.len();
            let mut acc = f32::new(0.0);
            for r in 0..rounds[k] {
                let i = unit + r * slots;
                if i < n {
                    let v = f32::cast_from(x[i]);
                    acc += v * v;
                }
            }
            total += acc;
        }
        partials[unit] = total;
    }

    /// One launch: `xs` (one dtype) added into `partials`, in place (the
    /// partial sums are [`sum_of_squares`]' own buffer, made for it).
    fn add_squares(xs: Vec<CubeTensor>, partials: CubeTensor) -> CubeTensor {
        let partials = into_contiguous(partials);
        let xs: Vec<CubeTensor> = xs.into_iter().map(into_contiguous).collect();
        let client = partials.client.clone();
        let dtype = xs[0].dtype;
        let rounds: SequenceArg<usize> = xs
            .iter()
            .map(|x| x.meta.shape.num_elements().div_ceil(SLOTS))
            .collect();
        let cube_dim = CubeDim::new_1d(CUBE_UNITS as u32);
        let cube_count = calculate_cube_count_elemwise(&client, SLOTS, cube_dim);
        add_squares_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            xs.into_iter().map(CubeTensor::into_tensor_arg).collect(),
            partials.clone().into_buffer_arg(),
            rounds,
            dtype_to_storage_type(dtype),
        );
        partials
    }

    /// The kernel as clipping launches it on CUDA: a full group
    /// ([`MAX_GROUP`] tensors, CUDA binds 1,024 buffers) of f32 gradients
    /// (a bf16 run's too: its master weights are f32), for `kiln
    /// check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::cube::offline::Offline,
    ) -> super::super::cube::offline::Kernels {
        use super::super::cube::offline::{buffer, tensor};
        vec![(
            format!("sum of squares ({MAX_GROUP} F32 tensors)"),
            Box::new(add_squares_kernel::AddSquaresKernel::new(
                o.settings(CUBE_UNITS as u32, 1),
                o.props.clone(),
                o.target.clone(),
                (0..MAX_GROUP).map(|_| tensor(None)).collect(),
                buffer(),
                (0..MAX_GROUP).map(|_| ()).collect(),
                dtype_to_storage_type(burn::tensor::DType::F32),
            )),
        )]
    }
}
