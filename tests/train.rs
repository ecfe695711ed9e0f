//! `kiln train`, `kiln resume` and `kiln bench` on a tiny model, as a user
//! runs them: real child processes, killed and interrupted.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{kill_when, kiln, kiln_bin, root};

/// A tiny model and a short run on a 40 kB slice of the shipped corpus.
pub(crate) fn tiny(dir: &Path, run: &str, steps: u32) -> Vec<String> {
    let corpus = dir.join("corpus.txt");
    if !corpus.exists() {
        let text =
            std::fs::read_to_string(root().join("data/tinyshakespeare.txt")).expect("corpus");
        std::fs::write(&corpus, &text[..40_000]).expect("write corpus");
    }
    [
        "train".to_string(),
        "hardware=cpu".into(),
        format!("data.path={}", corpus.display()),
        format!("data.cache_dir={}", dir.join("cache").display()),
        format!("run.dir={}", dir.join(run).display()),
        "model.layers=2".into(),
        "model.heads=2".into(),
        "model.hidden=32".into(),
        "model.intermediate=128".into(),
        "model.max_length=32".into(),
        "training.batch_size=8".into(),
        "eval.batch_size=8".into(),
        "eval.eval_iters=2".into(),
        "eval.eval_steps=100".into(),
        "logging.logging_steps=50".into(),
        "checkpoint.every_steps=100".into(),
        "checkpoint.keep=10".into(),
        "training.warmup_steps=20".into(),
        "sample.count=1".into(),
        "sample.tokens=20".into(),
        format!("training.max_steps={steps}"),
    ]
    .to_vec()
}

/// `kiln` with the tiny run's arguments and `extra` overrides.
pub(crate) fn train_tiny(dir: &Path, run: &str, steps: u32, extra: &[&str]) -> crate::support::Run {
    let mut args = tiny(dir, run, steps);
    args.extend(extra.iter().map(|s| s.to_string()));
    run_kiln(&args)
}

/// The final validation loss a run wrote to its `summary.json`.
pub(crate) fn final_val_loss(run: &Path) -> f64 {
    let text = std::fs::read_to_string(run.join("summary.json")).expect("summary.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["final_val_loss"].as_f64().expect("final_val_loss")
}

fn run_kiln(args: &[String]) -> crate::support::Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run()
}

/// The SHA-256 a checkpoint's header records over all its tensors (model
/// and optimizer): equal digests mean bitwise-equal state.
pub(crate) fn checkpoint_digest(path: &Path) -> String {
    metadata(path, "sha256")
}

/// The value of `key` in a safetensors file's header metadata.
pub(crate) fn metadata(path: &Path, key: &str) -> String {
    all_metadata(path)[key]
        .as_str()
        .unwrap_or_else(|| panic!("no `{key}` in {}", path.display()))
        .to_string()
}

/// A safetensors file's `__metadata__`.
pub(crate) fn all_metadata(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).expect("header");
    header["__metadata__"].clone()
}

pub(crate) fn ckpt(run: &Path, step: u32) -> PathBuf {
    run.join(format!("checkpoints/ckpt-{step:08}.safetensors"))
}

#[test]
fn a_run_leaves_a_complete_run_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = run_kiln(&tiny(tmp.path(), "run", 100)).expect_code(0);
    run.stdout_has(&[
        "kiln: backend: flex (CPU)",
        "kiln: loader: 1 worker thread",
        "step   100/100 | loss ",
        "tokens/s",
        "MFU ",
        "data-wait",
        "eval    100: train loss",
        "held back by: ",
    ]);
    // Its schedule fits its config: no warnings as it starts.
    assert!(!run.stdout.contains("warning"), "{}", run.stdout);
    let dir = tmp.path().join("run");
    for file in [
        "config.toml",
        "config-sources.txt",
        "hardware.json",
        "tokenizer.json",
        "data.json",
        "metrics.jsonl",
        "summary.json",
        "samples.txt",
        "loss.svg",
        "throughput.svg",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).expect("summary"))
            .expect("json");
    let val = summary["final_val_loss"].as_f64().expect("val loss");
    // ln(vocabulary) ≈ 4 at the start; 100 steps must have learned something.
    assert!(val < 3.3, "val loss {val}");
    assert!(
        summary["median_tokens_per_s"]
            .as_f64()
            .is_some_and(|t| t > 0.0)
    );
    assert!(ckpt(&dir, 100).is_file());
    // The saved tokenizer is a Hugging Face tokenizer.json.
    let tok: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer"),
    )
    .expect("json");
    assert_eq!(tok["model"]["type"], "WordLevel");
    // The saved config resolves again, as `--config`.
    kiln(&[
        "config",
        "--config",
        dir.join("config.toml").to_str().expect("utf-8"),
    ])
    .run()
    .expect_code(0);
    // A second run into the same folder is refused: nothing saved is overwritten.
    let again = run_kiln(&tiny(tmp.path(), "run", 100));
    assert_eq!(again.code, 2, "{}", again.stderr);
    again.stderr_has(&[
        "run.dir `",
        "` already holds a run: resume it with `kiln resume ",
    ]);
    assert!(
        !again.stderr.contains("not a kiln run directory"),
        "a folder holding a run is one: {}",
        again.stderr
    );
}

/// A run shorter than its evaluation interval and its warm-up says so as
/// it starts, each with the fix `kiln diagnose` gives, and trains as
/// configured.
#[test]
fn a_run_warns_as_it_starts_of_a_schedule_its_config_does_not_fit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = train_tiny(tmp.path(), "short", 10, &[]).expect_code(0);
    run.stdout_has(&[
        "kiln: warning: eval.eval_steps=100 is beyond the run's 10 steps: no evaluation before the end; fix: eval.eval_steps=2\n",
        "kiln: warning: training.warmup_steps=20 is not below the run's 10 steps: the learning rate never reaches training.learning_rate; fix: training.warmup_steps=1\n",
        "step    10/10 | loss ",
    ]);
    // logging.logging_steps=50 and checkpoint.every_steps=100 are beyond
    // it too, but the first and last steps are logged and checkpointed:
    // notes for `kiln diagnose`, not warnings.
    assert_eq!(run.stdout.matches("warning").count(), 2, "{}", run.stdout);
}

/// The tiny run of `steps` uninterrupted in `dir/whole`, and the same run
/// in `dir/killed`, killed (SIGKILL) once its first checkpoint (step 100)
/// exists: their folders.
fn whole_and_killed(dir: &Path, steps: u32) -> (PathBuf, PathBuf) {
    run_kiln(&tiny(dir, "whole", steps)).expect_code(0);
    let killed = dir.join("killed");
    kill_when(
        &tiny(dir, "killed", steps),
        &ckpt(&killed, 100),
        &ckpt(&killed, steps),
    );
    (dir.join("whole"), killed)
}

#[test]
fn a_killed_run_resumes_to_the_same_weights() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 400;
    let (whole, killed) = whole_and_killed(tmp.path(), steps);
    let resumed = kiln(&["resume", killed.to_str().expect("utf-8")])
        .run()
        .expect_code(0);
    resumed.stdout_has(&["resuming", "from step"]);
    // Bitwise: flex with the same seed and threads is deterministic.
    assert_eq!(
        checkpoint_digest(&ckpt(&killed, steps)),
        checkpoint_digest(&ckpt(&whole, steps))
    );
    // The metrics were not written twice.
    let steps_logged = logged_steps(&killed);
    let mut sorted = steps_logged.clone();
    sorted.dedup();
    assert_eq!(sorted, steps_logged, "duplicated metric lines");
}

