//! Token stores as a user makes and trains on them: `kiln prepare` on a
//! folder of documents, training and exact resume on the store with any
//! number of loader workers, `kiln train` on documents with no store yet,
//! `kiln eval` on a store's split, and each kind of bad input named with
//! exit 2.

use std::path::{Path, PathBuf};

use crate::support::{kill_when, kiln, root};
use crate::train::{checkpoint_digest, ckpt, eval_json, tiny};

/// Shakespeare's first 60 kB as JSON lines, a speech (blank-line separated)
/// a document, with a line missing its text.
pub(crate) fn documents(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(root().join("data/tinyshakespeare.txt")).expect("corpus");
    let folder = dir.join("docs");
    std::fs::create_dir_all(&folder).expect("mkdir");
    let mut jsonl = String::new();
    for (i, speech) in text[..60_000].split("\n\n").enumerate() {
        jsonl.push_str(&serde_json::json!({ "text": speech, "n": i }).to_string());
        jsonl.push('\n');
        if i == 3 {
            jsonl.push_str("{\"n\": \"no text\"}\n");
        }
    }
    std::fs::write(folder.join("speeches.jsonl"), jsonl).expect("write");
    folder
}

/// The tiny run's arguments with `data.path` at `path` and `extra` after.
pub(crate) fn tiny_on(
    dir: &Path,
    run: &str,
    steps: u32,
    path: &Path,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = tiny(dir, run, steps)
        .into_iter()
        .map(|a| {
            if a.starts_with("data.path=") {
                format!("data.path={}", path.display())
            } else {
                a
            }
        })
        .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run(args: &[String]) -> crate::support::Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run()
}

