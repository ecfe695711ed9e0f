#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! kiln-data: tokenizers, token caches and a parallel batch loader, with no
//! ML framework. It yields host batches (token ids) and measures how long the
//! consumer waited for each.
//!
//! - [`Tokenizer`]: character-level (vocabulary read off the corpus) or
//!   byte-level BPE trained locally, both Hugging Face `tokenizers` models
//!   saved as a `tokenizer.json` that Python's `tokenizers` loads.
//! - [`read_corpus`] and [`encode_cached`]: a UTF-8 corpus encoded once, in
//!   parallel, into a cache keyed by the corpus hash and the tokenizer.
//! - [`LmWindows`]: nanoGPT's random windows, batch `k` drawn from its own
//!   seeded RNG so that the sequence does not depend on who draws it;
//!   [`PairBatches`]: sentence pairs padded per batch. Each one's `share`
//!   is a data-parallel rank's part of every batch.
//! - [`Loader`]: N worker threads with bounded prefetch, the same batches in
//!   the same order whatever N, and the wait for each batch measured;
//!   [`benchmark_loader`] times it alone.
//! - [`prepare()`]: documents as users have them ([`find_inputs`]: text,
//!   JSON lines, parquet, each also gzip or zstd) into a token store of
//!   llm.c-format shards with a manifest, streaming with bounded memory,
//!   the same bytes for any thread count, continued after a kill;
//!   [`TokenStore`] opens one (or llm.c's shards, or nanoGPT's `.bin`
//!   files) for windows read from disk; [`Tokenizer::gpt2`] is GPT-2's
//!   tokenizer, built in.
//! - [`read_pairs`]: sentence pairs from JSONL, TSV or CSV, with bad rows
//!   skipped and counted or rejected, and [`grouped_stratified_folds`] to
//!   split them for cross-validation without a premise in two folds.
#![warn(missing_docs)]

mod cache;
mod corpus;
mod documents;
mod error;
mod folds;
mod gpt2;
mod loader;
mod pair_batches;
mod pairs;
mod parquet_text;
pub mod prepare;
pub mod store;
mod tokenizer;
mod windows;

pub use cache::{CacheOutcome, encode_cached};
pub use corpus::{Corpus, read_corpus};
pub use documents::{
    Compression, DOCUMENT_KINDS, DocFormat, InputFile, ReadOptions, SkippedRows, find_inputs,
    find_inputs_and_others,
};
pub use error::DataError;
pub use folds::grouped_stratified_folds;
pub use loader::{BatchSource, Loaded, Loader, LoaderBenchmark, benchmark_loader};
pub use pair_batches::{EncodedPair, PairBatch, PairBatches, encode_dataset, pad_batch};
pub use pairs::{BadRows, Pair, PairDataset, PairFormat, PairSchema, read_pairs};
pub use prepare::{
    PrepareOptions, PrepareOutcome, PrepareProgress, prepare, read_sample, sha256_hex,
};
pub use store::{Manifest, MemoryTokens, PrepareSettings, ShardSequence, TokenSpan, TokenStore};
pub use tokenizer::{END_OF_TEXT, PairIds, SPECIALS, Tokenizer, TokenizerKind};
pub use windows::{LmWindows, Split, TokenBatch};

/// The first file (not a folder) among `path` and the folders above it:
/// where a folder is to be made, a file in the way is the user's input to
/// name, not a failure to write.
pub fn file_in_the_way(path: &std::path::Path) -> Option<&std::path::Path> {
    path.ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists() && !a.is_dir())
}
