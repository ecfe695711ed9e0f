//! What the `Autodiff` routes of kiln's backend extensions share: the
//! backward step of a kernel with a hand-written gradient, and attention's
//! route (the same for the flex kernel and the CubeCL one: each backend
//! passes its own forward and backward).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};

use super::AttentionSpec;

/// The backward step of a kernel with `N` tracked inputs: the function
/// turns the saved state `S` and the output's gradient into one gradient
/// per input, registered for the inputs that require one.
pub(super) struct KernelBackward<B: Backend, S, const N: usize>(
    pub(super) fn(S, FloatTensor<B>) -> [FloatTensor<B>; N],
);

impl<B: Backend, S, const N: usize> std::fmt::Debug for KernelBackward<B, S, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelBackward")
    }
}

impl<B, S, const N: usize> Backward<B, N> for KernelBackward<B, S, N>
where
    B: Backend,
    S: Clone + Send + std::fmt::Debug + 'static,
{
    type State = S;

    fn backward(self, ops: Ops<S, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        for (parent, value) in ops.parents.into_iter().zip((self.0)(ops.state, grad)) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, value);
            }
        }
    }
}

/// An attention kernel's forward: the packed qkv and the key-padding mask
/// (1 where a key is padding) in, the merged heads' output and each
/// query's log-sum-exp out.
pub(super) type AttentionForward<B> =
    fn(FloatTensor<B>, FloatTensor<B>, AttentionSpec) -> (FloatTensor<B>, FloatTensor<B>);

/// An attention kernel's backward: what the forward took and gave, and the
/// output's gradient, in; the gradient of the packed qkv out.
pub(super) type AttentionBackward<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    AttentionSpec,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
) -> FloatTensor<B>;

/// What attention's backward pass needs: the input, the mask, the output,
/// the log-sum-exp, and the backend's backward kernel.
#[derive(Clone, Debug)]
struct Saved<B: Backend> {
    qkv: FloatTensor<B>,
    key_pad: FloatTensor<B>,
    spec: AttentionSpec,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    backward: AttentionBackward<B>,
}

/// A float tensor of the autodiff backend over `B`.
type Tracked<B, C> = FloatTensor<Autodiff<B, C>>;

/// Attention under autodiff: runs `forward` on the inner backend and, when
/// qkv is tracked, records `backward` with what it needs. Only qkv is
/// differentiated (the mask is data).
pub(super) fn attention<B: Backend, C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<B, C>>,
    key_pad: FloatTensor<Autodiff<B, C>>,
    spec: AttentionSpec,
    forward: AttentionForward<B>,
    backward: AttentionBackward<B>,
) -> (Tracked<B, C>, Tracked<B, C>) {
    let step = KernelBackward::<B, Saved<B>, 1>(|s, grad| {
        [(s.backward)(s.qkv, s.key_pad, s.spec, s.out, s.lse, grad)]
    });
    let node = qkv.node();
    let (qkv, key_pad) = (
        Autodiff::<B, C>::inner(qkv),
        Autodiff::<B, C>::inner(key_pad),
    );
    let (out, lse) = forward(qkv.clone(), key_pad.clone(), spec);
    let lse_out = Autodiff::<B, C>::from_inner(lse.clone());
    let out = match step.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let saved = Saved {
                qkv,
                key_pad,
                spec,
                out: out.clone(),
                lse,
                backward,
            };
            prep.finish(saved, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (out, lse_out)
}

/// Attention's backward called on autodiff tensors: computed on the inner
/// backend without tracking (nothing kiln trains needs second derivatives).
pub(super) fn attention_backward<B: Backend, C: CheckpointStrategy>(
    tensors: [Tracked<B, C>; 5],
    spec: AttentionSpec,
    backward: AttentionBackward<B>,
) -> Tracked<B, C> {
    let [qkv, key_pad, out, lse, grad] = tensors.map(Autodiff::<B, C>::inner);
    Autodiff::<B, C>::from_inner(backward(qkv, key_pad, spec, out, lse, grad))
}

/// Three tensors of one backend.
pub(super) type Three<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// Three inner-backend tensors as untracked autodiff tensors.
pub(super) fn lift3<B: Backend, C: CheckpointStrategy>(
    (a, b, c): Three<B>,
) -> Three<Autodiff<B, C>> {
    let lift = Autodiff::<B, C>::from_inner;
    (lift(a), lift(b), lift(c))
}

/// A LayerNorm kernel's forward: x, gamma, beta and epsilon in; the output
/// and each row's mean and 1/σ out.
pub(super) type LayerNormForward<B> =
    fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, f64) -> Three<B>;

