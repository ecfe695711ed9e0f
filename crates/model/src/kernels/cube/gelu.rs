//! Exact GELU on the CubeCL GPUs (wgpu, CUDA): one kernel forward, one
//! backward.
//!
//! Burn's GELU on CubeCL is five kernels forward (a division, `erf`, an
//! addition, a multiplication, a division) and, under autodiff, some
//! fifteen backward; and that backward is the derivative of GELU's tanh
//! approximation (Burn's default `gelu_backward`, which burn-cubecl does
//! not override; flex does), up to 8.7e-4 off the exact derivative
//! `Φ(x) + x·φ(x)` of the exact forward. Here each element is one unit:
//! forward `x·Φ(x)`, backward `grad·(Φ(x) + x·φ(x))`, computed in f32 for
//! f32, bf16 and f16 tensors, with CubeCL's `erf`.
//!
//! Not under Burn's `fusion`, which fuses the composition's element-wise
//! operations itself. Elsewhere, and with `Reference`, Burn's GELU runs.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::Tensor;

use crate::kernels::autodiff;

/// GELU as a Burn backend extension: the kernels on the CubeCL backend,
/// routed through `Autodiff` for training.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait KilnCubeGelu: Backend {
    /// Exact GELU of `x`.
    fn kiln_cube_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `grad · gelu'(x)`.
    fn kiln_cube_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl KilnCubeGelu for burn::backend::Cube {
    fn kiln_cube_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        cube::forward(x)
    }

    fn kiln_cube_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        cube::backward(x, grad)
    }
}

impl<B: Backend + KilnCubeGelu, C: CheckpointStrategy> KilnCubeGelu for Autodiff<B, C> {
    fn kiln_cube_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::unary::<B, C>(x, B::kiln_cube_gelu, B::kiln_cube_gelu_backward)
    }

    fn kiln_cube_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::unary_backward::<B, C>(x, grad, B::kiln_cube_gelu_backward)
    }
}

/// Whether `x` lives on a CubeCL GPU (with or without autodiff) in a dtype
/// the kernels take.
pub(crate) fn runs<const D: usize>(x: &Tensor<D>) -> bool {
    super::cube_gpu_float(x)
}

/// Exact GELU of `x` by the kernels.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as KilnCubeGelu>::kiln_cube_gelu(
        x.into_dispatch(),
    ))
}

#[cfg(feature = "cuda")]
pub(super) use cube::offline_kernels;

mod cube {
    //! The CubeCL kernels: one unit per element.

    use burn_backend::cubecl::dtype_to_storage_type;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeDim, calculate_cube_count_elemwise};

    /// Units per cube.
    const CUBE_UNITS: usize = 256;

    /// Φ(x), the standard normal's distribution function.
    #[cube]
    fn normal_cdf(x: f32) -> f32 {
        f32::new(0.5) * (f32::new(1.0) + Erf::erf(x * f32::new(std::f32::consts::FRAC_1_SQRT_2)))
    }

    #[cube(launch)]
    fn gelu_kernel<E: Float>(x: &[E], y: &mut [E], #[define(E)] _dtype: ElemType) {
        let i = ABSOLUTE_POS;
        if i >= y.len() {
            terminate!();
        }
        let v = f32::cast_from(x[i]);
        y[i] = E::cast_from(v * normal_cdf(v));
    }

    #[cube(launch)]
    fn gelu_backward_kernel<E: Float>(
        x: &[E],
        grad: &[E],
        dx: &mut [E],
        #[define(E)] _dtype: ElemType,
    ) {
        let i = ABSOLUTE_POS;
        if i >= dx.len() {
            terminate!();
        }
        let v = f32::cast_from(x[i]);
        // φ(x) = exp(−x²/2) / √(2π)
        let pdf = (f32::new(-0.5) * v * v).exp() * f32::new(0.398_942_3);
        dx[i] = E::cast_from(f32::cast_from(grad[i]) * (normal_cdf(v) + v * pdf));
    }

    /// A tensor shaped and typed like `like`, on its device.
    fn empty_like(like: &CubeTensor) -> CubeTensor {
        super::super::cube_empty(like, like.meta.shape().to_vec(), like.dtype)
    }

    fn launch_dims(t: &CubeTensor) -> (CubeCount, CubeDim) {
        let cube_dim = CubeDim::new_1d(CUBE_UNITS as u32);
        let n = t.meta.shape.num_elements();
        (
            calculate_cube_count_elemwise(&t.client, n, cube_dim),
            cube_dim,
        )
    }

    pub(super) fn forward(x: CubeTensor) -> CubeTensor {
        let x = into_contiguous(x);
        let y = empty_like(&x);
        let (count, dim) = launch_dims(&x);
        let dtype = x.dtype;
        gelu_kernel::launch(
            &x.client.clone(),
            count,
            dim,
            x.into_buffer_arg(),
            y.clone().into_buffer_arg(),
            dtype_to_storage_type(dtype),
        );
        y
    }

    pub(super) fn backward(x: CubeTensor, grad: CubeTensor) -> CubeTensor {
        let x = into_contiguous(x);
        let dtype = x.dtype;
        // The gradient in x's dtype (a cast at a layer's edge may bring
        // another).
        let grad = into_contiguous(if grad.dtype == dtype {
            grad
        } else {
            burn_cubecl::kernel::cast(grad, dtype)
        });
        let dx = empty_like(&x);
        let (count, dim) = launch_dims(&x);
        gelu_backward_kernel::launch(
            &x.client.clone(),
            count,
            dim,
            x.into_buffer_arg(),
            grad.into_buffer_arg(),
            dx.clone().into_buffer_arg(),
            dtype_to_storage_type(dtype),
        );
        dx
    }

    /// The kernels in bf16, for `kiln check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::offline::Offline,
    ) -> super::super::offline::Kernels {
        use super::super::offline::buffer;
        let elem = dtype_to_storage_type(burn::tensor::DType::BF16);
        let settings = o.settings(CUBE_UNITS as u32, 1);
        let (props, target) = (o.props.clone(), o.target.clone());
        vec![
            (
                "GELU (BF16)".to_string(),
                Box::new(gelu_kernel::GeluKernel::new(
                    settings.clone(),
                    props.clone(),
                    target.clone(),
                    buffer(),
                    buffer(),
                    elem,
                )),
            ),
            (
                "GELU's gradient (BF16)".to_string(),
                Box::new(gelu_backward_kernel::GeluBackwardKernel::new(
                    settings,
                    props,
                    target,
                    buffer(),
                    buffer(),
                    buffer(),
                    elem,
                )),
            ),
        ]
    }
}
