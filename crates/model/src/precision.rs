//! Mixed precision as an explicit policy (Burn has no autocast): parameters
//! stay f32 (the master weights, and so the optimizer state); matrix
//! multiplies and attention's two products run in the compute dtype through
//! casts at the layer's edges, and their results come back as f32, so
//! softmax, LayerNorm, GELU, the residual stream, the loss and every
//! reduction stay f32. Two exceptions keep a layer's inside in the compute
//! dtype where kiln's GPU kernels read it, as PyTorch's autocast does:
//! attention between its projections (`attention`) and an MLP's hidden
//! layer (`mlp_hidden`: the GELU kernel computes in f32 and rounds
//! once). `Tensor::cast` is differentiable: gradients flow back through
//! the casts and arrive at the f32 parameters as f32.

use burn::nn::Linear;
use burn::tensor::{Bool, FloatDType, Tensor, activation};

use crate::kernels::{self, AttentionKernel, Kernels};

/// The dtype matrix multiplies and attention compute in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDtype {
    /// Everything in f32 (the models' plain Burn path, fused attention included).
    #[default]
    F32,
    /// bfloat16 products, f32 everywhere else.
    Bf16,
    /// IEEE half products, f32 everywhere else; needs loss scaling to train.
    F16,
}

impl ComputeDtype {
    /// `f32`, `bf16` or `fp16`, as the configuration spells them.
    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "fp16",
        }
    }

    /// Burn's dtype for it.
    pub fn float_dtype(self) -> FloatDType {
        match self {
            ComputeDtype::F32 => FloatDType::F32,
            ComputeDtype::Bf16 => FloatDType::BF16,
            ComputeDtype::F16 => FloatDType::F16,
        }
    }

    /// Whether products run below f32.
    pub fn is_reduced(self) -> bool {
        self != ComputeDtype::F32
    }
}

/// `x · W + b` with the product in `dtype`; the result is f32. The bias is
/// added in f32, after the product's cast back: no cast of the bias
/// forward nor of its gradient backward (two kernel launches a layer and
/// micro-batch fewer on a GPU), and the sum is not rounded to `dtype`.
pub(crate) fn linear<const D: usize>(
    layer: &Linear,
    x: Tensor<D>,
    dtype: ComputeDtype,
    kernels: Kernels,
) -> Tensor<D> {
    if !dtype.is_reduced() {
        return kernels::linear(layer, x, kernels);
    }
    let low = dtype.float_dtype();
    let weight = layer.weight.val().cast(low);
    let product = kernels::rows_product(x.cast(low), weight, kernels).cast(FloatDType::F32);
    match &layer.bias {
        Some(bias) => kernels::add_bias(product, bias.val(), kernels),
        None => product,
    }
}

/// `x · W + b` all in `dtype` (the bias cast to it and added there, as
/// PyTorch's autocast adds it), for a consumer that takes `dtype` itself.
fn linear_in<const D: usize>(
    layer: &Linear,
    x: Tensor<D>,
    dtype: ComputeDtype,
    kernels: Kernels,
) -> Tensor<D> {
    let low = dtype.float_dtype();
    let weight = layer.weight.val().cast(low);
    let product = kernels::rows_product(x.cast(low), weight, kernels);
    match &layer.bias {
        Some(bias) => kernels::add_bias(product, bias.val().cast(low), kernels),
        None => product,
    }
}

/// An MLP's hidden layer, `gelu(x · W + b)` (`tanh`: GELU's tanh
/// approximation), for the output projection that follows. Where kiln's
/// GELU kernel runs in a reduced `dtype` (a CubeCL GPU, the exact GELU)
/// the layer stays in `dtype`, as PyTorch's autocast keeps it: the
/// product, its bias and the GELU in `dtype` (the GELU computed in f32 and
/// rounded once), so that what the backward pass keeps is half as large
/// (GPT-2 small: 100 MB a layer and micro-batch less) and two casts
/// forward and two backward a layer go. Elsewhere f32, as [`linear`]
/// gives it.
pub(crate) fn mlp_hidden<const D: usize>(
    fc: &Linear,
    x: Tensor<D>,
    tanh: bool,
    dtype: ComputeDtype,
    kernels: Kernels,
) -> Tensor<D> {
    if dtype.is_reduced() && !tanh && kernels::gelu_runs_in_any_float(&x, kernels) {
        return kernels::gelu(linear_in(fc, x, dtype, kernels), kernels);
    }
    let hidden = linear(fc, x, dtype, kernels);
    if tanh {
        activation::gelu_approximate(hidden)
    } else {
        kernels::gelu(hidden, kernels)
    }
}

