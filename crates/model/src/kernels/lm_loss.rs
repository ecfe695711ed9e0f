//! The language model's head and its loss, fused: the logits are never
//! made for all tokens at once.
//!
//! Burn's composition (`x · wteᵀ`, `log_softmax`, `gather`, and their
//! backward) keeps several `tokens × vocabulary` f32 tensors alive: the
//! logits, the log-probabilities, and in the backward pass the gradient of
//! each. For GPT-2 small on the `h100` preset (64 × 2048 tokens, 50,304
//! logits each) one of them is 26 GB. Here the tokens go through in chunks
//! of rows (`LM_HEAD_CHUNK_ELEMENTS` logits a chunk): per chunk the product (in the compute dtype,
//! on the backend's matmul: tensor cores on a GPU), each row's log-sum-exp,
//! the loss, and — when the loss will be differentiated — at once the
//! gradient of the logits (`softmax − one-hot`, over the tokens) and from
//! it the gradients of the rows and of the weight, so that nothing of the
//! chunk outlives it. The backward pass then only scales what the forward
//! pass kept (`tokens × hidden` and `vocabulary × hidden`) by the upstream
//! gradient. Same products as the composition, no recomputation: Liger's
//! and Apple's cut cross-entropy's way.
//!
//! One implementation for every backend: a default trait body of Burn's
//! primitive operations (flex, CubeCL, and under Burn's `fusion` the lazy
//! version of each), with a hand-written `Autodiff` route.
//! `check_lm_head_loss` compares it with the composition.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Scalar, Shape, Slice, TensorData, TensorMetadata,
    backend_extension,
};
use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor};

use super::autodiff::{KernelBackward, lift3};
use super::padding_bias;

/// What the fused head and loss need besides the tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LmLossShape {
    /// The true vocabulary: the logits from it on are padding, masked.
    pub(crate) vocab: usize,
    /// The dtype the products run in.
    pub(crate) compute: FloatDType,
    /// Rows (tokens) a chunk.
    pub(crate) chunk: usize,
    /// Label smoothing ε: the target is `1 − ε` on the token and `ε /
    /// vocab` on each of the true vocabulary's.
    pub(crate) smoothing: f64,
}

/// The fused LM head and loss as a Burn backend extension.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    Cube: cfg(feature = "cube"),
    Fusion: cfg(feature = "fusion"),
    Autodiff
)]
pub(crate) trait KilnLmLoss: Backend {
    /// The mean cross-entropy (`[1]`, f32) of the logits `x · weightᵀ`
    /// (`x`: `[tokens, hidden]`; `weight`: `[padded, hidden]`, logits from
    /// `shape.vocab` on masked) against `targets` (`[tokens]`).
    #[fusion(default)]
    fn kiln_lm_loss(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        chunked::<Self>(x, weight, targets, shape, false).0
    }

    /// [`KilnLmLoss::kiln_lm_loss`] with the gradients of `x` and `weight`
    /// for an upstream gradient of 1.
    #[fusion(default)]
    fn kiln_lm_loss_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, grads) = chunked::<Self>(x, weight, targets, shape, true);
        let (dx, dw) = grads.expect("the gradients were asked for");
        (loss, dx, dw)
    }

    /// The chunks' matrix products (`a · b`, 2-D): the backend's.
    #[fusion(default)]
    fn kiln_lm_product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// One chunk's loss, summed over its rows (`[1]`, f32): from their
    /// logits (`[rows, padded]`, f32, the columns from `shape.vocab` on
    /// padding, not masked yet) and targets (`[rows, 1]`).
    #[fusion(default)]
    fn kiln_lm_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        rows::<Self>(logits, targets, shape, false).0
    }

    /// Each row's cross-entropy (`[rows]`, f32), as
    /// [`KilnLmLoss::kiln_lm_rows`] sums them: what scoring a text token
    /// by token needs.
    #[fusion(default)]
    fn kiln_lm_row_losses(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        let rows = logits.shape()[0];
        Self::float_reshape(
            per_row::<Self>(logits, targets, shape, false).0,
            Shape::new([rows]),
        )
    }

    /// Each token's cross-entropy (`[tokens]`, f32) of the logits `x ·
    /// weightᵀ`, in chunks of `shape.chunk` rows as
    /// [`KilnLmLoss::kiln_lm_loss`] (no gradient).
    #[fusion(default)]
    fn kiln_lm_token_losses(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        per_token::<Self>(x, weight, targets, shape)
    }

    /// [`KilnLmLoss::kiln_lm_rows`], and the gradient of that sum with
    /// respect to the logits: `softmax − target` (the one-hot, or its
    /// smoothed version), f32, 0 on the padding.
    #[fusion(default)]
    fn kiln_lm_rows_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, grad) = rows::<Self>(logits, targets, shape, true);
        (loss, grad.expect("the gradient was asked for"))
    }
}

