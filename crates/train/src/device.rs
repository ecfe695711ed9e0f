//! Choosing the device: `device.backend = auto | cuda | wgpu | flex |
//! cubecl-cpu`.
//! The `cuda` feature needs a build that can download CubeCL's LLVM bundle
//! from GitHub; `wgpu` reaches NVIDIA GPUs through Vulkan without it.

use burn::tensor::Device;
use kiln_config::{Backend, DeviceSection};

use crate::TrainError;

/// The device a run uses, and why.
#[derive(Clone, Debug)]
pub struct DeviceChoice {
    /// The device the run trains on.
    pub device: Device,
    /// "flex (CPU)", "wgpu (GPU)".
    pub name: String,
    /// Why this device: the configuration, or what was detected.
    pub why: String,
    /// Whether it is a GPU (CUDA or wgpu).
    pub is_gpu: bool,
    /// What `optimization.compile` does on it (set by [`open_device`]).
    pub compile: String,
}

impl DeviceChoice {
    /// Whether this is a CUDA device (a job's gradients then go through NCCL).
    pub fn is_cuda(&self) -> bool {
        self.name.starts_with("cuda")
    }

    /// Whether this is flex, the CPU device kiln's fused CPU kernels run on
    /// (not Burn's CubeCL CPU backend, nor a GPU).
    pub fn is_flex(&self) -> bool {
        is_flex(&self.device)
    }
}

/// Whether `device` (with or without autodiff) is flex.
pub(crate) fn is_flex(device: &Device) -> bool {
    #[cfg(feature = "flex")]
    return matches!(
        device.clone().inner().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    );
    #[cfg(not(feature = "flex"))]
    {
        let _ = device;
        false
    }
}

/// The CPU device, with `why` as its reason.
pub(crate) fn flex(why: &str) -> DeviceChoice {
    DeviceChoice {
        device: Device::flex(),
        name: "flex (CPU)".to_string(),
        why: why.to_string(),
        is_gpu: false,
        compile: String::new(),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(why: &str) -> DeviceChoice {
    DeviceChoice {
        device: Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        name: "wgpu (GPU)".to_string(),
        why: why.to_string(),
        is_gpu: true,
        compile: String::new(),
    }
}

/// How this build's CUDA kernels are compiled, where it is not CubeCL's
/// default (LLVM's NVPTX target): named in the device, so that every
/// report of a run says it.
#[cfg(feature = "cuda")]
const CUDA_COMPILER_NOTE: &str = if cfg!(feature = "cuda-cpp") {
    ", kernels compiled by NVRTC"
} else {
    ""
};

#[cfg(feature = "cuda")]
fn cuda(index: usize, why: &str) -> Result<DeviceChoice, TrainError> {
    cuda_ready().map_err(|why| TrainError::Backend {
        backend: "cuda".to_string(),
        why,
    })?;
    Ok(DeviceChoice {
        device: Device::cuda(index),
        name: format!("cuda (GPU {index}{})", CUDA_COMPILER_NOTE),
        why: why.to_string(),
        is_gpu: true,
        compile: String::new(),
    })
}

/// What the CUDA device needs where kiln runs, checked before it opens
/// (where CubeCL would panic instead): the NVIDIA driver's `libcuda`; in a
/// `cuda-cpp` build also the CUDA headers where CubeCL looks for them
/// (`CUDA_PATH`, else `/usr/local/cuda`, `/opt/cuda`, `/usr` with `nvcc`)
/// and a `libnvrtc` the loader finds.
#[cfg(feature = "cuda")]
fn cuda_ready() -> Result<(), String> {
    // SAFETY: tries to load the library by its usual names and reports
    // whether one loaded; calls nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the NVIDIA driver's libcuda could not be loaded: this machine has no NVIDIA driver (or it is not on the library path); set device.backend=auto to train on what the machine has".to_string());
    }
    #[cfg(feature = "cuda-cpp")]
    nvrtc_ready()?;
    Ok(())
}

/// The `cuda-cpp` half of [`cuda_ready`]: the headers and NVRTC.
#[cfg(feature = "cuda-cpp")]
fn nvrtc_ready() -> Result<(), String> {
    const HOW: &str = "this kiln compiles its CUDA kernels with NVRTC (the `cuda-cpp` feature), which needs a CUDA toolkit or PyTorch's CUDA wheels: set CUDA_PATH to the folder with include/ (e.g. …/site-packages/nvidia/cu13) and put its lib/ on LD_LIBRARY_PATH, or use a build without `cuda-cpp`";
    let root = cubecl::cuda::install::cuda_path().ok_or_else(|| {
        format!("no CUDA found (CUDA_PATH is unset and /usr/local/cuda is missing); {HOW}")
    })?;
    let header = root.join("include").join("cuda_bf16.h");
    if !header.is_file() {
        return Err(format!("{} is missing; {HOW}", header.display()));
    }
    // SAFETY: tries to load the library by its usual names and reports
    // whether one loaded; calls nothing in it.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!("libnvrtc could not be loaded; {HOW}"));
    }
    Ok(())
}

