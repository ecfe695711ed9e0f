//! NVIDIA GPUs through NVML, loaded at run time, and what their compute
//! capability allows (fp16, bf16, tf32, fp8, tensor cores).

use serde::{Deserialize, Serialize};

use crate::specs::{self, PeakFlops};

/// One NVIDIA GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct GpuInfo {
    /// NVML's index (the CUDA ordinal on most systems).
    pub index: u32,
    /// The name NVML reports ("NVIDIA A100-SXM4-80GB").
    pub name: String,
    /// Device memory in bytes.
    pub memory_total_bytes: u64,
    /// Device memory free when detected, in bytes.
    pub memory_free_bytes: u64,
    /// CUDA compute capability, `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// What the compute capability supports (fp16, bf16, tf32, fp8, tensor cores).
    pub capabilities: GpuCapabilities,
    /// kiln's table row for this GPU, if it has one.
    pub table_model: Option<String>,
    /// Dense peak FLOP/s from kiln's table (`None`: not in the table).
    pub peak: Option<PeakFlops>,
    /// Where `peak` comes from.
    pub peak_source: Option<String>,
}

impl GpuInfo {
    /// Builds a GPU from NVML-style readings, deriving capabilities and the
    /// table entry. Tests use it to make fake GPUs.
    pub fn new(
        index: u32,
        name: &str,
        memory_total_bytes: u64,
        memory_free_bytes: u64,
        compute_capability: (u32, u32),
    ) -> Self {
        let spec = specs::lookup(name, memory_total_bytes);
        Self {
            index,
            name: name.to_string(),
            memory_total_bytes,
            memory_free_bytes,
            compute_capability,
            capabilities: GpuCapabilities::from_compute_capability(compute_capability),
            table_model: spec.map(|s| s.model.to_string()),
            peak: spec.map(|s| s.peak),
            peak_source: spec.map(|s| s.source.to_string()),
        }
    }

    /// Device memory in GiB.
    pub fn memory_total_gib(&self) -> f64 {
        self.memory_total_bytes as f64 / f64::from(1u32 << 30)
    }
}

/// What the GPU's architecture supports in hardware.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuCapabilities {
    /// Fast fp16 arithmetic (compute capability 5.3 or later).
    pub fp16: bool,
    /// bf16 arithmetic (8.0, Ampere, or later).
    pub bf16: bool,
    /// TF32 tensor-core matmuls (8.0 or later).
    pub tf32: bool,
    /// fp8 tensor cores (8.9, Ada and Hopper, or later).
    pub fp8: bool,
    /// Tensor cores (7.0, Volta, or later).
    pub tensor_cores: bool,
}

impl GpuCapabilities {
    /// The guides' table: Volta 7.0 and Turing 7.5 have fp16 tensor cores but
    /// no bf16/tf32; Ampere 8.0/8.6 and newer have all three; Ada 8.9 and
    /// Hopper 9.0 add fp8.
    pub fn from_compute_capability((major, minor): (u32, u32)) -> Self {
        let cc = major * 10 + minor;
        Self {
            fp16: cc >= 53,
            tensor_cores: cc >= 70,
            bf16: cc >= 80,
            tf32: cc >= 80,
            fp8: cc >= 89,
        }
    }
}

/// The outcome of looking for GPUs. Every way of finding none says why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum GpuStatus {
    /// NVML answered with at least one device.
    /// NVML found these GPUs.
    Found {
        /// One per device, in NVML's order.
        gpus: Vec<GpuInfo>,
    },
    /// No GPU to use; `why` is a sentence for the user.
    /// No GPU to use, and why, in a sentence for the user.
    None {
        /// Why, for the user ("no NVIDIA driver: …").
        why: String,
    },
}

impl GpuStatus {
    /// The GPUs found (empty when none).
    pub fn gpus(&self) -> &[GpuInfo] {
        match self {
            Self::Found { gpus } => gpus,
            Self::None { .. } => &[],
        }
    }
}

/// Driver and CUDA versions NVML reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverInfo {
    /// The driver version ("580.159.04").
    pub driver_version: Option<String>,
    /// The highest CUDA version the driver supports ("12.4").
    pub cuda_version: Option<String>,
}

