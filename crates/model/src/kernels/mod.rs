//! Fused CPU kernels for the models' hot spots, through Burn's
//! backend-extension point.
//!
//! Burn's `flex` backend runs each element-wise operation as its own pass on
//! one thread, exact GELU through scalar libm `erf`, attention and LayerNorm
//! as chains of such passes under autodiff, and a batched linear layer as
//! one gemm per batch entry (packing the weight each time): in a profile of
//! a GPT training step that, not the multiply itself, was most of the time
//! (docs/PERFORMANCE.md). Each kernel here is one pass (or one gemm) split
//! over all cores, its loops vectorised for the CPU's widest SIMD, with its
//! own backward.
//!
//! How it plugs into Burn: `KilnKernels` is a backend extension
//! (`#[backend_extension]`) implemented for `Flex` (the kernels in `cpu`)
//! and for `Autodiff<B>` (which records the operation and calls the
//! backend's backward kernel). The public functions here ([`linear`],
//! [`gelu`], [`self_attention`], [`layer_norm`]) take a
//! [`Kernels`] choice: on a flex f32 tensor, `Fused` runs the kernel; on any
//! other device or dtype, or with `Reference`, they run the plain Burn
//! composition of the same math, which is also what the tests compare the
//! kernels against, forward and backward.
//!
//! On the CubeCL GPUs (wgpu, CUDA) kiln has its own kernels too, each its
//! own extension trait.
//!
//! Where each kernel lives, by the device it runs on:
//!
//! | module | runs on | what |
//! |---|---|---|
//! | `cpu/` | flex (CPU) | the fused kernels (`cpu/mod.rs`), their SIMD math (`cpu/math.rs`), the measured fp32 peak (`cpu/peak.rs`) |
//! | `cube/` | CubeCL GPUs (wgpu, CUDA) | memory-efficient attention and FlashAttention-2 on the matrix unit, exact GELU, LayerNorm in f32, a bias with its gradient's column sums, the helpers they share; on CUDA the products by cuBLAS (`cube/cublas.rs`, `optimization.matmul`) |
//! | `group.rs` | (the host) | the token embedding's gradient's grouping of tokens by row |
//! | `blas_layout.rs` | (the host) | how a column-major BLAS reads Burn's row-major, pitched and transposed operands |
//! | `norm.rs`, `optim.rs` | flex and CubeCL | the gradients' sum of squares and AdamW's update: one kernel per device in each file |
//! | `lm_loss.rs` | every backend | the LM head fused with its loss (Burn's primitives in chunks) |
//! | `autodiff.rs` | every backend | the backward-pass glue the extensions share |
//! | `isa.rs` | (the host) | which instruction sets the CPU has and the build uses |
//! | `check.rs` | any device | the reference checks: each kernel against its composition (`kiln check-kernels`) |
//!
//! All but attention are left out under Burn's `fusion`, which fuses
//! their compositions itself.

#[cfg(any(feature = "flex", feature = "cube"))]
mod autodiff;
#[cfg_attr(
    not(all(feature = "cuda", not(feature = "fusion"))),
    allow(
        dead_code,
        reason = "the cuBLAS products' layout rules, tested on every build"
    )
)]
mod blas_layout;
mod check;
#[cfg(feature = "flex")]
mod cpu;
#[cfg(feature = "cube")]
mod cube;
#[cfg_attr(
    not(all(feature = "cube", not(feature = "fusion"))),
    allow(
        dead_code,
        reason = "the embedding kernel's grouping, tested on every build"
    )
)]
mod group;
mod isa;
#[cfg(any(feature = "flex", feature = "cube"))]
mod lm_loss;
mod norm;
mod optim;
mod ptx;

pub use check::{
    ADAMW_TOLERANCE, ATTENTION_BF16_TOLERANCE, ATTENTION_F16_TOLERANCE, ATTENTION_TOLERANCE,
    BIAS_BF16_TOLERANCE, BIAS_F16_TOLERANCE, BIAS_TOLERANCE, EMBEDDING_TOLERANCE, GELU_TOLERANCE,
    KernelCheck, LAYER_NORM_TOLERANCE, LM_HEAD_LOSS_TOLERANCE, MATMUL_BF16_TOLERANCE,
    MATMUL_F16_TOLERANCE, MATMUL_F32_TOLERANCE, MATMUL_TF32_TOLERANCE, SUM_OF_SQUARES_TOLERANCE,
    TF32_TOLERANCE, check_adamw, check_attention, check_bias, check_embedding, check_gelu,
    check_layer_norm, check_lm_head_loss, check_matmul, check_sum_of_squares, f32_products_round,
};
#[cfg(feature = "flex")]
pub use cpu::peak::{ClockEstimate, MeasuredPeak, measure_fp32_peak};
pub use ptx::{Occupancy, OfflineKernel, PtxCounts, Registers, occupancy, ptx_target};

/// kiln's CubeCL kernels compiled for NVIDIA compute capability `arch`
/// (90 for an H100 or H200) without a device, by both of CubeCL's CUDA
/// compilers (`kiln check-kernels --cuda-arch`); `None` where this build
/// has no CUDA backend.
pub fn compile_cuda_kernels(arch: u32) -> Option<Vec<OfflineKernel>> {
    #[cfg(feature = "cuda")]
    return Some(cube::offline::compile_kernels(arch));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = arch;
        None
    }
}

/// NVIDIA's assembler, to count what [`compile_cuda_kernels`]' PTX needs:
/// `bin/ptxas` of the CUDA toolkit CubeCL finds (`CUDA_PATH`, else
/// `/usr/local/cuda`, `/opt/cuda`: CubeCL's own lookup, in CUDA builds),
/// else `ptxas` on `PATH`; `None` where there is none.
pub fn find_ptxas() -> Option<std::path::PathBuf> {
    #[cfg(feature = "cuda")]
    let toolkit = cubecl::cuda::install::cuda_path().map(|root| root.join("bin").join("ptxas"));
    #[cfg(not(feature = "cuda"))]
    let toolkit = None;
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("ptxas"));
    toolkit.into_iter().chain(on_path).find(|p| p.is_file())
}
#[cfg(feature = "cube")]
pub(crate) use cube::{cube_empty, cube_gpu, cube_gpu_float};
#[cfg(all(feature = "cube", not(feature = "fusion")))]
pub(crate) use cube::{from_cube, into_cube};
pub use isa::{AVX512_BUILT, CpuIsa, cpu_isa};
pub use norm::{sum_of_squares, sum_of_squares_value};
pub use optim::{AdamWParam, AdamWStep, adamw, adamw_many};

use burn::nn::{Dropout, LayerNorm, Linear};
use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Int, Tensor, activation};

/// Which implementation of the fused operations a model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// kiln's fused kernels where the device has them (flex, f32), the
    /// plain Burn composition elsewhere.
    #[default]
    Fused,
    /// Always the plain Burn composition (the reference the fused kernels
    /// are tested against).
    Reference,
}

impl Kernels {
    /// The self-attention these kernels run when `choice` is asked for:
    /// `Reference` is Burn's composition (`Math`) whatever the choice.
    pub fn attention(self, choice: AttentionKernel) -> AttentionKernel {
        match self {
            Kernels::Fused => choice,
            Kernels::Reference => AttentionKernel::Math,
        }
    }
}

/// Which self-attention [`self_attention`] runs, as PyTorch's
/// `sdpa_kernel` picks among its backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The best the device and dtype have: FlashAttention-2 on the matrix
    /// unit (f16/bf16 on a CubeCL GPU with a matrix instruction for the
    /// dtype), else kiln's memory-efficient kernels (CubeCL GPUs; flex in
    /// f32), else Burn's composition.
    #[default]
    Auto,
    /// The matrix-unit kernels: the same as `Auto` where
    /// [`attention_on_tensor_cores`] holds; a caller asking for them
    /// elsewhere should refuse (kiln-train does, at the run's start).
    Flash,
    /// kiln's memory-efficient kernels without the matrix unit (the scalar
    /// CubeCL kernels; flex's fused kernel), Burn's composition where there
    /// are none.
    MemoryEfficient,
    /// Burn's composition (`attention` with the mask expanded): keeps the
    /// `heads × T × T` scores.
    Math,
}

/// What kiln's attention kernels take besides the tensors: the heads, the
/// causal mask, and whether the matrix unit may run them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttentionSpec {
    /// Heads in the packed projection.
    pub(crate) heads: usize,
    /// Query `i` sees keys `≤ i`.
    pub(crate) causal: bool,
    /// The matrix-unit kernels where the device and dtype have them
    /// (`AttentionKernel::MemoryEfficient` says no).
    pub(crate) matrix_unit: bool,
    /// Dropout on the probabilities (kiln's kernels: flex's, CubeCL's
    /// scalar and FlashAttention-2 ones; `FLASH_MMA`'s register kernels
    /// have none, and give way to FlashAttention-2's where it is asked).
    /// Its `seed` is flex's: the CubeCL kernels read theirs on the device
    /// (after the key-padding flags, `cube::attention::self_attention`),
    /// and it is 0 there.
    pub(crate) dropout: Option<ProbsDropout>,
}

/// Dropout on attention's probabilities (BERT's
/// `attention_probs_dropout_prob`, nanoGPT's `attn_dropout`): the mask of
/// `seed` ([`dropout_keeps`]) with probability `keep`, kept probabilities
/// times `1 / keep`. Query `i`'s probability of key `j` in head `bh` (of
/// the `batch × heads` heads, `t` positions) is element `(bh·t + i)·t + j`
/// of the mask, whatever part of the `t × t` scores a head computes, so the
/// backward pass draws the same mask again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ProbsDropout {
    /// The mask's seed.
    pub(crate) seed: u64,
    /// The probability of keeping each, in (0, 1].
    pub(crate) keep: f64,
}

// `keep` is a probability, never NaN.
impl Eq for ProbsDropout {}

impl ProbsDropout {
    /// The hash threshold of `keep` ([`dropout_threshold`]).
    pub(crate) fn threshold(self) -> u32 {
        dropout_threshold(self.keep)
    }

    /// What a kept probability is multiplied by: `1 / keep`.
    pub(crate) fn scale(self) -> f32 {
        (1.0 / self.keep) as f32
    }
}

/// The keys [`dropout_keeps`] derives from a mask's seed: the odd
/// multiplier of the index, the key the product is xored with, and the key
/// between the two rounds. The GPUs' attention kernels derive the same
/// keys from the seed on the device (`cube/dropout.rs`'s `seed_keys`) and
/// hash as [`dropout_keeps`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MaskKeys {
    pub(crate) multiply: u32,
    pub(crate) xor: u32,
    pub(crate) last: u32,
}

impl MaskKeys {
    /// The keys of `seed`.
    #[inline(always)]
    pub(crate) fn of(seed: u64) -> Self {
        let (lo, hi) = (seed as u32, (seed >> 32) as u32);
        Self {
            multiply: hi | 1,
            xor: lo,
            last: hi.rotate_left(16),
        }
    }
}

