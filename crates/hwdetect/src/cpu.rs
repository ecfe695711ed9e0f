//! The CPU: model, cores, instruction-set features, frequency, and an estimate
//! of its fp32 peak from cores × frequency × FLOPs per cycle of its ISA.

use serde::{Deserialize, Serialize};

/// What kiln knows about the host CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CpuInfo {
    /// Brand string as the CPU reports it ("AMD EPYC", "Intel(R) Xeon(R) ...").
    pub model: String,
    /// "AuthenticAMD", "GenuineIntel", ... (empty where unknown).
    pub vendor: String,
    /// CPU family number (x86 only; 0x19 is AMD Zen 3/4, 0x1A Zen 5).
    pub family: Option<u32>,
    /// Architecture as Rust names it (`x86_64`, `aarch64`).
    pub arch: String,
    /// Physical cores, where the OS tells them.
    pub physical_cores: Option<usize>,
    /// Logical CPUs this process may run on.
    pub logical_cores: usize,
    /// The instruction-set extensions kiln's kernels and estimates care about.
    pub features: IsaFeatures,
    /// Clock used for the peak estimate, in MHz (the maximum where the OS
    /// exposes it, else the current reading).
    pub frequency_mhz: Option<u64>,
    /// The fp32 peak estimate and how it was reached.
    pub peak: CpuPeak,
}

/// Instruction-set features that matter for training kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsaFeatures {
    /// AVX (256-bit float vectors).
    pub avx: bool,
    /// AVX2 (256-bit integer vectors).
    pub avx2: bool,
    /// FMA3 (fused multiply-add: two FLOPs per lane per instruction).
    pub fma: bool,
    /// F16C (half-precision conversions).
    pub f16c: bool,
    /// AVX-512 Foundation (512-bit vectors).
    pub avx512f: bool,
    /// AVX-512 BF16 (bfloat16 dot products).
    pub avx512_bf16: bool,
    /// Intel AMX tiles (read from `/proc/cpuinfo`).
    pub amx: bool,
    /// Arm NEON (128-bit vectors).
    pub neon: bool,
}

impl IsaFeatures {
    /// The widest vector extension, as people name it ("AVX-512", "AVX2+FMA").
    pub fn simd_class(&self) -> &'static str {
        if self.avx512f {
            "AVX-512"
        } else if self.avx2 && self.fma {
            "AVX2+FMA"
        } else if self.avx {
            "AVX"
        } else if self.neon {
            "NEON"
        } else {
            "SSE"
        }
    }

    /// The names of the features that are present, in a fixed order.
    pub fn names(&self) -> Vec<&'static str> {
        let all = [
            (self.avx, "avx"),
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.f16c, "f16c"),
            (self.avx512f, "avx512f"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.amx, "amx"),
            (self.neon, "neon"),
        ];
        all.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect()
    }
}

impl CpuInfo {
    /// The peak of this CPU for kernels that use at most `features` (an
    /// AVX-512 CPU running code built for AVX2 at most, for one).
    pub fn peak_with(&self, features: &IsaFeatures) -> CpuPeak {
        estimate_peak(
            &self.vendor,
            self.family,
            features,
            self.peak_cores(),
            self.frequency_mhz,
        )
    }

    /// The cores the peak estimate counts: the physical ones (hyper-threads
    /// add no FMA pipes), at most the logical ones this process may use.
    pub fn peak_cores(&self) -> usize {
        peak_cores(self.physical_cores, self.logical_cores)
    }
}

/// The fp32 peak estimate and how it was reached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuPeak {
    /// Estimated dense fp32 FLOP/s; `None` when the frequency is unknown.
    pub fp32_flops: Option<f64>,
    /// fp32 FLOPs one core retires per cycle with the widest FMA it has.
    pub flops_per_cycle: u32,
    /// One line: the arithmetic and its assumptions. Always an estimate.
    pub how: String,
}

