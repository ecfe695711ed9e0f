//! AdamW's update of one parameter as one kernel.
//!
//! Composed of Burn operations, AdamW is a dozen element-wise passes per
//! parameter (scale the gradient, both moments, bias corrections, the square
//! root, the division, decay, the subtraction), each reading and writing
//! whole tensors: on a GPU one kernel launch per operation per parameter (a
//! third of the tiny GPT's step on the H200), on flex one single-threaded
//! pass each. The fused update reads the weight, the gradient and both
//! moments once and writes the new weight and moments once: a rayon loop on
//! flex, a CubeCL kernel on the GPU backends (wgpu, CUDA; not under Burn's
//! `fusion`, which fuses the composition itself). Both compute the
//! composition's operations in its order, in f32.

use burn::tensor::{DType, Tensor};

use super::Kernels;

/// One AdamW update of one parameter, as PyTorch's `AdamW` computes it
/// (decoupled weight decay, bias-corrected moments, ε outside the square
/// root). The hyper-parameters are f64 as configured; each derived factor
/// (`1 − β₁`, `1 − β₁ᵗ`, `1 − lr·wd`, …) is computed in f64 and then used
/// in f32, as Burn's scalar operations do.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay β₁.
    pub beta1: f64,
    /// Second-moment decay β₂.
    pub beta2: f64,
    /// ε added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay (0 for parameters that are not decayed).
    pub weight_decay: f64,
    /// The step number `t` (1 for the first update), for bias correction.
    pub step: u64,
    /// Multiplies the gradient first: the clip factor, and whatever else
    /// scales it (loss scaling, the average over accumulated micro-batches).
    pub grad_scale: f64,
}

/// The f32 factors one update uses, derived from an [`AdamWStep`] in f64.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Factors {
    pub(crate) lr: f32,
    pub(crate) beta1: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) eps: f32,
    /// `1 − lr·wd`: multiplies the weight before the update.
    pub(crate) decay: f32,
    /// `1 − β₁ᵗ` and `1 − β₂ᵗ`.
    pub(crate) bias1: f32,
    pub(crate) bias2: f32,
    pub(crate) grad_scale: f32,
}

impl AdamWStep {
    pub(crate) fn factors(&self) -> Factors {
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        Factors {
            lr: self.lr as f32,
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            bias1: (1.0 - self.beta1.powi(t)) as f32,
            bias2: (1.0 - self.beta2.powi(t)) as f32,
            grad_scale: self.grad_scale as f32,
        }
    }
}

/// AdamW's update of the flattened parameter `weight` with gradient `grad`
/// and moments `m`, `v` (zeros before the first step): the new weight and
/// moments, `[weight, m, v]`.
///
/// `Fused` runs one kernel where the device has it (flex; wgpu and CUDA
/// without Burn's `fusion`) and the tensors are f32; otherwise, and with
/// `Reference`, the composition of Burn operations, which is also what the
/// kernels are tested against.
pub fn adamw(
    weight: Tensor<1>,
    grad: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    step: AdamWStep,
    kernels: Kernels,
) -> [Tensor<1>; 3] {
    let f = step.factors();
    #[cfg(any(feature = "flex", feature = "cube"))]
    if kernels == Kernels::Fused
        && [&weight, &grad, &m, &v]
            .iter()
            .all(|t| t.dtype() == DType::F32)
        && fused::runs(&weight)
    {
        return fused::adamw(weight, grad, m, v, f);
    }
    let _ = (kernels, DType::F32);
    let grad = if f.grad_scale != 1.0 {
        grad.mul_scalar(f.grad_scale)
    } else {
        grad
    };
    let m = m
        .mul_scalar(f.beta1)
        .add(grad.clone().mul_scalar(f.one_minus_beta1));
    let v = v
        .mul_scalar(f.beta2)
        .add(grad.clone().mul(grad).mul_scalar(f.one_minus_beta2));
    let denom = v.clone().div_scalar(f.bias2).sqrt().add_scalar(f.eps);
    let update = m.clone().div_scalar(f.bias1).div(denom).mul_scalar(f.lr);
    let weight = if f.decay != 1.0 {
        weight.mul_scalar(f.decay)
    } else {
        weight
    };
    [weight.sub(update), m, v]
}

/// One element's update, in the composition's order of operations (the
/// flex loop; the CubeCL kernel spells out the same lines).
#[cfg(feature = "flex")]
#[inline(always)]
pub(crate) fn update(f: &Factors, w: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let g = g * f.grad_scale;
    let m = m * f.beta1 + g * f.one_minus_beta1;
    let v = v * f.beta2 + (g * g) * f.one_minus_beta2;
    let denom = (v / f.bias2).sqrt() + f.eps;
    let w = w * f.decay - m / f.bias1 / denom * f.lr;
    (w, m, v)
}