/// murmur3's 32-bit finalizer's two multipliers, and the multiplier that
/// folds an index's high 32 bits into its low ones ([`dropout_keeps`]).
pub(crate) const MIX_1: u32 = 0x85EB_CA6B;
pub(crate) const MIX_2: u32 = 0xC2B2_AE35;
pub(crate) const INDEX_HIGH: u32 = 0x27D4_EB2F;

/// Whether dropout keeps element `index` under `seed`: a counter-based hash
/// below `threshold` (keep × 2³²). The hash is murmur3's 32-bit finalizer
/// over the index multiplied by an odd key of the seed, then keyed again,
/// so that two seeds' masks are neither shifts nor permutations of one
/// another; each element's bits depend on its index alone, so a mask is
/// made again for the backward pass instead of kept, in any chunking, and
/// on any device: flex's kernels call this, the CubeCL attention kernels
/// compute the same in 32-bit arithmetic (`cube/dropout.rs`).
#[inline(always)]
pub(crate) fn dropout_keeps(seed: u64, index: u64, threshold: u32) -> bool {
    #[inline(always)]
    fn fmix32(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(MIX_1);
        h ^= h >> 13;
        h = h.wrapping_mul(MIX_2);
        h ^ (h >> 16)
    }
    let keys = MaskKeys::of(seed);
    let i = (index as u32) ^ ((index >> 32) as u32).wrapping_mul(INDEX_HIGH);
    let h = fmix32(i.wrapping_mul(keys.multiply) ^ keys.xor);
    fmix32(h ^ keys.last) < threshold
}

/// The hash threshold of a keep probability: `keep × 2³²`, at most
/// `u32::MAX`.
pub(crate) fn dropout_threshold(keep: f64) -> u32 {
    (keep * 4_294_967_296.0).min(f64::from(u32::MAX)) as u32
}

/// Exact GELU, `x · Φ(x)`.
pub fn gelu<const D: usize>(x: Tensor<D>, kernels: Kernels) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if kernels == Kernels::Fused && flex::runs_fused(&x) {
        return flex::gelu(x);
    }
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused && cube::gelu::runs(&x) {
        return cube::gelu::gelu(x);
    }
    let _ = kernels;
    activation::gelu(x)
}

/// Burn's `Dropout` module applied to `x`, as its `forward` decides (only
/// while training, on an autodiff device, with a probability above 0): on
/// flex with the fused kernels, kiln's dropout in one pass, its mask a
/// counter-based hash of a seed drawn from the device's generator (so a
/// run's masks are as reproducible as Burn's) and of each element's index,
/// made again in the backward pass rather than kept; elsewhere Burn's
/// (a Bernoulli draw per element, then two products).
pub fn dropout<const D: usize>(module: &Dropout, x: Tensor<D>, kernels: Kernels) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if kernels == Kernels::Fused
        && module.prob > 0.0
        && module.training.is_enabled()
        && x.device().is_autodiff()
        && flex::runs_fused(&x)
    {
        let seed = draw_seed(&x.device());
        return flex::dropout(x, seed, 1.0 - module.prob);
    }
    let _ = kernels;
    module.forward(x)
}

/// [`dropout`] of probability `p` (in training) as a function of the
/// tensor: what the compositions apply to attention's probabilities.
pub(crate) fn dropout_with<const D: usize>(
    p: f64,
    kernels: Kernels,
) -> impl Fn(Tensor<D>) -> Tensor<D> {
    let module = burn::nn::DropoutConfig::new(p).init();
    move |x| dropout(&module, x, kernels)
}

/// A dropout mask's seed for flex's dropout kernel: [`MaskSeed::draw`],
/// read back.
#[cfg(feature = "flex")]
fn draw_seed(device: &burn::tensor::Device) -> u64 {
    MaskSeed::draw(device).on_host()
}

/// A dropout mask's seed ([`dropout_keeps`]), where it is.
// (A value moved once a layer from where it is drawn to where it is used:
// the tensor's size does not call for a box.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum MaskSeed {
    /// Known on the host (the kernel checks' fixed seeds).
    #[cfg_attr(not(any(feature = "flex", feature = "cube")), allow(dead_code))]
    Host(u64),
    /// Two uniform f32 of a device's generator where they were drawn
    /// ([`MaskSeed::draw`]): their bits are the seed's high and low
    /// halves.
    #[cfg_attr(not(any(feature = "flex", feature = "cube")), allow(dead_code))]
    Drawn(Tensor<1>),
}

impl MaskSeed {
    /// Two uniform f32 draws of `device`'s generator, which the loop seeds
    /// each step, so that a run's masks are as reproducible as Burn's:
    /// about 46 random bits (their mantissas). Left on the device: nothing
    /// waits for it (a GPU's kernels read it there, [`MaskSeed::on_device`];
    /// reading it back, once a layer and step, was a wait for the device).
    #[cfg(any(feature = "flex", feature = "cube"))]
    fn draw(device: &burn::tensor::Device) -> Self {
        let draw = burn::tensor::Distribution::Default;
        Self::Drawn(Tensor::random(
            [2],
            draw,
            &device.clone().without_autodiff(),
        ))
    }

    /// The seed as a number: a drawn one read back from its device (which
    /// waits for the device: flex's kernels, whose device is the host).
    #[cfg(feature = "flex")]
    fn on_host(self) -> u64 {
        match self {
            Self::Host(seed) => seed,
            Self::Drawn(words) => words
                .into_data()
                .try_into_vec::<f32>()
                .unwrap_or_default()
                .iter()
                .fold(0u64, |s, b| (s << 32) | u64::from(b.to_bits())),
        }
    }

    /// The seed as the CubeCL kernels read it: two f32 on `device` whose
    /// bits are its high and low halves (a host seed is uploaded, which
    /// waits for nothing).
    #[cfg(feature = "cube")]
    pub(crate) fn on_device(self, device: &burn::tensor::Device) -> Tensor<1> {
        match self {
            Self::Host(seed) => {
                let words = vec![
                    f32::from_bits((seed >> 32) as u32),
                    f32::from_bits(seed as u32),
                ];
                Tensor::from_data(
                    burn::tensor::TensorData::new(words, [2]),
                    &device.clone().without_autodiff(),
                )
            }
            Self::Drawn(words) => words,
        }
    }
}

/// Whether [`gelu`] runs kiln's kernel for a tensor on `x`'s device in
/// any float dtype (f32, bf16, f16): the CubeCL GPUs' kernel (not under
/// `fusion`); flex's takes f32 alone.
pub(crate) fn gelu_runs_in_any_float<const D: usize>(x: &Tensor<D>, kernels: Kernels) -> bool {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused && cube::gelu::runs(x) {
        return true;
    }
    let _ = (x, kernels);
    false
}

/// Multi-head self-attention of a packed projection `qkv` (`[batch, time,
/// 3·d]`: queries, keys and values side by side, each `heads` heads of
/// `d / heads`), scale `1/√head_dim`, heads merged in the result
/// (`[batch, time, d]`). `key_pad` (`[batch, time]`, true where a key is
/// padding) and `causal` (query `i` sees keys `≤ i`) mask keys. The fused
/// kernel reads the heads where they lie in `qkv`, keeps one head's
/// `time × time` scores at a time (fewer: no key after a batch entry's last
/// that is not padding, and with `causal` no row block's keys past its
/// end, is computed at all), rebuilds them in the backward pass and
/// writes the gradient of `qkv` in one piece; the reference (`Math`)
/// splits the heads and runs Burn's `attention` with the mask expanded to
/// `[batch, heads, time, time]`. `attention` picks among them
/// ([`AttentionKernel`]).
pub fn self_attention(
    qkv: Tensor<3>,
    heads: usize,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    attention: AttentionKernel,
) -> Tensor<3> {
    attention_with(qkv, heads, key_pad, causal, attention, None)
}

/// [`self_attention`] with dropout of probability `dropout` on the
/// attention probabilities (BERT's `attention_probs_dropout_prob`,
/// nanoGPT's `attn_dropout`) on an autodiff device; the caller gives 0
/// where its model does not train. Where [`self_attention`] runs a kiln
/// kernel (flex's fused one; CubeCL's scalar and matrix-unit ones on a
/// GPU), the kernel drops them out, its mask a counter-based hash of a
/// seed drawn from the device's generator and of each probability's place
/// ([`dropout_keeps`], the same on every device), made again in the
/// backward pass rather than kept, as FlashAttention does; where Burn's
/// attention runs it runs the composition with the probabilities dropped
/// out ([`dropout`] on them with `kernels`), which keeps the
/// `heads × T × T` scores, as it does without dropout.
pub fn self_attention_with_dropout(
    qkv: Tensor<3>,
    heads: usize,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    attention: AttentionKernel,
    dropout: f64,
    kernels: Kernels,
) -> Tensor<3> {
    if dropout <= 0.0 || !qkv.device().is_autodiff() {
        return self_attention(qkv, heads, key_pad, causal, attention);
    }
    #[cfg(any(feature = "flex", feature = "cube"))]
    if kernel_route(&qkv, heads, attention) != AttentionRoute::Burn {
        let seed = MaskSeed::draw(&qkv.device());
        let drop = Some((seed, 1.0 - dropout));
        return attention_with(qkv, heads, key_pad, causal, attention, drop);
    }
    let [q, k, v] = split_heads(qkv, heads);
    let dropped = dropout_with(dropout, kernels);
    crate::precision::attend(q, k, v, key_pad, causal, crate::ComputeDtype::F32, dropped)
}

/// [`self_attention`], the probabilities dropped out with `dropout` (the
/// mask's seed, and the probability of keeping each) where a kiln kernel
/// runs (where Burn's attention runs, `dropout` is not looked at).
pub(crate) fn attention_with(
    qkv: Tensor<3>,
    heads: usize,
    key_pad: Option<Tensor<2, Bool>>,
    causal: bool,
    attention: AttentionKernel,
    dropout: Option<(MaskSeed, f64)>,
) -> Tensor<3> {
    let spec = |dropout| AttentionSpec {
        heads,
        causal,
        matrix_unit: attention != AttentionKernel::MemoryEfficient,
        dropout,
    };
    // (Whether CubeCL's kernels take the matrix unit is theirs to decide,
    // from `spec`, at each launch: not asked here as well.)
    let route = kernel_route(&qkv, heads, attention);
    #[cfg(feature = "flex")]
    if route == AttentionRoute::Flex {
        // The seed on the host (read back: flex's device is the host).
        let drop = dropout.map(|(seed, keep)| ProbsDropout {
            seed: seed.on_host(),
            keep,
        });
        return flex::self_attention(qkv, key_pad, spec(drop));
    }
    #[cfg(feature = "cube")]
    if route == AttentionRoute::Scalar {
        // The seed stays on the device: the kernels read it there.
        let device = qkv.device();
        let (drop, seed) = match dropout {
            Some((seed, keep)) => (
                Some(ProbsDropout { seed: 0, keep }),
                Some(seed.on_device(&device)),
            ),
            None => (None, None),
        };
        return cube::attention::self_attention(qkv, key_pad, seed, spec(drop));
    }
    let _ = (spec, route, dropout);
    let [q, k, v] = split_heads(qkv, heads);
    let [b, h, t, hd] = q.dims();
    let mask = key_pad.map(|pad| pad.reshape([b, 1, 1, t]).expand([b, h, t, t]));
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: causal,
    };
    burn_attention(q, k, v, mask, None, options)
        .swap_dims(1, 2)
        .reshape([b, t, h * hd])
}

