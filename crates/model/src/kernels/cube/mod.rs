//! kiln's kernels on the CubeCL GPU backends (wgpu, CUDA), each its own
//! Burn backend extension with an autodiff route: the memory-efficient
//! self-attention (`attention`, and on the matrix unit `flash_attention`;
//! their dropout mask in `dropout`), exact GELU (`gelu`), LayerNorm in f32
//! (`layer_norm`) and a bias's addition with its gradient's column sums
//! (`bias`, which LayerNorm's gamma and beta gradients use too), the
//! token embedding's gradient (`embedding`); on CUDA
//! the linear layers' and the LM head's products by cuBLAS (`cublas`,
//! where `optimization.matmul = "cublas"`); the helpers they share are
//! here. The gradient norm's
//! sum of squares and AdamW's update have CubeCL kernels too, in
//! `kernels::norm` and `kernels::optim` beside their flex versions; the LM
//! head with its loss (`kernels::lm_loss`) is Burn's primitives in chunks
//! on every backend. Under Burn's `fusion` only attention runs (as a
//! custom operation of the fusion stream); fusion fuses the others'
//! compositions itself.

use burn::tensor::Tensor;

pub(crate) mod attention;
#[cfg(not(feature = "fusion"))]
pub(crate) mod bias;
#[cfg(all(feature = "cuda", not(feature = "fusion")))]
pub(crate) mod cublas;
#[cfg(all(feature = "cuda", not(feature = "fusion")))]
pub(crate) mod cuda_buffer;
pub(crate) mod dropout;
#[cfg(not(feature = "fusion"))]
pub(crate) mod embedding;
pub(crate) mod flash_attention;
pub(crate) mod flash_mma;
#[cfg(not(feature = "fusion"))]
pub(crate) mod gelu;
#[cfg(not(feature = "fusion"))]
pub(crate) mod layer_norm;
#[cfg(feature = "cuda")]
pub(crate) mod offline;

/// Whether a CubeCL device is a GPU, where kiln's CubeCL kernels run; not
/// Burn's CubeCL CPU backend (the `cubecl-cpu` feature), which runs Burn's
/// own operations.
pub(crate) fn cube_gpu(device: &cubecl::Device) -> bool {
    !matches!(device, cubecl::Device::Cpu(_))
}

/// Whether `t` lives on a CubeCL GPU (with or without autodiff) in a float
/// dtype kiln's CubeCL kernels read (f32, bf16, f16).
pub(crate) fn cube_gpu_float<const D: usize>(t: &Tensor<D>) -> bool {
    use burn::backend::DispatchDevice;
    use burn::tensor::DType;
    matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && matches!(t.device().inner().as_dispatch(), DispatchDevice::Cube(d) if cube_gpu(d))
}

/// A new tensor of `shape` and `dtype` on `like`'s device, for a CubeCL
/// kernel's output: **contiguous**, as kiln's kernels index their outputs
/// (`row · width + column`). Burn's `empty_device_dtype` asks CubeCL for
/// its "optimized" layout, which on CUDA (and HIP) pads each row to a
/// power of two up to 512 bytes, or to a multiple of 512 bytes beyond
/// (`cuMallocPitched`'s alignment): a kernel writing such a tensor as if
/// it were contiguous leaves its rows where Burn does not read them. That
/// was the 2026-12-04 GPU check's failures on an H200: GELU at 37 × 1009,
/// LayerNorm at width 200, attention's packed gradient 96 and 192 wide,
/// and a tiny GPT's training off the CPU's — while every width that is a
/// multiple of 512 bytes (GPT-2's, BERT's, the default GPT's) agreed, and
/// wgpu, whose layout is contiguous, never showed it.
pub(crate) fn cube_empty(
    like: &burn_cubecl::tensor::CubeTensor,
    shape: Vec<usize>,
    dtype: burn::tensor::DType,
) -> burn_cubecl::tensor::CubeTensor {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// The CubeCL tensor inside `t`, a tensor without autodiff on a CubeCL
/// device (else a panic: the caller checked the device). For the kernels
/// that take a list of tensors, which Burn's `#[backend_extension]` does
/// not route: it takes one tensor per argument.
#[cfg(not(feature = "fusion"))]
pub(crate) fn into_cube(t: Tensor<1>) -> burn_cubecl::tensor::CubeTensor {
    use burn::backend::DispatchTensorKind;
    match t.into_dispatch().kind {
        DispatchTensorKind::Cube(inner) => inner.float(),
        _ => panic!("a kiln CubeCL kernel was given a tensor of another backend"),
    }
}

/// [`into_cube`]'s inverse: a CubeCL kernel's result as a tensor without
/// autodiff.
#[cfg(not(feature = "fusion"))]
pub(crate) fn from_cube(t: burn_cubecl::tensor::CubeTensor) -> Tensor<1> {
    use burn::backend::{
        BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind,
    };
    Tensor::from_dispatch(DispatchTensor {
        kind: DispatchTensorKind::Cube(BackendTensor::Float(t)),
        autodiff: DispatchAutodiffContext::Disabled,
    })
}
