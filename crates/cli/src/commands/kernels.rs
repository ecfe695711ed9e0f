//! `kiln check-kernels [--only KERNEL,…] [KEY=VALUE…]`: kiln's fused kernels against the
//! composition of Burn operations each replaces, on the configured device
//! (`device.backend=…`). Exit 1 when a kernel disagrees; one that does not
//! run on the device (the composition runs there) is said so. Text for
//! people, `--json` for scripts (CI on llvmpipe, the GPU check on CUDA).
//! With `--cuda-arch SM` (a CUDA build), no device: kiln's CUDA kernels
//! compiled for that compute capability by both of CubeCL's CUDA
//! compilers, and what their PTX does counted; where NVIDIA's assembler
//! (`ptxas`) is at hand, each kernel's registers, spills and the cubes a
//! multiprocessor holds.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kiln_train::kiln_model::kernels::{
    KernelCheck, OfflineKernel, Registers, check_adamw, check_attention, check_bias,
    check_embedding, check_gelu, check_layer_norm, check_lm_head_loss, check_matmul,
    check_sum_of_squares, find_ptxas, occupancy, ptx_target,
};

use super::{BadInput, Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    /// Only these kernels' checks (comma-separated or repeated): adamw,
    /// sum-of-squares, gelu, layer-norm, bias, embedding, attention,
    /// lm-head, matmul
    #[arg(long, value_delimiter = ',', value_name = "KERNEL")]
    only: Vec<String>,
    /// Instead of checking kernels on a device: compile kiln's CUDA
    /// kernels (FlashAttention-2's, as GPT-2 small runs them) for this
    /// compute capability (90: H100/H200, 89: RTX 4090, 80: A100, 75: T4)
    /// without a GPU, with both of CubeCL's CUDA compilers, and count what
    /// their PTX does (instructions, barriers, tensor-core products,
    /// exponentials, local memory). A CUDA build only
    #[arg(long, value_name = "SM", conflicts_with = "only")]
    cuda_arch: Option<u32>,
    /// With --cuda-arch: write each kernel's PTX (`.ptx`) and CUDA C++
    /// (`.cu`) into this folder
    #[arg(long, value_name = "DIR", requires = "cuda_arch")]
    emit: Option<std::path::PathBuf>,
    /// With --cuda-arch: NVIDIA's assembler, to count each kernel's
    /// registers and spills (`ptxas -v`) and the cubes a multiprocessor
    /// holds. Default: the CUDA toolkit's (`$CUDA_PATH/bin/ptxas`, else
    /// /usr/local/cuda's or /opt/cuda's) or `ptxas` on PATH, where one is;
    /// without one the PTX is counted only
    #[arg(long, value_name = "PATH", requires = "cuda_arch")]
    ptxas: Option<std::path::PathBuf>,
    #[command(flatten)]
    layers: Layers,
}

