#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! What machine is this? kiln-hwdetect reads the CPU (model, cores, ISA
//! features, frequency and an fp32 peak estimate), the memory, and the NVIDIA
//! GPUs through NVML loaded at run time (name, memory, compute capability,
//! driver and CUDA version, fp16/bf16/tf32/fp8 support and a dense peak from
//! a sourced table); on Linux also AMD's and Intel's GPUs, read from sysfs
//! (name, memory, AMD's graphics architecture, fp16/bf16 and a dense peak
//! where kiln's table has one), and on macOS Apple silicon's GPU (the chip,
//! its unified memory and GPU cores, from `sysctl` and `system_profiler`).
//!
//! It depends on no ML framework and never panics: with no driver, no NVML
//! library or no GPU the report says which and why.
#![warn(missing_docs)]

mod apple;
mod cpu;
mod drm;
mod gpu;
pub mod specs;
mod summary;

pub use apple::{apple_gpu_from, detect_apple_gpu};
pub use cpu::{CpuInfo, CpuPeak, IsaFeatures, detect_cpu, estimate_peak, flops_per_cycle};
pub use drm::{GpuVendor, OtherGpu, detect_drm_gpus};
pub use gpu::{DriverInfo, FixedProbe, GpuCapabilities, GpuInfo, GpuProbe, GpuStatus, NvmlProbe};
pub use specs::PeakFlops;

use serde::{Deserialize, Serialize};

/// Everything kiln knows about the machine, as one serialisable value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HardwareReport {
    /// The CPU: model, cores, ISA features and the fp32 peak estimate.
    pub cpu: CpuInfo,
    /// Host memory.
    pub memory: MemoryInfo,
    /// The NVIDIA GPUs, or why there are none.
    pub gpu: GpuStatus,
    /// The NVIDIA driver and CUDA versions, where there is a driver.
    pub driver: DriverInfo,
    /// Operating system, as sysinfo names it ("Debian GNU/Linux 12").
    pub os: String,
    /// The GPUs that are not NVIDIA's: AMD's and Intel's seen through
    /// Linux's sysfs, Apple silicon's through macOS's `sysctl` (NVML sees
    /// only NVIDIA's). Empty in reports saved before kiln read them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_gpus: Vec<OtherGpu>,
}

impl HardwareReport {
    /// The NVIDIA GPUs found (empty when none).
    pub fn gpus(&self) -> &[GpuInfo] {
        self.gpu.gpus()
    }

    /// The GPU of another vendor kiln would train on where there is no
    /// NVIDIA GPU: of those [`OtherGpu::trainable`], the one with the most
    /// memory, the first on a tie.
    pub fn other_gpu(&self) -> Option<&OtherGpu> {
        self.other_gpus
            .iter()
            .filter(|g| g.trainable())
            .rev()
            .max_by_key(|g| g.memory_total_bytes.unwrap_or(0))
    }

    /// Whose GPU a run trains on: NVIDIA's where NVML found one, else the
    /// vendor of [`other_gpu`](Self::other_gpu); `None` with no GPU.
    pub fn gpu_vendor(&self) -> Option<GpuVendor> {
        if self.gpus().is_empty() {
            self.other_gpu().map(|g| g.vendor)
        } else {
            Some(GpuVendor::Nvidia)
        }
    }

    /// A file-name-safe name for this class of machine, which tuned presets
    /// are kept under: the GPU kiln trains on (the one with the most memory,
    /// with the count when there are several), else the CPU and its cores —
    /// `gpu-nvidia-h200`, `gpu-2x-nvidia-a30`, `cpu-amd-epyc-2c`.
    pub fn machine_id(&self) -> String {
        let gpus = self.gpus();
        let raw = match gpus.iter().max_by_key(|g| g.memory_total_bytes) {
            Some(gpu) if gpus.len() > 1 => format!("gpu-{}x-{}", gpus.len(), gpu.name),
            Some(gpu) => format!("gpu-{}", gpu.name),
            None => format!("cpu-{}-{}c", self.cpu.model, self.cpu.logical_cores),
        };
        let mut id = String::new();
        for c in raw.chars() {
            if c.is_ascii_alphanumeric() {
                id.push(c.to_ascii_lowercase());
            } else if !id.ends_with('-') {
                id.push('-');
            }
        }
        id.trim_matches('-').to_string()
    }
}

/// Host memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct MemoryInfo {
    /// Installed RAM in bytes.
    pub total_bytes: u64,
    /// RAM available to a new process, in bytes.
    pub available_bytes: u64,
}

/// Reads this machine: NVML for NVIDIA's GPUs, sysfs for AMD's and
/// Intel's (`other_gpus`, Linux), `sysctl` and `system_profiler` for Apple
/// silicon's (macOS).
pub fn detect() -> HardwareReport {
    let mut report = detect_with(&NvmlProbe);
    report.other_gpus = detect_drm_gpus(std::path::Path::new("/"));
    report.other_gpus.extend(detect_apple_gpu());
    report
}

/// The NVIDIA GPUs as NVML sees them now (free memory included); empty
/// without a driver.
pub fn detect_gpus() -> Vec<GpuInfo> {
    match NvmlProbe.probe().0 {
        GpuStatus::Found { gpus } => gpus,
        GpuStatus::None { .. } => Vec::new(),
    }
}