#[test]
fn a_resume_takes_overrides_that_leave_the_model_and_data_as_they_are() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 300;
    let (whole, run) = whole_and_killed(tmp.path(), steps);
    let run_arg = run.to_str().expect("utf-8");
    let config_before = std::fs::read(run.join("config.toml")).expect("config.toml");

    // What would change the model, the data or their order is refused,
    // each key named, and the run is left as it was.
    kiln(&[
        "resume",
        run_arg,
        "model.layers=3",
        "data.path=other.txt",
        "training.seed=7",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&[
        "`model.layers`",
        "the run has 2",
        "`data.path`",
        "`training.seed`",
        "start a new run",
    ]);
    // A run cannot end before the checkpoint it resumes from.
    kiln(&["resume", run_arg, "training.max_steps=50"])
        .run()
        .expect_code(2)
        .stderr_has(&["training.max_steps", "step 100"]);
    kiln(&["resume", run_arg, "training.learning_rate=much"])
        .run()
        .expect_code(2)
        .stderr_has(&["training.learning_rate", "much"]);
    assert_eq!(
        std::fs::read(run.join("config.toml")).expect("config.toml"),
        config_before
    );
    assert!(!ckpt(&run, 200).exists());

    // Logging and checkpoint cadence change what is written, not the
    // training: the run ends bitwise where the uninterrupted one did.
    kiln(&[
        "resume",
        run_arg,
        "logging.logging_steps=25",
        "checkpoint.every_steps=50",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "resuming with changes: logging.logging_steps 50 → 25, checkpoint.every_steps 100 → 50",
    ]);
    assert_eq!(
        checkpoint_digest(&ckpt(&run, steps)),
        checkpoint_digest(&ckpt(&whole, steps))
    );
    assert!(ckpt(&run, 150).exists() && ckpt(&run, 250).exists());
    // A finished run resumed as it is trains nothing and says how to go on.
    kiln(&["resume", run_arg])
        .run()
        .expect_code(0)
        .stdout_has(&["has taken its 300 steps", "training.max_steps=600"]);
    assert_eq!(
        checkpoint_digest(&ckpt(&run, steps)),
        checkpoint_digest(&ckpt(&whole, steps))
    );
    let config = std::fs::read_to_string(run.join("config.toml")).expect("config.toml");
    assert!(config.contains("logging_steps = 25"), "{config}");

    // Train longer, at a lower rate, in micro-batches of half the size with
    // the effective batch kept: the run goes on to the new end, and a
    // later plain resume keeps the new values.
    kiln(&[
        "resume",
        run_arg,
        "training.max_steps=360",
        "training.learning_rate=5e-4",
        "training.batch_size=4",
        "training.gradient_accumulation_steps=2",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "resuming `",
        "from step 300",
        "training.max_steps 300 → 360",
    ]);
    assert!(ckpt(&run, 360).exists());
    assert_eq!(last_step(&run.join("metrics.jsonl")), 360);
    let records = step_records(&run.join("metrics.jsonl"));
    // 8 sequences of 32 tokens a step, before the change and after it.
    let seen = |step: u64| {
        records
            .iter()
            .find(|m| m["step"] == step)
            .and_then(|m| m["tokens_seen"].as_u64())
            .expect("a logged step")
    };
    assert_eq!(seen(300) - seen(275), 25 * 8 * 32);
    assert_eq!(seen(350) - seen(325), 25 * 8 * 32);
    // The rate is the cosine of the new peak and length (warm-up 20 steps,
    // the experiment's floor 1e-4); the old peak would give 1.23e-4 here.
    let lr = logged_lr(&run.join("metrics.jsonl"), 325);
    let progress = (325.0 - 20.0) / (360.0 - 20.0);
    let want = 1e-4 + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (5e-4 - 1e-4);
    assert!((lr - want).abs() < 1e-12, "lr {lr}, want {want}");
    let sources = std::fs::read_to_string(run.join("config-sources.txt")).expect("sources");
    assert!(
        sources.contains(
            "command line (training.max_steps=360), on `kiln resume` after step 300 (was 300)"
        ),
        "{sources}"
    );
    let config = std::fs::read_to_string(run.join("config.toml")).expect("config.toml");
    for line in [
        "max_steps = 360",
        "batch_size = 4",
        "learning_rate = 0.0005",
    ] {
        assert!(config.contains(line), "{line} not in {config}");
    }
}

#[test]
fn a_resume_from_an_earlier_checkpoint_keeps_what_came_after_it_aside() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 300;
    run_kiln(&tiny(tmp.path(), "whole", steps)).expect_code(0);
    run_kiln(&tiny(tmp.path(), "run", steps)).expect_code(0);
    let run = tmp.path().join("run");
    let run_arg = run.to_str().expect("utf-8");
    kiln(&["resume", run_arg, "--from", "150"])
        .run()
        .expect_code(2)
        .stderr_has(&["none at step 150", "steps 100, 200, 300"]);
    let old_end = checkpoint_digest(&ckpt(&run, steps));

    // Back to step 100: the steps after it are trained again, bitwise as
    // the first time (no override), and the first ending is kept aside.
    kiln(&["resume", run_arg, "--from", "100"])
        .run()
        .expect_code(0)
        .stdout_has(&["from step 100", "checkpoints/after-100"]);
    let aside = run.join("checkpoints/after-100");
    assert_eq!(
        checkpoint_digest(&aside.join("ckpt-00000300.safetensors")),
        old_end
    );
    assert!(aside.join("ckpt-00000200.safetensors").is_file());
    assert!(aside.join("summary.json").is_file());
    let set_aside = step_records(&aside.join("metrics.jsonl"));
    assert!(
        set_aside
            .iter()
            .all(|m| m["step"].as_u64().is_some_and(|s| s > 100))
            && !set_aside.is_empty()
    );
    assert_eq!(
        checkpoint_digest(&ckpt(&run, steps)),
        checkpoint_digest(&ckpt(&tmp.path().join("whole"), steps))
    );
    // Each step once, in order (a resumed process also logs its first step).
    let mut want = logged_steps(&tmp.path().join("whole"));
    want.push(101);
    want.sort_unstable();
    assert_eq!(logged_steps(&run), want);
    assert!(run.join("summary.json").is_file());

    // torchrun's --max-restarts runs the same `kiln resume --from 100`
    // again after a failure: the restart goes on from the run's last good
    // checkpoint (here its end), not back to step 100 again.
    let end = checkpoint_digest(&ckpt(&run, steps));
    kiln(&["resume", run_arg, "--from", "100"])
        .env("TORCHELASTIC_MAX_RESTARTS", "1")
        .env("TORCHELASTIC_RESTART_COUNT", "1")
        .run()
        .expect_code(0)
        .stdout_has(&["from step 300"])
        .stderr_has(&[
            "torchrun's restart 1 of 1: resuming",
            "not --from 100 again",
        ]);
    assert_eq!(checkpoint_digest(&ckpt(&run, steps)), end);

    // A cross-validation run resumes in its fold, from its newest checkpoint.
    let cv = crate::nli::tiny(tmp.path(), "cv", 1);
    run_kiln(&cv).expect_code(0);
    kiln(&[
        "resume",
        tmp.path().join("cv").to_str().expect("utf-8"),
        "--from",
        "1",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&["--from on a cross-validation run"]);
}

/// The step a model file was written after (its header's `step`).
fn file_step(path: &Path) -> u64 {
    metadata(path, "step").parse().expect("a step")
}

/// A language model keeps its best model and stops early: 100 steps whose
/// validation loss falls (evaluated every 25), resumed at a rate of 1
/// with `eval.patience = 2`, get worse at 125 and 150 and stop there;
/// `best.safetensors` is step 100's, and `--best` exports and samples it
/// (the newest checkpoint, step 150's, is another model). A resume
/// `--from 50` sets the best model aside with what came after and makes
/// step 50's checkpoint the best again.
#[test]
fn a_language_model_keeps_its_best_model_and_stops_early() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let extra = [
        "eval.eval_steps=25",
        "checkpoint.every_steps=50",
        "training.learning_rate=3e-3",
    ];
    train_tiny(tmp.path(), "run", 100, &extra)
        .expect_code(0)
        .stdout_has(&["at step 100)"]);
    let run = tmp.path().join("run");
    let run_arg = run.to_str().expect("utf-8");
    kiln(&[
        "resume",
        run_arg,
        "training.max_steps=300",
        "training.learning_rate=1",
        "training.min_lr=1",
        "eval.patience=2",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "early stop at step 150: no better score in 2 evaluations",
        "done: 150 steps",
        "at step 100)",
    ]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).expect("summary"))
            .expect("json");
    assert_eq!(
        (summary["steps"].as_u64(), summary["best_step"].as_u64()),
        (Some(150), Some(100))
    );
    assert_eq!(file_step(&run.join("best.safetensors")), 100);
    let export = |name: &str, best: bool| {
        let out = tmp.path().join(name);
        let mut args = vec!["export", run_arg, "--out", out.to_str().expect("utf-8")];
        args.extend(best.then_some("--best"));
        let printed = kiln(&args).run().expect_code(0).stdout;
        let weights = std::fs::read(out.join("model.safetensors")).expect("model.safetensors");
        (printed, weights)
    };
    let (best_printed, best_weights) = export("best", true);
    let (last_printed, last_weights) = export("last", false);
    assert!(
        best_printed.starts_with("exported the best model (step 100)"),
        "{best_printed}"
    );
    assert!(
        last_printed.starts_with("exported step 150"),
        "{last_printed}"
    );
    assert_ne!(best_weights, last_weights);
    kiln(&["sample", run_arg, "--best", "-n", "1", "--tokens", "5"])
        .run()
        .expect_code(0)
        .stderr_has(&["sampling from the best model, step 100 of"]);

    kiln(&["resume", run_arg, "--from", "50"])
        .run()
        .expect_code(0)
        .stdout_has(&["the best model up to step 50 is step 50's again"]);
    assert_eq!(
        file_step(&run.join("checkpoints/after-50/best.safetensors")),
        100
    );
    assert_eq!(file_step(&run.join("best.safetensors")), 50);
}

