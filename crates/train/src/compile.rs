//! `optimization.compile` on CubeCL backends (wgpu, CUDA): what PyTorch's
//! `torch.compile` modes buy there is kernel autotuning, so the modes map
//! onto CubeCL's autotune levels, and (with the `autotune-cache` feature,
//! which kiln-cli's `wgpu` and `cuda` turn on) the tuned choices are kept in
//! CubeCL's on-disk cache in the user cache directory, so a second run
//! starts tuned.
//! Burn's operation fusion is a compile-time feature (`burn/fusion`), not a
//! switch a run can flip; the line says whether this build has it. On the
//! CPU backend (flex) none of this applies and the line says so.

use kiln_config::{CompileMode, OptimizationSection};

use crate::DeviceChoice;

/// CubeCL's autotune level for `optimization`: off → minimal (the fewest
/// candidates; CubeCL cannot skip tuning), `default` and `reduce-overhead`
/// → balanced, `max-autotune` → full.
pub fn autotune_level(optimization: &OptimizationSection) -> &'static str {
    if !optimization.compile {
        return "minimal";
    }
    match optimization.compile_mode {
        CompileMode::Default | CompileMode::ReduceOverhead => "balanced",
        CompileMode::MaxAutotune => "full",
    }
}

/// Whether this build fuses operations (Burn's `fusion` feature).
pub const FUSION_BUILT_IN: bool = cfg!(feature = "fusion");

/// Applies `optimization` to CubeCL's runtime configuration, before the
/// first kernel runs, and returns the line a run prints about it.
pub fn apply_compile(optimization: &OptimizationSection, device: &DeviceChoice) -> String {
    let asked = if optimization.compile {
        let mode = match optimization.compile_mode {
            CompileMode::Default => "default",
            CompileMode::ReduceOverhead => "reduce-overhead",
            CompileMode::MaxAutotune => "max-autotune",
        };
        format!("on ({mode})")
    } else {
        "off".to_string()
    };
    if !device.is_gpu {
        return format!(
            "compile: {asked} — fusion and autotuning are GPU (CubeCL) features, not applicable on flex"
        );
    }
    let level = autotune_level(optimization);
    let fusion = if FUSION_BUILT_IN {
        "fusion built in (always on in this build)"
    } else {
        "fusion not in this build (`--features fusion`)"
    };
    format!("compile: {asked} — {}; {fusion}", configure_cubecl(level))
}

/// Sets CubeCL's runtime configuration (kiln's autotune level, the cache
/// in the user cache directory) and says what is in effect: the level and
/// whether tuned kernels are kept across runs.
#[cfg(feature = "gpu")]
fn configure_cubecl(level: &str) -> String {
    use cubecl_runtime::config::autotune::AutotuneLevel;
    use cubecl_runtime::config::cache::CacheConfig;
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};

    let name = |level: &AutotuneLevel| match level {
        AutotuneLevel::Minimal => "minimal",
        AutotuneLevel::Balanced => "balanced",
        AutotuneLevel::Extensive => "extensive",
        AutotuneLevel::Full => "full",
    };
    // The CUBECL_* variables still win, as CubeCL's own loading would have
    // it (CUBECL_AUTOTUNE_LEVEL over kiln's level); a cubecl.toml gives the
    // rest (its cache settings), kiln the level.
    let mut config = CubeClRuntimeConfig::from_current_dir();
    let env_level = std::env::var("CUBECL_AUTOTUNE_LEVEL").is_ok();
    config = config.override_from_env();
    if !env_level {
        config.autotune.level = match level {
            "minimal" => AutotuneLevel::Minimal,
            "full" => AutotuneLevel::Full,
            _ => AutotuneLevel::Balanced,
        };
    }
    if matches!(config.environment.path, CacheConfig::Target) {
        config.environment.path = CacheConfig::Global;
    }
    let kept = if config.autotune.disable_cache {
        "tuned kernels not kept across runs (the cache disabled by cubecl.toml or CUBECL_AUTOTUNE_CACHE)".to_string()
    } else if cfg!(feature = "autotune-cache") {
        // Kept on disk only with the `autotune-cache` feature (Burn's
        // `persistence`).
        format!(
            "tuned kernels cached in {}",
            config.environment.path.root().display()
        )
    } else {
        "tuned kernels not kept across runs (a build without `autotune-cache`)".to_string()
    };
    let level = name(&config.autotune.level);
    if CubeClRuntimeConfig::try_set(config) {
        format!("CubeCL autotune level {level}, {kept}")
    } else {
        let current = CubeClRuntimeConfig::get();
        format!(
            "CubeCL was configured earlier in this process (autotune level {}, cache in {})",
            name(&current.autotune.level),
            current.environment.path.root().display()
        )
    }
}

#[cfg(not(feature = "gpu"))]
fn configure_cubecl(_level: &str) -> String {
    "this build has no CubeCL backend".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_modes_map_to_autotune_levels() {
        let o = |compile, compile_mode| {
            let mut o = kiln_config::RunConfig::default().optimization;
            o.compile = compile;
            o.compile_mode = compile_mode;
            o
        };
        assert_eq!(
            autotune_level(&o(false, CompileMode::MaxAutotune)),
            "minimal"
        );
        assert_eq!(autotune_level(&o(true, CompileMode::Default)), "balanced");
        assert_eq!(
            autotune_level(&o(true, CompileMode::ReduceOverhead)),
            "balanced"
        );
        assert_eq!(autotune_level(&o(true, CompileMode::MaxAutotune)), "full");
    }

    #[test]
    fn on_flex_compile_is_not_applicable() {
        let flex = crate::device::flex("device.backend = flex");
        let line = apply_compile(
            &{
                let mut o = kiln_config::RunConfig::default().optimization;
                o.compile = true;
                o.compile_mode = CompileMode::MaxAutotune;
                o
            },
            &flex,
        );
        assert!(line.contains("not applicable on flex"), "{line}");
        assert!(line.contains("on (max-autotune)"), "{line}");
    }
}
