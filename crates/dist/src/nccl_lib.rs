//! Finding NCCL's library: cudarc opens `libnccl.so` (and names with CUDA's
//! version), but NCCL installs `libnccl.so.2` — the bare name comes only
//! with the development package (`libnccl-dev`), and PyPI's
//! `nvidia-nccl-cu12` ships `libnccl.so.2` alone. Where only `.so.2` is
//! found, `kiln launch` links it as `libnccl.so` in a folder of its own and
//! puts that folder on the ranks' `LD_LIBRARY_PATH`.

use std::path::{Path, PathBuf};

/// NCCL's real file name.
pub const NCCL_SONAME: &str = "libnccl.so.2";

/// Whether the dynamic loader finds `libnccl.so` as this process's
/// environment stands (the name cudarc tries first).
pub fn loader_finds_libnccl() -> bool {
    // SAFETY: dlopen with a NUL-terminated literal; the handle is closed
    // at once. Loading NCCL runs no code of ours.
    unsafe {
        let handle = libc::dlopen(c"libnccl.so".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}

/// The folders NCCL is usually installed in: `LD_LIBRARY_PATH`, the
/// system's library folders, CUDA's, and the Python packages' (PyPI's
/// `nvidia-nccl-cu12`, a virtual environment's or the system's).
pub fn search_dirs(env: &[(String, String)]) -> Vec<PathBuf> {
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let mut dirs: Vec<PathBuf> = get("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
        "/opt/nccl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut pythons: Vec<PathBuf> = Vec::new();
    if let Some(venv) = get("VIRTUAL_ENV").or_else(|| get("CONDA_PREFIX")) {
        pythons.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = get("HOME") {
        pythons.push(PathBuf::from(home).join(".local/lib"));
    }
    pythons.push(PathBuf::from("/usr/local/lib"));
    pythons.push(PathBuf::from("/usr/lib"));
    for lib in pythons {
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut versions: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        versions.sort();
        for v in versions {
            for packages in ["site-packages", "dist-packages"] {
                dirs.push(v.join(packages).join("nvidia/nccl/lib"));
            }
        }
    }
    dirs
}

/// The first `libnccl.so.2` in `dirs`.
pub fn find_soname(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join(NCCL_SONAME))
        .find(|p| p.is_file())
}

/// Makes `dir/libnccl.so` point at `soname` (replacing an older link),
/// so that a process with `dir` on its `LD_LIBRARY_PATH` opens NCCL by
/// the name cudarc asks for.
pub fn link_as_libnccl(soname: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let link = dir.join("libnccl.so");
    let tmp = dir.join(format!(".libnccl.so.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(soname, &tmp)?;
    std::fs::rename(&tmp, &link)?;
    Ok(link)
}

/// What to tell a user whose NCCL cannot be opened: where a
/// `libnccl.so.2` was found and the link that fixes it, or how to install.
pub fn missing_advice(found: Option<&Path>) -> String {
    match found {
        Some(p) => format!(
            "NCCL is installed as `{}`, but cudarc opens `libnccl.so`: start the ranks with `kiln launch` (it links the name for them), or link it yourself: `ln -s {} <dir>/libnccl.so` with <dir> on LD_LIBRARY_PATH",
            p.display(),
            p.display()
        ),
        None => "no NCCL library found (libnccl.so, libnccl.so.2): install it (`apt install libnccl2 libnccl-dev`, or `pip install nvidia-nccl-cu12` and start the ranks with `kiln launch`), or set COLLECTIVES=sockets to reduce over the rendezvous's sockets instead".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pip_installed_nccl_is_found_and_linked_by_the_name_cudarc_opens() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let venv = tmp.path().join("venv");
        let lib = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).expect("dirs");
        std::fs::write(lib.join(NCCL_SONAME), b"not really a library").expect("write");
        let env = vec![("VIRTUAL_ENV".to_string(), venv.display().to_string())];
        let found = find_soname(&search_dirs(&env)).expect("found in the venv");
        assert_eq!(found, lib.join(NCCL_SONAME));
        let links = tmp.path().join("links");
        let link = link_as_libnccl(&found, &links).expect("links");
        assert_eq!(std::fs::read_link(&link).expect("a link"), found);
        // Linking again replaces it.
        link_as_libnccl(&found, &links).expect("relinks");
        assert!(missing_advice(Some(&found)).contains("ln -s"));
        assert!(missing_advice(None).contains("COLLECTIVES=sockets"));
        // LD_LIBRARY_PATH comes first.
        let env = vec![("LD_LIBRARY_PATH".to_string(), "/a:/b".to_string())];
        assert_eq!(
            search_dirs(&env)[..2],
            [PathBuf::from("/a"), PathBuf::from("/b")]
        );
    }
}
