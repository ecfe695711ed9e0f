//! `cargo run --release -p kiln-train --example tiny -- [FILE] [STEPS]`: a
//! small GPT trained from code on a text file (default: kiln's Tiny
//! Shakespeare, `data/tinyshakespeare.txt`), each evaluation printed, the
//! run under a temporary directory.

#![allow(clippy::print_stdout, reason = "an example prints")]

use kiln_train::kiln_config::{Presets, resolve_overrides};
use kiln_train::{EvalMetrics, Event, Observer, Outcome, TrainOptions, train};

struct Print;

impl Observer for Print {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Eval(e) => {
                if let EvalMetrics::Lm {
                    train_loss,
                    val_loss,
                } = &e.metrics
                {
                    println!(
                        "step {:>4}: train {train_loss:.4}, val {val_loss:.4}",
                        e.step
                    );
                }
            }
            Event::Done(s) => println!(
                "{} steps, {:.0} tokens/s, held back by {}",
                s.steps, s.median_tokens_per_s, s.held_back_by
            ),
            _ => {}
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let corpus = args
        .next()
        .unwrap_or_else(|| "data/tinyshakespeare.txt".into());
    let steps = args.next().unwrap_or_else(|| "200".into());
    let dir = tempfile::tempdir()?;
    let overrides = [
        "hardware=cpu".to_string(),
        format!("data.path={corpus}"),
        format!("data.cache_dir={}", dir.path().join("cache").display()),
        format!("run.dir={}", dir.path().join("run").display()),
        format!("training.max_steps={steps}"),
        "eval.eval_steps=50".into(),
        "sample.count=1".into(),
    ];
    let overrides: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let machine = kiln_train::kiln_hwdetect::detect_cpu_only();
    let config = resolve_overrides(&Presets::built_in(), &overrides, &machine)?.config;
    let options = TrainOptions::new(machine);
    if let Outcome::Finished { run, summary } = train(&config, &options, &mut Print)? {
        let sample = std::fs::read_to_string(run.join("samples.txt")).unwrap_or_default();
        println!(
            "final val loss {:?}; a sample:\n{sample}",
            summary.final_val_loss
        );
    }
    Ok(())
}
