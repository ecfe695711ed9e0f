//! LayerNorm on the CubeCL GPUs (wgpu, CUDA) as one kernel forward and one
//! backward (plus two column sums for gamma and beta).
//!
//! Burn's LayerNorm is a composition: the mean, the variance, the
//! subtraction, the square root, the division, gamma and beta, each its own
//! kernel over the whole activation, and about twice as many in the
//! backward pass: some 25 launches per LayerNorm and step, two LayerNorms
//! per transformer block. Here one cube of up to 256 units takes one
//! row (neighbouring units read neighbouring elements) and reduces through
//! shared memory: the forward kernel writes the output and the row's mean
//! and 1/σ (kept for the backward pass, two floats a row); the backward
//! kernel writes the input's gradient and `grad · x̂`, whose column sum
//! (the bias's kernel, `cube::bias`) is gamma's gradient, as the output
//! gradient's is beta's. The statistics are computed as the composition computes them
//! (the mean, then the mean of the squared deviations), in f32.
//!
//! f32 only (kiln's mixed precision keeps LayerNorm in f32); not under
//! Burn's `fusion`, which fuses the composition's element-wise operations
//! itself. Elsewhere, and with `Reference`, Burn's `LayerNorm` runs.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};

use crate::kernels::autodiff::{self, Three};

/// Units per cube, and so per row: the row's width rounded up to a power
/// of two, at least one warp (32) and at most 256 (wider rows take several
/// elements per unit).
fn cube_units(width: usize) -> usize {
    width.next_power_of_two().clamp(32, 256)
}

/// LayerNorm as a Burn backend extension: the kernels on the CubeCL
/// backend, routed through `Autodiff` for training.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait KilnCubeLayerNorm: Backend {
    /// LayerNorm's output and each row's mean and 1/σ.
    fn kiln_cube_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// The gradients of x, gamma and beta.
    fn kiln_cube_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl KilnCubeLayerNorm for burn::backend::Cube {
    fn kiln_cube_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> Three<Self> {
        cube::forward(x, gamma, beta, epsilon)
    }

    fn kiln_cube_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Three<Self> {
        cube::backward(x, gamma, mean, rstd, grad)
    }
}

impl<B: Backend + KilnCubeLayerNorm, C: CheckpointStrategy> KilnCubeLayerNorm for Autodiff<B, C> {
    fn kiln_cube_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> Three<Self> {
        autodiff::layer_norm::<B, C>(
            [x, gamma, beta],
            epsilon,
            B::kiln_cube_layer_norm,
            B::kiln_cube_layer_norm_backward,
        )
    }

    fn kiln_cube_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Three<Self> {
        autodiff::layer_norm_backward::<B, C>(
            [x, gamma, mean, rstd, grad],
            B::kiln_cube_layer_norm_backward,
        )
    }
}

/// Whether `x`, gamma and beta live on a CubeCL GPU (with or without
/// autodiff), all in f32.
pub(crate) fn runs<const D: usize>(x: &Tensor<D>, gamma: &Tensor<1>, beta: &Tensor<1>) -> bool {
    [x.dtype(), gamma.dtype(), beta.dtype()] == [DType::F32; 3] && super::cube_gpu_float(x)
}

/// LayerNorm of `x` over its last dimension by the kernels.
pub(crate) fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
) -> Tensor<D> {
    let (y, _mean, _rstd) = <Dispatch as KilnCubeLayerNorm>::kiln_cube_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    );
    Tensor::from_dispatch(y)
}

#[cfg(feature = "cuda")]
pub(super) use cube::offline_kernels;

mod cube {
    //! The CubeCL kernels: one cube per row.

