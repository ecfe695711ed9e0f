//! `cargo xtask <target>`: make-style shortcuts. Every target runs the `kiln`
//! binary (built with `--release`) or cargo itself; xtask links no ML crate.

#![allow(clippy::print_stdout, reason = "xtask prints its help")]
#![allow(clippy::print_stderr, reason = "xtask prints what it runs")]

mod cuda;
mod outside;

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
    ("mi300x", "mi300x"),
    ("mi250", "mi250"),
    ("7900xtx", "rx_7900_xtx"),
    ("arc-a770", "arc_a770"),
    ("apple", "apple_m"),
    ("low-mem", "low_mem"),
    ("cpu", "cpu"),
];

const HELP: &str = "\
cargo xtask <target> [args...]

  check-hardware [--json]   what this machine is and can do, and its preset
  check-gpu                 is there an NVIDIA GPU? (exit 1 if not)
  train-auto [KEY=VALUE..]  detect the hardware, pick its preset, train the LM
                            (on every GPU of the machine's kind: kiln launch)
  train-<gpu> [--force]     train the LM with a GPU preset: 4090 3090 4080 a100
                            a100-80gb a30 a40 v100 t4 h100 mi300x mi250
                            7900xtx arc-a770 apple low-mem cpu
  nli-train-auto            the NLI encoder with k-fold CV, preset from hardware
  nli-train-<gpu> [--force] the same with a GPU preset
  build-cuda [--profile P] [--features F] [--no-autotune-cache]
                            build kiln with the CUDA backend (installs the
                            static LLVM it links from PyPI on first use);
                            CI's build leaves out the on-disk autotune cache
  gpu-pack [--features F]   build, strip and compress the CUDA kiln into
                            gpu-pack/kiln[-F].xz for bench/gpu_check.py on a
                            GPU machine without network; with the plain build
                            and another (F = fusion, cuda-cpp) there, also
                            gpu-pack/kilns.tar.xz holding them all
  bench [--avx2]            the standard benchmarks → bench/results.json; with
                            --avx2 on a build without AVX-512 kernels (what
                            AVX2 CPUs run) → bench/results-avx2.json
  compare [--avx2] [--python PY] [--rounds N] [--out F]
                            kiln against PyTorch eager at PEERS.md's shapes,
                            interleaved rounds (bench/cpu_compare.py; PY
                            imports torch); --avx2 adds the AVX2-only build
                            against PyTorch --avx2
  bench-tune                `kiln tune` judged against the exhaustive sweep, for
                            both experiments → bench/tune-results.json
  outside [DIR]             each library crate's README example built and run
                            from a scratch crate outside the workspace
  ci                        .ci/run: fmt, clippy, the tests, packaging, the CUDA
                            build (linted), the GPU suite on Vulkan

Extra arguments go to `kiln` (overrides like training.batch_size=8).
A GPU target first checks that its preset fits this machine (kiln-config's
check, no Burn: minutes to build the first time): where it does not, it
exits 2 before any GPU build, unless --force. Where an NVIDIA driver
reports a GPU, the GPU and auto targets build kiln with --features cuda;
where AMD's ROCm kernel driver is loaded (/dev/kfd), --features rocm,vulkan
(CubeCL's build downloads its LLVM with LLD from GitHub for rocm);
on Apple silicon, wgpu (Metal); GPU targets elsewhere use wgpu (Vulkan,
DX12; an Intel Arc: KILN_FEATURES=vulkan for the auto targets). KILN_FEATURES=wgpu,fusion
(any list) picks other features. Each feature set builds in its own folder: the CPU build in
target/release, the others in target/<features>/release (target/wgpu,
target/cuda, target/fusion+wgpu), so switching targets rebuilds nothing;
xtask says which binary it runs. check-hardware and check-gpu never build a
GPU kiln: without train-auto's build they print kiln-config's report.";

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
        "check-hardware" => describe("check-hardware", rest),
        "check-gpu" => describe("check-gpu", rest),
        // Through the launcher: one rank per GPU of the machine's kind
        // (`kiln check-hardware` says how many), or one process in place.
        "train-auto" => kiln(&["launch", "train", "hardware=auto"], rest, Build::Auto),
        "nli-train-auto" => kiln(
            &["cv", "hardware=auto", "experiment=nli_snli"],
            rest,
            Build::Auto,
        ),
        "ci" => ci(),
        "build-cuda" => build_cuda(&rest).map(|_| ExitCode::SUCCESS),
        "gpu-pack" => gpu_pack(&rest),
        "bench" => bench(rest),
        "compare" => compare(rest),
        "bench-tune" => bench_tune(rest),
        "outside" => outside::outside(&rest),
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
                // A GPU preset is checked against the machine before its
                // build (a quarter of an hour), not by the kiln it builds.
                let checked = if build == Build::Gpu {
                    check_preset(preset, &rest)
                } else {
                    Ok(None)
                };
                match checked {
                    Ok(None) => kiln(&base, rest, build),
                    Ok(Some(refused)) => return refused,
                    Err(e) => Err(e),
                }
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

/// The workspace root: the parent of xtask's manifest directory, as `cargo
/// run` (the `cargo xtask` alias) gives it to the process. The compile-time
/// path is only the fallback: with a target directory shared between
/// checkouts (`CARGO_TARGET_DIR`), cargo may run an xtask binary compiled
/// in another checkout, whose path would send every build there.
fn root() -> PathBuf {
    root_of(std::env::var_os("CARGO_MANIFEST_DIR"))
}

/// The workspace root from the manifest directory `cargo run` gave, or the
/// one xtask was compiled in when it gave none.
fn root_of(runtime_manifest_dir: Option<std::ffi::OsString>) -> PathBuf {
    let manifest = runtime_manifest_dir
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Cargo's target directory: `CARGO_TARGET_DIR`, else `target/`.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// Where the build without AVX-512 kernels goes (`<target>/avx2`, as
/// docs/PERFORMANCE.md builds it): a directory of its own, so that it and
/// the default build do not rebuild each other's crates.
fn avx2_target_dir() -> PathBuf {
    target_dir().join("avx2")
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
    /// A GPU preset: the machine's GPU's backend ([`GpuKind::features`]),
    /// else `wgpu`.
    Gpu,
    /// The machine's GPU's backend, else the default build.
    Auto,
    /// The CPU backend without the kernels' AVX-512 versions
    /// (`--no-default-features --features flex`): what an AVX2 CPU runs, on
    /// any x86-64 CPU (`KILN_FEATURES` does not apply).
    Avx2,
}

/// Whose GPU the machine has, as far as xtask tells without kiln (no
/// crate linked): what decides the backend features of the GPU and auto
/// targets. kiln-hwdetect reads more (`kiln check-hardware`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum GpuKind {
    /// An NVIDIA driver reports a GPU (its proc files, else `nvidia-smi -L`).
    Nvidia,
    /// AMD's ROCm kernel driver is loaded (`/dev/kfd`).
    Amd,
    /// Apple silicon (macOS on arm64).
    Apple,
    /// None of these.
    Other,
}

impl GpuKind {
    fn of_this_machine() -> Self {
        let proc_gpus = std::fs::read_dir("/proc/driver/nvidia/gpus")
            .is_ok_and(|mut entries| entries.next().is_some());
        if proc_gpus
            || Command::new("nvidia-smi")
                .arg("-L")
                .output()
                .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
        {
            Self::Nvidia
        } else if Path::new("/dev/kfd").exists() {
            Self::Amd
        } else if cfg!(all(target_os = "macos", target_arch = "aarch64")) {
            Self::Apple
        } else {
            Self::Other
        }
    }

    /// The backend features for this kind of GPU: `cuda`; `rocm,vulkan`
    /// (HIP, and Vulkan with SPIR-V kernels where HIP's libraries are
    /// missing); `wgpu` (Metal).
    fn features(self) -> Option<&'static str> {
        match self {
            Self::Nvidia => Some("cuda"),
            Self::Amd => Some("rocm,vulkan"),
            Self::Apple => Some("wgpu"),
            Self::Other => None,
        }
    }
}

/// The Cargo features `kiln` is built with: `KILN_FEATURES` when set (e.g.
/// `wgpu,fusion`), else the features of the machine's GPU for the GPU
/// presets and the auto targets, `wgpu` for GPU presets elsewhere.
fn features(build: Build) -> Option<String> {
    features_for(
        build,
        std::env::var("KILN_FEATURES").ok(),
        GpuKind::of_this_machine,
    )
}

fn features_for(build: Build, chosen: Option<String>, gpu: impl Fn() -> GpuKind) -> Option<String> {
    if let Some(f) = chosen.filter(|_| build != Build::Avx2) {
        return (!f.trim().is_empty()).then_some(f);
    }
    match build {
        Build::Cpu => None,
        Build::Gpu => Some(gpu().features().unwrap_or("wgpu").to_string()),
        Build::Auto => gpu().features().map(str::to_string),
        Build::Avx2 => Some("flex".to_string()),
    }
}

/// Where a build of `kiln` with `features` goes: the default (CPU) build
/// in the target directory itself (`target/release/kiln`), the build without
/// AVX-512 kernels in `<target>/avx2`, every other feature set in a folder
/// named for it (`<target>/wgpu`, `<target>/cuda`, `<target>/fusion+wgpu`).
/// Each keeps its own build: switching between `train-auto` and a GPU
/// target rebuilds neither.
fn build_dir(build: Build, features: Option<&str>) -> PathBuf {
    match (build, features) {
        (Build::Avx2, _) => avx2_target_dir(),
        (_, None) => target_dir(),
        (_, Some(f)) => target_dir().join(feature_dir_name(f)),
    }
}

/// A folder name for a feature list: its features sorted and joined by
/// `+` (`wgpu,fusion` → `fusion+wgpu`), a crate's `/` as `.`.
fn feature_dir_name(features: &str) -> String {
    let mut names: Vec<String> = features
        .split(',')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .map(|f| f.replace('/', "."))
        .collect();
    names.sort();
    names.dedup();
    names.join("+")
}

/// The file in a build folder that keeps how long its last real build took.
const BUILD_TIME_FILE: &str = "xtask-build-seconds";

/// How long the last build in `dir` that compiled something took, if one
/// was timed (builds that only checked that nothing changed are not kept).
fn last_build_time(dir: &Path) -> Option<u64> {
    std::fs::read_to_string(dir.join(BUILD_TIME_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// "14 min 54 s", "38 s".
fn minutes(seconds: u64) -> String {
    if seconds < 60 {
        format!("{seconds} s")
    } else {
        format!("{} min {} s", seconds / 60, seconds % 60)
    }
}

/// The release `kiln` for `build`, built first if needed (cargo rebuilds
/// only what changed), as a command to run from the repository root. Not
/// `--quiet`: the first build compiles Burn for many minutes, and cargo's
/// progress shows it.
fn kiln_command(build: Build) -> Result<Command, String> {
    let features = features(build);
    let dir = build_dir(build, features.as_deref());
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--release",
        "--package",
        "kiln-cli",
        "--bin",
        "kiln",
    ])
    .env("CARGO_TARGET_DIR", &dir);
    if build == Build::Avx2 {
        eprintln!("xtask: the build without kiln's AVX-512 kernels (AVX2 + FMA at most)");
        cmd.arg("--no-default-features");
    }
    if let Some(f) = &features {
        cmd.args(["--features", f]);
        if cuda::wants_llvm(f) {
            cuda::prepare_build(&mut cmd)?;
        }
    }
    let bin = dir.join("release").join("kiln");
    let features = features.map_or_else(
        || "default features".to_string(),
        |f| format!("--features {f}"),
    );
    let expect = match last_build_time(&dir) {
        Some(s) => format!("the last build here took {}", minutes(s)),
        None => "a first build compiles Burn: about 20 minutes on 2 cores".to_string(),
    };
    eprintln!(
        "xtask: cargo builds {} ({features}) if anything changed; {expect}",
        bin.display()
    );
    let start = std::time::Instant::now();
    if run(cmd)? != ExitCode::SUCCESS {
        return Err("building kiln failed (see cargo's output above)".into());
    }
    let took = start.elapsed().as_secs();
    // A build that compiled nothing takes a second or two: only a real one
    // is kept as what the next build may take.
    if took >= 30 {
        let _ = std::fs::write(dir.join(BUILD_TIME_FILE), format!("{took}\n"));
    }
    eprintln!("xtask: running {}", bin.display());
    let mut run = Command::new(bin);
    run.current_dir(root());
    Ok(run)
}

/// The value of `--hardware-report FILE` (or `--hardware-report=FILE`) in
/// the arguments for kiln, which the checks before a build read too.
fn hardware_report(rest: &[String]) -> Option<String> {
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        if a == "--hardware-report" {
            return it.next().cloned();
        }
        if let Some(v) = a.strip_prefix("--hardware-report=") {
            return Some(v.to_string());
        }
    }
    None
}

/// kiln-config's `machine` example (Burn-free: about 3 minutes to build
/// from nothing on 2 cores, seconds after) with `args`, and the
/// `--hardware-report` of `rest`.
fn machine_probe(args: &[&str], rest: &[String]) -> Command {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--quiet",
        "--locked",
        "--package",
        "kiln-config",
        "--example",
        "machine",
        "--",
    ])
    .args(args);
    if let Some(report) = hardware_report(rest) {
        cmd.args(["--hardware-report", &report]);
    }
    cmd
}

