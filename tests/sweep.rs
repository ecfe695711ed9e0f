//! `kiln train -m` and `kiln cv -m` (Hydra's multirun) and `kiln resume
//! SWEEP`, on the tiny runs of `train.rs` and `nli.rs`.

use std::path::Path;

use crate::support::{kiln, start_until};

/// `kiln train -m` with the tiny run's arguments (its folder `run`) and
/// `sweep` after them.
fn sweep_args(dir: &Path, run: &str, steps: u32, sweep: &[&str]) -> Vec<String> {
    let mut args = crate::train::tiny(dir, run, steps);
    args.insert(1, "-m".into());
    args.extend(sweep.iter().map(|s| s.to_string()));
    args
}

fn run(args: &[String]) -> crate::support::Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run()
}

fn record(sweep: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(sweep.join("sweep.json")).expect("sweep.json");
    serde_json::from_str(&text).expect("json")
}

fn statuses(sweep: &Path) -> Vec<String> {
    record(sweep)["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["status"].as_str().expect("status").to_string())
        .collect()
}

fn job_dirs(sweep: &Path) -> Vec<std::path::PathBuf> {
    record(sweep)["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| sweep.join(j["dir"].as_str().expect("dir")))
        .collect()
}

fn summary_value(run: &Path, file: &str, key: &str) -> f64 {
    let text = std::fs::read_to_string(run.join(file)).expect("summary");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} in {}", run.display()))
}

#[test]
fn a_sweep_runs_every_combination_and_marks_the_best() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sweep = tmp.path().join("sw");
    let args = sweep_args(
        tmp.path(),
        "sw",
        60,
        &[
            "training.learning_rate=1e-3,3e-3",
            "model.layers=range(1,3)",
        ],
    );
    let out = run(&args).expect_code(0);
    out.stdout_has(&[
        "sweep of 4 jobs",
        "training.learning_rate (1e-3, 3e-3) × model.layers (1, 2)",
        "job  training.learning_rate  model.layers  status    best_val_loss  tokens/s",
    ]);
    assert_eq!(statuses(&sweep), ["finished"; 4]);
    let dirs = job_dirs(&sweep);
    let names: Vec<_> = dirs
        .iter()
        .map(|d| d.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "0-learning_rate=1e-3,layers=1",
            "1-learning_rate=1e-3,layers=2",
            "2-learning_rate=3e-3,layers=1",
            "3-learning_rate=3e-3,layers=2",
        ]
    );
    // Each job is a run of its own values.
    for (dir, (lr, layers)) in dirs
        .iter()
        .zip([(1e-3, 1), (1e-3, 2), (3e-3, 1), (3e-3, 2)])
    {
        let config = kiln_config::read_run_config(&dir.join("config.toml")).expect("config");
        assert_eq!(config.training.learning_rate, lr, "{}", dir.display());
        assert_eq!(config.model.layers, layers, "{}", dir.display());
    }
    // The best is the lowest validation loss of the four summaries.
    let losses: Vec<f64> = dirs
        .iter()
        .map(|d| summary_value(d, "summary.json", "best_val_loss"))
        .collect();
    let best = (0..4)
        .min_by(|&a, &b| losses[a].total_cmp(&losses[b]))
        .expect("best");
    let labels = [
        "training.learning_rate=1e-3 model.layers=1",
        "training.learning_rate=1e-3 model.layers=2",
        "training.learning_rate=3e-3 model.layers=1",
        "training.learning_rate=3e-3 model.layers=2",
    ];
    out.stdout_has(&[&format!(
        "best (*): job {best} ({}), best_val_loss {:.4}: {}",
        labels[best],
        losses[best],
        dirs[best].display()
    )]);
    // Each job scores a text, in a table; --json lists them.
    let text = tmp.path().join("text.txt");
    let corpus = std::fs::read_to_string(tmp.path().join("corpus.txt")).expect("corpus");
    std::fs::write(&text, &corpus[..200]).expect("text");
    let scored = kiln(&[
        "eval",
        &sweep.display().to_string(),
        "--data",
        &text.display().to_string(),
        "--json",
    ])
    .run()
    .expect_code(0);
    let list: serde_json::Value = serde_json::from_str(&scored.stdout).expect("json");
    let list = list.as_array().expect("a list");
    assert_eq!(list.len(), 4);
    assert_eq!(list[2]["job"], labels[2]);
    assert_eq!(list[2]["eval"]["tokens"], 199);
    // Done: a resume runs nothing and prints the table again.
    let written = std::fs::metadata(dirs[0].join("summary.json"))
        .and_then(|m| m.modified())
        .expect("mtime");
    kiln(&["resume", &sweep.display().to_string()])
        .run()
        .expect_code(0)
        .stdout_has(&["0 of 4 jobs to run", "best (*): job"]);
    assert_eq!(
        std::fs::metadata(dirs[0].join("summary.json"))
            .and_then(|m| m.modified())
            .expect("mtime"),
        written
    );
    // A sweep resumes as configured; the same folder is not swept twice.
    kiln(&[
        "resume",
        &sweep.display().to_string(),
        "training.max_steps=100",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&["is a sweep: it resumes its jobs as they were configured"]);
    run(&args)
        .expect_code(2)
        .stderr_has(&["already holds a sweep; resume it with `kiln resume"]);
}