#[test]
fn ctrl_c_checkpoints_and_prints_the_resume_command() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("int");
    let child = start_run(&tiny(tmp.path(), "int", 100_000), &dir);
    crate::support::signal(child.id(), "-INT");
    let stdout = crate::support::interrupted_stdout(child.wait_with_output().expect("wait"));
    assert!(stdout.contains("resume with: kiln resume"), "{stdout}");
    let checkpoints = std::fs::read_dir(dir.join("checkpoints"))
        .expect("checkpoints")
        .count();
    assert!(checkpoints >= 1);
}

/// A stop (SIGTERM, as a scheduler sends it) during a long evaluation
/// does not wait for the evaluation's end: the step's checkpoint is
/// written, marked as owing its evaluation, and the resume runs that
/// evaluation first, once, and ends on the weights of a run never stopped.
#[test]
fn a_stop_during_an_evaluation_cuts_it_short_and_the_resume_runs_it_first() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cut");
    let mut args = tiny(tmp.path(), "cut", 3);
    // An evaluation after every step, of more batches than a test waits
    // for: the first step's record is written just before it starts.
    args.extend([
        "eval.eval_steps=1".into(),
        "eval.eval_iters=1000000000".into(),
    ]);
    let child = start_run(&args, &dir);
    crate::support::signal(child.id(), "-TERM");
    let out = crate::support::exit_within(child, 120, "the evaluation of 1e9 batches to end");
    let stdout = crate::support::interrupted_stdout(out);
    assert!(
        stdout.contains(
            "the evaluation after step 1 was cut short by the stop; a resume runs it first"
        ),
        "{stdout}"
    );
    assert_eq!(metadata(&ckpt(&dir, 1), "eval_pending"), "true");
    assert_eq!(eval_steps(&dir), Vec::<u64>::new());

    let run_arg = dir.to_str().expect("utf-8");
    kiln(&["resume", run_arg, "eval.eval_iters=2"])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "the evaluation after step 1 was cut short by the stop: it runs now",
            "eval      1:",
        ]);
    assert_eq!(eval_steps(&dir), vec![1, 2, 3]);
    // Written again without the mark: another resume evaluates no more.
    let header = all_metadata(&ckpt(&dir, 1));
    assert_eq!(header.get("eval_pending"), None, "{header}");

    let whole = tmp.path().join("whole");
    let mut args = tiny(tmp.path(), "whole", 3);
    args.push("eval.eval_steps=1".into());
    run_kiln(&args).expect_code(0);
    assert_eq!(
        metadata(&ckpt(&dir, 3), "sha256"),
        metadata(&ckpt(&whole, 3), "sha256")
    );
}

/// A stop while the run samples its texts (its steps done, its last
/// checkpoint written) ends the samples, not the run: `samples.txt` says
/// they were cut short, the summary is written, and kiln exits 0.
#[test]
fn a_stop_during_the_final_samples_cuts_them_short_and_the_run_finishes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("samples");
    let mut args = tiny(tmp.path(), "samples", 2);
    args.extend(["sample.count=2".into(), "sample.tokens=1000000".into()]);
    let child = crate::support::start_until(&args, &ckpt(&dir, 2));
    crate::support::signal(child.id(), "-TERM");
    let out = crate::support::exit_within(child, 120, "a million tokens to be sampled");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("samples cut short by the stop"), "{stdout}");
    let samples = std::fs::read_to_string(dir.join("samples.txt")).expect("samples.txt");
    assert!(
        samples.contains("--- samples cut short by the stop (1 of 2 begun); `kiln sample "),
        "{samples}"
    );
    assert!(dir.join("summary.json").is_file());
}

/// A stop before the first step ends the process at once, where it waited
/// for the first step before: here the corpus is a FIFO no one writes, so
/// the run waits in its data's preparation for as long as the test lets it.
#[test]
fn a_stop_before_the_first_step_ends_the_process_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // `tiny` leaves an existing corpus.txt (the FIFO) as it is.
    crate::support::unwritten_fifo(&tmp.path().join("corpus.txt"));
    let args = tiny(tmp.path(), "early", 10);
    let printed = tmp.path().join("stdout.txt");
    let child = std::process::Command::new(crate::support::kiln_bin())
        .args(&args)
        .current_dir(crate::support::root())
        .stdout(std::fs::File::create(&printed).expect("stdout file"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    crate::support::wait_for_line(&printed, "preparing them into the token store");
    crate::support::signal(child.id(), "-TERM");
    let out = crate::support::exit_within(child, 60, "a corpus no one writes to be read");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("kiln: stopped before the first step: nothing to save yet"),
        "{stderr}"
    );
}

/// The steps a run's `metrics.jsonl` has evaluations of, in order.
pub(crate) fn eval_steps(run: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .filter(|m| m["kind"] == "eval")
        .filter_map(|m| m["step"].as_u64())
        .collect()
}

#[test]
fn bad_training_input_is_named_with_exit_2_and_no_run_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, bytes: &[u8]| {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).expect("write");
        p
    };
    let empty = write("empty.txt", b"");
    let latin1 = write("latin1.txt", b"good line\nbad caf\xe9\n");
    let short = write("short.txt", b"too short for a block\n");
    let broken_tok = write("tokenizer.json", b"{\"model\": {\"type\": \"BPE\"");
    let good = write(
        "good.txt",
        "All the world's a stage,\nAnd all the men and women merely players.\n"
            .repeat(50)
            .as_bytes(),
    );
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec![format!(
                "data.path={}",
                tmp.path().join("missing.txt").display()
            )],
            vec![
                "missing.txt".into(),
                "failed to read".into(),
                // The cause, not only the file.
                "No such file or directory".into(),
            ],
        ),
        (
            vec![format!("data.path={}", empty.display())],
            vec![format!("`{}` is empty", empty.display())],
        ),
        (
            vec![format!("data.path={}", latin1.display())],
            vec![
                "latin1.txt".into(),
                "invalid byte 0xe9 at byte 17 (line 2)".into(),
            ],
        ),
        (
            vec![format!("data.path={}", short.display())],
            vec!["short.txt".into(), "too short".into()],
        ),
        (
            vec![
                format!("data.path={}", good.display()),
                format!("data.tokenizer_file={}", broken_tok.display()),
            ],
            vec!["invalid tokenizer".into(), "tokenizer.json".into()],
        ),
        (
            vec![
                format!("data.path={}", good.display()),
                "device.backend=cuda".into(),
            ],
            vec![
                "backend `cuda` is not available".into(),
                "`cuda` feature".into(),
            ],
        ),
        (
            vec![
                format!("data.path={}", good.display()),
                "device.backend=cubecl-cpu".into(),
            ],
            vec![
                "backend `cubecl-cpu` is not available".into(),
                "`cubecl-cpu` feature".into(),
            ],
        ),
        // A step estimated at hundreds of TiB: the OOM killer ended such
        // runs once the machine's memory was full.
        (
            vec![
                format!("data.path={}", good.display()),
                "training.batch_size=100000000".into(),
            ],
            vec![
                "training.batch_size: the step needs about".into(),
                "(estimate) but available RAM is".into(),
                "over twice what it has; fix: training.batch_size=".into(),
                "--force runs it anyway".into(),
            ],
        ),
        // An evaluation batch of a billion sequences: the run trained its
        // first steps, then aborted allocating 256 GB for it.
        (
            vec![
                format!("data.path={}", good.display()),
                "eval.batch_size=1000000000".into(),
            ],
            vec![
                "eval.batch_size: an evaluation pass of 1000000000 sequences needs about".into(),
                "over twice what it has; fix: eval.batch_size=".into(),
            ],
        ),
        // A model whose weights and AdamW's moments alone outgrow the
        // machine: the fix is the model, not the batch.
        (
            vec![
                format!("data.path={}", good.display()),
                "model.layers=100000".into(),
            ],
            vec![
                "model: the model's".into(),
                "(their weights, gradients and AdamW's moments, before any activation)".into(),
                "fix: a smaller model".into(),
            ],
        ),
    ];
    for (extra, wants) in cases {
        let mut args = vec![
            "train".to_string(),
            "hardware=cpu".into(),
            format!("run.dir={}", tmp.path().join("run").display()),
            format!("data.cache_dir={}", tmp.path().join("cache").display()),
        ];
        args.extend(extra.clone());
        let run = run_kiln(&args);
        assert_eq!(run.code, 2, "{extra:?}: {}", run.stderr);
        let wants: Vec<&str> = wants.iter().map(String::as_str).collect();
        run.stderr_has(&wants);
        assert!(
            !tmp.path().join("run").exists(),
            "{extra:?} left a run directory"
        );
    }
    let missing = kiln(&["resume", tmp.path().join("nope").to_str().expect("utf-8")]).run();
    assert_eq!(missing.code, 2);
    missing.stderr_has(&["not a kiln run directory"]);
}

