//! `cargo xtask <target>`: make-style shortcuts. Every target runs the `kiln`
//! binary (built with `--release`) or cargo itself; xtask links no ML crate.

#![allow(clippy::print_stdout, reason = "xtask prints its help")]
#![allow(clippy::print_stderr, reason = "xtask prints what it runs")]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// GPU targets: `train-<suffix>` and `nli-train-<suffix>` run this preset.
const GPU_TARGETS: &[(&str, &str)] = &[
    ("4090", "gpu_4090"),
    ("3090", "gpu_3090"),
    ("4080", "gpu_4080"),
    ("a100", "a100"),
    ("a100-80gb", "a100_80gb"),
    ("a30", "a30"),
    ("a40", "a40"),
    ("v100", "v100"),
    ("t4", "t4"),
    ("h100", "h100"),
    ("low-mem", "low_mem"),
    ("cpu", "cpu"),
];

const HELP: &str = "\
cargo xtask <target> [args...]

  check-hardware [--json]   what this machine is and can do, and its preset
  check-gpu                 is there an NVIDIA GPU? (exit 1 if not)
  train-auto [KEY=VALUE..]  detect the hardware, pick its preset, train the LM
  train-<gpu> [--force]     train the LM with a GPU preset: 4090 3090 4080 a100
                            a100-80gb a30 a40 v100 t4 h100 low-mem cpu
  nli-train-auto            the NLI encoder with k-fold CV, preset from hardware
  nli-train-<gpu> [--force] the same with a GPU preset
  bench                     the standard benchmarks → bench/results.json
  bench-tune                `kiln tune` judged against the exhaustive sweep, for
                            both experiments → bench/tune-results.json
  ci                        what .ci/run checks: fmt, clippy (also wgpu, cuda),
                            the tests, the GPU suite on Vulkan

