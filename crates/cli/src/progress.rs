//! Printing a run as it goes: an indicatif bar with ETA on a terminal, plain
//! lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_train::{
    CvSummary, EvalMetrics, EvalRecord, Event, FoldResult, Observer, Scores, StepMetrics, Summary,
};

/// Prints events; the bar exists only when stderr is a terminal.
pub(crate) struct Printer {
    bar: Option<ProgressBar>,
    total: u64,
    /// The setup lines an earlier fold's start printed.
    shown: Vec<String>,
}

impl Printer {
    pub(crate) fn new() -> Self {
        Self {
            bar: None,
            total: 0,
            shown: Vec::new(),
        }
    }

    /// The setup lines of a start to print, each as `kiln: …`: all of them
    /// for a run or the first fold; for a later fold of a cross-validation,
    /// those an earlier fold did not print (its size, vocabulary, steps),
    /// the rest (model, device, loader) counted in one line.
    pub(crate) fn start_lines(
        &mut self,
        lines: &[String],
        fold: Option<(usize, usize)>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let mut same = 0;
        for l in lines {
            if fold.is_some() && self.shown.contains(l) {
                same += 1;
            } else {
                out.push(format!("kiln: {l}"));
                self.shown.push(l.clone());
            }
        }
        if same > 0 {
            out.push(format!(
                "kiln: {} as above, not repeated",
                kiln_train::counted(same, "setup line")
            ));
        }
        out
    }

    /// Result lines, printed to stdout as they are, after the bar.
    fn report(&mut self, lines: &[String]) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        for l in lines {
            println!("{l}");
        }
    }

    /// A prepare's bar: MB read of the total, MB/s, tokens, time left; on a
    /// pipe, a line every 10 % of the input.
    fn prepare_progress(&mut self, p: &kiln_train::PrepareProgress) {
        let total = p.total_bytes.max(1);
        if self.bar.is_none() && std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "preparing {bar:30} {bytes}/{total_bytes} {bytes_per_sec} | {msg} | {eta} left",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            self.bar = Some(bar);
        }
        let msg = format!(
            "{} tokens, {}{}",
            p.tokens,
            kiln_train::counted(p.documents, "document"),
            if p.skipping {
                " (skipping what was written)"
            } else {
                ""
            }
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(p.read_bytes.min(total));
                bar.set_message(msg);
            }
            None => {
                let tenth = p.read_bytes * 10 / total;
                if tenth > self.total {
                    self.total = tenth;
                    eprintln!(
                        "preparing: {:.1}/{:.1} MB read, {msg}",
                        p.read_bytes as f64 / 1e6,
                        total as f64 / 1e6
                    );
                }
            }
        }
    }

    /// Clears a prepare's bar.
    pub(crate) fn finish_prepare(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.total = 0;
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
    let comm = m
        .comm_pct
        .map_or(String::new(), |c| format!(" | comm {c:.1}%"));
    // A GPU run's memory is its allocator's on the GPU, not the process's RAM.
    let gpu = if m.device_memory { " on the GPU" } else { "" };
    format!(
        "step {:>5}/{total} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {:.1} ms/step | {:.0} tokens/s | {:.1} samples/s | {mfu} | data-wait {:.1}%{comm} | mem {} (peak {}){gpu}",
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
            "done: {} steps, {} tokens in {:.1} s; train loss {}, val loss {} (best {}{})",
            s.steps,
            s.tokens_seen,
            s.wall_s,
            loss(s.final_train_loss),
            loss(s.final_val_loss),
            loss(s.best_val_loss),
            s.best_step
                .map_or(String::new(), |step| format!(" at step {step}"))
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
            "data-wait: {:.2}% of step time{}; peak memory {}{}",
            s.data_wait_pct,
            s.comm_pct.map_or(String::new(), |c| format!(
                "; communication between the ranks {c:.1}%"
            )),
            mib(s.peak_memory_bytes),
            if s.peak_memory_on_gpu {
                " on the GPU"
            } else {
                ""
            }
        ),
        format!("held back by: {}", s.held_back_by),
    ]
}

/// An evaluation in one line.
fn eval_text(e: &EvalRecord) -> String {
    match &e.metrics {
        EvalMetrics::Lm {
            train_loss,
            val_loss,
        } => format!("train loss {train_loss:.4}, val loss {val_loss:.4}"),
        EvalMetrics::Nli { val_loss, scores } => format!(
            "val loss {val_loss:.4}, accuracy {:.1}%, macro-F1 {:.3}",
            100.0 * scores.accuracy,
            scores.macro_f1
        ),
    }
}