#[test]
fn bench_lm_prints_json_with_the_step_split() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = vec![
        "bench".to_string(),
        "lm".into(),
        "--json".into(),
        "--warmup".into(),
        "2".into(),
        "--steps".into(),
        "5".into(),
    ];
    args.extend(
        tiny(tmp.path(), "unused", 10)
            .into_iter()
            .skip(1)
            .filter(|a| !a.starts_with("run.dir")),
    );
    let run = run_kiln(&args).expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    let b = &v["bench"];
    assert!(b["tokens_per_s_median"].as_f64().is_some_and(|t| t > 0.0));
    assert!(b["ms_per_step_median"].as_f64().is_some_and(|t| t > 0.0));
    assert!(b["data_wait_pct"].as_f64().is_some());
    for phase in [
        "data_wait_ms",
        "host_to_device_ms",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
    ] {
        assert!(b["phases"][phase].as_f64().is_some(), "{phase}");
    }
    assert_eq!(b["timed_steps"], 5);
    assert_eq!(v["config"]["model"]["hidden"], 32);
}

#[test]
fn gradient_checkpointing_trains() {
    // Regression: the optimizer dropped the parameters' checkpointing
    // strategy, and the next step's forward pass panicked on the mismatch.
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "gc", 12);
    args.push("model.gradient_checkpointing=true".into());
    run_kiln(&args)
        .expect_code(0)
        .stdout_has(&["gradient checkpointing: on", "step    12/12"]);
}

#[test]
fn a_diverging_run_skips_non_finite_steps_then_stops_with_finite_checkpoints() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "run", 50);
    // A learning rate no model survives: the second step's loss is not finite.
    args.extend([
        "training.learning_rate=1e30".to_string(),
        "training.warmup_steps=0".into(),
        "checkpoint.every_steps=1".into(),
        "checkpoint.keep=50".into(),
        "precision.max_bad_steps=3".into(),
    ]);
    let run = run_kiln(&args).expect_code(1);
    run.stderr_has(&[
        "3 step(s) in a row (precision.max_bad_steps)",
        "last good checkpoint is intact",
    ]);
    run.stdout_has(&["step skipped, no update (1 in a row", "(2 in a row"]);
    let dir = tmp.path().join("run");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics");
    let skipped: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "skipped")
        .collect();
    assert_eq!(skipped.len(), 2, "{metrics}");
    // Every checkpoint written, before and during the bad steps, is finite.
    let mut checked = 0;
    for entry in std::fs::read_dir(dir.join("checkpoints")).expect("checkpoints") {
        let bytes = std::fs::read(entry.expect("entry").path()).expect("read");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        for (name, view) in file.tensors() {
            if view.dtype() == safetensors::Dtype::F32 {
                assert!(
                    view.data()
                        .chunks_exact(4)
                        .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
                    "{name} holds a non-finite value"
                );
            }
        }
        checked += 1;
    }
    assert!(
        checked >= 2,
        "checkpoints before and during the skipped steps"
    );
}

/// The `step` records of a `metrics.jsonl`, in file order.
pub(crate) fn step_records(metrics: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(metrics)
        .expect("metrics.jsonl")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["kind"] == "step")
        .collect()
}

/// The learning rate a run's `metrics.jsonl` logged at `step`.
pub(crate) fn logged_lr(metrics: &Path, step: u64) -> f64 {
    step_records(metrics)
        .iter()
        .find(|m| m["step"] == step)
        .and_then(|m| m["lr"].as_f64())
        .unwrap_or_else(|| panic!("no lr logged at step {step} in {}", metrics.display()))
}

/// The steps of a run's last logged step, from its `metrics.jsonl`.
pub(crate) fn last_step(metrics: &Path) -> u64 {
    step_records(metrics)
        .iter()
        .filter_map(|m| m["step"].as_u64())
        .max()
        .expect("a step record")
}

/// `kiln diagnose --json` for a run's arguments: the steps it predicts.
pub(crate) fn predicted_steps(train_args: &[String]) -> u64 {
    predicted_steps_with(train_args, &[])
}

/// [`predicted_steps`] with `flags` to diagnose (`--ranks 2`).
pub(crate) fn predicted_steps_with(train_args: &[String], flags: &[&str]) -> u64 {
    let mut args = vec!["diagnose".to_string(), "--burst=0".into(), "--json".into()];
    args.extend(flags.iter().map(|f| f.to_string()));
    args.extend(train_args.iter().skip(1).cloned());
    let out = run_kiln(&args);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
        panic!("diagnose --json: {e}\n{}", out.stderr);
    });
    v["diagnosis"]["total_steps"].as_u64().expect("total_steps")
}

#[test]
fn diagnose_predicts_the_steps_the_run_makes_with_accumulation_and_epochs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // 140 batches an epoch over 2 epochs in groups of 3: 93 steps (the
    // third-of-a-step left over is dropped), not the 92 that counting steps
    // per epoch first would give.
    let mut args = tiny(tmp.path(), "epochs", 0);
    args.extend([
        "training.epochs=2".to_string(),
        "training.gradient_accumulation_steps=3".into(),
        "training.warmup_steps=5".into(),
        "model.layers=1".into(),
    ]);
    let predicted = predicted_steps(&args);
    run_kiln(&args).expect_code(0);
    let done = last_step(&tmp.path().join("epochs/metrics.jsonl"));
    assert_eq!(predicted, done);
    assert_eq!(done, 93);
}

/// The step of each `step` record in a run's `metrics.jsonl`, in file order.
fn logged_steps(run: &Path) -> Vec<u64> {
    step_records(&run.join("metrics.jsonl"))
        .iter()
        .filter_map(|m| m["step"].as_u64())
        .collect()
}

#[test]
fn a_run_killed_before_its_first_checkpoint_resumes_from_step_0() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 300;
    run_kiln(&tiny(tmp.path(), "whole", steps)).expect_code(0);
    // Killed (SIGKILL) once it has logged its first step, long before its
    // first checkpoint (step 100).
    let killed = tmp.path().join("killed");
    kill_when(
        &tiny(tmp.path(), "killed", steps),
        &killed.join("metrics.jsonl"),
        &ckpt(&killed, 100),
    );
    assert!(!ckpt(&killed, 100).exists());
    let resumed = kiln(&["resume", killed.to_str().expect("utf-8")])
        .run()
        .expect_code(0);
    resumed.stdout_has(&["no usable checkpoint", "starting the run again from step 0"]);
    assert_eq!(
        checkpoint_digest(&ckpt(&killed, steps)),
        checkpoint_digest(&ckpt(&tmp.path().join("whole"), steps))
    );
    // The lost steps' metrics were replaced, not duplicated.
    assert_eq!(
        logged_steps(&killed),
        logged_steps(&tmp.path().join("whole"))
    );
}

#[test]
fn a_run_whose_every_checkpoint_is_damaged_starts_again() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 200;
    let run = tmp.path().join("run");
    run_kiln(&tiny(tmp.path(), "run", steps)).expect_code(0);
    let want = checkpoint_digest(&ckpt(&run, steps));
    for entry in std::fs::read_dir(run.join("checkpoints")).expect("checkpoints") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).expect("read");
        std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
    }
    let resumed = kiln(&["resume", run.to_str().expect("utf-8")])
        .run()
        .expect_code(0);
    resumed.stdout_has(&["is unusable", "starting the run again from step 0"]);
    assert_eq!(checkpoint_digest(&ckpt(&run, steps)), want);
    let logged = logged_steps(&run);
    let mut once = logged.clone();
    once.dedup();
    assert_eq!(once, logged, "duplicated metric lines");
}

#[test]
fn a_second_process_cannot_write_a_running_run() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("busy");
    let mut child = start_run(&tiny(tmp.path(), "busy", 100_000), &dir);
    let second = kiln(&["resume", dir.to_str().expect("utf-8")]).run();
    child.kill().expect("kill");
    child.wait().expect("reap");
    second.expect_code(2).stderr_has(&[
        "is in use by another kiln process",
        &format!("(pid {})", child.id()),
    ]);
    // Its lock went with the killed process: a new resume takes it (it
    // writes its pid into run.lock), and is stopped there.
    let mut third = Command::new(kiln_bin())
        .args(["resume", dir.to_str().expect("utf-8")])
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kiln resume");
    let pid = third.id().to_string();
    let started = Instant::now();
    while std::fs::read_to_string(dir.join("run.lock")).unwrap_or_default() != pid {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the resume did not take the lock"
        );
        assert!(
            third.try_wait().expect("poll").is_none(),
            "the resume ended without taking the lock"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    third.kill().expect("kill");
    third.wait().expect("reap");
}