/// Each check's name for `--only`, and the check.
type Check = fn(&kiln_train::kiln_model::burn::tensor::Device) -> Vec<KernelCheck>;
const CHECKS: [(&str, Check); 9] = [
    ("adamw", |d| vec![check_adamw(d)]),
    ("sum-of-squares", |d| vec![check_sum_of_squares(d)]),
    ("gelu", |d| vec![check_gelu(d)]),
    ("layer-norm", |d| vec![check_layer_norm(d)]),
    ("bias", check_bias),
    ("embedding", check_embedding),
    ("attention", check_attention),
    ("lm-head", |d| vec![check_lm_head_loss(d)]),
    ("matmul", check_matmul),
];

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    if let Some(arch) = args.cuda_arch {
        return compile_offline(arch, args.emit.as_deref(), args.ptxas, args.json);
    }
    let names: Vec<&str> = CHECKS.iter().map(|(name, _)| *name).collect();
    if let Some(unknown) = args.only.iter().find(|o| !names.contains(&o.as_str())) {
        return Err(BadInput(format!(
            "unknown kernel `{unknown}` in --only: expected one of {}",
            names.join(", ")
        ))
        .into());
    }
    let resolved = ctx.resolve(&args.layers)?;
    // As a run opens it: CubeCL's settings applied, wgpu's kernel language
    // in the device's name.
    let choice =
        kiln_train::open_device(&resolved.config, ctx.report.gpu_vendor()).map_err(train_error)?;
    let checks: Vec<KernelCheck> = CHECKS
        .iter()
        .filter(|(name, _)| args.only.is_empty() || args.only.iter().any(|o| o == name))
        .flat_map(|(_, check)| check(&choice.device))
        .collect();
    let passed = checks.iter().all(KernelCheck::passed);
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = serde_json::json!({
            "schema": "kiln.check-kernels/1",
            "device": choice.name,
            "passed": passed,
            "kernels": checks.iter().map(|c| {
                let mut v = serde_json::to_value(c).unwrap_or_default();
                v["passed"] = c.passed().into();
                v
            }).collect::<Vec<_>>(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        writeln!(out, "kernels on {} ({})", choice.name, choice.why)?;
        for c in &checks {
            let verdict = match (c.fused, c.passed()) {
                (false, _) => "not fused on this device (the composition runs)",
                (true, true) => "ok",
                (true, false) => "DISAGREES",
            };
            writeln!(
                out,
                "  {:<28} max |fused − composition| {:.2e} (tolerance {:.0e}): {verdict}",
                c.kernel, c.max_abs_difference, c.tolerance
            )?;
        }
    }
    Ok(exit(passed))
}

/// `--cuda-arch`: kiln's CUDA kernels compiled for compute capability
/// `arch` without a device, and assembled by `ptxas` where one is; exit 1
/// where one does not compile or assemble.
fn compile_offline(
    arch: u32,
    emit: Option<&Path>,
    ptxas: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use kiln_train::kiln_model::kernels::{PtxCounts, compile_cuda_kernels};
    if !(50..=130).contains(&arch) {
        return Err(BadInput(format!(
            "--cuda-arch {arch}: expected a compute capability as CUDA writes it without \
             the dot, from 50 to 130 (90 for an H100 or H200, 80 for an A100)"
        ))
        .into());
    }
    let ptxas = match ptxas {
        Some(path) if !path.is_file() => {
            return Err(BadInput(format!("--ptxas {}: no such file", path.display())).into());
        }
        Some(path) => Some(path),
        None => find_ptxas(),
    };
    let Some(kernels) = compile_cuda_kernels(arch) else {
        return Err(BadInput(
            "--cuda-arch needs a CUDA build of kiln (`cargo xtask build-cuda`, \
             docs/HARDWARE.md): this one has no CUDA compiler"
                .to_string(),
        )
        .into());
    };
    if let Some(dir) = emit {
        std::fs::create_dir_all(dir)
            .map_err(|e| BadInput(format!("--emit {}: {e}", dir.display())))?;
        for (i, kernel) in kernels.iter().enumerate() {
            if let Ok(text) = &kernel.assembly {
                let ext = if kernel.compiler == "llvm" {
                    "ptx"
                } else {
                    "cu"
                };
                let path = dir.join(format!("{:02}-{}.{ext}", i / 2, slug(&kernel.name)));
                std::fs::write(&path, text)
                    .map_err(|e| BadInput(format!("--emit: writing {}: {e}", path.display())))?;
            }
        }
    }
    // ptxas' verdict on each PTX, where there is a ptxas.
    let assembled: Vec<Option<Result<Registers, String>>> = kernels
        .iter()
        .map(|k| match (&k.assembly, k.compiler, &ptxas) {
            (Ok(ptx), "llvm", Some(ptxas)) => Some(assemble(ptxas, ptx)),
            _ => None,
        })
        .collect();
    let passed =
        kernels.iter().all(|k| k.assembly.is_ok()) && assembled.iter().flatten().all(Result::is_ok);
    let mut out = std::io::stdout().lock();
    if json {
        let value = serde_json::json!({
            "schema": "kiln.check-kernels.cuda/2",
            "arch": arch,
            "ptxas": ptxas.as_ref().map(|p| p.display().to_string()),
            "passed": passed,
            "kernels": kernels.iter().zip(&assembled).map(|(k, assembled)| {
                let mut v = serde_json::json!({
                    "kernel": k.name,
                    "compiler": k.compiler,
                    "units": k.units,
                    "shared_bytes": k.shared_bytes,
                });
                match &k.assembly {
                    Ok(text) if k.compiler == "llvm" => {
                        v["ptx"] = serde_json::to_value(PtxCounts::of(text)).unwrap_or_default();
                    }
                    Ok(text) => v["lines"] = text.lines().count().into(),
                    Err(e) => v["error"] = e.clone().into(),
                }
                match assembled {
                    Some(Ok(r)) => {
                        v["ptxas"] = serde_json::to_value(r).unwrap_or_default();
                        v["occupancy"] = serde_json::to_value(
                            occupancy(arch, k.units, r.registers, k.shared_bytes),
                        )
                        .unwrap_or_default();
                    }
                    Some(Err(e)) => v["ptxas_error"] = e.clone().into(),
                    None => {}
                }
                v["passed"] = (k.assembly.is_ok() && !matches!(assembled, Some(Err(_)))).into();
                v
            }).collect::<Vec<_>>(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        return Ok(exit(passed));
    }
    writeln!(
        out,
        "kiln's CUDA kernels compiled for sm_{arch} (no device); {}",
        match &ptxas {
            Some(path) => format!("assembled by {}", path.display()),
            None => "no ptxas, so no register counts (--ptxas PATH, or CUDA_PATH)".to_string(),
        }
    )?;
    for (k, assembled) in kernels.iter().zip(&assembled) {
        match (&k.assembly, k.compiler) {
            (Ok(ptx), "llvm") => {
                let c = PtxCounts::of(ptx);
                writeln!(
                    out,
                    "  {} (LLVM, PTX): ok, {} lines, {} instructions, {} cube barriers, \
                     {} warp barriers, {} tensor-core products, {} exponentials, \
                     {} local-memory accesses, {} global loads; \
                     {} units and {:.1} KiB shared a cube",
                    k.name,
                    c.lines,
                    c.instructions,
                    c.cube_barriers,
                    c.warp_barriers,
                    c.tensor_core_products,
                    c.exponentials,
                    c.local_memory,
                    c.global_loads,
                    k.units,
                    k.shared_bytes as f64 / 1024.0,
                )?;
                match assembled {
                    Some(Ok(r)) => writeln!(out, "    ptxas: {}", describe(arch, k, r))?,
                    Some(Err(e)) => writeln!(out, "    ptxas: DOES NOT ASSEMBLE: {e}")?,
                    None => {}
                }
            }
            (Ok(source), _) => writeln!(
                out,
                "  {} (CUDA C++ for NVRTC): ok, {} lines",
                k.name,
                source.lines().count()
            )?,
            (Err(e), compiler) => {
                writeln!(out, "  {} ({compiler}): DOES NOT COMPILE: {e}", k.name)?
            }
        }
    }
    Ok(exit(passed))
}

fn exit(passed: bool) -> ExitCode {
    if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// ptxas' figures for one kernel in words: registers, spills, and the
/// cubes a multiprocessor holds.
fn describe(arch: u32, k: &OfflineKernel, r: &Registers) -> String {
    let spills = if r.spills() {
        format!(
            "SPILLS {} bytes a unit to local memory (loads {} bytes)",
            r.spill_stores, r.spill_loads
        )
    } else {
        "no spills".to_string()
    };
    let held = match occupancy(arch, k.units, r.registers, k.shared_bytes) {
        Some(o) if o.cubes == 0 => format!("does not fit a multiprocessor ({})", o.limited_by),
        Some(o) => format!(
            "{} cubes a multiprocessor ({} of {} warps; bound by {})",
            o.cubes, o.warps, o.max_warps, o.limited_by
        ),
        None => format!("occupancy of sm_{arch} not known to kiln"),
    };
    format!("{} registers, {spills}, {held}", r.registers)
}

/// `ptxas -v` on `ptx`, for the architecture its `.target` names.
fn assemble(ptxas: &Path, ptx: &str) -> Result<Registers, String> {
    let target = ptx_target(ptx).ok_or("the PTX names no .target")?;
    let dir = tempfile::tempdir().map_err(|e| format!("a temporary folder: {e}"))?;
    let input = dir.path().join("kernel.ptx");
    std::fs::write(&input, ptx).map_err(|e| format!("writing {}: {e}", input.display()))?;
    let output = std::process::Command::new(ptxas)
        .arg(format!("-arch={target}"))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(dir.path().join("kernel.cubin"))
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
    let report = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(report.trim().to_string());
    }
    Registers::parse(&report).ok_or_else(|| format!("no register count in: {}", report.trim()))
}

/// A kernel's name as a file name: letters, digits and dashes.
fn slug(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    slug.trim_matches('-').to_string()
}
