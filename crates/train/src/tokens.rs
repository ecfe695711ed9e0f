//! Where a language model's tokens come from: a small text file read into
//! memory (the shipped Tiny Shakespeare's path), a token store (kiln's,
//! llm.c's shards, nanoGPT's `.bin` files) read from disk, or documents
//! (a folder, a glob, JSON lines, parquet, compressed files, a text file
//! over 64 MiB) prepared into a store under `data.cache_dir` first. And
//! `kiln prepare`: the same preparation from a config into a named folder.

use std::path::{Path, PathBuf};

use kiln_config::{RunConfig, TokenizerKind as ConfigTokenizer};
use kiln_data::store::{StoreKind, TOKENIZER, TokenWidth};
use kiln_data::{
    BadRows, DataError, DocFormat, InputFile, PrepareOptions, PrepareOutcome, PrepareSettings,
    ReadOptions, TokenStore, Tokenizer, find_inputs_and_others, read_sample, sha256_hex,
};

use crate::TrainError;
use crate::report::{Event, Observer};

/// A plain-text file up to this size is read into memory; a larger one is
/// prepared into a token store.
pub const MEMORY_TEXT_LIMIT: u64 = 64 << 20;

/// How a run's `data.path` is read.
#[derive(Debug)]
pub(crate) enum Route {
    /// One text file, into memory.
    Memory,
    /// A folder of tokens.
    Store(PathBuf),
    /// Documents to prepare first, and the files beside them left out.
    Documents(Vec<InputFile>, Vec<PathBuf>),
}

/// Which route `config.data.path` takes.
pub(crate) fn route(config: &RunConfig) -> Result<Route, TrainError> {
    let path = Path::new(&config.data.path);
    if TokenStore::detect(path).is_some() {
        return Ok(Route::Store(path.to_path_buf()));
    }
    if path.is_file() {
        let small_text = match InputFile::classify(path) {
            // Any other single file is read as text, as before stores.
            None => true,
            Some((DocFormat::Text, kiln_data::Compression::None)) => {
                std::fs::metadata(path).map_or(true, |m| m.len() <= MEMORY_TEXT_LIMIT)
            }
            Some(_) => false,
        };
        if small_text {
            return Ok(Route::Memory);
        }
    } else if !path.exists() && !config.data.path.contains(['*', '?', '[']) {
        // The memory path names a missing file as it always has.
        return Ok(Route::Memory);
    }
    let (inputs, others) = find_inputs_and_others(&config.data.path)?;
    Ok(Route::Documents(inputs, others))
}

/// Says which files of `data.path` are left out as not documents (a
/// folder's images, say), where there are any.
pub(crate) fn note_left_out(config: &RunConfig, others: &[PathBuf], observer: &mut dyn Observer) {
    if others.is_empty() {
        return;
    }
    let shown: Vec<String> = others
        .iter()
        .take(3)
        .map(|p| format!("`{}`", p.display()))
        .collect();
    let more = others.len().saturating_sub(shown.len());
    observer.event(&Event::Note(format!(
        "{} of data.path `{}` left out, not of a kind read as documents ({}): {}{}",
        crate::counted(others.len(), "file"),
        config.data.path,
        kiln_data::DOCUMENT_KINDS,
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )));
}

/// The settings a config prepares documents with.
pub(crate) fn settings(config: &RunConfig) -> PrepareSettings {
    let d = &config.data;
    PrepareSettings {
        source: d.path.clone(),
        text_field: d.text_field.clone(),
        val_fraction: d.val_fraction,
        shard_tokens: d.shard_tokens,
        tokenizer: tokenizer_name(config).into(),
        vocab_size: match d.tokenizer {
            ConfigTokenizer::Bpe => d.vocab_size,
            _ => 0,
        },
        tokenizer_sample_bytes: match d.tokenizer {
            ConfigTokenizer::Char | ConfigTokenizer::Bpe if d.tokenizer_file.is_none() => {
                d.tokenizer_sample_bytes
            }
            _ => 0,
        },
    }
}

