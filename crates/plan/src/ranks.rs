//! Data parallelism planned: how many ranks a machine runs (`kiln launch`'s
//! default, `cargo xtask train-auto`), and what the gradients' all-reduce
//! costs on a link, with the ring all-reduce's `2(N−1)/N` factor.

use kiln_config::ReduceDtype;
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::{Finding, Severity};

/// The data-parallel ranks for one machine, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ranks {
    /// Processes to start (1: train in one process).
    pub count: usize,
    /// Why, in one line.
    pub why: String,
}

/// The GPUs data-parallel ranks are spread over, as `(name, memory)`, and
/// the backend that opens each by its index: the NVIDIA GPUs (`cuda`)
/// where there are any, else the trainable AMD GPUs (`rocm`), else the
/// trainable Intel and Apple GPUs (no backend opens one by index: kiln
/// runs them through wgpu, which opens the system's default device).
fn rank_gpus(hardware: &HardwareReport) -> (Vec<(String, Option<u64>)>, Option<&'static str>) {
    let nvidia: Vec<_> = hardware
        .gpus()
        .iter()
        .map(|g| (g.name.clone(), Some(g.memory_total_bytes)))
        .collect();
    if !nvidia.is_empty() {
        return (nvidia, Some("cuda"));
    }
    let others: Vec<_> = hardware
        .other_gpus
        .iter()
        .filter(|g| g.trainable())
        .collect();
    let Some(vendor) = others.first().map(|g| g.vendor) else {
        return (Vec::new(), None);
    };
    let indexed = (vendor == kiln_hwdetect::GpuVendor::Amd).then_some("rocm");
    let gpus = others
        .iter()
        .filter(|g| g.vendor == vendor)
        .map(|g| (g.name.clone(), g.memory_total_bytes))
        .collect();
    (gpus, indexed)
}

/// How many GPUs a data-parallel rank's `LOCAL_RANK` is taken modulo when
/// it picks its device (`device.index`): those [`local_ranks`] counts.
pub fn rank_gpu_count(hardware: &HardwareReport) -> usize {
    rank_gpus(hardware).0.len().max(1)
}

/// One rank per GPU of the first GPU's kind (ranks must match: the same
/// kernels, the same memory), where this build has the backend that opens
/// each GPU by its index (`cuda` for NVIDIA's, `rocm` for AMD's; among
/// `backends`, the names of the backends built in); else one.
pub fn local_ranks(hardware: &HardwareReport, backends: &[&str]) -> Ranks {
    let (gpus, indexed) = rank_gpus(hardware);
    let Some(first) = gpus.first() else {
        return Ranks {
            count: 1,
            why: "no GPU: one process".into(),
        };
    };
    let gpu_backend = backends
        .iter()
        .any(|b| matches!(*b, "cuda" | "rocm" | "wgpu"));
    if !gpu_backend {
        return Ranks {
            count: 1,
            why: format!(
                "{} GPU(s), but this build has no GPU backend: one process on the CPU",
                gpus.len()
            ),
        };
    }
    let one_device = |why: String| Ranks { count: 1, why };
    if gpus.len() == 1 {
        return one_device(format!("one {}: one process", first.0));
    }
    match indexed {
        Some(backend) if !backends.contains(&backend) => {
            return one_device(format!(
                "{} GPUs, but this build runs them through wgpu, which opens one device: one process; a build with the `{backend}` feature runs one rank per GPU",
                gpus.len()
            ));
        }
        None => {
            return one_device(format!(
                "{} × {}, but kiln runs them through wgpu, which opens one device: one process",
                gpus.len(),
                first.0
            ));
        }
        Some(_) => {}
    }
    let same = gpus.iter().filter(|g| *g == first).count();
    let why = if same == gpus.len() {
        format!("{same} × {}: one rank per GPU", first.0)
    } else {
        format!(
            "{same} × {} (the other {} GPU(s) differ, and ranks must match)",
            first.0,
            gpus.len() - same
        )
    };
    Ranks { count: same, why }
}

/// A link the gradients cross, with the bandwidth an all-reduce achieves
/// on it (bytes/s; NCCL's bus bandwidth for NVLink, the line rate less
/// overheads for the others).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Its name, as docs/DISTRIBUTED.md's table gives it.
    pub name: &'static str,
    /// Achieved bandwidth, bytes per second.
    pub bytes_per_s: f64,
}

