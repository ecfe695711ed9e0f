//! `kiln cv` and `kiln predict` on a tiny encoder and made-up pairs, as a
//! user runs them; the fold split on the shipped SNLI sample.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::support::{kill_when, kiln, root};

/// 60 premises with one hypothesis per label; every premise carries a word
/// of its own (`zq` and two letters: none is a prefix of another), so a
/// tokenizer's vocabulary shows which premises it saw.
fn write_pairs(dir: &Path) -> PathBuf {
    let labels = ["entailment", "neutral", "contradiction"];
    let hyps = [
        "a person is outside",
        "the person is happy today",
        "nobody is outside at all",
    ];
    let mut text = String::new();
    for p in 0..60 {
        for (l, h) in labels.iter().zip(hyps) {
            text.push_str(&format!(
                "{{\"premise\": \"{} walks a dog in the park number {}\", \"hypothesis\": \"{h}\", \"label\": \"{l}\"}}\n",
                unique_word(p),
                p % 7
            ));
        }
    }
    let path = dir.join("pairs.jsonl");
    std::fs::write(&path, text).expect("write pairs");
    path
}

fn unique_word(p: usize) -> String {
    let letter = |i: usize| char::from(b'a' + (i % 26) as u8);
    format!("zq{}{}", letter(p / 26), letter(p))
}

pub(crate) fn tiny(dir: &Path, run: &str, epochs: u32) -> Vec<String> {
    let data = write_pairs(dir);
    vec![
        "cv".to_string(),
        "hardware=cpu".into(),
        format!("data.path={}", data.display()),
        format!("run.dir={}", dir.join(run).display()),
        "cv.folds=3".into(),
        "cv.patience=0".into(),
        "data.vocab_size=300".into(),
        "model.layers=1".into(),
        "model.heads=2".into(),
        "model.hidden=16".into(),
        "model.intermediate=32".into(),
        "model.max_length=32".into(),
        "training.batch_size=8".into(),
        "training.gradient_accumulation_steps=1".into(),
        "training.warmup_steps=5".into(),
        format!("training.epochs={epochs}"),
        "eval.batch_size=32".into(),
        "eval.eval_steps=1000".into(),
        "logging.logging_steps=20".into(),
        "checkpoint.every_steps=10".into(),
    ]
}

fn run_kiln(args: &[String]) -> crate::support::Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run()
}

fn summary(run: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run.join("cv_summary.json")).expect("cv_summary.json");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("json");
    // Timings differ between runs; the scores must not.
    for key in ["wall_s", "median_samples_per_s"] {
        v.as_object_mut().map(|m| m.remove(key));
    }
    for f in v["folds"].as_array_mut().into_iter().flatten() {
        f.as_object_mut().map(|m| m.remove("median_samples_per_s"));
    }
    v
}

#[test]
fn cv_runs_folds_prints_the_table_and_predicts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = run_kiln(&tiny(tmp.path(), "cv", 2)).expect_code(0);
    run.stdout_has(&[
        "fold 1/3:",
        "fold 3 result",
        "macro-F1",
        "majority baseline",
        "  mean | ",
        " ± ",
    ]);
    let dir = tmp.path().join("cv");
    for f in [
        "cv_summary.json",
        "folds.json",
        "cv_curves.svg",
        "confusion.svg",
        "fold-1/result.json",
        "fold-2/tokenizer.json",
        "fold-3/best.safetensors",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    let s = summary(&dir);
    assert_eq!(s["folds"].as_array().map(Vec::len), Some(3));
    assert_eq!(s["pairs"], 180);
    // Predict the same file: one line per pair, and scores since it has labels.
    // `kiln predict` of the run on `data`: what it printed, the lines it wrote.
    let predict = |data: &Path| {
        let p = kiln(&[
            "predict",
            dir.to_str().expect("utf-8"),
            "--data",
            data.to_str().expect("utf-8"),
        ])
        .run()
        .expect_code(0);
        let stem = data.file_stem().and_then(|s| s.to_str()).expect("a name");
        let out = std::fs::read_to_string(dir.join(format!("predictions-{stem}.jsonl")))
            .expect("predictions");
        (p, out)
    };
    let (p, out) = predict(&tmp.path().join("pairs.jsonl"));
    p.stdout_has(&["predicted 180 pairs", "accuracy"]);
    assert_eq!(out.lines().count(), 180);
    let first: serde_json::Value =
        serde_json::from_str(out.lines().next().expect("a line")).expect("json");
    assert_eq!(first["line"], 1);
    assert!(first["probabilities"]["neutral"].as_f64().is_some());
    // Pairs without labels, as a TSV with no label column: labelled, not scored.
    let tsv = tmp.path().join("new.tsv");
    std::fs::write(
        &tsv,
        "premise\thypothesis\nA man sleeps.\tA person rests.\nA dog runs.\tA cat sleeps.\n",
    )
    .expect("write tsv");
    let (p, out) = predict(&tsv);
    p.stdout_has(&["predicted 2 pairs"]);
    assert!(!p.stdout.contains("accuracy"), "{}", p.stdout);
    assert_eq!(out.lines().count(), 2);
}