fn prepare(docs: &Path, store: &Path, extra: &[&str]) -> crate::support::Run {
    let mut args = vec![
        "prepare".to_string(),
        format!("data.path={}", docs.display()),
        format!("--out={}", store.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    run(&args)
}

#[test]
fn a_store_trains_and_resumes_bitwise_with_any_number_of_loader_workers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let docs = documents(dir);
    // A file of another kind beside the documents is left out, and said so.
    std::fs::write(docs.join("cover.png"), [0x89, b'P', b'N', b'G']).expect("write");
    let store = dir.join("shakespeare.store");
    prepare(
        &docs,
        &store,
        &["data.tokenizer=char", "data.shard_tokens=20000"],
    )
    .expect_code(0)
    .stdout_has(&[
        "1 file of data.path",
        "left out, not of a kind read as documents (.txt/.text/.md",
        "cover.png`",
        "KiB of documents",
        "skipped 1 rows",
        "line 5: no field `text`",
        "tokenizer char",
        "train on it: kiln train data.path=",
    ]);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(store.join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    assert!(manifest["shards"].as_array().expect("shards").len() >= 3);
    // Again: nothing to do.
    prepare(
        &docs,
        &store,
        &["data.tokenizer=char", "data.shard_tokens=20000"],
    )
    .expect_code(0)
    .stdout_has(&["prepared already"]);

    // diagnose and the loader's bench know the store.
    let store_arg = format!("data.path={}", store.display());
    kiln(&[
        "diagnose",
        "hardware=cpu",
        &store_arg,
        "data.tokenizer=char",
        "--burst",
        "0",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["store:", "shards of 2-byte tokens", "MB/s now"]);
    kiln(&[
        "bench",
        "loader",
        "hardware=cpu",
        &store_arg,
        "data.tokenizer=char",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["bench loader (lm)", "(configured)"]);

    let steps = 200;
    let char_tok = "data.tokenizer=char";
    let whole = run(&tiny_on(
        dir,
        "whole",
        steps,
        &store,
        &[char_tok, "loader.num_workers=0"],
    ));
    whole.expect_code(0).stdout_has(&["token store"]);
    for workers in ["1", "4"] {
        let name = format!("killed{workers}");
        let killed = dir.join(&name);
        let workers_arg = format!("loader.num_workers={workers}");
        kill_when(
            &tiny_on(dir, &name, steps, &store, &[char_tok, &workers_arg]),
            &ckpt(&killed, 100),
            &ckpt(&killed, steps),
        );
        kiln(&["resume", killed.to_str().expect("utf-8")])
            .run()
            .expect_code(0);
        assert_eq!(
            checkpoint_digest(&ckpt(&killed, steps)),
            checkpoint_digest(&ckpt(&dir.join("whole"), steps)),
            "{workers} workers, killed and resumed, against 0 workers uninterrupted"
        );
    }
}

/// `args` run by `kiln` with at most `limit` open files (soft and hard, so
/// that kiln's raising of its soft limit finds nothing to raise).
fn run_under_open_files_limit(limit: u32, args: &[String]) -> crate::support::Run {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -n {limit} && exec \"$0\" \"$@\""))
        .arg(crate::support::kiln_bin())
        .args(args)
        .current_dir(root())
        .output()
        .expect("run sh");
    crate::support::Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn prepare_warns_of_more_shards_than_a_run_keeps_open_and_the_store_still_trains() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let docs = documents(dir);
    let store = dir.join("small-shards.store");
    let args = [
        "prepare".to_string(),
        format!("data.path={}", docs.display()),
        format!("--out={}", store.display()),
        "data.tokenizer=char".into(),
        "data.shard_tokens=1000".into(),
    ];
    // 60 kB in shards of 1,000 tokens: about 60 shards, over the 16 of a
    // limit of 64 files.
    run_under_open_files_limit(64, &args)
        .expect_code(0)
        .stderr_has(&[
            "shards are more than a run here keeps open (16, a quarter",
            "a larger data.shard_tokens (now 1000) makes fewer",
        ]);
    // Under the usual limit, the same store is prepared already and fits.
    let again = run(&args).expect_code(0);
    again.stdout_has(&["prepared already"]);
    assert!(!again.stderr.contains("keeps open"), "{}", again.stderr);
    // Under the low limit, a run reads each shard by opening it.
    run_under_open_files_limit(
        64,
        &tiny_on(dir, "low-limit", 20, &store, &["data.tokenizer=char"]),
    )
    .expect_code(0)
    .stdout_has(&["token store"]);
}

#[test]
fn train_on_documents_prepares_them_first_then_finds_them_prepared() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let docs = documents(dir).join("speeches.jsonl");
    let args = tiny_on(
        dir,
        "first",
        20,
        &docs,
        &["data.tokenizer=gpt2", "model.max_length=16"],
    );
    let first = run(&args);
    first.expect_code(0).stdout_has(&[
        "preparing them into the token store",
        "prepared",
        "vocabulary 50257",
    ]);
    let cached: Vec<PathBuf> = std::fs::read_dir(dir.join("cache"))
        .expect("cache")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("store-"))
        })
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    let second = run(&tiny_on(
        dir,
        "second",
        20,
        &docs,
        &["data.tokenizer=gpt2", "model.max_length=16"],
    ));
    let second = second.expect_code(0);
    assert!(
        !second.stdout.contains("prepared 1"),
        "prepared again:\n{}",
        second.stdout
    );
}

/// One text file of 300 kB, one document, as people have a corpus: its
/// validation split gets its share (it got none, the text going to the
/// splits in 256 KiB pieces, and training on the store was refused); a
/// share too small for one piece is warned of at prepare, and training's
/// refusal says that the store's splits are fixed and how to remake them.
#[test]
fn a_small_text_of_one_document_gets_its_validation_share() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let text = std::fs::read_to_string(root().join("data/tinyshakespeare.txt")).expect("corpus");
    let folder = dir.join("text");
    std::fs::create_dir_all(&folder).expect("mkdir");
    std::fs::write(folder.join("plays.txt"), &text[..300_000]).expect("write");
    let store = dir.join("plays.store");
    prepare(&folder, &store, &["data.tokenizer=char"]).expect_code(0);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(store.join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    let split = |name: &str| -> u64 {
        let shards = manifest["shards"].as_array().expect("shards");
        let of = shards.iter().filter(|s| s["split"] == name);
        of.map(|s| s["tokens"].as_u64().expect("tokens")).sum()
    };
    let share = split("val") as f64 / (split("train") + split("val")) as f64;
    assert!((0.08..0.12).contains(&share), "validation share {share}");
    run(&tiny_on(dir, "run", 2, &store, &["data.tokenizer=char"])).expect_code(0);

    let thin = dir.join("thin.store");
    prepare(
        &folder,
        &thin,
        &["data.tokenizer=char", "data.val_fraction=0.001"],
    )
    .expect_code(0)
    .stderr_has(&[
        "warning: the validation split is empty",
        "a larger data.val_fraction",
    ]);
    let mut diagnose = tiny_on(dir, "d", 2, &thin, &["data.tokenizer=char", "--burst", "0"]);
    diagnose[0] = "diagnose".into();
    let said = run(&diagnose);
    said.stdout_has(&[
        "but the validation split has 0",
        "fix: the store prepared again (into a new folder) with a larger data.val_fraction: its splits are fixed",
    ]);
    assert!(
        !said.stdout.contains("model.max_length=1"),
        "{}",
        said.stdout
    );
    run(&tiny_on(dir, "refused", 2, &thin, &["data.tokenizer=char"]))
        .expect_code(2)
        .stderr_has(&[
            "0 tokens in the validation split",
            "its splits were fixed when it was prepared: prepare its documents again into a new folder with a larger data.val_fraction",
        ]);
}

