//! Memory-efficient self-attention on the CubeCL backends (wgpu, CUDA):
//! forward and backward without the `time × time` scores.
//!
//! Burn's attention under autodiff materialises the scores and their
//! softmax for every head (`[batch, heads, time, time]`, twice, plus their
//! gradients): at block 2048 and batch 64 one such buffer is 4 GiB per
//! layer and head group, which wgpu refuses and which dominates the memory
//! traffic of a GPT-2-length step. Here each query row is one unit of work
//! that streams over the keys it sees with an online softmax (running
//! maximum and sum, the output rescaled as the maximum grows) and keeps
//! only its log-sum-exp; the backward pass rebuilds each probability from
//! it (`exp(s − lse)`), as FlashAttention does:
//!
//! 1. `delta`: per query, `Σ dO · O` (the softmax gradient's row term);
//! 2. `dq`: per query, over the keys it sees;
//! 3. `dkdv`: per key, over the queries that see it.
//!
//! No atomics, nothing `time × time` in memory: the extra memory is two
//! floats per query and head. The kernels read the heads where they lie in
//! the packed `[batch, time, 3·d]` projection and write the merged heads
//! (and the packed gradient) directly. Causal masking skips the keys after
//! the query (and, per key, the queries before it); the key-padding mask
//! (1 where a key is padding, per batch entry) skips padded keys. Inputs
//! and outputs are f32, bf16 or f16; everything is accumulated in f32.
//!
//! With dropout on the probabilities (a training step's
//! `model.attention_dropout`: the spec's `dropout`, compiled in only then),
//! each kernel hashes a (query, key) pair's mask bit where it meets the
//! pair (`dropout.rs`, the same mask as flex's kernel): the forward pass
//! weighs the values by the kept probabilities times `1 / keep` (their sum
//! and the log-sum-exp are those before dropout), the backward pass weighs
//! dV the same way and multiplies `dP` by the mask before the softmax's
//! gradient; `delta` (`Σ dO·O`) is unchanged, as in FlashAttention.
//!
//! Under Burn's `fusion` (where the backend is `Fusion<CubeBackend>`) the
//! two kernels are custom operations of the fusion stream: the extension's
//! `Fusion` route describes their outputs (shape, dtype) when they are
//! recorded and runs the same CubeCL kernels on the inner backend when the
//! stream executes; the element-wise operations around them are fused as
//! usual.
//!
//! In f16 and bf16 on a device with a matrix instruction for the dtype
//! (tensor cores, cooperative matrices), the forward pass and the dQ and
//! dK/dV kernels run on it instead (`flash_attention.rs`: tiles of queries
//! and keys, the same output, log-sum-exp and gradient); `delta` is this
//! file's either way.
//!
//! Each unit runs scalar multiply-adds over the head's width (no tensor
//! cores, no tiling across queries; the loops over the width unrolled up
//! to 64 or 128 wide, so that the unit's vectors can stay in registers):
//! what it buys is memory, and with it
//! the long blocks the materialising path cannot run; whether it is also
//! faster than the materialising path at a given length is for the GPU
//! check's timings to say (`optimization.kernels=reference` runs Burn's).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::{Bool, FloatDType, Tensor};

use crate::kernels::{AttentionSpec, autodiff};

