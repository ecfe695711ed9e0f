//! Data errors: each names the file and, where it can, the line or byte.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
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

    #[error("`{}` is too short: {tokens} tokens in the {split} split, but one batch window needs {need} (model.max_length + 1); use a longer corpus, a smaller model.max_length or data.val_fraction", path.display())]
    TooShort {
        path: PathBuf,
        split: &'static str,
        tokens: usize,
        need: usize,
    },

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