/// On flex, a chunk's rows in one pass each (`cpu::lm_rows`: kiln's
/// vectorised exponential instead of libm's, one scan for the maximum, one
/// for the exponentials and their sum, the gradient written over the
/// logits) rather than the composition's passes and buffers of the chunk's
/// size.
#[cfg(feature = "flex")]
impl KilnLmLoss for burn::backend::Flex {
    /// f32 products with their rows over the threads ([`super::cpu::product`]):
    /// flex's own runs a small vocabulary's on one thread.
    fn kiln_lm_product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        if a.dtype() == burn::tensor::DType::F32 && b.dtype() == burn::tensor::DType::F32 {
            super::cpu::product(a, b)
        } else {
            <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
        }
    }

    fn kiln_lm_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        let (losses, _) = super::cpu::lm_rows(logits, targets, shape.vocab, shape.smoothing, false);
        super::cpu::lm_total(&losses)
    }

    fn kiln_lm_row_losses(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        let (losses, _) = super::cpu::lm_rows(logits, targets, shape.vocab, shape.smoothing, false);
        super::cpu::lm_each(losses)
    }

    fn kiln_lm_rows_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (losses, grad) =
            super::cpu::lm_rows(logits, targets, shape.vocab, shape.smoothing, true);
        (
            super::cpu::lm_total(&losses),
            grad.expect("the gradient was asked for"),
        )
    }
}

#[cfg(feature = "cube")]
impl KilnLmLoss for burn_cubecl::CubeBackend {
    /// On a CUDA build, `cube::cublas::product`: cuBLAS's where
    /// `optimization.matmul = "cublas"`, Burn's otherwise.
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    fn kiln_lm_product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        super::cube::cublas::product(a, b)
    }
}

impl<B: Backend + KilnLmLoss, C: CheckpointStrategy> KilnLmLoss for Autodiff<B, C> {
    fn kiln_lm_loss(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> FloatTensor<Self> {
        // The forward pass made the gradients for an upstream 1: the
        // backward scales them by the upstream gradient (a `[1]` tensor).
        let step = KernelBackward::<B, [FloatTensor<B>; 2], 2>(|grads, upstream| {
            grads.map(|g| {
                let shape = g.shape();
                let upstream = B::float_reshape(upstream.clone(), Shape::new([1, 1]));
                B::float_mul(g, B::float_expand(upstream, shape))
            })
        });
        let nodes = [x.node(), weight.node()];
        let (x, weight) = (Self::inner(x), Self::inner(weight));
        match step.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (loss, dx, dw) = B::kiln_lm_loss_grads(x, weight, targets, shape);
                prep.finish([dx, dw], loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_lm_loss(x, weight, targets, shape)),
        }
    }

    fn kiln_lm_loss_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shape: LmLossShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, weight) = (Self::inner(x), Self::inner(weight));
        lift3::<B, C>(B::kiln_lm_loss_grads(x, weight, targets, shape))
    }
}

/// Two tensors of one backend: the gradients of `x` and of the weight.
type Pair<B> = (FloatTensor<B>, FloatTensor<B>);

