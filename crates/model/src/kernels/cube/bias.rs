//! A bias added along the last dimension on the CubeCL GPUs (wgpu, CUDA),
//! and the column sums that are its gradient (and LayerNorm's gamma and
//! beta gradients): one kernel that reads the rows the way a GPU reads
//! fastest.
//!
//! Burn's bias gradient is its reduction over the rows of `[rows, width]`
//! (a broadcast dimension at a time): on an H200 in the 2026-12-04 GPU
//! check those reductions took 46 % of a GPT-2 small step, 632 launches a
//! step at 1.35 ms each, where the data takes microseconds to read. Here a
//! cube of 256 units takes a tile of 32 neighbouring columns and a split
//! of the rows: the cube's 8 warps each read whole 32-column rows of the
//! split (one coalesced read a row), every 8th row, summing in f32; the
//! cube adds its 8 partial sums through shared memory and writes one sum a
//! column for its split. A second launch sums the splits' sums the same
//! way (`[splits, width]`, one split). Enough cubes to fill the GPU (16,384
//! rows of 768: 24 column tiles × 64 splits), a fixed order (the same sums
//! every run), f32, f16 and bf16 rows in, f32 sums out.
//!
//! The addition itself is Burn's broadcast (one kernel); its gradient is
//! the output's for `x` and the column sums for the bias, in the bias's
//! dtype. Not under Burn's `fusion` (see `kernels::add_bias`).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Shape, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Tensor};

use crate::kernels::autodiff::KernelBackward;