/// Multi-head self-attention of `x` (`[b, t, d]`) between its projections:
/// `proj(attention(qkv(x)))`, products in `dtype`, the result f32 (see
/// [`kernels::self_attention`] for `key_pad` and `causal`). In f32 the
/// attention is [`kernels::self_attention`], in a reduced dtype
/// [`reduced_attention`] — except where kiln's memory-efficient kernels run
/// (wgpu, CUDA): they read and write the reduced dtype, so the packed
/// projection goes into them as its product made it and their result into
/// the output projection as they wrote it (casting it to f32 and back in
/// between lost nothing and cost a pass over the activations each way,
/// forward and backward). `dropout` drops out the probabilities where the
/// device is an autodiff one (the caller gives 0 where its model does not
/// train): [`kernels::self_attention_with_dropout`] in f32 and where the
/// kernels take the reduced dtype (they drop them out themselves),
/// [`reduced_attention`] with it elsewhere.
#[allow(
    clippy::too_many_arguments,
    reason = "the two layers and the attention's own arguments"
)]
pub(crate) fn attention(
    qkv: &Linear,
    proj: &Linear,
    x: Tensor<3>,
    heads: usize,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    dtype: ComputeDtype,
    kernels: Kernels,
    attention: AttentionKernel,
    dropout: f64,
) -> Tensor<3> {
    let attention = kernels.attention(attention);
    // Dropout on the probabilities applies on an autodiff device (the
    // caller gives 0 where its model does not train).
    let dropout = if x.device().is_autodiff() {
        dropout
    } else {
        0.0
    };
    let kernels_take_dtype = dtype.is_reduced()
        && kernels::memory_efficient_attention_runs(
            &x,
            dtype.float_dtype().into(),
            x.dims()[2] / heads.max(1),
            attention,
        );
    let y = if dtype.is_reduced() && !kernels_take_dtype {
        let packed = linear(qkv, x, dtype, kernels);
        let dropped = kernels::dropout_with(dropout, kernels);
        reduced_attention(packed, heads, key_pad, causal, dtype, dropped)
    } else {
        let packed = if kernels_take_dtype {
            linear_in(qkv, x, dtype, kernels)
        } else {
            linear(qkv, x, dtype, kernels)
        };
        kernels::self_attention_with_dropout(
            packed, heads, key_pad, causal, attention, dropout, kernels,
        )
    };
    // In `dtype` where the kernels took it: `linear`'s cast of its input is
    // then no operation.
    linear(proj, y, dtype, kernels)
}

/// `p`, a layer's dropout on attention's probabilities, where `module` (its
/// dropout) trains, else 0: what [`attention`] takes.
pub(crate) fn while_training(module: &burn::nn::Dropout, p: f64) -> f64 {
    if module.training.is_enabled() { p } else { 0.0 }
}

/// `a · b` with the product in `dtype`; the result is f32.
pub(crate) fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>, dtype: ComputeDtype) -> Tensor<D> {
    if !dtype.is_reduced() {
        return a.matmul(b);
    }
    let low = dtype.float_dtype();
    a.cast(low).matmul(b.cast(low)).cast(FloatDType::F32)
}

