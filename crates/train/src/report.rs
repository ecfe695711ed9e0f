//! What a run reports: events for the CLI to print, the metrics written to
//! `metrics.jsonl`, the summary, and the SVG plots.

use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::records::{CvSummary, EvalRecord, FoldResult, Skipped, StepMetrics};

/// A language-model evaluation, for the loss plot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LmEval {
    pub(crate) step: u64,
    pub(crate) train_loss: f64,
    pub(crate) val_loss: f64,
}

/// The end of a run, also written as `summary.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Summary {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Tokens trained on (padding not counted).
    pub tokens_seen: u64,
    /// The last evaluation's training loss (lm).
    pub final_train_loss: Option<f64>,
    /// The last evaluation's validation loss.
    pub final_val_loss: Option<f64>,
    /// The best validation loss of the run.
    pub best_val_loss: Option<f64>,
    /// The step of the best validation loss: the model `best.safetensors`
    /// holds.
    #[serde(default)]
    pub best_step: Option<u64>,
    /// Median training throughput, tokens per second.
    pub median_tokens_per_s: f64,
    /// Median milliseconds per optimizer step.
    pub median_ms_per_step: f64,
    /// Median MFU (`None`: the device's peak is unknown).
    pub median_mfu: Option<f64>,
    /// What the MFU is measured against.
    pub mfu_peak: String,
    /// Share of step time spent waiting for the loader, in percent.
    pub data_wait_pct: f64,
    /// In a data-parallel job: the median share of step time spent in the
    /// gradients' all-reduce, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_pct: Option<f64>,
    /// Peak memory: on a GPU (`peak_memory_on_gpu`) the most CubeCL's
    /// allocator held there, else the process's resident set.
    pub peak_memory_bytes: u64,
    /// Whether `peak_memory_bytes` is the GPU's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peak_memory_on_gpu: bool,
    /// Seconds from start to end, evaluation and checkpoints included.
    pub wall_s: f64,
    /// One line: what held the run back, from the measures.
    pub held_back_by: String,
}

/// What a run tells whoever drives it.
#[derive(Clone, Debug)]
pub enum Event {
    /// Lines saying what is enabled and why, before the first step.
    Start {
        /// Those lines.
        lines: Vec<String>,
        /// The step the run starts from (0, or a resumed run's).
        first_step: u64,
        /// The steps the run makes in all.
        total_steps: u64,
        /// A cross-validation's fold, from 1, and its number of folds
        /// (`None` for a run that is not a fold).
        fold: Option<(usize, usize)>,
    },
    /// A logged step.
    Step(StepMetrics),
    /// An evaluation.
    Eval(EvalRecord),
    /// A step whose update was skipped (fp16 overflow, or not finite).
    Skipped {
        /// The record written to `metrics.jsonl`.
        record: Skipped,
        /// `precision.max_bad_steps`: the run stops at that many in a row.
        max_bad_steps: usize,
    },
    /// The run stopped early: no better score in `evaluations` evaluations.
    EarlyStopped {
        /// The step it stopped at.
        step: u64,
        /// Evaluations since the best one (`cv.patience` reached).
        evaluations: usize,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Its step.
        step: u64,
        /// Its file.
        path: std::path::PathBuf,
    },
    /// Something the user should know (a damaged checkpoint skipped, ...).
    Note(String),
    /// How far preparing documents into a token store is.
    Prepare(kiln_data::PrepareProgress),
    /// A cross-validation fold finished.
    FoldDone(FoldResult),
    /// A cross-validation run finished all its folds.
    CvDone(CvSummary),
    /// The run finished.
    Done(Summary),
}

/// Receives a run's events (the CLI prints them).
pub trait Observer {
    /// Called for each event, on the training thread.
    fn event(&mut self, event: &Event);
}

/// An observer that ignores every event.
#[derive(Debug, Default)]
pub struct Silent;

impl Observer for Silent {
    fn event(&mut self, _: &Event) {}
}

