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

pub(crate) fn summary(run: &Path) -> serde_json::Value {
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
        "kiln: model: encoder, 1 layer × 2 heads × 16 wide",
        "setup lines as above, not repeated",
    ]);
    // The setup every fold shares is printed once, at the first fold.
    for line in ["kiln: backend:", "kiln: model:", "kiln: loader:"] {
        assert_eq!(
            run.stdout.matches(line).count(),
            1,
            "{line}\n{}",
            run.stdout
        );
    }
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
    // Predicted shortest first, written in the file's order: each line's
    // probabilities are its own, whatever pairs share its batch (the file
    // reversed gives each pair the same).
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["line"], i as u64 + 1);
    }
    let text = std::fs::read_to_string(tmp.path().join("pairs.jsonl")).expect("pairs");
    let reversed = tmp.path().join("reversed.jsonl");
    let lines: Vec<&str> = text.lines().rev().collect();
    std::fs::write(&reversed, lines.join("\n") + "\n").expect("write");
    let (_, back) = predict(&reversed);
    for (row, other) in rows.iter().zip(back.lines().rev()) {
        let other: serde_json::Value = serde_json::from_str(other).expect("json");
        assert_eq!(row["prediction"], other["prediction"]);
        for label in ["entailment", "neutral", "contradiction"] {
            let (a, b) = (
                row["probabilities"][label].as_f64().expect("p"),
                other["probabilities"][label].as_f64().expect("p"),
            );
            assert!(
                (a - b).abs() < 1e-5,
                "line {}: {a} against {b}",
                row["line"]
            );
        }
    }
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

/// An attention the device cannot run (`flash` on the CPU, in f32) is
/// refused before anything is written: no run directory at the start, and
/// on a resume the run's `config.toml` as it was.
#[test]
fn cv_refuses_an_attention_it_cannot_run_before_writing_anything() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "refused", 1);
    args.push("optimization.attention=flash".into());
    run_kiln(&args).expect_code(2).stderr_has(&[
        "optimization.attention = \"flash\" cannot run here",
        "computes in f32",
    ]);
    assert!(
        !tmp.path().join("refused").exists(),
        "the refused run left a directory"
    );

    run_kiln(&tiny(tmp.path(), "cv", 1)).expect_code(0);
    let dir = tmp.path().join("cv");
    let before = std::fs::read_to_string(dir.join("config.toml")).expect("config.toml");
    let dir_arg = dir.to_str().expect("utf-8");
    kiln(&["resume", dir_arg, "optimization.attention=flash"])
        .run()
        .expect_code(2)
        .stderr_has(&["optimization.attention = \"flash\" cannot run here"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("config.toml")).expect("config.toml"),
        before,
        "the refused resume recorded its changes"
    );
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
        // Fewer premises than folds: a fold of no pair trained on an empty
        // batch and panicked.
        (write("few.jsonl", format!("{good_row}{}", good_row.replace("a man", "a dog")).as_bytes()), vec!["few.jsonl` is too short: 2 usable pairs under 2 premises, but 5 folds grouped by premise need 5 premises at least", "cv.folds=2"], vec![]),
        (write("one.jsonl", good_row.as_bytes()), vec!["1 usable pair under 1 premise", "cross-validation needs 2 premises at least"], vec!["cv.folds=2"]),
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

/// The largest change of each part of the encoder (`model/tokens...`,
/// `model/blocks...`, `model/head...`) between two checkpoints.
fn largest_moves(a: &Path, b: &Path) -> HashMap<&'static str, f32> {
    let mut out = HashMap::new();
    for ((name, was), (other, now)) in crate::support::weights(a)
        .into_iter()
        .zip(crate::support::weights(b))
    {
        assert_eq!(name, other);
        let part = ["tokens", "blocks", "head"]
            .into_iter()
            .find(|p| name.starts_with(&format!("model/{p}")));
        if let Some(part) = part {
            let moved = was.iter().zip(&now).map(|(x, y)| (x - y).abs());
            let top = out.entry(part).or_insert(0f32);
            *top = moved.fold(*top, f32::max);
        }
    }
    out
}