#[test]
fn twenty_kills_from_the_start_end_where_an_uninterrupted_run_ends() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 1500;
    let extra = ["checkpoint.every_steps=20".to_string()];
    let mut whole_args = tiny(tmp.path(), "whole", steps);
    whole_args.extend(extra.iter().cloned());
    run_kiln(&whole_args).expect_code(0);
    let run = tmp.path().join("killed");
    let mut train_args = tiny(tmp.path(), "killed", steps);
    train_args.extend(extra.iter().cloned());
    let resume_args = vec!["resume".to_string(), run.display().to_string()];
    // A fixed xorshift: the kill times vary over the run's start-up, its
    // steps and its checkpoint writes, the same each time the test runs.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next_delay = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        Duration::from_millis(5 + state % 200)
    };
    let mut kills = 0;
    while kills < 20 {
        // Until the run has its config, it is not a run yet: start it again.
        let args = if run.join("config.toml").is_file() {
            &resume_args
        } else {
            &train_args
        };
        let mut child = Command::new(kiln_bin())
            .args(args)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kiln");
        std::thread::sleep(next_delay());
        if child.try_wait().expect("poll").is_some() {
            // It finished (or failed) before the kill: a finished run is
            // resumed once more below; anything else is an error there.
            break;
        }
        child.kill().expect("kill");
        child.wait().expect("reap");
        kills += 1;
    }
    let done = kiln(&["resume", run.to_str().expect("utf-8")]).run();
    assert!(
        done.code == 0,
        "the last resume failed ({} kills):\n{}\n{}",
        kills,
        done.stdout,
        done.stderr
    );
    assert_eq!(
        checkpoint_digest(&ckpt(&run, steps)),
        checkpoint_digest(&ckpt(&tmp.path().join("whole"), steps))
    );
    // Each step once, in order; a resumed process also logs its first step.
    let logged = logged_steps(&run);
    assert!(logged.windows(2).all(|w| w[0] < w[1]), "{logged:?}");
    let whole = logged_steps(&tmp.path().join("whole"));
    assert!(whole.iter().all(|s| logged.contains(s)), "{logged:?}");
    assert_eq!(
        kills, 20,
        "the run ended after {kills} kills: make it longer"
    );
    // No write debris is left behind.
    for dir in [run.clone(), run.join("checkpoints")] {
        for entry in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            assert!(!name.contains(".tmp"), "{name} left in {}", dir.display());
        }
    }
}

/// Starts `kiln args` and waits until its run has logged a step.
fn start_run(args: &[String], dir: &Path) -> std::process::Child {
    crate::support::start_until(args, &dir.join("metrics.jsonl"))
}

#[test]
fn a_run_directory_removed_mid_run_ends_in_a_named_error_not_a_panic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("gone");
    let child = start_run(&tiny(tmp.path(), "gone", 100_000), &dir);
    std::fs::remove_dir_all(&dir).expect("remove the run directory");
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("error: failed to write"), "{stderr}");
    assert!(stderr.contains("gone"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_corpus_removed_under_a_running_run_does_not_stop_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("run");
    let args = tiny(tmp.path(), "run", 1500);
    let child = start_run(&args, &dir);
    // The language model's corpus is read, encoded and split before the
    // first step: the loader works from memory.
    std::fs::remove_file(tmp.path().join("corpus.txt")).expect("remove the corpus");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ckpt(&dir, 1500).is_file());
}

#[test]
fn a_checkpoint_that_cannot_be_written_leaves_no_debris_and_the_earlier_ones_intact() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 300;
    run_kiln(&tiny(tmp.path(), "whole", steps)).expect_code(0);
    // The run as far as its first checkpoint (step 100).
    let run = tmp.path().join("full");
    kill_when(
        &tiny(tmp.path(), "full", steps),
        &ckpt(&run, 100),
        &ckpt(&run, steps),
    );
    let first = checkpoint_digest(&ckpt(&run, 100));
    // Resumed where no file may grow past 64 KiB: the next checkpoint
    // (about 0.3 MiB) fails part-written, as on a full disk. (RLIMIT_FSIZE,
    // with SIGXFSZ ignored so that the write fails with EFBIG instead of
    // killing the process: a write that fails after N bytes, without a
    // small file system to mount, which needs root.)
    let out = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 128; exec \"$0\" resume \"$1\"")
        .arg(kiln_bin())
        .arg(&run)
        .current_dir(root())
        .output()
        .expect("run kiln under a file-size limit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("failed to write checkpoint") && stderr.contains("MiB needed"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let left: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .expect("checkpoints")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        left,
        vec!["ckpt-00000100.safetensors".to_string()],
        "{left:?}"
    );
    assert_eq!(checkpoint_digest(&ckpt(&run, 100)), first);
    // With room again, the run ends where the uninterrupted one ended.
    kiln(&["resume", run.to_str().expect("utf-8")])
        .run()
        .expect_code(0);
    assert_eq!(
        checkpoint_digest(&ckpt(&run, steps)),
        checkpoint_digest(&ckpt(&tmp.path().join("whole"), steps))
    );
}

/// `kiln export`: the tensors of a trained tiny GPT under GPT-2's names and
/// shapes, as `transformers` makes them (a fixture it wrote for this shape),
/// with the config and tokenizer beside them; nothing is overwritten. The
/// logits are compared with `transformers` by scripts/check_hf_export.py.
/// The run pads its vocabulary (`model.vocab_multiple`: 65 characters
/// trained as 128 rows); the export has the true 65.
#[test]
fn export_writes_a_gpt2_folder_with_transformers_names_and_shapes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    train_tiny(tmp.path(), "run", 10, &["model.vocab_multiple=64"]).expect_code(0);
    let run = tmp.path().join("run");
    let out = tmp.path().join("hf");
    let args = [
        "export",
        run.to_str().expect("utf-8"),
        "--out",
        out.to_str().expect("utf-8"),
    ];
    kiln(&args)
        .run()
        .expect_code(0)
        .stdout_has(&["exported step 10", "GPT2LMHeadModel"]);

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["n_layer"], 2);
    assert_eq!(config["activation_function"], "gelu", "kiln's exact GELU");
    let vocab = config["vocab_size"].as_u64().expect("vocab") as usize;
    assert!(
        !vocab.is_multiple_of(64),
        "the tokenizer's {vocab} tokens, not the padded rows"
    );

    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/data/gpt2-tiny-state-dict.json"))
            .expect("fixture"),
    )
    .expect("json");
    let mut want: Vec<(String, Vec<usize>)> = fixture["tensors"]
        .as_object()
        .expect("tensors")
        .iter()
        .filter(|(name, _)| fixture["tied"].get(name.as_str()).is_none())
        .map(|(name, shape)| {
            let mut shape: Vec<usize> = serde_json::from_value(shape.clone()).expect("shape");
            if name == "transformer.wte.weight" {
                shape[0] = vocab; // the fixture's vocabulary is 65 characters
            }
            (name.clone(), shape)
        })
        .collect();
    want.sort();
    let bytes = std::fs::read(out.join("model.safetensors")).expect("model.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut got: Vec<(String, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec()))
        .collect();
    got.sort();
    assert_eq!(got, want);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    assert_eq!(
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str),
        Some("pt"),
        "transformers reads safetensors marked as PyTorch's"
    );
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "kiln_reference.json",
    ] {
        assert!(out.join(file).is_file(), "{file}");
    }
    // The reference logits kiln computed are the true vocabulary's too.
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("kiln_reference.json")).expect("reference"),
    )
    .expect("json");
    let rows = reference["logits"].as_array().expect("logits");
    assert!(!rows.is_empty());
    for row in rows {
        assert_eq!(row.as_array().expect("row").len(), vocab);
    }
    // The linear layers' biases trained (GPT-2's zero start once lost
    // `require_grad`, and they stayed 0)...
    let bias = st
        .tensor("transformer.h.0.attn.c_attn.bias")
        .expect("c_attn.bias");
    assert!(
        bias.data()
            .chunks_exact(4)
            .any(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != 0.0),
        "c_attn.bias is all zeros"
    );
    // ...and GPT-2's forward pass as transformers computes it, in plain
    // Python over the exported files, gives kiln's logits.
    let check = std::process::Command::new("python3")
        .arg(root().join("scripts/gpt2_forward.py"))
        .arg(&out)
        .output()
        .expect("python3 runs scripts/gpt2_forward.py");
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && said.contains("-> ok"),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );

    // An existing folder is left alone; a folder that is no run is named.
    kiln(&args)
        .run()
        .expect_code(2)
        .stderr_has(&["exists already", "overwrites nothing"]);
    let not_a_run = tmp.path().join("cache");
    kiln(&["export", not_a_run.to_str().expect("utf-8")])
        .run()
        .expect_code(2)
        .stderr_has(&["is not a kiln run directory"]);
}

/// A tiny run `dir/source` of `steps` steps, exported as the GPT-2 folder
/// `dir/hf`.
fn exported_tiny(dir: &Path, steps: u32, extra: &[&str]) -> std::path::PathBuf {
    train_tiny(dir, "source", steps, extra).expect_code(0);
    let export = dir.join("hf");
    kiln(&[
        "export",
        dir.join("source").to_str().expect("utf-8"),
        "--out",
        export.to_str().expect("utf-8"),
    ])
    .run()
    .expect_code(0);
    export
}