/// The median of some values (0 for none).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// The verdict on what held the run back. `memory_total` is what
/// `peak_memory` is measured against: the GPU's memory where the peak is
/// its allocator's (`on_gpu`), else the machine's RAM.
pub(crate) fn held_back_by(
    data_wait_pct: f64,
    (peak_memory, memory_total, on_gpu): (u64, u64, bool),
    mfu: Option<f64>,
    comm_pct: Option<f64>,
) -> String {
    if data_wait_pct > 10.0 {
        return format!(
            "data: the step waited for the loader {data_wait_pct:.1} % of the time; raise loader.num_workers or loader.prefetch_factor"
        );
    }
    if memory_total > 0 && peak_memory as f64 > 0.9 * memory_total as f64 {
        return format!(
            "memory: the peak ({:.1} GiB) is over 90 % of the {:.1} GiB {}; lower training.batch_size, then model.max_length",
            peak_memory as f64 / f64::from(1u32 << 30),
            memory_total as f64 / f64::from(1u32 << 30),
            if on_gpu { "the GPU has" } else { "there is" }
        );
    }
    if let Some(c) = comm_pct.filter(|&c| c > 30.0) {
        return format!(
            "communication: the gradients' all-reduce took {c:.1} % of the step; raise training.gradient_accumulation_steps (one reduction per optimizer step) and lower training.batch_size to keep the global batch"
        );
    }
    match mfu {
        Some(m) => format!(
            "compute: the loader kept up ({data_wait_pct:.1} % wait) and memory is ample; the device ran at {:.1} % MFU, so speed now depends on the kernels",
            m * 100.0
        ),
        None => {
            format!("compute: the loader kept up ({data_wait_pct:.1} % wait) and memory is ample")
        }
    }
}

/// A white SVG chart over optimizer steps `0..last`, with its caption, mesh
/// and y axis (`y_label_area` pixels wide for the labels).
fn step_chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    caption: &str,
    y_desc: &str,
    y_label_area: u32,
    last: u64,
    y: std::ops::Range<f64>,
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu64, RangedCoordf64>>, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(y_label_area)
        .build_cartesian_2d(0u64..last, y)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    Ok(chart)
}

