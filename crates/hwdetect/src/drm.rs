//! GPUs that are not NVIDIA's, as Linux lists them: each DRM card's PCI
//! device under `/sys/class/drm/card<N>/device` (its `vendor` and `device`
//! ids; AMD's `mem_info_vram_total` and `product_name`), and for AMD the
//! graphics architecture from the ROCm kernel driver's topology
//! (`/sys/class/kfd/kfd/topology/nodes/<N>/properties`: `gfx_target_version`,
//! matched to the card by `location_id`). No library is loaded and nothing
//! needs ROCm or Intel's runtime installed. NVIDIA's cards are left to NVML.
//!
//! Everything is read under a root directory (`/` on a machine), so tests
//! read recorded trees.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::specs::PeakFlops;

/// Whose GPU it is: what decides the backend that trains on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuVendor {
    /// NVIDIA (read through NVML, not sysfs).
    Nvidia,
    /// AMD (PCI vendor 0x1002): Instinct, Radeon.
    Amd,
    /// Intel (PCI vendor 0x8086): Arc, Data Center GPU Max, integrated.
    Intel,
    /// Apple silicon's GPU (macOS), on the chip's unified memory.
    Apple,
}

impl GpuVendor {
    fn from_pci(vendor: u16) -> Option<Self> {
        match vendor {
            0x1002 => Some(Self::Amd),
            0x8086 => Some(Self::Intel),
            _ => None,
        }
    }

    /// "NVIDIA", "AMD", "Intel" or "Apple".
    pub fn name(self) -> &'static str {
        match self {
            Self::Nvidia => "NVIDIA",
            Self::Amd => "AMD",
            Self::Intel => "Intel",
            Self::Apple => "Apple",
        }
    }
}

/// A GPU found through sysfs (not NVML).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct OtherGpu {
    /// Whose it is.
    pub vendor: GpuVendor,
    /// The board's own name (AMD's `product_name`) if it has one, else
    /// kiln's table's, else the vendor and PCI device id.
    pub name: String,
    /// The PCI device id (`0x74a1`).
    pub pci_device_id: u16,
    /// Where it sits on the PCI bus (`0000:03:00.0`).
    pub pci_slot: String,
    /// Device memory in bytes, where the driver says (AMD's VRAM).
    pub memory_total_bytes: Option<u64>,
    /// Device memory in use, in bytes, where the driver says (AMD's
    /// `mem_info_vram_used`: the file ROCm SMI reads its figure from).
    #[serde(default)]
    pub memory_used_bytes: Option<u64>,
    /// The graphics architecture (`gfx942`), from the ROCm kernel driver's
    /// topology where it is loaded.
    pub architecture: Option<String>,
    /// kiln's table row for this GPU, if it has one.
    pub table_model: Option<String>,
    /// Dense peak FLOP/s from kiln's table, for one device as the driver
    /// lists it (one GCD of a two-die MI250X).
    pub peak: Option<PeakFlops>,
    /// Where `peak` comes from.
    pub peak_source: Option<String>,
    /// Whether it computes in fp16 at speed (kiln's table says; `false`
    /// where the GPU is not in it).
    #[serde(default)]
    pub fp16: bool,
    /// Whether it computes in bf16 at speed (as `fp16`).
    #[serde(default)]
    pub bf16: bool,
    /// Whether its memory is the host's (Apple silicon): then
    /// `memory_total_bytes` is the chip's, shared with the CPU.
    #[serde(default)]
    pub unified_memory: bool,
}

impl OtherGpu {
    /// Device memory in GiB, where the driver says.
    pub fn memory_total_gib(&self) -> Option<f64> {
        self.memory_total_bytes
            .map(|bytes| bytes as f64 / f64::from(1u32 << 30))
    }

    /// Whether kiln would train on it: it is in kiln's table, or has 8 GiB
    /// of memory or more; not an integrated GPU (sysfs gives an APU's small
    /// carve-out, an Intel iGPU no memory), slower than the CPU's kernels.
    pub fn trainable(&self) -> bool {
        self.table_model.is_some() || self.memory_total_bytes.unwrap_or(0) >= 8 << 30
    }