#[test]
fn bad_store_input_is_named_with_exit_2() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let docs = documents(dir);
    // A row without the field, under data.bad_rows=error: file and line.
    prepare(
        &docs,
        &dir.join("strict.store"),
        &["data.tokenizer=gpt2", "data.bad_rows=error"],
    )
    .expect_code(2)
    .stderr_has(&["speeches.jsonl` line 5", "no field `text`"]);
    // Not UTF-8: file and byte offset.
    let latin = dir.join("latin");
    std::fs::create_dir_all(&latin).expect("mkdir");
    std::fs::write(latin.join("a.txt"), b"fine text\ncaf\xe9\n").expect("write");
    prepare(&latin, &dir.join("latin.store"), &["data.tokenizer=gpt2"])
        .expect_code(2)
        .stderr_has(&["a.txt` is not UTF-8", "at byte 13"]);
    // A store trained with another tokenizer than the run's.
    let store = dir.join("gpt2.store");
    prepare(&docs, &store, &["data.tokenizer=gpt2"]).expect_code(0);
    run(&tiny_on(dir, "wrong", 10, &store, &["data.tokenizer=char"]))
        .expect_code(2)
        .stderr_has(&["prepared with the `gpt2` tokenizer", "data.tokenizer=gpt2"]);
    // A shard whose header disagrees with its size: named.
    let shard = store.join("tokens_train_000000.bin");
    let bytes = std::fs::read(&shard).expect("shard");
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).expect("truncate");
    run(&tiny_on(dir, "cut", 10, &store, &["data.tokenizer=gpt2"]))
        .expect_code(2)
        .stderr_has(&["tokens_train_000000.bin", "the shard is truncated"]);
    assert!(!dir.join("cut").exists() && !dir.join("wrong").exists());
    // llm.c's GPT-2 shards, trained as if characters.
    let llmc = dir.join("llmc");
    std::fs::create_dir_all(&llmc).expect("mkdir");
    for split in ["train", "val"] {
        std::fs::copy(
            root().join("crates/data/test_data/gpt2_shard.bin"),
            llmc.join(format!("web_{split}_000000.bin")),
        )
        .expect("copy");
    }
    run(&tiny_on(dir, "llmc", 10, &llmc, &[]))
        .expect_code(2)
        .stderr_has(&[
            "llm.c's uint16 shards hold GPT-2's token ids",
            "data.tokenizer=gpt2",
        ]);
    // Another prepare's folder is not overwritten.
    prepare(
        &docs,
        &store,
        &["data.tokenizer=gpt2", "data.val_fraction=0.2"],
    )
    .expect_code(2)
    .stderr_has(&["other inputs or settings", "--out"]);
    // Documents none of whose rows has the field: refused where the rows
    // are read, with the first one.
    run(&tiny_on(dir, "none", 10, &docs, &["data.text_field=body"]))
        .expect_code(2)
        .stderr_has(&[
            "data.text_field",
            "every one of the",
            "speeches.jsonl` line 1: no field `body`",
        ]);
    // One document, all of it in the validation split: `kiln diagnose`
    // lists what that leaves short, and exits 2 (it panicked timing reads
    // from the empty training split).
    let one = dir.join("one");
    std::fs::create_dir_all(&one).expect("mkdir");
    std::fs::write(
        one.join("a.jsonl"),
        "{\"text\": \"a tiny document of a few words\"}\n",
    )
    .expect("write");
    let mut args = tiny_on(dir, "one", 10, &one, &["data.val_fraction=0.9"]);
    args.splice(0..1, ["diagnose".to_string(), "--burst=0".into()]);
    run(&args).expect_code(2).stdout_has(&[
        "0 training tokens",
        "problems:",
        "training.batch_size",
    ]);
}