/// `training.layer_lr_decay` and `training.label_smoothing` reach the
/// step. AdamW's first steps move each element that has a gradient by
/// about the rate, so between a fold's checkpoints at steps 1 and 2 the
/// one block (decay 0.1) moves a tenth as far as the classifier, the
/// embeddings a hundredth; without the decay, all alike. The first step's
/// loss, from the same initial weights and batch, differs with smoothing.
#[test]
fn layer_wise_decay_and_label_smoothing_reach_the_step() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let train = |name: &str, extra: &[&str]| {
        let mut args = tiny(tmp.path(), name, 1);
        args.extend(
            [
                "training.max_steps=2",
                "checkpoint.every_steps=1",
                "logging.logging_steps=1",
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
        );
        let out = run_kiln(&args).expect_code(0);
        let fold = tmp.path().join(name).join("fold-1");
        let ckpt = |step: u32| fold.join(format!("checkpoints/ckpt-{step:08}.safetensors"));
        let moves = largest_moves(&ckpt(1), &ckpt(2));
        let first_loss = crate::train::step_records(&fold.join("metrics.jsonl"))[0]["loss"]
            .as_f64()
            .expect("a loss");
        (out, moves, first_loss)
    };
    let (plain, even, plain_loss) = train("plain", &[]);
    let (decayed, moves, smoothed_loss) = train(
        "decayed",
        &[
            "training.layer_lr_decay=0.1",
            "training.label_smoothing=0.1",
        ],
    );
    decayed.stdout_has(&[
        "layer-wise lr decay 0.1: the top block at ×0.1, the embeddings at ×0.01",
        "label smoothing 0.1",
    ]);
    assert!(!plain.stdout.contains("layer-wise"), "{}", plain.stdout);
    let ratio = |m: &HashMap<&str, f32>, part: &str| m[part] / m["head"];
    for part in ["tokens", "blocks"] {
        assert!((0.8..1.2).contains(&ratio(&even, part)), "{part}: {even:?}");
    }
    assert!((0.08..0.12).contains(&ratio(&moves, "blocks")), "{moves:?}");
    assert!(
        (0.008..0.012).contains(&ratio(&moves, "tokens")),
        "{moves:?}"
    );
    assert!(
        (plain_loss - smoothed_loss).abs() > 1e-4,
        "{plain_loss} {smoothed_loss}"
    );
}

