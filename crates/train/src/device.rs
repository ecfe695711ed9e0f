//! Choosing the device: `device.backend = auto | cuda | rocm | wgpu | flex
//! | cubecl-cpu`. `auto` goes by whose GPU the machine has: CUDA for
//! NVIDIA's, ROCm/HIP for AMD's, wgpu (Vulkan, Metal) for those and for
//! Intel's and Apple's, as far as this build has them; else the CPU.
//! The `cuda` and `rocm` features link CubeCL's static LLVM (`cargo xtask
//! build-cuda` installs PyPI's for CUDA; ROCm's also needs LLD, which only
//! CubeCL's own bundle has); `wgpu` needs nothing but the GPU's driver.

use burn::tensor::Device;
use kiln_config::{Backend, DeviceSection};
use kiln_hwdetect::GpuVendor;

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
    /// Whether it is a GPU (CUDA, ROCm or wgpu).
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
pub(crate) fn flex(why: impl Into<String>) -> DeviceChoice {
    DeviceChoice {
        device: Device::flex(),
        name: "flex (CPU)".to_string(),
        why: why.into(),
        is_gpu: false,
        compile: String::new(),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(why: impl Into<String>) -> DeviceChoice {
    DeviceChoice {
        device: Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        name: "wgpu (GPU)".to_string(),
        why: why.into(),
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

/// The ROCm/HIP device `index`, once HIP's libraries load.
#[cfg(feature = "rocm")]
fn rocm(index: usize, why: impl Into<String>) -> Result<DeviceChoice, TrainError> {
    rocm_ready().map_err(|why| TrainError::Backend {
        backend: "rocm".to_string(),
        why: format!("{why}; or set device.backend=auto to train on what the machine has"),
    })?;
    Ok(DeviceChoice {
        device: Device::rocm(index),
        name: format!("rocm (GPU {index})"),
        why: why.into(),
        is_gpu: true,
        compile: String::new(),
    })
}

/// What the ROCm device needs where kiln runs: HIP's runtime and compiler
/// (`libamdhip64`, `libhiprtc`), which CubeCL loads at run time from
/// `ROCM_PATH`/`HIP_PATH` or the loader's path (where CubeCL would panic).
#[cfg(feature = "rocm")]
fn rocm_ready() -> Result<(), String> {
    if cubecl_hip_sys::is_available() {
        Ok(())
    } else {
        Err("ROCm's libamdhip64 and libhiprtc could not be loaded (install ROCm 6.x or 7.x and set ROCM_PATH, e.g. /opt/rocm)".to_string())
    }
}

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
/// (the CPU last; `auto` never picks `cubecl-cpu`): `["cuda", "rocm",
/// "wgpu", "flex", "cubecl-cpu"]` at most.
pub const BACKENDS_BUILT_IN: &[&str] = &[
    #[cfg(feature = "cuda")]
    "cuda",
    #[cfg(feature = "rocm")]
    "rocm",
    #[cfg(feature = "wgpu")]
    "wgpu",
    "flex",
    #[cfg(feature = "cubecl-cpu")]
    "cubecl-cpu",
];

/// The backend a build made with `built` (names from
/// [`BACKENDS_BUILT_IN`]) takes under `auto` for a GPU of `vendor`, and
/// why; or, where it has none for it, what to build (`Err`). A pure
/// function of its inputs, so that `kiln check-hardware` can say it for
/// each GPU, and tests can ask it for any vendor and build.
pub fn backend_for_vendor(
    vendor: GpuVendor,
    built: &[&str],
) -> Result<(&'static str, String), String> {
    let has = |b: &str| built.contains(&b);
    let who = vendor.name();
    let wgpu_api = if vendor == GpuVendor::Apple {
        "Metal"
    } else {
        "Vulkan"
    };
    match vendor {
        GpuVendor::Nvidia if has("cuda") => Ok((
            "cuda",
            "an NVIDIA GPU: CUDA, kiln's fastest path for it".into(),
        )),
        GpuVendor::Amd if has("rocm") => Ok((
            "rocm",
            "an AMD GPU: ROCm/HIP, with bf16 and matrix cores".into(),
        )),
        _ if has("wgpu") => Ok((
            "wgpu",
            format!(
                "an {who} GPU: wgpu through {wgpu_api}{}",
                match vendor {
                    GpuVendor::Nvidia => " (this build has no `cuda`)",
                    GpuVendor::Amd => " (this build has no `rocm`)",
                    _ => "",
                }
            ),
        )),
        GpuVendor::Nvidia => Err(
            "build with `cargo xtask build-cuda` (CUDA; or `--features vulkan` for Vulkan)".into(),
        ),
        GpuVendor::Amd => Err(
            "build with `--features rocm` (ROCm/HIP; its build downloads CubeCL's LLVM with LLD from GitHub: docs/HARDWARE.md) or `--features vulkan` (Vulkan)".into(),
        ),
        GpuVendor::Intel => Err("build with `--features vulkan` (Vulkan)".into()),
        GpuVendor::Apple => Err("build with `--features wgpu` (Metal)".into()),
    }
}

/// The device for `device.backend`. `auto` trains on the GPU of `gpu`'s
/// vendor (the machine's, from kiln-hwdetect's `gpu_vendor`) through the
/// backend [`backend_for_vendor`] names for this build: CUDA for NVIDIA,
/// ROCm/HIP for AMD (wgpu where HIP's libraries are missing), wgpu for
/// Intel and Apple; else the CPU. A backend this build lacks is an error
/// naming the feature it needs.
pub fn select_device(
    device: &DeviceSection,
    gpu: Option<GpuVendor>,
) -> Result<DeviceChoice, TrainError> {
    // (A build with every backend lacks none.)
    #[cfg(not(all(
        feature = "wgpu",
        feature = "cuda",
        feature = "rocm",
        feature = "cubecl-cpu"
    )))]
    let missing = |name: &str| TrainError::Backend {
        backend: name.to_string(),
        why: format!(
            "kiln was built without the `{name}` feature; rebuild with `--features {name}` or set device.backend=auto"
        ),
    };
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    let index = device.index;
    match device.backend {
        Backend::Flex => Ok(flex("device.backend = flex")),
        Backend::Auto => auto_device(device, gpu),
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => Ok(wgpu("device.backend = wgpu")),
        #[cfg(not(feature = "wgpu"))]
        Backend::Wgpu => Err(missing("wgpu")),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda(index, "device.backend = cuda"),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(missing("cuda")),
        #[cfg(feature = "rocm")]
        Backend::Rocm => rocm(index, "device.backend = rocm"),
        #[cfg(not(feature = "rocm"))]
        Backend::Rocm => Err(missing("rocm")),
        #[cfg(feature = "cubecl-cpu")]
        Backend::CubeclCpu => Ok(cubecl_cpu("device.backend = cubecl-cpu")),
        #[cfg(not(feature = "cubecl-cpu"))]
        Backend::CubeclCpu => Err(missing("cubecl-cpu")),
    }
}