/// Which implementation [`self_attention`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionRoute {
    /// flex's fused kernel (f32 on the CPU).
    Flex,
    /// FlashAttention-2 on the matrix unit (`cube/flash_attention.rs`).
    MatrixUnit,
    /// FlashAttention-2 with its scores in the warps' registers
    /// (`cube/flash_mma.rs`): where `FLASH_MMA` asks for its forward on
    /// CUDA.
    Registers,
    /// kiln's memory-efficient CubeCL kernels without the matrix unit.
    Scalar,
    /// Burn's composition, which keeps the `heads × T × T` scores.
    Burn,
}

impl AttentionRoute {
    /// The route in words.
    pub fn describe(self) -> &'static str {
        match self {
            AttentionRoute::Flex => "kiln's fused kernel on flex",
            AttentionRoute::MatrixUnit => "FlashAttention-2 on the matrix unit",
            AttentionRoute::Registers => {
                "FlashAttention-2 on the matrix unit, its scores in registers (FLASH_MMA)"
            }
            AttentionRoute::Scalar => "kiln's memory-efficient scalar kernels",
            AttentionRoute::Burn => "Burn's composition, which keeps the scores",
        }
    }
}

/// Which implementation [`self_attention`] runs for `qkv` (its device,
/// dtype and heads' width) when `attention` is asked for: the one rule it
/// follows.
pub fn attention_route(
    qkv: &Tensor<3>,
    heads: usize,
    attention: AttentionKernel,
) -> AttentionRoute {
    let route = kernel_route(qkv, heads, attention);
    let head_dim = qkv.dims()[2] / 3 / heads.max(1);
    if route == AttentionRoute::Scalar
        && attention != AttentionKernel::MemoryEfficient
        && attention_on_tensor_cores(&qkv.device(), qkv.dtype(), head_dim)
    {
        #[cfg(feature = "cube")]
        if cube::attention::in_registers(&qkv.device(), qkv.dtype(), head_dim) {
            return AttentionRoute::Registers;
        }
        AttentionRoute::MatrixUnit
    } else {
        route
    }
}

/// [`attention_route`] without telling the CubeCL kernels apart: `Flex`,
/// `Scalar` for either of CubeCL's (which one runs the kernels decide at
/// their launch), or `Burn`. What [`self_attention`] asks on every call.
fn kernel_route(qkv: &Tensor<3>, heads: usize, attention: AttentionKernel) -> AttentionRoute {
    #[cfg(feature = "flex")]
    if attention != AttentionKernel::Math && flex::runs_fused(qkv) {
        return AttentionRoute::Flex;
    }
    let head_dim = qkv.dims()[2] / 3 / heads.max(1);
    if memory_efficient_attention_runs(qkv, qkv.dtype(), head_dim, attention) {
        AttentionRoute::Scalar
    } else {
        AttentionRoute::Burn
    }
}

/// Whether [`self_attention`] (forward and backward) in `dtype`, heads
/// `head_dim` wide, runs on `device`'s matrix unit (tensor cores, cooperative
/// matrices) with [`AttentionKernel::Auto`] or `Flash`: f16 or bf16 on a
/// CubeCL GPU with an instruction for it (`cube/flash_attention.rs`).
pub fn attention_on_tensor_cores(
    device: &burn::tensor::Device,
    dtype: burn::tensor::DType,
    head_dim: usize,
) -> bool {
    #[cfg(feature = "cube")]
    return cube::attention::on_tensor_cores(device, dtype, head_dim);
    #[cfg(not(feature = "cube"))]
    {
        let _ = (device, dtype, head_dim);
        false
    }
}

/// Whether [`self_attention`] runs the memory-efficient CubeCL kernels for
/// `qkv` (wgpu or CUDA, with or without Burn's `fusion`; f32/bf16/f16;
/// any choice but `Math`, and `Auto` only where [`auto_runs_kernels`]) in
/// `dtype` with heads `head_dim` wide: then a reduced compute dtype runs
/// them in that dtype too.
pub(crate) fn memory_efficient_attention_runs(
    qkv: &Tensor<3>,
    dtype: burn::tensor::DType,
    head_dim: usize,
    attention: AttentionKernel,
) -> bool {
    #[cfg(feature = "cube")]
    return attention != AttentionKernel::Math
        && cube::attention::runs(qkv)
        && (attention != AttentionKernel::Auto
            || auto_runs_kernels(&qkv.device(), dtype, head_dim));
    #[cfg(not(feature = "cube"))]
    {
        let _ = (qkv, dtype, head_dim, attention);
        false
    }
}

/// Whether `optimization.attention = "auto"` runs kiln's CubeCL attention
/// on `device` in `dtype` with heads `head_dim` wide. Everywhere but on
/// CUDA; there only where it runs on the matrix unit (FlashAttention-2 in
/// bf16/f16), not on the scalar kernels, for speed: on an H200 (2026-12-04)
/// GPT-2 small's bf16 step with them was 2.3× as long as with Burn's
/// compositions (`optimization.kernels=reference`: 12,647 against 29,258
/// tokens/s), which keep the `heads × T × T` scores instead (34.9 against
/// 8.8 GiB there). They are
/// right there: the second check that day passed them in `kiln
/// check-kernels` and in 20 training steps in f32 (2.6e-6 off flex's loss;
/// the first had found rows CUDA had padded written as contiguous, fixed in
/// `cube::cube_empty`). `memory-efficient` runs them where the scores do
/// not fit.
pub fn auto_runs_kernels(
    device: &burn::tensor::Device,
    dtype: burn::tensor::DType,
    head_dim: usize,
) -> bool {
    !is_cuda(device) || attention_on_tensor_cores(device, dtype, head_dim)
}

/// Whether `device` is a CUDA GPU.
fn is_cuda(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cube")]
    {
        matches!(
            crate::device_memory::cube_gpu_device(device),
            Some(cubecl::Device::Cuda(_))
        )
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether the models' self-attention keeps the `heads × T × T` scores for
/// the backward pass on `device` with compute dtype `dtype`: Burn's
/// attention (`Math`, other backends) and the
/// reduced-precision composition on the CPU do; flex's kernel (f32) and the
/// memory-efficient CubeCL kernels (wgpu, CUDA; any of the three dtypes)
/// keep one log-sum-exp per query and head, with dropout on the
/// probabilities too (a training step's `model.attention_dropout`:
/// [`self_attention_with_dropout`]). What memory estimates count.
pub fn attention_keeps_scores(
    device: &burn::tensor::Device,
    dtype: crate::ComputeDtype,
    attention: AttentionKernel,
) -> bool {
    #[cfg(any(feature = "flex", feature = "cube"))]
    use burn::backend::DispatchDevice;
    if attention == AttentionKernel::Math {
        return true;
    }
    // `auto` on CUDA runs the kernels on the matrix unit only (bf16, f16:
    // assumed here, the heads' width unknown) and Burn's attention in f32.
    if attention == AttentionKernel::Auto && is_cuda(device) && !dtype.is_reduced() {
        return true;
    }
    match device.clone().inner().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => dtype.is_reduced(),
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(d) if cube_gpu(d) => false,
        #[allow(unreachable_patterns)]
        _ => {
            let _ = dtype;
            true
        }
    }
}

/// Queries, keys and values of a packed `[batch, time, 3·d]` projection as
/// `[batch, heads, time, d / heads]` views.
pub fn split_heads(qkv: Tensor<3>, heads: usize) -> [Tensor<4>; 3] {
    let [b, t, three_d] = qkv.dims();
    let d = three_d / 3;
    [0, 1, 2].map(|part| {
        qkv.clone()
            .narrow(2, part * d, d)
            .reshape([b, t, heads, d / heads])
            .swap_dims(1, 2)
    })
}

/// `layer`'s linear map of `x` (`x · weight + bias` over the last
/// dimension). On flex the fused kernel runs one gemm over all rows with
/// the bias accumulated in, and its backward one gemm per gradient and
/// parallel column sums for the bias; it needs a bias. Elsewhere one
/// product over all rows (`rows_product`) and the bias by [`add_bias`]
/// (on a CubeCL GPU kiln's column sums for its gradient). The reference is
/// that product and Burn's broadcast addition.
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>, kernels: Kernels) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if kernels == Kernels::Fused
        && flex::runs_fused(&x)
        && let Some(bias) = &layer.bias
    {
        return flex::linear(x, layer.weight.val(), bias.val());
    }
    let product = rows_product(x, layer.weight.val(), kernels);
    match &layer.bias {
        Some(bias) => add_bias(product, bias.val(), kernels),
        None => product,
    }
}

/// `x · weight` over `x`'s last dimension as one matrix product of all
/// its rows (`[rows, in] · [in, out]`), as PyTorch's `linear` folds the
/// leading dimensions: its weight gradient is then one product `xᵀ · grad`
/// over all the rows. Burn's `linear` on its dispatch backend keeps a
/// batched product instead where the rows a batch entry fill its tiles
/// (GPT-2 small's 1,024), the weight broadcast over the batch: its
/// backward computes a weight gradient per batch entry (`[batch, in, out]`
/// in f32, 16 × 768 × 3,072 for GPT-2 small's MLP) and then sums them, a
/// product and a reduction per linear layer and micro-batch that this
/// avoids.
///
/// With `Fused` and [`GpuMatmul::Cublas`] chosen, the product (and its
/// gradients) runs in cuBLAS where it can (bf16, f16 or f32 on a CUDA GPU;
/// `cube::cublas`).
pub(crate) fn rows_product<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    kernels: Kernels,
) -> Tensor<D> {
    let mut dims = x.dims();
    let width = dims[D - 1];
    let rows = dims.iter().product::<usize>() / width.max(1);
    dims[D - 1] = weight.dims()[1];
    let x = x.reshape([rows, width]);
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    if kernels == Kernels::Fused
        && gpu_matmul() == GpuMatmul::Cublas
        && cube::cublas::runs(&x, &weight)
    {
        return cube::cublas::matmul(x, weight).reshape(dims);
    }
    let _ = kernels;
    x.matmul(weight).reshape(dims)
}

