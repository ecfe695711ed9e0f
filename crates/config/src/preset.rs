//! Choosing a hardware preset from a hardware report: a pure function, so
//! that every GPU the guides name can be tested on a machine without one.

use kiln_hwdetect::{GpuInfo, GpuVendor, HardwareReport, OtherGpu};

use crate::schema::{AmpDtype, PrecisionSection};

/// The preset chosen for a machine, and why, in one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresetChoice {
    /// The preset's name.
    pub name: String,
    /// Why, in a sentence: the GPU (or its absence) and what decided.
    pub why: String,
    /// The GPU the preset was chosen for (`None` on the CPU).
    pub gpu_index: Option<u32>,
}

/// Which GPUs each GPU preset is written for, by kiln-hwdetect's table model.
/// The chooser and the "is this preset for this machine" check both read it.
pub const PRESET_GPUS: &[(&str, &[&str])] = &[
    ("t4", &["T4"]),
    ("v100", &["V100 PCIe", "V100 SXM2"]),
    ("a30", &["A30"]),
    ("a40", &["A40"]),
    ("a100_80gb", &["A100 80GB"]),
    ("a100", &["A100 40GB", "A100 80GB"]),
    ("gpu_3090", &["RTX 3090"]),
    ("gpu_4080", &["RTX 4080"]),
    ("gpu_4090", &["RTX 4090"]),
    ("h100", &["H100 PCIe", "H100 SXM", "H200"]),
];

/// Which GPUs that are not NVIDIA's each of their presets is written for,
/// by kiln-hwdetect's table model (`OtherGpu::table_model`); `apple_m` is
/// for every Apple GPU.
pub const PRESET_OTHER_GPUS: &[(&str, &[&str])] = &[
    ("mi300x", &["Instinct MI300X"]),
    (
        "mi250",
        &[
            "Instinct MI250X (one GCD)",
            "Instinct MI250X/MI250 (one GCD)",
            "Instinct MI210",
        ],
    ),
    (
        "rx_7900_xtx",
        &["Radeon RX 7900 XTX", "Radeon RX 7900 XT/GRE"],
    ),
    ("arc_a770", &["Arc A770", "Arc A750"]),
];

/// The preset for Apple silicon's GPU.
pub const APPLE_PRESET: &str = "apple_m";

/// Presets for any GPU.
pub const ANY_GPU_PRESETS: &[&str] = &["low_mem", "conservative"];

/// Picks the hardware preset for a machine.
///
/// No GPU → `cpu`. Otherwise the GPU with the most memory decides: a GPU with
/// a preset of its own gets it; another is placed by memory and bf16 support
/// (under 13 GiB → `low_mem`; no bf16 → `conservative`; else the preset of
/// the closest class by memory).
pub fn choose_preset(report: &HardwareReport) -> PresetChoice {
    let gpus = report.gpus();
    let Some(gpu) = gpus.iter().max_by(|a, b| {
        a.memory_total_bytes
            .cmp(&b.memory_total_bytes)
            .then(b.index.cmp(&a.index))
    }) else {
        return match report.other_gpu() {
            Some(gpu) => other_choice(gpu),
            None => cpu_choice(report),
        };
    };
    let (name, reason) = gpu_preset(gpu);
    let cc = gpu.compute_capability;
    let precision = if gpu.capabilities.bf16 {
        "bf16".to_string()
    } else if gpu.capabilities.fp16 {
        "no bf16 → fp16".to_string()
    } else {
        "no bf16/fp16 → fp32".to_string()
    };
    let mut why = format!(
        "{}: compute capability {}.{}, {precision}; {:.0} GiB",
        gpu.table_model.as_deref().unwrap_or(&gpu.name),
        cc.0,
        cc.1,
        gpu.memory_total_gib()
    );
    if let Some(reason) = reason {
        why.push_str(&format!(" ({reason})"));
    }
    if gpus.len() > 1 {
        let same = gpus.iter().filter(|g| g.name == gpu.name).count();
        let what = if same == gpus.len() {
            format!("{} × {}", gpus.len(), gpu.name)
        } else {
            format!("{} GPUs", gpus.len())
        };
        why.push_str(&format!(
            "; {what}: kiln trains on one device, GPU {} (device.index)",
            gpu.index
        ));
    }
    PresetChoice {
        name: name.to_string(),
        why,
        gpu_index: Some(gpu.index),
    }
}

