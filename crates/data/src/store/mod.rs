//! The token store: a folder of llm.c-format shards and a `manifest.json`,
//! what `kiln prepare` writes and training reads windows from. Training
//! also reads what people already prepared: llm.c's shard folders
//! (`*_train_*.bin`, `*_val_*.bin`) and nanoGPT's headerless `uint16`
//! `train.bin`/`val.bin`. Tokens are read where a window needs them, so
//! memory and start-up do not grow with the corpus.

pub mod shard;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::documents::{InputFile, SkippedRows};
use crate::{DataError, Split};
pub use shard::{Shard, TokenWidth};

/// The store's description, `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `"kiln-token-store"`.
    pub format: String,
    /// Its layout's version (1).
    pub version: u32,
    /// What wrote it (`kiln-data 0.1.0`).
    pub written_by: String,
    /// The tokenizer, also saved as `tokenizer.json` beside the shards.
    pub tokenizer: TokenizerInfo,
    /// How wide the tokens are in the shards.
    pub width: TokenWidth,
    /// The settings it was prepared with (a store prepared again with the
    /// same settings continues it; with others, it is refused).
    pub settings: PrepareSettings,
    /// The input files, with their sizes.
    pub inputs: Vec<InputFile>,
    /// The shards, in order (training reads each split's in this order).
    pub shards: Vec<ShardInfo>,
    /// Documents read (not counting skipped rows).
    pub documents: u64,
    /// Bytes of text encoded.
    pub text_bytes: u64,
    /// Rows skipped (`data.bad_rows = "skip"`).
    pub skipped: SkippedRows,
}

/// The tokenizer a store's tokens are ids of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `gpt2`, `char`, `bpe` or `file` (a `tokenizer.json` the user gave).
    pub kind: String,
    /// Its vocabulary size.
    pub vocab_size: usize,
    /// The id put before each document.
    pub end_of_text: u32,
    /// sha256 of its `tokenizer.json`.
    pub sha256: String,
    /// Bytes of text a trained tokenizer learned from (0: not trained).
    pub trained_on_bytes: u64,
}

/// The settings that decide a store's bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrepareSettings {
    /// What `data.path` said.
    pub source: String,
    /// The JSON field or parquet column of the text.
    pub text_field: String,
    /// The share of text that goes to validation (by whole documents, or
    /// by pieces of those longer than a piece).
    pub val_fraction: f64,
    /// Tokens per shard (the last of each split has fewer).
    pub shard_tokens: usize,
    /// `data.tokenizer` (or `file`).
    pub tokenizer: String,
    /// For trained tokenizers: their vocabulary size.
    pub vocab_size: usize,
    /// For trained tokenizers: the text they learn from, at most.
    pub tokenizer_sample_bytes: u64,
}

/// One shard of the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Its file name in the store.
    pub file: String,
    /// `train` or `val`.
    pub split: String,
    /// Tokens in it.
    pub tokens: usize,
    /// Documents that begin in it.
    pub documents: u64,
}

impl Manifest {
    /// Tokens in a split.
    pub fn tokens(&self, split: Split) -> usize {
        let name = split_name(split);
        self.shards
            .iter()
            .filter(|s| s.split == name)
            .map(|s| s.tokens)
            .sum()
    }
}

/// `train` or `val`, as shard names and the manifest spell them.
pub fn split_name(split: Split) -> &'static str {
    match split {
        Split::Train => "train",
        Split::Val => "val",
    }
}

/// What a folder of tokens is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// kiln's store: shards and a manifest.
    Kiln,
    /// llm.c's shards without a manifest (GPT-2's tokens when `uint16`).
    Llmc,
    /// nanoGPT's headerless `train.bin` and `val.bin` (`uint16`, GPT-2's tokens).
    NanoGpt,
}

/// A store opened for reading: each split's shards, end to end.
#[derive(Debug)]
pub struct TokenStore {
    /// The folder.
    pub path: PathBuf,
    /// What it is.
    pub kind: StoreKind,
    /// Its manifest (kiln's stores only).
    pub manifest: Option<Manifest>,
    /// The training split.
    pub train: Arc<ShardSequence>,
    /// The validation split.
    pub val: Arc<ShardSequence>,
}

