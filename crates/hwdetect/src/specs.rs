//! Dense peak FLOP/s of the NVIDIA GPUs kiln has presets for, per dtype.
//!
//! Every figure is the vendor's dense (not 2:4 sparse) number for tensor-core
//! math with fp32 accumulation where that differs, taken from the data sheet or
//! architecture white paper named beside it. `None` means the GPU has no such
//! math (T4 and V100 have no bf16/tf32 tensor cores).

use serde::{Deserialize, Serialize};

/// Peak dense throughput of one GPU, in FLOP/s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeakFlops {
    /// Dense fp32 FLOP/s (CUDA cores).
    pub fp32: f64,
    /// Dense TF32 tensor-core FLOP/s, where the GPU has them.
    pub tf32: Option<f64>,
    /// Dense fp16 tensor-core FLOP/s (fp32 accumulate), where the GPU has them.
    pub fp16: Option<f64>,
    /// Dense bf16 tensor-core FLOP/s, where the GPU has them.
    pub bf16: Option<f64>,
    /// Dense fp8 tensor-core FLOP/s, where the GPU has them.
    pub fp8: Option<f64>,
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSpec {
    /// kiln's name for the model ("A100 80GB", "RTX 4090").
    pub model: &'static str,
    /// Tokens that identify it in the NVML name, all of which must appear as
    /// whole words (so "A10" does not match "A100").
    pub tokens: &'static [&'static str],
    /// Memory in GiB, for telling 40 GB from 80 GB parts (0: any).
    pub min_memory_gib: u32,
    /// The data sheet's dense peaks of this model.
    pub peak: PeakFlops,
    /// Where the figures come from.
    pub source: &'static str,
}

const T: f64 = 1e12;