/// `kiln eval` on a token store, read from its shards: the validation
/// split by default (every token but the first scored; for bits per byte
/// its documents' text, the end-of-text ids left out), `--split train`
/// the same ids and loss as the text path on the same documents with the
/// end-of-text marker before each; an empty split, `--split` on a text
/// file and a store of another tokenizer's ids are bad input (exit 2).
#[test]
fn eval_scores_a_stores_split_from_its_shards() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let docs = documents(tmp.path());
    let store = tmp.path().join("store");
    prepare(&docs, &store, &[]).expect_code(0);
    let model = tmp.path().join("run");
    run(&tiny_on(tmp.path(), "run", 20, &store, &[])).expect_code(0);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(store.join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    let (val_tokens, val_documents) = manifest["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .filter(|s| s["split"] == "val")
        .fold((0, 0), |(t, d), s| {
            (
                t + s["tokens"].as_u64().expect("tokens"),
                d + s["documents"].as_u64().expect("documents"),
            )
        });
    assert!(val_documents > 0, "{manifest}");
    let e = eval_json(&model, &store, &[]);
    assert_eq!(e["tokens"], val_tokens - 1, "{e}");
    assert!(
        e["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("(validation)")),
        "{e}"
    );
    // A character a token and Shakespeare in ASCII: every id but the
    // end-of-text ones is a byte.
    assert_eq!(e["bytes"], val_tokens - val_documents, "{e}");
    let loss = e["loss"].as_f64().expect("loss");
    let bits = e["bits_per_byte"].as_f64().expect("bits");
    let want = loss * (val_tokens - 1) as f64
        / std::f64::consts::LN_2
        / (val_tokens - val_documents) as f64;
    assert!((bits - want).abs() < 1e-9, "{bits} against {want}");

    // Every document in the training split, in input order: its ids are
    // those of the text with the marker before each document.
    let all = tmp.path().join("all");
    prepare(&docs, &all, &["data.val_fraction=0.000001"]).expect_code(0);
    let mut text = String::new();
    for line in std::fs::read_to_string(docs.join("speeches.jsonl"))
        .expect("docs")
        .lines()
    {
        let row: serde_json::Value = serde_json::from_str(line).expect("row");
        if let Some(t) = row["text"].as_str() {
            text.push_str("<|endoftext|>");
            text.push_str(t);
        }
    }
    let txt = tmp.path().join("all.txt");
    std::fs::write(&txt, &text).expect("write");
    let from_store = eval_json(&model, &all, &["--split", "train", "--stride", "8"]);
    let from_text = eval_json(&model, &txt, &["--stride", "8"]);
    for key in ["tokens", "windows", "loss"] {
        assert_eq!(
            from_store[key], from_text[key],
            "{key}: {from_store} against {from_text}"
        );
    }
    let markers = text.matches("<|endoftext|>").count() as u64;
    assert_eq!(
        from_store["bytes"].as_u64(),
        Some(text.len() as u64 - 13 * markers),
        "{from_store}"
    );

    let path = |p: &Path| p.display().to_string();
    let eval = |data: &Path, extra: &[&str]| {
        let mut args = vec![
            "eval".to_string(),
            path(&model),
            "--data".into(),
            path(data),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        run(&args)
    };
    eval(&all, &[])
        .expect_code(2)
        .stderr_has(&["all`", "its validation split holds 0 tokens"]);
    eval(&txt, &["--split", "val"])
        .expect_code(2)
        .stderr_has(&["invalid --split", "all.txt` is a text file"]);
    // nanoGPT's files hold GPT-2's ids; the model's tokenizer is
    // characters.
    let nano = tmp.path().join("nano");
    std::fs::create_dir_all(&nano).expect("mkdir");
    let ids = |n: u16| (1..=n).flat_map(u16::to_le_bytes).collect::<Vec<u8>>();
    std::fs::write(nano.join("train.bin"), ids(5)).expect("write");
    std::fs::write(nano.join("val.bin"), ids(3)).expect("write");
    eval(&nano, &[]).expect_code(2).stderr_has(&[
        "nano`",
        "ids of GPT-2's tokenizer",
        "not of the model's tokenizer",
    ]);
}