/// Multi-head self-attention of a packed `[b, t, 3·d]` projection (see
/// [`kernels::self_attention`]), heads merged in the `[b, t, d]` result, for
/// [`attention`] in a reduced dtype where the memory-efficient kernels do
/// not take it: [`attend`]
/// on its heads, `dropped` applied to the probabilities.
fn reduced_attention(
    qkv: Tensor<3>,
    heads: usize,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    dtype: ComputeDtype,
    dropped: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<3> {
    let [q, k, v] = kernels::split_heads(qkv, heads);
    attend(q, k, v, key_pad, causal, dtype, dropped)
}

/// Attention of queries `q` (`[b, h, t, d]`) over keys `k` and values `v`
/// (`[b, h, s, d]`, `s ≥ t`), heads merged in the `[b, t, h·d]` result:
/// the two products run in `dtype`, the scores are masked and soft-maxed
/// in f32. `key_pad` (`[b, s]`) is true where a key is padding. With
/// `causal`, the queries are the last `t` of the `s` positions (the
/// earlier ones a KV cache's), each seeing the keys up to its own.
/// `dropped` is applied to the probabilities (`[b, h, t, s]`) before they
/// weigh the values: dropout on them where a model trains, else the
/// identity.
pub(crate) fn attend(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    dtype: ComputeDtype,
    dropped: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<3> {
    let [b, h, t, d] = q.dims();
    let s = k.dims()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let scores = matmul(q, k.swap_dims(2, 3), dtype).mul_scalar(scale);
    let scores = match key_pad {
        Some(pad) => scores.mask_fill(
            pad.reshape([b, 1, 1, s]).expand([b, h, t, s]),
            f32::NEG_INFINITY,
        ),
        None => scores,
    };
    let scores = if causal {
        // Query i is position `s - t + i`: the keys after it are masked.
        let future = Tensor::<2, Bool>::tril_mask([t, s], (s - t) as i64, &scores.device())
            .reshape([1, 1, t, s])
            .expand([b, h, t, s]);
        scores.mask_fill(future, f32::NEG_INFINITY)
    } else {
        scores
    };
    matmul(dropped(activation::softmax(scores, 3)), v, dtype)
        .swap_dims(1, 2)
        .reshape([b, t, h * d])
}

// (The tests run on flex, the CPU backend of the default features.)
#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{DType, Device, Distribution};

    use super::*;

    /// A packed `[2, 6, 3·24]` projection: 3 heads of 8.
    fn qkv(device: &Device) -> Tensor<3> {
        Tensor::<3>::random([2, 6, 72], Distribution::Normal(0.0, 1.0), device)
    }

    fn max_diff(a: Tensor<3>, b: Tensor<3>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// `got` is f32 and within `tolerance` of `reference`; `what` names the case.
    fn assert_near(reference: &Tensor<3>, got: Tensor<3>, tolerance: f32, what: &str) {
        assert_eq!(got.dtype(), DType::F32, "{what} returns f32");
        let diff = max_diff(reference.clone(), got);
        assert!(diff <= tolerance, "{what}: {diff}");
    }

    #[test]
    fn reduced_attention_matches_the_f32_attention() {
        let device = Device::flex();
        device.seed(5);
        let qkv = qkv(&device);
        for causal in [false, true] {
            let reference =
                kernels::self_attention(qkv.clone(), 3, None, causal, AttentionKernel::Math);
            for dtype in [ComputeDtype::Bf16, ComputeDtype::F16] {
                let low = reduced_attention(qkv.clone(), 3, None, causal, dtype, |p| p);
                // bf16 keeps 8 bits of mantissa (2^-8 = 0.004), fp16 11.
                assert_near(&reference, low, 0.05, &format!("{dtype:?} causal={causal}"));
            }
        }
    }

    /// The reduced linear layer is the f32 one within the dtype's rounding
    /// of the product, and its bias is added in f32: with a bias of 1000 a
    /// sum rounded to bf16 would be off by up to 2 (bf16 keeps 8 bits).
    #[test]
    fn reduced_linear_matches_the_f32_layer_and_adds_the_bias_in_f32() {
        let device = Device::flex();
        device.seed(7);
        let mut layer = burn::nn::LinearConfig::new(24, 40).init(&device);
        layer.bias = Some(burn::module::Param::from_tensor(Tensor::<1>::full(
            [40],
            1000.0,
            &device,
        )));
        let x = Tensor::<3>::random([2, 5, 24], Distribution::Normal(0.0, 1.0), &device);
        let reference = linear(&layer, x.clone(), ComputeDtype::F32, Kernels::Reference);
        for dtype in [ComputeDtype::Bf16, ComputeDtype::F16] {
            let low = linear(&layer, x.clone(), dtype, Kernels::Fused);
            assert_near(&reference, low, 0.05, &format!("{dtype:?}"));
        }
    }

    /// The attention between its projections is the three steps it
    /// replaces in f32, and within the dtype's rounding of them in bf16 and
    /// fp16. (On flex the kernels read f32: the path that hands the reduced
    /// dtype through runs on wgpu and CUDA, where the GPU suite trains it.)
    #[test]
    fn attention_between_its_projections_is_the_three_steps() {
        let device = Device::flex();
        device.seed(8);
        let qkv_layer = burn::nn::LinearConfig::new(24, 72).init(&device);
        let proj = burn::nn::LinearConfig::new(24, 24).init(&device);
        let x = Tensor::<3>::random([2, 6, 24], Distribution::Normal(0.0, 1.0), &device);
        let steps = {
            let f32 = ComputeDtype::F32;
            let packed = linear(&qkv_layer, x.clone(), f32, Kernels::Fused);
            let y = kernels::self_attention(packed, 3, None, true, AttentionKernel::Auto);
            linear(&proj, y, f32, Kernels::Fused)
        };
        for dtype in [ComputeDtype::F32, ComputeDtype::Bf16, ComputeDtype::F16] {
            let got = attention(
                &qkv_layer,
                &proj,
                x.clone(),
                3,
                None,
                true,
                dtype,
                Kernels::Fused,
                AttentionKernel::Auto,
                0.0,
            );
            let tolerance = if dtype.is_reduced() { 0.05 } else { 0.0 };
            assert_near(&steps, got, tolerance, &format!("{dtype:?}"));
        }
    }

    #[test]
    fn reduced_attention_masks_padding_like_the_f32_one() {
        let device = Device::flex();
        device.seed(6);
        let qkv = qkv(&device);
        // The last two keys are padding.
        let keep = Tensor::<1, burn::tensor::Int>::arange(0..6, &device).greater_equal_elem(4);
        let pad = keep.reshape([1, 6]).expand([2, 6]);
        let reference = kernels::self_attention(
            qkv.clone(),
            3,
            Some(pad.clone()),
            false,
            AttentionKernel::Math,
        );
        let low = reduced_attention(qkv, 3, Some(pad), false, ComputeDtype::Bf16, |p| p);
        assert_near(&reference, low, 0.05, "bf16 padded");
    }
}
