//! The reference checks: each of kiln's kernels against the Burn
//! composition it replaces, forward and backward, on one device, at
//! ragged shapes — what `kiln check-kernels` prints, CI runs on flex and on
//! llvmpipe (wgpu), and the GPU check runs on CUDA. Each check returns a
//! [`KernelCheck`]: the largest difference, the tolerance, and whether
//! kiln's kernel ran there at all (where it does not, both sides are the
//! composition).

use burn::nn::LayerNorm;
use burn::tensor::{Bool, FloatDType, Int, Tensor, activation};

#[cfg(feature = "flex")]
use super::flex;
use super::norm::{SLOTS, sum_of_squares, sum_of_squares_value};
use super::optim::{AdamWParam, AdamWStep, adamw_many};
use super::{
    AttentionKernel, Kernels, LAYER_NORM_EPSILON, add_bias, gelu, layer_norm,
    lm_head_loss_fused_here, lm_head_losses, memory_efficient_attention_runs, self_attention,
    token_embeddings,
};

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

/// [`adamw_many`] fused and composed, 100 updates of 40 parameters (one of
/// 10,007 elements, the others 1 to 4,096, ragged against any block size;
/// every other one decayed) with random gradients, a gradient factor and a
/// warmup of the learning rate, on `device`: the largest difference of the
/// weights and moments at the end. 40 parameters take two launches or more
/// of the grouped GPU kernel (at most 32 a launch), which writes in place
/// where it can (half the gradients here) and elsewhere where not.
pub fn check_adamw(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::Distribution;
    const PARAMS: usize = 40;
    const STEPS: u64 = 100;
    device.seed(11);
    let sizes: Vec<usize> = (0..PARAMS)
        .map(|k| {
            if k == 0 {
                10_007
            } else {
                1 + (k * 997) % 4_096
            }
        })
        .collect();
    let start: Vec<[Tensor<1>; 3]> = sizes
        .iter()
        .map(|&n| {
            let w = Tensor::<1>::random([n], Distribution::Normal(0.0, 1.0), device);
            let zeros = Tensor::<1>::zeros([n], device);
            [w, zeros.clone(), zeros]
        })
        .collect();
    let fused_runs = super::optim::fused_here(&start[0][0]);
    let (mut fused, mut reference) = (start.clone(), start);
    for t in 1..=STEPS {
        let grads: Vec<Tensor<1>> = sizes
            .iter()
            .map(|&n| Tensor::<1>::random([n], Distribution::Normal(0.0, 2.0), device))
            .collect();
        let update = |state: Vec<[Tensor<1>; 3]>, kernels| {
            let params = state
                .into_iter()
                .zip(&grads)
                .enumerate()
                .map(|(k, ([weight, m, v], grad))| AdamWParam {
                    weight,
                    // Every other gradient is a buffer of its own, which the
                    // GPU kernel writes the new weight over; the others are
                    // shared (with the other side), and it writes elsewhere.
                    grad: if k % 2 == 1 {
                        grad.clone().mul_scalar(1.0)
                    } else {
                        grad.clone()
                    },
                    m,
                    v,
                    step: AdamWStep {
                        lr: 3e-3 * (t as f64 / 10.0).min(1.0),
                        beta1: 0.9,
                        beta2: 0.95,
                        eps: 1e-8,
                        weight_decay: if k % 2 == 0 { 0.1 } else { 0.0 },
                        step: t,
                        grad_scale: 0.5,
                    },
                })
                .collect();
            adamw_many(params, kernels)
        };
        fused = update(fused, Kernels::Fused);
        reference = update(reference, Kernels::Reference);
    }
    let max_abs_difference = fused
        .into_iter()
        .flatten()
        .zip(reference.into_iter().flatten())
        .map(|(a, b)| f64::from((a - b).abs().max().into_scalar::<f32>()))
        .fold(0.0, f64::max);
    KernelCheck {
        kernel: format!("adamw ({PARAMS} tensors, {STEPS} steps)"),
        fused: fused_runs,
        max_abs_difference,
        tolerance: ADAMW_TOLERANCE,
    }
}

/// The tolerance of [`check_sum_of_squares`], on the square root of the
/// sums (a norm of about 1): f32 sums of 400,000 squares in two orders.
pub const SUM_OF_SQUARES_TOLERANCE: f64 = 1e-5;

/// [`sum_of_squares`] by the kernel and by the composition, on `device`,
/// of 40 tensors (two launches of the grouped kernel) ragged against
/// [`SLOTS`] (one element; 10,007; 16,385; 3 × 16,384 + 5; 300,001; and
/// 35 of up to 5,000) whose norm is about 1: the largest difference of
/// the kernel's norm (square root of the sum), summed on the device and
/// on the host ([`sum_of_squares_value`]), from the composition's.
pub fn check_sum_of_squares(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::Distribution;
    const TENSORS: usize = 40;
    let big = [1, 10_007, SLOTS + 1, 3 * SLOTS + 5, 300_001];
    let sizes: Vec<usize> = big
        .into_iter()
        .chain((big.len()..TENSORS).map(|k| 1 + (k * 1_009) % 5_000))
        .collect();
    let total: usize = sizes.iter().sum();
    device.seed(13);
    let std = 1.0 / (total as f64).sqrt();
    let tensors: Vec<Tensor<1>> = sizes
        .iter()
        .map(|&n| Tensor::random([n], Distribution::Normal(0.0, std), device))
        .collect();
    let fused = super::norm::fused_here(&tensors[0]);
    let norm = |kernels| {
        let sum = sum_of_squares(tensors.iter().cloned(), kernels).expect("tensors");
        f64::from(sum.into_scalar::<f32>()).sqrt()
    };
    let reference = norm(Kernels::Reference);
    let on_host = sum_of_squares_value(tensors.iter().cloned(), Kernels::Fused)
        .expect("tensors")
        .sqrt();
    KernelCheck {
        kernel: format!("sum of squares ({TENSORS} tensors)"),
        fused,
        max_abs_difference: (norm(Kernels::Fused) - reference)
            .abs()
            .max((on_host - reference).abs()),
        tolerance: SUM_OF_SQUARES_TOLERANCE,
    }
}

/// The tolerance of [`check_attention`]: forward outputs and qkv gradients
/// of the kernels and Burn's attention agree to within 1e-4 (unit-variance
/// inputs; the sums run in another order).
pub const ATTENTION_TOLERANCE: f64 = 1e-4;