#[test]
fn every_job_is_checked_before_the_first_starts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sweep = tmp.path().join("sw");
    run(&sweep_args(
        tmp.path(),
        "sw",
        60,
        &["training.learning_rate=1e-3,abc", "model.layers=1,0"],
    ))
    .expect_code(2)
    .stderr_has(&[
        "3 of the sweep's 4 jobs would be refused; none was started",
        "job 1 (training.learning_rate=1e-3 model.layers=0): invalid value 0 for `model.layers`",
        "job 2 (training.learning_rate=abc model.layers=1): invalid value \"abc\" for `training.learning_rate`",
    ]);
    assert!(!sweep.exists(), "nothing is written for a refused sweep");
    for (bad, says) in [
        ("model.layers=range(0)", "range(0) is empty"),
        ("model.layers=1,,2", "an empty value"),
        ("run.dir=a,b", "`run.dir` cannot be swept"),
        (
            "experiment=shakespeare_char,nli_snli",
            "a sweep compares runs of one workload",
        ),
    ] {
        run(&sweep_args(tmp.path(), "sw", 60, &[bad]))
            .expect_code(2)
            .stderr_has(&[says]);
        assert!(!sweep.exists(), "{bad}");
    }
    // Without -m, a comma-separated value is one value, and says how to sweep it.
    let mut args = crate::train::tiny(tmp.path(), "sw", 60);
    args.push("model.layers=1,2".into());
    run(&args)
        .expect_code(2)
        .stderr_has(&["to run one job per value, add -m"]);
}

#[test]
fn ctrl_c_stops_a_sweep_with_a_checkpoint_and_resume_ends_as_an_uninterrupted_sweep() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 2000;
    let lrs = ["training.learning_rate=1e-3,3e-3"];
    run(&sweep_args(tmp.path(), "whole", steps, &lrs)).expect_code(0);
    let cut = tmp.path().join("cut");
    let child = start_until(
        &sweep_args(tmp.path(), "cut", steps, &lrs),
        &cut.join("0-learning_rate=1e-3/checkpoints/ckpt-00000100.safetensors"),
    );
    // To the sweep alone: it passes Ctrl-C on to its job.
    crate::support::signal(child.id(), "-INT");
    let stdout = crate::support::interrupted_stdout(child.wait_with_output().expect("wait"));
    assert!(
        stdout.contains(&format!("resume with: kiln resume {}\n", cut.display())),
        "{stdout}"
    );
    assert_eq!(statuses(&cut), ["interrupted", "pending"]);
    kiln(&["resume", &cut.display().to_string()])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "2 of 2 jobs to run",
            "(training.learning_rate=1e-3), resumed: ",
        ]);
    assert_eq!(statuses(&cut), ["finished", "finished"]);
    for (whole, cut) in job_dirs(&tmp.path().join("whole"))
        .iter()
        .zip(job_dirs(&cut))
    {
        assert_eq!(
            summary_value(&cut, "summary.json", "steps"),
            f64::from(steps)
        );
        assert_eq!(
            summary_value(&cut, "summary.json", "final_val_loss").to_bits(),
            summary_value(whole, "summary.json", "final_val_loss").to_bits(),
            "{}",
            cut.display()
        );
    }
}

#[test]
fn a_failed_job_is_recorded_with_its_error_the_sweep_goes_on_and_resume_retries_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sweep = tmp.path().join("sw");
    let later = tmp.path().join("later.txt");
    let paths = format!(
        "data.path={},{}",
        later.display(),
        tmp.path().join("corpus.txt").display()
    );
    // `tiny` writes corpus.txt.
    let args = sweep_args(tmp.path(), "sw", 60, &[&paths]);
    let out = run(&args).expect_code(1);
    out.stdout_has(&[
        "job 0 failed: failed to read",
        "some jobs failed; `kiln resume",
    ]);
    assert_eq!(statuses(&sweep), ["failed", "finished"]);
    let job = &record(&sweep)["jobs"][0];
    assert_eq!(job["exit"], "exit code 2");
    assert!(
        job["error"]
            .as_str()
            .is_some_and(|e| e.contains("later.txt")),
        "{job}"
    );
    std::fs::copy(tmp.path().join("corpus.txt"), &later).expect("copy");
    kiln(&["resume", &sweep.display().to_string()])
        .run()
        .expect_code(0)
        .stdout_has(&["1 of 2 jobs to run"]);
    assert_eq!(statuses(&sweep), ["finished", "finished"]);
}