/// A safetensors file of f32 tensors: (name, shape, little-endian bytes).
fn write_f32_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let views = tensors.iter().map(|(name, shape, data)| {
        let view = safetensors::tensor::TensorView::new(
            safetensors::tensor::Dtype::F32,
            shape.clone(),
            data,
        )
        .expect("view");
        (name.clone(), view)
    });
    std::fs::write(
        path,
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
}

/// `model.init_from`: a run starts from a `transformers` GPT-2 folder's
/// weights, both as `kiln export` writes it and in the Hub's layout (names
/// without `transformer.`, the causal-mask buffers, `lm_head.weight`
/// written out, `vocab.json` instead of `tokenizer.json`); a run whose
/// shape or tokenizer does not fit is refused before it writes anything.
#[test]
fn init_from_starts_a_run_from_a_gpt2_folders_weights() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let export = exported_tiny(tmp.path(), 10, &["model.vocab_multiple=64"]);
    let source_loss = final_val_loss(&tmp.path().join("source"));

    // The Hub's layout of the same weights.
    let hub = tmp.path().join("hub");
    std::fs::create_dir(&hub).expect("mkdir");
    std::fs::copy(export.join("config.json"), hub.join("config.json")).expect("config");
    let tokenizer: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(export.join("tokenizer.json")).expect("tokenizer"),
    )
    .expect("json");
    let vocab = tokenizer["model"]["vocab"].clone();
    std::fs::write(hub.join("vocab.json"), vocab.to_string()).expect("vocab.json");
    let bytes = std::fs::read(export.join("model.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let name = name.trim_start_matches("transformer.").to_string();
            (name, view.shape().to_vec(), view.data().to_vec())
        })
        .collect();
    let wte = tensors
        .iter()
        .find(|t| t.0 == "wte.weight")
        .expect("wte")
        .clone();
    tensors.push(("lm_head.weight".into(), wte.1, wte.2));
    for layer in 0..2 {
        tensors.push((
            format!("h.{layer}.attn.bias"),
            vec![1, 1, 32, 32],
            vec![0; 32 * 32 * 4],
        ));
    }
    write_f32_safetensors(&hub.join("model.safetensors"), &tensors);

    // One step at a learning rate far below f32's resolution leaves the
    // weights as loaded: the run's validation loss is the source's final
    // one, on the same windows. A run from random weights of the same seed
    // has another.
    let still = [
        "training.learning_rate=1e-12",
        "training.min_lr=0",
        "model.vocab_multiple=64",
    ];
    for (name, folder) in [("from-export", &export), ("from-hub", &hub)] {
        let from = format!("model.init_from={}", folder.display());
        let mut extra = still.to_vec();
        extra.push(&from);
        let run = train_tiny(tmp.path(), name, 1, &extra).expect_code(0);
        let said = format!("{}{}", run.stdout, run.stderr);
        assert!(
            said.contains(&format!("weights: from {}", folder.display()))
                && said.contains("vocabulary rows"),
            "{said}"
        );
        let loss = final_val_loss(&tmp.path().join(name));
        assert!(
            (loss - source_loss).abs() < 1e-6,
            "{name}: validation loss {loss}, the source's {source_loss}"
        );
    }
    // A run that lost every checkpoint starts again from the folder.
    let again = tmp.path().join("from-hub");
    std::fs::remove_dir_all(again.join("checkpoints")).expect("rm checkpoints");
    kiln(&["resume", again.to_str().expect("utf-8")])
        .run()
        .expect_code(0)
        .stdout_has(&["weights: from", "starting the run again from step 0"]);
    let loss = final_val_loss(&again);
    assert!(
        (loss - source_loss).abs() < 1e-6,
        "resumed from step 0: validation loss {loss}, the source's {source_loss}"
    );
    train_tiny(tmp.path(), "fresh", 1, &still).expect_code(0);
    let fresh = final_val_loss(&tmp.path().join("fresh"));
    assert!(
        (fresh - source_loss).abs() > 1e-3,
        "random weights' loss {fresh} too close to the source's {source_loss}"
    );

    // Another shape: every key to set is named, and no run directory made.
    let from = format!("model.init_from={}", hub.display());
    train_tiny(
        tmp.path(),
        "layers",
        1,
        &[&from, "model.layers=3", "model.gelu=tanh"],
    )
    .expect_code(2)
    .stderr_has(&[
        "model.layers = 3 where its n_layer is 2",
        "model.layers=2 model.gelu=exact",
    ]);
    assert!(!tmp.path().join("layers").exists());
    // `kiln diagnose` lists it among the problems, with the rest of its
    // report (the data, the memory), and exits 2.
    let mut args = tiny(tmp.path(), "layers", 1);
    args.splice(0..1, ["diagnose".to_string(), "--burst=0".into()]);
    args.extend([from.clone(), "model.layers=3".into()]);
    run_kiln(&args).expect_code(2).stdout_has(&[
        "model.init_from",
        "model.layers = 3 where its n_layer is 2",
        "model.layers=2",
        "memory",
    ]);
    // Another tokenizer with the same number of tokens: two ids swapped.
    let mut swapped = vocab.clone();
    let (a, b) = (swapped["a"].clone(), swapped["b"].clone());
    (swapped["a"], swapped["b"]) = (b, a);
    std::fs::write(hub.join("vocab.json"), swapped.to_string()).expect("vocab.json");
    train_tiny(tmp.path(), "tokens", 1, &[&from])
        .expect_code(2)
        .stderr_has(&[
            "vocab.json` is another tokenizer than the run's",
            "2 of its",
            "data.tokenizer=gpt2",
        ]);
    assert!(!tmp.path().join("tokens").exists());
}

/// `kiln sample`: from a run, with the run's settings and seed, the texts
/// of its `samples.txt` again; from the run's export (a GPT-2 folder), the
/// run's texts for any seed; a prompt outside the vocabulary is named.
#[test]
fn sample_gives_the_runs_samples_again_and_reads_gpt2_folders() {
    let tmp = tempfile::tempdir().expect("tempdir");
    train_tiny(tmp.path(), "run", 10, &["sample.count=2"]).expect_code(0);
    let run = tmp.path().join("run");
    let written = std::fs::read_to_string(run.join("samples.txt")).expect("samples.txt");
    let mut texts: Vec<String> = Vec::new();
    for line in written.lines() {
        if line.starts_with("--- sample ") {
            texts.push(String::new());
        } else if let Some(text) = texts.last_mut() {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(line);
        }
    }
    assert_eq!(texts.len(), 2, "{written}");
    let json = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["sample"];
        all.extend_from_slice(args);
        all.push("--json");
        serde_json::from_str(&kiln(&all).run().expect_code(0).stdout).expect("json")
    };
    let run_str = run.to_str().expect("utf-8");
    let again = json(&[run_str]);
    let continuations: Vec<String> =
        serde_json::from_value(again["continuations"].clone()).expect("continuations");
    assert_eq!(continuations, texts);
    assert_eq!(again["source"], format!("step 10 of `{run_str}`"));

    let hf = tmp.path().join("hf");
    let hf_str = hf.to_str().expect("utf-8");
    kiln(&["export", run_str, "--out", hf_str])
        .run()
        .expect_code(0);
    let settings = ["--seed", "7", "-n", "3", "--tokens", "15", "--top-k", "5"];
    let from_run = json(&[&[run_str][..], &settings[..]].concat());
    let from_hf = json(&[&[hf_str][..], &settings[..]].concat());
    assert_eq!(from_run["continuations"], from_hf["continuations"]);
    assert_ne!(from_run["continuations"], again["continuations"]);
    assert_eq!(from_hf["source"], format!("the GPT-2 folder `{hf_str}`"));
    // transformers' `generate` names for the same settings.
    let hf_names = [
        "--seed",
        "7",
        "--num-return-sequences",
        "3",
        "--max-new-tokens",
        "15",
        "--top-k",
        "5",
    ];
    let by_hf_names = json(&[&[hf_str][..], &hf_names[..]].concat());
    assert_eq!(by_hf_names["continuations"], from_hf["continuations"]);

    // Plain text: the prompt, then what follows it.
    let out = kiln(&["sample", run_str, "--prompt", "ROMEO:", "-n", "1"])
        .run()
        .expect_code(0);
    assert!(
        out.stdout.starts_with("--- sample 1\nROMEO:"),
        "{}",
        out.stdout
    );
    kiln(&["sample", run_str, "--prompt", "the €"])
        .run()
        .expect_code(2)
        .stderr_has(&["'€' is not in the model's vocabulary"]);
    kiln(&["sample", run_str, "--prompt", "the € ©"])
        .run()
        .expect_code(2)
        .stderr_has(&["'©', '€' are not in the model's vocabulary"]);
    kiln(&["sample", tmp.path().to_str().expect("utf-8")])
        .run()
        .expect_code(2)
        .stderr_has(&["neither config.toml (a kiln run) nor config.json"]);
}