#[cfg(any(feature = "flex", feature = "cube"))]
mod fused {
    //! The extension trait, its flex and CubeCL implementations, and the
    //! routing from `Tensor` to them.

    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Dispatch, DispatchDevice, backend_extension};
    use burn::tensor::Tensor;

    use super::Factors;

    /// The fused optimizer update as a Burn backend extension. The
    /// optimizer works on tensors without autodiff, so there is no
    /// `Autodiff` route.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        Cube: cfg(all(feature = "cube", not(feature = "fusion")))
    )]
    pub(crate) trait KilnOptim: Backend {
        /// AdamW's new weight, first and second moment.
        fn kiln_adamw(
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            m: FloatTensor<Self>,
            v: FloatTensor<Self>,
            factors: Factors,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    }

    #[cfg(feature = "flex")]
    impl KilnOptim for burn::backend::Flex {
        fn kiln_adamw(
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            m: FloatTensor<Self>,
            v: FloatTensor<Self>,
            factors: Factors,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            super::super::cpu::adamw(weight, grad, m, v, factors)
        }
    }

    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    impl KilnOptim for burn::backend::Cube {
        fn kiln_adamw(
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            m: FloatTensor<Self>,
            v: FloatTensor<Self>,
            factors: Factors,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            super::cube::adamw(weight, grad, m, v, factors)
        }
    }

    /// Whether `t`'s device has the fused update (the dtype is checked by
    /// the caller).
    pub(super) fn runs(t: &Tensor<1>) -> bool {
        match t.device().inner().as_dispatch() {
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => true,
            #[cfg(all(feature = "cube", not(feature = "fusion")))]
            DispatchDevice::Cube(d) => super::super::cube_gpu(d),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    pub(super) fn adamw(
        weight: Tensor<1>,
        grad: Tensor<1>,
        m: Tensor<1>,
        v: Tensor<1>,
        factors: Factors,
    ) -> [Tensor<1>; 3] {
        let (w, m, v) = <Dispatch as KilnOptim>::kiln_adamw(
            weight.into_dispatch(),
            grad.into_dispatch(),
            m.into_dispatch(),
            v.into_dispatch(),
            factors,
        );
        [w, m, v].map(Tensor::from_dispatch)
    }
}

#[cfg(all(feature = "cube", not(feature = "fusion")))]
mod cube {
    //! The CubeCL kernel: one unit per element.

    use burn::backend::tensor::FloatTensor;
    use burn_cubecl::CubeBackend;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

    use super::Factors;

    /// Units per cube.
    const CUBE_UNITS: usize = 256;

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn adamw_kernel(
        weight: &[f32],
        grad: &[f32],
        m: &[f32],
        v: &[f32],
        weight_out: &mut [f32],
        m_out: &mut [f32],
        v_out: &mut [f32],
        lr: f32,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        decay: f32,
        bias1: f32,
        bias2: f32,
        grad_scale: f32,
    ) {
        let i = ABSOLUTE_POS;
        if i >= weight.len() {
            terminate!();
        }
        let g = grad[i] * grad_scale;
        let m_new = m[i] * beta1 + g * one_minus_beta1;
        let v_new = v[i] * beta2 + (g * g) * one_minus_beta2;
        let denom = (v_new / bias2).sqrt() + eps;
        weight_out[i] = weight[i] * decay - m_new / bias1 / denom * lr;
        m_out[i] = m_new;
        v_out[i] = v_new;
    }

    type Out = (
        FloatTensor<CubeBackend>,
        FloatTensor<CubeBackend>,
        FloatTensor<CubeBackend>,
    );

    pub(super) fn adamw(
        weight: CubeTensor,
        grad: CubeTensor,
        m: CubeTensor,
        v: CubeTensor,
        f: Factors,
    ) -> Out {
        let [weight, grad, m, v] = [weight, grad, m, v].map(into_contiguous);
        let shape = weight.meta.shape.clone();
        let n = shape.num_elements();
        let client = weight.client.clone();
        let empty = || {
            empty_device_dtype(
                client.clone(),
                weight.device.clone(),
                shape.clone(),
                weight.dtype,
            )
        };
        let (weight_out, m_out, v_out) = (empty(), empty(), empty());
        let cube_dim = CubeDim::new_1d(CUBE_UNITS as u32);
        let cube_count: CubeCount = calculate_cube_count_elemwise(&client, n, cube_dim);
        adamw_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            weight.into_buffer_arg(),
            grad.into_buffer_arg(),
            m.into_buffer_arg(),
            v.into_buffer_arg(),
            weight_out.clone().into_buffer_arg(),
            m_out.clone().into_buffer_arg(),
            v_out.clone().into_buffer_arg(),
            f.lr,
            f.beta1,
            f.one_minus_beta1,
            f.beta2,
            f.one_minus_beta2,
            f.eps,
            f.decay,
            f.bias1,
            f.bias2,
            f.grad_scale,
        );
        (weight_out, m_out, v_out)
    }
}

/// One fused kernel compared with the composition it replaces, on one
/// device: what `kiln check-kernels` prints.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct KernelCheck {
    /// The kernel, and what was compared: "adamw (100 steps)".
    pub kernel: String,
    /// Whether the fused kernel ran on this device (when not, both sides
    /// were the composition and the comparison says nothing).
    pub fused: bool,
    /// The largest absolute difference between the two results.
    pub max_abs_difference: f64,
    /// What counts as agreement.
    pub tolerance: f64,
}

