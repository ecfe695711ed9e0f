//! What CubeCL's allocator holds on a GPU: the figures a GPU run reports
//! as its memory, instead of the process's RAM or an NVML reading of the
//! whole card (which other processes share, and which counts the CUDA
//! context and whatever the pools keep but do not use).

/// A GPU's memory as the allocator of this process's CubeCL client holds
/// it, every stream and pool together, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of live allocations (tensors, kernels' buffers).
    pub in_use: u64,
    /// Bytes the pools hold from the driver now.
    pub reserved: u64,
    /// The most the pools have held: for the pools that carve pages, their
    /// largest page count times the page size; for the others what they hold
    /// now (they return memory to the driver only under pressure). PyTorch's
    /// `max_memory_reserved`, near enough.
    pub peak_reserved: u64,
}

/// The allocator's figures for `device`, a CubeCL GPU (wgpu, CUDA); `None`
/// elsewhere (flex, Burn's CubeCL CPU backend), or in a build without the
/// GPU backends.
pub fn device_memory(device: &burn::tensor::Device) -> Option<DeviceMemory> {
    #[cfg(feature = "cube")]
    return cube_gpu_device(device).map(|d| cube(&d));
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        None
    }
}

/// `device`'s CubeCL device where it is a CubeCL GPU (wgpu, CUDA, HIP);
/// `None` on flex and on Burn's CubeCL CPU backend.
#[cfg(feature = "cube")]
pub(crate) fn cube_gpu_device(device: &burn::tensor::Device) -> Option<cubecl::Device> {
    use burn::backend::DispatchDevice;
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(d) if crate::kernels::cube_gpu(d) => Some(d.clone()),
        _ => None,
    }
}

#[cfg(feature = "cube")]
fn cube(device: &cubecl::Device) -> DeviceMemory {
    use cubecl::{MemoryPoolKind, MemoryPoolReport, MemoryScope};
    let report = device.client().memory_report(MemoryScope::Device);
    let usage = report.usage();
    let peak = |pool: &MemoryPoolReport| {
        let pages = match pool.kind {
            MemoryPoolKind::Sliced { page_size, .. }
            | MemoryPoolKind::Adaptive { page_size, .. } => pool.pages_peak * page_size,
            _ => 0,
        };
        pages.max(pool.usage.bytes_reserved)
    };
    let peak_reserved: u64 = report
        .streams
        .iter()
        .flat_map(|stream| {
            std::iter::once(&stream.pools)
                .chain(stream.auxiliary.iter().map(|a| &a.pools))
                .flat_map(|pools| {
                    pools
                        .dynamic
                        .iter()
                        .chain([&pools.persistent, &pools.dedicated])
                })
        })
        .map(peak)
        .sum();
    DeviceMemory {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved,
        peak_reserved: peak_reserved.max(usage.bytes_reserved),
    }
}

/// The CubeCL runtime of a wgpu device, as CubeCL names it (`wgpu<spirv>`,
/// `wgpu<wgsl>`, `wgpu<msl>`): which compiler the adapter was given, which
/// depends on the build (`vulkan`) and on what the driver offers (CubeCL
/// falls back to WGSL on a Vulkan device without the features its SPIR-V
/// needs). `None` off wgpu. Opens the device's client, so CubeCL's
/// configuration must be in place first.
pub fn gpu_runtime(device: &burn::tensor::Device) -> Option<&'static str> {
    #[cfg(feature = "cube")]
    return cube_gpu_device(device)
        .filter(|d| matches!(d, cubecl::Device::Wgpu(_)))
        .map(|d| d.client().name());
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        None
    }
}
