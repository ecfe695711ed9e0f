//! The token embedding's gradient on the CubeCL GPUs (wgpu, CUDA): the
//! rows of the output gradient summed into the table's rows, one unit a
//! column of a table row, in a fixed order.
//!
//! Burn's gradient is its `select_assign` into zeros: one unit a column
//! (768 for GPT-2 small), each looping over every token (16,384), so the
//! GPU runs 768 units for milliseconds (4.8 ms a launch on an H200 in the
//! 2026-12-04 profile, `SelectAssignKernel`). Here the token ids are read
//! back to the host (their buffer is the micro-batch's input: a few KiB,
//! one wait at the end of the backward pass) and sorted by counting, a
//! stable sort: each table row's tokens in order of position
//! (`row_start`, `order`). The kernel then gives each table row and tile
//! of 256 columns a cube, each unit summing its column over the row's
//! tokens in that order (in f32) and writing the sum, zero for a row no
//! token has: every row written once, no atomics, the same sums every run.
//!
//! The forward pass is Burn's embedding (a `select`). Not under Burn's
//! `fusion`.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{Int, Tensor};

use crate::kernels::autodiff::KernelBackward;

/// The token embedding as a Burn backend extension: Burn's lookup forward,
/// kiln's kernel for the table's gradient.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait KilnCubeEmbedding: Backend {
    /// The rows of `weight` (`[rows, width]`) at `ids` (`[batch, time]`):
    /// `[batch, time, width]`.
    fn kiln_cube_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self>;
    /// The table's gradient: `grad` (`[batch, time, width]`) summed into
    /// the rows `ids` name, `[rows, width]` in `grad`'s dtype.
    fn kiln_cube_embedding_grad(
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
        rows: usize,
    ) -> FloatTensor<Self>;
}

impl KilnCubeEmbedding for burn::backend::Cube {
    fn kiln_cube_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        use burn::backend::ops::ModuleOps;
        <Self as ModuleOps<Self>>::embedding(weight, ids)
    }

    fn kiln_cube_embedding_grad(
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
        rows: usize,
    ) -> FloatTensor<Self> {
        cube::embedding_grad(grad, ids, rows)
    }
}

impl<B: Backend + KilnCubeEmbedding, C: CheckpointStrategy> KilnCubeEmbedding for Autodiff<B, C> {
    fn kiln_cube_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let step = KernelBackward::<B, (IntTensor<B>, usize), 1>(|(ids, rows), grad| {
            [B::kiln_cube_embedding_grad(grad, ids, rows)]
        });
        let nodes = [weight.node()];
        let weight = Self::inner(weight);
        let rows = weight.shape()[0];
        let y = B::kiln_cube_embedding(weight, ids.clone());
        match step.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((ids, rows), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_cube_embedding_grad(
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
        rows: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_cube_embedding_grad(Self::inner(grad), ids, rows))
    }
}

/// Whether the kernel runs for a table like `weight`: a CubeCL GPU, a
/// float dtype it reads.
pub(crate) fn runs(weight: &Tensor<2>) -> bool {
    super::cube_gpu_float(weight)
}

/// `weight`'s rows at `ids`, the table's gradient by the kernel.
pub(crate) fn embedding(weight: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as KilnCubeEmbedding>::kiln_cube_embedding(
        weight.into_dispatch(),
        ids.into_dispatch(),
    ))
}

#[cfg(feature = "cuda")]
pub(super) use cube::offline_kernels;

mod cube {
    //! The kernel: a cube per table row and 256 columns.