/// Reads the CPU of this machine. Never panics: what cannot be read is `None`.
pub fn detect_cpu() -> CpuInfo {
    let (model, vendor, current_mhz) = read_brand();
    let features = detect_features();
    let family = cpu_family();
    let logical_cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let physical_cores = sysinfo::System::physical_core_count().ok();
    let frequency_mhz = max_frequency_mhz().or(current_mhz);
    let cores = peak_cores(physical_cores, logical_cores);
    let peak = estimate_peak(&vendor, family, &features, cores, frequency_mhz);
    CpuInfo {
        model,
        vendor,
        family,
        arch: std::env::consts::ARCH.to_string(),
        physical_cores,
        logical_cores,
        features,
        frequency_mhz,
        peak,
    }
}

/// The cores the peak counts: the physical ones where the OS tells them, at
/// most the logical CPUs this process may use.
fn peak_cores(physical: Option<usize>, logical: usize) -> usize {
    physical.unwrap_or(logical).min(logical)
}

/// fp32 FLOPs per cycle per core, and the reason, from the ISA.
///
/// Two FMA pipes is the common server case; AMD Zen 4 runs AVX-512 on 256-bit
/// datapaths (no gain in FLOPs over AVX2), Zen 5 (family 0x1A) on 512-bit ones.
pub fn flops_per_cycle(vendor: &str, family: Option<u32>, f: &IsaFeatures) -> (u32, String) {
    let amd = vendor.contains("AMD");
    if f.avx512f && f.fma {
        if amd && family.is_some_and(|fam| fam < 0x1A) {
            return (
                32,
                "AVX-512 on 256-bit datapaths (AMD Zen 4): 2 FMA pipes × 8 lanes × 2".into(),
            );
        }
        return (
            64,
            "AVX-512: 2 FMA pipes × 16 lanes × 2 (assumes two 512-bit FMA units)".into(),
        );
    }
    if f.avx2 && f.fma {
        return (32, "AVX2+FMA: 2 FMA pipes × 8 lanes × 2".into());
    }
    if f.avx {
        return (16, "AVX without FMA: 1 add + 1 mul pipe × 8 lanes".into());
    }
    if f.neon {
        return (16, "NEON: 2 FMA pipes × 4 lanes × 2".into());
    }
    (8, "SSE: 1 add + 1 mul pipe × 4 lanes".into())
}

/// Peak estimate from cores × frequency × FLOPs per cycle.
pub fn estimate_peak(
    vendor: &str,
    family: Option<u32>,
    features: &IsaFeatures,
    cores: usize,
    frequency_mhz: Option<u64>,
) -> CpuPeak {
    let (per_cycle, isa) = flops_per_cycle(vendor, family, features);
    match frequency_mhz {
        Some(mhz) => {
            let flops = cores as f64 * mhz as f64 * 1e6 * f64::from(per_cycle);
            CpuPeak {
                fp32_flops: Some(flops),
                flops_per_cycle: per_cycle,
                how: format!(
                    "estimate: {cores} cores × {:.2} GHz × {per_cycle} FLOP/cycle; {isa}",
                    mhz as f64 / 1000.0
                ),
            }
        }
        None => CpuPeak {
            fp32_flops: None,
            flops_per_cycle: per_cycle,
            how: format!("unknown: the CPU frequency could not be read; {isa}"),
        },
    }
}

fn read_brand() -> (String, String, Option<u64>) {
    use sysinfo::{CpuRefreshKind, RefreshKind, System};
    let refresh = RefreshKind::nothing().with_cpu(CpuRefreshKind::nothing().with_frequency());
    match System::new_with_specifics(refresh) {
        Ok(sys) => match sys.cpus().first() {
            Some(cpu) => {
                let mhz = cpu.frequency();
                (
                    cpu.brand().trim().to_string(),
                    cpu.vendor_id().trim().to_string(),
                    (mhz > 0).then_some(mhz),
                )
            }
            None => (String::from("unknown"), String::new(), None),
        },
        Err(_) => (String::from("unknown"), String::new(), None),
    }
}

/// The maximum clock where Linux exposes it (absent in most VMs).
fn max_frequency_mhz() -> Option<u64> {
    let khz = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    (khz > 0).then_some(khz / 1000)
}