    /// The AMD or Intel GPU with PCI ids `vendor` and `device`, as kiln's
    /// table knows it: what [`detect_drm_gpus`] makes of each card, before
    /// it adds the PCI slot and the architecture. `memory_total_bytes` and
    /// `product_name` are the driver's (AMD's `mem_info_vram_total` and
    /// `product_name`), where it gives them. `None` for another vendor.
    pub fn from_pci(
        vendor: u16,
        device: u16,
        memory_total_bytes: Option<u64>,
        product_name: Option<String>,
    ) -> Option<Self> {
        let vendor = GpuVendor::from_pci(vendor)?;
        let gib = memory_total_bytes.map_or(0, |m| m >> 30);
        let row = KNOWN.iter().find(|k| {
            k.vendor == vendor
                && k.ids.contains(&device)
                && gib >= u64::from(k.min_memory_gib)
                && k.product
                    .is_none_or(|word| product_name.as_deref().is_some_and(|p| p.contains(word)))
        });
        let table_model = row.map(|r| r.model.to_string());
        let (peak, peak_source) = match row.and_then(|r| r.peak) {
            Some((peak, source)) => (Some(peak), Some(source.to_string())),
            None => (None, None),
        };
        let name = product_name.unwrap_or_else(|| match &table_model {
            Some(model) => format!("{} {model}", vendor.name()),
            None => format!("{} GPU {device:#06x}", vendor.name()),
        });
        Some(OtherGpu {
            vendor,
            name,
            pci_device_id: device,
            pci_slot: String::new(),
            memory_total_bytes,
            memory_used_bytes: None,
            architecture: None,
            table_model,
            // Every board in the table computes fp16 and bf16 in its matrix
            // units (CDNA2/3's matrix cores, RDNA3's WMMA, Xe's XMX).
            fp16: row.is_some(),
            bf16: row.is_some(),
            peak,
            peak_source,
            unified_memory: false,
        })
    }
}