#[test]
fn each_fold_tokenizer_saw_only_its_training_premises() {
    let tmp = tempfile::tempdir().expect("tempdir");
    run_kiln(&tiny(tmp.path(), "cv", 1)).expect_code(0);
    let dir = tmp.path().join("cv");
    let folds: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("folds.json")).expect("folds"))
            .expect("json");
    // Line → fold; the premise of line l carries unique_word((l - 1) / 3).
    for k in 1..=3u64 {
        let tok: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("fold-{k}/tokenizer.json")))
                .expect("tokenizer"),
        )
        .expect("json");
        let vocab = tok["model"]["vocab"].as_object().expect("vocab");
        let (mut seen_train, mut seen_held) = (0, 0);
        for f in &folds {
            let line = f["line"].as_u64().expect("line");
            if (line - 1) % 3 != 0 {
                continue;
            }
            let word = unique_word(((line - 1) / 3) as usize);
            if f["fold"].as_u64() == Some(k) {
                assert!(
                    !vocab.contains_key(&word),
                    "fold {k}'s tokenizer knows held-out `{word}`"
                );
                seen_held += 1;
            } else if vocab.contains_key(&word) {
                seen_train += 1;
            }
        }
        assert!(seen_held > 0);
        assert!(
            seen_train > 30,
            "the training premises' words are in the vocabulary ({seen_train})"
        );
    }
}

#[test]
fn a_killed_cv_run_resumes_in_its_fold_and_ends_with_the_same_summary() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let epochs = 12;
    run_kiln(&tiny(tmp.path(), "whole", epochs)).expect_code(0);
    let killed = tmp.path().join("killed");
    kill_when(
        &tiny(tmp.path(), "killed", epochs),
        &killed.join("fold-2/checkpoints/ckpt-00000020.safetensors"),
        &killed.join("fold-2/result.json"),
    );
    assert!(killed.join("fold-1/result.json").is_file());
    assert!(
        !killed.join("fold-2/result.json").exists(),
        "fold 2 finished before the kill"
    );
    let killed_arg = killed.to_str().expect("utf-8");
    // The folds train alike: a resume may not change how.
    kiln(&["resume", killed_arg, "training.learning_rate=1e-4"])
        .run()
        .expect_code(2)
        .stderr_has(&["`training.learning_rate`", "folds"]);
    // What it writes may change, and leaves the result as it was.
    let resumed = kiln(&["resume", killed_arg, "logging.logging_steps=3"])
        .run()
        .expect_code(0);
    resumed.stdout_has(&[
        "resuming with changes: logging.logging_steps",
        "fold 1/3: done before, kept",
        "fold 2: resuming from step",
    ]);
    assert_eq!(summary(&killed), summary(&tmp.path().join("whole")));
    let config = std::fs::read_to_string(killed.join("config.toml")).expect("config.toml");
    assert!(config.contains("logging_steps = 3"), "{config}");
}

