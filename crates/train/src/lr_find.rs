//! `kiln lr-find`: Lightning's learning-rate finder (`Tuner.lr_find`, after
//! Leslie Smith's range test and fastai's `lr_find`). From the run's
//! starting point, each optimizer step takes a larger rate, geometrically
//! from `min_lr` to `max_lr`; the loss is smoothed as Lightning smooths it
//! (an exponential average with β = 0.98, bias-corrected) and the test stops
//! once it passes 4 times its best. The suggestion is where the smoothed
//! loss falls fastest against the logarithm of the rate (the steepest
//! negative gradient, the first 10 points and the last left out): Lightning
//! 1.x's rule (NumPy's gradient over the geometric steps) and fastai's
//! `steep`, searched up to the lowest smoothed loss (as fastai's `valley`
//! does): a fall after it is noise on the way to divergence, and a loss
//! that never fell below its start gives no suggestion. Lightning 2.6
//! takes the gradient against the rate itself, which divides the flat
//! start's noise by its tiny steps (on the tests' model it suggested
//! 1.1e-7); see docs/TRAINING.md.

use std::path::Path;

use kiln_config::{RunConfig, Workload};
use kiln_hwdetect::HardwareReport;
use plotters::prelude::*;
use serde::Serialize;

use crate::bench::{lm_model, nli_first_fold};
use crate::optim::AdamW;
use crate::precision::LossScaler;
use crate::setup::{run_precision, train_device};
use crate::step::{StepState, Untimed, train_step};
use crate::task::Task;
use crate::workload::lm;
use crate::{TrainError, open_device};

/// The range test's settings.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LrFindOptions {
    /// The first step's rate.
    pub min_lr: f64,
    /// The last step's rate.
    pub max_lr: f64,
    /// Optimizer steps from `min_lr` to `max_lr`.
    pub steps: usize,
}

impl LrFindOptions {
    /// A test from `min_lr` to `max_lr` in `steps` optimizer steps
    /// (Lightning's defaults: 1e-8, 1 and 100, `kiln lr-find`'s too).
    pub fn new(min_lr: f64, max_lr: f64, steps: usize) -> Self {
        Self {
            min_lr,
            max_lr,
            steps,
        }
    }
}

/// One step of the test.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LrPoint {
    /// The step's rate.
    pub lr: f64,
    /// The step's loss (the mean over its micro-batches).
    pub loss: f64,
    /// The smoothed loss.
    pub smoothed: f64,
}

/// What [`lr_find`] measured.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct LrFind {
    /// `lm` or `nli`.
    pub workload: String,
    /// The device it ran on.
    pub device: String,
    /// Each step, in order.
    pub points: Vec<LrPoint>,
    /// Whether the loss diverged (4 times its best, or not finite) before
    /// `max_lr`.
    pub diverged: bool,
    /// The rate where the smoothed loss fell fastest against log(rate)
    /// before its lowest point (Lightning 1.x's suggestion, fastai's
    /// `steep`, within fastai's `valley`); `None` with too few steps, or
    /// where the loss never fell (`fell`).
    pub suggestion: Option<f64>,
    /// The rate of the lowest smoothed loss.
    pub min_loss_lr: f64,
    /// Whether the smoothed loss reached its lowest after the first steps
    /// the suggestion leaves out (10): false where no rate of the range
    /// lowered it, a loss too noisy at this batch or too few steps.
    pub fell: bool,
}

/// Runs the range test on the model and data `config` describes (a
/// sentence-pair run's first fold), from its initial weights: drawn, or
/// `model.init_from`'s (a fine-tune's rate is found from the model it
/// fine-tunes).
pub fn lr_find(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: LrFindOptions,
) -> Result<LrFind, TrainError> {
    if !(options.min_lr > 0.0 && options.min_lr < options.max_lr && options.max_lr.is_finite()) {
        return Err(TrainError::Unsupported(
            "this learning-rate range",
            format!(
                "{} to {}: the range test needs 0 < --min-lr < --max-lr",
                options.min_lr, options.max_lr
            ),
        ));
    }
    if options.steps < 2 {
        return Err(TrainError::Unsupported(
            "this many steps",
            format!("{}: the range test needs at least 2", options.steps),
        ));
    }
    let choice = open_device(config, hardware.gpu_vendor())?;
    let device = train_device(config, &choice.device, config.training.seed);
    let precision = run_precision(config, &choice, hardware);
    crate::setup::check_attention_choice(config, &choice, &precision)?;
    let scaler = precision
        .loss_scaling()
        .then(|| LossScaler::from_config(&config.precision));
    let points = match config.workload {
        Workload::Lm => {
            let prepared = lm::prepare(config, lm::TokenizerFrom::Config)?;
            let task = prepared.shared_task(config, &choice.device, 0, 1)?;
            let model = lm_model(config, &prepared, &device, &precision, true)?;
            range_test(&task, model, &device, config, options, scaler)?
        }
        Workload::Nli => {
            let (_, model, task) =
                nli_first_fold(config, &choice, &device, &precision, (None, true), (0, 1))?;
            range_test(&task, model, &device, config, options, scaler)?
        }
    };
    let diverged = points.len() < options.steps;
    let (suggested, lowest) = suggest(&points);
    let min_loss_lr = points.get(lowest).map_or(options.min_lr, |p| p.lr);
    Ok(LrFind {
        workload: match config.workload {
            Workload::Lm => "lm".into(),
            Workload::Nli => "nli".into(),
        },
        device: choice.name,
        suggestion: suggested.map(|i| points[i].lr),
        fell: lowest >= SKIP_BEGIN,
        points,
        diverged,
        min_loss_lr,
    })
}

