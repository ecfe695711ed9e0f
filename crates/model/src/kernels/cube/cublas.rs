//! The linear layers' matrix products by NVIDIA's cuBLAS on CUDA
//! (`optimization.matmul = "cublas"`), forward and backward, in bf16 and
//! f16 with f32 sums — what PyTorch's `linear` runs.
//!
//! Why: on an H200 in the 2026-12-04 GPU check, Burn's matrix products
//! were 55 % of a GPT-2 small bf16 step at about 60 TFLOP/s (CubeCL's
//! autotune chose its simplest tile kernel; its LLVM path has no TMA, no
//! asynchronous copies, no `wgmma`), where cuBLAS reaches several hundred.
//!
//! How it reaches CubeCL's buffers: cubecl-cuda hands out a buffer's
//! device pointer (`ComputeClient::get_resource`), not its stream, and its
//! streams are non-blocking (they do not wait on others). So a product
//! here waits for the device (`client.sync()`), runs `cublasGemmEx` on a
//! stream of kiln's, and waits for that stream before CubeCL's next
//! launch can read the result: two host waits a product, the price of
//! working beside CubeCL's scheduler instead of inside it (about 220
//! products a GPT-2 small micro-batch: 144 for the linear layers, 75 for
//! the LM head's 25 chunks; each wait costs a launch's latency, the GPU
//! idle until the next launch arrives).
//!
//! The library is loaded at run time (cudarc's dynamic loading:
//! `libcublas.so.13`, `.12`, …, on `LD_LIBRARY_PATH`): nothing links it,
//! and [`unavailable`] says why a run cannot use it before it starts.
//!
//! Not under Burn's `fusion` (its tensors are not CubeCL's until it
//! flushes), not in f32 (Burn's products run TF32 there; cuBLAS's TF32
//! is a measurement for later).

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};

use crate::kernels::autodiff::KernelBackward;

/// The product as a Burn backend extension: cuBLAS on the CubeCL
/// backend, routed through `Autodiff` for training.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait KilnCublas: Backend {
    /// `a · b`: `[m, k]` times `[k, n]`, one dtype (bf16 or f16).
    fn kiln_cublas_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl KilnCublas for burn::backend::Cube {
    fn kiln_cublas_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        gemm::matmul(a, b)
    }
}

/// What the backward pass keeps: `b` where `a` is tracked (for `a`'s
/// gradient `grad · bᵀ`), `a` where `b` is (for `aᵀ · grad`).
#[derive(Clone, Debug)]
struct Saved<B: Backend> {
    a: Option<FloatTensor<B>>,
    b: Option<FloatTensor<B>>,
}