/// A model whose logits are NaN (a GPT-2 folder's weights set to NaN, as
/// a divergence leaves them): `kiln sample` refuses with exit 2 where
/// drawing from NaN panicked; a run from those weights (every step
/// skipped, fewer in a row than precision.max_bad_steps) finishes with its
/// summary, its NaN steps and evaluations counted (their `null`s read back
/// as NaN, where the lines were dropped) and never its best, and
/// `samples.txt` says why it holds no texts.
#[test]
fn a_diverged_model_is_refused_by_sample_and_a_run_ending_so_says_why() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = exported_tiny(tmp.path(), 2, &[]);
    let bytes = std::fs::read(hf.join("model.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let nan: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::tensor::Dtype::F32, "{name}");
            let values = view.data().len() / 4;
            let data = f32::NAN.to_le_bytes().repeat(values);
            (name, view.shape().to_vec(), data)
        })
        .collect();
    write_f32_safetensors(&hf.join("model.safetensors"), &nan);
    let hf_str = hf.to_str().expect("utf-8");
    kiln(&["sample", hf_str]).run().expect_code(2).stderr_has(&[
        &format!("the GPT-2 folder `{hf_str}`: the model's logits for token 1 of the continuation are not finite (NaN or infinite): its weights diverged"),
        "--best",
    ]);

    let from = format!("model.init_from={hf_str}");
    let out = train_tiny(
        tmp.path(),
        "run",
        2,
        &[&from, "logging.logging_steps=1", "eval.eval_steps=1"],
    )
    .expect_code(0);
    out.stdout_has(&[
        "step 2: the loss is NaN: step skipped",
        "no samples: the run's final model: the model's logits for token 1 of the continuation are not finite",
        "done: 2 steps",
        "val loss NaN (best n/a)",
    ]);
    let run = tmp.path().join("run");
    let samples = std::fs::read_to_string(run.join("samples.txt")).expect("samples.txt");
    assert!(samples.starts_with("no samples: "), "{samples}");
    assert!(
        !run.join("best.safetensors").exists(),
        "a NaN evaluation kept as the best"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("summary.json")).expect("summary.json"),
    )
    .expect("json");
    assert_eq!(summary["steps"], 2, "{summary}");
    assert!(summary["best_val_loss"].is_null(), "{summary}");
    kiln(&["sample", run.to_str().expect("utf-8")])
        .run()
        .expect_code(2)
        .stderr_has(&["step 2 of `", "are not finite (NaN or infinite)"]);
}

/// A run records what it trained on (`data.json`); a resume on other
/// tokens says that its batches are not the run's, and one on the same
/// tokens says nothing.
#[test]
fn a_resume_on_changed_data_says_so() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    train_tiny(dir, "run", 2, &["checkpoint.every_steps=1"]).expect_code(0);
    let run = dir.join("run");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("data.json")).expect("data.json"))
            .expect("json");
    assert_eq!(saved["train_tokens"], 36_000, "{saved}");
    let run_str = run.to_str().expect("utf-8");
    let same = kiln(&["resume", run_str, "training.max_steps=3"])
        .run()
        .expect_code(0);
    assert!(
        !same.stdout.contains("not what the run trained on"),
        "{}",
        same.stdout
    );
    let corpus = dir.join("corpus.txt");
    let text = std::fs::read_to_string(&corpus).expect("corpus");
    std::fs::write(&corpus, text.replace('e', "a")).expect("write");
    kiln(&["resume", run_str, "training.max_steps=4"])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "warning: the data is not what the run trained on",
            "holds as many tokens as before (36000 training, 4000 validation), but others",
        ]);
    std::fs::write(&corpus, format!("{text}more")).expect("write");
    kiln(&["resume", run_str, "training.max_steps=5"])
        .run()
        .expect_code(0)
        .stdout_has(&["where the run had 36000 and 4000"]);
}

/// A GPT-2 folder `kiln sample` cannot read is named as the command line
/// gave it, not as `model.init_from` (the key training's same checks name).
#[test]
fn sample_names_a_faulty_folder_without_the_training_key() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = exported_tiny(tmp.path(), 2, &[]);
    let hf_str = hf.to_str().expect("utf-8");
    std::fs::rename(hf.join("model.safetensors"), tmp.path().join("w")).expect("move");
    let out = kiln(&["sample", hf_str]).run().expect_code(2);
    out.stderr_has(&[&format!("error: `{hf_str}` has no model.safetensors")]);
    assert!(!out.stderr.contains("model.init_from"), "{}", out.stderr);
    std::fs::rename(tmp.path().join("w"), hf.join("model.safetensors")).expect("move");
    std::fs::remove_file(hf.join("tokenizer.json")).expect("rm");
    let out = kiln(&["sample", hf_str]).run().expect_code(2);
    out.stderr_has(&[&format!(
        "error: `{hf_str}` has no tokenizer.json, which encodes the prompt"
    )]);
    assert!(!out.stderr.contains("model.init_from"), "{}", out.stderr);
}

/// The language model with label smoothing: the first step's loss (the
/// same weights and batch) is the smoothed one, ε · (mean −log p − nll)
/// from the plain run's (both near ln 65 at the start: 8e-4 apart here);
/// the start line says so. Its value is checked against the composition
/// by `check_lm_head_loss`, and the composition's by hand.
#[test]
fn a_language_model_trains_with_label_smoothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let first_loss = |name: &str, extra: &[&str]| {
        let mut args = vec!["logging.logging_steps=1"];
        args.extend(extra);
        let out = train_tiny(tmp.path(), name, 2, &args).expect_code(0);
        let records = step_records(&tmp.path().join(name).join("metrics.jsonl"));
        (out, records[0]["loss"].as_f64().expect("a loss"))
    };
    let (_, plain) = first_loss("plain", &[]);
    let (smoothed_out, smoothed) = first_loss("smoothed", &["training.label_smoothing=0.1"]);
    smoothed_out.stdout_has(&["clip 1, label smoothing 0.1"]);
    assert!((smoothed - plain).abs() > 1e-4, "{smoothed} vs {plain}");
}

/// 60 steps, 20 of warm-up, the last quarter of the 40 after it (10
/// steps, 51–60) decaying: the peak at step 50, halfway down at 55.
#[test]
fn a_wsd_schedule_holds_the_peak_then_decays_and_says_so() {
    let tmp = tempfile::tempdir().expect("tempdir");
    train_tiny(
        tmp.path(),
        "wsd",
        60,
        &[
            "training.lr_schedule=wsd",
            "training.decay_fraction=0.25",
            "logging.logging_steps=5",
        ],
    )
    .expect_code(0)
    .stdout_has(&["(warm-up 20, then constant, linear to 0.0001 over the last 10 steps)"]);
    let lr = |step| logged_lr(&tmp.path().join("wsd/metrics.jsonl"), step);
    assert!((lr(30) - 1e-3).abs() < 1e-12, "{}", lr(30));
    assert!((lr(50) - 1e-3).abs() < 1e-12, "{}", lr(50));
    assert!((lr(55) - 5.5e-4).abs() < 1e-12, "{}", lr(55));
    assert!((lr(60) - 1e-4).abs() < 1e-12, "{}", lr(60));
}

/// `training.warmup_ratio` warms up for that share of the run, rounded up,
/// in place of `training.warmup_steps` (20 in the tiny run, beyond its 10
/// steps: no warning now), and the start line says so.
#[test]
fn a_warm_up_ratio_warms_up_for_that_share_of_the_run() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = train_tiny(
        tmp.path(),
        "ratio",
        10,
        &["training.warmup_ratio=0.25", "logging.logging_steps=1"],
    )
    .expect_code(0);
    run.stdout_has(&["(warm-up 3: training.warmup_ratio 0.25, cosine to 0.0001)"]);
    assert!(
        !run.stdout.contains("warning: training.warmup"),
        "{}",
        run.stdout
    );
    let lr = |step| logged_lr(&tmp.path().join("ratio/metrics.jsonl"), step);
    assert!((lr(1) - 1e-3 / 3.0).abs() < 1e-12, "{}", lr(1));
    assert!((lr(3) - 1e-3).abs() < 1e-12, "{}", lr(3));
    assert!(lr(4) < 1e-3);
}