/// Memory-efficient attention as a Burn backend extension: the kernels are
/// implemented for the CubeCL backend (`CubeBackend`), routed to through
/// `Fusion` in a build with Burn's fusion and through `Autodiff` for
/// training.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub(crate) trait KilnAttention: Backend {
    /// The merged heads' output (`[b, t, d]`, qkv's dtype) and each query's
    /// log-sum-exp (`[b, heads, t]`, f32).
    #[fusion(meta = forward_outputs)]
    fn kiln_memory_efficient_attention(
        qkv: FloatTensor<Self>,
        key_pad: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The gradient of the packed qkv.
    #[fusion(dtype = qkv, shape = qkv)]
    fn kiln_memory_efficient_attention_backward(
        qkv: FloatTensor<Self>,
        key_pad: FloatTensor<Self>,
        spec: AttentionSpec,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The forward kernel's outputs as `Fusion` records them before it runs:
/// the merged heads (`[b, t, d]` from qkv's `[b, t, 3·d]`, qkv's dtype) and
/// the log-sum-exp (`[b, heads, t]`, f32), what `cube::forward` allocates.
#[cfg(feature = "fusion")]
fn forward_outputs(
    qkv: &burn::backend::fusion::custom::TensorSpec,
    _key_pad: &burn::backend::fusion::custom::TensorSpec,
    spec: &AttentionSpec,
) -> (
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
) {
    use burn::backend::fusion::custom::TensorSpec;
    let (b, t, width) = (qkv.shape[0], qkv.shape[1], qkv.shape[2]);
    (
        TensorSpec::new([b, t, width / 3].into(), qkv.dtype),
        TensorSpec::new([b, spec.heads, t].into(), burn::tensor::DType::F32),
    )
}

impl KilnAttention for burn_cubecl::CubeBackend {
    fn kiln_memory_efficient_attention(
        qkv: FloatTensor<Self>,
        key_pad: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cube::forward(qkv, key_pad, spec)
    }

    fn kiln_memory_efficient_attention_backward(
        qkv: FloatTensor<Self>,
        key_pad: FloatTensor<Self>,
        spec: AttentionSpec,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cube::backward(qkv, key_pad, spec, out, lse, grad)
    }
}

impl<B: Backend + KilnAttention, C: CheckpointStrategy> KilnAttention for Autodiff<B, C> {
    fn kiln_memory_efficient_attention(
        qkv: FloatTensor<Self>,
        key_pad: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        autodiff::attention::<B, C>(
            qkv,
            key_pad,
            spec,
            B::kiln_memory_efficient_attention,
            B::kiln_memory_efficient_attention_backward,
        )
    }

    fn kiln_memory_efficient_attention_backward(
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
            B::kiln_memory_efficient_attention_backward,
        )
    }
}

/// Whether `qkv` lives on a CubeCL GPU (with or without autodiff) in a
/// dtype the kernels take.
pub(crate) fn runs(qkv: &Tensor<3>) -> bool {
    super::cube_gpu_float(qkv)
}

/// Whether [`self_attention`] in `dtype` with heads `head_dim` wide runs
/// on `device`'s matrix unit (`flash_attention`, forward and backward)
/// rather than the scalar kernels.
pub(crate) fn on_tensor_cores(
    device: &burn::tensor::Device,
    dtype: burn::tensor::DType,
    head_dim: usize,
) -> bool {
    crate::device_memory::cube_gpu_device(device)
        .is_some_and(|d| super::flash_attention::tile_for(&d.client(), dtype, head_dim).is_some())
}

/// Whether the forward pass on `device`'s matrix unit is `flash_mma.rs`'s
/// (its scores in registers): where `FLASH_MMA` asks for it and it runs.
pub(crate) fn in_registers(
    device: &burn::tensor::Device,
    dtype: burn::tensor::DType,
    head_dim: usize,
) -> bool {
    super::flash_mma::forward_asked()
        && crate::device_memory::cube_gpu_device(device)
            .is_some_and(|d| super::flash_mma::runs_on(&d, &d.client(), dtype, head_dim))
}

/// The kernels' self-attention of `qkv` (see `kernels::self_attention`);
/// the result has qkv's dtype. `seed`, given with `spec.dropout` (and only
/// then), is the mask's seed on the device (`MaskSeed::on_device`: the
/// kernels read it there, `spec.dropout`'s own `seed` is not looked at).
pub(crate) fn self_attention(
    qkv: Tensor<3>,
    key_pad: Option<Tensor<2, Bool>>,
    seed: Option<Tensor<1>>,
    spec: AttentionSpec,
) -> Tensor<3> {
    // Always a mask, in f32 (the extension cannot route an optional
    // tensor): zeros when nothing is padding; its `b·t` flags, and with
    // dropout the seed's two words after them (`dropout::seed_keys`), so
    // that the seed reaches the backward kernels with the flags.
    let [b, t, _] = qkv.dims();
    let key_pad = match key_pad {
        Some(pad) => pad.float().cast(FloatDType::F32),
        None => Tensor::zeros([b, t], &qkv.device().without_autodiff()),
    }
    .reshape([b * t]);
    let key_pad = match seed {
        Some(seed) => Tensor::cat(vec![key_pad, seed.cast(FloatDType::F32)], 0),
        None => key_pad,
    }
    .into_dispatch();
    let (out, _lse) = <Dispatch as KilnAttention>::kiln_memory_efficient_attention(
        qkv.into_dispatch(),
        key_pad,
        spec,
    );
    Tensor::from_dispatch(out)
}

#[cfg(feature = "cuda")]
pub(super) use cube::offline_kernels;

mod cube {
    //! The CubeCL kernels: one unit per (batch entry, head, query or key).

    use burn::tensor::DType;
    use burn_backend::cubecl::dtype_to_storage_type;

    use super::super::dropout::{Mask, kept, launch_mask, seed_keys};
    use super::AttentionSpec;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

    /// Units per cube: consecutive queries of one head, so a cube's units
    /// read the same key at the same time.
    const CUBE_UNITS: usize = 128;

    /// Below any score (a finite stand-in for −∞: WGSL has no infinity
    /// literal): the running maximum before the first key.
    const LOWEST: f32 = -3.0e38;

    /// Up to this head width the loops over a head's elements are unrolled,
    /// so that a unit's arrays (the query and the output's accumulator;
    /// the query, output gradient and dQ) are indexed by constants and can
    /// live in registers: a loop indexes them at run time, which puts them
    /// in the GPU's (slower, cached) local memory. GPT-2's and BERT's heads
    /// are 64 wide.
    const UNROLL_WIDTH: usize = 128;

    /// The same for the dK/dV kernel, whose unit holds four arrays (key,
    /// value and their gradients): at 64, 256 floats.
    const UNROLL_WIDTH_DKDV: usize = 64;

    /// A unit's batch entry, head and row (query or key): units go row by
    /// row within a head and head by head within a batch entry, the layout
    /// of `lse` and `delta` (`[b, heads, t]`).
    #[cube]
    fn unit_row(unit: usize, seq: usize, heads: usize) -> (usize, usize, usize) {
        let bh = unit / seq;
        (bh / heads, bh % heads, unit % seq)
    }

    /// Where a row's head starts in a `[b, t, stride]` buffer whose rows
    /// hold the heads side by side: the merged heads (the output and its
    /// gradient, `stride` = heads · d) or the packed qkv (`stride` =
    /// 3 · heads · d: the query there, the key `heads · d` further, the
    /// value `2 · heads · d`).
    #[cube]
    fn head_start(
        b: usize,
        row: usize,
        h: usize,
        seq: usize,
        stride: usize,
        #[comptime] head_dim: usize,
    ) -> usize {
        (b * seq + row) * stride + h * head_dim
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn attention_kernel<E: Float>(
        qkv: &[E],
        pad: &[f32],
        out: &mut [E],
        lse: &mut [f32],
        seq: usize,
        heads: usize,
        scale: f32,
        mask: Mask,
        #[comptime] head_dim: usize,
        #[comptime] causal: bool,
        #[comptime] dropout: bool,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = ABSOLUTE_POS;
        // The mask seed's keys, after the padding flags (with dropout).
        let mask_keys = seed_keys(pad, dropout);
        // The per-unit arrays in registers: see `UNROLL_WIDTH`.
        let unroll = head_dim <= UNROLL_WIDTH;
        if unit >= lse.len() {
            terminate!();
        }
        let (b, h, i) = unit_row(unit, seq, heads);
        let width = heads * head_dim;
        let q0 = head_start(b, i, h, seq, 3 * width, head_dim);
        let mut q = Array::<f32>::new(head_dim);
        let mut acc = Array::<f32>::new(head_dim);
        #[unroll(unroll)]
        for c in 0..head_dim {
            q[c] = f32::cast_from(qkv[q0 + c]) * scale;
            acc[c] = f32::new(0.0);
        }
        let mut running_max = f32::new(LOWEST);
        let mut sum = f32::new(0.0);
        let end = if causal { i + 1 } else { seq };
        for j in 0..end {
            if pad[b * seq + j] == f32::new(0.0) {
                let k0 = head_start(b, j, h, seq, 3 * width, head_dim) + width;
                let v0 = k0 + width;
                let mut s = f32::new(0.0);
                #[unroll(unroll)]
                for c in 0..head_dim {
                    s += q[c] * f32::cast_from(qkv[k0 + c]);
                }
                let new_max = max(running_max, s);
                let rescale = (running_max - new_max).exp();
                let p = (s - new_max).exp();
                sum = sum * rescale + p;
                // The values weighed by the probability dropped out (the
                // sum is of all of them: dropout comes after the softmax).
                let mut weight = p;
                if dropout {
                    weight = p * kept(&mask_keys, &mask, unit as u32, seq as u32, j as u32);
                }
                #[unroll(unroll)]
                for c in 0..head_dim {
                    acc[c] = acc[c] * rescale + weight * f32::cast_from(qkv[v0 + c]);
                }
                running_max = new_max;
            }
        }
        // A query that sees no key (all of them padding) gets zeros and a
        // log-sum-exp of 0, as on flex, not 0/0; no key's gradient reads it.
        let seen = sum > f32::new(0.0);
        let o0 = head_start(b, i, h, seq, width, head_dim);
        #[unroll(unroll)]
        for c in 0..head_dim {
            let mut o = f32::new(0.0);
            if seen {
                o = acc[c] / sum;
            }
            out[o0 + c] = E::cast_from(o);
        }
        let mut l = f32::new(0.0);
        if seen {
            l = running_max + sum.ln();
        }
        lse[unit] = l;
    }

    #[cube(launch)]
    fn delta_kernel<E: Float>(
        out: &[E],
        grad: &[E],
        delta: &mut [f32],
        seq: usize,
        heads: usize,
        #[comptime] head_dim: usize,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = ABSOLUTE_POS;
        // Unrolled as the other kernels' loops (no arrays here).
        let unroll = head_dim <= UNROLL_WIDTH;
        if unit >= delta.len() {
            terminate!();
        }
        let (b, h, i) = unit_row(unit, seq, heads);
        let o0 = head_start(b, i, h, seq, heads * head_dim, head_dim);
        let mut d = f32::new(0.0);
        #[unroll(unroll)]
        for c in 0..head_dim {
            d += f32::cast_from(out[o0 + c]) * f32::cast_from(grad[o0 + c]);
        }
        delta[unit] = d;
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn dq_kernel<E: Float>(
        qkv: &[E],
        pad: &[f32],
        grad: &[E],
        lse: &[f32],
        delta: &[f32],
        dqkv: &mut [E],
        seq: usize,
        heads: usize,
        scale: f32,
        mask: Mask,
        #[comptime] head_dim: usize,
        #[comptime] causal: bool,
        #[comptime] dropout: bool,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = ABSOLUTE_POS;
        // The mask seed's keys, after the padding flags (with dropout).
        let mask_keys = seed_keys(pad, dropout);
        // The per-unit arrays in registers: see `UNROLL_WIDTH`.
        let unroll = head_dim <= UNROLL_WIDTH;
        if unit >= lse.len() {
            terminate!();
        }
        let (b, h, i) = unit_row(unit, seq, heads);
        let width = heads * head_dim;
        let q0 = head_start(b, i, h, seq, 3 * width, head_dim);
        let g0 = head_start(b, i, h, seq, width, head_dim);
        let mut q = Array::<f32>::new(head_dim);
        let mut g = Array::<f32>::new(head_dim);
        let mut dq = Array::<f32>::new(head_dim);
        #[unroll(unroll)]
        for c in 0..head_dim {
            q[c] = f32::cast_from(qkv[q0 + c]);
            g[c] = f32::cast_from(grad[g0 + c]);
            dq[c] = f32::new(0.0);
        }
        let (lse_i, delta_i) = (lse[unit], delta[unit]);
        let end = if causal { i + 1 } else { seq };
        for j in 0..end {
            if pad[b * seq + j] == f32::new(0.0) {
                let k0 = head_start(b, j, h, seq, 3 * width, head_dim) + width;
                let v0 = k0 + width;
                let mut s = f32::new(0.0);
                let mut dp = f32::new(0.0);
                #[unroll(unroll)]
                for c in 0..head_dim {
                    s += q[c] * f32::cast_from(qkv[k0 + c]);
                    dp += g[c] * f32::cast_from(qkv[v0 + c]);
                }
                let p = (s * scale - lse_i).exp();
                // The gradient of the probability before its dropout: the
                // mask's factor on that of the one after.
                if dropout {
                    dp *= kept(&mask_keys, &mask, unit as u32, seq as u32, j as u32);
                }
                let ds = p * (dp - delta_i);
                #[unroll(unroll)]
                for c in 0..head_dim {
                    dq[c] += ds * f32::cast_from(qkv[k0 + c]);
                }
            }
        }
        #[unroll(unroll)]
        for c in 0..head_dim {
            dqkv[q0 + c] = E::cast_from(dq[c] * scale);
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn dkdv_kernel<E: Float>(
        qkv: &[E],
        pad: &[f32],
        grad: &[E],
        lse: &[f32],
        delta: &[f32],
        dqkv: &mut [E],
        seq: usize,
        heads: usize,
        scale: f32,
        mask: Mask,
        #[comptime] head_dim: usize,
        #[comptime] causal: bool,
        #[comptime] dropout: bool,
        #[define(E)] _dtype: ElemType,
    ) {
        let unit = ABSOLUTE_POS;
        // The mask seed's keys, after the padding flags (with dropout).
        let mask_keys = seed_keys(pad, dropout);
        // The per-unit arrays in registers: see `UNROLL_WIDTH_DKDV`.
        let unroll = head_dim <= UNROLL_WIDTH_DKDV;
        if unit >= lse.len() {
            terminate!();
        }
        let (b, h, j) = unit_row(unit, seq, heads);
        let width = heads * head_dim;
        let k0 = head_start(b, j, h, seq, 3 * width, head_dim) + width;
        let v0 = k0 + width;
        let mut k = Array::<f32>::new(head_dim);
        let mut v = Array::<f32>::new(head_dim);
        let mut dk = Array::<f32>::new(head_dim);
        let mut dv = Array::<f32>::new(head_dim);
        #[unroll(unroll)]
        for c in 0..head_dim {
            k[c] = f32::cast_from(qkv[k0 + c]);
            v[c] = f32::cast_from(qkv[v0 + c]);
            dk[c] = f32::new(0.0);
            dv[c] = f32::new(0.0);
        }
        // A padded key is seen by no query: its gradients stay zero.
        let mut start = j;
        if !causal {
            start = 0;
        }
        let end = if pad[b * seq + j] == f32::new(0.0) {
            seq
        } else {
            start
        };
        // This head's first row in `lse` and `delta`.
        let row0 = unit - j;
        for i in start..end {
            let q0 = head_start(b, i, h, seq, 3 * width, head_dim);
            let g0 = head_start(b, i, h, seq, width, head_dim);
            let mut s = f32::new(0.0);
            let mut dp = f32::new(0.0);
            #[unroll(unroll)]
            for c in 0..head_dim {
                s += f32::cast_from(qkv[q0 + c]) * k[c];
                dp += f32::cast_from(grad[g0 + c]) * v[c];
            }
            let p = (s * scale - lse[row0 + i]).exp();
            // dV takes the probability that weighed the value (dropped
            // out), dS the gradient of the one before the dropout.
            let mut weight = p;
            if dropout {
                let factor = kept(&mask_keys, &mask, (row0 + i) as u32, seq as u32, j as u32);
                weight = p * factor;
                dp *= factor;
            }
            let ds = p * (dp - delta[row0 + i]);
            #[unroll(unroll)]
            for c in 0..head_dim {
                dv[c] += weight * f32::cast_from(grad[g0 + c]);
                dk[c] += ds * f32::cast_from(qkv[q0 + c]);
            }
        }
        #[unroll(unroll)]
        for c in 0..head_dim {
            dqkv[k0 + c] = E::cast_from(dk[c] * scale);
            dqkv[v0 + c] = E::cast_from(dv[c]);
        }
    }

    /// The shape of the problem: batch, time, heads, head width, and the
    /// launch over one unit per (batch entry, head, row).
    struct Problem {
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        scale: f32,
        cube_count: CubeCount,
        cube_dim: CubeDim,
    }

    fn problem(qkv: &CubeTensor, heads: usize) -> Problem {
        let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
        let head_dim = three_width / 3 / heads;
        let cube_dim = CubeDim::new_1d(CUBE_UNITS as u32);
        let cube_count = calculate_cube_count_elemwise(&qkv.client, batch * heads * seq, cube_dim);
        Problem {
            batch,
            seq,
            heads,
            head_dim,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
            cube_count,
            cube_dim,
        }
    }

    impl Problem {
        /// The shape of what the kernels keep per unit (`lse`, `delta`).
        fn per_row(&self) -> Vec<usize> {
            vec![self.batch, self.heads, self.seq]
        }
    }

    /// A new tensor on `like`'s device.
    use super::super::cube_empty as empty;

    pub(super) fn forward(
        qkv: CubeTensor,
        key_pad: CubeTensor,
        spec: AttentionSpec,
    ) -> (CubeTensor, CubeTensor) {
        let (qkv, pad) = (into_contiguous(qkv), into_contiguous(key_pad));
        let (heads, causal) = (spec.heads, spec.causal);
        // On the matrix unit where the device has one for the dtype (and
        // the caller did not ask for the scalar kernels): with
        // `FLASH_MMA=1` the register kernel where it runs (CUDA; it has
        // no dropout).
        if spec.matrix_unit
            && spec.dropout.is_none()
            && super::super::flash_mma::forward_asked()
            && let Some(result) = super::super::flash_mma::forward(&qkv, &pad, heads, causal)
        {
            return result;
        }
        if spec.matrix_unit
            && let Some(result) = super::super::flash_attention::forward(&qkv, &pad, spec)
        {
            return result;
        }
        let p = problem(&qkv, heads);
        let dtype = qkv.dtype;
        let out = empty(&qkv, vec![p.batch, p.seq, p.heads * p.head_dim], dtype);
        let lse = empty(&qkv, p.per_row(), DType::F32);
        attention_kernel::launch(
            &qkv.client.clone(),
            p.cube_count,
            p.cube_dim,
            qkv.into_buffer_arg(),
            pad.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            lse.clone().into_buffer_arg(),
            p.seq,
            p.heads,
            p.scale,
            launch_mask(spec.dropout),
            p.head_dim,
            causal,
            spec.dropout.is_some(),
            dtype_to_storage_type(dtype),
        );
        (out, lse)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        qkv: CubeTensor,
        key_pad: CubeTensor,
        spec: AttentionSpec,
        out: CubeTensor,
        lse: CubeTensor,
        grad: CubeTensor,
    ) -> CubeTensor {
        let [qkv, pad, out, lse, grad] = [qkv, key_pad, out, lse, grad].map(into_contiguous);
        let (heads, causal) = (spec.heads, spec.causal);
        let p = problem(&qkv, heads);
        let dtype = qkv.dtype;
        let client = qkv.client.clone();
        // The gradient in qkv's dtype (the casts at the layer's edge bring
        // a reduced one back to f32).
        let grad = if grad.dtype == dtype {
            grad
        } else {
            burn_cubecl::kernel::cast(grad, dtype)
        };
        let delta = empty(&qkv, p.per_row(), DType::F32);
        delta_kernel::launch(
            &client,
            p.cube_count.clone(),
            p.cube_dim,
            out.into_buffer_arg(),
            grad.clone().into_buffer_arg(),
            delta.clone().into_buffer_arg(),
            p.seq,
            p.heads,
            p.head_dim,
            dtype_to_storage_type(dtype),
        );
        // On the matrix unit where the forward pass ran: with
        // `FLASH_MMA=1` the register kernels where they run (CUDA; they
        // have no dropout).
        if spec.matrix_unit
            && spec.dropout.is_none()
            && super::super::flash_mma::backward_asked()
            && let Some(dqkv) =
                super::super::flash_mma::backward(&qkv, &pad, &grad, &lse, &delta, heads, causal)
        {
            return dqkv;
        }
        if spec.matrix_unit
            && let Some(dqkv) =
                super::super::flash_attention::backward(&qkv, &pad, &grad, &lse, &delta, spec)
        {
            return dqkv;
        }
        let dqkv = empty(&qkv, qkv.meta.shape().to_vec(), dtype);
        dq_kernel::launch(
            &client,
            p.cube_count.clone(),
            p.cube_dim,
            qkv.clone().into_buffer_arg(),
            pad.clone().into_buffer_arg(),
            grad.clone().into_buffer_arg(),
            lse.clone().into_buffer_arg(),
            delta.clone().into_buffer_arg(),
            dqkv.clone().into_buffer_arg(),
            p.seq,
            p.heads,
            p.scale,
            launch_mask(spec.dropout),
            p.head_dim,
            causal,
            spec.dropout.is_some(),
            dtype_to_storage_type(dtype),
        );
        dkdv_kernel::launch(
            &client,
            p.cube_count,
            p.cube_dim,
            qkv.into_buffer_arg(),
            pad.into_buffer_arg(),
            grad.into_buffer_arg(),
            lse.into_buffer_arg(),
            delta.into_buffer_arg(),
            dqkv.clone().into_buffer_arg(),
            p.seq,
            p.heads,
            p.scale,
            launch_mask(spec.dropout),
            p.head_dim,
            causal,
            spec.dropout.is_some(),
            dtype_to_storage_type(dtype),
        );
        dqkv
    }

    /// The scalar kernels as `optimization.attention = "memory-efficient"`
    /// runs them for GPT-2 small in bf16 (heads 64 wide, causal), for
    /// `kiln check-kernels --cuda-arch`.
    #[cfg(feature = "cuda")]
    pub(crate) fn offline_kernels(
        o: &super::super::offline::Offline,
    ) -> super::super::offline::Kernels {
        use super::super::dropout::compilation;
        use super::super::offline::buffer;
        let elem = dtype_to_storage_type(burn::tensor::DType::BF16);
        let settings = o.settings(CUBE_UNITS as u32, 1);
        let (props, target) = (o.props.clone(), o.target.clone());
        let (head_dim, causal) = (64, true);
        let mut kernels: super::super::offline::Kernels = vec![
            (
                "scalar attention forward (BF16, heads 64 wide, causal)".to_string(),
                Box::new(attention_kernel::AttentionKernel::new(
                    settings.clone(),
                    props.clone(),
                    target.clone(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    (),
                    (),
                    (),
                    compilation(),
                    head_dim,
                    causal,
                    false,
                    elem,
                )),
            ),
            (
                "attention's delta (BF16, heads 64 wide)".to_string(),
                Box::new(delta_kernel::DeltaKernel::new(
                    settings.clone(),
                    props.clone(),
                    target.clone(),
                    buffer(),
                    buffer(),
                    buffer(),
                    (),
                    (),
                    head_dim,
                    elem,
                )),
            ),
        ];
        kernels.push((
            "scalar attention dQ (BF16, heads 64 wide, causal)".to_string(),
            Box::new(dq_kernel::DqKernel::new(
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
                compilation(),
                head_dim,
                causal,
                false,
                elem,
            )),
        ));
        kernels.push((
            "scalar attention dK and dV (BF16, heads 64 wide, causal)".to_string(),
            Box::new(dkdv_kernel::DkdvKernel::new(
                settings,
                props,
                target,
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                (),
                (),
                (),
                compilation(),
                head_dim,
                causal,
                false,
                elem,
            )),
        ));
        kernels
    }
}