/// The bias and its column sums as a Burn backend extension: the kernel on
/// the CubeCL backend, routed through `Autodiff` for training.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait KilnCubeBias: Backend {
    /// `x + bias` along x's last dimension.
    fn kiln_cube_add_bias(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// The sum of each column of `x` viewed as `[rows, width]` (`width`
    /// its last dimension): `[width]`, f32.
    fn kiln_cube_column_sum(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl KilnCubeBias for burn::backend::Cube {
    fn kiln_cube_add_bias(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        broadcast_add::<Self>(x, bias)
    }

    fn kiln_cube_column_sum(x: FloatTensor<Self>) -> FloatTensor<Self> {
        cube::column_sum(x)
    }
}

/// `x + bias` by the backend's broadcast addition: the bias viewed as
/// `[1, …, 1, width]`.
fn broadcast_add<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let width = bias.shape().num_elements();
    let mut dims = vec![1; rank];
    dims[rank - 1] = width;
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}

impl<B: Backend + KilnCubeBias, C: CheckpointStrategy> KilnCubeBias for Autodiff<B, C> {
    fn kiln_cube_add_bias(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        // x's gradient is the output's; the bias's its column sums, in the
        // bias's dtype (the state: `None` where the bias is not tracked, a
        // frozen layer's, and no sums are made).
        let step = KernelBackward::<B, Option<DType>, 2>(|dtype, grad| {
            let sums = match dtype {
                None => grad.clone(),
                Some(DType::F32) => B::kiln_cube_column_sum(grad.clone()),
                Some(dtype) => B::float_cast(B::kiln_cube_column_sum(grad.clone()), dtype.into()),
            };
            [grad, sums]
        });
        let nodes = [x.node(), bias.node()];
        let bias_tracked = bias.is_tracked();
        let (x, bias) = (Self::inner(x), Self::inner(bias));
        let dtype = bias_tracked.then(|| bias.dtype());
        let y = B::kiln_cube_add_bias(x, bias);
        match step.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(dtype, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_cube_column_sum(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_cube_column_sum(Self::inner(x)))
    }
}

/// Whether `x` and `bias` live on a CubeCL GPU (with or without autodiff)
/// in one float dtype the kernel reads, `bias` as wide as x's last
/// dimension.
pub(crate) fn runs<const D: usize>(x: &Tensor<D>, bias: &Tensor<1>) -> bool {
    x.dtype() == bias.dtype() && bias.dims()[0] == x.dims()[D - 1] && super::cube_gpu_float(x)
}

/// `x + bias` along x's last dimension, its bias gradient by the kernel.
pub(crate) fn add_bias<const D: usize>(x: Tensor<D>, bias: Tensor<1>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as KilnCubeBias>::kiln_cube_add_bias(
        x.into_dispatch(),
        bias.into_dispatch(),
    ))
}

#[cfg(feature = "cuda")]
pub(super) use cube::offline_kernels;

pub(super) mod cube {
    //! The CubeCL kernel: a cube per 32 columns and split of the rows.

    use burn::tensor::DType;
    use burn_backend::cubecl::dtype_to_storage_type;
    use burn_backend::ops::FloatTensorOps;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeCount, CubeDim};

    /// Columns a cube takes: a warp's (NVIDIA's 32 lanes) worth, one
    /// coalesced read a row.
    const TILE: usize = 32;
    /// Warps a cube: each reads every `PHASES`-th row of the split.
    const PHASES: usize = 8;
    /// Rows a split, about: 32 for each of a cube's units to sum.
    const ROWS_PER_SPLIT: usize = 256;
    /// Splits at most (CUDA's grid is 65,535 high); beyond, the splits grow.
    const MAX_SPLITS: usize = 4_096;

    #[cube(launch)]
    fn column_sum_kernel<E: Float>(
        x: &[E],
        sums: &mut [f32],
        rows: usize,
        width: usize,
        rows_per_split: usize,
        #[comptime] tile: usize,
        #[comptime] phases: usize,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = UNIT_POS as usize;
        let lane = unit % tile;
        let phase = unit / tile;
        let column = CUBE_POS_X as usize * tile + lane;
        let split = CUBE_POS_Y as usize;
        let start = split * rows_per_split;
        let mut end = start + rows_per_split;
        if end > rows {
            end = rows;
        }
        let mut sum = f32::new(0.0);
        if column < width {
            let mut row = start + phase;
            while row < end {
                sum += f32::cast_from(x[row * width + column]);
                row += phases;
            }
        }
        // Every unit reaches the barrier; the first warp adds the others'.
        let mut shared = Shared::<[f32]>::new_slice(tile * phases);
        shared[unit] = sum;
        sync_cube();
        if phase == 0 && column < width {
            let mut total = f32::new(0.0);
            for p in 0..phases {
                total += shared[p * tile + lane];
            }
            sums[split * width + column] = total;
        }
    }

    /// How many splits `rows` rows take.
    fn splits(rows: usize) -> usize {
        rows.div_ceil(ROWS_PER_SPLIT).clamp(1, MAX_SPLITS)
    }

    /// One launch: `[rows, width]` in, `[splits, width]` f32 out.
    fn launch_sums(x: CubeTensor, rows: usize, width: usize, splits: usize) -> CubeTensor {
        let rows_per_split = rows.div_ceil(splits).max(1);
        let sums = super::super::cube_empty(&x, vec![splits, width], DType::F32);
        let dtype = x.dtype;
        column_sum_kernel::launch(
            &x.client.clone(),
            CubeCount::Static(width.div_ceil(TILE) as u32, splits as u32, 1),
            CubeDim::new_1d((TILE * PHASES) as u32),
            x.into_buffer_arg(),
            sums.clone().into_buffer_arg(),
            rows,
            width,
            rows_per_split,
            TILE,
            PHASES,
            dtype_to_storage_type(dtype),
        );
        sums
    }

    /// The column sums of `x` viewed as `[rows, width]` (`width` its last
    /// dimension): `[width]`, f32. One launch where the rows take one
    /// split, else two (the splits' sums, then their sum in one split).
    pub(crate) fn column_sum(x: CubeTensor) -> CubeTensor {
        type B = burn::backend::Cube;
        let x = into_contiguous(x);
        let shape = x.meta.shape();
        let width = shape[shape.len() - 1];
        let rows = shape.num_elements() / width.max(1);
        let splits = splits(rows);
        let mut sums = launch_sums(x, rows, width, splits);
        if splits > 1 {
            sums = launch_sums(sums, splits, width, 1);
        }
        <B as FloatTensorOps<B>>::float_reshape(sums, [width].into())
    }

    /// The kernel in bf16, for `kiln check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::offline::Offline,
    ) -> super::super::offline::Kernels {
        use super::super::offline::buffer;
        let kernel = column_sum_kernel::ColumnSumKernel::new(
            o.settings((TILE * PHASES) as u32, 1),
            o.props.clone(),
            o.target.clone(),
            buffer(),
            buffer(),
            (),
            (),
            (),
            TILE,
            PHASES,
            dtype_to_storage_type(burn::tensor::DType::BF16),
        );
        vec![(
            "column sums: bias gradient (BF16)".to_string(),
            Box::new(kernel),
        )]
    }
}