/// The config's tokenizer as a store names it.
fn tokenizer_name(config: &RunConfig) -> &'static str {
    if config.data.tokenizer_file.is_some() {
        return "file";
    }
    match config.data.tokenizer {
        ConfigTokenizer::Char => "char",
        ConfigTokenizer::Bpe => "bpe",
        ConfigTokenizer::Gpt2 => "gpt2",
        ConfigTokenizer::Wordpiece => "wordpiece",
    }
}

fn read_options(config: &RunConfig) -> ReadOptions {
    ReadOptions {
        text_field: config.data.text_field.clone(),
        bad_rows: match config.data.bad_rows {
            kiln_config::BadRowsMode::Skip => BadRows::Skip,
            kiln_config::BadRowsMode::Error => BadRows::Error,
        },
    }
}

/// The tokenizer a store is prepared with, from the config: GPT-2's, a
/// `tokenizer.json`, or one trained on the corpus' first documents; with an
/// end-of-text token. Returns it and the bytes it learned from.
fn store_tokenizer(
    config: &RunConfig,
    inputs: &[InputFile],
    observer: &mut dyn Observer,
) -> Result<(Tokenizer, u64), TrainError> {
    if let Some(file) = &config.data.tokenizer_file {
        return Ok((Tokenizer::load(Path::new(file))?.with_end_of_text(), 0));
    }
    match config.data.tokenizer {
        ConfigTokenizer::Gpt2 => Ok((Tokenizer::gpt2()?, 0)),
        ConfigTokenizer::Wordpiece => Err(TrainError::Unsupported(
            "data.tokenizer = wordpiece",
            "WordPiece comes with the nli workload; use gpt2, char or bpe for a language model"
                .into(),
        )),
        kind => {
            let sample = read_sample(
                inputs,
                &read_options(config),
                config.data.tokenizer_sample_bytes,
            )?;
            observer.event(&Event::Note(format!(
                "training the {} tokenizer on the corpus' first {} of documents (data.tokenizer_sample_bytes)",
                tokenizer_name(config),
                if sample.len() < 1 << 20 {
                    format!("{:.1} KiB", sample.len() as f64 / 1024.0)
                } else {
                    format!("{:.1} MiB", sample.len() as f64 / f64::from(1u32 << 20))
                }
            )));
            let t = match kind {
                // U+FFFD stands for a character the sample did not have.
                ConfigTokenizer::Char => Tokenizer::char_level(&format!("{sample}\u{fffd}"))?,
                _ => Tokenizer::bpe(&sample, config.data.vocab_size)?,
            };
            let t = t.with_end_of_text();
            if let Some(short) = vocabulary_short(config, t.vocab_size()) {
                observer.event(&Event::Note(short));
            }
            Ok((t, sample.len() as u64))
        }
    }
}

/// Prepares the documents of `config.data.path` into `out` (a new store, or
/// the one an interrupted prepare left), telling `observer` how far it is.
pub fn prepare_store(
    config: &RunConfig,
    out: &Path,
    threads: Option<usize>,
    observer: &mut dyn Observer,
) -> Result<PrepareOutcome, TrainError> {
    let (inputs, others) = find_inputs_and_others(&config.data.path)?;
    note_left_out(config, &others, observer);
    prepare_inputs(config, inputs, out, threads, observer)
}