pub(crate) fn fold_lines(r: &FoldResult) -> Vec<String> {
    let mut lines = vec![format!(
        "fold {} result (best at step {}{}): accuracy {:.1}%, macro-F1 {:.3}, val loss {:.4}; majority baseline {:.1}%",
        r.fold,
        r.best_step,
        if r.stopped_early {
            ", stopped early"
        } else {
            ""
        },
        100.0 * r.scores.accuracy,
        r.scores.macro_f1,
        r.val_loss,
        100.0 * r.majority_baseline
    )];
    lines.extend(per_class_lines(&r.scores));
    lines
}

/// Each label's precision, recall, F1 and support.
pub(crate) fn per_class_lines(scores: &Scores) -> Vec<String> {
    scores
        .per_class
        .iter()
        .map(|c| {
            format!(
                "  {:<14} precision {:.3}  recall {:.3}  F1 {:.3}  ({})",
                c.label,
                c.precision,
                c.recall,
                c.f1,
                kiln_train::counted(c.support, "pair")
            )
        })
        .collect()
}

/// The per-fold table and the mean ± std.
pub(crate) fn cv_summary_lines(s: &CvSummary) -> Vec<String> {
    let mut lines = vec![
        format!(
            "cross-validation over {} ({} skipped):",
            kiln_train::counted(s.pairs, "pair"),
            kiln_train::counted(s.skipped_rows, "row")
        ),
        "  fold | accuracy | macro-F1 | majority baseline | best step".to_string(),
    ];
    for f in &s.folds {
        lines.push(format!(
            "  {:>4} | {:>7.1}% | {:>8.3} | {:>16.1}% | {:>9}",
            f.fold,
            100.0 * f.scores.accuracy,
            f.scores.macro_f1,
            100.0 * f.majority_baseline,
            f.best_step
        ));
    }
    lines.push(format!(
        "  mean | {:.1}% ± {:.1} | {:.3} ± {:.3} | {:.1}%",
        100.0 * s.accuracy_mean,
        100.0 * s.accuracy_std,
        s.macro_f1_mean,
        s.macro_f1_std,
        100.0 * s.majority_baseline_mean
    ));
    lines.push(format!(
        "throughput: median {:.1} pairs/s; wall time {:.0} s",
        s.median_samples_per_s, s.wall_s
    ));
    lines
}

impl Observer for Printer {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Start {
                lines,
                first_step,
                total_steps,
                fold,
            } => {
                self.finish_prepare();
                self.total = *total_steps;
                for l in self.start_lines(lines, *fold) {
                    self.line(&l);
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
            Event::Eval(e) => self.line(&format!("eval  {:>5}: {}", e.step, eval_text(e))),
            Event::Skipped {
                record: r,
                max_bad_steps,
            } => {
                let text = match (r.loss_scale, r.overflows, r.in_a_row) {
                    (Some(to), Some(overflows), _) => format!(
                        "step {}: fp16 gradients overflowed at loss scale {}: step skipped, scale halved to {to} ({overflows} overflows so far)",
                        r.step,
                        to * 2.0
                    ),
                    (_, _, in_a_row) => format!(
                        "step {}: {}: step skipped, no update ({} in a row; precision.max_bad_steps = {max_bad_steps})",
                        r.step,
                        r.why,
                        in_a_row.unwrap_or(1)
                    ),
                };
                self.line(&format!("kiln: {text}"));
            }
            Event::EarlyStopped { step, evaluations } => self.line(&format!(
                "kiln: early stop at step {step}: no better score in {}",
                kiln_train::counted(*evaluations, "evaluation")
            )),
            Event::Checkpoint { step, path } => {
                self.line(&format!("checkpoint {step}: {}", path.display()));
            }
            Event::Note(note) => self.line(&format!("kiln: {note}")),
            Event::Prepare(p) => self.prepare_progress(p),
            Event::FoldDone(result) => self.report(&fold_lines(result)),
            Event::CvDone(summary) => self.report(&cv_summary_lines(summary)),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One pair is "1 pair", in the per-label lines too.
    #[test]
    fn counts_of_pairs_agree_with_their_number() {
        for (n, words) in [(1, "1 pair"), (0, "0 pairs"), (180, "180 pairs")] {
            assert_eq!(kiln_train::counted(n, "pair"), words);
        }
        let labels = ["yes".to_string(), "no".to_string()];
        let lines = per_class_lines(&Scores::new(&labels, &[0, 1, 1], &[0, 1, 0]));
        assert!(lines[0].ends_with("(1 pair)"), "{lines:?}");
        assert!(lines[1].ends_with("(2 pairs)"), "{lines:?}");
    }
}
