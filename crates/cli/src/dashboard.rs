//! `--tui`: the live dashboard in the terminal. burn-train's renderer (its
//! `tui` feature: plots of each metric's recent and full history, progress,
//! time left, status) fed from kiln's own events, the same ones that become
//! the plain lines; the run directory's files are written by the run as
//! always. Nothing of burn-train's `Learner` is used.
//!
//! Ctrl-C does what it does in a plain run: burn's renderer puts the
//! terminal in raw mode, where Ctrl-C is a key press, so the terminal's
//! signal keys are turned back on once it has (see `keep_ctrl_c_a_signal`);
//! kiln's handler then stops the run with a checkpoint. The dashboard's own
//! "stop the training" (`q`, then `s`) stops it the same way.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_train::Interrupter;
use burn_train::logger::TrainingProgressLogger;
use burn_train::metric::{
    MetricAttributes, MetricDefinition, MetricEntry, MetricId, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use burn_train::renderer::tui::TuiMetricsRendererWrapper;
use burn_train::renderer::{MetricState, MetricsRenderer, MetricsRendererTraining};
use kiln_train::{EvalMetrics, Event, Observer};

use crate::progress::{self, Printer};

/// The dashboard, an [`Observer`]: it opens on the run's first step and
/// closes when the run ends, is interrupted or fails (on drop); the lines a
/// plain run prints at the end are printed after it closes.
pub(crate) struct Dashboard {
    tui: Option<TuiMetricsRendererWrapper>,
    /// burn's own "stop the training", read at each event.
    interrupter: Interrupter,
    /// kiln's Ctrl-C flag: the run stops after its step with a checkpoint.
    interrupt: Arc<AtomicBool>,
    registered: HashMap<&'static str, MetricId>,
    /// The bar of a prepare that runs before the first step.
    printer: Printer,
    /// Lines for after the dashboard: results, notes, the summary.
    after: Vec<String>,
}

impl std::fmt::Debug for Dashboard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dashboard")
            .field("open", &self.tui.is_some())
            .finish_non_exhaustive()
    }
}

impl Dashboard {
    /// A dashboard that opens at the run's first step; `interrupt` is the
    /// run's Ctrl-C flag.
    pub(crate) fn new(interrupt: Arc<AtomicBool>) -> Self {
        Self {
            tui: None,
            interrupter: Interrupter::new(),
            interrupt,
            registered: HashMap::new(),
            printer: Printer::new(),
            after: Vec::new(),
        }
    }

    /// Opens the renderer (raw mode, the alternate screen) and keeps
    /// Ctrl-C a signal.
    fn open(&mut self) -> &mut TuiMetricsRendererWrapper {
        self.tui.get_or_insert_with(|| {
            save_terminal();
            let tui = TuiMetricsRendererWrapper::new(self.interrupter.clone(), None);
            keep_ctrl_c_a_signal();
            tui
        })
    }

    /// Sends a metric's value, registering the metric the first time.
    fn metric(&mut self, valid: bool, name: &'static str, value: f64, unit: Option<&str>) {
        // Losses, the gradient norm and the loader's wait are better low.
        let higher_is_better =
            !(name.contains("loss") || name == "grad norm" || name == "data-wait");
        let id = match self.registered.get(name) {
            Some(id) => id.clone(),
            None => {
                let id = MetricId::new(Arc::new(name.to_string()));
                let definition = MetricDefinition {
                    metric_id: id.clone(),
                    name: Arc::new(name.to_string()),
                    description: None,
                    attributes: MetricAttributes::Numeric(NumericAttributes {
                        unit: unit.map(String::from),
                        higher_is_better,
                    }),
                };
                self.open().register_metric(definition);
                self.registered.insert(name, id.clone());
                id
            }
        };
        let text = format_value(name, value, unit);
        let entry = MetricEntry::new(id, SerializedEntry::new(text, value.to_string()));
        let state = MetricState::Numeric(entry, Some(NumericEntry::Value(value)));
        let tui = self.open();
        if valid {
            tui.update_valid(state);
        } else {
            tui.update_train(state);
        }
    }