/// `auto`: the backend for the machine's GPU, else the CPU.
fn auto_device(device: &DeviceSection, gpu: Option<GpuVendor>) -> Result<DeviceChoice, TrainError> {
    let Some(vendor) = gpu else {
        return Ok(flex("auto: no GPU, so the CPU"));
    };
    let _ = device;
    match backend_for_vendor(vendor, BACKENDS_BUILT_IN) {
        #[cfg(feature = "cuda")]
        Ok(("cuda", why)) => cuda(device.index, &format!("auto: {why}")),
        #[cfg(feature = "rocm")]
        Ok(("rocm", why)) => match rocm_ready() {
            Ok(()) => rocm(device.index, format!("auto: {why}")),
            #[cfg(feature = "wgpu")]
            Err(e) => Ok(wgpu(format!(
                "auto: an AMD GPU, but {e}; so wgpu through Vulkan"
            ))),
            #[cfg(not(feature = "wgpu"))]
            Err(e) => Ok(flex(format!("auto: an AMD GPU, but {e}; so the CPU"))),
        },
        #[cfg(feature = "wgpu")]
        Ok(("wgpu", why)) => Ok(wgpu(format!("auto: {why}"))),
        Ok((other, _)) => unreachable!("backend_for_vendor named `{other}`, which is not built in"),
        Err(build) => Ok(flex(format!(
            "auto: an {} GPU is present, but this build has no backend for it, so the CPU; {build}",
            vendor.name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_vendor_gets_its_backend_or_what_to_build() {
        let all = ["cuda", "rocm", "wgpu", "flex"];
        let pick = |v, built: &[&str]| backend_for_vendor(v, built).map(|(b, _)| b);
        assert_eq!(pick(GpuVendor::Nvidia, &all), Ok("cuda"));
        assert_eq!(pick(GpuVendor::Amd, &all), Ok("rocm"));
        assert_eq!(pick(GpuVendor::Intel, &all), Ok("wgpu"));
        assert_eq!(pick(GpuVendor::Apple, &all), Ok("wgpu"));
        // Without the vendor's own backend, Vulkan through wgpu, and why.
        let wgpu_only = ["wgpu", "flex"];
        let (b, why) = backend_for_vendor(GpuVendor::Amd, &wgpu_only).expect("wgpu");
        assert_eq!(b, "wgpu");
        assert_eq!(
            why,
            "an AMD GPU: wgpu through Vulkan (this build has no `rocm`)"
        );
        let (_, why) = backend_for_vendor(GpuVendor::Apple, &wgpu_only).expect("wgpu");
        assert_eq!(why, "an Apple GPU: wgpu through Metal");
        // The CPU build: what to build, for each vendor.
        let cpu = ["flex"];
        let build = |v| backend_for_vendor(v, &cpu).expect_err("no GPU backend");
        assert!(build(GpuVendor::Nvidia).contains("cargo xtask build-cuda`"));
        assert!(build(GpuVendor::Amd).contains("`--features rocm`"));
        assert!(build(GpuVendor::Intel).contains("--features vulkan"));
        assert!(build(GpuVendor::Apple).contains("(Metal)"));
        // An NVIDIA build reaches no AMD GPU through CUDA.
        assert!(backend_for_vendor(GpuVendor::Amd, &["cuda", "flex"]).is_err());
    }

    #[test]
    fn auto_in_this_build_follows_the_vendor() {
        let section: DeviceSection =
            toml::from_str("backend = \"auto\"\nindex = 0").expect("a device section");
        let none = select_device(&section, None).expect("the CPU");
        assert_eq!(
            (none.name.as_str(), none.why.as_str()),
            ("flex (CPU)", "auto: no GPU, so the CPU")
        );
        for vendor in [GpuVendor::Amd, GpuVendor::Intel, GpuVendor::Apple] {
            match select_device(&section, Some(vendor)) {
                // A build with a backend for it opens it (a GPU build on a
                // machine without that GPU may fail to open it: not asked here).
                Ok(d) if d.is_gpu => assert!(d.why.starts_with("auto: an "), "{}", d.why),
                Ok(d) => {
                    let wgpu_built = BACKENDS_BUILT_IN.contains(&"wgpu");
                    assert!(!wgpu_built, "{vendor:?}: {}", d.why);
                    assert!(
                        d.why
                            .contains("this build has no backend for it, so the CPU; build with"),
                        "{}",
                        d.why
                    );
                }
                Err(e) => panic!("{vendor:?}: {e}"),
            }
        }
    }
}