/// Before a GPU target's build: is `preset` written for this machine? Asks
/// kiln-config's check (the one `kiln train` makes) through [`machine_probe`].
/// Where it is not, `Some(exit 2)` with kiln's message, unless `rest` has
/// `--force`: then the build goes on, saying what it is and how long the
/// last one took.
fn check_preset(preset: &str, rest: &[String]) -> Result<Option<ExitCode>, String> {
    eprintln!(
        "xtask: does hardware preset `{preset}` fit this machine? (kiln-config's check; no GPU build yet)"
    );
    let mut probe = machine_probe(&["--fits", preset], rest);
    let out = probe
        .output()
        .map_err(|e| format!("failed to run {probe:?}: {e}"))?;
    if out.status.success() {
        return Ok(None);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(2) {
        return Err(format!(
            "checking hardware preset `{preset}` failed:\n{}",
            stderr.trim_end()
        ));
    }
    let msg = stderr.trim();
    if !rest.iter().any(|a| a == "--force") {
        eprintln!("{msg}; pass --force to run it on this machine anyway, or use hardware=auto");
        return Ok(Some(ExitCode::from(2)));
    }
    let features = features(Build::Gpu);
    let dir = build_dir(Build::Gpu, features.as_deref());
    let last = last_build_time(&dir).map_or_else(
        || "no earlier build timed here".to_string(),
        |s| format!("the last took {}", minutes(s)),
    );
    eprintln!(
        "xtask: {msg}; going on (--force): the {} build of kiln comes next, in {} ({last})",
        features.as_deref().unwrap_or("default"),
        dir.display()
    );
    Ok(None)
}

/// `check-hardware` and `check-gpu` never build a GPU `kiln` to describe the
/// machine: with the build `train-auto` uses there (kept current by cargo),
/// that `kiln`; without it, kiln-config's Burn-free report ([`machine_probe`]).
fn describe(command: &str, rest: Vec<String>) -> Result<ExitCode, String> {
    let features = features(Build::Auto);
    let dir = build_dir(Build::Auto, features.as_deref());
    if dir.join("release").join("kiln").is_file() {
        return kiln(&[command], rest, Build::Auto);
    }
    eprintln!(
        "xtask: no kiln is built in {} yet, so this is kiln-config's report (Burn-free: \
         a few minutes to build the first time, seconds after); `kiln {command}` adds the backends, the memory plan and the \
         ranks once `cargo xtask train-auto` has built kiln",
        dir.display()
    );
    let mut args = Vec::new();
    if command == "check-gpu" {
        args.push("--gpu");
    }
    if rest.iter().any(|a| a == "--json") {
        args.push("--json");
    }
    run(machine_probe(&args, &rest))
}

/// Runs `kiln <base> <rest>`.
fn kiln(base: &[&str], rest: Vec<String>, build: Build) -> Result<ExitCode, String> {
    let mut cmd = kiln_command(build)?;
    cmd.args(base).args(rest);
    run(cmd)
}

/// A CUDA build of `kiln`: the binary, and the features asked for besides
/// `cuda` (e.g. `fusion`).
#[derive(Debug)]
struct CudaBuild {
    bin: PathBuf,
    extra_features: Vec<String>,
}

/// `cargo xtask build-cuda [--profile P] [--features F]
/// [--no-autotune-cache]`: builds `kiln` with the CUDA backend (and `F`,
/// e.g. `fusion`), installing the static LLVM it links first. kiln-cli's
/// `cuda` and `wgpu` features bring CubeCL's on-disk autotune cache
/// (`autotune-cache`); `--no-autotune-cache` asks for the backends alone
/// (kiln-train's features of those names), as CI's GPU build does.
fn build_cuda(args: &[String]) -> Result<CudaBuild, String> {
    let mut profile = "release".to_string();
    let mut extra_features: Vec<String> = Vec::new();
    let mut autotune_cache = true;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--profile" => profile = value("--profile")?,
            "--features" => extra_features.extend(
                value("--features")?
                    .split(',')
                    .map(str::trim)
                    .filter(|f| !f.is_empty())
                    .map(String::from),
            ),
            "--no-autotune-cache" => autotune_cache = false,
            other => return Err(format!("build-cuda: unknown argument `{other}`")),
        }
    }
    let features = cuda_features(&extra_features, autotune_cache);
    // The folder is named for what the build has: `cuda` (where the GPU
    // targets' CUDA build goes too, so each reuses the other's), with the
    // extra features and `no-autotune-cache`.
    let mut named = vec!["cuda".to_string()];
    named.extend(extra_features.iter().cloned());
    if !autotune_cache {
        named.push("no-autotune-cache".into());
    }
    let dir = target_dir().join(feature_dir_name(&named.join(",")));
    let profile_dir = if profile == "dev" { "debug" } else { &profile };
    if let Some(plain) = seed_for(&dir, &target_dir().join("cuda"), profile_dir) {
        seed(plain, &dir)?;
    }
    let mut cmd = cargo();
    cmd.env("CARGO_TARGET_DIR", &dir);
    cmd.args([
        "build",
        "--locked",
        "--package",
        "kiln-cli",
        "--bin",
        "kiln",
    ])
    .args(["--profile", &profile, "--features", &features]);
    cuda::prepare_build(&mut cmd)?;
    eprintln!("xtask: cargo build --profile {profile} --features {features} (CUDA)");
    if run(cmd)? != ExitCode::SUCCESS {
        return Err("building kiln with CUDA failed (see cargo's output above)".into());
    }
    let bin = dir.join(profile_dir).join("kiln");
    eprintln!("xtask: built {}", bin.display());
    Ok(CudaBuild {
        bin,
        extra_features,
    })
}

