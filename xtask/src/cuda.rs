//! Building kiln's CUDA backend from the project's own files.
//!
//! `cubecl-cuda` links a static LLVM (its NVPTX code generator) through
//! `cubecl-llvm`, whose build script takes it from `tracel-llvm-bundler`.
//! That bundler downloads a prebuilt LLVM from GitHub unless its directory,
//! `<XDG_DATA_HOME>/tracel/tracel-llvm-23.1.0-4`, already holds the marker
//! file `.tracel-llvm-installed`. PyPI's relocatable static LLVM
//! (`mlc-llvm-static`, with `mlc-llvm-static-extra-targets`) has the NVPTX
//! target and a working `llvm-config`: [`ensure_llvm`] installs it into
//! kiln's cache directory with that marker, and every CUDA build here points
//! `XDG_DATA_HOME` at that directory for the build command alone.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI wheels of the static LLVM (23.1.1, NVPTX included).
const LLVM_WHEELS: [&str; 2] = [
    "mlc-llvm-static==23.1.1.post0",
    "mlc-llvm-static-extra-targets==23.1.1.post0",
];

/// The directory `tracel-llvm-bundler` 23.1.0-4 reads under `XDG_DATA_HOME`.
const BUNDLER_DIR: &str = "tracel/tracel-llvm-23.1.0-4";

/// The file that tells the bundler its LLVM is installed.
const MARKER: &str = ".tracel-llvm-installed";

/// The CUDA version whose driver API kiln's CUDA build binds (cudarc): 13.0,
/// which drivers from 580 on provide. `CUDARC_CUDA_VERSION` picks another
/// (e.g. `12080` for a CUDA 12.8 driver).
const DEFAULT_CUDA_VERSION: &str = "13000";

/// Where the LLVM goes: `KILN_CUDA_LLVM_HOME`, else
/// `$XDG_CACHE_HOME/kiln/cuda-llvm`, else `~/.cache/kiln/cuda-llvm`. This
/// directory is what CUDA builds get as `XDG_DATA_HOME`.
pub(crate) fn llvm_home() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("KILN_CUDA_LLVM_HOME") {
        return Ok(PathBuf::from(dir));
    }
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => std::env::var_os("HOME")
            .map(|h| Path::new(&h).join(".cache"))
            .ok_or("neither KILN_CUDA_LLVM_HOME, XDG_CACHE_HOME nor HOME is set")?,
    };
    Ok(cache.join("kiln").join("cuda-llvm"))
}