/// Writes `loss.svg` (training loss per logged step, evaluation losses) and
/// `throughput.svg` (tokens/s per logged step) into `dir`.
pub(crate) fn write_plots(
    dir: &Path,
    steps: &[StepMetrics],
    evals: &[LmEval],
) -> Result<(), String> {
    if steps.is_empty() {
        return Ok(());
    }
    let last = steps.iter().map(|s| s.step).max().unwrap_or(1).max(1);
    let losses = steps
        .iter()
        .map(|s| s.loss)
        .chain(evals.iter().flat_map(|e| [e.train_loss, e.val_loss]))
        .filter(|l| l.is_finite());
    let (lo, hi) = losses.fold((f64::MAX, f64::MIN), |(a, b), l| (a.min(l), b.max(l)));
    let (lo, hi) = if lo < hi {
        (lo, hi)
    } else if lo == hi {
        (lo - 1.0, lo + 1.0)
    } else {
        // No finite loss at all (a run that diverged at once).
        (0.0, 1.0)
    };
    let err = |e: &dyn std::fmt::Display| e.to_string();
    // A diverged step's NaN is a gap in its curve, not a point.
    let finite = |points: Vec<(u64, f64)>| -> Vec<(u64, f64)> {
        points.into_iter().filter(|p| p.1.is_finite()).collect()
    };

    let path = dir.join("loss.svg");
    let root = SVGBackend::new(&path, (900, 540)).into_drawing_area();
    let mut chart = step_chart(
        &root,
        "loss (nats per token)",
        "loss",
        56,
        last,
        (lo * 0.95)..(hi * 1.02),
    )?;
    /// Points, style and legend label of one curve.
    type Curve<'a> = (Vec<(u64, f64)>, ShapeStyle, &'a str);
    let series: [Curve<'_>; 3] = [
        (
            finite(steps.iter().map(|s| (s.step, s.loss)).collect()),
            BLUE.mix(0.5).into(),
            "train (batch)",
        ),
        (
            finite(evals.iter().map(|e| (e.step, e.train_loss)).collect()),
            BLUE.stroke_width(2),
            "train (eval)",
        ),
        (
            finite(evals.iter().map(|e| (e.step, e.val_loss)).collect()),
            RED.stroke_width(2),
            "validation (eval)",
        ),
    ];
    for (points, style, label) in series.into_iter().filter(|s| !s.0.is_empty()) {
        chart
            .draw_series(LineSeries::new(points, style))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;

    let path = dir.join("throughput.svg");
    let top = steps
        .iter()
        .map(|s| s.tokens_per_s)
        .fold(0.0, f64::max)
        .max(1.0);
    let root = SVGBackend::new(&path, (900, 540)).into_drawing_area();
    let mut chart = step_chart(
        &root,
        "throughput (tokens/s)",
        "tokens/s",
        70,
        last,
        0.0..top * 1.1,
    )?;
    chart
        .draw_series(LineSeries::new(
            steps.iter().map(|s| (s.step, s.tokens_per_s)),
            GREEN.stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes `cv_curves.svg` (validation macro-F1 per fold over steps: the
/// `(step, score)` points of each fold's evaluations) and `confusion.svg`
/// (the folds' confusion matrices summed) into the run folder.
pub(crate) fn write_cv_plots(
    dir: &Path,
    summary: &CvSummary,
    curves: &[Vec<(u64, f64)>],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let last = curves
        .iter()
        .flatten()
        .map(|p| p.0)
        .max()
        .unwrap_or(1)
        .max(1);
    let path = dir.join("cv_curves.svg");
    let root = SVGBackend::new(&path, (900, 540)).into_drawing_area();
    let mut chart = step_chart(
        &root,
        "validation macro-F1 per fold",
        "macro-F1",
        56,
        last,
        0.0..1.0,
    )?;
    for (i, curve) in curves.iter().enumerate() {
        let color = Palette99::pick(i);
        chart
            .draw_series(LineSeries::new(
                curve.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(format!("fold {}", i + 1))
            .legend(move |(x, y)| {
                PathElement::new(
                    vec![(x, y), (x + 18, y)],
                    Palette99::pick(i).stroke_width(2),
                )
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;

    let n = summary.labels.len();
    let mut total = vec![vec![0usize; n]; n];
    for f in &summary.folds {
        for (t, row) in f.scores.confusion.iter().enumerate() {
            for (p, c) in row.iter().enumerate() {
                total[t][p] += c;
            }
        }
    }
    let max = total.iter().flatten().copied().max().unwrap_or(1).max(1) as f64;
    let path = dir.join("confusion.svg");
    let cell = 120i32;
    let (w, h) = (160 + cell * n as i32 + 20, 80 + cell * n as i32 + 60);
    let root = SVGBackend::new(&path, (w as u32, h as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let style = ("sans-serif", 16).into_font();
    root.draw(&Text::new(
        "confusion (rows: true, columns: predicted), all folds",
        (10, 10),
        style.clone(),
    ))
    .map_err(|e| err(&e))?;
    for (t, row) in total.iter().enumerate() {
        let y = 60 + cell * t as i32;
        root.draw(&Text::new(
            summary.labels[t].clone(),
            (10, y + cell / 2),
            style.clone(),
        ))
        .map_err(|e| err(&e))?;
        for (p, &c) in row.iter().enumerate() {
            let x = 160 + cell * p as i32;
            let shade = 1.0 - 0.8 * c as f64 / max;
            let color = RGBColor((255.0 * shade) as u8, (255.0 * shade) as u8, 255);
            root.draw(&Rectangle::new(
                [(x, y), (x + cell - 2, y + cell - 2)],
                color.filled(),
            ))
            .map_err(|e| err(&e))?;
            root.draw(&Text::new(
                c.to_string(),
                (x + cell / 3, y + cell / 2),
                style.clone(),
            ))
            .map_err(|e| err(&e))?;
        }
    }
    for (p, label) in summary.labels.iter().enumerate() {
        root.draw(&Text::new(
            label.clone(),
            (160 + cell * p as i32 + 10, 60 + cell * n as i32 + 10),
            style.clone(),
        ))
        .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn the_verdict_names_the_bottleneck() {
        let host = |peak| (peak, 100, false);
        assert!(held_back_by(25.0, host(1), Some(0.3), None).starts_with("data"));
        assert!(held_back_by(1.0, host(95), Some(0.3), None).starts_with("memory"));
        assert!(held_back_by(1.0, host(10), Some(0.3), None).starts_with("compute"));
        assert!(held_back_by(1.0, host(10), Some(0.3), Some(45.0)).starts_with("communication"));
        assert!(held_back_by(1.0, host(10), Some(0.3), Some(5.0)).starts_with("compute"));
        // A GPU's peak is the GPU's, against the GPU's memory.
        assert!(held_back_by(1.0, (95, 100, true), None, None).contains("the GPU has"));
    }

    #[test]
    fn plots_are_svg_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let steps: Vec<StepMetrics> = (1..=20)
            .map(|i| StepMetrics {
                step: i,
                loss: 4.0 - f64::from(i as u32) * 0.1,
                lr: 1e-3,
                grad_norm: 1.0,
                ms_per_step: 10.0,
                tokens_per_s: 1000.0 + f64::from(i as u32),
                samples_per_s: 10.0,
                mfu: Some(0.1),
                data_wait_pct: 0.5,
                comm_pct: None,
                memory_bytes: 1,
                peak_memory_bytes: 1,
                device_memory: false,
                tokens_seen: u64::from(i as u32) * 10,
            })
            .collect();
        let evals = vec![LmEval {
            step: 10,
            train_loss: 3.0,
            val_loss: 3.2,
        }];
        write_plots(dir.path(), &steps, &evals).expect("plots");
        for name in ["loss.svg", "throughput.svg"] {
            let text = std::fs::read_to_string(dir.path().join(name)).expect("written");
            assert!(
                text.starts_with("<svg") && text.contains("<polyline"),
                "{name}"
            );
        }
    }
}
