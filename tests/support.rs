//! Running the `kiln` binary and reading what it printed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root.
///
/// The checkout's path as `cargo test` gives it to the test process, not
/// as it was compiled in: with a target directory shared between checkouts,
/// cargo may run a test binary built in another one.
pub(crate) fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The `kiln` binary of this build profile, brought up to date once per
/// test run (`cargo test -p kiln-tests` alone would not rebuild it); with
/// this crate's `wgpu` feature, built with the wgpu backend, and with its
/// `fusion` feature, with Burn's operation fusion too. `TEST_KILN_BIN=path`
/// tests that binary as it is instead (CI builds one `kiln` with both GPU
/// backends and runs the GPU suite on it). Not `KILN_…`: every `KILN_`
/// variable is a configuration layer to the `kiln` it would reach.
pub(crate) fn kiln_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("TEST_KILN_BIN") {
            let bin = PathBuf::from(bin);
            assert!(bin.is_file(), "TEST_KILN_BIN={} is no file", bin.display());
            return bin;
        }
        let features: &[&str] = if cfg!(feature = "fusion") {
            &["--features", "kiln-cli/wgpu,kiln-cli/fusion"]
        } else if cfg!(feature = "wgpu") {
            &["--features", "kiln-cli/wgpu"]
        } else {
            &[]
        };
        built("kiln", features)
    })
}

/// Binary `bin` of the workspace, built (with `extra` arguments) in the
/// tests' own profile and target directory, and its path there. Built with
/// `--workspace`, as `cargo test --workspace` builds the libraries: the
/// features are unified over every member there (kiln-model and kiln-train
/// with their `default`), so the binary reuses the test build's units;
/// `--package kiln-cli` alone resolved other features and compiled
/// kiln-model, kiln-train and kiln-cli again, about 100 s of CI's test
/// step with every test waiting on it (2026-12-03).
pub(crate) fn built(bin: &str, extra: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/tests-<hash> → target/<profile>/<bin>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary in target/<profile>/deps");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    let profile = if profile == "debug" { "dev" } else { profile };
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--workspace", "--bin", bin])
        .args(["--profile", profile])
        .args(extra)
        .current_dir(root())
        .status()
        .expect("run cargo build");
    assert!(status.success(), "building {bin} failed");
    profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX))
}

/// What one run of `kiln` did.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// Panics with both streams unless the exit code is `code`.
    pub(crate) fn expect_code(self, code: i32) -> Self {
        assert_eq!(
            self.code, code,
            "exit code\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout, self.stderr
        );
        self
    }

    pub(crate) fn stdout_has(&self, parts: &[&str]) -> &Self {
        for part in parts {
            assert!(
                self.stdout.contains(part),
                "stdout lacks `{part}`:\n{}",
                self.stdout
            );
        }
        self
    }

    pub(crate) fn stderr_has(&self, parts: &[&str]) -> &Self {
        for part in parts {
            assert!(
                self.stderr.contains(part),
                "stderr lacks `{part}`:\n{}",
                self.stderr
            );
        }
        assert!(!self.stderr.contains("panicked"), "panic:\n{}", self.stderr);
        self
    }
}

/// This machine's hardware report (`kiln check-hardware --json`), to edit
/// into another machine's.
pub(crate) fn this_machine() -> serde_json::Value {
    let out = kiln(&["check-hardware", "--json"]).run().expect_code(0);
    serde_json::from_str(&out.stdout).expect("check-hardware --json")
}

/// A `kiln` command: arguments, environment (the test's `KILN_*` variables
/// are removed) and working directory (the repository root by default).
pub(crate) struct Kiln {
    cmd: Command,
}

pub(crate) fn kiln(args: &[&str]) -> Kiln {
    let mut cmd = Command::new(kiln_bin());
    cmd.args(args).current_dir(root());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("KILN_") {
            cmd.env_remove(name);
        }
    }
    Kiln { cmd }
}

impl Kiln {
    pub(crate) fn env(mut self, key: &str, value: &str) -> Self {
        self.cmd.env(key, value);
        self
    }

    pub(crate) fn cwd(mut self, dir: &Path) -> Self {
        self.cmd.current_dir(dir);
        self
    }