/// Which library runs the linear layers' matrix products on a CUDA GPU
/// (`optimization.matmul`): one choice for the process, as the products
/// are deep inside the models. Elsewhere Burn's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuMatmul {
    /// Burn's (CubeCL's autotuned kernels).
    #[default]
    Burn,
    /// NVIDIA's cuBLAS (`cublasGemmEx`, f32 sums) in bf16, f16 and f32
    /// (TF32 as [`set_tf32`] says), forward and backward; see
    /// [`cublas_unavailable`].
    Cublas,
}

static GPU_MATMUL_CUBLAS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets [`GpuMatmul`] for this process (kiln-train does, as a run opens
/// its device).
pub fn set_gpu_matmul(choice: GpuMatmul) {
    GPU_MATMUL_CUBLAS.store(
        choice == GpuMatmul::Cublas,
        std::sync::atomic::Ordering::Relaxed,
    );
}

static TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether cuBLAS's f32 products (with [`GpuMatmul::Cublas`]) may round
/// their inputs to TF32 on the tensor cores (`precision.tf32`, PyTorch's
/// `allow_tf32`): kiln-train sets it with the matmul choice. Off, they
/// are f32's (`CUBLAS_COMPUTE_32F`). Burn's own f32 products are
/// CubeCL's autotune's to choose, whatever this says.
pub fn set_tf32(allowed: bool) {
    TF32.store(allowed, std::sync::atomic::Ordering::Relaxed);
}

/// [`set_tf32`]'s setting.
pub fn tf32() -> bool {
    TF32.load(std::sync::atomic::Ordering::Relaxed)
}

/// The [`GpuMatmul`] this process runs.
pub fn gpu_matmul() -> GpuMatmul {
    if GPU_MATMUL_CUBLAS.load(std::sync::atomic::Ordering::Relaxed) {
        GpuMatmul::Cublas
    } else {
        GpuMatmul::Burn
    }
}

static CUBLAS_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static CUBLAS_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static CUBLAS_TIMING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether cuBLAS's products are timed on the device from now on: each is
/// queued between two CUDA events, read by [`cublas_time`]. What `kiln
/// bench --kernel-profile` turns on for its window (cuBLAS's kernels are
/// no CubeCL launches, which CubeCL times); off otherwise, so that a
/// product costs no events.
pub fn cublas_timing(on: bool) {
    CUBLAS_TIMING.store(on, std::sync::atomic::Ordering::Relaxed);
}

#[cfg_attr(
    not(all(feature = "cuda", not(feature = "fusion"))),
    allow(dead_code, reason = "the cuBLAS products ask it")
)]
pub(crate) fn cublas_timing_on() -> bool {
    CUBLAS_TIMING.load(std::sync::atomic::Ordering::Relaxed)
}

/// cuBLAS's products this process has timed ([`cublas_timing`]) and their
/// device time, between the CUDA events queued around each on its stream.
/// Waits for the products not read yet.
pub fn cublas_time() -> (u64, std::time::Duration) {
    use std::sync::atomic::Ordering;
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    cube::cublas::settle_timings();
    (
        CUBLAS_CALLS.load(Ordering::Relaxed),
        std::time::Duration::from_nanos(CUBLAS_NANOS.load(Ordering::Relaxed)),
    )
}

/// Counts one cuBLAS product that took `elapsed` ([`cublas_time`]).
#[cfg_attr(
    not(all(feature = "cuda", not(feature = "fusion"))),
    allow(dead_code, reason = "the cuBLAS products count themselves")
)]
pub(crate) fn record_cublas(elapsed: std::time::Duration) {
    use std::sync::atomic::Ordering;
    CUBLAS_CALLS.fetch_add(1, Ordering::Relaxed);
    let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
    CUBLAS_NANOS.fetch_add(nanos, Ordering::Relaxed);
}

/// A tensor's buffer on a CUDA device, as [`with_cuda_buffer`] lends it:
/// where its values are, how many, their type, and the stream the
/// tensor's work is queued on.
#[derive(Clone, Copy, Debug)]
pub struct CudaBuffer {
    /// The device address of the first value (a `CUdeviceptr`).
    pub ptr: u64,
    /// How many values, contiguous from `ptr`.
    pub len: usize,
    /// Their type.
    pub dtype: burn::tensor::DType,
    /// The CUDA stream (`CUstream`) that this thread's work on the tensor
    /// is queued on: work queued there after the call reads what a library
    /// queued on it (or made it wait for) during the call.
    pub stream: *mut std::ffi::c_void,
    /// The CUDA device's ordinal.
    pub ordinal: usize,
}

/// Whether [`with_cuda_buffer`] lends the buffers of tensors on `device`:
/// a CUDA GPU, in a build with CUDA and not under Burn's `fusion`.
pub fn lends_cuda_buffers(device: &burn::tensor::Device) -> bool {
    cfg!(all(feature = "cuda", not(feature = "fusion"))) && is_cuda(device)
}

/// Calls `f` with `t`'s buffer on its CUDA device, for a library that
/// reads or writes it in place on the device (NCCL's all-reduce of a
/// data-parallel job's gradients): `t` made contiguous, and copied first
/// where another tensor shares its buffer. Returns the tensor, holding
/// whatever `f` queued into it, and `f`'s result; `t` unchanged and
/// `None`, `f` not called, where `t` is not on a CUDA device, or in a build
/// without CUDA or under Burn's `fusion` ([`lends_cuda_buffers`]). `t` must
/// be a tensor without autodiff (a gradient, say).
///
/// What `f` queues must run on `buffer.stream`, or on a stream ordered
/// after its work so far and before its next (events), and must be done
/// with the memory before that next work: CubeCL frees and reuses memory
/// in that stream's order.
pub fn with_cuda_buffer<R>(
    t: Tensor<1>,
    f: impl FnOnce(&CudaBuffer) -> R,
) -> (Tensor<1>, Option<R>) {
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    {
        cube::cuda_buffer::with_buffer(t, f)
    }
    #[cfg(not(all(feature = "cuda", not(feature = "fusion"))))]
    {
        let _ = f;
        (t, None)
    }
}

/// Why [`GpuMatmul::Cublas`] cannot run on `device`, or `None` where it
/// can: a CUDA GPU in a build with CUDA (not under Burn's `fusion`), and
/// cuBLAS's library found on the loader's path.
pub fn cublas_unavailable(device: &burn::tensor::Device) -> Option<String> {
    #[cfg(all(feature = "cuda", not(feature = "fusion")))]
    {
        cube::cublas::unavailable(device)
    }
    #[cfg(all(feature = "cuda", feature = "fusion"))]
    {
        let _ = device;
        Some("cuBLAS's products are not built under Burn's `fusion`".into())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Some("this kiln is built without CUDA".into())
    }
}

/// The token embeddings of `ids` (`[batch, time]`): `table`'s rows. On a
/// CubeCL GPU with `Fused` (not under Burn's `fusion`) the table's
/// gradient is kiln's kernel (`cube::embedding`: the ids sorted on the
/// host, a unit a column of a table row summing its tokens in order);
/// elsewhere, and with `Reference`, Burn's embedding, whose gradient on
/// CubeCL is its `select_assign` (one unit a column looping over every
/// token). The same rows forward.
pub fn token_embeddings(
    table: &burn::nn::Embedding,
    ids: Tensor<2, Int>,
    kernels: Kernels,
) -> Tensor<3> {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused {
        let weight = table.weight.val();
        if cube::embedding::runs(&weight) {
            return cube::embedding::embedding(weight, ids);
        }
    }
    let _ = kernels;
    table.forward(ids)
}

/// The position embeddings of `batch` sequences of `t` positions from
/// `start` (`table`'s rows `start..start + t`, `[batch, t, width]`). On a
/// CubeCL GPU with `Fused` the rows are sliced and broadcast over the
/// batch, so that their gradient is a sum over the batch (`[batch, t,
/// width]` to `[t, width]`: many short sums side by side). Elsewhere, and
/// with `Reference`, Burn's embedding of the positions, whose gradient on
/// CubeCL is its `select_assign`: one unit a column looping over every
/// token (4.8 ms a launch for GPT-2 small's 16,384 tokens on an H200, the
/// 2026-12-04 profile's `SelectAssignKernel`, with the token embedding's).
/// The same rows either way.
pub fn position_embeddings(
    table: &burn::nn::Embedding,
    batch: usize,
    start: usize,
    t: usize,
    kernels: Kernels,
) -> Tensor<3> {
    let weight = table.weight.val();
    #[cfg(feature = "cube")]
    if kernels == Kernels::Fused && cube::cube_gpu_float(&weight) {
        let width = weight.dims()[1];
        return weight
            .narrow(0, start, t)
            .unsqueeze_dim::<3>(0)
            .expand([batch, t, width]);
    }
    let _ = kernels;
    let pos = Tensor::<1, Int>::arange(start as i64..(start + t) as i64, &weight.device())
        .reshape([1, t])
        .expand([batch, t]);
    table.forward(pos)
}

/// `x + bias`, `bias` along `x`'s last dimension (a linear layer's). With
/// `Fused` on a CubeCL GPU the bias's gradient (the column sums of `x`'s) is kiln's
/// column-sum kernel (`cube::bias`): Burn sums a broadcast dimension at a
/// time, and over the rows of `[rows, width]` its reduction took 46 % of a
/// GPT-2 small step on an H200 in the 2026-12-04 GPU check, 1.35 ms a
/// launch where the data takes microseconds to read. Under Burn's
/// `fusion` the rows are viewed as `[chunks, rows per chunk, width]` for
/// the addition instead, so that Burn sums them in two stages that each
/// have many sums to run side by side. The result is the same sum in
/// another order. Elsewhere, and with `Reference`, the plain broadcast.
pub fn add_bias<const D: usize>(x: Tensor<D>, bias: Tensor<1>, kernels: Kernels) -> Tensor<D> {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused && cube::bias::runs(&x, &bias) {
        return cube::bias::add_bias(x, bias);
    }
    #[cfg(all(feature = "cube", feature = "fusion"))]
    if kernels == Kernels::Fused && cube::cube_gpu_float(&x) {
        let dims = x.dims();
        let width = dims[D - 1];
        let rows = dims.iter().product::<usize>() / width.max(1);
        if let Some(chunk) = row_chunk(rows) {
            let chunks = x.reshape([rows / chunk, chunk, width]);
            return (chunks + bias.reshape([1, 1, width])).reshape(dims);
        }
    }
    let _ = kernels;
    x + bias.unsqueeze()
}

/// Rows per chunk for a two-stage sum over `rows` rows ([`add_bias`] under
/// Burn's `fusion`): the largest divisor of `rows` at most √rows, where it
/// is at least 8 (16,384 rows: 128 chunks of 128); `None` where there is
/// none (a prime number of rows), for one stage.
#[cfg(any(all(feature = "cube", feature = "fusion"), all(test, feature = "flex")))]
pub(crate) fn row_chunk(rows: usize) -> Option<usize> {
    let mut chunk = (rows as f64).sqrt() as usize;
    while chunk >= 8 {
        if rows.is_multiple_of(chunk) {
            return Some(chunk);
        }
        chunk -= 1;
    }
    None
}