/// The seam between kiln and the GPU driver: the real one asks NVML, tests
/// give fixed answers.
pub trait GpuProbe {
    /// The GPUs and the driver, or why there are none; never panics.
    fn probe(&self) -> (GpuStatus, DriverInfo);
}

/// Asks NVML (`libnvidia-ml.so.1`, loaded at run time).
#[derive(Clone, Copy, Debug, Default)]
pub struct NvmlProbe;

impl GpuProbe for NvmlProbe {
    fn probe(&self) -> (GpuStatus, DriverInfo) {
        use nvml_wrapper::error::NvmlError;
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                let why = match e {
                    NvmlError::LibloadingError(e) => {
                        format!("no NVIDIA driver: NVML could not be loaded ({e})")
                    }
                    NvmlError::DriverNotLoaded => {
                        "the NVIDIA driver is installed but not loaded (NVML: driver not loaded)"
                            .to_string()
                    }
                    NvmlError::NoPermission => {
                        "NVML has no permission to talk to the NVIDIA driver".to_string()
                    }
                    other => format!("NVML could not start: {other}"),
                };
                return (GpuStatus::None { why }, DriverInfo::default());
            }
        };
        let driver = DriverInfo {
            driver_version: nvml.sys_driver_version().ok(),
            cuda_version: nvml.sys_cuda_driver_version().ok().map(|v| {
                format!(
                    "{}.{}",
                    nvml_wrapper::cuda_driver_version_major(v),
                    nvml_wrapper::cuda_driver_version_minor(v)
                )
            }),
        };
        let count = match nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                let why = format!("NVML could not count devices: {e}");
                return (GpuStatus::None { why }, driver);
            }
        };
        let mut gpus = Vec::new();
        let mut failures = Vec::new();
        for index in 0..count {
            let read = || -> Result<GpuInfo, NvmlError> {
                let device = nvml.device_by_index(index)?;
                let memory = device.memory_info()?;
                let cc = device.cuda_compute_capability()?;
                let major = u32::try_from(cc.major).unwrap_or(0);
                let minor = u32::try_from(cc.minor).unwrap_or(0);
                Ok(GpuInfo::new(
                    index,
                    &device.name()?,
                    memory.total,
                    memory.free,
                    (major, minor),
                ))
            };
            match read() {
                Ok(gpu) => gpus.push(gpu),
                Err(e) => failures.push(format!("GPU {index}: {e}")),
            }
        }
        if gpus.is_empty() {
            let why = if failures.is_empty() {
                "the NVIDIA driver is loaded but reports no GPU".to_string()
            } else {
                format!("NVML could not read any GPU ({})", failures.join("; "))
            };
            return (GpuStatus::None { why }, driver);
        }
        (GpuStatus::Found { gpus }, driver)
    }
}

/// Fixed answers, for tests and for planning another machine.
#[derive(Clone, Debug)]
pub struct FixedProbe(pub GpuStatus, pub DriverInfo);

impl GpuProbe for FixedProbe {
    fn probe(&self) -> (GpuStatus, DriverInfo) {
        (self.0.clone(), self.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_follow_the_guides_table() {
        // (cc, fp16, bf16, tf32, fp8, tensor cores)
        let table = [
            ((7, 0), true, false, false, false, true), // V100
            ((7, 5), true, false, false, false, true), // T4
            ((8, 0), true, true, true, false, true),   // A100
            ((8, 6), true, true, true, false, true),   // A10, RTX 3090
            ((8, 9), true, true, true, true, true),    // L4, RTX 4090
            ((9, 0), true, true, true, true, true),    // H100
            ((6, 1), true, false, false, false, false),
        ];
        for (cc, fp16, bf16, tf32, fp8, tc) in table {
            let c = GpuCapabilities::from_compute_capability(cc);
            assert_eq!(
                (c.fp16, c.bf16, c.tf32, c.fp8, c.tensor_cores),
                (fp16, bf16, tf32, fp8, tc),
                "{cc:?}"
            );
        }
    }

    #[test]
    fn nvml_probe_never_panics_and_explains_an_absent_gpu() {
        let (status, _) = NvmlProbe.probe();
        if let GpuStatus::None { why } = status {
            assert!(!why.is_empty());
        }
    }
}