impl<B: Backend + KilnCublas, C: CheckpointStrategy> KilnCublas for Autodiff<B, C> {
    fn kiln_cublas_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        // An input that is not tracked gets no gradient: `KernelBackward`
        // registers none for it, and the closure hands it the output's
        // gradient untouched rather than computing a product for nothing.
        let step = KernelBackward::<B, Saved<B>, 2>(|saved, grad| {
            let da = match saved.b {
                Some(b) => B::kiln_cublas_matmul(grad.clone(), B::float_transpose(b)),
                None => grad.clone(),
            };
            let db = match saved.a {
                Some(a) => B::kiln_cublas_matmul(B::float_transpose(a), grad),
                None => grad,
            };
            [da, db]
        });
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        let nodes = [a.node(), b.node()];
        let (a, b) = (Self::inner(a), Self::inner(b));
        let saved = Saved {
            a: b_tracked.then(|| a.clone()),
            b: a_tracked.then(|| b.clone()),
        };
        let y = B::kiln_cublas_matmul(a, b);
        match step.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(saved, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// Whether `a · b` can run here: both on a CUDA GPU, 2-D, chaining, in
/// one dtype cuBLAS takes with f32 sums (bf16, f16).
pub(crate) fn runs(a: &Tensor<2>, b: &Tensor<2>) -> bool {
    crate::device_memory::cube_gpu_device(&a.device())
        .is_some_and(|device| takes([a.dtype(), b.dtype()], [&a.dims(), &b.dims()], &device))
}

/// What [`runs`] asks, of dtypes, shapes and a device: the one rule for
/// autodiff tensors and for the CubeCL backend's ([`product`]).
fn takes(dtypes: [DType; 2], shapes: [&[usize]; 2], device: &cubecl::Device) -> bool {
    let ([a, b], [sa, sb]) = (dtypes, shapes);
    matches!(a, DType::BF16 | DType::F16)
        && a == b
        && sa.len() == 2
        && sb.len() == 2
        && sa[1] == sb[0]
        && matches!(device, cubecl::Device::Cuda(_))
}

/// `a · b` by cuBLAS (the caller checked [`runs`]), with its gradients by
/// cuBLAS too.
pub(crate) fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as KilnCublas>::kiln_cublas_matmul(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `a · b` of the CubeCL backend's tensors (no autodiff) by cuBLAS where
/// [`crate::kernels::GpuMatmul::Cublas`] is chosen and it can run (2-D, one
/// dtype of bf16 and f16, a CUDA device), else Burn's product: the LM
/// head's chunked products (`kernels::lm_loss`), which run inside kiln's
/// own backward pass.
pub(crate) fn product(
    a: burn_cubecl::tensor::CubeTensor,
    b: burn_cubecl::tensor::CubeTensor,
) -> burn_cubecl::tensor::CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    if crate::kernels::gpu_matmul() == crate::kernels::GpuMatmul::Cublas
        && takes(
            [a.dtype, b.dtype],
            [a.meta.shape().as_slice(), b.meta.shape().as_slice()],
            &a.device,
        )
    {
        gemm::matmul(a, b)
    } else {
        <burn::backend::Cube as FloatTensorOps<burn::backend::Cube>>::float_matmul(a, b)
    }
}

/// Why cuBLAS cannot run on `device`, or `None` where it can: a CUDA GPU
/// and the library found.
pub(crate) fn unavailable(device: &burn::tensor::Device) -> Option<String> {
    match crate::device_memory::cube_gpu_device(device) {
        Some(cubecl::Device::Cuda(_)) => {}
        _ => return Some("cuBLAS runs on CUDA devices only".into()),
    }
    // SAFETY: only tries to open the library by cudarc's names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Some(
            "cuBLAS's library (libcublas.so.13 or .so.12) was not found on the loader's path: \
             install CUDA's cuBLAS (the CUDA toolkit, `apt install libcublas-13-0`, or PyPI's \
             `nvidia-cublas`, which PyTorch's wheels bring) and put its `lib` folder on \
             LD_LIBRARY_PATH (for PyPI's: `site-packages/nvidia/cu13/lib` or \
             `site-packages/nvidia/cublas/lib`)"
                .into(),
        );
    }
    None
}

/// One cuBLAS handle and stream per CUDA device, made at the first
/// product.
struct Blas {
    ordinal: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<cudarc::driver::CudaStream>,
    handle: cudarc::cublas::sys::cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time:
// the handles live behind `BLAS`'s mutex, held for the whole call.
unsafe impl Send for Blas {}

static BLAS: Mutex<Vec<Blas>> = Mutex::new(Vec::new());

mod gemm {
    //! The call: pointers from CubeCL, `cublasGemmEx` on kiln's stream.

    use std::ffi::c_void;

    use burn::tensor::DType;
    use burn_cubecl::kernel::{into_contiguous, untile};
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;
    use cubecl_runtime::runtime::Runtime;
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };

    use super::{BLAS, Blas};
    use crate::kernels::blas_layout::{self, Gemm, Operand};

    type Server = <CudaRuntime as Runtime>::Server;

    /// `[rows, cols]` and the strides of a 2-D tensor, untiled.
    fn layout(t: &CubeTensor) -> ([usize; 2], [usize; 2]) {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        assert_eq!(shape.num_dims(), 2, "cuBLAS's product takes 2-D tensors");
        ([shape[0], shape[1]], [strides[0], strides[1]])
    }

    /// The call's arguments for `a · b`, each operand made contiguous
    /// first where cuBLAS cannot read it as it is (a broadcast, a view
    /// strided both ways).
    fn operands(a: CubeTensor, b: CubeTensor) -> (CubeTensor, CubeTensor, Gemm) {
        let (mut a, mut b) = (untile(a), untile(b));
        let readable = |t: &CubeTensor| {
            let (shape, strides) = layout(t);
            blas_layout::operand(shape[0], shape[1], strides).is_some()
        };
        if !readable(&a) {
            a = into_contiguous(a);
        }
        if !readable(&b) {
            b = into_contiguous(b);
        }
        let ((sa, ta), (sb, tb)) = (layout(&a), layout(&b));
        let gemm = blas_layout::gemm(sa, ta, sb, tb).unwrap_or_else(|| {
            panic!("cuBLAS cannot take the product of {sa:?} (strides {ta:?}) and {sb:?} (strides {tb:?})")
        });
        (a, b, gemm)
    }