Extra arguments go to `kiln` (overrides like training.batch_size=8).
A GPU preset on a machine without that GPU exits 2 unless --force.
GPU targets build kiln with --features wgpu (the auto targets where an
NVIDIA GPU is present); KILN_FEATURES=cuda,fusion picks other features.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((target, rest)) = args.split_first() else {
        println!("{HELP}");
        return ExitCode::SUCCESS;
    };
    let rest = rest.to_vec();
    let result = match target.as_str() {
        "help" | "--help" | "-h" => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        "check-hardware" => kiln(&["check-hardware"], rest, Build::Auto),
        "check-gpu" => kiln(&["check-gpu"], rest, Build::Auto),
        "train-auto" => kiln(&["train", "hardware=auto"], rest, Build::Auto),
        "nli-train-auto" => kiln(
            &["cv", "hardware=auto", "experiment=nli_snli"],
            rest,
            Build::Auto,
        ),
        "ci" => ci(),
        "bench" => bench(rest),
        "bench-tune" => bench_tune(rest),
        other => match train_target(other) {
            Some((preset, nli)) => {
                let hw = format!("hardware={preset}");
                let base = if nli {
                    vec!["cv", hw.as_str(), "experiment=nli_snli"]
                } else {
                    vec!["train", hw.as_str()]
                };
                let build = if preset == "cpu" {
                    Build::Cpu
                } else {
                    Build::Gpu
                };
                kiln(&base, rest, build)
            }
            None => {
                eprintln!("unknown target `{other}`\n\n{HELP}");
                return ExitCode::from(2);
            }
        },
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `train-4090` → (`gpu_4090`, false); `nli-train-t4` → (`t4`, true).
fn train_target(target: &str) -> Option<(&'static str, bool)> {
    let (suffix, nli) = match target.strip_prefix("nli-train-") {
        Some(s) => (s, true),
        None => (target.strip_prefix("train-")?, false),
    };
    GPU_TARGETS
        .iter()
        .find(|(s, _)| *s == suffix)
        .map(|(_, preset)| (*preset, nli))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Which backend features a target builds `kiln` with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Build {
    /// The default build: the CPU backend (flex).
    Cpu,
    /// A GPU preset: the `wgpu` backend too.
    Gpu,
    /// `wgpu` where this machine has an NVIDIA GPU, else the default build.
    Auto,
}

/// Whether an NVIDIA driver reports a GPU (no ML crate linked: the driver's
/// proc files, else `nvidia-smi -L`).
fn nvidia_gpu_present() -> bool {
    let proc_gpus = std::fs::read_dir("/proc/driver/nvidia/gpus")
        .is_ok_and(|mut entries| entries.next().is_some());
    proc_gpus
        || Command::new("nvidia-smi")
            .arg("-L")
            .output()
            .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

/// The Cargo features `kiln` is built with: `KILN_FEATURES` when set (e.g.
/// `cuda,fusion` on a machine that can build CUDA), else `wgpu` for GPU
/// presets and, for the auto targets, where an NVIDIA GPU is present.
fn features(build: Build) -> Option<String> {
    features_for(
        build,
        std::env::var("KILN_FEATURES").ok(),
        nvidia_gpu_present,
    )
}

fn features_for(
    build: Build,
    chosen: Option<String>,
    gpu_present: impl Fn() -> bool,
) -> Option<String> {
    if let Some(f) = chosen {
        return (!f.trim().is_empty()).then_some(f);
    }
    let gpu = match build {
        Build::Cpu => false,
        Build::Gpu => true,
        Build::Auto => gpu_present(),
    };
    gpu.then(|| "wgpu".to_string())
}

/// `cargo run` of the `kiln` binary in release mode, from the repository
/// root, with the backend features `build` needs.
fn kiln_command(build: Build) -> Command {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--quiet",
        "--release",
        "--package",
        "kiln-cli",
        "--bin",
        "kiln",
    ]);
    if let Some(f) = features(build) {
        eprintln!("xtask: building kiln with --features {f}");
        cmd.args(["--features", &f]);
    }
    cmd.arg("--");
    cmd
}

/// Runs `kiln <base> <rest>`.
fn kiln(base: &[&str], rest: Vec<String>, build: Build) -> Result<ExitCode, String> {
    let mut cmd = kiln_command(build);
    cmd.args(base).args(rest);
    run(cmd)
}

/// The standard benchmark set: the default runs of both workloads, the
/// PyTorch comparison shapes of ../shared/PEERS.md (GPT block 128 × batch 32;
/// encoder batch 32 padded to 128), and the LM's loader alone.
const BENCHES: &[(&str, &[&str])] = &[
    ("lm-default", &["lm"]),
    (
        "lm-peers-shape",
        &["lm", "model.max_length=128", "training.batch_size=32"],
    ),
    ("nli-default", &["nli"]),
    (
        "nli-peers-shape",
        &[
            "nli",
            "--pad-to-max-length",
            "--warmup=2",
            "--steps=8",
            "training.batch_size=32",
        ],
    ),
    ("loader-lm", &["loader"]),
];

/// Runs `kiln <args> --json` for each entry and writes the outputs, named,
/// as one JSON array to `bench/<file>`.
fn collect(
    file: &str,
    entries: &[(String, Vec<String>)],
    rest: &[String],
) -> Result<ExitCode, String> {
    let mut results = Vec::new();
    for (name, args) in entries {
        eprintln!("xtask: {name}: kiln {}", args.join(" "));
        let mut cmd = kiln_command(Build::Auto);
        cmd.args(args).arg("--json").args(rest);
        let out = cmd
            .output()
            .map_err(|e| format!("failed to run {cmd:?}: {e}"))?;
        if !out.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&out.stderr));
            return Ok(ExitCode::FAILURE);
        }
        let json = String::from_utf8_lossy(&out.stdout);
        results.push(format!(
            "{{\"name\": \"{name}\", \"result\": {}}}",
            json.trim()
        ));
    }
    let dir = root().join("bench");
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("failed to create {}: {e}", dir.display()))?;
    let path = dir.join(file);
    std::fs::write(&path, format!("[\n{}\n]\n", results.join(",\n")))
        .map_err(|e| format!("failed to write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(ExitCode::SUCCESS)
}

fn bench(rest: Vec<String>) -> Result<ExitCode, String> {
    let entries: Vec<(String, Vec<String>)> = BENCHES
        .iter()
        .map(|(name, args)| {
            let mut a = vec!["bench".to_string()];
            a.extend(args.iter().map(|s| s.to_string()));
            (name.to_string(), a)
        })
        .collect();
    collect("results.json", &entries, &rest)
}

/// `kiln tune --compare-sweep` for both experiments: the tuner's time as a
/// share of the sweep's, and its choice against the sweep's head to head.
fn bench_tune(rest: Vec<String>) -> Result<ExitCode, String> {
    let entries: Vec<(String, Vec<String>)> = ["shakespeare_char", "nli_snli"]
        .iter()
        .map(|e| {
            (
                format!("tune-{e}"),
                vec![
                    "tune".to_string(),
                    "--compare-sweep".into(),
                    format!("experiment={e}"),
                ],
            )
        })
        .collect();
    collect("tune-results.json", &entries, &rest)
}

/// The steps of `.ci/run` (without its system packages): formatting, lints
/// (also with the wgpu backend and its tests, and type-checking CUDA), the
/// tests, and the GPU suite on whatever Vulkan device there is.
fn ci() -> Result<ExitCode, String> {
    let clippy = ["clippy", "--workspace", "--all-targets"];
    let deny = ["--", "-D", "warnings"];
    let steps: Vec<(Vec<&str>, bool)> = vec![
        (vec!["fmt", "--all", "--check"], false),
        ([&clippy[..], &deny[..]].concat(), false),
        (
            [
                &clippy[..],
                &["--features", "kiln-cli/wgpu,kiln-tests/wgpu"][..],
                &deny[..],
            ]
            .concat(),
            false,
        ),
        (vec!["test", "--workspace"], false),
        (
            vec!["test", "-p", "kiln-tests", "--features", "wgpu", "gpu::"],
            false,
        ),
        (
            [&clippy[..], &["--features", "kiln-cli/cuda"][..], &deny[..]].concat(),
            true,
        ),
    ];
    for (step, docs_rs) in steps {
        eprintln!(
            "$ {}cargo {}",
            if docs_rs { "DOCS_RS=1 " } else { "" },
            step.join(" ")
        );
        let mut cmd = cargo();
        cmd.args(&step);
        if docs_rs {
            // Skips cubecl-cuda's LLVM download: a type-check of the CUDA path.
            cmd.env("DOCS_RS", "1");
        }
        let code = run(cmd)?;
        if code != ExitCode::SUCCESS {
            return Ok(code);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run(mut cmd: Command) -> Result<ExitCode, String> {
    let status = cmd
        .status()
        .map_err(|e| format!("failed to run {cmd:?}: {e}"))?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gpu_target_names_a_preset_file() {
        for (suffix, preset) in GPU_TARGETS {
            let path = root()
                .join("presets/hardware")
                .join(format!("{preset}.toml"));
            assert!(path.is_file(), "train-{suffix}: {} missing", path.display());
        }
    }

    #[test]
    fn targets_parse() {
        assert_eq!(train_target("train-4090"), Some(("gpu_4090", false)));
        assert_eq!(train_target("nli-train-low-mem"), Some(("low_mem", true)));
        assert_eq!(train_target("train-9090"), None);
        assert_eq!(train_target("check-hardware"), None);
    }
}