/// The links docs/DISTRIBUTED.md's table models, fastest first.
pub const LINKS: [Link; 5] = [
    Link {
        name: "NVLink 4",
        bytes_per_s: 360e9,
    },
    Link {
        name: "400 Gb/s network",
        bytes_per_s: 45e9,
    },
    Link {
        name: "PCIe 4.0 x16",
        bytes_per_s: 22e9,
    },
    Link {
        name: "100 Gb/s Ethernet",
        bytes_per_s: 11e9,
    },
    Link {
        name: "25 Gb/s Ethernet",
        bytes_per_s: 2.8e9,
    },
];

/// Seconds one ring all-reduce of `bytes` takes among `ranks` over `link`:
/// each rank sends and receives `2(N−1)/N` of the buffer. 0 for one rank.
pub fn allreduce_seconds(bytes: f64, ranks: usize, link: Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let n = ranks as f64;
    2.0 * (n - 1.0) / n * bytes / link.bytes_per_s
}

/// Seconds one ring all-gather of `bytes` in all takes among `ranks` over
/// `link`: each rank receives the `(N−1)/N` it does not have, half an
/// all-reduce. 0 for one rank.
pub fn allgather_seconds(bytes: f64, ranks: usize, link: Link) -> f64 {
    allreduce_seconds(bytes, ranks, link) / 2.0
}

/// The gradients' reduction of a data-parallel job, per optimizer step,
/// over each modelled link (`kiln diagnose`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReductionEstimate {
    /// Ranks in the job.
    pub ranks: usize,
    /// Bytes reduced per optimizer step: the gradients in
    /// `precision.reduce_dtype` (4 bytes each in f32, 2 in bf16).
    pub gradient_bytes: u64,
    /// The type they travel in.
    pub reduce_dtype: ReduceDtype,
    /// `optimization.zero_stage`: 0 and 1 all-reduce the gradients, 2
    /// reduce-scatters them (half an all-reduce: each rank receives its
    /// share alone).
    pub zero_stage: u8,
    /// Under ZeRO (`optimization.zero_stage` 1 or 2): the f32 weights
    /// all-gathered after each update; 0 otherwise.
    pub gather_bytes: u64,
    /// Milliseconds per optimizer step over each link of [`LINKS`], the
    /// gradients' reduction and the all-gather together.
    pub per_link_ms: Vec<(String, f64)>,
}

impl ReductionEstimate {
    /// The estimate for a model of `parameters` trainable parameters
    /// among `ranks` ranks, its gradients averaged in `reduce_dtype` (with
    /// `zero_stage` 2, reduce-scattered) and, with `zero_stage` 1 or 2,
    /// its weights all-gathered after each update (`None` for one rank:
    /// nothing to reduce).
    pub fn new(
        parameters: usize,
        ranks: usize,
        reduce_dtype: ReduceDtype,
        zero_stage: u8,
    ) -> Option<Self> {
        if ranks <= 1 {
            return None;
        }
        let bytes = parameters as u64 * reduce_dtype.bytes();
        let gather_bytes = if zero_stage >= 1 {
            parameters as u64 * 4
        } else {
            0
        };
        Some(Self {
            ranks,
            gradient_bytes: bytes,
            reduce_dtype,
            zero_stage,
            gather_bytes,
            per_link_ms: LINKS
                .iter()
                .map(|l| {
                    // A ring reduce-scatter moves what an all-gather does.
                    let reduce = if zero_stage >= 2 {
                        allgather_seconds(bytes as f64, ranks, *l)
                    } else {
                        allreduce_seconds(bytes as f64, ranks, *l)
                    };
                    let s = reduce + allgather_seconds(gather_bytes as f64, ranks, *l);
                    (l.name.to_string(), 1e3 * s)
                })
                .collect(),
        })
    }