    fn op(operand: Operand) -> cublasOperation_t {
        if operand.transposed {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    }

    /// `a · b` into a new contiguous `[m, n]` tensor of their dtype.
    pub(super) fn matmul(a: CubeTensor, b: CubeTensor) -> CubeTensor {
        let dtype = a.dtype;
        assert_eq!(dtype, b.dtype, "cuBLAS's product takes one dtype");
        let data_type = match dtype {
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            other => panic!("cuBLAS's product here takes bf16 or f16, not {other:?}"),
        };
        let ordinal = match &a.device {
            cubecl::Device::Cuda(d) => d.index,
            other => panic!("cuBLAS's product runs on CUDA devices, not {other:?}"),
        };
        let (a, b) = (untile(a), untile(b));
        let ((sa, _), (sb, _)) = (layout(&a), layout(&b));
        if sa[0] == 0 || sa[1] == 0 || sb[1] == 0 {
            // Nothing to multiply (no rows, columns or inner size): zeros.
            use burn_backend::ops::FloatTensorOps;
            type B = burn::backend::Cube;
            let device = a.device.clone();
            return <B as FloatTensorOps<B>>::float_zeros(
                [sa[0], sb[1]].into(),
                &device,
                dtype.into(),
            );
        }
        let (a, b, gemm) = operands(a, b);
        let [n, m, k] = gemm.mnk;
        let out = crate::kernels::cube_empty(&a, vec![m, n], dtype);
        let client = a.client.clone();
        let resource = |t: &CubeTensor, what: &str| {
            client
                .get_resource::<Server>(t.handle.clone())
                .unwrap_or_else(|e| panic!("cuBLAS's product: the {what}'s device memory: {e:?}"))
        };
        let (ra, rb, rc) = (
            resource(&a, "left operand"),
            resource(&b, "right operand"),
            resource(&out, "output"),
        );
        let (pa, pb, pc) = (ra.resource().ptr, rb.resource().ptr, rc.resource().ptr);
        // Everything queued before, the output's allocation included, done.
        cubecl::future::block_on(client.sync())
            .unwrap_or_else(|e| panic!("cuBLAS's product: waiting for the device: {e:?}"));
        let mut all = BLAS.lock().unwrap_or_else(|e| e.into_inner());
        let blas = match all.iter().position(|b| b.ordinal == ordinal) {
            Some(at) => &all[at],
            None => {
                all.push(Blas::new(ordinal));
                &all[all.len() - 1]
            }
        };
        blas.ctx
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("cuBLAS's product: CUDA device {ordinal}: {e}"));
        let (alpha, beta) = (1.0f32, 0.0f32);
        let to_i32 = |v: usize| i32::try_from(v).expect("blas_layout::gemm checked the sizes");
        let started = std::time::Instant::now();
        // SAFETY: the pointers are CubeCL's live buffers of the operands and
        // the output (kept alive by `ra`, `rb`, `rc` until the stream is
        // done), sized and laid out as `gemm` says; the device is idle
        // (synced above) and CubeCL reads the output only after this
        // stream's wait below.
        let status = unsafe {
            cudarc::cublas::result::gemm_ex(
                blas.handle,
                op(gemm.first),
                op(gemm.second),
                to_i32(n),
                to_i32(m),
                to_i32(k),
                (&alpha as *const f32).cast::<c_void>(),
                pb as *const c_void,
                data_type,
                to_i32(gemm.first.ld),
                pa as *const c_void,
                data_type,
                to_i32(gemm.second.ld),
                (&beta as *const f32).cast::<c_void>(),
                pc as *mut c_void,
                data_type,
                to_i32(gemm.ldc),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        status.unwrap_or_else(|e| panic!("cublasGemmEx ({m} × {k} · {k} × {n}, {dtype:?}): {e:?}"));
        blas.stream
            .synchronize()
            .unwrap_or_else(|e| panic!("cuBLAS's product: waiting for its stream: {e}"));
        crate::kernels::record_cublas(started.elapsed());
        drop((ra, rb, rc));
        out
    }

    impl Blas {
        fn new(ordinal: usize) -> Self {
            let fail = |what: &str, e: &dyn std::fmt::Debug| -> ! {
                panic!("cuBLAS on CUDA device {ordinal}: {what}: {e:?}")
            };
            let ctx = cudarc::driver::CudaContext::new(ordinal)
                .unwrap_or_else(|e| fail("opening the device", &e));
            ctx.bind_to_thread()
                .unwrap_or_else(|e| fail("binding its context", &e));
            let stream = ctx.new_stream().unwrap_or_else(|e| fail("a stream", &e));
            let handle = cudarc::cublas::result::create_handle()
                .unwrap_or_else(|e| fail("cublasCreate", &e));
            // SAFETY: a live handle and a live stream of the same context.
            unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream().cast()) }
                .unwrap_or_else(|e| fail("cublasSetStream", &e));
            Blas {
                ordinal,
                ctx,
                stream,
                handle,
            }
        }
    }
}