    use burn::tensor::DType;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeDim, calculate_cube_count_elemwise};

    use super::cube_units;

    /// The cube's sum of each unit's `value`, in every unit (`shared` is
    /// the cube's scratch; it is free again when this returns).
    #[cube]
    fn cube_sum(value: f32, shared: &mut Shared<[f32]>, #[comptime] units: usize) -> f32 {
        let unit = UNIT_POS as usize;
        shared[unit] = value;
        sync_cube();
        let mut stride = units.runtime() / 2;
        while stride > 0 {
            if unit < stride {
                shared[unit] += shared[unit + stride];
            }
            sync_cube();
            stride /= 2;
        }
        let total = shared[0];
        sync_cube();
        total
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_kernel(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        width: usize,
        rounds: usize,
        epsilon: f32,
        #[comptime] units: usize,
    ) {
        let row = CUBE_POS;
        if row >= mean.len() {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let start = row * width;
        let mut shared = Shared::<[f32]>::new_slice(units);
        let mut s = f32::new(0.0);
        for r in 0..rounds {
            let c = unit + r * units;
            if c < width {
                s += x[start + c];
            }
        }
        let m = cube_sum(s, &mut shared, units) / f32::cast_from(width);
        let mut sq = f32::new(0.0);
        for r in 0..rounds {
            let c = unit + r * units;
            if c < width {
                let d = x[start + c] - m;
                sq += d * d;
            }
        }
        let variance = cube_sum(sq, &mut shared, units) / f32::cast_from(width);
        let inv = f32::new(1.0) / (variance + epsilon).sqrt();
        for r in 0..rounds {
            let c = unit + r * units;
            if c < width {
                y[start + c] = (x[start + c] - m) * inv * gamma[c] + beta[c];
            }
        }
        if unit == 0 {
            mean[row] = m;
            rstd[row] = inv;
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward_kernel(
        x: &[f32],
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        grad: &[f32],
        dx: &mut [f32],
        grad_xhat: &mut [f32],
        width: usize,
        rounds: usize,
        #[comptime] units: usize,
    ) {
        let row = CUBE_POS;
        if row >= mean.len() {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let start = row * width;
        let (m, inv) = (mean[row], rstd[row]);
        let mut shared = Shared::<[f32]>::new_slice(units);
        // dx = (g·γ − mean(g·γ) − x̂ · mean(g·γ·x̂)) / σ
        let mut sum_gg = f32::new(0.0);
        let mut sum_ggx = f32::new(0.0);
        for r in 0..rounds {
            let c = unit + r * units;
            if c < width {
                let g = grad[start + c];
                let xhat = (x[start + c] - m) * inv;
                let gg = g * gamma[c];
                sum_gg += gg;
                sum_ggx += gg * xhat;
                grad_xhat[start + c] = g * xhat;
            }
        }
        let n = f32::cast_from(width);
        let mean_gg = cube_sum(sum_gg, &mut shared, units) / n;
        let mean_ggx = cube_sum(sum_ggx, &mut shared, units) / n;
        for r in 0..rounds {
            let c = unit + r * units;
            if c < width {
                let xhat = (x[start + c] - m) * inv;
                let gg = grad[start + c] * gamma[c];
                dx[start + c] = (gg - mean_gg - xhat * mean_ggx) * inv;
            }
        }
    }

    /// Rows, width, and the launch: one cube per row.
    struct Rows {
        rows: usize,
        width: usize,
        rounds: usize,
        units: usize,
        cube_count: CubeCount,
        cube_dim: CubeDim,
    }

    fn rows(x: &CubeTensor) -> Rows {
        let shape = x.meta.shape();
        let width = shape[shape.len() - 1];
        let rows = shape.num_elements() / width.max(1);
        let units = cube_units(width);
        let cube_dim = CubeDim::new_1d(units as u32);
        Rows {
            rows,
            width,
            rounds: width.div_ceil(units),
            units,
            cube_count: calculate_cube_count_elemwise(&x.client, rows * units, cube_dim),
            cube_dim,
        }
    }

    /// An f32 tensor of `shape` on `like`'s device.
    fn empty(like: &CubeTensor, shape: Vec<usize>) -> CubeTensor {
        super::super::cube_empty(like, shape, DType::F32)
    }

    pub(super) fn forward(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f64,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let [x, gamma, beta] = [x, gamma, beta].map(into_contiguous);
        let r = rows(&x);
        let y = empty(&x, x.meta.shape().to_vec());
        let (mean, rstd) = (empty(&x, vec![r.rows]), empty(&x, vec![r.rows]));
        layer_norm_kernel::launch(
            &x.client.clone(),
            r.cube_count,
            r.cube_dim,
            x.into_buffer_arg(),
            gamma.into_buffer_arg(),
            beta.into_buffer_arg(),
            y.clone().into_buffer_arg(),
            mean.clone().into_buffer_arg(),
            rstd.clone().into_buffer_arg(),
            r.width,
            r.rounds,
            epsilon as f32,
            r.units,
        );
        (y, mean, rstd)
    }

    pub(super) fn backward(
        x: CubeTensor,
        gamma: CubeTensor,
        mean: CubeTensor,
        rstd: CubeTensor,
        grad: CubeTensor,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let [x, gamma, mean, rstd, grad] = [x, gamma, mean, rstd, grad].map(into_contiguous);
        let r = rows(&x);
        let dx = empty(&x, x.meta.shape().to_vec());
        let grad_xhat = empty(&x, vec![r.rows, r.width]);
        layer_norm_backward_kernel::launch(
            &x.client.clone(),
            r.cube_count,
            r.cube_dim,
            x.into_buffer_arg(),
            gamma.into_buffer_arg(),
            mean.into_buffer_arg(),
            rstd.into_buffer_arg(),
            grad.clone().into_buffer_arg(),
            dx.clone().into_buffer_arg(),
            grad_xhat.clone().into_buffer_arg(),
            r.width,
            r.rounds,
            r.units,
        );
        // Gamma's and beta's gradients: the column sums of `grad · x̂` and
        // of `grad`, by the bias's kernel.
        let dgamma = super::super::bias::cube::column_sum(grad_xhat);
        let dbeta = super::super::bias::cube::column_sum(grad);
        (dx, dgamma, dbeta)
    }

    /// The kernels at GPT-2's width (768: 256 units a row), for `kiln
    /// check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::offline::Offline,
    ) -> super::super::offline::Kernels {
        use super::super::offline::buffer;
        let units = super::cube_units(768);
        let settings = o.settings(units as u32, 1);
        let (props, target) = (o.props.clone(), o.target.clone());
        vec![
            (
                "LayerNorm (F32)".to_string(),
                Box::new(layer_norm_kernel::LayerNormKernel::new(
                    settings.clone(),
                    props.clone(),
                    target.clone(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    (),
                    (),
                    (),
                    units,
                )),
            ),
            (
                "LayerNorm's gradient (F32)".to_string(),
                Box::new(layer_norm_backward_kernel::LayerNormBackwardKernel::new(
                    settings,
                    props,
                    target,
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    (),
                    (),
                    units,
                )),
            ),
        ]
    }
}