/// One row of the table of GPUs that are not NVIDIA's.
struct Known {
    vendor: GpuVendor,
    /// The PCI device ids this row covers.
    ids: &'static [u16],
    /// A word the board's own name (AMD's `product_name`) must contain, for
    /// boards that share an id and name themselves (`MI250X`); `None`: any.
    product: Option<&'static str>,
    /// Memory in GiB from which the row applies (0: any), for boards that
    /// share an id (the RX 7900 XTX has 24 GB, the XT 20 GB).
    min_memory_gib: u32,
    model: &'static str,
    peak: Option<(PeakFlops, &'static str)>,
}

const T: f64 = 1e12;

/// The table: the first row whose vendor, id, memory and board name match
/// wins. Peaks are the vendor's dense figures (no sparsity); fp32 is the
/// vector (non-matrix) rate, as NVIDIA's table has the CUDA cores' rate.
const KNOWN: &[Known] = &[
    Known {
        vendor: GpuVendor::Amd,
        product: None,
        ids: &[0x74a1],
        min_memory_gib: 0,
        model: "Instinct MI300X",
        // FP32 vector 163.4, TF32 653.7, FP16 and BF16 1307.4, FP8 2614.9 TFLOPS.
        peak: Some((
            PeakFlops {
                fp32: 163.4 * T,
                tf32: Some(653.7 * T),
                fp16: Some(1307.4 * T),
                bf16: Some(1307.4 * T),
                fp8: Some(2614.9 * T),
            },
            "AMD Instinct MI300X data sheet",
        )),
    },
    Known {
        vendor: GpuVendor::Amd,
        product: None,
        ids: &[0x740f],
        min_memory_gib: 0,
        model: "Instinct MI210",
        // FP32 vector 22.6, FP16 and BF16 181.0 TFLOPS.
        peak: Some((
            PeakFlops {
                fp32: 22.6 * T,
                tf32: None,
                fp16: Some(181.0 * T),
                bf16: Some(181.0 * T),
                fp8: None,
            },
            "AMD Instinct MI210 data sheet",
        )),
    },
    Known {
        vendor: GpuVendor::Amd,
        product: Some("MI250X"),
        ids: &[0x7408, 0x740c],
        min_memory_gib: 0,
        model: "Instinct MI250X (one GCD)",
        // MI250X: FP32 vector 47.9, FP16 and BF16 383.0 TFLOPS per board.
        peak: Some((
            PeakFlops {
                fp32: 47.9 / 2.0 * T,
                tf32: None,
                fp16: Some(383.0 / 2.0 * T),
                bf16: Some(383.0 / 2.0 * T),
                fp8: None,
            },
            "AMD Instinct MI250X data sheet, halved per GCD",
        )),
    },
    Known {
        vendor: GpuVendor::Amd,
        product: None,
        ids: &[0x7408, 0x740c],
        min_memory_gib: 0,
        // Two dies (GCDs) per board, each its own device with half the
        // board's memory and rate. The MI250X and the MI250 share these ids;
        // the MI250's lower figures are taken unless the board names itself
        // (the row above).
        model: "Instinct MI250X/MI250 (one GCD)",
        // MI250: FP32 vector 45.3, FP16 and BF16 362.1 TFLOPS per board.
        peak: Some((
            PeakFlops {
                fp32: 45.3 / 2.0 * T,
                tf32: None,
                fp16: Some(362.1 / 2.0 * T),
                bf16: Some(362.1 / 2.0 * T),
                fp8: None,
            },
            "AMD Instinct MI250 data sheet, halved per GCD",
        )),
    },
    Known {
        vendor: GpuVendor::Amd,
        product: None,
        ids: &[0x744c],
        min_memory_gib: 23,
        model: "Radeon RX 7900 XTX",
        // FP32 61.4, FP16 122.8 TFLOPS; RDNA 3's WMMA runs bf16 at the fp16 rate.
        peak: Some((
            PeakFlops {
                fp32: 61.4 * T,
                tf32: None,
                fp16: Some(122.8 * T),
                bf16: Some(122.8 * T),
                fp8: None,
            },
            "AMD Radeon RX 7900 XTX specifications; RDNA 3 ISA (WMMA bf16 = fp16 rate)",
        )),
    },
    Known {
        vendor: GpuVendor::Amd,
        product: None,
        ids: &[0x744c],
        min_memory_gib: 0,
        model: "Radeon RX 7900 XT/GRE",
        peak: None,
    },
    Known {
        vendor: GpuVendor::Intel,
        product: None,
        ids: &[0x56a0],
        min_memory_gib: 0,
        model: "Arc A770",
        peak: None,
    },
    Known {
        vendor: GpuVendor::Intel,
        product: None,
        ids: &[0x56a1],
        min_memory_gib: 0,
        model: "Arc A750",
        peak: None,
    },
    Known {
        vendor: GpuVendor::Intel,
        product: None,
        ids: &[0x0bd5, 0x0bd6],
        min_memory_gib: 0,
        model: "Data Center GPU Max 1550",
        peak: None,
    },
    Known {
        vendor: GpuVendor::Intel,
        product: None,
        ids: &[0x0bda],
        min_memory_gib: 0,
        model: "Data Center GPU Max 1100",
        peak: None,
    },
];

/// A sysfs file's text, trimmed; `None` if missing or empty.
fn read(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// A `0x1002`-style id file.
fn read_hex(path: &Path) -> Option<u16> {
    let text = read(path)?;
    u16::from_str_radix(text.trim_start_matches("0x"), 16).ok()
}

/// `gfx_target_version` as the architecture's name: 90402 → `gfx942`,
/// 90010 → `gfx90a`, 110000 → `gfx1100`.
fn gfx_name(version: u32) -> String {
    let (major, minor, step) = (version / 10000, (version / 100) % 100, version % 100);
    format!("gfx{major}{minor:x}{step:x}")
}

/// The KFD topology's architectures by PCI location (`location_id`, the
/// bus, device and function as `bus << 8 | device << 3 | function`).
fn kfd_architectures(root: &Path) -> Vec<(u32, String)> {
    let nodes = root.join("sys/class/kfd/kfd/topology/nodes");
    let Ok(entries) = std::fs::read_dir(nodes) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let Some(props) = read(&entry.path().join("properties")) else {
            continue;
        };
        let value = |key: &str| {
            props.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse::<u32>().ok()).flatten()
            })
        };
        // CPU nodes have version 0.
        if let (Some(version), Some(location)) = (value("gfx_target_version"), value("location_id"))
            && version > 0
        {
            found.push((location, gfx_name(version)));
        }
    }
    found
}

