//! The linear layers' matrix products by NVIDIA's cuBLAS on CUDA
//! (`optimization.matmul = "cublas"`), forward and backward, in bf16 and
//! f16 with f32 sums — what PyTorch's `linear` runs — and in f32, on TF32
//! tensor cores where `precision.tf32` allows (PyTorch's
//! `allow_tf32`).
//!
//! Why: on an H200 in the 2026-12-04 GPU check, Burn's matrix products
//! were 55 % of a GPT-2 small bf16 step at about 60 TFLOP/s (CubeCL's
//! autotune chose its simplest tile kernel; its LLVM path has no TMA, no
//! asynchronous copies, no `wgmma`), where cuBLAS reaches several hundred.
//!
//! How it reaches CubeCL's buffers: cubecl-cuda hands out a buffer's
//! device pointer (`ComputeClient::get_resource`), and — kiln's patch of
//! it, `vendor/cubecl-cuda` — the stream of the storage that holds it.
//! The output is allocated on the calling thread's CubeCL stream, the
//! stream every launch of this thread runs on, and `get_resource` makes
//! that stream wait for any other stream that wrote an operand; so
//! `cublasGemmEx` is queued on that stream, after the launches that wrote
//! its operands and before those that read its output, and the host waits
//! for nothing (PyTorch's way: one stream, the library's kernels in its
//! order). `KILN_CUBLAS_WAIT=1` runs the products the first way kiln ran
//! them instead, as a check on that ordering: the device waited for
//! (`client.sync()`), the product on a stream of kiln's, that stream
//! waited for — two host waits a product, the GPU idle after each.
//!
//! The library is loaded at run time (cudarc's dynamic loading:
//! `libcublas.so.13`, `.12`, …, on `LD_LIBRARY_PATH`): nothing links it,
//! and [`unavailable`] says why a run cannot use it before it starts.
//!
//! Not under Burn's `fusion` (its tensors are not CubeCL's until it
//! flushes).

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
/// one dtype cuBLAS takes with f32 sums (bf16, f16, f32).
pub(crate) fn runs(a: &Tensor<2>, b: &Tensor<2>) -> bool {
    crate::device_memory::cube_gpu_device(&a.device())
        .is_some_and(|device| takes([a.dtype(), b.dtype()], [&a.dims(), &b.dims()], &device))
}