/// What [`mask_padding`] adds to a padding id's logit: `exp` of it is 0 in
/// f32, and it stays finite (no `inf − inf` anywhere).
pub(crate) const PADDING_LOGIT: f32 = -1e30;

/// What the logits of a `padded` vocabulary get added: 0 for the true
/// `vocab`, [`PADDING_LOGIT`] for the padding.
pub(crate) fn padding_bias(vocab: usize, padded: usize) -> Vec<f32> {
    (0..padded)
        .map(|i| if i < vocab { 0.0 } else { PADDING_LOGIT })
        .collect()
}

/// `logits [b, t, padded]` with the columns from `vocab` on pushed to
/// [`PADDING_LOGIT`]: one broadcast addition, whose gradient passes
/// through unchanged (and is 0 there, the softmax being 0).
fn mask_padding(logits: Tensor<3>, vocab: usize) -> Tensor<3> {
    use burn::tensor::TensorData;
    let padded = logits.dims()[2];
    if padded == vocab {
        return logits;
    }
    let bias = TensorData::new(padding_bias(vocab, padded), [1, 1, padded]);
    let bias = Tensor::<3>::from_data(bias, &logits.device());
    logits + bias
}

/// The language model's head and its mean cross-entropy: the logits
/// `x · weightᵀ` (`x`: `[batch, time, hidden]`, `weight`: the tied token
/// embedding, `[padded, hidden]`; the product in `compute`, the softmax in
/// f32) against `targets` (`[batch, time]`), the logits from `vocab` on
/// (a padded vocabulary's) masked out.
///
/// The fused version (flex; CubeCL GPUs, with or without Burn's `fusion`)
/// never makes the logits of all tokens: chunks of tokens, each's loss and
/// (under autodiff) its gradients at once, so a step keeps
/// `tokens × hidden` and `padded × hidden` floats for the backward pass
/// instead of several `tokens × padded` ones (`lm_loss`). The reference is
/// the composition: the product, the mask, `log_softmax` and `gather`.
pub fn lm_head_loss(
    x: Tensor<3>,
    weight: Tensor<2>,
    targets: Tensor<2, Int>,
    head: LmHead,
    kernels: Kernels,
) -> Tensor<1> {
    lm_head_losses(x, weight, targets, head, kernels, None, false)
}

/// What [`lm_head_loss`] needs besides its tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LmHead {
    /// The true vocabulary: the weight's rows from it on are padding.
    pub vocab: usize,
    /// The dtype of the product (the softmax is f32 whatever it is).
    pub compute: crate::ComputeDtype,
    /// Label smoothing ε over the true vocabulary (0: none).
    pub smoothing: f64,
}

/// [`lm_head_loss`] (the mean, `[1]`) or with `each_token` each token's
/// loss (`[batch × time]`, `head.smoothing` ignored), the fused version's
/// rows per chunk chosen (`None`: [`LM_HEAD_CHUNK_ELEMENTS`] logits a
/// chunk).
fn lm_head_losses(
    x: Tensor<3>,
    weight: Tensor<2>,
    targets: Tensor<2, Int>,
    head: LmHead,
    kernels: Kernels,
    chunk: Option<usize>,
    each_token: bool,
) -> Tensor<1> {
    let LmHead {
        vocab,
        compute,
        smoothing,
    } = head;
    let smoothing = if each_token { 0.0 } else { smoothing };
    let [b, t, d] = x.dims();
    #[cfg(any(feature = "flex", feature = "cube"))]
    if kernels == Kernels::Fused && lm_head_loss_fused_here(&x) {
        let shape = lm_loss::LmLossShape {
            vocab,
            compute: compute.float_dtype(),
            chunk: chunk.unwrap_or((LM_HEAD_CHUNK_ELEMENTS / weight.dims()[0].max(1)).max(1)),
            smoothing,
        };
        return lm_loss::lm_loss(
            x.reshape([b * t, d]),
            weight,
            targets.reshape([b * t]),
            shape,
            each_token,
        );
    }
    let _ = (kernels, chunk);
    let logits = crate::precision::matmul(x.reshape([b * t, d]), weight.transpose(), compute);
    let logits = mask_padding(logits.reshape([b as i64, t as i64, -1]), vocab);
    if each_token {
        activation::log_softmax(logits, 2)
            .gather(2, targets.reshape([b, t, 1]))
            .reshape([b * t])
            .neg()
    } else {
        crate::gpt::smoothed_cross_entropy(logits, targets, vocab, smoothing)
    }
}

/// Each token's cross-entropy `[batch, time]` (f32) of the logits `x ·
/// weightᵀ` (the padding's masked) against `targets`: [`lm_head_loss`]
/// before its mean, without label smoothing or a gradient, for scoring a
/// text token by token. Fused where [`lm_head_loss`] is (in chunks of
/// rows, no `tokens × vocabulary` tensor at once), else the composition.
pub fn lm_head_token_losses(
    x: Tensor<3>,
    weight: Tensor<2>,
    targets: Tensor<2, Int>,
    head: LmHead,
    kernels: Kernels,
) -> Tensor<2> {
    let [b, t, _] = x.dims();
    lm_head_losses(x, weight, targets, head, kernels, None, true).reshape([b, t])
}

/// Whether [`lm_head_loss`] runs the fused version for `x`: flex, or a
/// CubeCL GPU, in f32.
fn lm_head_loss_fused_here(x: &Tensor<3>) -> bool {
    #[cfg(feature = "flex")]
    if flex::runs_fused(x) {
        return true;
    }
    #[cfg(feature = "cube")]
    if cube_gpu_float(x) && x.dtype() == burn::tensor::DType::F32 {
        return true;
    }
    let _ = x;
    false
}

/// Logits of one chunk of [`lm_head_loss`]'s fused version (128 MiB in
/// f32): few enough chunks for a GPU's products to stay large, small
/// enough to be no memory concern.
pub const LM_HEAD_CHUNK_ELEMENTS: usize = 1 << 25;

/// Whether [`lm_head_loss`] keeps every token's logits for the backward
/// pass on `device` (the composition: `Reference`, other backends), or
/// goes through them in chunks of [`LM_HEAD_CHUNK_ELEMENTS`] (flex and the
/// CubeCL GPUs). What memory estimates count.
pub fn lm_head_keeps_logits(device: &burn::tensor::Device, kernels: Kernels) -> bool {
    #[cfg(any(feature = "flex", feature = "cube"))]
    use burn::backend::DispatchDevice;
    if kernels == Kernels::Reference {
        return true;
    }
    match device.clone().inner().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => false,
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(d) if cube_gpu(d) => false,
        #[allow(unreachable_patterns)]
        _ => true,
    }
}

/// The epsilon of kiln's LayerNorms (Burn's, PyTorch's and GPT-2's
/// default): the GPT's always, the encoder's unless its config says
/// otherwise ([`layer_norm_with`]).
pub const LAYER_NORM_EPSILON: f64 = 1e-5;

/// `ln`'s LayerNorm of `x` over the last dimension. The fused kernel (one
/// pass per row forward, one backward, row statistics kept in between)
/// needs a bias and `ln` built with [`LAYER_NORM_EPSILON`]; the reference
/// is `ln.forward(x)`.
pub fn layer_norm<const D: usize>(ln: &LayerNorm, x: Tensor<D>, kernels: Kernels) -> Tensor<D> {
    layer_norm_with(ln, x, LAYER_NORM_EPSILON, kernels)
}

/// [`layer_norm`] for `ln` built with another `epsilon` (BERT's 1e-12):
/// the fused kernel takes it from here, since Burn's `LayerNorm` keeps its
/// own private.
pub fn layer_norm_with<const D: usize>(
    ln: &LayerNorm,
    x: Tensor<D>,
    epsilon: f64,
    kernels: Kernels,
) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if kernels == Kernels::Fused
        && flex::runs_fused(&x)
        && let Some(beta) = &ln.beta
    {
        return flex::layer_norm(x, ln.gamma.val(), beta.val(), epsilon);
    }
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    if kernels == Kernels::Fused
        && let Some(beta) = &ln.beta
        && cube::layer_norm::runs(&x, &ln.gamma.val(), &beta.val())
    {
        return cube::layer_norm::layer_norm(x, ln.gamma.val(), beta.val(), epsilon);
    }
    let _ = (kernels, epsilon);
    ln.forward(x)
}

#[cfg(feature = "flex")]
mod flex {
    //! The extension trait, its flex and autodiff implementations, and the
    //! routing from `Tensor` to them.

    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::ops::{Backward, OpsKind};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{
        Autodiff, AutodiffBackend, Backend, Dispatch, DispatchDevice, Flex, backend_extension,
    };
    use burn::tensor::{Bool, DType, Tensor};

    use super::autodiff::{self, KernelBackward, Three, lift3};
    use super::{AttentionSpec, cpu};

    /// kiln's fused operations as a Burn backend extension.
    #[backend_extension(Flex, Autodiff)]
    pub(crate) trait KilnKernels: Backend {
        fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
        fn kiln_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        /// Dropout with the mask `seed` draws (`cpu::dropout`); its own
        /// backward.
        fn kiln_dropout(x: FloatTensor<Self>, seed: u64, keep: f64) -> FloatTensor<Self>;
        /// Attention's output and each query's log-sum-exp (see
        /// `cpu::attention`).
        fn kiln_attention(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
        ) -> (FloatTensor<Self>, FloatTensor<Self>);
        /// The gradient of the packed qkv.
        fn kiln_attention_backward(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        /// A linear layer's output.
        fn kiln_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        /// The gradients of x, the weight and the bias.
        fn kiln_linear_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
        /// LayerNorm's output and each row's mean and 1/σ.
        fn kiln_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
        /// The gradients of x, gamma and beta.
        fn kiln_layer_norm_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            mean: FloatTensor<Self>,
            rstd: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    }

    impl KilnKernels for Flex {
        fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
            cpu::gelu(x)
        }

        fn kiln_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
            cpu::gelu_backward(x, grad)
        }

        fn kiln_dropout(x: FloatTensor<Self>, seed: u64, keep: f64) -> FloatTensor<Self> {
            cpu::dropout(x, seed, keep)
        }

        fn kiln_attention(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            cpu::attention(qkv, key_pad, spec)
        }

        fn kiln_attention_backward(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            cpu::attention_backward(qkv, key_pad, spec, out, lse, grad)
        }

