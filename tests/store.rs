//! Token stores as a user makes and trains on them: `kiln prepare` on a
//! folder of documents, training and exact resume on the store with any
//! number of loader workers, `kiln train` on documents with no store yet,
//! and each kind of bad input named with exit 2.

use std::path::{Path, PathBuf};

use crate::support::{kill_when, kiln, root};
use crate::train::{checkpoint_digest, ckpt, tiny};

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
    let store = dir.join("shakespeare.store");
    prepare(
        &docs,
        &store,
        &["data.tokenizer=char", "data.shard_tokens=20000"],
    )
    .expect_code(0)
    .stdout_has(&[
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
