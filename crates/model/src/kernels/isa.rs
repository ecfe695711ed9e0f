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
}

/// Whether this build has the CPU kernels' AVX-512 versions (kiln-model's
/// `avx512` feature). Without them an AVX-512 CPU runs the AVX2 + FMA ones.
pub const AVX512_BUILT: bool = cfg!(feature = "avx512");

/// What [`CpuIsa`]'s families run with here.
pub fn cpu_isa() -> CpuIsa {
    CpuIsa {
        gemm: gemm_isa(),
        kernels: loops_isa(),
    }
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

/// multiversion 0.9's `targets = "simd"` on x86-64: its v4 level needs the
/// Ice Lake set of AVX-512 extensions (it adds them unless built with
/// `multiversion_allow_slow_avx512`), v3 AVX2 with FMA, v2 SSE4.2. Without
/// kiln-model's `avx512` feature the loops have no v4 version.
#[cfg(target_arch = "x86_64")]
fn loops_isa() -> &'static str {
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
    let v4 = AVX512_BUILT
        && v3
        && all!(
            "avx512f",
            "avx512bw",
            "avx512cd",
            "avx512dq",
            "avx512vl",
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
    if v4 {
        "x86-64-v4 (avx512)"
    } else if v3 {
        "x86-64-v3 (avx2+fma)"
    } else if v2 {
        "x86-64-v2 (sse4.2)"
    } else {
        "x86-64 (sse2)"
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
            if fma && has("avx2") == Some(true) && has("bmi2") == Some(true) {
                assert!(
                    isa.kernels.contains("v3") || isa.kernels.contains("v4"),
                    "{isa:?}"
                );
            }
        }
    }
}
