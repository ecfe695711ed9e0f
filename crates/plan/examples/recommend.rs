//! `cargo run -p kiln-plan --example recommend -- [KEY=VALUE...]`: this
//! machine, the preset `hardware=auto` picks for it, what the preset comes to
//! (batch, precision, loader, ...) and the run's step schedule.

#![allow(clippy::print_stdout, reason = "an example prints")]

use kiln_plan::kiln_config::{Presets, resolve_overrides};
use kiln_plan::{Recommendation, Schedule};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let machine = kiln_plan::kiln_hwdetect::detect();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let overrides: Vec<&str> = args.iter().map(String::as_str).collect();
    let resolved = resolve_overrides(&Presets::built_in(), &overrides, &machine)?;
    print!("{machine}\n{}", Recommendation::new(&resolved, &machine));
    // Tiny Shakespeare's training split at this batch and block size.
    let c = &resolved.config;
    let batches = (1_003_854 / (c.training.batch_size * c.model.max_length)).max(1) as u64;
    let s = Schedule::new(&c.training, batches);
    println!(
        "schedule: {} optimizer steps, {:.1} an epoch; lr {:.1e} at step 1, {:.1e} at the end",
        s.total_steps,
        s.steps_per_epoch(),
        s.lr_at(1),
        s.lr_at(s.total_steps)
    );
    Ok(())
}
