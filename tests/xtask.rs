//! `cargo xtask`'s GPU targets: the machine checked before the GPU build,
//! and each feature set built in a folder of its own.
//!
//! xtask runs with a stand-in for cargo (`CARGO`) that records each command
//! and, for a build of `kiln`, writes a script in its place that says where
//! it was built and with what arguments it ran: the Burn builds these
//! targets start take a quarter of an hour each. The Burn-free check
//! (kiln-config's `machine` example) is built and run by the real cargo.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{Run, fake_report, root};

/// xtask's binary, built in the tests' profile.
fn xtask_bin() -> PathBuf {
    crate::support::built("xtask", &["--locked"])
}

/// The stand-in for cargo: every command goes to `$XTASK_TEST_LOG` as
/// `CARGO_TARGET_DIR :: arguments`; the `machine` example goes to the real
/// cargo (in the tests' own target directory); a `build` writes a `kiln`
/// script into `$CARGO_TARGET_DIR/release`.
const FAKE_CARGO: &str = r#"#!/bin/sh
echo "$CARGO_TARGET_DIR :: $*" >> "$XTASK_TEST_LOG"
case " $* " in
  *" --example machine "*)
    CARGO_TARGET_DIR="$XTASK_TEST_REAL_TARGET" exec "$XTASK_TEST_REAL_CARGO" "$@" ;;
esac
if [ "$1" = build ]; then
  mkdir -p "$CARGO_TARGET_DIR/release"
  printf '#!/bin/sh\necho "kiln built in %s ran: $*"\n' "$CARGO_TARGET_DIR" > "$CARGO_TARGET_DIR/release/kiln"
  chmod +x "$CARGO_TARGET_DIR/release/kiln"
fi
"#;

struct Xtask {
    bin: PathBuf,
    fake_cargo: PathBuf,
    target: PathBuf,
    log: PathBuf,
    real_target: PathBuf,
}

impl Xtask {
    fn new(dir: &Path) -> Self {
        let bin = xtask_bin();
        let real_target = bin
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/xtask")
            .to_path_buf();
        let fake_cargo = dir.join("cargo");
        std::fs::write(&fake_cargo, FAKE_CARGO).expect("write fake cargo");
        let status = Command::new("chmod")
            .arg("+x")
            .arg(&fake_cargo)
            .status()
            .expect("chmod");
        assert!(status.success());
        let target = dir.join("target");
        std::fs::create_dir_all(&target).expect("target dir");
        Self {
            bin,
            fake_cargo,
            target,
            log: dir.join("cargo.log"),
            real_target,
        }
    }

    fn run(&self, args: &[&str]) -> Run {
        let _ = std::fs::remove_file(&self.log);
        let real_cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .current_dir(root())
            .env("CARGO", &self.fake_cargo)
            .env("CARGO_MANIFEST_DIR", root().join("xtask"))
            .env("CARGO_TARGET_DIR", &self.target)
            .env("XTASK_TEST_LOG", &self.log)
            .env("XTASK_TEST_REAL_CARGO", real_cargo)
            .env("XTASK_TEST_REAL_TARGET", &self.real_target)
            .env_remove("KILN_FEATURES");
        let out = cmd.output().expect("run xtask");
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The builds of `kiln` the last run asked cargo for: each one's target
    /// directory and arguments.
    fn builds(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(":: build "))
            .map(String::from)
            .collect()
    }
}

