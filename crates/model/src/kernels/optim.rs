//! AdamW's update as one kernel: one per parameter on flex, one per group
//! of parameters on the GPU backends.
//!
//! Composed of Burn operations, AdamW is a dozen element-wise passes per
//! parameter (scale the gradient, both moments, bias corrections, the square
//! root, the division, decay, the subtraction), each reading and writing
//! whole tensors: on a GPU one kernel launch per operation per parameter (a
//! third of the tiny GPT's step on the H200), on flex one single-threaded
//! pass each. The fused update reads the weight, the gradient and both
//! moments once and writes the new weight and moments once: a rayon loop on
//! flex, a CubeCL kernel on the GPU backends (wgpu, CUDA; not under Burn's
//! `fusion`, which fuses the composition itself) that updates up to 32
//! parameters a launch, in place where it can ([`adamw_many`]). Both
//! compute the composition's operations in its order, in f32.

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
/// kernels are tested against. [`adamw_many`] updates many parameters in
/// fewer kernel launches.
pub fn adamw(
    weight: Tensor<1>,
    grad: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    step: AdamWStep,
    kernels: Kernels,
) -> [Tensor<1>; 3] {
    let param = AdamWParam {
        weight,
        grad,
        m,
        v,
        step,
    };
    adamw_many(vec![param], kernels)
        .pop()
        .expect("one parameter in, one out")
}

/// One parameter's part of [`adamw_many`]: the flattened weight, its
/// gradient, its moments (zeros before the first step) and the update's
/// hyper-parameters.
#[derive(Clone, Debug)]
pub struct AdamWParam {
    /// The flattened weight.
    pub weight: Tensor<1>,
    /// Its gradient, flattened.
    pub grad: Tensor<1>,
    /// The first moment.
    pub m: Tensor<1>,
    /// The second moment.
    pub v: Tensor<1>,
    /// The update's hyper-parameters (its weight decay may differ from the
    /// other parameters').
    pub step: AdamWStep,
}

/// AdamW's update of each of `params`: the new `[weight, m, v]` of each, in
/// their order, each as [`adamw`] computes it.
///
/// On a CubeCL GPU (wgpu, CUDA; without Burn's `fusion`) with `Fused`, one
/// kernel launch updates a group of parameters: consecutive f32 parameters
/// whose steps differ at most in weight decay, as many as the device binds
/// buffers for (up to 32 a launch), writing the new moments over the old
/// ones and the new weight over the gradient wherever those buffers have
/// no other owner (a returned tensor may then share the gradient's
/// buffer). A step of a small model is mostly
/// launches (about 20 µs each on an H100), and one launch per parameter was
/// half of what was left of the optimizer's. Each group's inputs are
/// dropped once its kernel is queued, so the moments and gradients of the
/// parameters already updated are freed as the new ones are made, as one
/// parameter at a time does. Elsewhere, one [`adamw`] per parameter.
pub fn adamw_many(params: Vec<AdamWParam>, kernels: Kernels) -> Vec<[Tensor<1>; 3]> {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused
        && let Some(first) = params.first()
        && cube::runs(&first.weight)
    {
        return cube::adamw_many(params);
    }
    params.into_iter().map(|p| adamw_one(p, kernels)).collect()
}

/// One parameter's update: flex's loop, or the composition.
fn adamw_one(p: AdamWParam, kernels: Kernels) -> [Tensor<1>; 3] {
    let AdamWParam {
        weight,
        grad,
        m,
        v,
        step,
    } = p;
    let f = step.factors();
    #[cfg(feature = "flex")]
    if kernels == Kernels::Fused
        && [&weight, &grad, &m, &v]
            .iter()
            .all(|t| t.dtype() == DType::F32)
        && flex::runs(&weight)
    {
        return flex::adamw(weight, grad, m, v, f);
    }
    let _ = (kernels, DType::F32);
    composed(weight, grad, m, v, &f)
}