/// The table. More specific rows come first: the first match wins.
pub const GPU_SPECS: &[GpuSpec] = &[
    GpuSpec {
        model: "T4",
        tokens: &["T4"],
        min_memory_gib: 0,
        // FP32 8.1 TFLOPS; mixed-precision (FP16/FP32) tensor 65 TFLOPS.
        peak: PeakFlops {
            fp32: 8.1 * T,
            tf32: None,
            fp16: Some(65.0 * T),
            bf16: None,
            fp8: None,
        },
        source: "NVIDIA T4 Tensor Core GPU data sheet",
    },
    GpuSpec {
        model: "V100 PCIe",
        tokens: &["V100", "PCIE"],
        min_memory_gib: 0,
        // FP32 14 TFLOPS; tensor 112 TFLOPS.
        peak: PeakFlops {
            fp32: 14.0 * T,
            tf32: None,
            fp16: Some(112.0 * T),
            bf16: None,
            fp8: None,
        },
        source: "NVIDIA V100 Tensor Core GPU data sheet (PCIe)",
    },
    GpuSpec {
        model: "V100 SXM2",
        tokens: &["V100"],
        min_memory_gib: 0,
        // FP32 15.7 TFLOPS; tensor 125 TFLOPS.
        peak: PeakFlops {
            fp32: 15.7 * T,
            tf32: None,
            fp16: Some(125.0 * T),
            bf16: None,
            fp8: None,
        },
        source: "NVIDIA V100 Tensor Core GPU data sheet (SXM2)",
    },
    GpuSpec {
        model: "A10",
        tokens: &["A10"],
        min_memory_gib: 0,
        // FP32 31.2; TF32 62.5; BF16/FP16 125 TFLOPS (sparse figures halved).
        peak: PeakFlops {
            fp32: 31.2 * T,
            tf32: Some(62.5 * T),
            fp16: Some(125.0 * T),
            bf16: Some(125.0 * T),
            fp8: None,
        },
        source: "NVIDIA A10 Tensor Core GPU data sheet",
    },
    GpuSpec {
        model: "A30",
        tokens: &["A30"],
        min_memory_gib: 0,
        // FP32 10.3; TF32 82; BF16/FP16 165 TFLOPS.
        peak: PeakFlops {
            fp32: 10.3 * T,
            tf32: Some(82.0 * T),
            fp16: Some(165.0 * T),
            bf16: Some(165.0 * T),
            fp8: None,
        },
        source: "NVIDIA A30 Tensor Core GPU data sheet",
    },
    GpuSpec {
        model: "A40",
        tokens: &["A40"],
        min_memory_gib: 0,
        // FP32 37.4; TF32 74.8; BF16/FP16 149.7 TFLOPS.
        peak: PeakFlops {
            fp32: 37.4 * T,
            tf32: Some(74.8 * T),
            fp16: Some(149.7 * T),
            bf16: Some(149.7 * T),
            fp8: None,
        },
        source: "NVIDIA A40 data sheet",
    },
    GpuSpec {
        model: "A100 80GB",
        tokens: &["A100"],
        min_memory_gib: 70,
        // FP32 19.5; TF32 156; BF16/FP16 312 TFLOPS (SXM and PCIe alike).
        peak: PeakFlops {
            fp32: 19.5 * T,
            tf32: Some(156.0 * T),
            fp16: Some(312.0 * T),
            bf16: Some(312.0 * T),
            fp8: None,
        },
        source: "NVIDIA A100 Tensor Core GPU data sheet (80GB)",
    },
    GpuSpec {
        model: "A100 40GB",
        tokens: &["A100"],
        min_memory_gib: 0,
        peak: PeakFlops {
            fp32: 19.5 * T,
            tf32: Some(156.0 * T),
            fp16: Some(312.0 * T),
            bf16: Some(312.0 * T),
            fp8: None,
        },
        source: "NVIDIA A100 Tensor Core GPU data sheet (40GB)",
    },
    GpuSpec {
        model: "L4",
        tokens: &["L4"],
        min_memory_gib: 0,
        // FP32 30.3; TF32 60; BF16/FP16 121; FP8 242.5 TFLOPS (sparse halved).
        peak: PeakFlops {
            fp32: 30.3 * T,
            tf32: Some(60.0 * T),
            fp16: Some(121.0 * T),
            bf16: Some(121.0 * T),
            fp8: Some(242.5 * T),
        },
        source: "NVIDIA L4 Tensor Core GPU data sheet",
    },
    GpuSpec {
        model: "RTX 3060",
        tokens: &["RTX", "3060"],
        min_memory_gib: 0,
        // FP32 12.7; GeForce tensor math with FP32 accumulate runs at half
        // the FP16-accumulate rate: FP16/BF16 25.4, TF32 12.7 TFLOPS.
        peak: PeakFlops {
            fp32: 12.7 * T,
            tf32: Some(12.7 * T),
            fp16: Some(25.4 * T),
            bf16: Some(25.4 * T),
            fp8: None,
        },
        source: "NVIDIA Ampere GA102 GPU architecture white paper, appendix (GA106 scaled by SM count and boost clock)",
    },
    GpuSpec {
        model: "RTX 3090",
        tokens: &["RTX", "3090"],
        min_memory_gib: 0,
        // FP32 35.6; FP16/BF16 tensor with FP32 accumulate 71; TF32 35.6 TFLOPS.
        peak: PeakFlops {
            fp32: 35.6 * T,
            tf32: Some(35.6 * T),
            fp16: Some(71.0 * T),
            bf16: Some(71.0 * T),
            fp8: None,
        },
        source: "NVIDIA Ampere GA102 GPU architecture white paper, table of RTX 3090 specs",
    },
    GpuSpec {
        model: "RTX 4080",
        tokens: &["RTX", "4080"],
        min_memory_gib: 0,
        // FP32 48.7; FP16/BF16 with FP32 accumulate 97.5; TF32 48.7; FP8 194.9 TFLOPS.
        peak: PeakFlops {
            fp32: 48.7 * T,
            tf32: Some(48.7 * T),
            fp16: Some(97.5 * T),
            bf16: Some(97.5 * T),
            fp8: Some(194.9 * T),
        },
        source: "NVIDIA Ada Lovelace GPU architecture white paper, RTX 4080 16GB column",
    },
    GpuSpec {
        model: "RTX 4090",
        tokens: &["RTX", "4090"],
        min_memory_gib: 0,
        // FP32 82.6; FP16/BF16 with FP32 accumulate 165.2; TF32 82.6; FP8 330.3 TFLOPS.
        peak: PeakFlops {
            fp32: 82.6 * T,
            tf32: Some(82.6 * T),
            fp16: Some(165.2 * T),
            bf16: Some(165.2 * T),
            fp8: Some(330.3 * T),
        },
        source: "NVIDIA Ada Lovelace GPU architecture white paper, RTX 4090 column",
    },
    GpuSpec {
        model: "H100 PCIe",
        tokens: &["H100", "PCIE"],
        min_memory_gib: 0,
        // FP32 51; TF32 378; BF16/FP16 756; FP8 1,513 TFLOPS (sparse halved).
        peak: PeakFlops {
            fp32: 51.0 * T,
            tf32: Some(378.0 * T),
            fp16: Some(756.0 * T),
            bf16: Some(756.0 * T),
            fp8: Some(1513.0 * T),
        },
        source: "NVIDIA H100 Tensor Core GPU data sheet (PCIe)",
    },
    GpuSpec {
        model: "H100 SXM",
        tokens: &["H100"],
        min_memory_gib: 0,
        // FP32 67; TF32 494.7; BF16/FP16 989.4; FP8 1,978.9 TFLOPS (sparse halved).
        peak: PeakFlops {
            fp32: 67.0 * T,
            tf32: Some(494.7 * T),
            fp16: Some(989.4 * T),
            bf16: Some(989.4 * T),
            fp8: Some(1978.9 * T),
        },
        source: "NVIDIA H100 Tensor Core GPU data sheet (SXM)",
    },
    GpuSpec {
        model: "H200",
        tokens: &["H200"],
        min_memory_gib: 0,
        // Same Hopper compute as H100 SXM, more and faster memory.
        peak: PeakFlops {
            fp32: 67.0 * T,
            tf32: Some(494.7 * T),
            fp16: Some(989.4 * T),
            bf16: Some(989.4 * T),
            fp8: Some(1978.9 * T),
        },
        source: "NVIDIA H200 Tensor Core GPU data sheet (SXM)",
    },
];