/// A GPU target on a machine without its GPU stops before any build, with
/// kiln's message; `--force` builds into the target's own folder and runs;
/// a CPU target then builds in the default folder, beside it; with the GPU
/// there the target builds at once; `check-hardware` builds nothing.
#[test]
#[allow(clippy::print_stderr, reason = "the test says why it skips")]
fn gpu_targets_check_the_machine_before_building_and_keep_their_own_build() {
    if Path::new("/proc/driver/nvidia/gpus").is_dir() {
        // xtask would build CUDA here (`--features cuda`), not wgpu.
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let x = Xtask::new(dir.path());
    let no_gpu = dir.path().join("no-gpu");
    std::fs::create_dir(&no_gpu).expect("dir");
    let no_gpu = fake_report(&no_gpu, &[]);
    let no_gpu = no_gpu.to_str().expect("utf-8 path");
    let rtx = dir.path().join("rtx");
    std::fs::create_dir(&rtx).expect("dir");
    let rtx = fake_report(&rtx, &[("NVIDIA GeForce RTX 4090", 24, (8, 9))]);
    let rtx = rtx.to_str().expect("utf-8 path");
    let wgpu_dir = x.target.join("wgpu");

    // No GPU: exit 2, kiln's message, and no build of kiln at all.
    let run = x
        .run(&["train-4090", "--hardware-report", no_gpu])
        .expect_code(2);
    run.stderr_has(&[
        "hardware preset `gpu_4090` is for RTX 4090, but this machine has no GPU",
        "pass --force to run it on this machine anyway, or use hardware=auto",
    ]);
    assert!(x.builds().is_empty(), "built: {:?}", x.builds());
    assert!(!wgpu_dir.exists());
    // The NLI target is checked the same way.
    x.run(&["nli-train-t4", "--hardware-report", no_gpu])
        .expect_code(2)
        .stderr_has(&["hardware preset `t4` is for T4"]);
    assert!(x.builds().is_empty(), "built: {:?}", x.builds());

    // Nothing built yet: check-hardware describes the machine without a build.
    let run = x
        .run(&["check-hardware", "--hardware-report", no_gpu])
        .expect_code(0);
    run.stdout_has(&["preset for hardware=auto: cpu"])
        .stderr_has(&["no kiln is built"]);
    assert!(x.builds().is_empty(), "built: {:?}", x.builds());

    // --force: says what comes next, builds wgpu in its own folder, runs it.
    let run = x
        .run(&["train-4090", "--force", "--hardware-report", no_gpu])
        .expect_code(0);
    run.stderr_has(&[
        "going on (--force): the wgpu build of kiln comes next",
        &wgpu_dir.display().to_string(),
    ]);
    let builds = x.builds();
    assert_eq!(builds.len(), 1, "{builds:?}");
    assert!(
        builds[0].starts_with(&format!("{} :: build ", wgpu_dir.display()))
            && builds[0].contains("--features wgpu"),
        "{builds:?}"
    );
    run.stdout_has(&[&format!(
        "kiln built in {} ran: train hardware=gpu_4090 --force --hardware-report {no_gpu}",
        wgpu_dir.display()
    )]);

    // A CPU target next: the default build, in the target folder itself;
    // the wgpu build stays where it was.
    let run = x
        .run(&["train-cpu", "--hardware-report", no_gpu])
        .expect_code(0);
    let builds = x.builds();
    assert_eq!(builds.len(), 1, "{builds:?}");
    assert!(
        builds[0].starts_with(&format!("{} :: build ", x.target.display()))
            && !builds[0].contains("--features"),
        "{builds:?}"
    );
    run.stdout_has(&[&format!(
        "kiln built in {} ran: train hardware=cpu",
        x.target.display()
    )]);
    assert!(wgpu_dir.join("release/kiln").is_file());

    // Where the GPU is there, the target builds and runs without --force.
    let run = x
        .run(&["train-4090", "--hardware-report", rtx])
        .expect_code(0);
    assert_eq!(x.builds().len(), 1, "{:?}", x.builds());
    run.stdout_has(&[&format!(
        "kiln built in {} ran: train hardware=gpu_4090",
        wgpu_dir.display()
    )]);

    // With train-auto's build there, check-hardware runs that kiln.
    let run = x
        .run(&["check-hardware", "--hardware-report", no_gpu])
        .expect_code(0);
    run.stdout_has(&[&format!(
        "kiln built in {} ran: check-hardware",
        x.target.display()
    )]);
}