/// The CPU through Burn's CubeCL backend: Burn's own operations, none of
/// kiln's kernels; `auto` never picks it.
#[cfg(feature = "cubecl-cpu")]
fn cubecl_cpu(why: &str) -> DeviceChoice {
    DeviceChoice {
        device: Device::cpu(),
        name: "cubecl-cpu (CPU)".to_string(),
        why: why.to_string(),
        is_gpu: false,
        compile: String::new(),
    }
}

/// The backends this build of kiln has, in the order `auto` prefers them
/// (the CPU last; `auto` never picks `cubecl-cpu`): `["cuda", "wgpu",
/// "flex", "cubecl-cpu"]` at most.
pub const BACKENDS_BUILT_IN: &[&str] = &[
    #[cfg(feature = "cuda")]
    "cuda",
    #[cfg(feature = "wgpu")]
    "wgpu",
    "flex",
    #[cfg(feature = "cubecl-cpu")]
    "cubecl-cpu",
];

/// The device for `device.backend`. `auto` takes CUDA where this build has
/// the `cuda` feature and the machine has an NVIDIA GPU (`has_gpu`, from
/// NVML), else a wgpu GPU where it has the `wgpu` feature, else the CPU; a
/// backend this build lacks is an error naming the feature it needs.
pub fn select_device(device: &DeviceSection, has_gpu: bool) -> Result<DeviceChoice, TrainError> {
    // (A build with every backend lacks none.)
    #[cfg(not(all(feature = "wgpu", feature = "cuda", feature = "cubecl-cpu")))]
    let missing = |name: &str| TrainError::Backend {
        backend: name.to_string(),
        why: format!(
            "kiln was built without the `{name}` feature; rebuild with `--features {name}` or set device.backend=auto"
        ),
    };
    #[cfg(feature = "cuda")]
    let index = device.index;
    match device.backend {
        Backend::Flex => Ok(flex("device.backend = flex")),
        #[cfg(feature = "cuda")]
        Backend::Auto if has_gpu => cuda(
            index,
            "auto: an NVIDIA GPU is present and this build has the `cuda` backend",
        ),
        #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
        Backend::Auto if has_gpu => Ok(wgpu(
            "auto: an NVIDIA GPU is present and this build has the `wgpu` backend",
        )),
        Backend::Auto if has_gpu => Ok(flex(
            "auto: a GPU is present, but this build has no GPU backend (the `wgpu` and `cuda` features are off), so the CPU",
        )),
        Backend::Auto => Ok(flex("auto: no GPU, so the CPU")),
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => Ok(wgpu("device.backend = wgpu")),
        #[cfg(not(feature = "wgpu"))]
        Backend::Wgpu => Err(missing("wgpu")),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda(index, "device.backend = cuda"),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(missing("cuda")),
        #[cfg(feature = "cubecl-cpu")]
        Backend::CubeclCpu => Ok(cubecl_cpu("device.backend = cubecl-cpu")),
        #[cfg(not(feature = "cubecl-cpu"))]
        Backend::CubeclCpu => Err(missing("cubecl-cpu")),
    }
}