/// WSD's point: a run's length need not be fixed in advance. A 200-step
/// run decays over its last 36; resumed from its step-100 checkpoint (still
/// at the peak) with 300 steps, it ends bitwise where a 300-step run
/// ends, and its first ending is kept aside.
#[test]
fn a_wsd_run_resumed_from_its_stable_phase_with_more_steps_is_the_longer_run() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let wsd = ["training.lr_schedule=wsd", "training.decay_fraction=0.2"];
    let mut long = tiny(tmp.path(), "long", 300);
    long.extend(wsd.iter().map(|s| s.to_string()));
    run_kiln(&long).expect_code(0);
    train_tiny(tmp.path(), "short", 200, &wsd)
        .expect_code(0)
        .stdout_has(&["linear to 0.0001 over the last 36 steps"]);
    let short = tmp.path().join("short");
    kiln(&[
        "resume",
        short.to_str().expect("utf-8"),
        "--from",
        "100",
        "training.max_steps=300",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["from step 100", "training.max_steps 200 → 300"]);
    assert_eq!(
        checkpoint_digest(&ckpt(&short, 300)),
        checkpoint_digest(&ckpt(&tmp.path().join("long"), 300))
    );
    assert!(
        short
            .join("checkpoints/after-100/ckpt-00000200.safetensors")
            .is_file()
    );
}

#[test]
fn a_linear_schedule_decays_in_a_line_and_says_so() {
    let tmp = tempfile::tempdir().expect("tempdir");
    train_tiny(tmp.path(), "linear", 60, &["training.lr_schedule=linear"])
        .expect_code(0)
        .stdout_has(&["(warm-up 20, linear to 0.0001)"]);
    let lr = logged_lr(&tmp.path().join("linear/metrics.jsonl"), 50);
    // Three quarters of the way from the peak 1e-3 to the floor 1e-4.
    let want = 1e-3 + (50.0 - 20.0) / (60.0 - 20.0) * (1e-4 - 1e-3);
    assert!((lr - want).abs() < 1e-12, "lr {lr}, want {want}");
}

/// `kiln eval --json` of `from` on `text` (a text or a token store): the
/// measures.
pub(crate) fn eval_json(from: &Path, text: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "eval".to_string(),
        from.display().to_string(),
        "--data".into(),
        text.display().to_string(),
        "--json".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = run_kiln(&args).expect_code(0);
    serde_json::from_str(&out.stdout).expect("eval --json")
}

#[test]
fn eval_scores_every_token_as_gpt2s_forward_pass_in_python_does() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = tmp.path().join("run");
    train_tiny(tmp.path(), "run", 60, &[]).expect_code(0);
    let corpus = std::fs::read_to_string(tmp.path().join("corpus.txt")).expect("corpus");
    let text = tmp.path().join("text.txt");
    std::fs::write(&text, &corpus[..300]).expect("write text");
    // Block 32, stride 8: a first window scoring 32 tokens, then 34 more
    // scoring 8 (the last 3) of the 299 after the first.
    let e = eval_json(&run, &text, &["--stride", "8"]);
    assert_eq!(e["tokens"], 299);
    assert_eq!(e["windows"], 35);
    assert_eq!(
        (e["block"].clone(), e["stride"].clone()),
        (32.into(), 8.into())
    );
    let loss = e["loss"].as_f64().expect("loss");
    assert!((e["perplexity"].as_f64().expect("ppl") - loss.exp()).abs() < 1e-9);
    let bits = e["bits_per_byte"].as_f64().expect("bpb");
    assert!((bits - loss * 299.0 / std::f64::consts::LN_2 / 300.0).abs() < 1e-9);
    // Without overlap each token has less context: another loss.
    let whole = eval_json(&run, &text, &[]);
    assert_eq!(whole["windows"], 10);
    assert_ne!(whole["loss"], e["loss"]);
    // The exported GPT-2 folder scores the same, and so does GPT-2's
    // forward pass as transformers computes it, in plain Python.
    let hf = tmp.path().join("hf");
    run_kiln(&[
        "export".into(),
        run.display().to_string(),
        "--out".into(),
        hf.display().to_string(),
    ])
    .expect_code(0);
    let folder = eval_json(&hf, &text, &["--stride", "8"]);
    assert!((folder["loss"].as_f64().expect("loss") - loss).abs() < 1e-6);
    let check = std::process::Command::new("python3")
        .arg(root().join("scripts/gpt2_forward.py"))
        .arg(&hf)
        .args(["--text", &text.display().to_string(), "--stride", "8"])
        .args(["--expect-loss", &loss.to_string(), "--tolerance", "1e-5"])
        .output()
        .expect("python3 runs scripts/gpt2_forward.py");
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && said.contains("299 tokens scored") && said.contains("-> ok"),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    // Bad input is named, exit 2.
    let unknown = tmp.path().join("unknown.txt");
    std::fs::write(&unknown, "To be, or not to be: 5 €").expect("write");
    let path = |p: &Path| p.display().to_string();
    run_kiln(&["eval".into(), path(&run), "--data".into(), path(&unknown)])
        .expect_code(2)
        .stderr_has(&[
            "unknown.txt` cannot be encoded",
            "'€'",
            "not in the model's vocabulary",
        ]);
    for (stride, says) in [
        ("0", "invalid --stride: it is 0"),
        ("33", "invalid --stride: it is 33: a window scores"),
    ] {
        run_kiln(&[
            "eval".into(),
            path(&run),
            "--data".into(),
            path(&text),
            "--stride".into(),
            stride.into(),
        ])
        .expect_code(2)
        .stderr_has(&[says]);
    }
    run_kiln(&[
        "eval".into(),
        path(&run),
        "--data".into(),
        path(&tmp.path().join("none.txt")),
    ])
    .expect_code(2)
    .stderr_has(&["none.txt"]);
}

#[test]
fn lr_find_runs_the_range_test_and_suggests_a_rate_it_tried() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "unused", 1);
    args[0] = "lr-find".into();
    let plot = tmp.path().join("lr.svg");
    args.extend([
        "--steps".into(),
        "40".into(),
        "--min-lr".into(),
        "1e-6".into(),
        "--plot".into(),
        plot.display().to_string(),
        "--json".into(),
    ]);
    let out = run_kiln(&args).expect_code(0);
    let found: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    let points = found["points"].as_array().expect("points");
    assert!(points.len() > 12, "{} steps", points.len());
    assert_eq!(found["diverged"], points.len() < 40);
    let lrs: Vec<f64> = points
        .iter()
        .map(|p| p["lr"].as_f64().expect("lr"))
        .collect();
    assert!((lrs[0] / 1e-6 - 1.0).abs() < 1e-9);
    // Geometric: each rate the same factor above the one before.
    let factor = (1.0f64 / 1e-6).powf(1.0 / 39.0);
    for pair in lrs.windows(2) {
        assert!((pair[1] / pair[0] / factor - 1.0).abs() < 1e-9);
    }
    let suggestion = found["suggestion"].as_f64().expect("a suggestion");
    assert!(lrs.contains(&suggestion));
    // Looked for before the lowest smoothed loss, which is past the start.
    assert_eq!(found["fell"], true);
    assert!(suggestion <= found["min_loss_lr"].as_f64().expect("min_loss_lr"));
    // The loss falls somewhere in the range: the tiny model learns.
    let smoothed: Vec<f64> = points
        .iter()
        .map(|p| p["smoothed"].as_f64().expect("smoothed"))
        .collect();
    assert!(smoothed.iter().copied().fold(f64::INFINITY, f64::min) < smoothed[0] - 0.05);
    let svg = std::fs::read_to_string(&plot).expect("the plot");
    assert!(svg.starts_with("<svg") && svg.contains("learning-rate range test"));
    // A fine-tune's range starts from the model it fine-tunes: a tiny run's
    // export, whose loss is far below a drawn model's.
    train_tiny(tmp.path(), "source", 60, &[]).expect_code(0);
    let folder = tmp.path().join("hf");
    run_kiln(&[
        "export".into(),
        tmp.path().join("source").display().to_string(),
        "--out".into(),
        folder.display().to_string(),
    ])
    .expect_code(0);
    let first_loss = |extra: &[String]| {
        let mut args = tiny(tmp.path(), "unused", 1);
        args[0] = "lr-find".into();
        args.extend(
            [
                "--steps", "12", "--min-lr", "1e-12", "--max-lr", "1e-11", "--json",
            ]
            .map(String::from),
        );
        args.extend(extra.iter().cloned());
        let out = run_kiln(&args).expect_code(0);
        let found: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
        found["points"][0]["loss"].as_f64().expect("loss")
    };
    let drawn = first_loss(&[]);
    let tuned = first_loss(&[format!("model.init_from={}", folder.display())]);
    assert!(
        tuned < drawn - 0.3,
        "from the folder {tuned}, drawn {drawn}"
    );
    // A range upside down is named, exit 2.
    let mut bad = tiny(tmp.path(), "unused", 1);
    bad[0] = "lr-find".into();
    bad.extend([
        "--min-lr".into(),
        "1".into(),
        "--max-lr".into(),
        "1e-3".into(),
    ]);
    run_kiln(&bad)
        .expect_code(2)
        .stderr_has(&["needs 0 < --min-lr < --max-lr"]);
}