/// Installs the static LLVM under `home` unless its marker is there, and
/// returns the LLVM's directory. Needs `python3` with pip and PyPI.
pub(crate) fn ensure_llvm(home: &Path) -> Result<PathBuf, String> {
    let dir = home.join(BUNDLER_DIR);
    if dir.join(MARKER).is_file() {
        return Ok(dir);
    }
    eprintln!(
        "xtask: installing the static LLVM for CUDA ({}) into {}",
        LLVM_WHEELS.join(", "),
        dir.display()
    );
    let scratch = home.join("download");
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&scratch)
        .map_err(|e| format!("failed to create {}: {e}", scratch.display()))?;
    let mut pip = Command::new("python3");
    pip.args(["-m", "pip", "download", "--quiet", "--no-deps"])
        .args(["--only-binary=:all:", "--dest"])
        .arg(&scratch)
        .args(LLVM_WHEELS);
    check(
        pip,
        "downloading the LLVM wheels from PyPI (python3 -m pip)",
    )?;
    let unpacked = scratch.join("unpacked");
    for wheel in wheels(&scratch)? {
        let mut unzip = Command::new("python3");
        unzip
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked);
        check(unzip, &format!("unpacking {}", wheel.display()))?;
    }
    let sdk = unpacked.join("mlc_llvm_static").join("static");
    if !sdk.join("bin").join("llvm-config").is_file() {
        return Err(format!(
            "the wheels hold no {}: has mlc-llvm-static changed its layout?",
            sdk.join("bin/llvm-config").display()
        ));
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("failed to create {}: {e}", parent.display()))?;
    }
    std::fs::rename(&sdk, &dir)
        .map_err(|e| format!("failed to move {} to {}: {e}", sdk.display(), dir.display()))?;
    let llvm_config = dir.join("bin").join("llvm-config");
    make_executable(&llvm_config)?;
    let out = Command::new(&llvm_config)
        .args(["--version", "--targets-built"])
        .output()
        .map_err(|e| format!("failed to run {}: {e}", llvm_config.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("NVPTX") {
        return Err(format!(
            "{} does not report the NVPTX target: {text}{}",
            llvm_config.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::write(
        dir.join(MARKER),
        "installed by cargo xtask (kiln) from PyPI\n",
    )
    .map_err(|e| format!("failed to write the marker in {}: {e}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&scratch);
    eprintln!(
        "xtask: LLVM {} installed (NVPTX)",
        text.lines().next().unwrap_or("?")
    );
    Ok(dir)
}

/// Sets what a cargo command building the `cuda` or `cubecl-cpu` feature needs: the LLVM
/// (installed first if missing) as `XDG_DATA_HOME`, and the CUDA version.
pub(crate) fn prepare_build(cmd: &mut Command) -> Result<(), String> {
    let home = llvm_home()?;
    ensure_llvm(&home)?;
    cmd.env("XDG_DATA_HOME", &home);
    if std::env::var_os("CUDARC_CUDA_VERSION").is_none() {
        cmd.env("CUDARC_CUDA_VERSION", DEFAULT_CUDA_VERSION);
    }
    Ok(())
}

/// Whether a comma-separated feature list asks for a backend that links
/// CubeCL's LLVM: CUDA, or Burn's CubeCL CPU backend (`cubecl-cpu`). Not
/// `rocm`: its AMDGPU target links LLD too, which PyPI's LLVM lacks, so its
/// build leaves CubeCL's bundler to download its own LLVM (from GitHub).
pub(crate) fn wants_llvm(features: &str) -> bool {
    features.split(',').map(str::trim).any(|f| {
        let f = f.rsplit('/').next().unwrap_or(f);
        f == "cuda" || f == "cuda-cpp" || f == "cubecl-cpu"
    })
}

/// The `.whl` files in `dir`.
fn wheels(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("failed to read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    // The base wheel first: the extra targets' files go on top of it.
    found.sort_by_key(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().contains("extra_targets"))
    });
    if found.len() != LLVM_WHEELS.len() {
        return Err(format!(
            "expected {} wheels in {}, found {}",
            LLVM_WHEELS.len(),
            dir.display(),
            found.len()
        ));
    }
    Ok(found)
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("failed to make {} executable: {e}", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<(), String> {
    Ok(())
}

/// Runs `cmd`; an error names `what` when it fails.
fn check(mut cmd: Command, what: &str) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("{what}: failed to start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what}: {cmd:?} exited with {status}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llvm_backends_are_found_in_feature_lists() {
        assert!(wants_llvm("cuda"));
        assert!(wants_llvm("cubecl-cpu"));
        assert!(wants_llvm("wgpu, kiln-cli/cubecl-cpu"));
        assert!(!wants_llvm("cpu"));
        assert!(wants_llvm("cuda,fusion"));
        assert!(wants_llvm("cuda-cpp"));
        assert!(wants_llvm("fusion, kiln-cli/cuda"));
        assert!(!wants_llvm("wgpu,fusion"));
        assert!(!wants_llvm("cudnn"));
        // ROCm links LLD as well, which only CubeCL's own LLVM bundle has.
        assert!(!wants_llvm("rocm,wgpu"));
    }

    #[test]
    fn an_installed_llvm_is_not_downloaded_again() {
        let home = std::env::temp_dir().join(format!("kiln-xtask-llvm-{}", std::process::id()));
        let dir = home.join(BUNDLER_DIR);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(MARKER), "").expect("marker");
        // With the marker present nothing runs (no python3, no network).
        assert_eq!(ensure_llvm(&home).expect("installed"), dir);
        let _ = std::fs::remove_dir_all(&home);
    }
}