impl TokenStore {
    /// What `path` holds, if it is a folder of tokens; `None` for anything
    /// else (documents to prepare).
    pub fn detect(path: &Path) -> Option<StoreKind> {
        if !path.is_dir() {
            return None;
        }
        if path.join(MANIFEST).is_file() {
            return Some(StoreKind::Kiln);
        }
        if path.join("train.bin").is_file() && path.join("val.bin").is_file() {
            return Some(StoreKind::NanoGpt);
        }
        let names = llmc_shards(path).ok()?;
        (!names.0.is_empty() && !names.1.is_empty()).then_some(StoreKind::Llmc)
    }

    /// Opens the store in `path`: every shard's header checked against its
    /// size; nothing else read. A store of more shards than a quarter of
    /// the files this process may hold open ([`shards_kept_open`]) keeps
    /// none of their files open ([`Shard::without_file`]): each read opens
    /// its shard, a few microseconds more.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        Self::open_keeping(path, shards_kept_open())
    }

    /// [`TokenStore::open`], holding the shards' files open where there
    /// are at most `keep_open` of them.
    fn open_keeping(path: &Path, keep_open: usize) -> Result<Self, DataError> {
        let not_a_store = || DataError::InvalidArgument {
            what: "token store",
            why: format!(
                "`{}` is neither a kiln token store (manifest.json), llm.c's shards (*_train_*.bin and *_val_*.bin) nor nanoGPT's train.bin and val.bin",
                path.display()
            ),
        };
        let kind = Self::detect(path).ok_or_else(not_a_store)?;
        let (manifest, train, val) = match kind {
            StoreKind::Kiln => {
                let manifest = read_manifest(path)?;
                let keep = manifest.shards.len() <= keep_open;
                let open = |split: Split| -> Result<Vec<Shard>, DataError> {
                    let name = split_name(split);
                    manifest
                        .shards
                        .iter()
                        .filter(|s| s.split == name)
                        .map(|s| {
                            let shard = kept(Shard::open(&path.join(&s.file))?, keep);
                            if shard.tokens() != s.tokens {
                                return Err(DataError::BadShard {
                                    path: path.join(&s.file),
                                    why: format!(
                                        "it holds {} tokens but manifest.json says {}",
                                        shard.tokens(),
                                        s.tokens
                                    ),
                                });
                            }
                            Ok(shard)
                        })
                        .collect()
                };
                let (train, val) = (open(Split::Train)?, open(Split::Val)?);
                (Some(manifest), train, val)
            }
            StoreKind::Llmc => {
                let (train, val) = llmc_shards(path).map_err(|source| DataError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                let keep = train.len() + val.len() <= keep_open;
                let open = |files: Vec<PathBuf>| -> Result<Vec<Shard>, DataError> {
                    files
                        .iter()
                        .map(|f| Ok(kept(Shard::open(f)?, keep)))
                        .collect()
                };
                (None, open(train)?, open(val)?)
            }
            StoreKind::NanoGpt => (
                None,
                vec![Shard::open_headerless(&path.join("train.bin"))?],
                vec![Shard::open_headerless(&path.join("val.bin"))?],
            ),
        };
        Ok(Self {
            path: path.to_path_buf(),
            kind,
            manifest,
            train: Arc::new(ShardSequence::new(train)),
            val: Arc::new(ShardSequence::new(val)),
        })
    }

    /// The shards' token width (of the training split's first shard).
    pub fn width(&self) -> TokenWidth {
        self.train
            .shards
            .first()
            .map_or(TokenWidth::U16, Shard::width)
    }

    /// The split's tokens.
    pub fn split(&self, split: Split) -> &Arc<ShardSequence> {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }
}

/// The files this process may hold open: its soft `RLIMIT_NOFILE` (1,024
/// by default on Linux, 256 on macOS; `kiln` raises it to the hard limit
/// as it starts). A store of 10 billion tokens in shards of a million has
/// 10,000 shards.
pub fn open_files_limit() -> usize {
    nofile().map_or(1024, |l| usize::try_from(l.rlim_cur).unwrap_or(usize::MAX))
}

/// The most shards a store keeps open ([`TokenStore::open`]): a quarter of
/// [`open_files_limit`], the rest left to the run's other files.
pub fn shards_kept_open() -> usize {
    open_files_limit() / 4
}