/// The plain CUDA build's folder (`plain`, `target/cuda`) to start a new
/// feature folder `dir` from: where `dir` does not exist yet and `plain`
/// has a build of the same profile (`profile_dir`). Cargo's fingerprints
/// do not name the folder, so from such a copy it rebuilds only the crates
/// whose features differ (CubeCL's CUDA runtime, Burn's backends and
/// kiln's crates): the NVRTC build (`--features cuda-cpp`) took 7.5
/// minutes instead of about 17 on 2 cores (2026-12-04).
fn seed_for<'a>(dir: &Path, plain: &'a Path, profile_dir: &str) -> Option<&'a Path> {
    (dir != plain && !dir.exists() && plain.join(profile_dir).is_dir()).then_some(plain)
}

/// Copies the build folder `from` to `to` (`cp -a`: times kept, which
/// cargo's fingerprints compare).
fn seed(from: &Path, to: &Path) -> Result<(), String> {
    eprintln!(
        "xtask: starting {} as a copy of {} (only what the features change is rebuilt)",
        to.display(),
        from.display()
    );
    let mut cp = Command::new("cp");
    cp.arg("-a").arg(from).arg(to);
    if run(cp)? != ExitCode::SUCCESS {
        // A partial copy would be a build folder cargo half trusts.
        let _ = std::fs::remove_dir_all(to);
        return Err(format!(
            "copying {} to {} failed",
            from.display(),
            to.display()
        ));
    }
    Ok(())
}