fn prepare_inputs(
    config: &RunConfig,
    inputs: Vec<InputFile>,
    out: &Path,
    threads: Option<usize>,
    observer: &mut dyn Observer,
) -> Result<PrepareOutcome, TrainError> {
    let mut options = PrepareOptions::new(
        inputs,
        settings(config),
        read_options(config),
        out.to_path_buf(),
    );
    options.threads = threads;
    // An interrupted or finished store keeps the tokenizer it started with.
    let saved = out.join(TOKENIZER);
    let (tokenizer, trained_on) = if saved.is_file() {
        // The sample size it learned from is in the store's record.
        (Tokenizer::load(&saved)?, 0)
    } else {
        store_tokenizer(config, &options.inputs, observer)?
    };
    let outcome = kiln_data::prepare(&options, &tokenizer, trained_on, &mut |p| {
        observer.event(&Event::Prepare(*p));
    })?;
    Ok(outcome)
}

/// The store the documents `inputs` of `config.data.path` are prepared
/// into under `data.cache_dir` (keyed by inputs and settings; prepared
/// once, continued if interrupted).
pub(crate) fn prepare_cached(
    config: &RunConfig,
    inputs: Vec<InputFile>,
    observer: &mut dyn Observer,
) -> Result<PathBuf, TrainError> {
    let mut key = serde_json::to_vec(&(settings(config), &inputs)).unwrap_or_default();
    if let Some(file) = &config.data.tokenizer_file {
        key.extend(std::fs::read(file).unwrap_or_default());
    }
    let out = Path::new(&config.data.cache_dir).join(format!("store-{}", &sha256_hex(&key)[..16]));
    let total: u64 = inputs.iter().map(|f| f.bytes).sum();
    observer.event(&Event::Note(format!(
        "data.path names documents ({}, {:.1} MiB): preparing them into the token store `{}` (once; `kiln prepare` does this ahead)",
        crate::counted(inputs.len(), "file"),
        total as f64 / f64::from(1u32 << 20),
        out.display()
    )));
    let outcome = prepare_inputs(config, inputs, &out, None, observer)?;
    if !outcome.already_prepared {
        observer.event(&Event::Note(format!(
            "prepared {} tokens in {:.1} s",
            outcome
                .manifest
                .shards
                .iter()
                .map(|s| s.tokens)
                .sum::<usize>(),
            outcome.seconds
        )));
    }
    Ok(out)
}

/// Opens the store and the tokenizer its tokens are ids of, checking that
/// it is the run's: `run_tokenizer` is a resumed run's saved tokenizer,
/// else the config's.
pub(crate) fn open_store(
    config: &RunConfig,
    path: &Path,
    run_tokenizer: Option<&Path>,
) -> Result<(TokenStore, Tokenizer), TrainError> {
    let store = TokenStore::open(path)?;
    let mismatch = |why: String| {
        TrainError::Data(DataError::StoreMismatch {
            path: path.to_path_buf(),
            why,
        })
    };
    let tokenizer = match (&store.kind, &store.manifest) {
        (StoreKind::Kiln, Some(manifest)) => {
            let t = kiln_store_tokenizer(path, manifest)?;
            let same = |other: Tokenizer| -> Result<bool, TrainError> {
                Ok(other.to_json()? == t.to_json()?)
            };
            if let Some(saved) = run_tokenizer {
                if !same(Tokenizer::load(saved)?)? {
                    return Err(mismatch(format!(
                        "its tokenizer is not the one the run trained with (`{}`)",
                        saved.display()
                    )));
                }
            } else if let Some(file) = &config.data.tokenizer_file {
                if !same(Tokenizer::load(Path::new(file))?.with_end_of_text())? {
                    return Err(mismatch(format!(
                        "it was prepared with another tokenizer than data.tokenizer_file `{file}`"
                    )));
                }
            } else if manifest.tokenizer.kind != tokenizer_name(config) {
                return Err(mismatch(format!(
                    "it was prepared with the `{}` tokenizer but the run asks for `{}` (data.tokenizer); set data.tokenizer={} or prepare the store again",
                    manifest.tokenizer.kind,
                    tokenizer_name(config),
                    manifest.tokenizer.kind
                )));
            }
            t
        }
        _ => {
            // llm.c's GPT-2 shards and nanoGPT's files hold GPT-2's ids.
            match (&config.data.tokenizer_file, run_tokenizer) {
                (_, Some(saved)) => Tokenizer::load(saved)?,
                (Some(file), None) => Tokenizer::load(Path::new(file))?,
                (None, None) if store.width() == TokenWidth::U32 => {
                    return Err(mismatch(
                        "its shards hold uint32 tokens (llm.c writes Llama 3's so), whose tokenizer kiln does not have: give it as data.tokenizer_file".into(),
                    ));
                }
                (None, None) if config.data.tokenizer != ConfigTokenizer::Gpt2 => {
                    return Err(mismatch(format!(
                        "{} hold GPT-2's token ids, but the run asks for the `{}` tokenizer (data.tokenizer); set data.tokenizer=gpt2",
                        gpt2_files(store.kind),
                        tokenizer_name(config)
                    )));
                }
                (None, None) => Tokenizer::gpt2()?,
            }
        }
    };
    Ok((store, tokenizer))
}