    /// The run's Ctrl-C flag, set when burn's "stop the training" was chosen.
    fn forward_stop(&self) {
        if self.interrupter.should_stop() {
            self.interrupt.store(true, Ordering::SeqCst);
        }
    }

    /// Closes the dashboard and prints what waited for it.
    fn close(&mut self) {
        // Dropping the renderer joins its thread, which leaves the
        // alternate screen and raw mode.
        if let Some(tui) = self.tui.take() {
            drop(tui);
            forget_terminal();
        }
        for line in self.after.drain(..) {
            println!("{line}");
        }
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        self.close();
    }
}

/// A value as the dashboard's text panel shows it.
fn format_value(name: &str, value: f64, unit: Option<&str>) -> String {
    match (name, unit) {
        ("learning rate", _) => format!("{value:.3e}"),
        ("tokens/s", _) => format!("{value:.0}"),
        (_, Some(unit)) => format!("{value:.1} {unit}"),
        _ => format!("{value:.4}"),
    }
}

impl Observer for Dashboard {
    fn event(&mut self, event: &Event) {
        self.forward_stop();
        match event {
            Event::Prepare(_) => self.printer.event(event),
            Event::Start {
                lines,
                first_step,
                total_steps,
                fold,
            } => {
                self.printer.finish_prepare();
                // The setup lines stay on the terminal's main screen, above
                // where the dashboard's alternate screen opens.
                // A later fold's are printed after it closes.
                let lines = self.printer.start_lines(lines, *fold).into_iter();
                if self.tui.is_none() {
                    lines.for_each(|l| println!("{l}"));
                } else {
                    self.after.extend(lines);
                }
                let (part, parts) = fold.unwrap_or((1, 1));
                // burn's status panel counts "Epochs" and "Items": kiln's
                // are a cross-validation's folds and optimizer steps.
                let label = match fold {
                    Some((k, n)) => {
                        format!("kiln · fold {k} of {n} · Epochs: folds, Items: optimizer steps")
                    }
                    None => "kiln · Items: optimizer steps".to_string(),
                };
                let total = usize::try_from(*total_steps).unwrap_or(usize::MAX);
                let done = usize::try_from(first_step.saturating_sub(1)).unwrap_or(0);
                let tui = self.open();
                tui.start(parts, part, Some(total), Some(&label));
                tui.start_split("train", total);
                tui.update_split(done);
            }
            Event::Step(m) => {
                self.metric(false, "loss", m.loss, None);
                self.metric(false, "learning rate", m.lr, None);
                self.metric(false, "grad norm", m.grad_norm, None);
                self.metric(false, "tokens/s", m.tokens_per_s, None);
                if let Some(mfu) = m.mfu {
                    self.metric(false, "MFU", mfu * 100.0, Some("%"));
                }
                self.metric(false, "data-wait", m.data_wait_pct, Some("%"));
                let step = usize::try_from(m.step).unwrap_or(usize::MAX);
                self.open().update_split(step);
            }
            Event::Eval(e) => {
                match &e.metrics {
                    EvalMetrics::Lm {
                        train_loss,
                        val_loss,
                    } => {
                        self.metric(true, "val loss", *val_loss, None);
                        self.metric(true, "eval train loss", *train_loss, None);
                    }
                    EvalMetrics::Nli { val_loss, scores } => {
                        self.metric(true, "val loss", *val_loss, None);
                        self.metric(true, "accuracy", 100.0 * scores.accuracy, Some("%"));
                        self.metric(true, "macro-F1", scores.macro_f1, None);
                    }
                }
                self.open().log_event_training("evaluations".to_string());
            }
            Event::Checkpoint { .. } => self.open().log_event_training("checkpoints".to_string()),
            Event::Skipped { record, .. } => {
                self.open().log_event_training("skipped steps".to_string());
                self.after.push(format!(
                    "kiln: step {} skipped: {}",
                    record.step, record.why
                ));
            }
            Event::EarlyStopped { step, evaluations } => self.after.push(format!(
                "kiln: early stop at step {step}: no better score in {}",
                kiln_train::counted(*evaluations, "evaluation")
            )),
            Event::Note(note) => self.after.push(format!("kiln: {note}")),
            Event::FoldDone(result) => self.after.extend(progress::fold_lines(result)),
            Event::CvDone(summary) => {
                self.after.extend(progress::cv_summary_lines(summary));
                self.close();
            }
            Event::Done(summary) => {
                self.after.extend(progress::summary_lines(summary));
                self.close();
            }
        }
    }
}

