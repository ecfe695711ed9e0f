//! `cargo run -p kiln-config --example machine -- [--hardware-report FILE]
//! [--fits PRESET] [--gpu] [--json]`: this machine (or a saved report), the
//! hardware preset `hardware=auto` picks for it and why (`--json`: both as
//! JSON, the report under `hardware` as `kiln check-hardware --json` has
//! it), and with `--fits PRESET` whether that preset is written for this
//! machine: exit 2 with the reason if not. With `--gpu`, exit 1 where there
//! is no NVIDIA GPU.
//!
//! Burn-free, so it builds in about 3 minutes from an empty target directory
//! on 2 cores, where a GPU build of Burn takes a quarter of an hour: `cargo
//! xtask train-4090` runs it before that build, and `cargo xtask
//! check-hardware` runs it while no `kiln` is built yet.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example prints"
)]

use std::process::ExitCode;

use kiln_config::kiln_hwdetect::{self, HardwareReport};
use kiln_config::{check_preset_fits, choose_preset};

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let mut report_path = None;
    let mut fits = None;
    let mut gpu = false;
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--hardware-report" => report_path = Some(value("--hardware-report")?),
            "--fits" => fits = Some(value("--fits")?),
            "--gpu" => gpu = true,
            "--json" => json = true,
            other => {
                return Err(format!(
                    "unknown argument `{other}` (expected --hardware-report FILE, --fits PRESET, --gpu, --json)"
                ));
            }
        }
    }
    let report = match &report_path {
        Some(path) => read_report(path)?,
        None => kiln_hwdetect::detect(),
    };
    if let Some(preset) = fits {
        return Ok(match check_preset_fits(&preset, &report) {
            Ok(()) => {
                println!("hardware preset `{preset}` fits this machine");
                ExitCode::SUCCESS
            }
            Err(mismatch) => {
                eprintln!("{mismatch}");
                ExitCode::from(2)
            }
        });
    }
    let choice = choose_preset(&report);
    if json {
        let out = serde_json::json!({
            "hardware": report,
            "preset": { "name": choice.name, "why": choice.why },
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
    } else {
        print!("{report}");
        println!("preset for hardware=auto: {} ({})", choice.name, choice.why);
    }
    Ok(if gpu && report.gpus().is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A report saved by `kiln check-hardware --json` (which wraps it under
/// `hardware`), or a bare one.
fn read_report(path: &str) -> Result<HardwareReport, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("failed to read `{path}`: {e}"))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("hardware report `{path}` line {}: {e}", e.line()))?;
    let inner = value.get("hardware").cloned().unwrap_or(value);
    serde_json::from_value(inner).map_err(|e| format!("hardware report `{path}`: {e}"))
}