/// The first row whose tokens all appear as whole words in `name` and whose
/// memory bound fits.
pub fn lookup(name: &str, memory_bytes: u64) -> Option<&'static GpuSpec> {
    let words = words(name);
    let gib = memory_bytes as f64 / f64::from(1u32 << 30);
    GPU_SPECS.iter().find(|spec| {
        spec.tokens.iter().all(|t| words.iter().any(|w| w == t))
            && gib >= f64::from(spec.min_memory_gib)
    })
}

/// Upper-cased alphanumeric words of a GPU name: "NVIDIA A100-SXM4-80GB" →
/// ["NVIDIA", "A100", "SXM4", "80GB"].
fn words(name: &str) -> Vec<String> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_uppercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn model(name: &str, gib: u64) -> Option<&'static str> {
        lookup(name, gib * GIB).map(|s| s.model)
    }

    #[test]
    fn nvml_names_map_to_rows() {
        let cases = [
            ("Tesla T4", 15, Some("T4")),
            ("Tesla V100-SXM2-16GB", 16, Some("V100 SXM2")),
            ("Tesla V100-PCIE-32GB", 32, Some("V100 PCIe")),
            ("NVIDIA A10", 22, Some("A10")),
            ("NVIDIA A30", 24, Some("A30")),
            ("NVIDIA A40", 45, Some("A40")),
            ("NVIDIA A100-SXM4-40GB", 40, Some("A100 40GB")),
            ("NVIDIA A100-SXM4-80GB", 80, Some("A100 80GB")),
            ("NVIDIA A100 80GB PCIe", 80, Some("A100 80GB")),
            ("NVIDIA L4", 22, Some("L4")),
            ("NVIDIA L40S", 45, None),
            ("NVIDIA GeForce RTX 3060", 12, Some("RTX 3060")),
            ("NVIDIA GeForce RTX 3090", 24, Some("RTX 3090")),
            ("NVIDIA GeForce RTX 4080", 16, Some("RTX 4080")),
            ("NVIDIA GeForce RTX 4090", 24, Some("RTX 4090")),
            ("NVIDIA H100 PCIe", 80, Some("H100 PCIe")),
            ("NVIDIA H100 80GB HBM3", 80, Some("H100 SXM")),
            ("NVIDIA H200", 141, Some("H200")),
            ("NVIDIA GeForce GTX 1080", 8, None),
        ];
        for (name, gib, want) in cases {
            assert_eq!(model(name, gib), want, "{name}");
        }
    }

    #[test]
    fn rows_without_tensor_bf16_are_the_pre_ampere_ones() {
        for spec in GPU_SPECS {
            let pre_ampere = matches!(spec.model, "T4" | "V100 PCIe" | "V100 SXM2");
            assert_eq!(spec.peak.bf16.is_none(), pre_ampere, "{}", spec.model);
            assert_eq!(spec.peak.tf32.is_none(), pre_ampere, "{}", spec.model);
            assert!(spec.peak.fp16.is_some_and(|f| f > spec.peak.fp32));
            assert!(!spec.source.is_empty());
        }
    }
}