#[cfg(target_arch = "x86_64")]
fn cpu_family() -> Option<u32> {
    // SAFETY: CPUID leaf 1 exists on every x86_64 processor.
    #[allow(unused_unsafe, reason = "__cpuid is unsafe on older toolchains only")]
    let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
    let base = (eax >> 8) & 0xF;
    let extended = (eax >> 20) & 0xFF;
    Some(if base == 0xF { base + extended } else { base })
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_family() -> Option<u32> {
    None
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> IsaFeatures {
    use std::arch::is_x86_feature_detected as has;
    IsaFeatures {
        avx: has!("avx"),
        avx2: has!("avx2"),
        fma: has!("fma"),
        f16c: has!("f16c"),
        avx512f: has!("avx512f"),
        avx512_bf16: has!("avx512bf16"),
        // AMX detection is not stable in std yet: Linux lists it in cpuinfo.
        amx: linux_cpu_flag("amx_tile"),
        neon: false,
    }
}

#[cfg(target_arch = "aarch64")]
fn detect_features() -> IsaFeatures {
    IsaFeatures {
        neon: std::arch::is_aarch64_feature_detected!("neon"),
        ..IsaFeatures::default()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect_features() -> IsaFeatures {
    IsaFeatures::default()
}

#[cfg(target_arch = "x86_64")]
fn linux_cpu_flag(flag: &str) -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|text| {
        text.lines()
            .find(|l| l.starts_with("flags"))
            .is_some_and(|l| l.split_whitespace().any(|f| f == flag))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avx2() -> IsaFeatures {
        IsaFeatures {
            avx: true,
            avx2: true,
            fma: true,
            f16c: true,
            ..IsaFeatures::default()
        }
    }

    #[test]
    fn peers_md_peak_is_reproduced_for_two_avx2_cores() {
        // ../shared/PEERS.md: 2 cores × 2.445 GHz × 32 FLOP/cycle = 156.5 GFLOP/s.
        let peak = estimate_peak("AuthenticAMD", Some(0x19), &avx2(), 2, Some(2445));
        let gflops = peak.fp32_flops.map(|f| f / 1e9);
        assert!(
            gflops.is_some_and(|g| (g - 156.48).abs() < 0.01),
            "{gflops:?}"
        );
        assert!(peak.how.starts_with("estimate:"), "{}", peak.how);
    }

    #[test]
    fn zen4_avx512_counts_like_avx2_and_zen5_doubles() {
        let f = IsaFeatures {
            avx512f: true,
            ..avx2()
        };
        assert_eq!(flops_per_cycle("AuthenticAMD", Some(0x19), &f).0, 32);
        assert_eq!(flops_per_cycle("AuthenticAMD", Some(0x1A), &f).0, 64);
        assert_eq!(flops_per_cycle("GenuineIntel", Some(6), &f).0, 64);
    }

    #[test]
    fn the_peak_with_fewer_features_counts_only_those() {
        let mut cpu = detect_cpu();
        cpu.vendor = "GenuineIntel".into();
        cpu.family = Some(6);
        cpu.frequency_mhz = Some(2000);
        cpu.physical_cores = Some(4);
        cpu.logical_cores = 8;
        let all = IsaFeatures {
            avx512f: true,
            ..avx2()
        };
        let wide = cpu.peak_with(&all);
        let narrow = cpu.peak_with(&avx2());
        assert_eq!(wide.fp32_flops, Some(4.0 * 2e9 * 64.0));
        assert_eq!(narrow.fp32_flops, Some(4.0 * 2e9 * 32.0));
        assert!(narrow.how.contains("AVX2"), "{}", narrow.how);
    }

    #[test]
    fn unknown_frequency_gives_no_peak_and_says_why() {
        let peak = estimate_peak("", None, &IsaFeatures::default(), 4, None);
        assert_eq!(peak.fp32_flops, None);
        assert!(peak.how.contains("frequency"), "{}", peak.how);
    }

    #[test]
    fn detection_on_this_machine_reads_cores_and_isa() {
        let cpu = detect_cpu();
        assert!(cpu.logical_cores >= 1);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            cpu.features.avx2,
            std::arch::is_x86_feature_detected!("avx2")
        );
    }
}