        fn kiln_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            cpu::linear(x, weight, bias)
        }

        fn kiln_linear_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            cpu::linear_backward(x, weight, grad)
        }

        fn kiln_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            cpu::layer_norm(x, gamma, beta, epsilon)
        }

        fn kiln_layer_norm_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            mean: FloatTensor<Self>,
            rstd: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            cpu::layer_norm_backward(x, gamma, mean, rstd, grad)
        }
    }

    impl<B: Backend + KilnKernels, C: CheckpointStrategy> KilnKernels for Autodiff<B, C> {
        fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
            autodiff::unary::<B, C>(x, B::kiln_gelu, B::kiln_gelu_backward)
        }

        fn kiln_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
            autodiff::unary_backward::<B, C>(x, grad, B::kiln_gelu_backward)
        }

        fn kiln_dropout(x: FloatTensor<Self>, seed: u64, keep: f64) -> FloatTensor<Self> {
            // Nothing saved but the seed: the backward draws the same mask.
            let backward = KernelBackward::<B, (u64, f64), 1>(|(seed, keep), grad| {
                [B::kiln_dropout(grad, seed, keep)]
            });
            let node = x.node();
            let y = B::kiln_dropout(Self::inner(x), seed, keep);
            match backward.prepare::<C>([node]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish((seed, keep), y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            }
        }

        fn kiln_attention(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            autodiff::attention::<B, C>(
                qkv,
                key_pad,
                spec,
                B::kiln_attention,
                B::kiln_attention_backward,
            )
        }

        fn kiln_attention_backward(
            qkv: FloatTensor<Self>,
            key_pad: FloatTensor<Self>,
            spec: AttentionSpec,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            autodiff::attention_backward::<B, C>(
                [qkv, key_pad, out, lse, grad],
                spec,
                B::kiln_attention_backward,
            )
        }

        fn kiln_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            // x and the weight.
            let backward = KernelBackward::<B, [FloatTensor<B>; 2], 3>(|[x, weight], grad| {
                let (dx, dw, db) = B::kiln_linear_backward(x, weight, grad);
                [dx, dw, db]
            });
            let nodes = [x.node(), weight.node(), bias.node()];
            let [x, weight, bias] = [x, weight, bias].map(Self::inner);
            let y = B::kiln_linear(x.clone(), weight.clone(), bias);
            match backward.prepare::<C>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish([x, weight], y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            }
        }

        fn kiln_linear_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            let [x, weight, grad] = [x, weight, grad].map(Self::inner);
            lift3::<B, C>(B::kiln_linear_backward(x, weight, grad))
        }

        fn kiln_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> Three<Self> {
            autodiff::layer_norm::<B, C>(
                [x, gamma, beta],
                epsilon,
                B::kiln_layer_norm,
                B::kiln_layer_norm_backward,
            )
        }

        fn kiln_layer_norm_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            mean: FloatTensor<Self>,
            rstd: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> Three<Self> {
            autodiff::layer_norm_backward::<B, C>(
                [x, gamma, mean, rstd, grad],
                B::kiln_layer_norm_backward,
            )
        }
    }

    /// Whether `x` lives on flex (with or without autodiff) in f32.
    pub(crate) fn runs_fused<const D: usize>(x: &Tensor<D>) -> bool {
        x.dtype() == DType::F32
            && matches!(x.device().inner().as_dispatch(), DispatchDevice::Flex(_))
    }

    pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
        Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_gelu(x.into_dispatch()))
    }

    pub(crate) fn dropout<const D: usize>(x: Tensor<D>, seed: u64, keep: f64) -> Tensor<D> {
        Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_dropout(
            x.into_dispatch(),
            seed,
            keep,
        ))
    }

    pub(crate) fn linear<const D: usize>(
        x: Tensor<D>,
        weight: Tensor<2>,
        bias: Tensor<1>,
    ) -> Tensor<D> {
        Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_linear(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.into_dispatch(),
        ))
    }

    pub(crate) fn layer_norm<const D: usize>(
        x: Tensor<D>,
        gamma: Tensor<1>,
        beta: Tensor<1>,
        epsilon: f64,
    ) -> Tensor<D> {
        let (y, _mean, _rstd) = <Dispatch as KilnKernels>::kiln_layer_norm(
            x.into_dispatch(),
            gamma.into_dispatch(),
            beta.into_dispatch(),
            epsilon,
        );
        Tensor::from_dispatch(y)
    }

    pub(crate) fn self_attention(
        qkv: Tensor<3>,
        key_pad: Option<Tensor<2, Bool>>,
        spec: AttentionSpec,
    ) -> Tensor<3> {
        // Always a mask (the extension cannot route an optional tensor):
        // zeros when nothing is padding.
        let [b, t, _] = qkv.dims();
        let key_pad = match key_pad {
            Some(pad) => pad.float(),
            None => Tensor::zeros([b, t], &qkv.device().without_autodiff()),
        }
        .into_dispatch();
        let (out, _lse) =
            <Dispatch as KilnKernels>::kiln_attention(qkv.into_dispatch(), key_pad, spec);
        Tensor::from_dispatch(out)
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, Distribution, Gradients, Int, Tensor};

    use super::check::{attention_run, drawn_layer_norm};
    use super::*;

    fn max_abs(a: Tensor<2>, b: Tensor<2>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// Off CUDA nothing is lent: the tensor comes back as it was and the
    /// library's call is not made (a data-parallel job there reduces
    /// through the host).
    #[test]
    fn no_cuda_buffer_is_lent_off_cuda() {
        let device = Device::flex();
        assert!(!lends_cuda_buffers(&device));
        let t = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device);
        let mut called = false;
        let (back, lent) = with_cuda_buffer(t, |_| called = true);
        assert!(lent.is_none() && !called, "flex lends nothing");
        assert_eq!(
            back.into_data().try_to_vec::<f32>().expect("f32"),
            [1.0, 2.0, 3.0]
        );
    }

    /// A two-stage sum's chunks divide the rows, near √rows; no chunking
    /// where no divisor of at least 8 is at most √rows.
    #[test]
    fn row_chunks_divide_the_rows_near_their_square_root() {
        assert_eq!(row_chunk(16_384), Some(128));
        assert_eq!(row_chunk(150), Some(10));
        assert_eq!(row_chunk(4_096 * 3), Some(96));
        assert_eq!(row_chunk(256), Some(16));
        // Prime, and too few rows to split.
        assert_eq!(row_chunk(8_191), None);
        assert_eq!(row_chunk(40), None);
        assert_eq!(row_chunk(64), Some(8));
    }

    /// Runs `op` with both kernel choices on the same input and upstream
    /// gradient; returns (fused, reference) outputs and input gradients.
    fn both(
        op: impl Fn(Tensor<2>, Kernels) -> Tensor<2>,
        x: Tensor<2>,
        upstream: Tensor<2>,
    ) -> [(Tensor<2>, Tensor<2>); 2] {
        [Kernels::Fused, Kernels::Reference].map(|kernels| {
            let x = x.clone().require_grad();
            let y = op(x.clone(), kernels);
            let grads = (y.clone() * upstream.clone()).sum().backward();
            let dx = x.grad(&grads).expect("input gradient");
            (y.detach(), dx)
        })
    }

    /// A check whose kiln kernel ran (its sums go in another order than
    /// Burn's, so the two differ a little) and agrees within its tolerance.
    fn assert_ran_and_agrees(check: &KernelCheck) {
        assert!(check.fused, "{check:?}");
        assert!(check.max_abs_difference > 0.0, "{check:?}");
        assert!(check.passed(), "{check:?}");
    }

    /// The mask's hash keeps each element with the probability asked for,
    /// independently of its neighbour's and of another seed's mask.
    #[test]
    fn dropout_masks_keep_the_share_asked_for_independently() {
        let n = 1u64 << 20;
        for keep in [0.9, 0.5, 0.1] {
            let threshold = dropout_threshold(keep);
            let mask = |seed: u64| -> Vec<bool> {
                (0..n).map(|i| dropout_keeps(seed, i, threshold)).collect()
            };
            let (a, b) = (mask(0x1234_5678_9ABC_DEF0), mask(0x1234_5678_9ABC_DEF1));
            let share = |hits: usize| hits as f64 / n as f64;
            let kept = share(a.iter().filter(|&&k| k).count());
            let both_neighbours = share(a.windows(2).filter(|w| w[0] && w[1]).count());
            let both_seeds = share(a.iter().zip(&b).filter(|(x, y)| **x && **y).count());
            // Binomial standard deviations are under 5e-4 here.
            assert!((kept - keep).abs() < 3e-3, "{keep}: kept {kept}");
            assert!(
                (both_neighbours - keep * keep).abs() < 3e-3,
                "{keep}: {both_neighbours}"
            );
            assert!(
                (both_seeds - keep * keep).abs() < 3e-3,
                "{keep}: {both_seeds}"
            );
        }
        assert_eq!(dropout_threshold(1.0), u32::MAX);
    }

    /// Fused dropout on flex: kept elements scaled by 1/keep, the rest 0;
    /// the backward pass applies the same mask; a seed gives one mask, in
    /// place or not; outside training (no autodiff) it is the identity, as
    /// Burn's is. (The seed's draw from the device's generator is not
    /// tested here: tests in other threads share flex's generator.)
    #[test]
    fn flex_dropout_scales_what_it_keeps_and_its_gradient_uses_the_same_mask() {
        let device = Device::flex().autodiff();
        let module = burn::nn::DropoutConfig::new(0.25).init();
        let x = Tensor::<2>::random([300, 70], Distribution::Uniform(1.0, 2.0), &device);
        let upstream = Tensor::<2>::random([300, 70], Distribution::Uniform(1.0, 2.0), &device);
        let (y, dx) = {
            let x = x.clone().require_grad();
            let y = dropout(&module, x.clone(), Kernels::Fused);
            let grads = (y.clone() * upstream.clone()).sum().backward();
            (y.inner(), x.grad(&grads).expect("input gradient"))
        };
        let kept = y.clone().greater_elem(0.0).float();
        let share = f64::from(kept.clone().mean().into_scalar::<f32>());
        assert!((share - 0.75).abs() < 0.02, "kept {share}");
        let scale = 1.0 / 0.75;
        let expected_y = x.clone().inner() * kept.clone() * scale;
        assert!(max_abs(y.clone(), expected_y) < 1e-6);
        let expected_dx = upstream.clone().inner() * kept * scale;
        assert!(max_abs(dx, expected_dx) < 1e-6);
        // One seed, one mask (x shared: a copy; then x's own buffer, in
        // place); another seed, another mask.
        let plain = x.clone().inner();
        let seeded = |seed: u64, x: Tensor<2>| flex::dropout(x, seed, 0.75);
        let first = seeded(7, plain.clone());
        let again = seeded(7, plain.clone() * 1.0);
        assert!(max_abs(first.clone(), again) == 0.0);
        assert!(max_abs(seeded(8, plain.clone()), first) > 0.5);
        // Not training: the input itself.
        let eval = dropout(&module, plain.clone(), Kernels::Fused);
        assert!(max_abs(eval, plain) == 0.0);
    }

    #[test]
    fn the_gelu_check_compares_flex_kernel_with_the_exact_derivative() {
        assert_ran_and_agrees(&check_gelu(&Device::flex()));
    }

    #[test]
    fn the_lm_head_loss_check_compares_the_chunks_with_the_composition_on_flex() {
        assert_ran_and_agrees(&check_lm_head_loss(&Device::flex()));
    }

    #[test]
    fn the_layer_norm_check_compares_flex_kernel_with_burn() {
        let check = check_layer_norm(&Device::flex());
        assert_eq!(check.kernel, "layer norm (150 × 200)");
        assert_ran_and_agrees(&check);
    }

    /// On flex the bias is Burn's broadcast both ways (flex's fused linear
    /// layer sums its bias itself): the check runs, says so, and passes
    /// in every dtype flex has, at both shapes.
    #[test]
    fn the_bias_check_is_the_composition_on_flex() {
        let checks = check_bias(&Device::flex());
        let names: Vec<&str> = checks.iter().map(|c| c.kernel.as_str()).collect();
        assert!(names.contains(&"bias, f32 (6003 × 200)"), "{names:?}");
        assert!(names.contains(&"bias, f32 (150 × 96)"), "{names:?}");
        for check in &checks {
            assert!(!check.fused, "{check:?}");
            assert!(check.passed(), "{check:?}");
        }
    }

    #[test]
    fn the_sum_of_squares_is_the_composition_on_flex() {
        let check = check_sum_of_squares(&Device::flex());
        // No kernel on flex: both sides are Burn's composition.
        assert!(!check.fused, "{check:?}");
        assert_eq!(check.max_abs_difference, 0.0, "{check:?}");
        let device = Device::flex();
        let t = |v: Vec<f32>| {
            Tensor::<1>::from_data(burn::tensor::TensorData::new(v.clone(), [v.len()]), &device)
        };
        let sum = sum_of_squares([t(vec![1.0, 2.0]), t(vec![2.0])], Kernels::Fused).expect("sum");
        assert_eq!(sum.into_scalar::<f32>(), 9.0);
        assert!(sum_of_squares(Vec::<Tensor<1>>::new(), Kernels::Fused).is_none());
        let value = sum_of_squares_value([t(vec![1.0, 2.0]), t(vec![2.0])], Kernels::Fused);
        assert_eq!(value, Some(9.0));
        assert!(sum_of_squares_value(Vec::<Tensor<1>>::new(), Kernels::Fused).is_none());
    }

    #[test]
    fn the_attention_check_passes_on_flex_with_queries_that_see_no_key() {
        let checks = check_attention(&Device::flex());
        let names: Vec<&str> = checks.iter().map(|c| c.kernel.as_str()).collect();
        assert_eq!(
            names,
            [
                "attention, causal (t=75)",
                "attention, padded (t=75)",
                "attention, causal, heads 136 wide (t=75)",
                "attention, causal, dropout 0.1 (t=75)",
                "attention, padded, dropout 0.1 (t=75)",
                "attention, queries that see no key (t=75)"
            ]
        );
        for check in &checks {
            assert!(check.fused && check.passed(), "{check:?}");
        }
    }

    #[test]
    fn fused_gelu_matches_burn_gelu_forward_and_backward() {
        let device = Device::flex().autodiff();
        device.seed(7);
        // Wide enough to span several rayon chunks and a ragged tail.
        let x = Tensor::<2>::random([37, 1009], Distribution::Normal(0.0, 3.0), &device);
        let upstream = Tensor::<2>::random([37, 1009], Distribution::Normal(0.0, 1.0), &device);
        let [(y, dx), (y_ref, dx_ref)] = both(gelu, x, upstream);
        assert!(max_abs(y, y_ref) < 2e-6, "forward");
        assert!(max_abs(dx, dx_ref) < 2e-6, "backward");
    }

    #[test]
    fn fused_gelu_runs_without_autodiff_and_on_strided_views() {
        let device = Device::flex();
        device.seed(8);
        let x = Tensor::<2>::random([64, 48], Distribution::Normal(0.0, 2.0), &device);
        let view = x.clone().swap_dims(0, 1);
        let fused = gelu(view.clone(), Kernels::Fused);
        assert!(max_abs(fused, activation::gelu(view)) < 2e-6);
    }

    fn max_abs3(a: Tensor<3>, b: Tensor<3>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// The attention tests' inputs: heads, the packed qkv, an upstream
    /// gradient, and a key-padding mask from each batch entry's real
    /// length. 19 positions fit one causal row block; 75 make blocks of 32,
    /// 32 and a ragged 11 (`cpu::CAUSAL_BLOCK`), so the products that skip
    /// the masked keys and the key-block gradients cross block edges.
    fn attention_inputs(device: &Device) -> Vec<(usize, Tensor<3>, Tensor<3>, Tensor<2, Bool>)> {
        // (batch, time, heads, head width, each batch entry's real length).
        let shapes: [(usize, usize, usize, usize, &[i64]); 2] =
            [(3, 19, 4, 8, &[19, 14, 18]), (2, 75, 2, 8, &[75, 40])];
        let normal =
            |shape: [usize; 3]| Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), device);
        shapes
            .into_iter()
            .map(|(b, t, h, hd, lengths)| {
                let lengths = Tensor::<1, Int>::from_data(lengths, device).reshape([b, 1]);
                let pad = Tensor::<1, Int>::arange(0..t as i64, device)
                    .reshape([1, t])
                    .expand([b, t])
                    .greater_equal(lengths.expand([b, t]));
                (h, normal([b, t, 3 * h * hd]), normal([b, t, h * hd]), pad)
            })
            .collect()
    }

    #[test]
    fn fused_attention_matches_burn_attention_forward_and_backward() {
        let device = Device::flex().autodiff();
        device.seed(9);
        for (h, qkv, upstream, pad) in attention_inputs(&device) {
            let [b, t, width] = qkv.dims();
            let hd = width / 3 / h;
            // A strided input too: a projection seen through a transpose.
            let strided =
                Tensor::<3>::random([t, b, 3 * h * hd], Distribution::Normal(0.0, 1.0), &device)
                    .swap_dims(0, 1);
            let cases = [
                (&qkv, None, true),
                (&qkv, Some(pad.clone()), false),
                (&qkv, Some(pad), true),
                (&strided, None, true),
            ];
            for (input, key_pad, causal) in cases {
                let label = format!("t={t} padded={} causal={causal}", key_pad.is_some());
                let (y, dqkv) = attention_run(
                    input,
                    &upstream,
                    key_pad.clone(),
                    causal,
                    h,
                    AttentionKernel::Auto,
                );
                let reference =
                    attention_run(input, &upstream, key_pad, causal, h, AttentionKernel::Math);
                assert_attention_agrees(&label, (y, dqkv), reference);
            }
        }
    }

    /// A kernel's attention output and qkv gradient within 1e-5 and 1e-4
    /// of the reference's.
    fn assert_attention_agrees(
        label: &str,
        (y, dqkv): (Tensor<3>, Tensor<3>),
        (y_ref, dqkv_ref): (Tensor<3>, Tensor<3>),
    ) {
        let fwd = max_abs3(y, y_ref);
        let bwd = max_abs3(dqkv, dqkv_ref);
        assert!(fwd < 1e-5, "{label}: forward differs by {fwd}");
        assert!(bwd < 1e-4, "{label}: backward differs by {bwd}");
    }

    /// flex's kernel with dropout on the probabilities against the
    /// composition with flex's dropout on them under the same seed (the
    /// same mask), forward and backward, over the shapes and masks of the
    /// test above; and the dropout does drop (the output moves off the one
    /// without it).
    #[test]
    fn fused_attention_dropout_matches_the_composition_with_the_same_mask() {
        use super::check::attention_dropout_kernel_and_reference;
        let device = Device::flex().autodiff();
        device.seed(10);
        for (h, qkv, upstream, pad) in attention_inputs(&device) {
            let t = qkv.dims()[1];
            for (key_pad, causal) in [(None, true), (Some(pad.clone()), false), (Some(pad), true)] {
                for (seed, keep) in [(3u64, 0.9), (0xdead_beef_0123_4567, 0.5)] {
                    let label = format!(
                        "t={t} padded={} causal={causal} keep={keep}",
                        key_pad.is_some()
                    );
                    let drop = ProbsDropout { seed, keep };
                    let ((y, dqkv), (y_ref, dqkv_ref)) = attention_dropout_kernel_and_reference(
                        &qkv,
                        &upstream,
                        key_pad.clone(),
                        causal,
                        h,
                        drop,
                    );
                    let (plain, _) = attention_run(
                        &qkv,
                        &upstream,
                        key_pad.clone(),
                        causal,
                        h,
                        AttentionKernel::Auto,
                    );
                    let moved = max_abs3(y.clone(), plain);
                    assert!(
                        moved > 0.1,
                        "{label}: dropout changed the output by {moved} only"
                    );
                    assert_attention_agrees(&label, (y, dqkv), (y_ref, dqkv_ref));
                }
            }
        }
    }

    /// `self_attention_with_dropout`: dropout, its seed drawn from flex's
    /// generator, on an autodiff device; none where the device is not an
    /// autodiff one or the probability is 0.
    #[test]
    fn attention_dropout_applies_while_training_only() {
        let train = Device::flex().autodiff();
        let infer = Device::flex();
        let run = |device: &Device, p: f64| {
            let qkv = Tensor::<3>::from_data(
                Tensor::<3>::random([2, 9, 48], Distribution::Normal(0.0, 1.0), &infer).into_data(),
                device,
            );
            let y = self_attention_with_dropout(
                qkv.clone(),
                2,
                None,
                true,
                AttentionKernel::Auto,
                p,
                Kernels::Fused,
            );
            let plain = self_attention(qkv, 2, None, true, AttentionKernel::Auto);
            max_abs3(y, plain)
        };
        // (Tests in other threads draw from flex's one generator too, so a
        // mask is judged only as there or not.)
        assert!(run(&train, 0.5) > 0.1, "dropout while training");
        assert_eq!(run(&train, 0.0), 0.0, "no dropout at 0");
        assert_eq!(run(&infer, 0.5), 0.0, "no dropout off autodiff");
    }

    /// A `[b, t]` key-padding mask, true in the `[start, end)` spans of
    /// `padded` per batch entry.
    fn padding_mask(t: usize, padded: &[&[(usize, usize)]], device: &Device) -> Tensor<2, Bool> {
        let values: Vec<bool> = padded
            .iter()
            .flat_map(|spans| {
                (0..t).map(move |i| spans.iter().any(|&(start, end)| (start..end).contains(&i)))
            })
            .collect();
        let data = burn::tensor::TensorData::new(values, [padded.len(), t]);
        Tensor::<2, Bool>::from_data(data, device)
    }

    /// Self-attention's output and qkv gradient, fused then composed, of
    /// random `[b, t, 3·h·hd]` inputs with the key padding of
    /// [`padding_mask`], without and with the causal mask.
    fn padded_attention_runs(
        seed: u64,
        (b, t, h, hd): (usize, usize, usize, usize),
        padded: &[&[(usize, usize)]],
    ) -> Vec<(bool, [(Tensor<3>, Tensor<3>); 2])> {
        let device = Device::flex().autodiff();
        device.seed(seed);
        let pad = padding_mask(t, padded, &device);
        let qkv = Tensor::<3>::random([b, t, 3 * h * hd], Distribution::Normal(0.0, 1.0), &device);
        let upstream = Tensor::<3>::random([b, t, h * hd], Distribution::Normal(0.0, 1.0), &device);
        [false, true]
            .into_iter()
            .map(|causal| {
                let run = |attention| {
                    attention_run(&qkv, &upstream, Some(pad.clone()), causal, h, attention)
                };
                (
                    causal,
                    [run(AttentionKernel::Auto), run(AttentionKernel::Math)],
                )
            })
            .collect()
    }

    #[test]
    fn fused_attention_skips_trailing_padding_and_masks_the_padding_before_it() {
        // The kernel computes each entry's scores only up to its last key
        // that is not padding (`cpu::Span`); padding before that key is
        // masked. Entries: padding inside and at the end (its last real key
        // inside the second causal block), none, a single real key after
        // padding inside, and padding at the end only, so the key spans are
        // 60, 75, 34 and 1 of 75.
        let padded: [&[(usize, usize)]; 4] = [
            &[(10, 20), (60, 75)],
            &[],
            &[(20, 33), (34, 75)],
            &[(1, 75)],
        ];
        for (causal, [(y, dqkv), (y_ref, dqkv_ref)]) in
            padded_attention_runs(10, (4, 75, 2, 8), &padded)
        {
            let fwd = max_abs3(y, y_ref);
            let bwd = max_abs3(dqkv, dqkv_ref);
            assert!(fwd < 1e-5, "causal={causal}: forward differs by {fwd}");
            assert!(bwd < 1e-4, "causal={causal}: backward differs by {bwd}");
        }
    }

    #[test]
    fn a_batch_entry_of_padding_only_gets_zeros_and_leaves_the_others_alone() {
        // No key of entry 0 is real, so no query there sees one: its output
        // and its whole gradient are zeros (Burn's composition would give
        // 0/0 there, so it is the reference for entry 1 only).
        let entry = |x: &Tensor<3>, i: usize| x.clone().narrow(0, i, 1);
        for (causal, [(y, dqkv), (y_ref, dqkv_ref)]) in
            padded_attention_runs(11, (2, 40, 2, 8), &[&[(0, 40)], &[(30, 40)]])
        {
            assert_eq!(entry(&y, 0).abs().max().into_scalar::<f32>(), 0.0);
            assert_eq!(entry(&dqkv, 0).abs().max().into_scalar::<f32>(), 0.0);
            let fwd = max_abs3(entry(&y, 1), entry(&y_ref, 1));
            let bwd = max_abs3(entry(&dqkv, 1), entry(&dqkv_ref, 1));
            assert!(fwd < 1e-5, "causal={causal}: forward differs by {fwd}");
            assert!(bwd < 1e-4, "causal={causal}: backward differs by {bwd}");
        }
    }

    #[test]
    fn only_burns_attention_and_the_reduced_composition_keep_scores() {
        use crate::ComputeDtype;
        let device = Device::flex();
        let keeps =
            |device: &Device, dtype, attention| attention_keeps_scores(device, dtype, attention);
        assert!(!keeps(&device, ComputeDtype::F32, AttentionKernel::Auto));
        assert!(!keeps(
            &device,
            ComputeDtype::F32,
            AttentionKernel::MemoryEfficient
        ));
        assert!(keeps(&device, ComputeDtype::F32, AttentionKernel::Math));
        assert!(keeps(&device, ComputeDtype::Bf16, AttentionKernel::Auto));
        assert!(!keeps(
            &device.autodiff(),
            ComputeDtype::F32,
            AttentionKernel::Auto
        ));
    }

    #[test]
    fn reference_kernels_run_burns_attention_whatever_the_choice() {
        use AttentionKernel::*;
        for choice in [Auto, Flash, MemoryEfficient, Math] {
            assert_eq!(Kernels::Reference.attention(choice), Math);
            assert_eq!(Kernels::Fused.attention(choice), choice);
        }
    }

    /// On flex every choice but `Math` is flex's kernel (no matrix unit
    /// there): the same bits; `Math` is Burn's composition, which rounds
    /// differently.
    #[test]
    fn on_flex_memory_efficient_is_the_fused_kernel_and_math_the_composition() {
        let device = Device::flex().autodiff();
        device.seed(13);
        let qkv = Tensor::<3>::random([2, 9, 24], Distribution::Normal(0.0, 1.0), &device);
        let upstream = Tensor::<3>::random([2, 9, 8], Distribution::Normal(0.0, 1.0), &device);
        let run = |attention| attention_run(&qkv, &upstream, None, true, 2, attention);
        let (auto_y, auto_d) = run(AttentionKernel::Auto);
        for attention in [AttentionKernel::Flash, AttentionKernel::MemoryEfficient] {
            let (y, d) = run(attention);
            assert_eq!(max_abs3(y, auto_y.clone()), 0.0, "{attention:?}");
            assert_eq!(max_abs3(d, auto_d.clone()), 0.0, "{attention:?}");
        }
        let (math_y, math_d) = run(AttentionKernel::Math);
        let (fwd, bwd) = (max_abs3(math_y, auto_y), max_abs3(math_d, auto_d));
        assert!(fwd > 0.0 && fwd < 1e-5, "forward: {fwd}");
        assert!(bwd < 1e-4, "backward: {bwd}");
    }

    #[test]
    fn fused_attention_masks_the_future_and_padding() {
        // Changing a future key/value or a padding key/value leaves the
        // output alone: keys are columns 8..16, values 16..24 of qkv.
        let device = Device::flex();
        device.seed(10);
        let qkv = Tensor::<3>::random([1, 6, 24], Distribution::Normal(0.0, 1.0), &device);
        let bump = |x: Tensor<3>, at: usize| {
            let moved = x.clone().slice([0..1, at..at + 1, 8..24]) + 5.0;
            x.slice_assign([0..1, at..at + 1, 8..24], moved)
        };
        let causal = |qkv: Tensor<3>| {
            self_attention(qkv, 2, None, true, AttentionKernel::Auto).narrow(1, 0, 5)
        };
        let moved = causal(bump(qkv.clone(), 5));
        assert!(max_abs3(causal(qkv.clone()), moved) < 1e-6, "future leaked");
        let pad = Tensor::<1, Int>::arange(0..6, &device)
            .greater_equal_elem(4)
            .reshape([1, 6]);
        let padded = |qkv: Tensor<3>| {
            self_attention(qkv, 2, Some(pad.clone()), false, AttentionKernel::Auto)
        };
        let moved = padded(bump(bump(qkv.clone(), 4), 5));
        assert!(max_abs3(padded(qkv), moved) < 1e-6, "padding leaked");
    }

    #[test]
    fn fused_layer_norm_matches_burn_layer_norm_forward_and_backward() {
        let device = Device::flex().autodiff();
        device.seed(11);
        // 150 rows: two full tasks of 64 and a ragged one; width 72 is not a
        // multiple of the SIMD lanes.
        let d = 72;
        let ln = drawn_layer_norm(d, &device);
        let x = Tensor::<2>::random([150, d], Distribution::Normal(3.0, 2.0), &device);
        let upstream = Tensor::<2>::random([150, d], Distribution::Normal(0.0, 1.0), &device);
        let diffs = fused_vs_reference(
            &x,
            &upstream,
            |x, k| layer_norm(&ln, x, k),
            |grads| {
                let beta = ln.beta.as_ref().and_then(|b| b.grad(grads));
                [ln.gamma.grad(grads), beta]
            },
        );
        let [forward, dx, dgamma, dbeta] = diffs;
        assert!(forward < 1e-5, "forward: {forward}");
        assert!(dx < 1e-5, "x gradient: {dx}");
        assert!(dgamma < 1e-4, "gamma gradient: {dgamma}");
        assert!(dbeta < 1e-4, "beta gradient: {dbeta}");
    }

    #[test]
    fn fused_linear_matches_burn_linear_forward_and_backward() {
        use burn::nn::LinearConfig;

        let device = Device::flex().autodiff();
        device.seed(12);
        // 4 × 130 rows (the forward in chunks of 256, 256 and 8 rows,
        // `cpu::linear_rows`; eight tasks of 64 and a ragged one for the
        // bias sums; the weight gradient split over the rows in two on two
        // or more threads, `cpu::dw_parts`), 40 → 24.
        let layer = LinearConfig::new(40, 24).init(&device);
        let mut layer = layer;
        layer.bias = layer
            .bias
            .map(|b| b.map(|b| b.random_like(Distribution::Normal(0.0, 1.0)).require_grad()));
        let x = Tensor::<3>::random([4, 130, 40], Distribution::Normal(0.0, 1.0), &device);
        let upstream = Tensor::<3>::random([4, 130, 24], Distribution::Normal(0.0, 1.0), &device);
        let diffs = fused_vs_reference(
            &x,
            &upstream,
            |x, k| linear(&layer, x, k),
            |grads| {
                let weight = layer.weight.grad(grads).map(|w| w.reshape([-1]));
                [weight, layer.bias.as_ref().and_then(|b| b.grad(grads))]
            },
        );
        let [forward, dx, dweight, dbias] = diffs;
        assert!(forward < 1e-5, "forward: {forward}");
        assert!(dx < 1e-5, "x gradient: {dx}");
        // Each entry sums 520 products of unit normals (size about 23), in
        // another order than the reference's: over 150 seeds the largest
        // difference was 5.3e-5 (weight) and 4.2e-5 (bias). A row left out
        // or counted twice is off by about 1.
        assert!(dweight < 2e-4, "weight gradient: {dweight}");
        assert!(dbias < 2e-4, "bias gradient: {dbias}");
    }

    /// The largest differences between the fused kernel and the reference
    /// for `op` on `x` with `upstream` as the output's gradient: output,
    /// input gradient, and the two parameter gradients `params` reads
    /// (flattened).
    fn fused_vs_reference<const D: usize>(
        x: &Tensor<D>,
        upstream: &Tensor<D>,
        op: impl Fn(Tensor<D>, Kernels) -> Tensor<D>,
        params: impl Fn(&Gradients) -> [Option<Tensor<1>>; 2],
    ) -> [f32; 4] {
        let [fused, reference] = [Kernels::Fused, Kernels::Reference].map(|kernels| {
            let x = x.clone().require_grad();
            let y = op(x.clone(), kernels);
            let grads = (y.clone() * upstream.clone()).sum().backward();
            let dx = x.grad(&grads).expect("input gradient");
            let [p, q] = params(&grads).map(|g| g.expect("parameter gradient"));
            (y.detach().reshape([-1]), dx.reshape([-1]), p, q)
        });
        let diff = |a: Tensor<1>, b: Tensor<1>| -> f32 { (a - b).abs().max().into_scalar() };
        [
            diff(fused.0, reference.0),
            diff(fused.1, reference.1),
            diff(fused.2, reference.2),
            diff(fused.3, reference.3),
        ]
    }
}
