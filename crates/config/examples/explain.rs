//! `cargo run -p kiln-config --example explain -- [--presets DIR] KEY=VALUE...`:
//! resolves kiln's presets with the overrides given, on this machine, and
//! prints every key with its value and where it was set.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example prints"
)]

use std::process::ExitCode;

use kiln_config::{Presets, resolve_overrides};

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.iter().position(|a| a == "--presets").map(|i| {
        args.remove(i);
        args.remove(i)
    });
    let presets = match dir.map_or(Ok(Presets::built_in()), Presets::with_dir) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let machine = kiln_config::kiln_hwdetect::detect();
    let overrides: Vec<&str> = args.iter().map(String::as_str).collect();
    match resolve_overrides(&presets, &overrides, &machine) {
        Ok(resolved) => {
            if let Some(choice) = &resolved.hardware_choice {
                println!("# hardware=auto chose `{}`: {}", choice.name, choice.why);
            }
            for row in resolved.explain() {
                println!("{} = {}  # {}", row.key, row.value, row.source);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