/// The rate of step `i` of `steps` from `min` to `max`, geometrically.
fn rate(min: f64, max: f64, i: usize, steps: usize) -> f64 {
    min * (max / min).powf(i as f64 / (steps - 1) as f64)
}

/// Lightning's smoothing factor and divergence threshold.
const BETA: f64 = 0.98;
const DIVERGED: f64 = 4.0;

/// The steps of the test: each at its rate, until `max_lr` or divergence.
fn range_test<T: Task>(
    task: &T,
    mut model: T::Model,
    device: &burn::tensor::Device,
    config: &RunConfig,
    options: LrFindOptions,
    scaler: Option<LossScaler>,
) -> Result<Vec<LrPoint>, TrainError> {
    let mut loader = kiln_data::Loader::new(
        task.source(),
        0,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let mut optim = AdamW::for_run(config, &model, None);
    let mut state = StepState::new(config, scaler);
    let mut points = Vec::with_capacity(options.steps);
    let mut average = 0.0;
    let mut best = f64::INFINITY;
    for i in 0..options.steps {
        let lr = rate(options.min_lr, options.max_lr, i, options.steps);
        let (stepped, report) = train_step(
            task,
            model,
            &mut optim,
            &mut state,
            &mut loader,
            device,
            lr,
            &config.training,
            &mut Untimed,
        )?;
        model = stepped;
        let loss = f64::from(report.loss);
        if !loss.is_finite() {
            break;
        }
        average = BETA * average + (1.0 - BETA) * loss;
        let smoothed = average / (1.0 - BETA.powi(i as i32 + 1));
        points.push(LrPoint { lr, loss, smoothed });
        if smoothed > DIVERGED * best {
            break;
        }
        best = best.min(smoothed);
    }
    Ok(points)
}

/// The first points the suggestion leaves out, as Lightning does.
const SKIP_BEGIN: usize = 10;

/// The suggested point of a range test (the steepest fall of the smoothed
/// loss against log(rate), up to its lowest point: a fall after it is not a
/// rate to train at) and the lowest point's index.
fn suggest(points: &[LrPoint]) -> (Option<usize>, usize) {
    let lowest = (0..points.len())
        .min_by(|&a, &b| points[a].smoothed.total_cmp(&points[b].smoothed))
        .unwrap_or(0);
    let smoothed: Vec<(f64, f64)> = points[..points.len().min(lowest + 1)]
        .iter()
        .map(|p| (p.lr.ln(), p.smoothed))
        .collect();
    (steepest(&smoothed), lowest)
}

/// The index of the steepest fall of `(x, loss)` points against `x`
/// (`torch.gradient` with `x` as the coordinates: second-order central
/// differences for unequal steps, one-sided at the ends), the first 10 and
/// the last point left out, as Lightning leaves them; `None` with fewer
/// than 2 between. `x` is log(rate) for the suggestion (equal steps).
fn steepest(points: &[(f64, f64)]) -> Option<usize> {
    const SKIP_END: usize = 1;
    let kept = points.get(SKIP_BEGIN..points.len().checked_sub(SKIP_END)?)?;
    let n = kept.len();
    if n < 2 {
        return None;
    }
    let (x, f) = (|i: usize| kept[i].0, |i: usize| kept[i].1);
    let gradient = |i: usize| match i {
        0 => (f(1) - f(0)) / (x(1) - x(0)),
        i if i == n - 1 => (f(n - 1) - f(n - 2)) / (x(n - 1) - x(n - 2)),
        i => {
            let (hl, hr) = (x(i) - x(i - 1), x(i + 1) - x(i));
            (hl * hl * f(i + 1) - hr * hr * f(i - 1) + (hr * hr - hl * hl) * f(i))
                / (hr * hl * hl + hr * hr * hl)
        }
    };
    (0..n)
        .min_by(|&a, &b| gradient(a).total_cmp(&gradient(b)))
        .map(|i| i + SKIP_BEGIN)
}

/// Writes the loss against the rate (log scale), the suggestion marked, as
/// an SVG at `path`.
pub fn write_lr_plot(found: &LrFind, path: &Path) -> Result<(), TrainError> {
    let err = |e: &dyn std::fmt::Display| TrainError::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    };
    let points = &found.points;
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return Ok(());
    };
    let (lo, hi) = points
        .iter()
        .flat_map(|p| [p.loss, p.smoothed])
        .fold((f64::MAX, f64::MIN), |(a, b), l| (a.min(l), b.max(l)));
    crate::rundir::create_parent("--plot", path)?;
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("learning-rate range test", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (first.lr..last.lr.max(first.lr * 1.01)).log_scale(),
            (lo * 0.95)..(hi * 1.02).max(lo * 0.95 + 1e-6),
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("learning rate")
        .y_desc("loss")
        .x_label_formatter(&|v| format!("{v:.0e}"))
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            points.iter().map(|p| (p.lr, p.loss)),
            BLUE.mix(0.4),
        ))
        .map_err(|e| err(&e))?
        .label("loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.mix(0.4)));
    chart
        .draw_series(LineSeries::new(
            points.iter().map(|p| (p.lr, p.smoothed)),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("smoothed")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
    if let Some(lr) = found.suggestion
        && let Some(p) = points.iter().find(|p| p.lr == lr)
    {
        chart
            .draw_series([Circle::new((p.lr, p.smoothed), 6, RED.filled())])
            .map_err(|e| err(&e))?
            .label(format!("suggestion {lr:.2e}"))
            .legend(|(x, y)| Circle::new((x + 9, y), 5, RED.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_rise_geometrically_from_the_first_to_the_last() {
        let lrs: Vec<f64> = (0..5).map(|i| rate(1e-4, 1.0, i, 5)).collect();
        let expected = [1e-4, 1e-3, 1e-2, 1e-1, 1.0];
        for (a, b) in lrs.iter().zip(expected) {
            assert!((a / b - 1.0).abs() < 1e-12, "{lrs:?}");
        }
    }

    #[test]
    fn the_suggestion_is_the_steepest_fall_against_the_rate_after_the_first_ten_points() {
        // Equal steps in the rate: the steepest central difference.
        let even = |losses: &[f64]| -> Vec<(f64, f64)> {
            losses
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as f64, l))
                .collect()
        };
        let mut losses = vec![5.0; 12];
        losses.extend([4.9, 4.7, 4.0, 3.0, 2.8, 2.7, 2.9, 4.0]);
        // Around point 14: (3.0 - 4.7) / 2, the steepest.
        assert_eq!(steepest(&even(&losses)), Some(14));
        // A fall in the first ten points is left out, as Lightning does.
        let mut early = vec![9.0, 1.0];
        early.extend(vec![1.0; 10]);
        early.extend([0.9, 0.8]);
        assert_eq!(steepest(&even(&early)), Some(12));
        // Two points left between the skipped ones at least (torch's
        // gradient needs two; Lightning then has no suggestion).
        assert!(steepest(&even(&[1.0; 13])).is_some());
        assert_eq!(steepest(&even(&[1.0; 12])), None);
        // Unequal steps, the rates as coordinates: torch.gradient gives
        // 0, -0.1, -0.2, -0.1982, -0.0992, -0.1 for points 10 to 15 (torch
        // 2.15), so point 12; by the index alone (-0.9 at point 13, the
        // fall from 4.6 to 3.0 over a step 100 long) it would be 13.
        let mut points: Vec<(f64, f64)> = (0..12).map(|i| (i as f64, 5.0)).collect();
        points.extend([
            (12.0, 4.8),
            (13.0, 4.6),
            (113.0, 3.0),
            (114.0, 2.9),
            (115.0, 2.9),
        ]);
        assert_eq!(steepest(&points), Some(12));
    }

    #[test]
    fn the_suggestion_is_looked_for_before_the_lowest_loss_and_needs_one_after_the_start() {
        let test = |smoothed: &[f64]| -> Vec<LrPoint> {
            smoothed
                .iter()
                .enumerate()
                .map(|(i, &s)| LrPoint {
                    lr: 1e-6 * 2f64.powi(i as i32),
                    loss: s,
                    smoothed: s,
                })
                .collect()
        };
        // A fall to the lowest point at 15, then a steeper fall (11 → 10)
        // on the way to divergence: the suggestion is the first fall's.
        let mut falls = vec![5.0; 12];
        falls.extend([4.9, 4.3, 4.25, 4.2, 9.0, 11.0, 10.0, 10.0, 30.0]);
        assert_eq!(suggest(&test(&falls)), (Some(12), 15));
        // Without the lowest point as the limit, the later fall would win.
        let whole: Vec<(f64, f64)> = test(&falls)
            .iter()
            .map(|p| (p.lr.ln(), p.smoothed))
            .collect();
        assert_eq!(steepest(&whole), Some(18));
        // Lowest in the first ten steps (a loss that never fell below its
        // start, noise after it): no suggestion.
        let mut flat = vec![1.10, 1.08, 1.11, 1.12];
        flat.extend([
            1.12, 1.13, 1.12, 1.14, 1.12, 1.13, 1.13, 1.12, 1.13, 1.2, 1.15,
        ]);
        let (suggestion, lowest) = suggest(&test(&flat));
        assert_eq!((suggestion, lowest), (None, 1));
    }
}