/// `0000:03:00.0` → `bus << 8 | device << 3 | function`.
fn location_id(slot: &str) -> Option<u32> {
    let mut parts = slot.rsplit(':');
    let dev_fn = parts.next()?;
    let bus = u32::from_str_radix(parts.next()?, 16).ok()?;
    let (dev, func) = dev_fn.split_once('.')?;
    let dev = u32::from_str_radix(dev, 16).ok()?;
    let func = u32::from_str_radix(func, 16).ok()?;
    Some(bus << 8 | dev << 3 | func)
}

/// The AMD and Intel GPUs under `root` (`/` on a machine), one per PCI
/// device, in card order. Empty where there is no sysfs (macOS, Windows).
pub fn detect_drm_gpus(root: &Path) -> Vec<OtherGpu> {
    let Ok(entries) = std::fs::read_dir(root.join("sys/class/drm")) else {
        return Vec::new();
    };
    // card0, card1, ...: not connectors (card0-DP-1) or render nodes.
    let mut cards: Vec<(u32, std::path::PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("card")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    cards.sort();
    let architectures = kfd_architectures(root);
    let mut gpus: Vec<OtherGpu> = Vec::new();
    for (_, card) in cards {
        let device = card.join("device");
        let Some(vendor) = read_hex(&device.join("vendor")) else {
            continue;
        };
        let Some(id) = read_hex(&device.join("device")) else {
            continue;
        };
        // The PCI slot is the name the device link points to.
        let slot = std::fs::read_link(&device)
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        if !slot.is_empty() && gpus.iter().any(|g| g.pci_slot == slot) {
            continue;
        }
        let bytes = |file: &str| read(&device.join(file)).and_then(|t| t.parse::<u64>().ok());
        let memory = bytes("mem_info_vram_total");
        let Some(mut gpu) =
            OtherGpu::from_pci(vendor, id, memory, read(&device.join("product_name")))
        else {
            continue;
        };
        gpu.memory_used_bytes = bytes("mem_info_vram_used");
        gpu.architecture = location_id(&slot).and_then(|loc| {
            architectures
                .iter()
                .find(|(l, _)| *l == loc)
                .map(|(_, a)| a.clone())
        });
        gpu.pci_slot = slot;
        gpus.push(gpu);
    }
    gpus
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recorded card: `vendor`, `device` and the files given, under
    /// `root/sys/class/drm/card<n>` linked to `root/sys/devices/.../<slot>`.
    fn card(root: &Path, n: u32, slot: &str, files: &[(&str, &str)]) {
        let dev = root.join("sys/devices/pci0000:00").join(slot);
        std::fs::create_dir_all(&dev).expect("mkdir");
        for (name, text) in files {
            std::fs::write(dev.join(name), format!("{text}\n")).expect("write");
        }
        let card = root.join(format!("sys/class/drm/card{n}"));
        std::fs::create_dir_all(&card).expect("mkdir");
        std::os::unix::fs::symlink(&dev, card.join("device")).expect("link");
        // A connector of the same card, which is no GPU of its own.
        std::fs::create_dir_all(root.join(format!("sys/class/drm/card{n}-DP-1"))).expect("mkdir");
    }

    fn kfd_node(root: &Path, n: u32, props: &str) {
        let dir = root.join(format!("sys/class/kfd/kfd/topology/nodes/{n}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("properties"), props).expect("write");
    }

    #[test]
    fn gfx_versions_and_pci_locations_decode() {
        assert_eq!(gfx_name(90402), "gfx942");
        assert_eq!(gfx_name(90010), "gfx90a");
        assert_eq!(gfx_name(110000), "gfx1100");
        assert_eq!(location_id("0000:03:00.0"), Some(0x300));
        assert_eq!(location_id("0000:c1:00.1"), Some(0xc1 << 8 | 1));
    }

    #[cfg(unix)]
    #[test]
    fn an_instinct_node_a_radeon_desktop_and_an_intel_arc_are_read_from_sysfs() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        // An MI300X node's first GPU, with the KFD topology (a CPU node too).
        card(
            root,
            1,
            "0000:0c:00.0",
            &[
                ("vendor", "0x1002"),
                ("device", "0x74a1"),
                ("mem_info_vram_total", "206141652992"),
                ("mem_info_vram_used", "299892736"),
                ("product_name", "AMD Instinct MI300X"),
            ],
        );
        kfd_node(
            root,
            0,
            "cpu_cores_count 96\ngfx_target_version 0\nlocation_id 0\n",
        );
        kfd_node(
            root,
            1,
            "simd_count 1216\ngfx_target_version 90402\nlocation_id 3072\ndomain 0\n",
        );
        // A desktop RX 7900 XTX without a product name, no KFD node.
        card(
            root,
            2,
            "0000:03:00.0",
            &[
                ("vendor", "0x1002"),
                ("device", "0x744c"),
                ("mem_info_vram_total", "25753026560"),
            ],
        );
        // An MI250X GCD that names itself.
        card(
            root,
            3,
            "0000:29:00.0",
            &[
                ("vendor", "0x1002"),
                ("device", "0x740c"),
                ("mem_info_vram_total", "68702699520"),
                ("product_name", "AMD Instinct MI250X"),
            ],
        );
        // An Intel Arc A770 and the server's BMC graphics (ASPEED), which
        // is no GPU to train on.
        card(
            root,
            4,
            "0000:04:00.0",
            &[("vendor", "0x8086"), ("device", "0x56a0")],
        );
        card(
            root,
            0,
            "0000:02:00.0",
            &[("vendor", "0x1a03"), ("device", "0x2000")],
        );

        let gpus = detect_drm_gpus(root);
        let names: Vec<&str> = gpus.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "AMD Instinct MI300X",
                "AMD Radeon RX 7900 XTX",
                "AMD Instinct MI250X",
                "Intel Arc A770"
            ]
        );
        let mi300 = &gpus[0];
        assert_eq!(mi300.vendor, GpuVendor::Amd);
        assert_eq!(mi300.architecture.as_deref(), Some("gfx942"));
        assert_eq!(mi300.memory_total_bytes, Some(206_141_652_992));
        assert_eq!(mi300.memory_used_bytes, Some(299_892_736));
        assert_eq!(mi300.pci_slot, "0000:0c:00.0");
        assert_eq!(mi300.peak.map(|p| p.bf16), Some(Some(1307.4e12)));
        let radeon = &gpus[1];
        assert_eq!(radeon.architecture, None);
        assert_eq!(radeon.memory_used_bytes, None);
        assert_eq!(radeon.table_model.as_deref(), Some("Radeon RX 7900 XTX"));
        assert_eq!(radeon.peak.map(|p| p.fp16), Some(Some(122.8e12)));
        let gcd = &gpus[2];
        assert_eq!(
            gcd.table_model.as_deref(),
            Some("Instinct MI250X (one GCD)")
        );
        assert_eq!(gcd.peak.map(|p| p.bf16), Some(Some(191.5e12)));
        let arc = &gpus[3];
        assert_eq!(arc.vendor, GpuVendor::Intel);
        assert_eq!((arc.memory_total_bytes, arc.peak), (None, None));
        assert!(gpus.iter().all(|g| g.fp16 && g.bf16 && !g.unified_memory));
        assert_eq!(detect_drm_gpus(&root.join("nothing")), Vec::new());
    }

    #[cfg(unix)]
    #[test]
    fn unknown_ids_are_named_by_vendor_and_id_and_shared_ids_by_memory() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        card(
            root,
            0,
            "0000:03:00.0",
            &[
                ("vendor", "0x1002"),
                ("device", "0x744c"),
                ("mem_info_vram_total", "21458059264"),
            ],
        );
        card(
            root,
            1,
            "0000:00:02.0",
            &[("vendor", "0x8086"), ("device", "0x46a6")],
        );
        let gpus = detect_drm_gpus(root);
        assert_eq!(gpus[0].name, "AMD Radeon RX 7900 XT/GRE");
        assert_eq!(gpus[0].peak, None);
        assert_eq!(gpus[1].name, "Intel GPU 0x46a6");
        assert_eq!(gpus[1].table_model, None);
    }
}