#[test]
fn a_cross_validation_sweep_ranks_by_macro_f1() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = crate::nli::tiny(tmp.path(), "sw", 1);
    args.insert(1, "-m".into());
    args.push("training.learning_rate=1e-3,1e-2".into());
    let out = run(&args).expect_code(0);
    let sweep = tmp.path().join("sw");
    assert_eq!(record(&sweep)["objective"]["name"], "macro_f1_mean");
    let f1: Vec<f64> = job_dirs(&sweep)
        .iter()
        .map(|d| summary_value(d, "cv_summary.json", "macro_f1_mean"))
        .collect();
    let best = usize::from(f1[1] > f1[0]);
    out.stdout_has(&["macro_f1_mean  pairs/s", &format!("best (*): job {best} ")]);
}

#[test]
fn jobs_run_two_at_a_time_on_a_gpu_each_and_stop_and_resume_together() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 2000;
    // Two GPUs, as a saved report says; the jobs train on the CPU, so that
    // the GPU each was given shows in its configuration only.
    let report = crate::support::fake_report(
        tmp.path(),
        &[("NVIDIA A30", 24, (8, 0)), ("NVIDIA A30", 24, (8, 0))],
    );
    let with = |run: &str| {
        let mut args = vec![format!("--hardware-report={}", report.display())];
        args.extend(sweep_args(
            tmp.path(),
            run,
            steps,
            &[
                "--jobs",
                "2",
                "device.backend=flex",
                "training.learning_rate=1e-3,3e-3",
            ],
        ));
        args
    };
    run(&with("whole")).expect_code(0).stdout_has(&[
        "job 0 (training.learning_rate=1e-3) started on GPU 0",
        "job 1 (training.learning_rate=3e-3) started on GPU 1",
        "job 0 finished: best_val_loss",
    ]);
    let cut = tmp.path().join("cut");
    let jobs = ["0-learning_rate=1e-3", "1-learning_rate=3e-3"];
    for (index, job) in jobs.iter().enumerate() {
        let config =
            kiln_config::read_run_config(&tmp.path().join("whole").join(job).join("config.toml"))
                .expect("config");
        assert_eq!(config.device.index, index, "{job}");
    }
    // Ctrl-C once both have a checkpoint: both stop with one.
    let child = start_until(
        &with("cut"),
        &cut.join(jobs[0])
            .join("checkpoints/ckpt-00000100.safetensors"),
    );
    crate::support::wait_for(
        &cut.join(jobs[1])
            .join("checkpoints/ckpt-00000100.safetensors"),
    );
    crate::support::signal(child.id(), "-INT");
    let stdout = crate::support::interrupted_stdout(child.wait_with_output().expect("wait"));
    assert!(
        stdout.contains("job 0 stopped with a checkpoint"),
        "{stdout}"
    );
    assert!(
        stdout.contains("job 1 stopped with a checkpoint"),
        "{stdout}"
    );
    assert_eq!(statuses(&cut), ["interrupted", "interrupted"]);
    let log = std::fs::read_to_string(cut.join(jobs[1]).join("kiln.log")).expect("log");
    assert!(log.contains("interrupted after step"), "{log}");
    // Resumed two at a time again (the sweep keeps its --jobs), each ends
    // where the uninterrupted sweep's did.
    kiln(&["resume", &cut.display().to_string()])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "job 0 (training.learning_rate=1e-3) resumed on GPU 0",
            "job 1 (training.learning_rate=3e-3) resumed on GPU 1",
        ]);
    for job in jobs {
        assert_eq!(
            summary_value(&cut.join(job), "summary.json", "final_val_loss").to_bits(),
            summary_value(
                &tmp.path().join("whole").join(job),
                "summary.json",
                "final_val_loss"
            )
            .to_bits(),
            "{job}"
        );
    }
    // One dashboard shows one job.
    let mut tui = with("tui");
    tui.push("--tui".into());
    run(&tui)
        .expect_code(2)
        .stderr_has(&["--tui shows one job"]);
}

