//! The report in words, as `kiln check-hardware` prints it: `Display` for
//! [`HardwareReport`] (CPU, memory, OS, GPUs, driver) and for [`GpuStatus`]
//! (one block per GPU, or why there is none).

use std::fmt;

use crate::{GpuStatus, HardwareReport, PeakFlops};

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

impl fmt::Display for HardwareReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cpu = &self.cpu;
        let family = cpu
            .family
            .map(|x| format!(", family {x:#x}"))
            .unwrap_or_default();
        writeln!(
            f,
            "CPU      {} ({}{family}), {}",
            cpu.model, cpu.vendor, cpu.arch
        )?;
        let physical = cpu
            .physical_cores
            .map_or("? physical".to_string(), |p| format!("{p} physical"));
        let clock = cpu.frequency_mhz.map_or("unknown clock".to_string(), |m| {
            format!("{:.2} GHz", m as f64 / 1000.0)
        });
        writeln!(
            f,
            "         {physical} / {} logical cores at {clock}",
            cpu.logical_cores
        )?;
        writeln!(f, "         ISA: {}", cpu.features.names().join(" "))?;
        match cpu.peak.fp32_flops {
            Some(flops) => writeln!(
                f,
                "         fp32 peak ≈ {:.1} GFLOP/s ({})",
                flops / 1e9,
                cpu.peak.how
            )?,
            None => writeln!(f, "         fp32 peak {}", cpu.peak.how)?,
        }
        writeln!(
            f,
            "Memory   {} total, {} available",
            gib(self.memory.total_bytes),
            gib(self.memory.available_bytes)
        )?;
        writeln!(f, "OS       {}", self.os)?;
        write!(f, "{}", self.gpu)?;
        for g in &self.other_gpus {
            let mut about: Vec<String> = Vec::new();
            if !g.pci_slot.is_empty() {
                about.push(format!("PCI {}", g.pci_slot));
            }
            // (Apple's architecture is its chip's generation, in its name.)
            about.extend(
                g.architecture
                    .clone()
                    .filter(|a| !g.name.starts_with(a.as_str())),
            );
            let about = if about.is_empty() {
                String::new()
            } else {
                format!(" ({})", about.join(", "))
            };
            let memory = match g.memory_total_bytes {
                Some(m) if g.unified_memory => format!(", {} unified memory", gib(m)),
                Some(m) => match g.memory_used_bytes {
                    Some(used) => format!(", {} ({} free)", gib(m), gib(m.saturating_sub(used))),
                    None => format!(", {}", gib(m)),
                },
                None => String::new(),
            };
            let seen = if g.vendor == crate::GpuVendor::Apple {
                "sysctl"
            } else {
                "sysfs"
            };
            writeln!(f, "GPU      {}{about}{memory}, seen through {seen}", g.name)?;
            let yes = |b: bool| if b { "yes" } else { "no" };
            if g.table_model.is_some() {
                writeln!(f, "         fp16 {}, bf16 {}", yes(g.fp16), yes(g.bf16))?;
            }
            match (&g.peak, &g.peak_source) {
                (Some(p), Some(src)) => writeln!(f, "         dense peak: {p} ({src})")?,
                _ => writeln!(
                    f,
                    "         dense peak: not in kiln's table (MFU needs a measured peak)"
                )?,
            }
        }
        if self.driver.driver_version.is_some() {
            writeln!(
                f,
                "Driver   {}, CUDA {}",
                self.driver.driver_version.as_deref().unwrap_or("?"),
                self.driver.cuda_version.as_deref().unwrap_or("?")
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for GpuStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gpus = match self {
            GpuStatus::None { why } => return writeln!(f, "GPU      none: {why}"),
            GpuStatus::Found { gpus } => gpus,
        };
        for g in gpus {
            let (maj, min) = g.compute_capability;
            writeln!(
                f,
                "GPU {:<4} {}, {} ({} free), compute capability {maj}.{min}",
                g.index,
                g.name,
                gib(g.memory_total_bytes),
                gib(g.memory_free_bytes)
            )?;
            let c = g.capabilities;
            let yes = |b: bool| if b { "yes" } else { "no" };
            writeln!(
                f,
                "         fp16 {}, bf16 {}, tf32 {}, fp8 {}, tensor cores {}",
                yes(c.fp16),
                yes(c.bf16),
                yes(c.tf32),
                yes(c.fp8),
                yes(c.tensor_cores)
            )?;
            match (&g.peak, &g.peak_source) {
                (Some(p), Some(src)) => writeln!(f, "         dense peak: {p} ({src})")?,
                _ => writeln!(
                    f,
                    "         dense peak: not in kiln's table (MFU needs a measured peak)"
                )?,
            }
        }
        Ok(())
    }
}

