//! Which instruction set each family of CPU kernels runs with on this
//! machine: both choose at run time, so the build alone does not say.

/// The instruction sets of the CPU kernels on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CpuIsa {
    /// The matrix products (the `gemm` crate, which flex and kiln's linear
    /// and attention kernels call): its widest microkernels this CPU runs.
    pub gemm: &'static str,
    /// kiln's own loops (GELU, softmax, LayerNorm, bias sums), compiled per
    /// instruction-set level by `multiversion`: the level this CPU gets.
    pub kernels: &'static str,
    /// Burn's own element-wise operations on flex (burn-flex's SIMD loops
    /// through `macerator`: the residual sums, the gradients' sums, some
    /// reductions), which choose their level at run time too. kiln-model's
    /// `avx512` feature does not reach them: burn-flex always builds
    /// macerator's AVX-512 level, so an AVX-512 CPU runs it even in the
    /// AVX2-only build. `none` without the flex backend.
    pub elementwise: &'static str,
}

/// Whether this build has the CPU kernels' AVX-512 versions (kiln-model's
/// `avx512` feature). Without them an AVX-512 CPU runs the AVX2 + FMA ones.
pub const AVX512_BUILT: bool = cfg!(feature = "avx512");

/// What [`CpuIsa`]'s families run with here.
pub fn cpu_isa() -> CpuIsa {
    CpuIsa {
        gemm: gemm_isa(),
        kernels: loops_isa(),
        elementwise: flex_isa(),
    }
}

/// The level macerator 0.5 picks for burn-flex's loops (`Arch::detect`,
/// the detection its `with_simd` dispatch runs), named as kiln's loops'
/// levels are. Its `Arch` is `non_exhaustive` and its variants depend on
/// macerator's own features, so the name is read off the variant's.
#[cfg(feature = "flex")]
fn flex_isa() -> &'static str {
    match format!("{:?}", macerator::Arch::detect()).as_str() {
        "V4FP16" => "x86-64-v4 (avx512 with fp16)",
        "V4" => "x86-64-v4 (avx512)",
        "V3" => "x86-64-v3 (avx2+fma)",
        "V2" => "x86-64-v2 (sse4.2)",
        "NeonFma" | "NeonF16" => "aarch64 (neon)",
        "Scalar" => "scalar",
        _ => "other",
    }
}

#[cfg(not(feature = "flex"))]
fn flex_isa() -> &'static str {
    "none"
}

/// gemm 0.19's dispatch (`gemm-common`'s `gemm_def!`): AVX-512F kernels when
/// built with `x86-v4` (kiln-model's `avx512` feature turns it on through
/// Burn) and the CPU has AVX-512F; else FMA (its x86-64-v3 kernels); else
/// scalar.
#[cfg(target_arch = "x86_64")]
fn gemm_isa() -> &'static str {
    if AVX512_BUILT && std::arch::is_x86_feature_detected!("avx512f") {
        "avx512f"
    } else if std::arch::is_x86_feature_detected!("fma") {
        "avx2+fma"
    } else {
        "scalar"
    }
}

#[cfg(target_arch = "aarch64")]
fn gemm_isa() -> &'static str {
    if std::arch::is_aarch64_feature_detected!("neon") {
        "neon"
    } else {
        "scalar"
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn gemm_isa() -> &'static str {
    "scalar"
}

/// The level kiln's loops run at on this x86-64 CPU.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoopsLevel {
    /// multiversion's AVX-512 level: x86-64-v4 with Ice Lake's extensions.
    V4,
    /// x86-64-v4 proper (AVX-512 F/BW/CD/DQ/VL) without Ice Lake's
    /// extensions (Skylake-SP, Cascade Lake): `simd_levels!`'s own version.
    V4WithoutExtensions,
    /// AVX2 with FMA.
    V3,
    /// SSE4.2.
    V2,
    /// x86-64's baseline (SSE2).
    Baseline,
}