/// The tokenizer a kiln store's ids are of: its `tokenizer.json`, or
/// GPT-2's built in where the manifest's sha256 says it is that (parsing
/// its 6 MB file again is most of a start-up).
pub(crate) fn kiln_store_tokenizer(
    path: &Path,
    manifest: &kiln_data::store::Manifest,
) -> Result<Tokenizer, TrainError> {
    if manifest.tokenizer.kind == "gpt2" {
        let gpt2 = Tokenizer::gpt2()?;
        if sha256_hex(gpt2.to_json()?.as_bytes()) == manifest.tokenizer.sha256 {
            return Ok(gpt2);
        }
    }
    Ok(Tokenizer::load(&path.join(TOKENIZER))?)
}

/// What a store without a manifest that holds GPT-2's ids is, for
/// messages: nanoGPT's files or llm.c's `uint16` shards.
pub(crate) fn gpt2_files(kind: StoreKind) -> &'static str {
    if kind == StoreKind::NanoGpt {
        "nanoGPT's train.bin and val.bin"
    } else {
        "llm.c's uint16 shards"
    }
}

/// How fast a store's windows are read, against what the run needs.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct StoreRead {
    /// The store's folder.
    pub path: PathBuf,
    /// Its shards.
    pub shards: usize,
    /// Bytes a token takes on disk.
    pub bytes_per_token: usize,
    /// Random windows of `model.max_length + 1` tokens read now, MB/s (the
    /// page cache included: a store just prepared reads from memory).
    pub disk_mb_per_s: f64,
    /// What the run reads at the measured burst's speed, MB/s (none
    /// without a burst).
    pub needed_mb_per_s: Option<f64>,
}

/// Times random windows read from the store for about a quarter of a
/// second; `None` where its training split has no window of `block`
/// tokens to read (the run refuses such a store: that is the finding); an
/// error where a shard cannot be read.
pub(crate) fn measure_store_read(
    store: &TokenStore,
    block: usize,
) -> Result<Option<StoreRead>, kiln_data::DataError> {
    use kiln_data::TokenSpan;
    let split = &store.train;
    if split.len() <= block {
        return Ok(None);
    }
    let window = block + 1;
    let mut out = vec![0u32; window];
    let span = split.len().saturating_sub(window).max(1);
    let started = std::time::Instant::now();
    let mut reads = 0u64;
    // A fixed sequence of offsets spread over the split (Knuth's multiplier).
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while reads < 20_000 && (reads < 16 || started.elapsed().as_secs_f64() < 0.25) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        split.read((x >> 11) as usize % span, &mut out)?;
        reads += 1;
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let bytes_per_token = store.width().bytes();
    Ok(Some(StoreRead {
        path: store.path.clone(),
        shards: store.train.shards().len() + store.val.shards().len(),
        bytes_per_token,
        disk_mb_per_s: (reads as usize * window * bytes_per_token) as f64 / seconds / 1e6,
        needed_mb_per_s: None,
    }))
}

