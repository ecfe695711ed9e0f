//! CUDA math library support.

use crate::shared::{
    bitcode::{link_bitcode, read_library},
    math_library::{FloatWidth, MathLibrary},
};
use llvm_sys::prelude::LLVMModuleRef;
use std::path::{Path, PathBuf};

/// Math intrinsics provided by libdevice.
const NO_LIBCALL: [&str; 19] = [
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "exp", "exp2",
    "exp10", "log", "log2", "log10", "pow", "cbrt", "erf",
];

pub struct Libdevice;

impl MathLibrary for Libdevice {
    fn needs_redirect(&self, base: &str, _width: FloatWidth) -> bool {
        NO_LIBCALL.contains(&base)
    }

    /// Libdevice supports f32 and f64; f16 and bf16 calls use f32.
    fn symbol(&self, base: &str, width: FloatWidth) -> Option<(String, FloatWidth)> {
        match width {
            // (kiln) `__nv_fast_expf`: one `ex2.approx` after a product by
            // log2(e), where `__nv_expf` reduces the range first (about ten
            // instructions). Asked for by `KILN_FAST_EXP=1`; see KILN-PATCH.md.
            FloatWidth::F16 | FloatWidth::BF16 | FloatWidth::F32 if base == "exp" && fast_exp() => {
                Some(("__nv_fast_expf".to_string(), FloatWidth::F32))
            }
            FloatWidth::F16 | FloatWidth::BF16 | FloatWidth::F32 => {
                Some((format!("__nv_{base}f"), FloatWidth::F32))
            }
            FloatWidth::F64 => Some((format!("__nv_{base}"), FloatWidth::F64)),
        }
    }
}

/// (kiln) Whether `exp` on f32, f16 and bf16 is libdevice's fast
/// `__nv_fast_expf` (`ex2.approx` of `x · log2(e)`, the exponential Triton's
/// `tl.exp` and FlashAttention's kernels compute) rather than the accurate
/// `__nv_expf`: `KILN_FAST_EXP=1` in the environment, read once a process.
/// f64 keeps `__nv_exp`.
pub fn fast_exp() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| std::env::var("KILN_FAST_EXP").is_ok_and(|value| value.trim() == "1"))
}

/// Bitcode path within the CUDA toolkit.
fn libdevice_path() -> Option<PathBuf> {
    let root = cuda_root()?;
    let path = root.join("nvvm").join("libdevice").join("libdevice.10.bc");
    path.is_file().then_some(path)
}

/// Fallback CUDA toolkit locations.
const CUDA_ROOTS: [&str; 4] = ["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr"];

fn cuda_root() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("CUDA_PATH") {
        return Some(PathBuf::from(path));
    }
    CUDA_ROOTS
        .into_iter()
        .map(Path::new)
        .find(|candidate| candidate.join("nvvm").join("libdevice").is_dir())
        .map(Path::to_path_buf)
}

/// # Safety
/// `module` must be a live LLVM module.
pub unsafe fn link_libdevice(module: LLVMModuleRef) -> Result<(), String> {
    let path = libdevice_path().ok_or_else(|| {
        "libdevice.10.bc was not found: the kernel calls a math function NVPTX has no \
         instruction for, and the CUDA toolkit is where the implementation lives. Set CUDA_PATH \
         to a toolkit containing nvvm/libdevice/libdevice.10.bc."
            .to_string()
    })?;
    let bitcode = read_library(&path)?;
    // SAFETY: the caller keeps `module` live.
    unsafe { link_bitcode(module, bitcode) }
        .map_err(|message| format!("{}: {message}", path.display()))
}