/// The level of kiln's loops on this CPU: multiversion 0.9's `targets =
/// "simd"` on x86-64 (its v4 level needs the Ice Lake set of AVX-512
/// extensions, which it adds unless built with
/// `multiversion_allow_slow_avx512`; v3 AVX2 with FMA; v2 SSE4.2), with
/// `simd_levels!`'s x86-64-v4 for AVX-512 CPUs without that set. Without
/// kiln-model's `avx512` feature the loops have no v4 version. Detected
/// once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn loops_level() -> LoopsLevel {
    static LEVEL: std::sync::OnceLock<LoopsLevel> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        macro_rules! all {
            ($($f:tt),*) => { true $(&& std::arch::is_x86_feature_detected!($f))* };
        }
        let v3 = all!(
            "avx",
            "avx2",
            "bmi1",
            "bmi2",
            "f16c",
            "fma",
            "lzcnt",
            "movbe",
            "popcnt",
            "sse3",
            "sse4.1",
            "sse4.2",
            "ssse3",
            "xsave",
            "cmpxchg16b"
        );
        let v4 =
            AVX512_BUILT && v3 && all!("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl");
        let extensions = all!(
            "avx512bitalg",
            "avx512ifma",
            "avx512vbmi",
            "avx512vbmi2",
            "avx512vnni",
            "avx512vpopcntdq",
            "gfni",
            "vaes",
            "vpclmulqdq"
        );
        let v2 = all!("popcnt", "sse3", "sse4.1", "sse4.2", "ssse3", "cmpxchg16b");
        if v4 && extensions {
            LoopsLevel::V4
        } else if v4 {
            LoopsLevel::V4WithoutExtensions
        } else if v3 {
            LoopsLevel::V3
        } else if v2 {
            LoopsLevel::V2
        } else {
            LoopsLevel::Baseline
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn loops_isa() -> &'static str {
    match loops_level() {
        LoopsLevel::V4 => "x86-64-v4 (avx512)",
        LoopsLevel::V4WithoutExtensions => "x86-64-v4 (avx512, without Ice Lake's extensions)",
        LoopsLevel::V3 => "x86-64-v3 (avx2+fma)",
        LoopsLevel::V2 => "x86-64-v2 (sse4.2)",
        LoopsLevel::Baseline => "x86-64 (sse2)",
    }
}

#[cfg(target_arch = "aarch64")]
fn loops_isa() -> &'static str {
    "aarch64 (neon)"
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn loops_isa() -> &'static str {
    "portable"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_levels_follow_the_cpu() {
        let isa = cpu_isa();
        let has = |f: &str| {
            std::fs::read_to_string("/proc/cpuinfo")
                .map(|c| c.split_whitespace().any(|w| w == f))
                .ok()
        };
        // On Linux, /proc/cpuinfo says what the CPU has.
        if let (Some(avx512f), Some(fma)) = (has("avx512f"), has("fma")) {
            let want = if avx512f && AVX512_BUILT {
                "avx512f"
            } else if fma {
                "avx2+fma"
            } else {
                "scalar"
            };
            assert_eq!(isa.gemm, want);
            if !avx512f || !AVX512_BUILT {
                assert!(!isa.kernels.contains("v4"), "{isa:?}");
            }
            // Every AVX-512 CPU gets an AVX-512 version of the loops, with
            // Ice Lake's extensions or without them.
            let avx512 = ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
                .iter()
                .all(|f| has(f) == Some(true));
            if avx512 && AVX512_BUILT {
                assert!(isa.kernels.contains("v4"), "{isa:?}");
                // /proc/cpuinfo's names for the set multiversion adds.
                let extensions = [
                    "avx512_bitalg",
                    "avx512ifma",
                    "avx512vbmi",
                    "avx512_vbmi2",
                    "avx512_vnni",
                    "avx512_vpopcntdq",
                    "gfni",
                    "vaes",
                    "vpclmulqdq",
                ]
                .iter()
                .all(|f| has(f) == Some(true));
                assert_eq!(
                    isa.kernels.contains("without Ice Lake's extensions"),
                    !extensions,
                    "{isa:?}"
                );
            }
            // burn-flex's loops: AVX-512 wherever the CPU has it, whatever
            // kiln's `avx512` feature says (macerator's V4 needs F, BW, CD,
            // DQ and VL).
            #[cfg(feature = "flex")]
            if avx512 {
                assert!(isa.elementwise.starts_with("x86-64-v4"), "{isa:?}");
            } else if has("avx2") == Some(true) && fma {
                assert_eq!(isa.elementwise, "x86-64-v3 (avx2+fma)", "{isa:?}");
            }
            if fma && has("avx2") == Some(true) && has("bmi2") == Some(true) {
                assert!(
                    isa.kernels.contains("v3") || isa.kernels.contains("v4"),
                    "{isa:?}"
                );
            }
        }
    }
}