/// Where a BPE trained for `config` has fewer than the `data.vocab_size`
/// ids asked (`vocab`: every id it has): what it learned
/// and why, as a line. A text small for the size asked has no more pairs
/// seen twice to merge.
pub(crate) fn vocabulary_short(config: &RunConfig, vocab: usize) -> Option<String> {
    let asked = config.data.vocab_size;
    (config.data.tokenizer == ConfigTokenizer::Bpe
        && config.data.tokenizer_file.is_none()
        && vocab < asked)
        .then(|| {
            format!(
                "the BPE tokenizer has {vocab} ids of the {asked} data.vocab_size asks: its text has no more pairs seen twice to merge (more text gives more: a larger corpus, or data.tokenizer_sample_bytes where documents are prepared)"
            )
        })
}

/// What a language model's run trained on, as `data.json` in its folder
/// records it: a resume on other tokens would not draw the batches the run
/// would have drawn, and says so.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct DataFingerprint {
    /// Tokens in the training split.
    pub(crate) train_tokens: usize,
    /// Tokens in the validation split.
    pub(crate) val_tokens: usize,
    /// SHA-256 of 65 pieces of 64 tokens spread evenly over each split
    /// (a store of billions of tokens is not read whole for it).
    pub(crate) sample_sha256: String,
}

impl DataFingerprint {
    /// Its file in the run's folder.
    pub(crate) const FILE: &str = "data.json";

    /// The fingerprint of the two splits.
    pub(crate) fn of(
        train: &dyn kiln_data::TokenSpan,
        val: &dyn kiln_data::TokenSpan,
    ) -> Result<Self, DataError> {
        const PIECES: usize = 64;
        const PIECE: usize = 64;
        let mut bytes = Vec::with_capacity(2 * (PIECES + 1) * PIECE * 4);
        for split in [train, val] {
            let n = split.len();
            let mut piece = vec![0u32; PIECE.min(n)];
            for i in 0..=PIECES {
                split.read((n - piece.len()) * i / PIECES, &mut piece)?;
                bytes.extend(piece.iter().flat_map(|t| t.to_le_bytes()));
            }
        }
        Ok(Self {
            train_tokens: train.len(),
            val_tokens: val.len(),
            sample_sha256: sha256_hex(&bytes),
        })
    }

    /// How `now` differs from `self` (the run's), in words; `None` where
    /// they are the same.
    pub(crate) fn differs(&self, now: &Self) -> Option<String> {
        if self == now {
            return None;
        }
        Some(
            if (self.train_tokens, self.val_tokens) == (now.train_tokens, now.val_tokens) {
                format!(
                    "as many tokens as before ({} training, {} validation), but others",
                    self.train_tokens, self.val_tokens
                )
            } else {
                format!(
                    "{} training and {} validation tokens, where the run had {} and {}",
                    now.train_tokens, now.val_tokens, self.train_tokens, self.val_tokens
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::config;

    /// A BPE of fewer ids than asked says so, with both numbers; one of the
    /// size asked, a loaded tokenizer file or a character-level one do not.
    #[test]
    fn a_bpe_short_of_its_vocabulary_says_so() {
        let bpe = config(&["data.tokenizer=bpe", "data.vocab_size=70000"]);
        let short = vocabulary_short(&bpe, 12_712).expect("short");
        assert!(short.contains("12712 ids of the 70000"), "{short}");
        assert_eq!(vocabulary_short(&bpe, 70_000), None);
        let loaded = config(&[
            "data.tokenizer=bpe",
            "data.vocab_size=70000",
            "data.tokenizer_file=t.json",
        ]);
        assert_eq!(vocabulary_short(&loaded, 300), None);
        assert_eq!(
            vocabulary_short(&config(&["data.tokenizer=char"]), 65),
            None
        );
    }
}