fn cpu_choice(report: &HardwareReport) -> PresetChoice {
    let no_gpu = match &report.gpu {
        kiln_hwdetect::GpuStatus::None { why } => why.clone(),
        kiln_hwdetect::GpuStatus::Found { .. } => String::from("no GPU"),
    };
    // GPUs seen but too small to train on (integrated ones): say so.
    let others = match report.other_gpus.as_slice() {
        [] => String::new(),
        gpus => format!(
            "; {} seen: an integrated GPU, slower than the CPU's kernels",
            gpus.iter()
                .map(|g| g.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let isa = report.cpu.features.simd_class();
    let gib = report.memory.total_bytes as f64 / f64::from(1u32 << 30);
    PresetChoice {
        name: "cpu".to_string(),
        why: format!(
            "no GPU to train on ({no_gpu}{others}); {} cores {isa}, {gib:.0} GiB RAM → cpu",
            report.cpu.logical_cores
        ),
        gpu_index: None,
    }
}

/// The choice for a GPU that is not NVIDIA's ([`HardwareReport::other_gpu`]).
fn other_choice(gpu: &OtherGpu) -> PresetChoice {
    let (name, reason) = other_preset(gpu);
    let what = gpu.table_model.as_deref().unwrap_or(&gpu.name);
    let arch = gpu
        .architecture
        .as_deref()
        .map(|a| format!(" ({a})"))
        .unwrap_or_default();
    let memory = match gpu.memory_total_gib() {
        Some(gib) if gpu.unified_memory => {
            format!("{gib:.0} GiB unified memory, about 75 % of it for the GPU")
        }
        Some(gib) => format!("{gib:.0} GiB"),
        None => "memory not reported".to_string(),
    };
    let precision = match (gpu.bf16, gpu.fp16) {
        (true, _) => "bf16",
        (false, true) => "fp16",
        (false, false) => "bf16/fp16 not in kiln's table",
    };
    let mut why = format!("{} {what}{arch}: {precision}; {memory}", gpu.vendor.name());
    if let Some(reason) = reason {
        why.push_str(&format!(" ({reason})"));
    }
    PresetChoice {
        name: name.to_string(),
        why,
        gpu_index: None,
    }
}

/// The preset for a GPU that is not NVIDIA's and, where it has none of its
/// own, why this one: Apple's have `apple_m`; another is placed by memory.
fn other_preset(gpu: &OtherGpu) -> (&'static str, Option<String>) {
    if gpu.vendor == GpuVendor::Apple {
        return (APPLE_PRESET, None);
    }
    if let Some(model) = gpu.table_model.as_deref()
        && let Some((preset, _)) = PRESET_OTHER_GPUS.iter().find(|(_, ms)| ms.contains(&model))
    {
        return (preset, None);
    }
    let gib = gpu.memory_total_gib().unwrap_or(0.0);
    let (preset, class) = if gib >= 100.0 {
        ("mi300x", "over 100 GB, like an MI300X")
    } else if gib >= 40.0 {
        ("mi250", "40-64 GB, like one GCD of an MI250")
    } else if gib >= 20.0 {
        ("rx_7900_xtx", "20-24 GB, like a Radeon RX 7900 XTX")
    } else if gib >= 13.0 {
        ("arc_a770", "16 GB, like an Arc A770 (fp16)")
    } else {
        ("low_mem", "an 8-12 GB card")
    };
    (
        preset,
        Some(format!(
            "{} has no preset of its own: {class}",
            gpu.table_model.as_deref().unwrap_or("this GPU")
        )),
    )
}

/// The preset for one GPU and, where it has none of its own, why this one.
fn gpu_preset(gpu: &GpuInfo) -> (&'static str, Option<String>) {
    if let Some(model) = gpu.table_model.as_deref()
        && let Some((preset, _)) = PRESET_GPUS.iter().find(|(_, ms)| ms.contains(&model))
    {
        return (preset, None);
    }
    let gib = gpu.memory_total_gib();
    let what = gpu.table_model.as_deref().unwrap_or("this GPU");
    let (preset, class) = if gib < 13.0 {
        ("low_mem", "an 8–12 GB card")
    } else if !gpu.capabilities.bf16 {
        (
            "conservative",
            "no bf16, so the broad-compatibility settings",
        )
    } else if gib >= 70.0 {
        ("a100_80gb", "80 GB with bf16, like an A100 80GB")
    } else if gib >= 40.0 {
        ("a40", "48 GB with bf16, like an A40")
    } else if gib >= 20.0 {
        ("gpu_3090", "24 GB with bf16, like an RTX 3090")
    } else {
        ("gpu_4080", "16 GB with bf16, like an RTX 4080")
    };
    (
        preset,
        Some(format!("{what} has no preset of its own: {class}")),
    )
}

/// A hardware preset named for a machine that lacks its GPU.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("hardware preset `{preset}` is for {needs}, but {have}")]
pub struct PresetMismatch {
    /// The preset.
    pub preset: String,
    /// The GPUs it is written for: "RTX 4090", "an NVIDIA GPU".
    pub needs: String,
    /// What the machine has: "this machine has no GPU (no NVIDIA driver)".
    pub have: String,
}

/// Whether a named hardware preset is meant for this machine: the error
/// says what the preset needs and what the machine has. Presets kiln does
/// not know (user-written, tuned) always fit.
pub fn check_preset_fits(preset: &str, report: &HardwareReport) -> Result<(), PresetMismatch> {
    let gpus = report.gpus();
    let have = if gpus.is_empty() {
        match &report.gpu {
            kiln_hwdetect::GpuStatus::None { why } => format!("this machine has no GPU ({why})"),
            kiln_hwdetect::GpuStatus::Found { .. } => "this machine has no GPU".to_string(),
        }
    } else {
        let names: Vec<&str> = gpus.iter().map(|g| g.name.as_str()).collect();
        format!("this machine has {}", names.join(", "))
    };
    let others: Vec<&str> = report.other_gpus.iter().map(|g| g.name.as_str()).collect();
    let have = match (gpus.is_empty(), others.as_slice()) {
        (_, []) => have,
        (true, _) => format!("this machine has {}", others.join(", ")),
        (false, _) => format!("{have}, {}", others.join(", ")),
    };
    let other_named = PRESET_OTHER_GPUS.iter().find(|(p, _)| *p == preset);
    if other_named.is_some() || preset == APPLE_PRESET {
        let needs = match other_named {
            Some((_, models)) => models.join(" / "),
            None => "an Apple silicon GPU".to_string(),
        };
        // A GPU fits the preset written for it (its table model's, or
        // Apple's), and the GPU kiln trains on the preset chosen for it.
        let fits = report.other_gpus.iter().any(|g| {
            let (chosen, placed_by_memory) = other_preset(g);
            chosen == preset && (placed_by_memory.is_none() || report.other_gpu() == Some(g))
        });
        return if fits {
            Ok(())
        } else {
            Err(PresetMismatch {
                preset: preset.to_string(),
                needs,
                have,
            })
        };
    }
    if let Some((_, models)) = PRESET_GPUS.iter().find(|(p, _)| *p == preset) {
        // A GPU fits the presets written for it and the one kiln would choose for it.
        let fits = gpus.iter().any(|g| {
            g.table_model
                .as_deref()
                .is_some_and(|m| models.contains(&m))
                || gpu_preset(g).0 == preset
        });
        return if fits {
            Ok(())
        } else {
            Err(PresetMismatch {
                preset: preset.to_string(),
                needs: models.join(" / "),
                have,
            })
        };
    }
    if ANY_GPU_PRESETS.contains(&preset) && gpus.is_empty() && report.other_gpu().is_none() {
        return Err(PresetMismatch {
            preset: preset.to_string(),
            needs: "a GPU".to_string(),
            have,
        });
    }
    Ok(())
}

/// The precision a run computes in, as the machine's capabilities decide it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectivePrecision {
    /// The dtype products compute in (`None`: f32); parameters stay f32.
    pub compute: Option<AmpDtype>,
    /// "bf16 compute, f32 master weights", "f32, TF32 matmuls", ...
    pub label: String,
    /// Why, in a sentence: the setting and what the GPU supports.
    pub why: String,
}

impl EffectivePrecision {
    /// The label for computing in `compute` (f32 master weights either way).
    pub fn label_for(compute: Option<AmpDtype>) -> String {
        match compute {
            None => "f32".to_string(),
            Some(AmpDtype::Bf16) => "bf16 compute, f32 master weights".to_string(),
            Some(AmpDtype::Fp16) => {
                "fp16 compute with dynamic loss scaling, f32 master weights".to_string()
            }
        }
    }

    fn new(compute: Option<AmpDtype>, suffix: &str, why: String) -> Self {
        Self {
            compute,
            label: format!("{}{suffix}", Self::label_for(compute)),
            why,
        }
    }
}

/// The compute precision a run will use, and why: on a GPU (`gpu`) its
/// compute capability decides (bf16 from Ampere on, else fp16 — the guides'
/// T4 rule — else f32); on the CPU (`None`) `precision.amp` is honoured, and
/// the reason says it is slower there.
pub fn effective_precision(
    precision: &PrecisionSection,
    gpu: Option<&GpuInfo>,
) -> EffectivePrecision {
    let Some(gpu) = gpu else {
        if !precision.amp {
            return EffectivePrecision::new(None, "", "precision.amp is off".to_string());
        }
        return EffectivePrecision::new(
            Some(precision.amp_dtype),
            "",
            "precision.amp asked for on the CPU: flex computes bf16/fp16 by converting to f32, so it is slower than f32 there (the CPU presets keep amp off)".to_string(),
        );
    };
    let caps = gpu.capabilities;
    let tf32 = if precision.tf32 && caps.tf32 {
        ", TF32 matmuls"
    } else {
        ""
    };
    if !precision.amp {
        return EffectivePrecision::new(None, tf32, "precision.amp is off".to_string());
    }
    let cc = gpu.compute_capability;
    match precision.amp_dtype {
        AmpDtype::Bf16 if caps.bf16 => EffectivePrecision::new(
            Some(AmpDtype::Bf16),
            tf32,
            format!("compute capability {}.{} has bf16", cc.0, cc.1),
        ),
        AmpDtype::Bf16 if caps.fp16 => EffectivePrecision::new(
            Some(AmpDtype::Fp16),
            "",
            format!(
                "bf16 asked for, but compute capability {}.{} has no bf16 → fp16",
                cc.0, cc.1
            ),
        ),
        AmpDtype::Fp16 if caps.fp16 => EffectivePrecision::new(
            Some(AmpDtype::Fp16),
            "",
            "precision.amp_dtype = fp16".to_string(),
        ),
        _ => EffectivePrecision::new(
            None,
            tf32,
            format!(
                "compute capability {}.{} has neither bf16 nor fp16",
                cc.0, cc.1
            ),
        ),
    }
}

/// The precision `precision` comes to on a GPU that is not NVIDIA's, from
/// kiln's table's fp16/bf16 flags; a GPU not in the table gets what was
/// asked, and the device decides when the run opens it (wgpu has no bf16,
/// whatever the chip has).
pub fn other_gpu_precision(precision: &PrecisionSection, gpu: &OtherGpu) -> EffectivePrecision {
    if !precision.amp {
        return EffectivePrecision::new(None, "", "precision.amp is off".to_string());
    }
    let name = gpu.table_model.as_deref().unwrap_or(&gpu.name);
    match precision.amp_dtype {
        AmpDtype::Bf16 if gpu.bf16 => EffectivePrecision::new(
            Some(AmpDtype::Bf16),
            "",
            format!("the {name} has bf16 (on ROCm; wgpu has none, so fp16 there)"),
        ),
        AmpDtype::Bf16 if gpu.fp16 => EffectivePrecision::new(
            Some(AmpDtype::Fp16),
            "",
            format!("bf16 asked for, but the {name} has no bf16 → fp16"),
        ),
        AmpDtype::Fp16 if gpu.fp16 => EffectivePrecision::new(
            Some(AmpDtype::Fp16),
            "",
            "precision.amp_dtype = fp16".to_string(),
        ),
        asked => EffectivePrecision::new(
            Some(asked),
            "",
            format!(
                "precision.amp_dtype = {}; the {name} is not in kiln's table, so the device decides when the run opens it",
                asked.name()
            ),
        ),
    }
}

/// The precision a run comes to on `hardware`'s GPU: NVIDIA's `gpu` where
/// there is one ([`effective_precision`]), else the other vendor's GPU kiln
/// trains on ([`other_gpu_precision`]), else the CPU's.
pub fn machine_precision(
    precision: &PrecisionSection,
    gpu: Option<&GpuInfo>,
    hardware: &HardwareReport,
) -> EffectivePrecision {
    match (gpu, hardware.other_gpu()) {
        (None, Some(other)) => other_gpu_precision(precision, other),
        (gpu, _) => effective_precision(precision, gpu),
    }
}

#[cfg(test)]
mod tests {
    use kiln_hwdetect::{DriverInfo, FixedProbe, GpuStatus, detect_with};

    use super::*;

    const GIB: u64 = 1 << 30;

    fn machine(gpus: &[(&str, u64, (u32, u32))]) -> HardwareReport {
        let status = if gpus.is_empty() {
            GpuStatus::None {
                why: "no NVIDIA driver".into(),
            }
        } else {
            GpuStatus::Found {
                gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(i, (name, gib, cc))| {
                        GpuInfo::new(i as u32, name, gib * GIB, gib * GIB / 2, *cc)
                    })
                    .collect(),
            }
        };
        detect_with(&FixedProbe(status, DriverInfo::default()))
    }

    /// Checks the preset chosen for a machine and that the why contains each of `why`.
    fn check(gpus: &[(&str, u64, (u32, u32))], preset: &str, why: &[&str]) {
        let choice = choose_preset(&machine(gpus));
        assert_eq!(choice.name, preset, "{gpus:?}: {}", choice.why);
        for part in why {
            assert!(
                choice.why.contains(part),
                "{gpus:?}: `{}` lacks `{part}`",
                choice.why
            );
        }
        assert_eq!(
            check_preset_fits(preset, &machine(gpus)),
            Ok(()),
            "{gpus:?}"
        );
    }

    #[test]
    fn every_gpu_of_the_guides_gets_its_preset_and_why() {
        check(
            &[("Tesla T4", 15, (7, 5))],
            "t4",
            &["T4: compute capability 7.5, no bf16 → fp16; 15 GiB"],
        );
        check(
            &[("Tesla V100-SXM2-16GB", 16, (7, 0))],
            "v100",
            &["compute capability 7.0, no bf16 → fp16"],
        );
        check(
            &[("NVIDIA A10", 24, (8, 6))],
            "gpu_3090",
            &["A10:", "no preset of its own", "like an RTX 3090"],
        );
        check(
            &[("NVIDIA A30", 24, (8, 0))],
            "a30",
            &["A30: compute capability 8.0, bf16; 24 GiB"],
        );
        check(&[("NVIDIA A40", 48, (8, 6))], "a40", &["bf16; 48 GiB"]);
        check(
            &[("NVIDIA A100-SXM4-40GB", 40, (8, 0))],
            "a100",
            &["A100 40GB"],
        );
        check(
            &[("NVIDIA A100-SXM4-80GB", 80, (8, 0))],
            "a100_80gb",
            &["A100 80GB"],
        );
        check(
            &[("NVIDIA L4", 24, (8, 9))],
            "gpu_3090",
            &["L4:", "no preset of its own"],
        );
        check(
            &[("NVIDIA GeForce RTX 3060", 12, (8, 6))],
            "low_mem",
            &["RTX 3060", "8–12 GB"],
        );
        check(
            &[("NVIDIA GeForce RTX 3090", 24, (8, 6))],
            "gpu_3090",
            &["RTX 3090: compute capability 8.6, bf16"],
        );
        check(
            &[("NVIDIA GeForce RTX 4080", 16, (8, 9))],
            "gpu_4080",
            &["RTX 4080"],
        );
        check(
            &[("NVIDIA GeForce RTX 4090", 24, (8, 9))],
            "gpu_4090",
            &["RTX 4090: compute capability 8.9, bf16; 24 GiB"],
        );
        check(
            &[("NVIDIA H100 80GB HBM3", 80, (9, 0))],
            "h100",
            &["H100 SXM: compute capability 9.0"],
        );
        check(&[("NVIDIA H100 PCIe", 80, (9, 0))], "h100", &["H100 PCIe"]);
        check(
            &[("NVIDIA H200", 141, (9, 0))],
            "h100",
            &["H200", "141 GiB"],
        );
    }

    #[test]
    fn unknown_gpus_are_placed_by_memory_and_bf16() {
        check(
            &[("NVIDIA GeForce RTX 2080 Ti", 11, (7, 5))],
            "low_mem",
            &["this GPU has no preset"],
        );
        check(
            &[("Quadro RTX 6000", 24, (7, 5))],
            "conservative",
            &["no bf16"],
        );
        check(&[("NVIDIA RTX A6000", 48, (8, 6))], "a40", &["like an A40"]);
        check(&[("NVIDIA RTX 4000 Ada", 20, (8, 9))], "gpu_3090", &[]);
        check(
            &[("NVIDIA GeForce RTX 4060 Ti", 16, (8, 9))],
            "gpu_4080",
            &[],
        );
    }

    /// A machine with no NVIDIA GPU and `others` seen by sysfs or sysctl.
    fn other_machine(others: Vec<OtherGpu>) -> HardwareReport {
        let mut report = machine(&[]);
        report.other_gpus = others;
        report
    }

    fn amd(device: u16, gib: u64, product: &str) -> OtherGpu {
        OtherGpu::from_pci(0x1002, device, Some(gib * GIB), Some(product.into())).expect("AMD")
    }

    /// Checks the preset chosen for `others`, its why, and that it fits.
    fn check_other(others: Vec<OtherGpu>, preset: &str, why: &[&str]) {
        let report = other_machine(others);
        let choice = choose_preset(&report);
        assert_eq!(choice.name, preset, "{}", choice.why);
        for part in why {
            assert!(choice.why.contains(part), "`{}` lacks `{part}`", choice.why);
        }
        assert_eq!(choice.gpu_index, None);
        assert_eq!(check_preset_fits(preset, &report), Ok(()));
    }

    #[test]
    fn amd_intel_and_apple_gpus_get_their_presets_and_why() {
        check_other(
            vec![amd(0x74a1, 192, "AMD Instinct MI300X")],
            "mi300x",
            &["AMD Instinct MI300X: bf16; 192 GiB"],
        );
        let gcd = amd(0x740c, 64, "AMD Instinct MI250X");
        check_other(
            vec![gcd.clone(), gcd],
            "mi250",
            &["Instinct MI250X (one GCD)", "64 GiB"],
        );
        check_other(vec![amd(0x740f, 64, "AMD Instinct MI210")], "mi250", &[]);
        check_other(
            vec![amd(0x744c, 24, "AMD Radeon RX 7900 XTX")],
            "rx_7900_xtx",
            &["Radeon RX 7900 XTX"],
        );
        let arc = OtherGpu::from_pci(0x8086, 0x56a0, None, None).expect("Intel");
        check_other(
            vec![arc],
            "arc_a770",
            &["Intel Arc A770", "memory not reported"],
        );
        let m2 =
            kiln_hwdetect::apple_gpu_from("Apple M2 Max", 96 * GIB, "Total Number of Cores: 38\n")
                .expect("Apple");
        check_other(
            vec![m2],
            "apple_m",
            &[
                "Apple M2 Max (Apple M2): fp16",
                "96 GiB unified memory, about 75 % of it for the GPU",
            ],
        );
    }

    #[test]
    fn unknown_amd_gpus_are_placed_by_memory_and_igpus_left_to_the_cpu() {
        // A Radeon RX 6800 (16 GB, not in the table).
        check_other(
            vec![amd(0x73bf, 16, "AMD Radeon RX 6800")],
            "arc_a770",
            &["this GPU has no preset of its own", "16 GB"],
        );
        check_other(
            vec![amd(0x7448, 48, "AMD Radeon Pro W7900")],
            "mi250",
            &["like one GCD of an MI250"],
        );
        // An APU's 512 MiB carve-out is no GPU to train on.
        let apu = OtherGpu::from_pci(0x1002, 0x15bf, Some(512 << 20), None).expect("AMD");
        let report = other_machine(vec![apu]);
        let choice = choose_preset(&report);
        assert_eq!(choice.name, "cpu");
        assert!(choice.why.contains("an integrated GPU"), "{}", choice.why);
    }

    #[test]
    fn other_gpus_compute_in_what_the_table_says_they_have() {
        let p = |amp: bool, dtype: AmpDtype| PrecisionSection {
            amp,
            amp_dtype: dtype,
            tf32: false,
            max_bad_steps: 5,
            loss_scale_init: 65536.0,
            loss_scale_growth_interval: 2000,
            reduce_dtype: crate::schema::ReduceDtype::F32,
        };
        let mi300x = other_machine(vec![amd(0x74a1, 192, "AMD Instinct MI300X")]);
        let bf16 = machine_precision(&p(true, AmpDtype::Bf16), None, &mi300x);
        assert_eq!(bf16.compute, Some(AmpDtype::Bf16));
        assert!(
            bf16.why.contains("Instinct MI300X has bf16"),
            "{}",
            bf16.why
        );
        let off = machine_precision(&p(false, AmpDtype::Bf16), None, &mi300x);
        assert_eq!(off.compute, None);
        let m1 = kiln_hwdetect::apple_gpu_from("Apple M1", 16 * GIB, "").expect("Apple");
        let apple = other_machine(vec![m1]);
        let fp16 = machine_precision(&p(true, AmpDtype::Bf16), None, &apple);
        assert_eq!(fp16.compute, Some(AmpDtype::Fp16), "{}", fp16.why);
        let unknown = other_machine(vec![amd(0x73bf, 16, "AMD Radeon RX 6800")]);
        let asked = machine_precision(&p(true, AmpDtype::Bf16), None, &unknown);
        assert_eq!(asked.compute, Some(AmpDtype::Bf16));
        assert!(asked.why.contains("the device decides"), "{}", asked.why);
        // No GPU: the CPU's answer.
        let cpu = machine_precision(&p(true, AmpDtype::Bf16), None, &machine(&[]));
        assert!(cpu.why.contains("on the CPU"), "{}", cpu.why);
    }

    #[test]
    fn presets_of_other_vendors_fit_only_their_gpus() {
        let radeon = other_machine(vec![amd(0x744c, 24, "AMD Radeon RX 7900 XTX")]);
        let err = check_preset_fits("mi300x", &radeon).expect_err("no MI300X");
        assert_eq!(err.needs, "Instinct MI300X");
        assert_eq!(err.have, "this machine has AMD Radeon RX 7900 XTX");
        let err = check_preset_fits("apple_m", &radeon).expect_err("no Apple GPU");
        assert_eq!(err.needs, "an Apple silicon GPU");
        assert!(check_preset_fits("mi300x", &machine(&[])).is_err());
        // An NVIDIA preset does not fit an AMD GPU; the any-GPU presets do.
        assert!(check_preset_fits("gpu_4090", &radeon).is_err());
        assert_eq!(check_preset_fits("low_mem", &radeon), Ok(()));
        // kiln's NVIDIA machine: the AMD presets do not fit it.
        let h100 = machine(&[("NVIDIA H100 80GB HBM3", 80, (9, 0))]);
        assert!(check_preset_fits("rx_7900_xtx", &h100).is_err());
    }

    #[test]
    fn two_a30s_choose_a30_and_say_which_device_trains() {
        let gpus = [("NVIDIA A30", 24, (8, 0)), ("NVIDIA A30", 24, (8, 0))];
        check(&gpus, "a30", &["2 × NVIDIA A30", "GPU 0"]);
    }

    #[test]
    fn mixed_gpus_train_on_the_largest() {
        let gpus = [
            ("Tesla T4", 15, (7, 5)),
            ("NVIDIA A100-SXM4-80GB", 80, (8, 0)),
        ];
        let choice = choose_preset(&machine(&gpus));
        assert_eq!(
            (choice.name.as_str(), choice.gpu_index),
            ("a100_80gb", Some(1))
        );
        assert!(choice.why.contains("2 GPUs"), "{}", choice.why);
    }

    #[test]
    fn no_gpu_chooses_cpu_and_says_why() {
        check(
            &[],
            "cpu",
            &["no GPU to train on (no NVIDIA driver)", "→ cpu"],
        );
        // A GPU saved in a report before kiln read fp16/bf16 (no such
        // fields) still reads, and is trained on.
        let mut report = machine(&[]);
        report.other_gpus = serde_json::from_str(
            r#"[{"vendor": "amd", "name": "AMD Radeon RX 7900 XTX", "pci_device_id": 29772,
                "pci_slot": "0000:03:00.0", "memory_total_bytes": 25753026560,
                "architecture": null, "table_model": null, "peak": null, "peak_source": null}]"#,
        )
        .expect("a report's AMD GPU");
        let choice = choose_preset(&report);
        assert_eq!(choice.name, "rx_7900_xtx", "{}", choice.why);
        assert!(
            choice.why.contains("bf16/fp16 not in kiln's table; 24 GiB"),
            "{}",
            choice.why
        );
    }

    #[test]
    fn a_gpu_preset_does_not_fit_another_machine() {
        let err = check_preset_fits("gpu_4090", &machine(&[])).expect_err("no GPU");
        assert_eq!(err.needs, "RTX 4090");
        let err = err.to_string();
        assert!(err.contains("RTX 4090") && err.contains("no GPU"), "{err}");
        let t4 = machine(&[("Tesla T4", 15, (7, 5))]);
        let err = check_preset_fits("a100", &t4).expect_err("T4 is no A100");
        assert!(err.have.contains("Tesla T4"), "{err}");
        assert!(check_preset_fits("low_mem", &machine(&[])).is_err());
        assert_eq!(check_preset_fits("low_mem", &t4), Ok(()));
        assert_eq!(check_preset_fits("cpu", &t4), Ok(()));
        assert_eq!(check_preset_fits("my_own", &machine(&[])), Ok(()));
    }

    #[test]
    fn precision_follows_the_t4_rule() {
        let p = PrecisionSection {
            amp: true,
            amp_dtype: AmpDtype::Bf16,
            tf32: true,
            max_bad_steps: 5,
            loss_scale_init: 65536.0,
            loss_scale_growth_interval: 2000,
            reduce_dtype: crate::schema::ReduceDtype::F32,
        };
        let t4 = GpuInfo::new(0, "Tesla T4", 15 * GIB, 15 * GIB, (7, 5));
        let a100 = GpuInfo::new(0, "NVIDIA A100-SXM4-40GB", 40 * GIB, 40 * GIB, (8, 0));
        let on_t4 = effective_precision(&p, Some(&t4));
        assert_eq!(on_t4.compute, Some(AmpDtype::Fp16));
        assert!(on_t4.label.starts_with("fp16"), "{}", on_t4.label);
        assert!(on_t4.why.contains("no bf16 → fp16"), "{}", on_t4.why);
        let on_a100 = effective_precision(&p, Some(&a100));
        assert_eq!(on_a100.compute, Some(AmpDtype::Bf16));
        assert!(on_a100.label.contains("TF32"), "{}", on_a100.label);
        // The CPU honours an explicit amp, and says it is slower there.
        let on_cpu = effective_precision(&p, None);
        assert_eq!(on_cpu.compute, Some(AmpDtype::Bf16));
        assert!(on_cpu.why.contains("slower"), "{}", on_cpu.why);
        let off = PrecisionSection { amp: false, ..p };
        assert_eq!(effective_precision(&off, None).label, "f32");
        assert_eq!(effective_precision(&off, Some(&a100)).compute, None);
    }
}