/// A `transformers` BERT folder as `save_pretrained` writes a
/// `BertForSequenceClassification` (`bert.`-prefixed names, PyTorch's `[out,
/// in]` weights, a classifier for `labels`), its weights drawn from a fixed
/// sequence, its tokenizer a WordPiece of `texts`: 1 layer, 2 heads, 16
/// wide, 32 inner, 40 positions, BERT's ε.
fn write_bert(dir: &Path, texts: &[&str], labels: &[&str]) {
    let tokenizer =
        kiln_data::Tokenizer::wordpiece(texts.iter().copied(), 300, 32).expect("wordpiece");
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(
        dir.join("tokenizer.json"),
        tokenizer.to_json().expect("json"),
    )
    .expect("tokenizer.json");
    let (d, f, vocab, positions) = (16usize, 32usize, tokenizer.vocab_size(), 40usize);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut draw = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
        (
            "bert.embeddings.word_embeddings.weight".into(),
            vec![vocab, d],
            draw(vocab * d, 0.5),
        ),
        (
            "bert.embeddings.position_embeddings.weight".into(),
            vec![positions, d],
            draw(positions * d, 0.5),
        ),
        (
            "bert.embeddings.token_type_embeddings.weight".into(),
            vec![2, d],
            draw(2 * d, 0.5),
        ),
    ];
    let mut norm = |name: &str, tensors: &mut Vec<(String, Vec<usize>, Vec<f32>)>| {
        let gain = draw(d, 0.2).iter().map(|g| 1.0 + g).collect();
        tensors.push((format!("{name}.LayerNorm.weight"), vec![d], gain));
        tensors.push((format!("{name}.LayerNorm.bias"), vec![d], draw(d, 0.1)));
    };
    norm("bert.embeddings", &mut tensors);
    let layer = "bert.encoder.layer.0";
    norm(&format!("{layer}.attention.output"), &mut tensors);
    norm(&format!("{layer}.output"), &mut tensors);
    let mut linears = vec![
        (format!("{layer}.attention.self.query"), d, d),
        (format!("{layer}.attention.self.key"), d, d),
        (format!("{layer}.attention.self.value"), d, d),
        (format!("{layer}.attention.output.dense"), d, d),
        (format!("{layer}.intermediate.dense"), d, f),
        (format!("{layer}.output.dense"), f, d),
        ("bert.pooler.dense".to_string(), d, d),
    ];
    linears.push(("classifier".into(), d, labels.len()));
    for (name, inputs, outputs) in linears {
        tensors.push((
            format!("{name}.weight"),
            vec![outputs, inputs],
            draw(outputs * inputs, 0.5),
        ));
        tensors.push((format!("{name}.bias"), vec![outputs], draw(outputs, 0.1)));
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(n, s, b)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .expect("view"),
        )
    });
    let file = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(dir.join("model.safetensors"), file).expect("model.safetensors");
    let id2label: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| (i.to_string(), serde_json::Value::from(*l)))
        .collect();
    let config = serde_json::json!({
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "hidden_size": d,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": f,
        "hidden_act": "gelu",
        "max_position_embeddings": positions,
        "type_vocab_size": 2,
        "vocab_size": vocab,
        "layer_norm_eps": 1e-12,
        "id2label": id2label,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
}

/// `model.init_from` on the encoder: every fold starts from a BERT
/// folder's weights (its classifier too, trained for these labels) and
/// tokenizes with its tokenizer. With the learning rate at 1e-12 the folds
/// are the folder's model: the same predictions whatever the seed, which
/// random weights are not; what does not fit exits 2 before the run
/// directory is made, and `kiln diagnose` lists it.
#[test]
fn init_from_starts_every_fold_from_a_bert_folders_weights() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let folder = tmp.path().join("bert");
    let data = write_pairs(tmp.path());
    let text = std::fs::read_to_string(&data).expect("pairs");
    let pairs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let texts: Vec<&str> = pairs
        .iter()
        .flat_map(|p| [p["premise"].as_str(), p["hypothesis"].as_str()])
        .flatten()
        .collect();
    write_bert(&folder, &texts, &["entailment", "neutral", "contradiction"]);
    let from = format!("model.init_from={}", folder.display());
    let run = |name: &str, extra: &[&str]| -> (crate::support::Run, Vec<serde_json::Value>) {
        let mut args = tiny(tmp.path(), name, 1);
        args.extend(
            [
                "model.pooling=pooler",
                "model.layer_norm_eps=1e-12",
                "model.dropout=0.0",
                "training.learning_rate=1e-12",
                "training.min_lr=1e-12",
                "training.warmup_steps=0",
            ]
            .iter()
            .chain(extra)
            .map(ToString::to_string),
        );
        let out = run_kiln(&args).expect_code(0);
        let dir = tmp.path().join(name);
        kiln(&[
            "predict",
            dir.to_str().expect("utf-8"),
            "--data",
            data.to_str().expect("utf-8"),
        ])
        .run()
        .expect_code(0);
        let predictions = std::fs::read_to_string(dir.join("predictions-pairs.jsonl"))
            .expect("predictions")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        (out, predictions)
    };
    let probabilities = |p: &[serde_json::Value]| -> Vec<f64> {
        p.iter()
            .flat_map(|line| {
                ["entailment", "neutral", "contradiction"]
                    .map(|l| line["probabilities"][l].as_f64().expect("a probability"))
            })
            .collect()
    };
    let largest_difference = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };

    let (first, a) = run("seed1", &[&from, "training.seed=1"]);
    first.stdout_has(&[
        "weights: from",
        "(BERT; tokenizer.json",
        "position embeddings cropped 40 → 32",
        "its classifier, trained for these labels",
        "(the weights' tokenizer)",
    ]);
    let folder_vocab = std::fs::read_to_string(folder.join("tokenizer.json")).expect("read");
    for k in 1..=3 {
        let fold =
            std::fs::read_to_string(tmp.path().join(format!("seed1/fold-{k}/tokenizer.json")))
                .expect("fold tokenizer");
        let vocab = |json: &str| {
            serde_json::from_str::<serde_json::Value>(json).expect("json")["model"]["vocab"].clone()
        };
        assert_eq!(vocab(&fold), vocab(&folder_vocab), "fold {k}'s vocabulary");
    }
    let (_, b) = run("seed2", &[&from, "training.seed=2"]);
    let (_, random) = run("random", &["training.seed=1"]);
    let (a, b, random) = (probabilities(&a), probabilities(&b), probabilities(&random));
    assert_eq!(a.len(), 540);
    assert!(
        largest_difference(&a, &b) < 1e-5,
        "two seeds from one folder: {}",
        largest_difference(&a, &b)
    );
    assert!(
        largest_difference(&a, &random) > 1e-2,
        "the folder's model against random weights: {}",
        largest_difference(&a, &random)
    );

    // `kiln export` writes the random run's best fold as a BERT folder
    // (kiln's own WordPiece, its labels as id2label), which starts a run
    // again: the same predictions.
    let random_dir = tmp.path().join("random");
    let exported = tmp.path().join("exported");
    kiln(&[
        "export",
        random_dir.to_str().expect("utf-8"),
        "--out",
        exported.to_str().expect("utf-8"),
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["as transformers' BertForSequenceClassification", "fold "]);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(exported.join("config.json")).expect("config.json"),
    )
    .expect("json");
    assert_eq!(config["id2label"]["2"], "contradiction");
    assert_eq!(config["layer_norm_eps"], 1e-12);
    let from_export = format!("model.init_from={}", exported.display());
    let (again, c) = run("again", &[&from_export, "training.seed=3"]);
    again.stdout_has(&["its classifier, trained for these labels"]);
    let c = probabilities(&c);
    assert!(
        largest_difference(&c, &random) < 1e-5,
        "exported and read back: {}",
        largest_difference(&c, &random)
    );
    // `kiln predict` on the exported folder itself: the same predictions,
    // with no run; a folder whose id2label says LABEL_0.. only is refused
    // until model.init_labels names its outputs. The predictions go to a
    // folder not yet made, which predict makes.
    let predict_folder = |extra: &[&str]| {
        let out = tmp.path().join("predictions").join("folder.jsonl");
        let mut args = vec![
            "predict",
            exported.to_str().expect("utf-8"),
            "--data",
            data.to_str().expect("utf-8"),
            "--out",
            out.to_str().expect("utf-8"),
        ];
        args.extend_from_slice(extra);
        let run = kiln(&args).run();
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        let _ = std::fs::remove_file(&out);
        (run, probabilities(&lines))
    };
    let (direct, d) = predict_folder(&[]);
    direct.expect_code(0).stdout_has(&[
        "predicted 180 pairs with the classifier of",
        "against the file's labels: accuracy",
    ]);
    assert!(
        largest_difference(&d, &random) < 1e-5,
        "kiln predict on the export: {}",
        largest_difference(&d, &random)
    );
    let config_json = exported.join("config.json");
    let text = std::fs::read_to_string(&config_json).expect("config.json");
    let generic = text
        .replace("\"entailment\"", "\"LABEL_0\"")
        .replace("\"neutral\"", "\"LABEL_1\"")
        .replace("\"contradiction\"", "\"LABEL_2\"");
    assert_ne!(generic, text);
    std::fs::write(&config_json, generic).expect("write");
    let (refused, _) = predict_folder(&[]);
    refused.expect_code(2).stderr_has(&[
        "has no classifier for the run's labels",
        "model.init_labels=",
    ]);
    let (named, e) =
        predict_folder(&[r#"model.init_labels=["Entailment", "neutral", "CONTRADICTION"]"#]);
    named.expect_code(0);
    assert_eq!(e, d, "the outputs named by model.init_labels");
    // A run takes no overrides: it predicts as it was configured.
    kiln(&[
        "predict",
        random_dir.to_str().expect("utf-8"),
        "--data",
        data.to_str().expect("utf-8"),
        "eval.batch_size=2",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&["is a run: it predicts as it was configured"]);

    // An encoder without BERT's pooler has no BertForSequenceClassification.
    let mut cls = tiny(tmp.path(), "cls", 1);
    cls.push("training.max_steps=2".into());
    run_kiln(&cls).expect_code(0);
    kiln(&["export", tmp.path().join("cls").to_str().expect("utf-8")])
        .run()
        .expect_code(2)
        .stderr_has(&["model.pooling=pooler"]);

    // A shape the weights do not have: exit 2 with the fix, no run directory.
    let mut args = tiny(tmp.path(), "wrong", 1);
    args.extend([from.clone(), "model.layers=2".into()]);
    run_kiln(&args).expect_code(2).stderr_has(&[
        "model.init_from",
        "model.layers = 2 where its num_hidden_layers is 1",
        "model.layers=1 model.layer_norm_eps=1e-12",
    ]);
    assert!(!tmp.path().join("wrong").exists());
    // `kiln diagnose` lists it among the problems, with the rest of its
    // report, and exits 2.
    let mut diagnose = args.clone();
    diagnose.splice(0..1, ["diagnose".to_string(), "--burst=0".into()]);
    diagnose.push("experiment=nli_snli".into());
    run_kiln(&diagnose).expect_code(2).stdout_has(&[
        "model.init_from",
        "num_hidden_layers is 1",
        "memory",
    ]);
}

#[test]
fn runs_with_fewer_segment_rows_or_other_poolers_export_as_distilbert_electra_and_roberta() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = write_pairs(tmp.path());
    let probabilities = |file: &Path| -> Vec<f64> {
        std::fs::read_to_string(file)
            .expect("predictions")
            .lines()
            .flat_map(|l| {
                let line: serde_json::Value = serde_json::from_str(l).expect("json");
                ["entailment", "neutral", "contradiction"]
                    .map(|c| line["probabilities"][c].as_f64().expect("a probability"))
            })
            .collect()
    };
    // (run, its keys, the model_type exported, whether segment ids are an input)
    for (name, keys, model_type, segment_ids) in [
        (
            "distil",
            ["model.segments=0", "model.pooler_activation=relu"],
            "distilbert",
            false,
        ),
        (
            "electra",
            ["model.segments=1", "model.pooler_activation=gelu"],
            "electra",
            true,
        ),
        (
            "roberta",
            ["model.segments=1", "model.pooler_activation=tanh"],
            "roberta",
            false,
        ),
    ] {
        let mut args = tiny(tmp.path(), name, 1);
        args.extend(
            [
                "model.pooling=pooler",
                "model.layer_norm_eps=1e-12",
                "training.epochs=0",
                "training.max_steps=3",
            ]
            .iter()
            .chain(&keys)
            .map(ToString::to_string),
        );
        run_kiln(&args).expect_code(0);
        let dir = tmp.path().join(name);
        let dir_arg = dir.to_str().expect("utf-8");
        let data_arg = data.to_str().expect("utf-8");
        kiln(&["predict", dir_arg, "--data", data_arg])
            .run()
            .expect_code(0);
        let from_run = probabilities(&dir.join("predictions-pairs.jsonl"));
        let exported = tmp.path().join(format!("{name}-hf"));
        let out = exported.to_str().expect("utf-8");
        kiln(&["export", dir_arg, "--out", out])
            .run()
            .expect_code(0);
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(exported.join("config.json")).expect("config.json"),
        )
        .expect("json");
        assert_eq!(config["model_type"], model_type, "{name}");
        let inputs = std::fs::read_to_string(exported.join("tokenizer_config.json"))
            .expect("tokenizer_config.json");
        assert_eq!(inputs.contains("token_type_ids"), segment_ids, "{name}");
        // The exported folder predicts what the run predicted.
        let folder_out = tmp.path().join(format!("{name}-folder.jsonl"));
        kiln(&[
            "predict",
            out,
            "--data",
            data_arg,
            "--out",
            folder_out.to_str().expect("utf-8"),
        ])
        .run()
        .expect_code(0)
        .stdout_has(&["with the classifier of"]);
        let from_folder = probabilities(&folder_out);
        assert_eq!(from_run.len(), from_folder.len());
        let worst = from_run
            .iter()
            .zip(&from_folder)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-5, "{name}: {worst}");
    }
}