/// The tolerance of an f32 check whose products may run on TF32 tensor
/// cores ([`f32_products_round`]): TF32 rounds the products' inputs to 10
/// significant bits, as f16 does, so f16's tolerance. (The 2026-12-04 H200
/// check: 1.1e-3 to 2.3e-3 for attention against 1e-4, 2.7e-4 for the LM
/// head, every other f32 case within its tolerance; kiln's kernels there
/// wrote rows CUDA had padded, the bug these checks found, at 144 and
/// 8.9e12.)
pub const TF32_TOLERANCE: f64 = ATTENTION_F16_TOLERANCE;

/// Whether Burn's f32 matrix products on `device` may run on TF32 tensor
/// cores: CUDA from Ampere, where CubeCL's matmul autotune may pick such a
/// kernel for f32 whatever `precision.tf32` says. Then the f32 checks that
/// multiply through Burn (attention's composition, the LM head both ways)
/// hold to [`TF32_TOLERANCE`] and say so in their names.
pub fn f32_products_round(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cube")]
    {
        use cubecl::ir::{ElemType, FloatKind};
        crate::device_memory::cube_gpu_device(device).is_some_and(|d| {
            d.client()
                .properties()
                .features
                .matmul
                .cmma
                .iter()
                .any(|c| c.a_type == ElemType::Float(FloatKind::TF32))
        })
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// An f32 check's name and tolerance on `device`: `tolerance`, or where
/// its products may run as TF32 ([`f32_products_round`]) the looser
/// [`TF32_TOLERANCE`] and the name saying so.
fn f32_check(device: &burn::tensor::Device, name: String, tolerance: f64) -> (String, f64) {
    if f32_products_round(device) {
        (
            format!("{name}, products as TF32"),
            tolerance.max(TF32_TOLERANCE),
        )
    } else {
        (name, tolerance)
    }
}

/// The tolerance of [`check_attention`]'s f16 cases on the matrix unit
/// (`flash_attention`): the probabilities and their gradient enter the
/// products rounded to f16, and the output and gradients are f16 (11
/// significant bits) of values up to about 4.
pub const ATTENTION_F16_TOLERANCE: f64 = 1e-2;

/// The same for bf16 (8 significant bits: eight times f16's rounding).
pub const ATTENTION_BF16_TOLERANCE: f64 = 8e-2;

/// How much larger the queries are in [`check_attention`]'s sharp case.
const SHARP_QUERIES: f32 = 12.0;

/// The sharp case's tolerances, relative to each result's largest value,
/// as a share of the absolute ones (which allow for values up to about 4).
const ATTENTION_RELATIVE_PER_ABSOLUTE: f64 = 0.25;

/// [`self_attention`] fused (`memory-efficient`: kiln's kernels, which
/// `auto` runs everywhere but in f32 on CUDA) and composed (Burn's
/// attention) on `device`, forward and backward: a causal case (the GPT's) and a padded one (the
/// encoder's; one batch entry 40 of 75 positions long), 2 heads of 16, 75
/// positions (ragged against any block size). Each check's difference is
/// the largest of the output's and the qkv gradient's. A third check gives
/// some queries no key to see (causal, left padding), where a kiln kernel
/// runs: their output must be zeros and nothing may be NaN.
pub fn check_attention(device: &burn::tensor::Device) -> Vec<KernelCheck> {
    use burn::tensor::{Distribution, Int};
    let device = device.clone().autodiff();
    device.seed(12);
    let (b, t, h, hd) = (2, 75, 2, 16);
    let inputs = |heads: usize, head_dim: usize| {
        let normal =
            |width| Tensor::<3>::random([b, t, width], Distribution::Normal(0.0, 1.0), &device);
        (normal(3 * heads * head_dim), normal(heads * head_dim))
    };
    let (qkv, upstream) = inputs(h, hd);
    // Heads wider than the CubeCL kernels unroll their loops for (128, and
    // 64 for dK/dV): the loop path.
    let (wide_h, wide_hd) = (1, 136);
    let (wide_qkv, wide_upstream) = inputs(wide_h, wide_hd);
    let lengths = Tensor::<1, Int>::from_data([t as i64, 40], &device).reshape([b, 1]);
    let pad = Tensor::<1, Int>::arange(0..t as i64, &device)
        .reshape([1, t])
        .expand([b, t])
        .greater_equal(lengths.expand([b, t]));
    let fused = attention_fused_here(&qkv);
    let max_abs = |a: Tensor<3>, b: Tensor<3>| f64::from((a - b).abs().max().into_scalar::<f32>());
    let wide = format!("causal, heads {wide_hd} wide");
    let cases = [
        ("causal", &qkv, &upstream, h, None, true),
        ("padded", &qkv, &upstream, h, Some(pad.clone()), false),
        (wide.as_str(), &wide_qkv, &wide_upstream, wide_h, None, true),
    ];
    let mut checks: Vec<KernelCheck> = cases
        .into_iter()
        .map(|(name, qkv, upstream, heads, key_pad, causal)| {
            let run =
                |attention| attention_run(qkv, upstream, key_pad.clone(), causal, heads, attention);
            let ((y, dqkv), (y_ref, dqkv_ref)) = (
                run(AttentionKernel::MemoryEfficient),
                run(AttentionKernel::Math),
            );
            let (kernel, tolerance) = f32_check(
                &device,
                format!("attention, {name} (t={t})"),
                ATTENTION_TOLERANCE,
            );
            KernelCheck {
                kernel,
                fused,
                max_abs_difference: max_abs(y, y_ref).max(max_abs(dqkv, dqkv_ref)),
                tolerance,
            }
        })
        .collect();
    // Dropout 0.1 on the probabilities in kiln's kernel (flex's; on a GPU
    // the scalar CubeCL kernels in f32): against the composition with the
    // same mask on the probabilities (causal, then padded).
    if fused {
        for (name, key_pad, causal) in
            [("causal", None, true), ("padded", Some(pad.clone()), false)]
        {
            let ((y, dqkv), (y_ref, dqkv_ref)) = attention_dropout_kernel_and_reference(
                &qkv,
                &upstream,
                key_pad.clone(),
                causal,
                h,
                CHECK_DROPOUT,
            );
            let (kernel, tolerance) = f32_check(
                &device,
                format!("attention, {name}, dropout 0.1 (t={t})"),
                ATTENTION_TOLERANCE,
            );
            checks.push(KernelCheck {
                kernel,
                fused,
                max_abs_difference: max_abs(y, y_ref).max(max_abs(dqkv, dqkv_ref)),
                tolerance,
            });
        }
    }
    // Attention on the matrix unit (f16 or bf16 inputs, where the device
    // has an instruction for them; forward and backward): against the
    // composition in f32 on the same rounded inputs, its results rounded to
    // the dtype as the kernels' are. Heads 16 wide, and GPT-2's 64. Then
    // the same cases on the scalar kernels in the same dtype
    // (`AttentionKernel::MemoryEfficient`, what a run with
    // `optimization.attention = "memory-efficient"` gets there).
    let (gpt2_qkv, gpt2_upstream) = inputs(1, 64);
    // Sharp scores (the queries `SHARP_QUERIES` times larger: scores of
    // standard deviation about 12), so that a row's maximum keeps growing
    // along the keys past the forward kernel's margin and its sums are
    // rescaled (the softmax nearly one-hot: relative differences).
    let sharp: Vec<f32> = (0..3 * h * hd)
        .map(|i| if i < h * hd { SHARP_QUERIES } else { 1.0 })
        .collect();
    let sharp = Tensor::<1>::from_data(burn::tensor::TensorData::new(sharp, [3 * h * hd]), &device)
        .reshape([1, 1, 3 * h * hd]);
    let sharp_qkv = qkv.clone() * sharp;
    let drop = Some(CHECK_DROPOUT);
    let half_cases = [
        // (The last fields: differences relative to the largest value, and
        // dropout on the probabilities.)
        ("causal", &qkv, &upstream, h, hd, None, true, false, None),
        (
            "padded",
            &qkv,
            &upstream,
            h,
            hd,
            Some(pad.clone()),
            false,
            false,
            None,
        ),
        (
            "causal, heads 64 wide",
            &gpt2_qkv,
            &gpt2_upstream,
            1,
            64,
            None,
            true,
            false,
            None,
        ),
        (
            "causal, sharp scores",
            &sharp_qkv,
            &upstream,
            h,
            hd,
            None,
            true,
            true,
            None,
        ),
        (
            "causal, dropout 0.1",
            &qkv,
            &upstream,
            h,
            hd,
            None,
            true,
            false,
            drop,
        ),
        (
            "padded, dropout 0.1",
            &qkv,
            &upstream,
            h,
            hd,
            Some(pad.clone()),
            false,
            false,
            drop,
        ),
    ];
    for (dtype, name, tolerance) in [
        (FloatDType::F16, "f16", ATTENTION_F16_TOLERANCE),
        (FloatDType::BF16, "bf16", ATTENTION_BF16_TOLERANCE),
    ] {
        for (case, qkv, upstream, heads, head_dim, key_pad, causal, relative, drop) in
            half_cases.clone()
        {
            // (Before any cast: a device without the dtype may not survive
            // one.)
            if !super::attention_on_tensor_cores(&device, dtype.into(), head_dim) {
                continue;
            }
            let widen = |x: Tensor<3>| x.cast(FloatDType::F32);
            let round = |x: Tensor<3>| widen(x.cast(dtype));
            let (half, half_upstream) = (qkv.clone().cast(dtype), upstream.clone().cast(dtype));
            let run = |qkv: &Tensor<3>, upstream: &Tensor<3>, attention| match drop {
                Some(drop) => attention_dropout_run(
                    qkv,
                    upstream,
                    key_pad.clone(),
                    causal,
                    heads,
                    drop,
                    attention,
                ),
                None => attention_run(qkv, upstream, key_pad.clone(), causal, heads, attention),
            };
            let (y_ref, dqkv_ref) = run(
                &widen(half.clone()),
                &widen(half_upstream.clone()),
                AttentionKernel::Math,
            );
            // (Which kernels run on the matrix unit, in the name: with
            // `FLASH_MMA` on CUDA those with their scores in registers,
            // which give way to FlashAttention-2's for dropout.)
            let matrix_unit = match super::attention_route(&half, heads, AttentionKernel::Auto) {
                super::AttentionRoute::Registers if drop.is_none() => {
                    "on the matrix unit, scores in registers"
                }
                _ => "on the matrix unit",
            };
            for (attention, on) in [
                (AttentionKernel::Auto, matrix_unit),
                (AttentionKernel::MemoryEfficient, "scalar"),
            ] {
                let (y, dqkv) = run(&half, &half_upstream, attention);
                let difference = |x: Tensor<3>, reference: Tensor<3>| {
                    if relative {
                        relative_difference(widen(x), round(reference))
                    } else {
                        max_abs(widen(x), round(reference))
                    }
                };
                let (kernel, tolerance) = if relative {
                    (
                        format!("attention, {case}, {name} {on} (t={t}, relative)"),
                        tolerance * ATTENTION_RELATIVE_PER_ABSOLUTE,
                    )
                } else {
                    (format!("attention, {case}, {name} {on} (t={t})"), tolerance)
                };
                checks.push(KernelCheck {
                    kernel,
                    fused,
                    max_abs_difference: difference(y, y_ref.clone())
                        .max(difference(dqkv, dqkv_ref.clone())),
                    tolerance,
                });
            }
        }
    }
    // Queries that see no key: causal, the first `unseen` keys of entry 0
    // padding, so its first `unseen` queries see none. Their output must be
    // zeros (as flex gives, not 0/0), the other rows must match Burn's
    // composition, and nothing may be NaN or infinite. Burn's composition
    // does not make such a query's output zeros, so it is not the reference
    // there, and the gradients (which its output there feeds) are not
    // compared. Without a kiln kernel here (Burn's attention both ways)
    // there is nothing to check.
    if let Some(check) = check_dropout_mask(&device) {
        checks.push(check);
    }
    if !fused {
        return checks;
    }
    let unseen = 4;
    let starts = Tensor::<1, Int>::from_data([unseen as i64, 0], &device).reshape([b, 1]);
    let left_pad = Tensor::<1, Int>::arange(0..t as i64, &device)
        .reshape([1, t])
        .expand([b, t])
        .lower(starts.expand([b, t]));
    let run =
        |attention| attention_run(&qkv, &upstream, Some(left_pad.clone()), true, h, attention);
    let ((y, dqkv), (y_ref, _)) = (
        run(AttentionKernel::MemoryEfficient),
        run(AttentionKernel::Math),
    );
    let not_finite = |x: &Tensor<3>| {
        x.clone().is_nan().any().into_scalar::<bool>()
            || x.clone().is_inf().any().into_scalar::<bool>()
    };
    let seen = |x: Tensor<3>| [x.clone().slice([0..1, unseen..t]), x.slice([1..b, 0..t])];
    let [y_rows, y_other] = seen(y.clone());
    let [ref_rows, ref_other] = seen(y_ref);
    let difference = if not_finite(&y) || not_finite(&dqkv) {
        f64::INFINITY
    } else {
        let zeros = f64::from(y.slice([0..1, 0..unseen]).abs().max().into_scalar::<f32>());
        zeros
            .max(max_abs(y_rows, ref_rows))
            .max(max_abs(y_other, ref_other))
    };
    let (kernel, tolerance) = f32_check(
        &device,
        format!("attention, queries that see no key (t={t})"),
        ATTENTION_TOLERANCE,
    );
    checks.push(KernelCheck {
        kernel,
        fused,
        max_abs_difference: difference,
        tolerance,
    });
    checks
}

/// The tolerance of [`check_gelu`]: GELU and its gradient, from the
/// kernel and from Burn's operations, agree to within 1e-5 (inputs of
/// spread 3; each side's `erf` is its own approximation).
pub const GELU_TOLERANCE: f64 = 1e-5;

/// [`gelu`] fused and composed on `device`, 37 × 1009 elements of spread 3:
/// the output against Burn's GELU, and the gradient against the exact
/// derivative `Φ(x) + x·φ(x)` written as Burn operations. (Burn's own GELU
/// gradient is exact on flex, but on CubeCL it is the derivative of the
/// tanh approximation, up to 8.7e-4 off the exact one: not a reference for
/// an exact kernel.)
pub fn check_gelu(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::Distribution;
    let device = device.clone().autodiff();
    device.seed(15);
    let x = Tensor::<2>::random([37, 1009], Distribution::Normal(0.0, 3.0), &device);
    let upstream = Tensor::<2>::random([37, 1009], Distribution::Normal(0.0, 1.0), &device);
    let fused = gelu_fused_here(&x);
    let tracked = x.clone().require_grad();
    let y = gelu(tracked.clone(), Kernels::Fused);
    let grads = (y.clone() * upstream.clone()).sum().backward();
    let dx = tracked.grad(&grads).expect("x gradient");
    let (x, upstream) = (x.inner(), upstream.inner());
    let y_ref = activation::gelu(x.clone());
    let cdf = x
        .clone()
        .mul_scalar(std::f32::consts::FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    let pdf = x
        .clone()
        .powi_scalar(2)
        .mul_scalar(-0.5)
        .exp()
        .mul_scalar(0.398_942_3);
    let dx_ref = upstream * (cdf + x * pdf);
    let max_abs = |a: Tensor<2>, b: Tensor<2>| f64::from((a - b).abs().max().into_scalar::<f32>());
    KernelCheck {
        kernel: "gelu (37 × 1009)".into(),
        fused,
        max_abs_difference: max_abs(y.inner(), y_ref).max(max_abs(dx, dx_ref)),
        tolerance: GELU_TOLERANCE,
    }
}

/// Whether [`gelu`] runs a kiln kernel (flex's or CubeCL's) for `x`.
fn gelu_fused_here(x: &Tensor<2>) -> bool {
    #[cfg(feature = "flex")]
    if flex::runs_fused(x) {
        return true;
    }
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if super::cube::gelu::runs(x) {
        return true;
    }
    let _ = x;
    false
}

/// The tolerance of [`check_bias`] in f32: the bias's gradient is a sum
/// over 6,003 rows of spread 1 (sums of spread about 77), and f32's
/// rounding over that many additions reaches about 1e-3 in either order
/// (6.6e-4 between the kernel and Burn's sums on llvmpipe).
pub const BIAS_TOLERANCE: f64 = 5e-3;

/// [`check_bias`]'s tolerance in f16: its sums (spread about 0.8, below 4)
/// rounded to f16, two units in the last place at 2 to 4.
pub const BIAS_F16_TOLERANCE: f64 = 4e-3;

/// [`check_bias`]'s tolerance in bf16: two units in the last place at 2 to
/// 4 (bf16 keeps 8 bits).
pub const BIAS_BF16_TOLERANCE: f64 = 3.2e-2;

/// [`add_bias`] fused (on a CubeCL GPU, kiln's column sums for the bias's
/// gradient) against Burn's broadcast addition and its column sums, on
/// `device`, forward and backward: 3 × 2001 rows of width 200 (splits of
/// the rows and tiles of the columns ragged, two launches) and 2 × 75 of
/// width 96 (one launch); in f32, and in f16 and bf16 where the device has
/// them (a linear layer's bias in attention's packed projection is added
/// in the reduced dtype), there against the f32 sums of the same values
/// rounded to the dtype. The difference is the largest of the output's
/// and the two gradients'.
pub fn check_bias(device: &burn::tensor::Device) -> Vec<KernelCheck> {
    use burn::tensor::Distribution;
    let device = device.clone().autodiff();
    device.seed(16);
    let mut checks = Vec::new();
    for (dtype, name, tolerance) in [
        (FloatDType::F32, "f32", BIAS_TOLERANCE),
        (FloatDType::F16, "f16", BIAS_F16_TOLERANCE),
        (FloatDType::BF16, "bf16", BIAS_BF16_TOLERANCE),
    ] {
        if dtype != FloatDType::F32 && !device.supports_dtype(burn::tensor::DType::from(dtype)) {
            continue;
        }
        // Gradients of spread 1 in f32; in a reduced dtype of spread 0.01,
        // so that the sums stay where its rounding is fine.
        let spread = if dtype == FloatDType::F32 { 1.0 } else { 0.01 };
        for (b, t, width) in [(3, 2001, 200), (2, 75, 96)] {
            let normal = |shape: [usize; 3], spread| {
                Tensor::<3>::random(shape, Distribution::Normal(0.0, spread), &device).cast(dtype)
            };
            let x = normal([b, t, width], 1.0);
            let upstream = normal([b, t, width], spread);
            let bias =
                Tensor::<1>::random([width], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
            let fused = bias_fused_here(&x, &bias);
            let (tracked_x, tracked_bias) = (x.clone().require_grad(), bias.clone().require_grad());
            let y = add_bias(tracked_x.clone(), tracked_bias.clone(), Kernels::Fused);
            let grads = (y.clone() * upstream.clone()).sum().backward();
            let dx = tracked_x.grad(&grads).expect("x gradient");
            let dbias = tracked_bias.grad(&grads).expect("bias gradient");
            let widen3 = |t: Tensor<3>| t.cast(FloatDType::F32);
            let widen1 = |t: Tensor<1>| t.cast(FloatDType::F32);
            let (x, bias, upstream) = (x.inner(), bias.inner(), upstream.inner());
            let y_ref = x + bias.unsqueeze();
            let dbias_ref = widen3(upstream.clone())
                .reshape([b * t, width])
                .sum_dim(0)
                .reshape([width])
                .cast(dtype);
            let max3 = |a: Tensor<3>, r: Tensor<3>| {
                f64::from((widen3(a) - widen3(r)).abs().max().into_scalar::<f32>())
            };
            let max1 = |a: Tensor<1>, r: Tensor<1>| {
                f64::from((widen1(a) - widen1(r)).abs().max().into_scalar::<f32>())
            };
            checks.push(KernelCheck {
                kernel: format!("bias, {name} ({} × {width})", b * t),
                fused,
                max_abs_difference: max3(y.inner(), y_ref)
                    .max(max3(dx, upstream))
                    .max(max1(dbias, dbias_ref)),
                tolerance,
            });
        }
    }
    checks
}

/// Whether [`add_bias`] runs kiln's kernel for `x` and `bias`.
fn bias_fused_here(x: &Tensor<3>, bias: &Tensor<1>) -> bool {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if super::cube::bias::runs(x, bias) {
        return true;
    }
    let _ = (x, bias);
    false
}

/// The tolerance of [`check_layer_norm`]: outputs and the three gradients
/// of the kernel and Burn's `LayerNorm` agree to within 1e-4 (gamma's and
/// beta's gradients are sums over 150 rows, in another order).
pub const LAYER_NORM_TOLERANCE: f64 = 1e-4;

/// [`layer_norm`] fused and composed (Burn's `LayerNorm`) on `device`,
/// forward and backward: 2 × 75 rows of width 200 (ragged against a
/// cube's 128 units and the CPU's SIMD lanes), inputs of mean 3 and
/// spread 2, gamma and beta drawn (not ones and zeros). The difference is
/// the largest of the output's and the gradients' of x, gamma and beta.
pub fn check_layer_norm(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::Distribution;
    let device = device.clone().autodiff();
    device.seed(14);
    let (b, t, d) = (2, 75, 200);
    let ln = drawn_layer_norm(d, &device);
    let x = Tensor::<3>::random([b, t, d], Distribution::Normal(3.0, 2.0), &device);
    let upstream = Tensor::<3>::random([b, t, d], Distribution::Normal(0.0, 1.0), &device);
    let beta = ln.beta.as_ref().expect("beta");
    let fused = layer_norm_fused_here(&x, &ln.gamma.val(), &beta.val());
    let run = |kernels| {
        let x = x.clone().require_grad();
        let y = layer_norm(&ln, x.clone(), kernels);
        let grads = (y.clone() * upstream.clone()).sum().backward();
        let dx = x.grad(&grads).expect("x gradient");
        let dgamma = ln.gamma.grad(&grads).expect("gamma gradient");
        let dbeta = beta.grad(&grads).expect("beta gradient");
        (y.detach(), dx, dgamma, dbeta)
    };
    let (y, dx, dgamma, dbeta) = run(Kernels::Fused);
    let (y_ref, dx_ref, dgamma_ref, dbeta_ref) = run(Kernels::Reference);
    let max_abs3 = |a: Tensor<3>, b: Tensor<3>| f64::from((a - b).abs().max().into_scalar::<f32>());
    let max_abs1 = |a: Tensor<1>, b: Tensor<1>| f64::from((a - b).abs().max().into_scalar::<f32>());
    KernelCheck {
        kernel: format!("layer norm ({} × {d})", b * t),
        fused,
        max_abs_difference: max_abs3(y, y_ref)
            .max(max_abs3(dx, dx_ref))
            .max(max_abs1(dgamma, dgamma_ref))
            .max(max_abs1(dbeta, dbeta_ref)),
        tolerance: LAYER_NORM_TOLERANCE,
    }
}

/// A LayerNorm of width `d` with [`LAYER_NORM_EPSILON`] whose gamma and
/// beta are drawn (not the initial ones and zeros, so that they matter).
pub(super) fn drawn_layer_norm(d: usize, device: &burn::tensor::Device) -> LayerNorm {
    use burn::nn::LayerNormConfig;
    use burn::tensor::Distribution;
    let mut ln = LayerNormConfig::new(d)
        .with_epsilon(LAYER_NORM_EPSILON)
        .init(device);
    ln.gamma = ln
        .gamma
        .map(|g| g.random_like(Distribution::Normal(1.0, 0.5)).require_grad());
    ln.beta = ln
        .beta
        .map(|b| b.map(|b| b.random_like(Distribution::Normal(0.0, 0.5)).require_grad()));
    ln
}

/// Whether [`layer_norm`] runs a kiln kernel (flex's or CubeCL's) for `x`
/// with these gamma and beta.
fn layer_norm_fused_here(x: &Tensor<3>, gamma: &Tensor<1>, beta: &Tensor<1>) -> bool {
    #[cfg(feature = "flex")]
    if flex::runs_fused(x) {
        return true;
    }
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if super::cube::layer_norm::runs(x, gamma, beta) {
        return true;
    }
    let _ = (x, gamma, beta);
    false
}

/// Self-attention's output and qkv gradient with `attention`, for the
/// upstream gradient `upstream`.
pub(super) fn attention_run(
    qkv: &Tensor<3>,
    upstream: &Tensor<3>,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    heads: usize,
    attention: AttentionKernel,
) -> (Tensor<3>, Tensor<3>) {
    output_and_grad(qkv, upstream, |qkv| {
        self_attention(qkv, heads, key_pad, causal, attention)
    })
}

/// `attend(qkv)` and the gradient of qkv for the upstream gradient
/// `upstream`.
fn output_and_grad(
    qkv: &Tensor<3>,
    upstream: &Tensor<3>,
    attend: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> (Tensor<3>, Tensor<3>) {
    let qkv = qkv.clone().require_grad();
    let y = attend(qkv.clone());
    let grads = (y.clone() * upstream.clone()).sum().backward();
    (y.detach(), qkv.grad(&grads).expect("qkv gradient"))
}

/// The CubeCL kernels' dropout mask against the host's
/// ([`dropout_keeps`](super::dropout_keeps)) where a probability's index
/// `row · t + j` passes 2³², which the kernels take in 32-bit halves and
/// no attention check reaches: four rows of 3,000 keys on either side of
/// the row whose keys cross 2³² (the carry into the high half), and four
/// from row 50 million (a high half of 34 and more). Exact: the factors
/// are `1 / keep` or 0. `None` off a CubeCL GPU (flex's kernels call the
/// host's function); under `fusion` not run (`fused` false), its kernel
/// launched outside a fusion stream.
fn check_dropout_mask(device: &burn::tensor::Device) -> Option<KernelCheck> {
    #[cfg(feature = "cube")]
    crate::device_memory::cube_gpu_device(device)?;
    let kernel = "attention's dropout mask, indices past 2³²".to_string();
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    {
        let (seq, rows) = (3_000u32, 4u32);
        let crossing = ((1u64 << 32) / u64::from(seq)) as u32 - rows / 2;
        let (threshold, scale) = (CHECK_DROPOUT.threshold(), CHECK_DROPOUT.scale());
        let mut difference = 0.0f64;
        for row0 in [crossing, 50_000_000] {
            let got = super::cube::dropout::factors(device, CHECK_DROPOUT, row0, rows, seq);
            if got.len() != (rows * seq) as usize {
                difference = f64::INFINITY;
            }
            for (k, got) in got.into_iter().enumerate() {
                let index = u64::from(row0) * u64::from(seq) + k as u64;
                let kept = super::dropout_keeps(CHECK_DROPOUT.seed, index, threshold);
                let want = if kept { scale } else { 0.0 };
                difference = difference.max(f64::from((got - want).abs()));
            }
        }
        Some(KernelCheck {
            kernel,
            fused: true,
            max_abs_difference: difference,
            tolerance: 0.0,
        })
    }
    #[cfg(all(feature = "cube", feature = "fusion"))]
    return Some(KernelCheck {
        kernel,
        fused: false,
        max_abs_difference: 0.0,
        tolerance: 0.0,
    });
    #[cfg(not(feature = "cube"))]
    {
        let _ = (device, kernel);
        None
    }
}

/// The dropout the attention checks run: 0.1, a fixed seed whose two
/// halves both matter to the hash, each the bits of an f32 in [0, 1) as
/// the seeds a run draws are (`MaskSeed::draw`: the GPUs' kernels read it
/// as two such f32 on the device).
pub(super) const CHECK_DROPOUT: super::ProbsDropout = super::ProbsDropout {
    seed: 0x3f6b_696c_3e6e_0007,
    keep: 0.9,
};

/// Self-attention's output and qkv gradient with the probabilities dropped
/// out by `drop`, for the upstream gradient `upstream`: kiln's kernel that
/// `attention` picks, or with `Math` the composition with the mask
/// [`reference_mask`] builds on the host multiplying the probabilities —
/// the mask the kernels must draw.
pub(super) fn attention_dropout_run(
    qkv: &Tensor<3>,
    upstream: &Tensor<3>,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    heads: usize,
    drop: super::ProbsDropout,
    attention: AttentionKernel,
) -> (Tensor<3>, Tensor<3>) {
    output_and_grad(qkv, upstream, |qkv| {
        if attention == AttentionKernel::Math {
            let [q, k, v] = super::split_heads(qkv, heads);
            let [b, h, t, _] = q.dims();
            let mask = reference_mask(drop, [b, h, t], &q.device());
            let dropped = |p| p * mask;
            crate::precision::attend(q, k, v, key_pad, causal, crate::ComputeDtype::F32, dropped)
        } else {
            let drop = Some((super::MaskSeed::Host(drop.seed), drop.keep));
            super::attention_with(qkv, heads, key_pad, causal, attention, drop)
        }
    })
}

/// [`attention_dropout_run`] by kiln's kernels (`MemoryEfficient`: flex's,
/// or the scalar CubeCL ones), then by the composition with the host's
/// mask: each one's output and qkv gradient.
pub(super) fn attention_dropout_kernel_and_reference(
    qkv: &Tensor<3>,
    upstream: &Tensor<3>,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    heads: usize,
    drop: super::ProbsDropout,
) -> ((Tensor<3>, Tensor<3>), (Tensor<3>, Tensor<3>)) {
    let run = |attention| {
        attention_dropout_run(
            qkv,
            upstream,
            key_pad.clone(),
            causal,
            heads,
            drop,
            attention,
        )
    };
    (
        run(AttentionKernel::MemoryEfficient),
        run(AttentionKernel::Math),
    )
}

/// The mask `drop` draws over `batch × heads` heads' `t × t` probabilities
/// (`[b, heads, t, t]`: element `(bh·t + i)·t + j`, as the kernels number
/// them), kept ones `1 / keep` and the others 0, from
/// [`dropout_keeps`](super::dropout_keeps) on the host: what the kernels'
/// masks are checked against.
pub(super) fn reference_mask(
    drop: super::ProbsDropout,
    [b, heads, t]: [usize; 3],
    device: &burn::tensor::Device,
) -> Tensor<4> {
    let (threshold, scale) = (drop.threshold(), drop.scale());
    let values: Vec<f32> = (0..(b * heads * t * t) as u64)
        .map(|i| {
            if super::dropout_keeps(drop.seed, i, threshold) {
                scale
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_data(
        burn::tensor::TensorData::new(values, [b, heads, t, t]),
        device,
    )
}

/// Whether [`self_attention`] runs a kiln kernel (flex's or CubeCL's) for
/// `qkv`.
fn attention_fused_here(qkv: &Tensor<3>) -> bool {
    #[cfg(feature = "flex")]
    if flex::runs_fused(qkv) {
        return true;
    }
    // kiln's kernels (flex's, the scalar CubeCL ones), which the f32 cases
    // check whichever `auto` picks (Burn's attention in f32 on CUDA).
    memory_efficient_attention_runs(qkv, qkv.dtype(), 1, AttentionKernel::MemoryEfficient)
}

/// `max |x − reference|` over `reference`'s largest magnitude (the
/// checks whose values span orders of magnitude).
fn relative_difference<const D: usize>(x: Tensor<D>, reference: Tensor<D>) -> f64 {
    let scale = f64::from(reference.clone().abs().max().into_scalar::<f32>()).max(1e-30);
    f64::from((x - reference).abs().max().into_scalar::<f32>()) / scale
}

/// The tolerance of [`check_embedding`]: the kernel sums each table row's
/// tokens in order of position, as Burn's `select_assign` does, so the
/// two agree to f32's rounding of the same sums (1e-5 leaves room for a
/// compiler's contractions).
pub const EMBEDDING_TOLERANCE: f64 = 1e-5;

/// [`token_embeddings`] fused (on a CubeCL GPU, kiln's kernel for the
/// table's gradient) against Burn's embedding, on `device`, forward and
/// the table's gradient, in f32: 3 × 75 tokens of 203 rows 200 wide
/// (rows repeated, rows unused, columns ragged against the kernel's 256),
/// and 2 × 50 tokens of 40,000 rows 8 wide (more rows than the grid's
/// second dimension takes: its third). The difference is the largest of
/// the output's and the gradient's.
pub fn check_embedding(device: &burn::tensor::Device) -> Vec<KernelCheck> {
    use burn::nn::EmbeddingConfig;
    use burn::tensor::Distribution;
    let device = device.clone().autodiff();
    device.seed(29);
    let mut checks = Vec::new();
    for (b, t, rows, width) in [(3, 75, 203, 200), (2, 50, 40_000, 8)] {
        let table = EmbeddingConfig::new(rows, width).init(&device);
        // Ids that repeat and leave rows out: a quarter of the rows.
        let ids: Vec<i64> = (0..b * t)
            .map(|i| ((i * 7919 + 13) % (rows / 4).max(1)) as i64 * 4 % rows as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(burn::tensor::TensorData::new(ids, [b, t]), &device);
        let upstream = Tensor::<3>::random([b, t, width], Distribution::Normal(0.0, 1.0), &device);
        let fused = embedding_fused_here(&table.weight.val());
        let run = |kernels| {
            let y = token_embeddings(&table, ids.clone(), kernels);
            let grads = (y.clone() * upstream.clone()).sum().backward();
            let grad = table.weight.grad(&grads).expect("the table's gradient");
            (y.inner(), grad)
        };
        let (y, grad) = run(Kernels::Fused);
        let (y_ref, grad_ref) = run(Kernels::Reference);
        let max3 = |a: Tensor<3>, r: Tensor<3>| f64::from((a - r).abs().max().into_scalar::<f32>());
        let max2 = |a: Tensor<2>, r: Tensor<2>| f64::from((a - r).abs().max().into_scalar::<f32>());
        checks.push(KernelCheck {
            kernel: format!("embedding gradient ({} tokens, {rows} × {width})", b * t),
            fused,
            max_abs_difference: max3(y, y_ref).max(max2(grad, grad_ref)),
            tolerance: EMBEDDING_TOLERANCE,
        });
    }
    checks
}

/// Whether [`token_embeddings`] runs kiln's kernel for a table like `weight`.
fn embedding_fused_here(weight: &Tensor<2>) -> bool {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    return super::cube::embedding::runs(weight);
    #[cfg(not(all(feature = "cube", not(feature = "fusion"))))]
    {
        let _ = weight;
        false
    }
}

/// [`check_matmul`]'s tolerance in bf16, relative to the largest value
/// of each result: cuBLAS rounds each sum once to bf16 (half a unit in
/// the last place, 2⁻⁸ of the value), and the f32 sums run in another
/// order; two units (bf16 keeps 8 bits) leave room for both.
pub const MATMUL_BF16_TOLERANCE: f64 = 1.6e-2;

/// [`check_matmul`]'s tolerance in f16, relative as in bf16: two units in
/// the last place (f16 keeps 11 bits).
pub const MATMUL_F16_TOLERANCE: f64 = 2e-3;

/// [`check_matmul`]'s tolerance in f32 with TF32 (`precision.tf32`), and
/// wherever Burn's f32 reference may itself run on TF32 tensor cores
/// ([`f32_products_round`]): TF32 keeps f16's 11 bits, and rounds the
/// inputs too. Each term's error is then about 4e-4 of it (both inputs'
/// roundings), their sum's about 4e-4 of the result's spread (about 1
/// here), the worst of 3 M results about 5 times that, against largest
/// values of about 5: 4e-4 relative, five times under this.
pub const MATMUL_TF32_TOLERANCE: f64 = MATMUL_F16_TOLERANCE;

/// [`check_matmul`]'s tolerance in f32 without TF32: the same sums in
/// another order (each about 1e-7 of the result's spread, over up to
/// 16,384 terms for a gradient).
pub const MATMUL_F32_TOLERANCE: f64 = 1e-5;

/// The linear layers' products by cuBLAS (`optimization.matmul =
/// "cublas"`, `cube::cublas`) on `device`, forward and backward, against
/// Burn's product in f32 of the same rounded values (exact products of
/// bf16/f16 inputs, which TF32 holds too): `[m, k] · [k, n]` at 300 × 200
/// · 96 (rows CUDA pads: 96 and 200 bf16 values are not 512 bytes), 37 ×
/// 1,009 · 50 (odd sizes) and GPT-2 small's MLP, 1,024 × 768 · 3,072; in
/// bf16, f16, and f32 with TF32 allowed and not ([`super::set_tf32`], put
/// back as it was after). The backward pass takes both operands transposed
/// (Burn's `transpose` is a view: cuBLAS's `OP_T`). The difference is the
/// largest of the output's and the two gradients', each relative to the
/// largest value of its reference. Where cuBLAS does not run (not CUDA,
/// no library) the check says so and compares Burn's product in the
/// reduced dtype with its f32 one, at the first shape only.
pub fn check_matmul(device: &burn::tensor::Device) -> Vec<KernelCheck> {
    use burn::tensor::Distribution;
    let device = device.clone().autodiff();
    device.seed(23);
    let mut checks = Vec::new();
    let available = super::cublas_unavailable(&device).is_none();
    let tf32_was = super::tf32();
    let (f32_name, f32_tolerance) = f32_check(&device, "f32".into(), MATMUL_F32_TOLERANCE);
    for (dtype, name, tolerance, tf32) in [
        (
            FloatDType::BF16,
            "bf16".into(),
            MATMUL_BF16_TOLERANCE,
            false,
        ),
        (FloatDType::F16, "f16".into(), MATMUL_F16_TOLERANCE, false),
        (FloatDType::F32, f32_name, f32_tolerance, false),
        (
            FloatDType::F32,
            "f32 as TF32".into(),
            MATMUL_TF32_TOLERANCE,
            true,
        ),
    ] {
        if !device.supports_dtype(burn::tensor::DType::from(dtype)) {
            continue;
        }
        super::set_tf32(tf32);
        // Where cuBLAS does not run the comparison says nothing about it:
        // one small shape, not GPT-2's on a software GPU.
        let shapes = [(300, 200, 96), (37, 1009, 50), (1024, 768, 3072)];
        for (m, k, n) in shapes.into_iter().take(if available { 3 } else { 1 }) {
            // Values about 1 in every result: b and the upstream gradient
            // scaled by 1/√(the sum's length).
            let normal = |shape: [usize; 2], spread: f64| {
                Tensor::<2>::random(shape, Distribution::Normal(0.0, spread), &device).cast(dtype)
            };
            let a = normal([m, k], 1.0);
            let b = normal([k, n], 1.0 / (k as f64).sqrt());
            let upstream = normal([m, n], 1.0 / (m as f64).sqrt());
            let fused = available && cublas_runs(&a, &b);
            let (ta, tb) = (a.clone().require_grad(), b.clone().require_grad());
            let y = cublas_product(ta.clone(), tb.clone(), fused);
            let grads = (y.clone().cast(FloatDType::F32) * upstream.clone().cast(FloatDType::F32))
                .sum()
                .backward();
            let da = ta.grad(&grads).expect("a's gradient");
            let db = tb.grad(&grads).expect("b's gradient");
            let wide = |t: Tensor<2>| t.cast(FloatDType::F32);
            let (a, b, g) = (wide(a.inner()), wide(b.inner()), wide(upstream.inner()));
            let y_ref = a.clone().matmul(b.clone());
            let da_ref = g.clone().matmul(b.transpose());
            let db_ref = a.transpose().matmul(g);
            let relative = |x: Tensor<2>, r: Tensor<2>| relative_difference(wide(x), r);
            checks.push(KernelCheck {
                kernel: format!("matmul by cuBLAS, {name} ({m} × {k} · {k} × {n}, relative)"),
                fused,
                max_abs_difference: relative(y.inner(), y_ref)
                    .max(relative(da, da_ref))
                    .max(relative(db, db_ref)),
                tolerance,
            });
        }
    }
    super::set_tf32(tf32_was);
    checks
}

/// Whether cuBLAS's product takes `a · b` (the device, the dtypes).
fn cublas_runs(a: &Tensor<2>, b: &Tensor<2>) -> bool {
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    return super::cube::cublas::runs(a, b);
    #[cfg(not(all(feature = "cuda", not(feature = "fusion"))))]
    {
        let _ = (a, b);
        false
    }
}

/// `a · b` by cuBLAS where `fused`, else Burn's.
fn cublas_product(a: Tensor<2>, b: Tensor<2>, fused: bool) -> Tensor<2> {
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    if fused {
        return super::cube::cublas::matmul(a, b);
    }
    let _ = fused;
    a.matmul(b)
}

/// The tolerance of [`check_lm_head_loss`]: the loss and the gradients of
/// the hidden states and the embedding (each token's, about 1 in size),
/// fused against composed, agree to within 1e-4 (f32; the sums run in
/// another order).
pub const LM_HEAD_LOSS_TOLERANCE: f64 = 1e-4;

/// [`lm_head_loss`] fused and composed on `device`, forward and backward:
/// 2 × 75 tokens of width 48, a vocabulary of 203 padded to 256, the fused
/// version in chunks of 64 rows (ragged: 64, 64, 22), in f32, without and
/// with label smoothing (0.1). The difference is the largest of the
/// loss's and the gradients' of the hidden states and the embedding
/// (whose padding rows must get none).
pub fn check_lm_head_loss(device: &burn::tensor::Device) -> KernelCheck {
    use burn::tensor::{Distribution, TensorData};
    let device = device.clone().autodiff();
    device.seed(16);
    let (b, t, d, vocab, padded) = (2, 75, 48, 203, 256);
    let x = Tensor::<3>::random([b, t, d], Distribution::Normal(0.0, 1.0), &device);
    let weight = Tensor::<2>::random([padded, d], Distribution::Normal(0.0, 0.3), &device);
    let ids: Vec<i64> = (0..b * t).map(|i| ((i * 37 + 5) % vocab) as i64).collect();
    let targets = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, t]), &device);
    let fused = lm_head_loss_fused_here(&x);
    let run = |kernels, smoothing| {
        let (x, weight) = (x.clone().require_grad(), weight.clone().require_grad());
        let head = super::LmHead {
            vocab,
            compute: crate::ComputeDtype::F32,
            smoothing,
        };
        let loss = lm_head_losses(
            x.clone(),
            weight.clone(),
            targets.clone(),
            head,
            kernels,
            Some(64),
            false,
        );
        // An upstream gradient of the token count: the gradients are each
        // token's own (about 1), not a mean's (1/150 of that).
        let grads = loss.clone().mul_scalar((b * t) as f64).backward();
        let dx = x.grad(&grads).expect("x gradient");
        let dw = weight.grad(&grads).expect("weight gradient");
        (loss.inner(), dx, dw)
    };
    // Without autodiff (an evaluation): the mean loss, or each token's
    // (scoring a text), no gradient made.
    let untracked = |kernels, smoothing, chunk, each_token| {
        let head = super::LmHead {
            vocab,
            compute: crate::ComputeDtype::F32,
            smoothing,
        };
        lm_head_losses(
            x.clone().inner(),
            weight.clone().inner(),
            targets.clone().inner(),
            head,
            kernels,
            chunk,
            each_token,
        )
    };
    let max_abs = |a: Tensor<1>, b: Tensor<1>| f64::from((a - b).abs().max().into_scalar::<f32>());
    // Each token's loss: the fused rows, in one chunk and in ragged chunks
    // of 64 rows (64, 64, 22), against the composition's log-softmax.
    let per_token = |kernels, chunk| untracked(kernels, 0.0, chunk, true);
    let reference = per_token(Kernels::Reference, None);
    let mut worst = max_abs(per_token(Kernels::Fused, None), reference.clone())
        .max(max_abs(per_token(Kernels::Fused, Some(64)), reference));
    for smoothing in [0.0, 0.1] {
        worst = worst.max(max_abs(
            untracked(Kernels::Fused, smoothing, Some(64), false),
            untracked(Kernels::Reference, smoothing, Some(64), false),
        ));
        let (loss, dx, dw) = run(Kernels::Fused, smoothing);
        let (loss_ref, dx_ref, dw_ref) = run(Kernels::Reference, smoothing);
        let padding_grad = f64::from(
            dw.clone()
                .slice([vocab..padded, 0..d])
                .abs()
                .max()
                .into_scalar::<f32>(),
        );
        worst = worst
            .max(max_abs(loss, loss_ref))
            .max(max_abs(dx.reshape([-1]), dx_ref.reshape([-1])))
            .max(max_abs(dw.reshape([-1]), dw_ref.reshape([-1])))
            .max(padding_grad);
    }
    let (kernel, tolerance) = f32_check(
        &device,
        format!(
            "lm head and loss ({} × {d}, vocabulary {vocab} as {padded}, label smoothing 0 and 0.1, with and without autodiff, and each token's, in chunks of 64 rows and in one)",
            b * t
        ),
        LM_HEAD_LOSS_TOLERANCE,
    );
    KernelCheck {
        kernel,
        fused,
        max_abs_difference: worst,
        tolerance,
    }
}
