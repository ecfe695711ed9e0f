//! Printing a run as it goes: an indicatif bar with ETA on a terminal, plain
//! lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_train::{Event, Observer, StepMetrics, Summary};

/// Prints events; the bar exists only when stderr is a terminal.
pub(crate) struct Printer {
    bar: Option<ProgressBar>,
    total: u64,
}

impl Printer {
    pub(crate) fn new() -> Self {
        Self {
            bar: None,
            total: 0,
        }
    }

    fn line(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// One log line for a step.
pub(crate) fn step_line(m: &StepMetrics, total: u64) -> String {
    let mfu = m
        .mfu
        .map_or("MFU n/a".to_string(), |v| format!("MFU {:.1}%", v * 100.0));
    format!(
        "step {:>5}/{total} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {:.1} ms/step | {:.0} tokens/s | {:.1} samples/s | {mfu} | data-wait {:.1}% | mem {} (peak {})",
        m.step,
        m.loss,
        m.lr,
        m.grad_norm,
        m.ms_per_step,
        m.tokens_per_s,
        m.samples_per_s,
        m.data_wait_pct,
        mib(m.memory_bytes),
        mib(m.peak_memory_bytes)
    )
}

pub(crate) fn summary_lines(s: &Summary) -> Vec<String> {
    let loss = |l: Option<f64>| l.map_or("n/a".to_string(), |v| format!("{v:.4}"));
    vec![
        format!(
            "done: {} steps, {} tokens in {:.1} s; train loss {}, val loss {} (best {})",
            s.steps,
            s.tokens_seen,
            s.wall_s,
            loss(s.final_train_loss),
            loss(s.final_val_loss),
            loss(s.best_val_loss)
        ),
        format!(
            "throughput: median {:.0} tokens/s, {:.1} ms/step; MFU {} against {}",
            s.median_tokens_per_s,
            s.median_ms_per_step,
            s.median_mfu
                .map_or("n/a".to_string(), |m| format!("{:.1}%", m * 100.0)),
            s.mfu_peak
        ),
        format!(
            "data-wait: {:.2}% of step time; peak memory {}",
            s.data_wait_pct,
            mib(s.peak_memory_bytes)
        ),
        format!("held back by: {}", s.held_back_by),
    ]
}

impl Observer for Printer {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Start {
                lines,
                first_step,
                total_steps,
            } => {
                self.total = *total_steps;
                for l in lines {
                    self.line(&format!("kiln: {l}"));
                }
                if std::io::stderr().is_terminal() {
                    let bar = ProgressBar::new(*total_steps);
                    bar.set_position(first_step.saturating_sub(1));
                    if let Ok(style) = ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} steps [{elapsed_precise}, ETA {eta_precise}] {msg}",
                    ) {
                        bar.set_style(style);
                    }
                    self.bar = Some(bar);
                }
            }
            Event::Step(m) => {
                if let Some(bar) = &self.bar {
                    bar.set_position(m.step);
                    bar.set_message(format!(
                        "loss {:.4}, {:.0} tokens/s",
                        m.loss, m.tokens_per_s
                    ));
                }
                self.line(&step_line(m, self.total));
            }
            Event::Eval { step, line } => self.line(&format!("eval  {step:>5}: {line}")),
            Event::Checkpoint { step, path } => {
                self.line(&format!("checkpoint {step}: {}", path.display()));
            }
            Event::Note(note) => self.line(&format!("kiln: {note}")),
            Event::Report(lines) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
                for l in lines {
                    println!("{l}");
                }
            }
            Event::Done(summary) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
                for l in summary_lines(summary) {
                    println!("{l}");
                }
            }
        }
    }
}