#[test]
fn random_search_draws_its_trials_the_same_for_a_seed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let search = |name: &str, seed: &str| {
        let mut args = sweep_args(
            tmp.path(),
            name,
            20,
            &[
                "--trials",
                "3",
                "--search-seed",
                seed,
                "training.learning_rate=tag(log, interval(1e-4, 1e-2))",
                "training.warmup_steps=int(interval(1, 10))",
            ],
        );
        args.push("eval.eval_steps=20".into());
        run(&args).expect_code(0).stdout_has(&[
            "random search (seed",
            "of 3 jobs",
            "drawing training.learning_rate from tag(log, interval(1e-4, 1e-2))",
        ]);
        let sweep = tmp.path().join(name);
        let axes = record(&sweep)["axes"].clone();
        assert_eq!(axes[1]["drawn_from"], "int(interval(1, 10))");
        // Each job ran with its draws.
        for (n, dir) in job_dirs(&sweep).iter().enumerate() {
            let config = kiln_config::read_run_config(&dir.join("config.toml")).expect("config");
            let lr: f64 = axes[0]["values"][n]
                .as_str()
                .expect("lr")
                .parse()
                .expect("number");
            assert_eq!(config.training.learning_rate, lr);
            assert!((1e-4..1e-2).contains(&lr), "{lr}");
            let warmup = axes[1]["values"][n].as_str().expect("warmup");
            assert_eq!(config.training.warmup_steps.to_string(), warmup);
        }
        axes
    };
    let first = search("a", "3");
    assert_eq!(
        search("b", "3"),
        first,
        "the same seed draws the same trials"
    );
    assert_ne!(search("c", "4"), first);
    // A distribution is drawn, not listed: without --trials it is refused.
    run(&sweep_args(
        tmp.path(),
        "d",
        20,
        &["training.learning_rate=interval(1e-4, 1e-2)"],
    ))
    .expect_code(2)
    .stderr_has(&["add --trials N"]);
}

#[test]
fn the_median_rule_stops_a_job_behind_the_finished_ones_with_a_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sweep = tmp.path().join("sw");
    // Job 1 learns 15 times slower: at its first evaluation (step 100) its
    // loss is above job 0's there, the median of one finished job. (The
    // sweep may read it first at a later evaluation on a busy machine:
    // the step is not asserted.)
    let out = run(&sweep_args(
        tmp.path(),
        "sw",
        2000,
        &[
            "--prune",
            "--prune-startup",
            "1",
            "training.min_lr=1e-5",
            "training.learning_rate=3e-3,2e-4",
        ],
    ))
    .expect_code(0);
    out.stdout_has(&[
        "kiln: job 1 pruned at step ",
        "above the finished jobs' median",
        "best (*): job 0 ",
    ]);
    assert_eq!(statuses(&sweep), ["finished", "pruned"]);
    let pruned = &job_dirs(&sweep)[1];
    assert!(!pruned.join("summary.json").exists());
    let checkpoints = std::fs::read_dir(pruned.join("checkpoints"))
        .expect("checkpoints")
        .count();
    assert!(checkpoints >= 1, "it stopped with a checkpoint");
    // Pruned is done: a resume runs nothing.
    kiln(&["resume", &sweep.display().to_string()])
        .run()
        .expect_code(0)
        .stdout_has(&["0 of 2 jobs to run", "job 1 pruned at step "]);
    // A cross-validation's folds have cv.patience instead.
    let mut cv = crate::nli::tiny(tmp.path(), "cv", 1);
    cv.splice(1..1, ["-m".to_string(), "--prune".into()]);
    cv.push("training.learning_rate=1e-3,3e-3".into());
    run(&cv)
        .expect_code(2)
        .stderr_has(&["--prune compares a language model's evaluations"]);
}

/// A sweep stopped while its jobs still prepare their data says so, not
/// "stopped with a checkpoint": the jobs end at once, with nothing to save
/// (here the corpus is a FIFO no one writes, so they wait in their
/// preparation until the signal).
#[test]
fn jobs_stopped_before_their_first_step_are_said_to_be() {
    let tmp = tempfile::tempdir().expect("tempdir");
    crate::support::unwritten_fifo(&tmp.path().join("corpus.txt"));
    let sweep = tmp.path().join("early");
    let args = sweep_args(
        tmp.path(),
        "early",
        10,
        &["--jobs", "2", "training.learning_rate=1e-3,3e-3"],
    );
    let child = crate::support::spawn(&args, std::process::Stdio::piped);
    for job in ["0-learning_rate=1e-3", "1-learning_rate=3e-3"] {
        let log = sweep.join(job).join("kiln.log");
        crate::support::wait_for_line(&log, "preparing them into the token store");
    }
    crate::support::signal(child.id(), "-INT");
    let out = crate::support::exit_within(child, 60, "the jobs' corpus to be read");
    let stdout = crate::support::interrupted_stdout(out);
    for n in [0, 1] {
        assert!(
            stdout.contains(&format!("job {n} stopped before its first step")),
            "{stdout}"
        );
    }
    assert_eq!(statuses(&sweep), ["interrupted", "interrupted"]);
}