/// Raises this process's soft limit on open files to its hard limit, as
/// Go's runtime does: a store keeps its shards open while they fit in a
/// quarter of it ([`open_files_limit`]), and the soft default is a few
/// hundred shards. Where the system refuses, the limit stays as it was.
pub fn raise_open_files_limit() {
    if let Some(mut limit) = nofile().filter(|l| l.rlim_cur < l.rlim_max) {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit only reads the struct it is given.
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}

/// This process's `RLIMIT_NOFILE`, where it can be read.
fn nofile() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// `shard`, without its file unless `keep`.
fn kept(shard: Shard, keep: bool) -> Shard {
    if keep { shard } else { shard.without_file() }
}

/// The manifest's file name in a store.
pub const MANIFEST: &str = "manifest.json";
/// The tokenizer's file name in a store.
pub const TOKENIZER: &str = "tokenizer.json";

/// Reads `manifest.json` of the store in `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, DataError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|source| DataError::Io {
        path: path.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| DataError::BadShard {
        path,
        why: format!("not a kiln store manifest: {e}"),
    })
}

/// llm.c's shard files in `dir`: `*_train_*.bin` and `*_val_*.bin`, each
/// sorted by name.
fn llmc_shards(dir: &Path) -> std::io::Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut train = Vec::new();
    let mut val = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.ends_with(".bin") {
            continue;
        }
        if name.contains("_train_") {
            train.push(path);
        } else if name.contains("_val_") {
            val.push(path);
        }
    }
    train.sort();
    val.sort();
    Ok((train, val))
}

/// Token ids a window sampler reads from: in memory, or a split's shards.
pub trait TokenSpan: Send + Sync + std::fmt::Debug {
    /// Tokens in it.
    fn len(&self) -> usize;
    /// Whether it has no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies tokens `start..start + out.len()` into `out`; an error where
    /// a shard can no longer be read.
    fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DataError>;
}

/// Ids held in memory.
#[derive(Clone, Debug)]
pub struct MemoryTokens(pub Arc<[u32]>);

impl TokenSpan for MemoryTokens {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DataError> {
        out.copy_from_slice(&self.0[start..start + out.len()]);
        Ok(())
    }
}

/// A split's shards read end to end as one sequence.
#[derive(Debug)]
pub struct ShardSequence {
    shards: Vec<Shard>,
    /// Where each shard begins in the sequence.
    starts: Vec<usize>,
    total: usize,
}

impl ShardSequence {
    /// The shards, in order.
    pub fn new(shards: Vec<Shard>) -> Self {
        let mut starts = Vec::with_capacity(shards.len());
        let mut total = 0;
        for s in &shards {
            starts.push(total);
            total += s.tokens();
        }
        Self {
            shards,
            starts,
            total,
        }
    }

    /// The shards.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }
}

impl TokenSpan for ShardSequence {
    fn len(&self) -> usize {
        self.total
    }

    fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DataError> {
        let mut at = start;
        let mut filled = 0;
        while filled < out.len() {
            let i = self.starts.partition_point(|&s| s <= at) - 1;
            let shard = &self.shards[i];
            let local = at - self.starts[i];
            let n = (shard.tokens() - local).min(out.len() - filled);
            shard.read(local, &mut out[filled..filled + n])?;
            filled += n;
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llmc_and_nanogpt_folders_open_and_read_across_shards() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        shard::write_shard(&d.join("web_val_000000.bin"), &[9, 8, 7], TokenWidth::U16).expect("w");
        shard::write_shard(&d.join("web_train_000001.bin"), &[0, 1, 2], TokenWidth::U16)
            .expect("w");
        shard::write_shard(
            &d.join("web_train_000002.bin"),
            &[3, 4, 5, 6],
            TokenWidth::U16,
        )
        .expect("w");
        assert_eq!(TokenStore::detect(d), Some(StoreKind::Llmc));
        let store = TokenStore::open(d).expect("opens");
        assert_eq!(store.train.len(), 7);
        let mut out = [0u32; 4];
        store.train.read(1, &mut out).expect("read");
        assert_eq!(out, [1, 2, 3, 4], "a window across two shards");
        assert_eq!(store.val.len(), 3);

        let nano = tempfile::tempdir().expect("tempdir");
        let bytes = |ids: &[u16]| {
            ids.iter()
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        std::fs::write(nano.path().join("train.bin"), bytes(&[5, 50256, 7])).expect("w");
        std::fs::write(nano.path().join("val.bin"), bytes(&[1, 2])).expect("w");
        let store = TokenStore::open(nano.path()).expect("opens");
        assert_eq!(store.kind, StoreKind::NanoGpt);
        let mut out = [0u32; 3];
        store.train.read(0, &mut out).expect("read");
        assert_eq!(out, [5, 50256, 7]);
        let err = TokenStore::open(Path::new("/"))
            .expect_err("not a store")
            .to_string();
        assert!(err.contains("neither a kiln token store"), "{err}");
    }

    /// A store of more shards than it may keep open holds none of their
    /// files open (one of 111,541 shards ran out of descriptors: "Too many
    /// open files") and reads the same tokens; a smaller one keeps them
    /// open.
    #[test]
    fn a_store_of_many_shards_holds_no_file_open_and_reads_the_same() {
        assert!(open_files_limit() >= 64, "{}", open_files_limit());
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        const KEEP: usize = 8;
        let shards = KEEP; // and the validation shard: one too many
        for i in 0..shards {
            let ids = [3 * i as u32, 3 * i as u32 + 1, 3 * i as u32 + 2];
            let name = format!("web_train_{i:06}.bin");
            shard::write_shard(&d.join(name), &ids, TokenWidth::U32).expect("w");
        }
        shard::write_shard(&d.join("web_val_000000.bin"), &[7, 8], TokenWidth::U32).expect("w");
        let store = TokenStore::open_keeping(d, KEEP).expect("opens");
        assert!(store.train.shards().iter().all(|s| !s.holds_file()));
        assert!(!store.val.shards()[0].holds_file());
        let mut out = vec![0u32; 3 * shards - 2];
        store.train.read(1, &mut out).expect("read");
        assert_eq!(out, (1..3 * shards as u32 - 1).collect::<Vec<_>>());
        std::fs::remove_file(d.join("web_train_000000.bin")).expect("rm");
        let store = TokenStore::open_keeping(d, KEEP).expect("opens");
        assert!(store.train.shards().iter().all(Shard::holds_file));
        store.train.read(0, &mut out[..4]).expect("read");
        assert_eq!(out[..4], [3, 4, 5, 6]);
    }

    /// A shard removed under a running job is an error of the batch that
    /// reads it, through the loader's workers too, where it panicked.
    #[test]
    fn a_shard_lost_under_the_run_is_the_error_of_the_batch_that_reads_it() {
        use crate::{BatchSource, LmWindows, Loader, Split};
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        for i in 0..4u32 {
            let ids: Vec<u32> = (0..100).map(|t| i * 100 + t).collect();
            let name = format!("web_train_{i:06}.bin");
            shard::write_shard(&d.join(name), &ids, TokenWidth::U16).expect("w");
        }
        shard::write_shard(&d.join("web_val_000000.bin"), &[7, 8, 9], TokenWidth::U16).expect("w");
        let store = TokenStore::open_keeping(d, 0).expect("opens");
        let windows = |store: &TokenStore| {
            let train: Arc<dyn TokenSpan> = store.train.clone();
            Arc::new(LmWindows::over(train, 4, 16, 7, Split::Train).expect("windows"))
        };
        let source = windows(&store);
        source.batch(0).expect("every shard there");
        let lost = d.join("web_train_000002.bin");
        std::fs::remove_file(&lost).expect("rm");
        // Within a few batches of 4 windows, one reads the lost shard.
        let failing = (0..64)
            .find(|&k| source.batch(k).is_err())
            .expect("a batch reads the lost shard");
        let err = source.batch(failing).expect_err("lost");
        assert!(
            matches!(&err, DataError::ShardUnreadable { path, .. } if *path == lost),
            "{err}"
        );
        for workers in [0, 1, 3] {
            let mut loader = Loader::new(Arc::clone(&source), 0, workers, 2);
            for k in 0..failing {
                assert_eq!(loader.next_batch().expect("before it").index, k);
            }
            let err = loader.next_batch().expect_err("the lost shard's batch");
            assert!(err.to_string().contains("web_train_000002.bin"), "{err}");
        }
    }
}
