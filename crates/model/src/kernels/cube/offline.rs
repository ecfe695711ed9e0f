//! kiln's CubeCL kernels compiled for an NVIDIA GPU without one: the
//! kernel definitions CubeCL would hand its CUDA compiler at a launch,
//! compiled here by both of CubeCL's CUDA compilers (LLVM's NVPTX target
//! to PTX, the default; CUDA C++ for NVRTC, `cuda-cpp`, whose source is
//! generated without NVRTC). A kernel whose lowering fails on CUDA fails
//! here, on any machine, instead of on a lent GPU; and the assembly shows
//! what a profile cannot be had for (`kiln check-kernels --cuda-arch`):
//! its barriers, tensor-core instructions and local-memory traffic.

use std::sync::Arc;

use burn::tensor::DType;
use cubecl::Compiler;
use cubecl::cuda::compiler::CudaBackend;
use cubecl::cuda::{CudaCompilationOptions, CudaCompiler, CudaRepresentation};
use cubecl::features::Features;
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{DeviceIdentity, HardwareProperties, MemoryDeviceProperties};
use cubecl::prelude::*;

use super::flash_attention;
use crate::kernels::ptx::OfflineKernel;

/// The device CubeCL's CUDA runtime would describe for compute capability
/// `arch` (e.g. 90 for an H100 or H200): 32-unit warps, the shared memory
/// a cube may have there (227 KiB on an H100, where kiln does not know the
/// architecture), and tensor-core products of bf16 and f16 summing in f32
/// (16 × 16 × 16), what the kernels ask for.
fn device(arch: u32) -> Arc<DeviceProperties> {
    use cubecl::features::MmaConfig;
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: crate::kernels::ptx::max_shared_per_cube(arch)
            .unwrap_or(227 * 1024),
        max_cube_count: (u32::MAX, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut features = Features::default();
    for dtype in [DType::BF16, DType::F16] {
        let elem = burn_backend::cubecl::dtype_to_elem_type(dtype);
        features.matmul.cmma.insert(MmaConfig {
            a_type: elem,
            b_type: elem,
            cd_type: burn_backend::cubecl::dtype_to_elem_type(DType::F32),
            m: 16,
            n: 16,
            k: 16,
        });
    }
    Arc::new(DeviceProperties::new(
        features,
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: format!("offline sm_{arch}"),
            fingerprint: "offline".to_string(),
            physical: None,
        },
    ))
}

/// Compiles `kernel` with both compilers for `arch`.
fn compile(name: &str, arch: u32, kernel: &dyn CubeKernel, out: &mut Vec<OfflineKernel>) {
    let units = kernel.define().settings.cube_dim.num_elems();
    for (backend, compiler) in [(CudaBackend::Llvm, "llvm"), (CudaBackend::Cpp, "cpp")] {
        let options = CudaCompilationOptions {
            arch: Some(SmArch::new(arch, false)),
            ..Default::default()
        };
        let assembly = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            CudaCompiler::new(backend).compile(kernel.define(), &options)
        }))
        .map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the compiler panicked".to_string())
        })
        .and_then(|compiled| compiled.map_err(|error| format!("{error:?}")));
        let shared_bytes = assembly
            .as_ref()
            .map_or(0, CudaRepresentation::shared_memory_size);
        let assembly = assembly.map(|representation| match representation {
            CudaRepresentation::Llvm(module) => {
                // (The module's PTX is NUL-terminated.)
                let bytes: Vec<u8> = module.ptx.iter().map(|&c| c as u8).collect();
                String::from_utf8_lossy(&bytes)
                    .trim_end_matches('\0')
                    .to_string()
            }
            representation => representation.to_string(),
        });
        out.push(OfflineKernel {
            name: name.to_string(),
            compiler,
            assembly,
            units,
            shared_bytes,
        });
    }
}

/// Kernels to compile, each with its name and the shape it is compiled
/// for.
pub(crate) type Kernels = Vec<(String, Box<dyn CubeKernel>)>;

/// What every kernel's constructor takes first: the device and target
/// properties, and its settings.
pub(crate) struct Offline {
    pub(crate) props: Arc<DeviceProperties>,
    pub(crate) target: Arc<TargetProperties>,
}

impl Offline {
    /// A kernel's settings for a cube of `x × y` units, as a launch makes
    /// them (bounds-checked, 32-bit addresses).
    pub(crate) fn settings(&self, x: u32, y: u32) -> KernelSettings {
        KernelSettings::new(
            *CubeDim::new_2d(x, y),
            ExecutionMode::Checked,
            AddressType::U32,
        )
    }
}

/// A buffer argument's compilation argument (not written in place).
pub(crate) fn buffer() -> BufferCompilationArg {
    BufferCompilationArg { inplace: None }
}

/// A tensor argument's compilation argument: its own buffer, or written
/// over input binding `inplace` (the optimizer's kernels', not under
/// `fusion`).
#[cfg(not(feature = "fusion"))]
pub(crate) fn tensor(inplace: Option<usize>) -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace },
    }
}

/// kiln's CubeCL kernels as GPT-2 small runs them (bf16, heads 64 wide,
/// width 768; the embedding's and the scalar attention's too), compiled
/// for compute capability `arch` by both compilers; with the gradient
/// norm's sum of squares and the fused AdamW as a step launches them, over
/// groups of 32 tensors.
pub(crate) fn compile_kernels(arch: u32) -> Vec<OfflineKernel> {
    let offline = Offline {
        props: device(arch),
        // CUDA's own: the manual MMA's register layout is the target's.
        target: Arc::new(
            <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::target_properties(),
        ),
    };
    let mut kernels = flash_attention::offline_kernels(&offline, DType::BF16);
    kernels.extend(super::flash_mma::offline_kernels(&offline, DType::BF16));
    kernels.extend(super::attention::offline_kernels(&offline));
    #[cfg(not(feature = "fusion"))]
    {
        kernels.extend(super::embedding::offline_kernels(&offline));
        kernels.extend(super::gelu::offline_kernels(&offline));
        kernels.extend(super::layer_norm::offline_kernels(&offline));
        kernels.extend(super::bias::offline_kernels(&offline));
        kernels.extend(super::super::norm::offline_kernels(&offline));
        kernels.extend(super::super::optim::offline_kernels(&offline));
    }
    let mut out = Vec::new();
    for (name, kernel) in kernels {
        compile(&name, arch, &*kernel, &mut out);
    }
    out
}
