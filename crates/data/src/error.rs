//! Data errors: each names the file and, where it can, the line or byte.

use std::path::PathBuf;

use crate::windows::Split;

/// Why data could not be read, encoded or batched. New variants may come
/// (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file could not be read.
    #[error("failed to read `{}`", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// A file (a cache, a tokenizer) could not be written.
    #[error("failed to write `{}`", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// A corpus or pairs file has nothing in it.
    #[error("`{}` is empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },

    /// A text file is not UTF-8.
    #[error("`{}` is not UTF-8 text: invalid byte 0x{byte:02x} at byte {offset} (line {line})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The first invalid byte's offset.
        offset: usize,
        /// Its line, from 1.
        line: usize,
        /// Its value.
        byte: u8,
    },

    /// A split has too few tokens for one window.
    #[error("{tokens} tokens in the {split} split, but one window of {block} tokens needs {} (its inputs and the next token)", block + 1)]
    TooShort {
        /// Which split.
        split: Split,
        /// The tokens it has.
        tokens: usize,
        /// The window (context) length asked for.
        block: usize,
    },

    /// An argument out of its range (a zero size, say).
    #[error("invalid {what}: {why}")]
    InvalidArgument {
        /// The argument.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },

    /// A `tokenizer.json` that does not load.
    #[error("invalid tokenizer `{}`: {message}", path.display())]
    BadTokenizer {
        /// The file.
        path: PathBuf,
        /// What the tokenizers library said.
        message: String,
    },

    /// A row of a pairs file that cannot be used (with `BadRows::Error`).
    #[error("`{}` line {line}: {why}", path.display())]
    BadRow {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        why: String,
    },

    /// A token shard (or a store's manifest) that cannot be read as it is.
    #[error("bad token shard `{}`: {why}", path.display())]
    BadShard {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },

    /// A shard of a store, opened and checked before, that can no longer be
    /// read: removed, truncated or its disk failing under a running job.
    #[error("failed to read the token shard `{}` (opened and checked as the run began: removed, truncated, or its disk failing since)", path.display())]
    ShardUnreadable {
        /// The shard.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },

    /// A token store that is not the one asked for (another tokenizer, other
    /// inputs or settings).
    #[error("token store `{}`: {why}", path.display())]
    StoreMismatch {
        /// The store's folder (or file).
        path: PathBuf,
        /// What differs, and what to do.
        why: String,
    },

    /// The tokenizers library failed to train or encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