impl fmt::Display for PeakFlops {
    /// `fp32 19.5, tf32 156.0, bf16 312.0, fp16 312.0 TFLOP/s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = vec![format!("fp32 {:.1}", self.fp32 / 1e12)];
        for (name, v) in [
            ("tf32", self.tf32),
            ("bf16", self.bf16),
            ("fp16", self.fp16),
            ("fp8", self.fp8),
        ] {
            if let Some(v) = v {
                parts.push(format!("{name} {:.1}", v / 1e12));
            }
        }
        write!(f, "{} TFLOP/s", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use crate::{DriverInfo, FixedProbe, GpuInfo, GpuStatus, detect_with};

    #[test]
    fn the_summary_names_cpu_memory_and_each_gpu() {
        let gpu = GpuInfo::new(0, "NVIDIA A100-SXM4-80GB", 80 << 30, 79 << 30, (8, 0));
        let report = detect_with(&FixedProbe(
            GpuStatus::Found { gpus: vec![gpu] },
            DriverInfo::default(),
        ));
        let text = report.to_string();
        assert!(text.starts_with("CPU      "), "{text}");
        assert!(text.contains("Memory   ") && text.contains("logical cores"));
        assert!(
            text.contains(
                "GPU 0    NVIDIA A100-SXM4-80GB, 80.0 GiB (79.0 GiB free), compute capability 8.0"
            ),
            "{text}"
        );
        assert!(
            text.contains("bf16 yes") && text.contains("dense peak: fp32 19.5"),
            "{text}"
        );
        let mut report = report;
        report.other_gpus = serde_json::from_str(
            r#"[{"vendor": "amd", "name": "AMD Instinct MI300X", "pci_device_id": 29857,
                "pci_slot": "0000:0c:00.0", "memory_total_bytes": 206141652992,
                "architecture": "gfx942", "table_model": "Instinct MI300X",
                "peak": {"fp32": 163.4e12, "tf32": null, "fp16": 1307.4e12, "bf16": 1307.4e12, "fp8": null},
                "peak_source": "AMD Instinct MI300X data sheet"}]"#,
        )
        .expect("an AMD GPU as a report has it");
        let text = report.to_string();
        assert!(
            text.contains(
                "GPU      AMD Instinct MI300X (PCI 0000:0c:00.0, gfx942), 192.0 GiB, seen through sysfs\n"
            ),
            "{text}"
        );
        // A report saved before kiln read fp16/bf16 (and the memory in
        // use) says false for both, and no free memory.
        assert!(text.contains("fp16 no, bf16 no"), "{text}");
        let mut used = report.clone();
        used.other_gpus[0].memory_used_bytes = Some(2 << 30);
        assert!(
            used.to_string()
                .contains("gfx942), 192.0 GiB (190.0 GiB free), seen through sysfs"),
            "{used}"
        );
        assert!(
            text.contains("dense peak: fp32 163.4, bf16 1307.4"),
            "{text}"
        );
        report.other_gpus = vec![
            crate::apple_gpu_from("Apple M2 Max", 96 << 30, "Total Number of Cores: 38")
                .expect("Apple"),
        ];
        let text = report.to_string();
        assert!(
            text.contains("GPU      Apple M2 Max (38-core GPU), 96.0 GiB unified memory, seen through sysctl\n         fp16 yes, bf16 no\n         dense peak: fp32 13.7"),
            "{text}"
        );
        let none = GpuStatus::None {
            why: "no NVIDIA driver".into(),
        };
        assert_eq!(none.to_string(), "GPU      none: no NVIDIA driver\n");
    }
}