impl KernelCheck {
    /// Whether the two agreed (trivially so where the kernel did not run:
    /// see [`KernelCheck::fused`]).
    pub fn passed(&self) -> bool {
        self.max_abs_difference <= self.tolerance
    }
}

/// The tolerance of [`check_adamw`]: after 100 updates, weights and moments
/// of the fused kernel and the composition agree to within 1e-5 (they start
/// near ±1; a GPU compiler may contract multiply-adds, flex runs the same
/// operations in the same order).
pub const ADAMW_TOLERANCE: f64 = 1e-5;

/// [`adamw`] fused and composed, 100 updates of a 10,007-element parameter
/// (ragged against any block size) with random gradients, decay, a
/// gradient factor and a warmup of the learning rate, on `device`: the
/// largest difference of the weights and moments at the end.
pub fn check_adamw(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::Distribution;
    const N: usize = 10_007;
    const STEPS: u64 = 100;
    device.seed(11);
    let w0 = Tensor::<1>::random([N], Distribution::Normal(0.0, 1.0), device);
    let fused_runs = fused_here(&w0);
    let zeros = Tensor::<1>::zeros([N], device);
    let start = [w0, zeros.clone(), zeros];
    let (mut fused, mut reference) = (start.clone(), start);
    for t in 1..=STEPS {
        let grad = Tensor::<1>::random([N], Distribution::Normal(0.0, 2.0), device);
        let step = AdamWStep {
            lr: 3e-3 * (t as f64 / 10.0).min(1.0),
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: t,
            grad_scale: 0.5,
        };
        let [w, m, v] = fused;
        fused = adamw(w, grad.clone(), m, v, step, Kernels::Fused);
        let [w, m, v] = reference;
        reference = adamw(w, grad, m, v, step, Kernels::Reference);
    }
    let max_abs_difference = fused
        .into_iter()
        .zip(reference)
        .map(|(a, b)| f64::from((a - b).abs().max().into_scalar::<f32>()))
        .fold(0.0, f64::max);
    KernelCheck {
        kernel: format!("adamw ({STEPS} steps)"),
        fused: fused_runs,
        max_abs_difference,
        tolerance: ADAMW_TOLERANCE,
    }
}

/// Whether [`adamw`] runs its fused kernel for f32 tensors on `t`'s device.
fn fused_here(t: &Tensor<1>) -> bool {
    #[cfg(any(feature = "flex", feature = "cube"))]
    return fused::runs(t);
    #[cfg(not(any(feature = "flex", feature = "cube")))]
    {
        let _ = t;
        false
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// The fused update against numbers worked by hand (not against the
    /// composition): one element, w = 1, g = 2 scaled by 0.5 to 1, first
    /// step: m = 0.1, v = 0.05; m̂ = 1, v̂ = 1; w' = 1·(1 − 0.1·0.01) −
    /// 0.1·1/(1 + 1e-8) = 0.899.
    #[test]
    fn fused_adamw_matches_a_hand_worked_step() {
        let device = Device::flex();
        let t = |x: f32| Tensor::<1>::from_data(TensorData::new(vec![x], [1]), &device);
        let step = AdamWStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 1,
            grad_scale: 0.5,
        };
        let [w, m, v] = adamw(t(1.0), t(2.0), t(0.0), t(0.0), step, Kernels::Fused);
        let x = |t: Tensor<1>| t.into_scalar::<f32>();
        assert!((x(m) - 0.1).abs() < 1e-7);
        assert!((x(v) - 0.05).abs() < 1e-7);
        assert!((x(w) - 0.899).abs() < 1e-6);
    }

    #[test]
    fn fused_adamw_agrees_with_the_composition_on_flex() {
        // Same operations in the same order, no contraction into
        // multiply-adds: bit for bit.
        let check = check_adamw(&Device::flex());
        assert!(check.fused, "{check:?}");
        assert_eq!(check.max_abs_difference, 0.0, "{check:?}");
        assert!(check.passed(), "{check:?}");
    }
}