/// The composition of Burn operations: the reference, and what runs where
/// no kernel does.
fn composed(
    weight: Tensor<1>,
    grad: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    f: &Factors,
) -> [Tensor<1>; 3] {
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

#[cfg(feature = "flex")]
mod flex {
    //! The extension trait, its flex implementation, and the routing from
    //! `Tensor` to it.

    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Dispatch, DispatchDevice, backend_extension};
    use burn::tensor::Tensor;

    use super::Factors;

    /// The fused optimizer update as a Burn backend extension. The
    /// optimizer works on tensors without autodiff, so there is no
    /// `Autodiff` route.
    #[backend_extension(Flex)]
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

    /// Whether `t` is on flex (the dtype is checked by the caller).
    pub(super) fn runs(t: &Tensor<1>) -> bool {
        matches!(t.device().inner().as_dispatch(), DispatchDevice::Flex(_))
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

#[cfg(all(feature = "cuda", not(feature = "fusion")))]
pub(super) use cube::offline_kernels;

#[cfg(all(feature = "cube", not(feature = "fusion")))]
mod cube {
    //! The CubeCL kernel (one unit per element of a group of parameters)
    //! and the grouping of parameters into launches.
    //!
    //! The update is written in place where it can be: the new moments
    //! over the old ones, the new weight over the gradient (both consumed
    //! by the step), wherever the buffer has no other owner; elsewhere into
    //! a new buffer. An in-place output binds no buffer of its own, so
    //! more parameters fit in one launch on a device that binds few (wgpu
    //! on Metal or llvmpipe: about 31), and the step allocates nothing.

    use burn::tensor::{DType, Tensor};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeDim, calculate_cube_count_elemwise};

    use super::{AdamWParam, AdamWStep};

    /// Units per cube.
    const CUBE_UNITS: usize = 256;

    /// The most parameters one launch updates: the kernel's code holds one
    /// branch per parameter, and each group size is compiled once. Fewer
    /// where the device binds fewer buffers (wgpu on Metal: 31).
    const MAX_GROUP: usize = 32;

    /// Buffers a launch binds per parameter for its inputs: weight,
    /// gradient and both moments (each result written elsewhere than in
    /// place binds one more).
    const INPUT_BINDINGS: u32 = 4;

    /// Bindings kept free for the launch's metadata and scalars.
    const RESERVED_BINDINGS: u32 = 4;

    /// The most elements one launch covers: a unit's position in the group
    /// is a 32-bit index (CubeCL's default address type), so a group of
    /// large parameters (a 7B model's embeddings are 131 M elements each)
    /// splits before its positions could overflow. One parameter over it
    /// still goes alone, as the single-parameter kernel always did.
    const MAX_ELEMENTS: usize = i32::MAX as usize;

    /// Whether `t` lives on a CubeCL GPU.
    pub(super) fn runs(t: &Tensor<1>) -> bool {
        super::super::cube_gpu_float(t)
    }

    /// Whether `a` and `b` can share a launch: the same factors but for
    /// the weight decay.
    fn same_but_decay(a: &AdamWStep, b: &AdamWStep) -> bool {
        AdamWStep {
            weight_decay: 0.0,
            ..*a
        } == AdamWStep {
            weight_decay: 0.0,
            ..*b
        }
    }

    fn is_f32(p: &AdamWParam) -> bool {
        [&p.weight, &p.grad, &p.m, &p.v]
            .iter()
            .all(|t| t.dtype() == DType::F32)
    }

    /// The update of `params` in as few launches as [`Launch::fits`]
    /// allows; a parameter that is not all f32 takes the composition.
    pub(super) fn adamw_many(params: Vec<AdamWParam>) -> Vec<[Tensor<1>; 3]> {
        let mut out = Vec::with_capacity(params.len());
        let mut launch = Launch::default();
        for p in params {
            if !is_f32(&p) {
                out.extend(launch.run());
                out.push(super::adamw_one(p, super::Kernels::Reference));
                continue;
            }
            let p = CubeParam::new(p);
            if !launch.fits(&p) {
                out.extend(launch.run());
            }
            launch.push(p);
        }
        out.extend(launch.run());
        out
    }

    /// One parameter's tensors on the CubeCL device, contiguous, and its
    /// step.
    struct CubeParam {
        weight: CubeTensor,
        grad: CubeTensor,
        m: CubeTensor,
        v: CubeTensor,
        step: AdamWStep,
    }

    impl CubeParam {
        fn new(p: AdamWParam) -> Self {
            let cube = |t: Tensor<1>| into_contiguous(super::super::into_cube(t));
            Self {
                weight: cube(p.weight),
                grad: cube(p.grad),
                m: cube(p.m),
                v: cube(p.v),
                step: p.step,
            }
        }

        /// The buffers a launch binds for this parameter: its inputs, and
        /// each result that cannot be written in place.
        fn bindings(&self) -> u32 {
            INPUT_BINDINGS
                + [&self.grad, &self.m, &self.v]
                    .iter()
                    .map(|t| u32::from(!t.can_mut()))
                    .sum::<u32>()
        }

        fn elements(&self) -> usize {
            self.weight.meta.shape.num_elements()
        }
    }

    /// The parameters gathered for one launch, with the buffers they bind
    /// and the elements they cover.
    #[derive(Default)]
    struct Launch {
        params: Vec<CubeParam>,
        bindings: u32,
        elements: usize,
    }

    impl Launch {
        /// Whether `p` can join: a step that differs at most in weight
        /// decay, and room left in the group, the device's bindings and
        /// the index range. Anything joins an empty launch.
        fn fits(&self, p: &CubeParam) -> bool {
            let Some(first) = self.params.first() else {
                return true;
            };
            let max_bindings = first.weight.client.properties().hardware.max_bindings;
            same_but_decay(&first.step, &p.step)
                && self.params.len() < MAX_GROUP
                && RESERVED_BINDINGS + self.bindings + p.bindings() <= max_bindings
                && self.elements + p.elements() <= MAX_ELEMENTS
        }

        fn push(&mut self, p: CubeParam) {
            self.bindings += p.bindings();
            self.elements += p.elements();
            self.params.push(p);
        }

        /// The launch of what was gathered (nothing if nothing was), which
        /// leaves this one empty; its inputs are dropped once it is queued.
        fn run(&mut self) -> Vec<[Tensor<1>; 3]> {
            let Launch { params, .. } = std::mem::take(self);
            if params.is_empty() {
                Vec::new()
            } else {
                launch_group(params)
            }
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn adamw_kernel(
        weights: &Sequence<OwnedTensor<f32>>,
        grads: &Sequence<OwnedTensor<f32>>,
        ms: &Sequence<OwnedTensor<f32>>,
        vs: &Sequence<OwnedTensor<f32>>,
        weights_out: &mut Sequence<OwnedTensor<f32>>,
        ms_out: &mut Sequence<OwnedTensor<f32>>,
        vs_out: &mut Sequence<OwnedTensor<f32>>,
        starts: Sequence<usize>,
        decays: Sequence<f32>,
        lr: f32,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        bias1: f32,
        bias2: f32,
        grad_scale: f32,
    ) {
        let i = ABSOLUTE_POS;
        let count = comptime![weights.len()];
        #[unroll]
        for k in 0..count {
            let start = starts[k];
            let end = starts[k + 1];
            if i >= start && i < end {
                let j = i - start;
                let g = grads[k][j] * grad_scale;
                let m_new = ms[k][j] * beta1 + g * one_minus_beta1;
                let v_new = vs[k][j] * beta2 + (g * g) * one_minus_beta2;
                let denom = (v_new / bias2).sqrt() + eps;
                let w_new = weights[k][j] * decays[k] - m_new / bias1 / denom * lr;
                let w_out = weights_out.index_mut(k);
                w_out[j] = w_new;
                let m_out = ms_out.index_mut(k);
                m_out[j] = m_new;
                let v_out = vs_out.index_mut(k);
                v_out[j] = v_new;
            }
        }
    }

    /// One launch updating `params`, whose steps differ at most in decay.
    fn launch_group(params: Vec<CubeParam>) -> Vec<[Tensor<1>; 3]> {
        let f = params[0].step.factors();
        let n = params.len();
        let client = params[0].weight.client.clone();
        let mut decays = SequenceArg::<f32>::new();
        let mut starts = SequenceArg::<usize>::new();
        let mut total = 0;
        starts.push(0);
        // The inputs bind in this order (weights, gradients, first moments,
        // second moments), so input `k` of the `i`-th list is binding
        // `i·n + k`: what an in-place output names.
        let mut inputs: [Vec<TensorArg>; 4] = Default::default();
        let mut outputs: [Vec<TensorArg>; 3] = Default::default();
        let mut results: [Vec<CubeTensor>; 3] = Default::default();
        for (k, p) in params.into_iter().enumerate() {
            decays.push(p.step.factors().decay);
            total += p.weight.meta.shape.num_elements();
            starts.push(total);
            // Result `i` (weight, m, v) goes over input `i + 1` (gradient,
            // m, v) where that buffer has no other owner.
            for (i, over) in [&p.grad, &p.m, &p.v].into_iter().enumerate() {
                if over.can_mut() {
                    outputs[i].push(over.as_tensor_alias((i + 1) * n + k));
                    results[i].push(over.clone());
                } else {
                    let fresh =
                        super::super::cube_empty(over, over.meta.shape().to_vec(), DType::F32);
                    outputs[i].push(fresh.clone().into_tensor_arg());
                    results[i].push(fresh);
                }
            }
            for (i, t) in [p.weight, p.grad, p.m, p.v].into_iter().enumerate() {
                inputs[i].push(t.into_tensor_arg());
            }
        }
        let [weights, grads, ms, vs] = inputs.map(|args| args.into_iter().collect());
        let [weights_out, ms_out, vs_out] = outputs.map(|args| args.into_iter().collect());
        let cube_dim = CubeDim::new_1d(CUBE_UNITS as u32);
        let cube_count = calculate_cube_count_elemwise(&client, total, cube_dim);
        adamw_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            weights,
            grads,
            ms,
            vs,
            weights_out,
            ms_out,
            vs_out,
            starts,
            decays,
            f.lr,
            f.beta1,
            f.one_minus_beta1,
            f.beta2,
            f.one_minus_beta2,
            f.eps,
            f.bias1,
            f.bias2,
            f.grad_scale,
        );
        let from = super::super::from_cube;
        let [w, m, v] = results;
        w.into_iter()
            .zip(m)
            .zip(v)
            .map(|((w, m), v)| [from(w), from(m), from(v)])
            .collect()
    }

    /// The kernel as a training step on CUDA launches it for GPT-2 small:
    /// a full group ([`MAX_GROUP`] parameters, CUDA binds 1,024 buffers)
    /// with every result written in place over its gradient and moments
    /// (a step's usual case: no other owner), and a group whose results
    /// have buffers of their own (a gradient or moment with another
    /// owner), for `kiln check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::cube::offline::Offline,
    ) -> super::super::cube::offline::Kernels {
        use super::super::cube::offline::tensor;
        let n = MAX_GROUP;
        // `n` tensors, the `k`-th written over input binding `first + k`
        // where there is a `first`.
        let tensors = |first: Option<usize>| -> SequenceCompilationArg<OwnedTensor<f32>> {
            (0..n).map(|k| tensor(first.map(|f| f + k))).collect()
        };
        let kernel = |in_place: bool| {
            // Output `i` (weight, m, v) over input `i + 1` (gradient, m, v),
            // input `k` of the `j`-th list being binding `j·n + k`.
            let out = |i: usize| tensors(in_place.then_some((i + 1) * n));
            Box::new(adamw_kernel::AdamwKernel::new(
                o.settings(CUBE_UNITS as u32, 1),
                o.props.clone(),
                o.target.clone(),
                tensors(None),
                tensors(None),
                tensors(None),
                tensors(None),
                out(0),
                out(1),
                out(2),
                (0..=n).map(|_| ()).collect(),
                (0..n).map(|_| ()).collect(),
                (),
                (),
                (),
                (),
                (),
                (),
                (),
                (),
                (),
            )) as Box<dyn CubeKernel>
        };
        vec![
            (format!("AdamW ({n} parameters, in place)"), kernel(true)),
            (
                format!("AdamW ({n} parameters, new buffers)"),
                kernel(false),
            ),
        ]
    }
}

/// Whether [`adamw`] runs its fused kernel for f32 tensors on `t`'s device.
pub(super) fn fused_here(t: &Tensor<1>) -> bool {
    #[cfg(feature = "flex")]
    if flex::runs(t) {
        return true;
    }
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if cube::runs(t) {
        return true;
    }
    let _ = t;
    false
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
        let check = crate::kernels::check_adamw(&Device::flex());
        assert!(check.fused, "{check:?}");
        assert_eq!(check.max_abs_difference, 0.0, "{check:?}");
        assert!(check.passed(), "{check:?}");
    }
}
