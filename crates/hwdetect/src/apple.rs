//! Apple silicon's GPU, as macOS tells it: the chip from `sysctl -n
//! machdep.cpu.brand_string` ("Apple M2 Max"), the unified memory from
//! `sysctl -n hw.memsize`, and the GPU's cores from `system_profiler
//! SPDisplaysDataType` ("Total Number of Cores: 38"). The GPU has no memory
//! of its own: it shares the chip's with the CPU, and macOS lets a process's
//! GPU allocations reach about three quarters of it (Metal's
//! `recommendedMaxWorkingSetSize`), which the `apple_m` preset plans for.
//!
//! The parsing is a pure function of the commands' text, so tests read
//! recorded outputs on any machine; only [`detect_apple_gpu`] runs commands,
//! and only on macOS.

use crate::drm::{GpuVendor, OtherGpu};
use crate::specs::PeakFlops;

/// Apple's published fp32 figures divided by the GPU cores they were given
/// for: M1 2.6 TFLOPS on 8 cores (M1 Pro 5.2 on 16, M1 Max 10.4 on 32, M1
/// Ultra 21 on 64), M2 3.6 TFLOPS on 10 cores (M2 Pro 6.8 on 19, M2 Max 13.6
/// on 38, M2 Ultra 27.2 on 76). Each core has 128 fp32 lanes that also run
/// fp16 at the same rate. Apple gives no TFLOPS for the M3 and later: kiln
/// has no peak for them (MFU needs a measured one).
const PER_CORE: &[(&str, f64, &str)] = &[
    (
        "Apple M1",
        2.6e12 / 8.0,
        "Apple's M1 family figures (2.6 TFLOPS fp32 on 8 GPU cores)",
    ),
    (
        "Apple M2",
        3.6e12 / 10.0,
        "Apple's M2 family figures (3.6 TFLOPS fp32 on 10 GPU cores)",
    ),
];

/// The GPU of an Apple chip from what `sysctl` and `system_profiler` print:
/// `brand` is `machdep.cpu.brand_string`, `memsize` `hw.memsize` in bytes,
/// `displays` the text of `system_profiler SPDisplaysDataType`. `None` where
/// the chip is not Apple's (an Intel Mac's GPU is left to other probes).
pub fn apple_gpu_from(brand: &str, memsize: u64, displays: &str) -> Option<OtherGpu> {
    let chip = brand.trim();
    if !chip.starts_with("Apple M") {
        return None;
    }
    let cores: Option<u32> = displays.lines().find_map(|l| {
        l.trim()
            .strip_prefix("Total Number of Cores:")
            .and_then(|v| v.trim().parse().ok())
    });
    // "Apple M2 Max" → the generation "Apple M2".
    let generation: String = {
        let rest = &chip["Apple M".len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        format!("Apple M{digits}")
    };
    let row = PER_CORE.iter().find(|(g, _, _)| *g == generation);
    let (peak, peak_source) = match (row, cores) {
        (Some((_, per_core, source)), Some(n)) => {
            let fp32 = per_core * f64::from(n);
            (
                Some(PeakFlops {
                    fp32,
                    tf32: None,
                    fp16: Some(fp32),
                    bf16: None,
                    fp8: None,
                }),
                Some(format!("{source}, × {n} cores")),
            )
        }
        _ => (None, None),
    };
    let name = match cores {
        Some(n) => format!("{chip} ({n}-core GPU)"),
        None => chip.to_string(),
    };
    Some(OtherGpu {
        vendor: GpuVendor::Apple,
        name,
        pci_device_id: 0,
        pci_slot: String::new(),
        memory_total_bytes: (memsize > 0).then_some(memsize),
        memory_used_bytes: None,
        architecture: Some(generation),
        table_model: Some(chip.to_string()),
        peak,
        peak_source,
        fp16: true,
        bf16: false,
        unified_memory: true,
    })
}

/// This Mac's GPU, if it is Apple silicon; `None` elsewhere (and on a Mac
/// where the commands fail).
pub fn detect_apple_gpu() -> Option<OtherGpu> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    let run = |program: &str, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let brand = run("sysctl", &["-n", "machdep.cpu.brand_string"])?;
    let memsize = run("sysctl", &["-n", "hw.memsize"])
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let displays = run("system_profiler", &["SPDisplaysDataType"]).unwrap_or_default();
    apple_gpu_from(&brand, memsize, &displays)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `system_profiler SPDisplaysDataType` on a MacBook Pro with an M2 Max.
    const M2_MAX: &str = "Graphics/Displays:

    Apple M2 Max:

      Chipset Model: Apple M2 Max
      Type: GPU
      Bus: Built-In
      Total Number of Cores: 38
      Vendor: Apple (0x106b)
      Metal Support: Metal 3
      Displays:
        Color LCD:
          Display Type: Built-in Liquid Retina XDR Display
          Resolution: 3456 x 2234 Retina
          Main Display: Yes
";

    /// The same on a Mac mini with an M4 (no peak of Apple's to use).
    const M4: &str = "Graphics/Displays:

    Apple M4:

      Chipset Model: Apple M4
      Type: GPU
      Bus: Built-In
      Total Number of Cores: 10
      Vendor: Apple (0x106b)
      Metal Support: Metal 3
";

    #[test]
    fn an_m2_max_has_its_cores_unified_memory_and_apples_peak() {
        let gpu = apple_gpu_from("Apple M2 Max\n", 96 << 30, M2_MAX).expect("an Apple GPU");
        assert_eq!(gpu.vendor, GpuVendor::Apple);
        assert_eq!(gpu.name, "Apple M2 Max (38-core GPU)");
        assert_eq!(gpu.table_model.as_deref(), Some("Apple M2 Max"));
        assert_eq!(gpu.architecture.as_deref(), Some("Apple M2"));
        assert_eq!(gpu.memory_total_bytes, Some(96 << 30));
        assert!(gpu.unified_memory && gpu.fp16 && !gpu.bf16);
        // Apple's own figure for the 38-core M2 Max: 13.6 TFLOPS.
        let peak = gpu.peak.expect("a peak");
        assert!((peak.fp32 / 1e12 - 13.68).abs() < 0.01, "{}", peak.fp32);
        assert_eq!(peak.fp16, Some(peak.fp32));
    }

    #[test]
    fn an_m1_ultras_peak_matches_apples_21_tflops_and_an_m4_has_none() {
        let ultra = "      Chipset Model: Apple M1 Ultra\n      Total Number of Cores: 64\n";
        let gpu = apple_gpu_from("Apple M1 Ultra", 128 << 30, ultra).expect("an Apple GPU");
        let fp32 = gpu.peak.expect("a peak").fp32;
        assert!((fp32 / 1e12 - 20.8).abs() < 0.01, "{fp32}");
        let m4 = apple_gpu_from("Apple M4", 16 << 30, M4).expect("an Apple GPU");
        assert_eq!(m4.name, "Apple M4 (10-core GPU)");
        assert_eq!(m4.architecture.as_deref(), Some("Apple M4"));
        assert!(m4.peak.is_none() && m4.peak_source.is_none());
    }

    #[test]
    fn an_intel_mac_and_a_missing_profile_are_handled() {
        let intel = "Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz";
        assert!(apple_gpu_from(intel, 32 << 30, "").is_none());
        // system_profiler failed: the chip still names the GPU, without cores or peak.
        let gpu = apple_gpu_from("Apple M3 Pro", 36 << 30, "").expect("an Apple GPU");
        assert_eq!(gpu.name, "Apple M3 Pro");
        assert!(gpu.peak.is_none());
    }
}