/// What [`runs`] asks, of dtypes, shapes and a device: the one rule for
/// autodiff tensors and for the CubeCL backend's ([`product`]).
fn takes(dtypes: [DType; 2], shapes: [&[usize]; 2], device: &cubecl::Device) -> bool {
    let ([a, b], [sa, sb]) = (dtypes, shapes);
    matches!(a, DType::BF16 | DType::F16 | DType::F32)
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
/// dtype of bf16, f16 and f32, a CUDA device), else Burn's product: the LM
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

/// Whether the products wait on the host (`KILN_CUBLAS_WAIT=1`), read
/// once a process; see the module's documentation.
fn host_waits() -> bool {
    static WAIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WAIT.get_or_init(|| {
        std::env::var("KILN_CUBLAS_WAIT").is_ok_and(|v| matches!(v.trim(), "1" | "true"))
    })
}

/// A CUDA device's context (the primary one, CubeCL's too) and kiln's own
/// stream on it, for [`host_waits`].
struct Device {
    ordinal: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<cudarc::driver::CudaStream>,
}

/// One cuBLAS handle per stream its products are queued on: a handle's
/// workspace is used in its stream's order.
struct Handle {
    /// The stream's address (a `CUstream` is a pointer).
    stream: usize,
    handle: cudarc::cublas::sys::cublasHandle_t,
}

struct Blas {
    devices: Vec<Device>,
    handles: Vec<Handle>,
    /// The event pairs around the products queued while
    /// [`crate::kernels::cublas_timing`] is on, not yet read.
    timed: Vec<(usize, [cudarc::driver::sys::CUevent; 2])>,
}

// SAFETY: cuBLAS handles and CUDA events may be used from any thread, one
// call at a time: they live behind `BLAS`'s mutex, held for each use.
unsafe impl Send for Blas {}

static BLAS: Mutex<Blas> = Mutex::new(Blas {
    devices: Vec::new(),
    handles: Vec::new(),
    timed: Vec::new(),
});

fn blas() -> std::sync::MutexGuard<'static, Blas> {
    BLAS.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reads the device times of the products timed so far (each read waits
/// for its product) into [`crate::kernels::record_cublas`].
pub(crate) fn settle_timings() {
    let mut blas = blas();
    let timed = std::mem::take(&mut blas.timed);
    for (ordinal, [start, end]) in timed {
        let device = blas.device(ordinal);
        device
            .ctx
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("cuBLAS's product: CUDA device {ordinal}: {e}"));
        // SAFETY: both events were created by `event::create` and recorded
        // on one stream, and are destroyed once, here.
        let elapsed = unsafe {
            use cudarc::driver::result::event;
            let ms = event::synchronize(end).and_then(|()| event::elapsed(start, end));
            let _ = event::destroy(start);
            let _ = event::destroy(end);
            ms
        };
        let ms = elapsed.unwrap_or_else(|e| panic!("cuBLAS's product: reading its time: {e}"));
        crate::kernels::record_cublas(std::time::Duration::from_secs_f64(f64::from(ms) / 1e3));
    }
}

mod gemm {
    //! The call: pointers and a stream from CubeCL, `cublasGemmEx` queued
    //! on it.

    use std::ffi::c_void;

    use burn::tensor::DType;
    use burn_cubecl::kernel::{into_contiguous, untile};
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;
    use cubecl_runtime::runtime::Runtime;
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType,
    };
    use cudarc::driver::sys::CUstream;

    use super::{Blas, Device, Handle};
    use crate::kernels::blas_layout::{self, Gemm, Operand};

    type Server = <CudaRuntime as Runtime>::Server;

    const COMPUTE_32F: cublasComputeType_t = cublasComputeType_t::CUBLAS_COMPUTE_32F;

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
        // f32 sums always; f32 inputs rounded to TF32 on the tensor cores
        // where `precision.tf32` allows it (`kernels::set_tf32`).
        let (data_type, compute) = match dtype {
            DType::BF16 => (cudaDataType::CUDA_R_16BF, COMPUTE_32F),
            DType::F16 => (cudaDataType::CUDA_R_16F, COMPUTE_32F),
            DType::F32 if crate::kernels::tf32() => (
                cudaDataType::CUDA_R_32F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            DType::F32 => (cudaDataType::CUDA_R_32F, COMPUTE_32F),
            other => panic!("cuBLAS's product here takes bf16, f16 or f32, not {other:?}"),
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
        // Each lookup also makes this thread's stream wait for the stream
        // that wrote the buffer, where that is another.
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
        let waits = super::host_waits();
        if waits {
            // Everything queued before, the output's allocation included, done.
            cubecl::future::block_on(client.sync())
                .unwrap_or_else(|e| panic!("cuBLAS's product: waiting for the device: {e:?}"));
        }
        let mut blas = super::blas();
        let device = blas.device(ordinal);
        device
            .ctx
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("cuBLAS's product: CUDA device {ordinal}: {e}"));
        // With host waits kiln's own stream, waited for below; else the
        // output's: it was allocated on this thread's CubeCL stream, the
        // one its launches run on.
        let own = waits.then(|| device.stream.clone());
        let stream = own
            .as_ref()
            .map_or(rc.resource().stream, |own| own.cu_stream());
        let handle = blas.handle(ordinal, stream);
        let timed = crate::kernels::cublas_timing_on().then(|| Blas::events(ordinal, stream));
        let (alpha, beta) = (1.0f32, 0.0f32);
        let to_i32 = |v: usize| i32::try_from(v).expect("blas_layout::gemm checked the sizes");
        // SAFETY: the pointers are CubeCL's live buffers of the operands and
        // the output, sized and laid out as `gemm` says. The product is
        // queued on the stream CubeCL's launches of this thread run on,
        // which waits for the operands' writers (`get_resource`), so it
        // reads them written and any later launch reads its output after
        // it; CubeCL reuses the buffers, once `ra`, `rb` and `rc` are
        // dropped, for launches queued after it on that stream. With
        // `host_waits` the device is idle here and the product's stream is
        // waited for below, before CubeCL queues anything more.
        let status = unsafe {
            cudarc::cublas::result::gemm_ex(
                handle,
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
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        status.unwrap_or_else(|e| panic!("cublasGemmEx ({m} × {k} · {k} × {n}, {dtype:?}): {e:?}"));
        if let Some(pair @ [_, end]) = timed {
            // SAFETY: a live event of this context, recorded on a live stream.
            unsafe { cudarc::driver::result::event::record(end, stream) }
                .unwrap_or_else(|e| panic!("cuBLAS's product: an event after it: {e}"));
            blas.timed.push((ordinal, pair));
        }
        drop(blas);
        if let Some(own) = own {
            own.synchronize()
                .unwrap_or_else(|e| panic!("cuBLAS's product: waiting for its stream: {e}"));
        }
        drop((ra, rb, rc));
        out
    }

    impl Blas {
        fn at(&self, ordinal: usize) -> Option<usize> {
            self.devices.iter().position(|d| d.ordinal == ordinal)
        }

        /// CUDA device `ordinal`'s context and kiln's stream, made at its
        /// first product.
        pub(super) fn device(&mut self, ordinal: usize) -> &Device {
            let at = match self.at(ordinal) {
                Some(at) => at,
                None => {
                    let fail = |what: &str, e: &dyn std::fmt::Debug| -> ! {
                        panic!("cuBLAS on CUDA device {ordinal}: {what}: {e:?}")
                    };
                    let ctx = cudarc::driver::CudaContext::new(ordinal)
                        .unwrap_or_else(|e| fail("opening the device", &e));
                    ctx.bind_to_thread()
                        .unwrap_or_else(|e| fail("binding its context", &e));
                    let stream = ctx.new_stream().unwrap_or_else(|e| fail("a stream", &e));
                    self.devices.push(Device {
                        ordinal,
                        ctx,
                        stream,
                    });
                    self.devices.len() - 1
                }
            };
            &self.devices[at]
        }

        /// The handle whose products are queued on `stream` (the device's
        /// context bound), made at its first product.
        fn handle(&mut self, ordinal: usize, stream: CUstream) -> cublasHandle_t {
            let key = stream as usize;
            if let Some(h) = self.handles.iter().find(|h| h.stream == key) {
                return h.handle;
            }
            let fail = |what: &str, e: &dyn std::fmt::Debug| -> ! {
                panic!("cuBLAS on CUDA device {ordinal}: {what}: {e:?}")
            };
            let handle = cudarc::cublas::result::create_handle()
                .unwrap_or_else(|e| fail("cublasCreate", &e));
            // SAFETY: a live handle and a live stream of the same context.
            unsafe { cudarc::cublas::result::set_stream(handle, stream.cast()) }
                .unwrap_or_else(|e| fail("cublasSetStream", &e));
            self.handles.push(Handle {
                stream: key,
                handle,
            });
            handle
        }

        /// Two events, the first recorded on `stream` now: the product
        /// queued next is timed between them.
        fn events(ordinal: usize, stream: CUstream) -> [cudarc::driver::sys::CUevent; 2] {
            use cudarc::driver::result::event;
            use cudarc::driver::sys::CUevent_flags;
            let make = || {
                event::create(CUevent_flags::CU_EVENT_DEFAULT).unwrap_or_else(|e| {
                    panic!("cuBLAS on CUDA device {ordinal}: an event to time it: {e}")
                })
            };
            let (start, end) = (make(), make());
            // SAFETY: a live event of this context, recorded on a live stream.
            unsafe { event::record(start, stream) }.unwrap_or_else(|e| {
                panic!("cuBLAS on CUDA device {ordinal}: an event before it: {e}")
            });
            [start, end]
        }
    }
}
