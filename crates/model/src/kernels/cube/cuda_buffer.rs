//! A CubeCL tensor's buffer on a CUDA device, lent to a library that works
//! on it in place: NCCL's all-reduce of a data-parallel job's gradients
//! (kiln-train's `params::all_reduce_grads`), which so never cross the
//! host. The same lookup as cuBLAS's operands (`cublas`): cubecl-cuda
//! hands out the buffer's device pointer and — kiln's patch of it,
//! `vendor/cubecl-cuda` — the stream of the storage that holds it, the
//! stream this thread's launches run on; the lookup also makes that
//! stream wait for any other stream that wrote the buffer.

use burn::tensor::Tensor;
use burn_cubecl::kernel::into_contiguous;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

use crate::kernels::CudaBuffer;

type Server = <CudaRuntime as Runtime>::Server;

/// See [`crate::kernels::with_cuda_buffer`].
pub(crate) fn with_buffer<R>(
    t: Tensor<1>,
    f: impl FnOnce(&CudaBuffer) -> R,
) -> (Tensor<1>, Option<R>) {
    let ordinal = match crate::device_memory::cube_gpu_device(&t.device()) {
        Some(cubecl::Device::Cuda(d)) => d.index,
        _ => return (t, None),
    };
    let cube = into_contiguous(super::into_cube(t));
    // In place: a buffer another tensor shares is copied first, so that
    // no other tensor's values change.
    let cube = if cube.can_mut() { cube } else { cube.copy() };
    let client = cube.client.clone();
    let resource = client
        .get_resource::<Server>(cube.handle.clone())
        .unwrap_or_else(|e| panic!("a tensor's CUDA buffer: its device memory: {e:?}"));
    let buffer = CudaBuffer {
        ptr: resource.resource().ptr,
        len: cube.meta.shape().num_elements(),
        dtype: cube.dtype,
        stream: resource.resource().stream.cast(),
        ordinal,
    };
    let out = f(&buffer);
    // The lookup's hold on the buffer ends after the call was queued; the
    // tensor keeps the memory until its owner drops it, and CubeCL hands
    // it out again only to work queued later on its stream.
    drop(resource);
    (super::from_cube(cube), Some(out))
}