/// A LayerNorm kernel's backward: x, gamma, the rows' mean and 1/σ, and the
/// output's gradient in; the gradients of x, gamma and beta out.
pub(super) type LayerNormBackward<B> =
    fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> Three<B>;

/// What LayerNorm's backward pass needs: x, gamma, the rows' statistics,
/// and the backend's backward kernel.
#[derive(Clone, Debug)]
struct LayerNormSaved<B: Backend> {
    tensors: [FloatTensor<B>; 4],
    backward: LayerNormBackward<B>,
}

/// LayerNorm under autodiff (the flex kernel and the CubeCL one): runs
/// `forward` on the inner backend and, when any input is tracked, records
/// `backward` with x, gamma and the statistics.
pub(super) fn layer_norm<B: Backend, C: CheckpointStrategy>(
    [x, gamma, beta]: [Tracked<B, C>; 3],
    epsilon: f64,
    forward: LayerNormForward<B>,
    backward: LayerNormBackward<B>,
) -> Three<Autodiff<B, C>> {
    let step = KernelBackward::<B, LayerNormSaved<B>, 3>(|s, grad| {
        let [x, gamma, mean, rstd] = s.tensors;
        let (dx, dgamma, dbeta) = (s.backward)(x, gamma, mean, rstd, grad);
        [dx, dgamma, dbeta]
    });
    let nodes = [x.node(), gamma.node(), beta.node()];
    let [x, gamma, beta] = [x, gamma, beta].map(Autodiff::<B, C>::inner);
    let (y, mean, rstd) = forward(x.clone(), gamma.clone(), beta, epsilon);
    let (mean_out, rstd_out) = (
        Autodiff::<B, C>::from_inner(mean.clone()),
        Autodiff::<B, C>::from_inner(rstd.clone()),
    );
    let y = match step.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(
            LayerNormSaved {
                tensors: [x, gamma, mean, rstd],
                backward,
            },
            y,
        ),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    (y, mean_out, rstd_out)
}

/// LayerNorm's backward called on autodiff tensors: computed on the inner
/// backend without tracking.
pub(super) fn layer_norm_backward<B: Backend, C: CheckpointStrategy>(
    tensors: [Tracked<B, C>; 5],
    backward: LayerNormBackward<B>,
) -> Three<Autodiff<B, C>> {
    let [x, gamma, mean, rstd, grad] = tensors.map(Autodiff::<B, C>::inner);
    lift3::<B, C>(backward(x, gamma, mean, rstd, grad))
}

/// An element-wise kernel's forward (x in, y out) and backward (x and the
/// output's gradient in, x's gradient out).
pub(super) type UnaryForward<B> = fn(FloatTensor<B>) -> FloatTensor<B>;
pub(super) type UnaryBackward<B> = fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;

/// What an element-wise kernel's backward pass needs: its input and the
/// backend's backward kernel.
#[derive(Clone, Debug)]
struct UnarySaved<B: Backend> {
    x: FloatTensor<B>,
    backward: UnaryBackward<B>,
}

/// An element-wise kernel under autodiff (GELU on flex and on CubeCL):
/// runs `forward` on the inner backend and, when x is tracked, records
/// `backward` with x.
pub(super) fn unary<B: Backend, C: CheckpointStrategy>(
    x: Tracked<B, C>,
    forward: UnaryForward<B>,
    backward: UnaryBackward<B>,
) -> Tracked<B, C> {
    let step =
        KernelBackward::<B, UnarySaved<B>, 1>(|s: UnarySaved<B>, grad| [(s.backward)(s.x, grad)]);
    let node = x.node();
    let x = Autodiff::<B, C>::inner(x);
    match step.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(
            UnarySaved {
                x: x.clone(),
                backward,
            },
            forward(x),
        ),
        OpsKind::UnTracked(prep) => prep.finish(forward(x)),
    }
}

/// An element-wise kernel's backward called on autodiff tensors: computed
/// on the inner backend without tracking (nothing kiln trains needs second
/// derivatives).
pub(super) fn unary_backward<B: Backend, C: CheckpointStrategy>(
    x: Tracked<B, C>,
    grad: Tracked<B, C>,
    backward: UnaryBackward<B>,
) -> Tracked<B, C> {
    let [x, grad] = [x, grad].map(Autodiff::<B, C>::inner);
    Autodiff::<B, C>::from_inner(backward(x, grad))
}