/// The feature list of a CUDA build: `cuda` and `extra`, with the GPU
/// backends as kiln-train's features (no autotune cache) unless
/// `autotune_cache`.
fn cuda_features(extra: &[String], autotune_cache: bool) -> String {
    std::iter::once("cuda")
        .chain(extra.iter().map(String::as_str))
        .map(|f| match f {
            "cuda" | "cuda-cpp" | "wgpu" if !autotune_cache => format!("kiln-train/{f}"),
            _ => f.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `cargo xtask gpu-pack [--features F]`: the CUDA `kiln` (release, with
/// `F` too) stripped and compressed into `gpu-pack/kiln.xz` (with `F`:
/// `gpu-pack/kiln-F.xz`), for `bench/gpu_check.py` on a GPU machine that has
/// no network (the repository's tracked files carry the presets, data and
/// scripts). The stripped binary stays beside its pack: once both builds
/// are there, [`bundle`] puts them in one file.
fn gpu_pack(args: &[String]) -> Result<ExitCode, String> {
    let CudaBuild {
        bin,
        extra_features,
    } = build_cuda(args)?;
    let name = if extra_features.is_empty() {
        "kiln".to_string()
    } else {
        format!("kiln-{}", extra_features.join("-"))
    };
    let dir = root().join("gpu-pack");
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("failed to create {}: {e}", dir.display()))?;
    let stripped = dir.join(&name);
    let mut strip = Command::new("strip");
    strip.arg("-o").arg(&stripped).arg(&bin);
    if run(strip)? != ExitCode::SUCCESS {
        return Err(format!("strip {} failed", bin.display()));
    }
    let (packed, mib) = pack(&stripped)?;
    println!(
        "wrote {} ({mib:.1} MiB); on the GPU machine, from the repository root:
           python3 bench/gpu_check.py --kiln gpu-pack/kiln.xz [--kiln-fusion gpu-pack/kiln-fusion.xz] --out gpu-check.json",
        packed.display(),
    );
    bundle(&dir)?;
    Ok(ExitCode::SUCCESS)
}

/// Compresses `binary` to `binary.xz` beside it, keeping `binary` for
/// [`bundle`]; the pack's path and size in MiB.
fn pack(binary: &Path) -> Result<(PathBuf, f64), String> {
    let mut packed = binary.as_os_str().to_owned();
    packed.push(".xz");
    let packed = PathBuf::from(packed);
    // `--force` writes over an earlier pack.
    let mut xz = Command::new("xz");
    xz.args(["-6", "-T0", "--force", "--keep"]).arg(binary);
    let mib = write_with(xz, &packed)?;
    Ok((packed, mib))
}

/// The builds [`bundle`] puts together, in the order they are stored (each
/// next to the one it differs least from), and `bench/gpu_check.py`'s
/// option for each: the plain CUDA build, its kernels compiled by NVRTC,
/// Burn's fusion on.
const BUNDLED: [(&str, &str); 3] = [
    ("kiln", "--kiln"),
    ("kiln-cuda-cpp", "--kiln-cuda-cpp"),
    ("kiln-fusion", "--kiln-fusion"),
];

/// With the plain build and at least one other of [`BUNDLED`] stripped in
/// `dir`, all of them in one `kilns.tar.xz` with a dictionary that spans a
/// binary, so that what the builds share (most of it: Burn, CubeCL, LLVM)
/// is stored once. Two `.xz` packs of 34 and 35 MiB are over what a lent
/// GPU machine takes from the working tree (64 MiB); the bundle is one file
/// for `bench/gpu_check.py --kiln X --kiln-fusion X --kiln-cuda-cpp X`.
fn bundle(dir: &Path) -> Result<(), String> {
    let present: Vec<(&str, &str)> = BUNDLED
        .into_iter()
        .filter(|(name, _)| dir.join(name).is_file())
        .collect();
    if present.len() < 2 || present[0].0 != "kiln" {
        return Ok(());
    }
    let largest = present
        .iter()
        .map(|(n, _)| std::fs::metadata(dir.join(n)).map_or(0, |m| m.len()))
        .max()
        .unwrap_or(0);
    // The next power of two at or over the binary, at least 64 MiB; xz's
    // dictionary is at most 1.5 GiB. One thread: more would cut the stream
    // into blocks that do not see each other.
    let dict_mib = (largest >> 20).next_power_of_two().clamp(64, 1536);
    let out = dir.join("kilns.tar.xz");
    let _ = std::fs::remove_file(&out);
    let mut tar = Command::new("tar");
    tar.env("XZ_OPT", format!("-T1 --lzma2=preset=6,dict={dict_mib}MiB"))
        .arg("-cJf")
        .arg(&out)
        .arg("-C")
        .arg(dir)
        .args(present.iter().map(|(n, _)| n));
    let mib = write_with(tar, &out)?;
    let options: Vec<String> = present
        .iter()
        .map(|(_, option)| format!("{option} gpu-pack/kilns.tar.xz"))
        .collect();
    println!(
        "wrote {} ({mib:.1} MiB: {} builds); on the GPU machine:
           python3 bench/gpu_check.py {} --out gpu-check.json",
        out.display(),
        present.len(),
        options.join(" "),
    );
    Ok(())
}

/// Runs `cmd`, which writes `out`; the size of `out` in MiB.
fn write_with(cmd: Command, out: &Path) -> Result<f64, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    if run(cmd)? != ExitCode::SUCCESS {
        return Err(format!("{program} writing {} failed", out.display()));
    }
    let size = std::fs::metadata(out)
        .map_err(|e| format!("failed to read {}: {e}", out.display()))?
        .len();
    Ok(size as f64 / f64::from(1 << 20))
}

/// The standard benchmark set: the default runs of both workloads, the
/// PyTorch comparison shapes of ../shared/PEERS.md (GPT block 128 × batch 32;
/// encoder batch 32 padded to 128, no dropout, an optimizer step per batch
/// as `bench/pytorch_encoder.py` takes; the `cpu` preset's encoder
/// accumulates 8), and the LM's loader alone.
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
            "training.gradient_accumulation_steps=1",
            "model.dropout=0.0",
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
    build: Build,
) -> Result<ExitCode, String> {
    let mut results = Vec::new();
    for (name, args) in entries {
        eprintln!("xtask: {name}: kiln {}", args.join(" "));
        let mut cmd = kiln_command(build)?;
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

/// `cargo xtask compare [--avx2] [args…]`: builds kiln in release (with
/// `--avx2` also the build without AVX-512 kernels, in `<target>/avx2`, as
/// docs/PERFORMANCE.md builds it) and runs bench/cpu_compare.py on them;
/// the other arguments (`--python`, `--rounds`, `--out`, …) go to it.
fn compare(mut rest: Vec<String>) -> Result<ExitCode, String> {
    let avx2 = rest.iter().any(|a| a == "--avx2");
    rest.retain(|a| a != "--avx2");
    let mut builds = vec![(target_dir(), false)];
    if avx2 {
        builds.push((avx2_target_dir(), true));
    }
    let mut args = vec![root().join("bench/cpu_compare.py").display().to_string()];
    for (dir, avx2_only) in builds {
        let mut cmd = cargo();
        cmd.args(["build", "--release", "--locked", "-p", "kiln-cli"])
            .env("CARGO_TARGET_DIR", &dir);
        if avx2_only {
            eprintln!(
                "xtask: building kiln without its AVX-512 kernels in {}",
                dir.display()
            );
            cmd.args(["--no-default-features", "--features", "flex"]);
        }
        if run(cmd)? != ExitCode::SUCCESS {
            return Ok(ExitCode::FAILURE);
        }
        let flag = if avx2_only { "--kiln-avx2" } else { "--kiln" };
        args.extend([
            flag.to_string(),
            dir.join("release/kiln").display().to_string(),
        ]);
    }
    let mut cmd = Command::new("python3");
    cmd.current_dir(root()).args(args).args(rest);
    run(cmd)
}

/// `cargo xtask bench [--avx2] [args…]`: the standard benchmarks →
/// bench/results.json; with `--avx2`, on a build without the CPU kernels'
/// AVX-512 versions → bench/results-avx2.json.
fn bench(mut rest: Vec<String>) -> Result<ExitCode, String> {
    let avx2 = rest.iter().any(|a| a == "--avx2");
    rest.retain(|a| a != "--avx2");
    let entries: Vec<(String, Vec<String>)> = BENCHES
        .iter()
        .map(|(name, args)| {
            let mut a = vec!["bench".to_string()];
            a.extend(args.iter().map(|s| s.to_string()));
            (name.to_string(), a)
        })
        .collect();
    if avx2 {
        collect("results-avx2.json", &entries, &rest, Build::Avx2)
    } else {
        collect("results.json", &entries, &rest, Build::Auto)
    }
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
    collect("tune-results.json", &entries, &rest, Build::Auto)
}

/// `.ci/run` itself, so that the two cannot drift apart: formatting, lints,
/// the tests (the crates' README examples among them), packaging,
/// the CUDA build with wgpu (SPIR-V) linked for real (linted by clippy as it builds),
/// and on it the GPU suite on whatever Vulkan device there is. It installs
/// Mesa's Vulkan driver and pip only where they are missing.
fn ci() -> Result<ExitCode, String> {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join(".ci/run"));
    run(cmd)
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

    /// The checkout `cargo xtask` runs in wins over the one the binary was
    /// compiled in (a target directory shared between checkouts).
    #[test]
    fn the_root_is_the_checkout_cargo_runs_xtask_in() {
        assert_eq!(
            root_of(Some("/elsewhere/kiln/xtask".into())),
            Path::new("/elsewhere/kiln")
        );
        let compiled = root_of(None);
        assert!(compiled.join("xtask").join("Cargo.toml").is_file());
        assert_ne!(compiled, Path::new("/elsewhere/kiln"));
    }

    /// A new CUDA feature folder starts from the plain build's where that
    /// has the profile; never the plain folder itself, nor one that exists.
    #[test]
    fn a_new_cuda_feature_folder_starts_from_the_plain_builds() {
        let tmp = std::env::temp_dir().join(format!("xtask-seed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let plain = tmp.join("cuda");
        let nvrtc = tmp.join("cuda+cuda-cpp");
        assert_eq!(
            seed_for(&nvrtc, &plain, "release"),
            None,
            "no plain build yet"
        );
        std::fs::create_dir_all(plain.join("release")).expect("mkdir");
        assert_eq!(seed_for(&nvrtc, &plain, "release"), Some(plain.as_path()));
        assert_eq!(seed_for(&nvrtc, &plain, "gpu-ci"), None, "another profile");
        assert_eq!(seed_for(&plain, &plain, "release"), None, "itself");
        std::fs::create_dir_all(&nvrtc).expect("mkdir");
        assert_eq!(seed_for(&nvrtc, &plain, "release"), None, "already there");
        std::fs::remove_dir_all(&tmp).expect("cleanup");
    }

    #[test]
    fn a_cuda_build_without_the_autotune_cache_names_the_backends_of_kiln_train() {
        let extra = ["wgpu".to_string(), "fusion".to_string()];
        assert_eq!(cuda_features(&extra, true), "cuda,wgpu,fusion");
        assert_eq!(
            cuda_features(&extra, false),
            "kiln-train/cuda,kiln-train/wgpu,fusion"
        );
        assert_eq!(cuda_features(&[], false), "kiln-train/cuda");
        // kiln-cli's `cuda-cpp` turns on its `cuda`, and so the cache.
        let cpp = ["wgpu".to_string(), "cuda-cpp".to_string()];
        assert_eq!(
            cuda_features(&cpp, false),
            "kiln-train/cuda,kiln-train/wgpu,kiln-train/cuda-cpp"
        );
    }

    /// Each pack leaves its stripped binary in place: the bundle is made
    /// from the two binaries once both builds have been packed.
    #[test]
    fn a_pack_keeps_the_binary_the_bundle_is_made_from() {
        let dir = std::env::temp_dir().join(format!("kiln-xtask-pack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch folder");
        let bytes: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        std::fs::write(dir.join("kiln-fusion"), &bytes).expect("binary");
        let (packed, mib) = pack(&dir.join("kiln-fusion")).expect("xz");
        assert_eq!(packed, dir.join("kiln-fusion.xz"));
        assert!(mib > 0.0 && mib < 0.5, "{mib} MiB");
        assert_eq!(std::fs::read(dir.join("kiln-fusion")).expect("kept"), bytes);
        let out = Command::new("xz")
            .args(["-dc"])
            .arg(&packed)
            .output()
            .expect("xz -dc");
        assert!(out.status.success());
        assert_eq!(out.stdout, bytes);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The builds come back byte for byte, and what they share is stored
    /// once: incompressible binaries that share all but their last 64 KiB
    /// make a bundle not much larger than one of them. The plain build alone
    /// makes none.
    #[test]
    fn the_bundle_holds_the_builds_and_stores_what_they_share_once() {
        let dir = std::env::temp_dir().join(format!("kiln-xtask-bundle-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch folder");
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state.to_le_bytes()[0]
                })
                .collect()
        };
        let shared = noise(1 << 20);
        let builds = [
            ("kiln", [shared.clone(), noise(1 << 16)].concat()),
            ("kiln-fusion", [shared.clone(), noise(1 << 16)].concat()),
            ("kiln-cuda-cpp", [shared, noise(1 << 16)].concat()),
        ];
        let bundled = dir.join("kilns.tar.xz");
        std::fs::write(dir.join("kiln"), &builds[0].1).expect("write kiln");
        bundle(&dir).expect("bundle");
        assert!(!bundled.exists(), "one build alone is not bundled");

        for count in [2, 3] {
            let (name, bytes) = &builds[count - 1];
            std::fs::write(dir.join(name), bytes).expect("write a build");
            bundle(&dir).expect("bundle");
            let size = std::fs::metadata(&bundled).expect("the bundle").len();
            assert!(
                size < (builds[0].1.len() as u64) * 5 / 4,
                "bundle {size} bytes for {count} binaries of {} sharing 1 MiB",
                builds[0].1.len()
            );
            let out = dir.join(format!("out{count}"));
            std::fs::create_dir_all(&out).expect("scratch folder");
            let mut untar = Command::new("tar");
            untar.arg("-xJf").arg(&bundled).arg("-C").arg(&out);
            assert_eq!(run(untar).expect("tar runs"), ExitCode::SUCCESS);
            for (name, bytes) in &builds[..count] {
                assert!(
                    std::fs::read(out.join(name)).expect("a build") == *bytes,
                    "{name}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

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
    fn each_machines_gpu_gets_its_backend_and_others_wgpu_or_nothing() {
        let f = |build, chosen: Option<&str>, gpu: GpuKind| {
            features_for(build, chosen.map(str::to_string), || gpu)
        };
        let (nvidia, amd, apple, other) = (
            GpuKind::Nvidia,
            GpuKind::Amd,
            GpuKind::Apple,
            GpuKind::Other,
        );
        assert_eq!(f(Build::Auto, None, nvidia).as_deref(), Some("cuda"));
        assert_eq!(f(Build::Auto, None, amd).as_deref(), Some("rocm,vulkan"));
        assert_eq!(f(Build::Auto, None, apple).as_deref(), Some("wgpu"));
        assert_eq!(f(Build::Auto, None, other), None);
        assert_eq!(f(Build::Gpu, None, nvidia).as_deref(), Some("cuda"));
        assert_eq!(f(Build::Gpu, None, amd).as_deref(), Some("rocm,vulkan"));
        assert_eq!(f(Build::Gpu, None, other).as_deref(), Some("wgpu"));
        assert_eq!(f(Build::Cpu, None, nvidia), None);
        let any = nvidia;
        // KILN_FEATURES wins; empty means the default build.
        assert_eq!(
            f(Build::Auto, Some("wgpu,fusion"), any).as_deref(),
            Some("wgpu,fusion")
        );
        assert_eq!(f(Build::Gpu, Some(" "), any), None);
        // The AVX2 build is flex alone (kiln_command drops the defaults).
        assert_eq!(f(Build::Avx2, Some("wgpu"), any).as_deref(), Some("flex"));
    }

    /// Each feature set has its own folder, whatever order its features
    /// are named in; the default and AVX2 builds keep theirs.
    #[test]
    fn each_feature_set_builds_in_a_folder_of_its_own() {
        assert_eq!(feature_dir_name("wgpu"), "wgpu");
        assert_eq!(feature_dir_name("wgpu, fusion"), "fusion+wgpu");
        assert_eq!(feature_dir_name("fusion,wgpu,fusion"), "fusion+wgpu");
        assert_eq!(
            feature_dir_name("kiln-train/cuda,kiln-train/wgpu"),
            "kiln-train.cuda+kiln-train.wgpu"
        );
        assert_eq!(build_dir(Build::Cpu, None), target_dir());
        assert_eq!(
            build_dir(Build::Gpu, Some("cuda")),
            target_dir().join("cuda")
        );
        assert_eq!(build_dir(Build::Avx2, Some("flex")), avx2_target_dir());
        assert_ne!(
            build_dir(Build::Gpu, Some("wgpu")),
            build_dir(Build::Gpu, Some("wgpu,fusion"))
        );
    }

    #[test]
    fn minutes_read_as_people_say_them() {
        assert_eq!(minutes(38), "38 s");
        assert_eq!(minutes(894), "14 min 54 s");
    }

    #[test]
    fn the_hardware_report_flag_is_found_in_both_spellings() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            hardware_report(&args(&["x=1", "--hardware-report", "r.json"])).as_deref(),
            Some("r.json")
        );
        assert_eq!(
            hardware_report(&args(&["--hardware-report=r.json"])).as_deref(),
            Some("r.json")
        );
        assert_eq!(hardware_report(&args(&["--force"])), None);
    }

    #[test]
    fn targets_parse() {
        assert_eq!(train_target("train-4090"), Some(("gpu_4090", false)));
        assert_eq!(train_target("nli-train-low-mem"), Some(("low_mem", true)));
        assert_eq!(train_target("train-9090"), None);
        assert_eq!(train_target("check-hardware"), None);
    }
}