/// The loss over chunks of `chunk` rows and, with `grads`, the gradients
/// of `x` and `weight` (f32, as they are), the products by the backend's
/// `kiln_lm_product`, each chunk's rows by its `kiln_lm_rows`.
fn chunked<B: KilnLmLoss>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    shape: LmLossShape,
    grads: bool,
) -> (FloatTensor<B>, Option<Pair<B>>) {
    let n = x.shape()[0];
    let compute = shape.compute;
    let reduced = compute != FloatDType::F32;
    let low = |t: FloatTensor<B>| {
        if reduced {
            B::float_cast(t, compute)
        } else {
            t
        }
    };
    let full = |t: FloatTensor<B>| {
        if reduced {
            B::float_cast(t, FloatDType::F32)
        } else {
            t
        }
    };
    let weight = low(weight);
    let weight_t = B::float_transpose(weight.clone());
    let mut loss: Option<FloatTensor<B>> = None;
    let mut dx = Vec::new();
    let mut dw: Option<FloatTensor<B>> = None;
    for (xc, tc) in row_chunks::<B>(&x, &targets, shape.chunk) {
        let xc = low(xc);
        let logits = full(B::kiln_lm_product(xc.clone(), weight_t.clone()));
        let part = if grads {
            // d(mean loss)/d logits = (softmax − one-hot) / tokens. The
            // products take `softmax − one-hot` (in [−1, 1]) and the 1/tokens
            // is applied to their f32 results after the loop: in fp16,
            // 1/tokens times a small probability would underflow before the
            // loss scaler's factor (which comes with the upstream gradient)
            // could help.
            let (part, g) = B::kiln_lm_rows_grad(logits, tc, shape);
            let g = low(g);
            dx.push(full(B::kiln_lm_product(g.clone(), weight.clone())));
            let dwc = full(B::kiln_lm_product(B::float_transpose(g), xc));
            dw = Some(match dw {
                None => dwc,
                Some(total) => B::float_add(total, dwc),
            });
            part
        } else {
            B::kiln_lm_rows(logits, tc, shape)
        };
        loss = Some(match loss {
            None => part,
            Some(total) => B::float_add(total, part),
        });
    }
    let loss = B::float_div_scalar(loss.expect("at least one token"), Scalar::from(n as f64));
    let loss = B::float_reshape(loss, Shape::new([1]));
    // The mean's 1/tokens, once on each whole gradient (f32).
    let per_token = |t: FloatTensor<B>| B::float_mul_scalar(t, Scalar::from(1.0 / n as f64));
    let grads = grads.then(|| {
        let dx = if dx.len() == 1 {
            dx.pop().expect("one chunk")
        } else {
            B::float_cat(dx, 0)
        };
        (per_token(dx), per_token(dw.expect("at least one token")))
    });
    (loss, grads)
}

/// `x`'s rows (`[tokens, hidden]`) and `targets` (`[tokens]`, as
/// `[rows, 1]`) in chunks of `chunk` rows, in order.
fn row_chunks<'a, B: Backend>(
    x: &'a FloatTensor<B>,
    targets: &'a IntTensor<B>,
    chunk: usize,
) -> impl Iterator<Item = (FloatTensor<B>, IntTensor<B>)> + 'a {
    let (n, d) = (x.shape()[0], x.shape()[1]);
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |start| {
        let rows = chunk.min(n - start);
        let range = Slice::from(start..start + rows);
        (
            B::float_slice(x.clone(), &[range, Slice::from(0..d)]),
            B::int_reshape(
                B::int_slice(targets.clone(), &[range]),
                Shape::new([rows, 1]),
            ),
        )
    })
}

/// A chunk's rows in Burn's operations (the default of
/// [`KilnLmLoss::kiln_lm_rows`]): the loss summed over the rows and, with
/// `grads`, its gradient with respect to the logits.
fn rows<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    shape: LmLossShape,
    grads: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let (per_row, grad) = per_row::<B>(logits, targets, shape, grads);
    (B::float_sum(per_row), grad)
}