    /// `"all-reduce"`, or `"reduce-scatter"` under ZeRO-2.
    pub fn reduction(&self) -> &'static str {
        if self.zero_stage >= 2 {
            "reduce-scatter"
        } else {
            "all-reduce"
        }
    }

    /// `" and ZeRO-1's all-gather of the weights (496.0 MB)"` under
    /// ZeRO, else nothing: what a step sends besides the gradients.
    pub fn gather_words(&self) -> String {
        if self.gather_bytes == 0 {
            return String::new();
        }
        format!(
            " and ZeRO-{}'s all-gather of the weights ({:.1} MB)",
            self.zero_stage,
            self.gather_bytes as f64 / 1e6
        )
    }

    /// A note where the reduction would take longer than half the step's
    /// compute (`step_ms`, measured) on some link: which links, and the fix.
    pub fn finding(&self, step_ms: f64) -> Option<Finding> {
        let slow: Vec<String> = self
            .per_link_ms
            .iter()
            .filter(|(_, ms)| *ms > 0.5 * step_ms)
            .map(|(name, ms)| format!("{name} {ms:.0} ms"))
            .collect();
        if slow.is_empty() {
            return None;
        }
        let gather = self.gather_words();
        Some(Finding {
            severity: Severity::Note,
            key: "training.gradient_accumulation_steps".into(),
            problem: format!(
                "with {} ranks the gradients' {} ({:.0} MB a step){gather} would take over half of the {step_ms:.0} ms step over: {}",
                self.ranks,
                self.reduction(),
                self.gradient_bytes as f64 / 1e6,
                slow.join(", ")
            ),
            fix: format!(
                "on such a link, raise training.gradient_accumulation_steps (one reduction per optimizer step) and lower training.batch_size to keep the global batch{}{}",
                match self.reduce_dtype {
                    ReduceDtype::F32 => ", or set precision.reduce_dtype=bf16 (half the bytes)",
                    ReduceDtype::Bf16 => "",
                },
                if self.zero_stage == 1 {
                    "; optimization.zero_stage=2 reduce-scatters the gradients instead (with the all-gather, DDP's bytes)"
                } else {
                    ""
                }
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_factor_and_the_docs_figures() {
        let gpt2_small = 124.0e6 * 4.0;
        let nvlink = allreduce_seconds(gpt2_small, 8, LINKS[0]);
        assert!((nvlink - 2.4e-3).abs() < 0.1e-3, "{nvlink}");
        let eth25 = allreduce_seconds(gpt2_small, 8, LINKS[4]);
        assert!((eth25 - 0.31).abs() < 0.01, "{eth25}");
        assert_eq!(allreduce_seconds(gpt2_small, 1, LINKS[0]), 0.0);
        // Two ranks move the whole buffer once each way.
        assert_eq!(allreduce_seconds(1e9, 2, LINKS[2]), 1e9 / 22e9);
    }

    fn machine(gpus: &[(&str, u64)]) -> HardwareReport {
        use kiln_hwdetect::{DriverInfo, FixedProbe, GpuInfo, GpuStatus, detect_with};
        let gpus = gpus
            .iter()
            .zip(0u32..)
            .map(|((name, gib), i)| GpuInfo::new(i, name, gib << 30, gib << 30, (9, 0)))
            .collect();
        detect_with(&FixedProbe(
            GpuStatus::Found { gpus },
            DriverInfo::default(),
        ))
    }

    #[test]
    fn a_reduction_slower_than_half_the_step_is_noted_with_its_links() {
        assert_eq!(ReductionEstimate::new(1000, 1, ReduceDtype::F32, 0), None);
        let e = ReductionEstimate::new(124_000_000, 8, ReduceDtype::F32, 0).expect("8 ranks");
        assert_eq!(e.gradient_bytes, 496_000_000);
        assert_eq!(e.per_link_ms.len(), LINKS.len());
        let f = e.finding(31.0).expect("slow links");
        assert!(
            f.problem.contains("100 Gb/s Ethernet") && !f.problem.contains("NVLink"),
            "{}",
            f.problem
        );
        assert!(f.fix.contains("precision.reduce_dtype=bf16"), "{}", f.fix);
        assert!(e.finding(10_000.0).is_none());
        // In bf16: half the bytes, half the time, and no advice to do so.
        let b = ReductionEstimate::new(124_000_000, 8, ReduceDtype::Bf16, 0).expect("8 ranks");
        assert_eq!(b.gradient_bytes, 248_000_000);
        for ((_, f32_ms), (_, bf16_ms)) in e.per_link_ms.iter().zip(&b.per_link_ms) {
            assert!((f32_ms / bf16_ms - 2.0).abs() < 1e-9);
        }
        let f = b.finding(31.0).expect("slow links");
        assert!(!f.fix.contains("reduce_dtype"), "{}", f.fix);
        // ZeRO-1 adds the f32 weights' all-gather: half an f32 all-reduce.
        let z = ReductionEstimate::new(124_000_000, 8, ReduceDtype::F32, 1).expect("8 ranks");
        assert_eq!(z.gather_bytes, 496_000_000);
        for ((_, ddp), (_, zero)) in e.per_link_ms.iter().zip(&z.per_link_ms) {
            assert!((zero / ddp - 1.5).abs() < 1e-9);
        }
        let f = z.finding(31.0).expect("slow links");
        assert!(
            f.problem
                .contains("ZeRO-1's all-gather of the weights (496.0 MB)"),
            "{}",
            f.problem
        );
        assert!(f.fix.contains("optimization.zero_stage=2"), "{}", f.fix);
        // ZeRO-2 reduce-scatters instead: with the all-gather, DDP's time.
        let z2 = ReductionEstimate::new(124_000_000, 8, ReduceDtype::F32, 2).expect("8 ranks");
        for ((_, ddp), (_, zero)) in e.per_link_ms.iter().zip(&z2.per_link_ms) {
            assert!((zero / ddp - 1.0).abs() < 1e-9);
        }
        let f = z2.finding(31.0).expect("slow links");
        assert!(
            f.problem
                .contains("the gradients' reduce-scatter (496 MB a step) and ZeRO-2's all-gather"),
            "{}",
            f.problem
        );
        assert!(!f.fix.contains("zero_stage"), "{}", f.fix);
    }

    const ALL: &[&str] = &["cuda", "rocm", "wgpu", "flex"];

    #[test]
    fn ranks_follow_the_gpus_of_the_first_kind() {
        let cpu = kiln_hwdetect::detect_cpu_only();
        assert_eq!(local_ranks(&cpu, ALL).count, 1);
        let eight = machine(&[("NVIDIA H100 80GB HBM3", 80); 8]);
        let r = local_ranks(&eight, ALL);
        assert_eq!(r.count, 8);
        assert!(r.why.contains("8 × NVIDIA H100"), "{}", r.why);
        assert_eq!(rank_gpu_count(&eight), 8);
        assert_eq!(
            local_ranks(&eight, &["flex"]).count,
            1,
            "no GPU backend built"
        );
        let r = local_ranks(&eight, &["wgpu", "flex"]);
        assert_eq!(r.count, 1, "wgpu opens one device");
        assert!(r.why.contains("the `cuda` feature"), "{}", r.why);
        let mixed = machine(&[
            ("NVIDIA RTX 4090", 24),
            ("NVIDIA RTX 4090", 24),
            ("Tesla T4", 16),
        ]);
        let r = local_ranks(&mixed, ALL);
        assert_eq!(r.count, 2);
        assert!(r.why.contains("the other 1 GPU(s) differ"), "{}", r.why);
    }

    /// A machine without NVIDIA GPUs whose sysfs shows `cards` (PCI vendor,
    /// device id, GiB, product name).
    fn other_machine(cards: &[(u16, u16, u64, &str)]) -> HardwareReport {
        let mut report = kiln_hwdetect::detect_cpu_only();
        report.other_gpus = cards
            .iter()
            .map(|&(vendor, device, gib, name)| {
                kiln_hwdetect::OtherGpu::from_pci(
                    vendor,
                    device,
                    Some(gib << 30),
                    Some(name.into()),
                )
                .expect("a known vendor")
            })
            .collect();
        report
    }

    #[test]
    fn amd_gpus_get_a_rank_each_through_rocm_and_others_one_process() {
        // Eight MI300X (and an integrated Radeon, too small to train on).
        let mut cards = vec![(0x1002, 0x74a1, 192, "AMD Instinct MI300X"); 8];
        cards.push((0x1002, 0x164e, 0, "AMD Radeon Graphics"));
        let amd = other_machine(&cards);
        assert_eq!(rank_gpu_count(&amd), 8);
        let r = local_ranks(&amd, ALL);
        assert_eq!(r.count, 8, "{}", r.why);
        assert!(r.why.contains("one rank per GPU"), "{}", r.why);
        let r = local_ranks(&amd, &["wgpu", "flex"]);
        assert_eq!(r.count, 1);
        assert!(r.why.contains("the `rocm` feature"), "{}", r.why);
        // Two Intel Arc A770: wgpu is their backend, one device.
        let arc = other_machine(&[(0x8086, 0x56a0, 16, "Intel Arc A770"); 2]);
        let r = local_ranks(&arc, ALL);
        assert_eq!(r.count, 1);
        assert!(r.why.contains("wgpu, which opens one device"), "{}", r.why);
    }
}