#[test]
fn snli_sample_folds_keep_premises_together_and_labels_balanced() {
    let schema = kiln_data::PairSchema {
        premise: "premise".into(),
        hypothesis: "hypothesis".into(),
        label: "label".into(),
        labels: vec![
            "entailment".into(),
            "neutral".into(),
            "contradiction".into(),
        ],
        bad_rows: kiln_data::BadRows::Skip,
        format: kiln_data::PairFormat::Auto,
        require_label: true,
    };
    let data = kiln_data::read_pairs(&root().join("data/snli_sample.jsonl"), &schema)
        .expect("sample reads");
    assert!(data.pairs.len() > 2500);
    let premises: Vec<&str> = data.pairs.iter().map(|p| p.premise.as_str()).collect();
    let labels: Vec<usize> = data.pairs.iter().map(|p| p.label.unwrap_or(0)).collect();
    let folds = kiln_data::grouped_stratified_folds(&premises, &labels, 3, 5, 1337);
    let mut fold_of: HashMap<&str, usize> = HashMap::new();
    for (p, f) in premises.iter().zip(&folds) {
        assert_eq!(
            *fold_of.entry(p).or_insert(*f),
            *f,
            "premise {p:?} is in two folds"
        );
    }
    let n = labels.len() as f64;
    for f in 0..5 {
        let size = folds.iter().filter(|&&x| x == f).count() as f64;
        for l in 0..3 {
            let count = folds
                .iter()
                .zip(&labels)
                .filter(|(x, y)| **x == f && **y == l)
                .count() as f64;
            let share = labels.iter().filter(|&&y| y == l).count() as f64 / n;
            assert!(
                (count - size * share).abs() <= 1.0,
                "fold {f}, label {l}: {count} vs {:.2}",
                size * share
            );
        }
    }
    let distinct: HashSet<usize> = folds.iter().copied().collect();
    assert_eq!(distinct.len(), 5);
}

#[test]
fn bad_pair_files_are_named_with_their_line_and_exit_2() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &[u8]| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let good_row =
        "{\"premise\": \"a man\", \"hypothesis\": \"a person\", \"label\": \"entailment\"}\n";
    let cases = [
        (write("malformed.jsonl", format!("{good_row}{good_row}{{\"premise\": \n").as_bytes()), vec!["malformed.jsonl` line 3", "malformed JSON"], vec![]),
        (write("columns.tsv", b"sentence1\tsentence2\tlabel\na\tb\tneutral\n"), vec!["no column `premise`"], vec![]),
        (write("unknown.jsonl", format!("{good_row}{{\"premise\": \"a\", \"hypothesis\": \"b\", \"label\": \"maybe\"}}\n").as_bytes()), vec!["unknown.jsonl` line 2", "unknown label \"maybe\"", "set data.bad_rows = \"skip\""], vec!["data.bad_rows=error"]),
        (write("latin1.jsonl", b"{\"premise\": \"caf\xe9\"}\n"), vec!["invalid byte 0xe9", "line 1"], vec![]),
    ];
    for (path, wants, extra) in cases {
        let mut args = vec![
            "cv".to_string(),
            "hardware=cpu".into(),
            format!("data.path={}", path.display()),
            format!("run.dir={}", tmp.path().join("run").display()),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let run = run_kiln(&args);
        assert_eq!(run.code, 2, "{}: {}", path.display(), run.stderr);
        run.stderr_has(&wants);
        assert!(
            !tmp.path().join("run").exists(),
            "{} left a run directory",
            path.display()
        );
    }
}

#[test]
fn diagnose_predicts_each_folds_steps_with_accumulation_and_epochs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "steps", 3);
    args.retain(|a| !a.starts_with("training.gradient_accumulation_steps"));
    // 90 training pairs a fold, 12 batches an epoch, 3 epochs in groups of
    // 5: 7 steps (counting whole steps per epoch first would give 6).
    args.push("training.gradient_accumulation_steps=5".into());
    args.push("cv.folds=2".into());
    args.push("experiment=nli_snli".into());
    let predicted = crate::train::predicted_steps(&args);
    run_kiln(&args).expect_code(0);
    // The first fold, as diagnose measures it.
    let done = crate::train::last_step(&tmp.path().join("steps/fold-1/metrics.jsonl"));
    assert_eq!(predicted, done);
    assert_eq!(done, 7);
    // Evaluations where the first two epochs end (steps 3 and 5) and at the last step.
    let evals = std::fs::read_to_string(tmp.path().join("steps/fold-1/metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter(|l| l.contains("\"kind\":\"eval\""))
        .count();
    assert!(evals >= 3, "{evals} evaluations");
}