/// This machine's CPU and memory with no GPU, whatever NVML or sysfs would
/// say: to plan a CPU run, and for tests that must not depend on the
/// machine's GPUs.
pub fn detect_cpu_only() -> HardwareReport {
    detect_with(&FixedProbe(
        GpuStatus::None {
            why: "a CPU-only report".into(),
        },
        DriverInfo::default(),
    ))
}

/// Reads this machine's CPU and memory, and asks `probe` for GPUs (sysfs is
/// not read: `other_gpus` is empty, so tests with a fixed probe see the same
/// report on any machine).
pub fn detect_with(probe: &dyn GpuProbe) -> HardwareReport {
    let (gpu, driver) = probe.probe();
    HardwareReport {
        cpu: detect_cpu(),
        memory: detect_memory(),
        gpu,
        driver,
        os: sysinfo::System::long_os_version().unwrap_or_else(|_| std::env::consts::OS.to_string()),
        other_gpus: Vec::new(),
    }
}

/// Total and available RAM. Zero where the OS does not tell.
pub fn detect_memory() -> MemoryInfo {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let refresh = RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram());
    match System::new_with_specifics(refresh) {
        Ok(sys) => MemoryInfo {
            total_bytes: sys.total_memory(),
            available_bytes: sys.available_memory(),
        },
        Err(_) => MemoryInfo {
            total_bytes: 0,
            available_bytes: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_probe_reaches_the_report() {
        let gpu = GpuInfo::new(0, "Tesla T4", 15 << 30, 14 << 30, (7, 5));
        let probe = FixedProbe(GpuStatus::Found { gpus: vec![gpu] }, DriverInfo::default());
        let report = detect_with(&probe);
        assert_eq!(report.gpus().len(), 1);
        assert_eq!(report.gpus()[0].table_model.as_deref(), Some("T4"));
        assert!(!report.gpus()[0].capabilities.bf16);
    }

    #[test]
    fn report_round_trips_through_json() {
        let report = detect_with(&FixedProbe(
            GpuStatus::None {
                why: "no driver".into(),
            },
            DriverInfo::default(),
        ));
        let text = serde_json::to_string(&report).expect("serialise");
        let back: HardwareReport = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, report);
        assert!(report.memory.total_bytes > 0);
    }

    #[test]
    fn the_other_gpu_trained_on_is_the_largest_known_or_discrete_one() {
        let mut report = detect_cpu_only();
        assert_eq!((report.other_gpu(), report.gpu_vendor()), (None, None));
        // A laptop's Intel iGPU (not in the table, no VRAM): nothing to train on.
        let igpu = OtherGpu::from_pci(0x8086, 0x46a6, None, None).expect("Intel");
        assert!(!igpu.fp16 && igpu.table_model.is_none());
        report.other_gpus = vec![igpu.clone()];
        assert_eq!(report.gpu_vendor(), None);
        // An unknown Radeon with 16 GB counts; the MI300X beside it wins.
        let radeon = OtherGpu::from_pci(0x1002, 0x73bf, Some(16 << 30), None).expect("AMD");
        assert_eq!(radeon.name, "AMD GPU 0x73bf");
        let mi300x = OtherGpu::from_pci(0x1002, 0x74a1, Some(192 << 30), None).expect("AMD");
        report.other_gpus = vec![igpu, radeon.clone(), mi300x];
        let chosen = report.other_gpu().expect("a GPU");
        assert_eq!(chosen.table_model.as_deref(), Some("Instinct MI300X"));
        assert_eq!(report.gpu_vendor(), Some(GpuVendor::Amd));
        // Two alike: the first.
        let mut second = radeon.clone();
        second.pci_slot = "0000:04:00.0".into();
        report.other_gpus = vec![radeon, second];
        assert_eq!(report.other_gpu().map(|g| g.pci_slot.as_str()), Some(""));
        assert!(OtherGpu::from_pci(0x10de, 0x2330, None, None).is_none());
        // NVML's GPUs come first.
        let h200 = GpuInfo::new(0, "NVIDIA H200", 141 << 30, 140 << 30, (9, 0));
        report.gpu = GpuStatus::Found { gpus: vec![h200] };
        assert_eq!(report.gpu_vendor(), Some(GpuVendor::Nvidia));
    }

    #[test]
    fn machine_ids_name_the_gpu_or_the_cpu() {
        let with = |gpus: Vec<GpuInfo>| {
            let mut r = detect_with(&FixedProbe(
                GpuStatus::Found { gpus },
                DriverInfo::default(),
            ));
            r.cpu.model = "AMD EPYC 9R45".into();
            r.cpu.logical_cores = 2;
            r
        };
        let h200 = GpuInfo::new(0, "NVIDIA H200", 141 << 30, 140 << 30, (9, 0));
        let a30 = |i| GpuInfo::new(i, "NVIDIA A30", 24 << 30, 23 << 30, (8, 0));
        assert_eq!(with(vec![h200]).machine_id(), "gpu-nvidia-h200");
        assert_eq!(with(vec![a30(0), a30(1)]).machine_id(), "gpu-2x-nvidia-a30");
        assert_eq!(with(Vec::new()).machine_id(), "cpu-amd-epyc-9r45-2c");
    }
}