    pub(crate) fn run(mut self) -> Run {
        let out = self.cmd.output().expect("run kiln");
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// A fake GPU: NVML name, memory in GiB, compute capability.
pub(crate) type FakeGpu<'a> = (&'a str, u64, (u32, u32));

/// A saved hardware report with the given GPUs, as a file for `--hardware-report`.
pub(crate) fn fake_report(dir: &Path, gpus: &[FakeGpu<'_>]) -> PathBuf {
    use kiln_hwdetect::{DriverInfo, FixedProbe, GpuInfo, GpuStatus, detect_with};
    let status = if gpus.is_empty() {
        GpuStatus::None {
            why: "no NVIDIA driver (fake report)".into(),
        }
    } else {
        GpuStatus::Found {
            gpus: gpus
                .iter()
                .zip(0u32..)
                .map(|((name, gib, cc), i)| GpuInfo::new(i, name, gib << 30, gib << 30, *cc))
                .collect(),
        }
    };
    let report = detect_with(&FixedProbe(status, DriverInfo::default()));
    let path = dir.join("report.json");
    std::fs::write(&path, serde_json::to_string(&report).expect("json")).expect("write report");
    path
}

/// A hardware report with no NVIDIA GPU and `others` (AMD's, Intel's,
/// Apple's GPUs as kiln-hwdetect reads them), written to `dir/<name>.json`.
pub(crate) fn other_gpus_report(
    dir: &Path,
    name: &str,
    others: Vec<kiln_hwdetect::OtherGpu>,
) -> PathBuf {
    use kiln_hwdetect::{DriverInfo, FixedProbe, GpuStatus, detect_with};
    let mut report = detect_with(&FixedProbe(
        GpuStatus::None {
            why: "no NVIDIA driver (fake report)".into(),
        },
        DriverInfo::default(),
    ));
    report.other_gpus = others;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string(&report).expect("json")).expect("write report");
    path
}

/// Sends `signal` (`-KILL`, `-TERM`, `-INT`) to process `pid`.
pub(crate) fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// The output of `child` once it has exited, which it must within `secs`
/// seconds (else it is killed and the test fails: it waited for `what`).
pub(crate) fn exit_within(
    mut child: std::process::Child,
    secs: u64,
    what: &str,
) -> std::process::Output {
    let ended = poll_for(
        std::time::Duration::from_secs(secs),
        std::time::Duration::from_millis(20),
        || child.try_wait().expect("try_wait"),
    );
    if ended.is_none() {
        child.kill().expect("kill");
        panic!("the stop waited for {what}");
    }
    child.wait_with_output().expect("wait")
}

/// What an interrupted `kiln` printed to stdout, once it has exited 130
/// (the test fails with both streams otherwise).
pub(crate) fn interrupted_stdout(out: std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Starts `kiln args` with its output captured, and returns once `marker`
/// exists (a checkpoint, the metrics).
pub(crate) fn start_until(args: &[String], marker: &Path) -> std::process::Child {
    let child = spawn(args, std::process::Stdio::piped);
    wait_for(marker);
    child
}

/// `kiln args`, started with `out` as its stdout and stderr.
pub(crate) fn spawn(args: &[String], out: fn() -> std::process::Stdio) -> std::process::Child {
    Command::new(kiln_bin())
        .args(args)
        .current_dir(root())
        .stdout(out())
        .stderr(out())
        .spawn()
        .expect("spawn kiln")
}

/// Makes a FIFO at `path` that nothing writes: a corpus whose reader
/// waits (in its data's preparation) until it is stopped.
pub(crate) fn unwritten_fifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
}

/// Waits (5 minutes at most) until `file` holds `part`.
pub(crate) fn wait_for_line(file: &Path, part: &str) {
    poll(&format!("`{part}` in {}", file.display()), || {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        text.contains(part).then_some(())
    });
}

/// Waits (5 minutes at most) until `marker` exists.
pub(crate) fn wait_for(marker: &Path) {
    poll(&marker.display().to_string(), || {
        marker.exists().then_some(())
    });
}

/// Calls `what` every millisecond until it gives `Some` (5 minutes at
/// most, then fails naming `waiting_for`).
pub(crate) fn poll<T>(waiting_for: &str, what: impl FnMut() -> Option<T>) -> T {
    use std::time::Duration;
    poll_for(Duration::from_secs(300), Duration::from_millis(1), what)
        .unwrap_or_else(|| panic!("{waiting_for} never appeared"))
}

/// Calls `what` every `every` until it gives `Some`, for `limit` at most.
pub(crate) fn poll_for<T>(
    limit: std::time::Duration,
    every: std::time::Duration,
    mut what: impl FnMut() -> Option<T>,
) -> Option<T> {
    let started = std::time::Instant::now();
    loop {
        if let Some(found) = what() {
            return Some(found);
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(every);
    }
}

/// Starts `kiln args` and SIGKILLs it as soon as `marker` exists (a
/// checkpoint, say); fails if `done` exists by then (the run was too short
/// to be killed midway).
pub(crate) fn kill_when(args: &[String], marker: &Path, done: &Path) {
    let mut child = spawn(args, std::process::Stdio::null);
    wait_for(marker);
    child.kill().expect("kill");
    child.wait().expect("reap");
    assert!(
        !done.exists(),
        "the run finished before it was killed: make it longer"
    );
}

/// `bench/gpu_check.py` with `args`, which must pass: what it printed and
/// the steps of its JSON report. This build's `kiln` goes to `--kiln` and to
/// each flag of `also_as` (the check's other builds, `--kiln-cuda-cpp` and
/// the like), the report to a file in a fresh directory.
pub(crate) fn gpu_check(args: &[&str], also_as: &[&str]) -> (String, Vec<serde_json::Value>) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("gpu-check.json");
    let mut command = Command::new("python3");
    command.arg(root().join("bench/gpu_check.py")).args(args);
    for flag in ["--kiln"].iter().chain(also_as) {
        command.arg(flag).arg(kiln_bin());
    }
    let run = command
        .arg("--out")
        .arg(&out)
        .output()
        .expect("python3 runs bench/gpu_check.py (python3 is needed for the GPU check)");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "gpu_check.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let mut report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("gpu-check.json"))
            .expect("json");
    assert_eq!(report["schema"], "kiln.gpu-check/1");
    let serde_json::Value::Array(steps) = report["steps"].take() else {
        panic!("no steps in the report: {report}");
    };
    (stdout, steps)
}

/// A checkpoint's model tensors, by name.
pub(crate) fn weights(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("checkpoint");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| name.starts_with("model/"))
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