    use burn::backend::TensorData;
    use burn_backend::cubecl::dtype_to_storage_type;
    use burn_backend::ops::{FloatTensorOps, IntTensorOps};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeCount, CubeDim};

    type B = burn::backend::Cube;

    /// Columns a cube.
    const COLUMNS: usize = 256;
    /// Rows of the grid's second dimension at most (CUDA's is 65,535);
    /// beyond, its third.
    const GRID_Y: usize = 32_768;

    #[cube(launch)]
    fn embedding_grad_kernel<E: Float, I: Int>(
        grad: &[E],
        order: &[I],
        row_start: &[I],
        out: &mut [E],
        rows: usize,
        width: usize,
        #[define(E, I)] _dtypes: [ElemType; 2],
    ) {
        let row = CUBE_POS_Y as usize + CUBE_POS_Z as usize * CUBE_COUNT_Y as usize;
        let column = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        if row < rows && column < width {
            let start = usize::cast_from(row_start[row]);
            let end = usize::cast_from(row_start[row + 1]);
            let mut sum = f32::new(0.0);
            let mut j = start;
            while j < end {
                let token = usize::cast_from(order[j]);
                sum += f32::cast_from(grad[token * width + column]);
                j += 1;
            }
            out[row * width + column] = E::cast_from(sum);
        }
    }

    /// `grad` (`[…, width]`, one row a token) summed into `rows` table rows
    /// by `ids` (the tokens' rows, any shape of as many).
    pub(super) fn embedding_grad(grad: CubeTensor, ids: CubeTensor, rows: usize) -> CubeTensor {
        let device = grad.device.clone();
        let shape = grad.meta.shape().clone();
        let width = shape[shape.num_dims() - 1];
        let tokens = shape.num_elements() / width.max(1);
        let data = cubecl::future::block_on(<B as IntTensorOps<B>>::int_into_data(ids))
            .unwrap_or_else(|e| panic!("the token embedding's gradient: reading the ids: {e:?}"));
        let ids: Vec<i64> = data.iter::<i64>().collect();
        assert_eq!(
            ids.len(),
            tokens,
            "one id a row of the embedding's gradient"
        );
        let (row_start, order) =
            crate::kernels::group::group_by_row(&ids, rows).unwrap_or_else(|| {
                panic!("the token embedding's gradient: an id outside the table's {rows} rows")
            });
        let upload = |values: Vec<i32>| {
            let n = values.len();
            <B as IntTensorOps<B>>::int_from_data(TensorData::new(values, [n]), &device)
        };
        let (row_start, order) = (upload(row_start), upload(order));
        let grad = into_contiguous(<B as FloatTensorOps<B>>::float_reshape(
            grad,
            [tokens, width].into(),
        ));
        let dtype = grad.dtype;
        let out = super::super::cube_empty(&grad, vec![rows, width], dtype);
        let (grid_y, grid_z) = (rows.clamp(1, GRID_Y), rows.div_ceil(GRID_Y).max(1));
        let index_dtype = order.dtype;
        embedding_grad_kernel::launch(
            &grad.client.clone(),
            CubeCount::Static(width.div_ceil(COLUMNS) as u32, grid_y as u32, grid_z as u32),
            CubeDim::new_1d(COLUMNS as u32),
            grad.into_buffer_arg(),
            order.into_buffer_arg(),
            row_start.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            rows,
            width,
            [
                dtype_to_storage_type(dtype),
                dtype_to_storage_type(index_dtype),
            ],
        );
        out
    }

    /// The kernel as GPT-2 small's token embedding runs it (bf16, i32
    /// ids), for `kiln check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::offline::Offline,
    ) -> super::super::offline::Kernels {
        use super::super::offline::buffer;
        use burn::tensor::DType;
        let kernel = embedding_grad_kernel::EmbeddingGradKernel::new(
            o.settings(COLUMNS as u32, 1),
            o.props.clone(),
            o.target.clone(),
            buffer(),
            buffer(),
            buffer(),
            buffer(),
            (),
            (),
            [
                dtype_to_storage_type(DType::BF16),
                dtype_to_storage_type(DType::I32),
            ],
        );
        vec![(
            "token embedding's gradient (BF16)".to_string(),
            Box::new(kernel),
        )]
    }
}
