//! Data errors: each names the file and, where it can, the line or byte.

use std::path::PathBuf;

use crate::windows::Split;

/// Why data could not be read, encoded or batched. New variants may come
/// (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    #[error("failed to read `{}`", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("failed to write `{}`", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("`{}` is empty", path.display())]
    Empty { path: PathBuf },

    #[error("`{}` is not UTF-8 text: invalid byte 0x{byte:02x} at byte {offset} (line {line})", path.display())]
    NotUtf8 {
        path: PathBuf,
        offset: usize,
        line: usize,
        byte: u8,
    },

    #[error("{tokens} tokens in the {split} split, but one window of {block} tokens needs {} (its inputs and the next token)", block + 1)]
    TooShort {
        split: Split,
        tokens: usize,
        block: usize,
    },

    #[error("invalid {what}: {why}")]
    InvalidArgument { what: &'static str, why: String },

    #[error("invalid tokenizer `{}`: {message}", path.display())]
    BadTokenizer { path: PathBuf, message: String },

    #[error("`{}` line {line}: {why}", path.display())]
    BadRow {
        path: PathBuf,
        line: usize,
        why: String,
    },

    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
