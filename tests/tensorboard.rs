//! TensorBoard's event files, read back by TensorBoard itself: the
//! `tensorboard` Python package's `EventAccumulator`
//! (tests/data/tensorboard_check.py) compares every scalar with
//! metrics.jsonl. `TEST_PYTHON` names the Python that has the package (CI:
//! a virtual environment `.ci/run` makes); else `python3`.

use std::path::Path;
use std::process::Command;

use crate::support::{kiln, root};

/// Runs the script `tests/data/<script>` on `dir` with the Python that
/// has the `tensorboard` package, asserts it succeeded; what it printed.
fn with_tensorboard(script: &str, dir: &Path) -> String {
    let python = std::env::var_os("TEST_PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(&python)
        .arg(root().join("tests/data").join(script))
        .arg(dir)
        .output()
        .expect("run python (TEST_PYTHON or python3)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'tensorboard'"),
        "this test reads the event files with the `tensorboard` package: \
         `python3 -m venv VENV && VENV/bin/pip install tensorboard`, then TEST_PYTHON=VENV/bin/python"
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// Runs tests/data/tensorboard_check.py on `run` and asserts it found no
/// difference; what it printed.
fn tensorboard_agrees(run: &Path) -> String {
    with_tensorboard("tensorboard_check.py", run)
}

/// A run, the same run resumed from an earlier checkpoint (its later
/// events superseded, as metrics.jsonl is cut), and a cross-validation
/// (each fold, and the folds' summary) read back as metrics.jsonl and
/// cv_summary.json say; with `logging.tensorboard=false` there are none.
#[test]
fn tensorboard_reads_a_run_a_resumed_run_and_a_cv_run_as_their_metrics() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = crate::train::tiny(tmp.path(), "lm", 120);
    args.extend([
        "logging.logging_steps=10".into(),
        "eval.eval_steps=40".into(),
        "checkpoint.every_steps=50".into(),
    ]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run().expect_code(0);
    let run = tmp.path().join("lm");
    let events: Vec<_> = std::fs::read_dir(run.join("tensorboard"))
        .expect("RUN/tensorboard")
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(events.len(), 1, "one event file");
    let out = tensorboard_agrees(&run);
    assert!(out.contains("scalars"), "{out}");

    // Resumed from step 50: steps 60 to 120 are written again, once each.
    let run_arg = run.to_str().expect("utf-8");
    kiln(&["resume", run_arg, "--from", "50"])
        .run()
        .expect_code(0);
    tensorboard_agrees(&run);

    // A cross-validation: each fold and the summary.
    let cv_args = crate::nli::tiny(tmp.path(), "cv", 1);
    let refs: Vec<&str> = cv_args.iter().map(String::as_str).collect();
    kiln(&refs).run().expect_code(0);
    let out = tensorboard_agrees(&tmp.path().join("cv"));
    assert!(out.contains("cross-validation scalars"), "{out}");
    assert!(out.contains("fold-3"), "{out}");

    // Off with the key: no event files.
    let mut args = crate::train::tiny(tmp.path(), "quiet", 10);
    args.push("logging.tensorboard=false".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run().expect_code(0);
    assert!(!tmp.path().join("quiet/tensorboard").exists());
}

/// A sweep's jobs carry their values for TensorBoard's HParams dashboard,
/// as TensorBoard's own reader decodes them; their scalars are read as
/// without.
#[test]
fn a_sweeps_jobs_show_their_values_in_the_hparams_dashboard() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = crate::train::tiny(tmp.path(), "sw", 40);
    args.insert(1, "-m".into());
    args.extend([
        "training.learning_rate=1e-3,3e-3".into(),
        "model.gelu=exact,tanh".into(),
    ]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run().expect_code(0);
    let job = tmp.path().join("sw/3-learning_rate=3e-3,gelu=tanh");
    let hparams = with_tensorboard("tensorboard_hparams.py", &job.join("tensorboard"));
    assert_eq!(
        hparams.trim(),
        r#"{"model.gelu": "tanh", "training.learning_rate": 0.003}"#
    );
    tensorboard_agrees(&job);
}