/// The terminal's settings from before the dashboard opened, while it is
/// open: a second Ctrl-C ends the process at once, with no destructor to
/// leave raw mode and the alternate screen, so its handler puts them back
/// (`restore_terminal`).
#[cfg(unix)]
static SAVED: std::sync::Mutex<Option<libc::termios>> = std::sync::Mutex::new(None);

/// The terminal crossterm uses: standard input if it is one, else the
/// controlling terminal (kept open in `tty`); `None` without one.
#[cfg(unix)]
fn terminal_fd(tty: &mut Option<std::fs::File>) -> Option<i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: isatty only reads the descriptor's state.
    if unsafe { libc::isatty(libc::STDIN_FILENO) } == 1 {
        return Some(libc::STDIN_FILENO);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .ok()?;
    Some(tty.insert(file).as_raw_fd())
}

fn save_terminal() {
    #[cfg(unix)]
    {
        let mut tty = None;
        let Some(fd) = terminal_fd(&mut tty) else {
            return;
        };
        // SAFETY: termios is plain data, filled in by tcgetattr before it is
        // kept; fd is open here.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(fd, &mut t) == 0
                && let Ok(mut saved) = SAVED.lock()
            {
                *saved = Some(t);
            }
        }
    }
}

fn forget_terminal() {
    #[cfg(unix)]
    if let Ok(mut saved) = SAVED.lock() {
        *saved = None;
    }
}

/// Puts the terminal back as it was before the dashboard opened, if it is
/// open: the settings, mouse reporting off, the main screen, the cursor.
/// For an exit that skips the renderer's own clean-up (a second Ctrl-C).
pub(crate) fn restore_terminal() {
    #[cfg(unix)]
    {
        use std::io::Write;
        let Some(t) = SAVED.lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        let mut tty = None;
        if let Some(fd) = terminal_fd(&mut tty) {
            // SAFETY: t came from tcgetattr on this terminal; fd is open.
            unsafe {
                libc::tcsetattr(fd, libc::TCSANOW, &t);
            }
        }
        // crossterm's EnableMouseCapture modes, the alternate screen, the cursor.
        let mut out = std::io::stdout();
        let _ = out.write_all(
            b"\x1b[?1006l\x1b[?1015l\x1b[?1003l\x1b[?1002l\x1b[?1000l\x1b[?1049l\x1b[?25h",
        );
        let _ = out.flush();
    }
}

/// crossterm's raw mode, which burn's renderer enters on its own thread as
/// it starts, turns off the terminal's signal keys: Ctrl-C would be a key
/// press the dashboard ignores. Waits (up to 2 s) for raw mode, then turns
/// the signal keys back on, so that Ctrl-C is SIGINT for kiln's handler as
/// in a plain run. Leaving raw mode restores the terminal's saved settings.
fn keep_ctrl_c_a_signal() {
    #[cfg(unix)]
    {
        let mut tty = None;
        let Some(fd) = terminal_fd(&mut tty) else {
            return;
        };
        for _ in 0..200 {
            // SAFETY: termios is plain data, filled in by tcgetattr before
            // it is read; fd is open for the whole loop.
            unsafe {
                let mut t: libc::termios = std::mem::zeroed();
                if libc::tcgetattr(fd, &mut t) == 0 && t.c_lflag & libc::ICANON == 0 {
                    t.c_lflag |= libc::ISIG;
                    libc::tcsetattr(fd, libc::TCSANOW, &t);
                    return;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