/// [`rows`] before the sum: each row's loss (`[rows, 1]`).
fn per_row<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    LmLossShape {
        vocab, smoothing, ..
    }: LmLossShape,
    grads: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let [rows, padded] = [logits.shape()[0], logits.shape()[1]];
    let device = logits.device();
    let wide = |t: FloatTensor<B>| B::float_expand(t, Shape::new([rows, padded]));
    let mut logits = logits;
    if padded > vocab {
        let bias = TensorData::new(padding_bias(vocab, padded), [1, padded]);
        logits = B::float_add(logits, wide(B::float_from_data(bias, &device)));
    }
    // Label smoothing's uniform share, ε / vocab on the true vocabulary's
    // columns (none on the padding's).
    let uniform = (smoothing != 0.0).then(|| {
        let share = (smoothing / vocab as f64) as f32;
        let row: Vec<f32> = (0..padded)
            .map(|i| if i < vocab { share } else { 0.0 })
            .collect();
        B::float_from_data(TensorData::new(row, [1, padded]), &device)
    });
    let max = B::float_max_dim(logits.clone(), 1);
    let exp = B::float_exp(B::float_sub(logits.clone(), wide(max.clone())));
    let sum = B::float_sum_dim(exp.clone(), 1);
    let lse = B::float_add(max, B::float_log(sum.clone()));
    // −log p of the token, and with smoothing (1 − ε) of it plus the
    // uniform target's ε/vocab · Σ −log p = lse·ε − Σ ε/vocab · z.
    let per_row = match &uniform {
        None => B::float_sub(lse, B::float_gather(1, logits, targets.clone())),
        Some(u) => {
            let picked = B::float_gather(1, logits.clone(), targets.clone());
            let spread = B::float_sum_dim(B::float_mul(logits, wide(u.clone())), 1);
            let kept = B::float_mul_scalar(picked, Scalar::from(1.0 - smoothing));
            B::float_sub(B::float_sub(lse, kept), spread)
        }
    };
    let grad = grads.then(|| {
        let mut softmax = B::float_div(exp, wide(sum));
        if let Some(u) = &uniform {
            softmax = B::float_sub(softmax, wide(u.clone()));
        }
        let minus_one = B::float_full(
            Shape::new([rows, 1]),
            Scalar::from(smoothing - 1.0),
            &device,
            FloatDType::F32,
        );
        B::float_scatter(1, softmax, targets, minus_one, IndexingUpdateOp::Add)
    });
    (per_row, grad)
}

/// Each token's loss in chunks of rows (the default of
/// [`KilnLmLoss::kiln_lm_token_losses`]): the product and each chunk's
/// [`KilnLmLoss::kiln_lm_row_losses`].
fn per_token<B: KilnLmLoss>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    shape: LmLossShape,
) -> FloatTensor<B> {
    let reduced = shape.compute != FloatDType::F32;
    let low = |t: FloatTensor<B>| {
        if reduced {
            B::float_cast(t, shape.compute)
        } else {
            t
        }
    };
    let weight_t = B::float_transpose(low(weight));
    let mut parts: Vec<_> = row_chunks::<B>(&x, &targets, shape.chunk)
        .map(|(xc, tc)| {
            let mut logits = B::kiln_lm_product(low(xc), weight_t.clone());
            if reduced {
                logits = B::float_cast(logits, FloatDType::F32);
            }
            B::kiln_lm_row_losses(logits, tc, shape)
        })
        .collect();
    if parts.len() == 1 {
        parts.pop().expect("one chunk")
    } else {
        B::float_cat(parts, 0)
    }
}

/// The fused head on tensors: the mean loss (`[1]`, see
/// [`super::lm_head_loss`]), or with `each_token` each token's (`[tokens]`,
/// no gradient: see [`super::lm_head_token_losses`]).
pub(crate) fn lm_loss(
    x: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    shape: LmLossShape,
    each_token: bool,
) -> Tensor<1> {
    let (x, weight, targets) = (
        x.into_dispatch(),
        weight.into_dispatch(),
        targets.into_dispatch(),
    );
    Tensor::from_dispatch(if each_token {
        <Dispatch as KilnLmLoss>::kiln_lm_token_losses(x, weight, targets, shape)
    } else {
        <Dispatch as KilnLmLoss>::kiln_lm_loss(x, weight, targets, shape)
    })
}
