//! llm.c's token shard, byte for byte: a header of 256 little-endian
//! `int32` (magic, version, token count, then zeros), then the tokens,
//! `uint16` (magic 20240520, version 1: GPT-2's vocabulary) or `uint32`
//! (magic 20240801, version 7: vocabularies past 16 bits, as llm.c writes
//! Llama 3's). The reader checks the header against the file's size, as
//! llm.c's `dataloader.h` does, and names the shard when they disagree.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::DataError;

/// Bytes in a shard's header (256 `int32`).
pub const HEADER_BYTES: usize = 1024;
/// The magic of a shard of `uint16` tokens.
pub const MAGIC_U16: i32 = 20240520;
/// The magic of a shard of `uint32` tokens.
pub const MAGIC_U32: i32 = 20240801;

/// How wide each token is on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    /// `uint16`: vocabularies of up to 65,536 tokens.
    U16,
    /// `uint32`.
    U32,
}

impl TokenWidth {
    /// The width a vocabulary of `vocab_size` tokens needs.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            Self::U16
        } else {
            Self::U32
        }
    }

    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }

    fn magic_version(self) -> (i32, i32) {
        match self {
            Self::U16 => (MAGIC_U16, 1),
            Self::U32 => (MAGIC_U32, 7),
        }
    }
}

/// llm.c's header for `tokens` tokens of `width`.
pub fn header(width: TokenWidth, tokens: usize) -> Result<[u8; HEADER_BYTES], DataError> {
    let count = i32::try_from(tokens).map_err(|_| DataError::InvalidArgument {
        what: "shard size",
        why: format!("{tokens} tokens do not fit llm.c's int32 token count"),
    })?;
    let (magic, version) = width.magic_version();
    let mut bytes = [0u8; HEADER_BYTES];
    bytes[0..4].copy_from_slice(&magic.to_le_bytes());
    bytes[4..8].copy_from_slice(&version.to_le_bytes());
    bytes[8..12].copy_from_slice(&count.to_le_bytes());
    Ok(bytes)
}

/// Appends `ids` to `out` as `width` little-endian integers. Errors naming
/// the first id that does not fit.
pub fn encode_tokens(ids: &[u32], width: TokenWidth, out: &mut Vec<u8>) -> Result<(), DataError> {
    match width {
        TokenWidth::U16 => {
            out.reserve(ids.len() * 2);
            for &id in ids {
                let id = u16::try_from(id).map_err(|_| DataError::InvalidArgument {
                    what: "token id",
                    why: format!("{id} does not fit a uint16 shard"),
                })?;
                out.extend_from_slice(&id.to_le_bytes());
            }
        }
        TokenWidth::U32 => {
            out.reserve(ids.len() * 4);
            for &id in ids {
                out.extend_from_slice(&id.to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Writes a whole shard (header and tokens) to `path`.
pub fn write_shard(path: &Path, ids: &[u32], width: TokenWidth) -> Result<(), DataError> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + ids.len() * width.bytes());
    bytes.extend_from_slice(&header(width, ids.len())?);
    encode_tokens(ids, width, &mut bytes)?;
    let mut file = File::create(path).map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    file.write_all(&bytes).map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// One shard open for reading: tokens read where asked (`pread`), so memory
/// does not grow with the shard. Its file stays open, unless
/// [`Shard::without_file`] let it go (a store of more shards than a process
/// may hold files open): then each read opens it.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    file: Option<File>,
    /// Where the tokens begin (the header's size, or 0 without one).
    offset: u64,
    width: TokenWidth,
    tokens: usize,
}

impl Shard {
    /// Opens an llm.c shard, checking its magic, version and token count
    /// against the file's size.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let (file, len) = open_len(path)?;
        let bad = |why: String| DataError::BadShard {
            path: path.to_path_buf(),
            why,
        };
        if len < HEADER_BYTES as u64 {
            return Err(bad(format!(
                "{len} bytes is shorter than llm.c's {HEADER_BYTES}-byte header"
            )));
        }
        let mut head = [0u8; 12];
        file.read_exact_at(&mut head, 0)
            .map_err(|source| DataError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        let int = |i: usize| i32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        let (magic, version, count) = (int(0), int(4), int(8));
        let width = match (magic, version) {
            (MAGIC_U16, 1) => TokenWidth::U16,
            (MAGIC_U32, 7) => TokenWidth::U32,
            _ => {
                return Err(bad(format!(
                    "header magic {magic} version {version} is not llm.c's ({MAGIC_U16} version 1 for uint16 tokens, {MAGIC_U32} version 7 for uint32); a headerless nanoGPT file must be named train.bin or val.bin"
                )));
            }
        };
        let tokens = usize::try_from(count)
            .map_err(|_| bad(format!("the header's token count {count} is negative")))?;
        let expected = HEADER_BYTES as u64 + (tokens * width.bytes()) as u64;
        if len != expected {
            return Err(bad(format!(
                "the header says {tokens} tokens ({expected} bytes with the header) but the file has {len} bytes: the shard is truncated or was written by another tool; prepare it again"
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file: Some(file),
            offset: HEADER_BYTES as u64,
            width,
            tokens,
        })
    }

    /// Opens a headerless file of `uint16` tokens (nanoGPT's `train.bin`).
    pub fn open_headerless(path: &Path) -> Result<Self, DataError> {
        let (file, len) = open_len(path)?;
        if len % 2 != 0 {
            return Err(DataError::BadShard {
                path: path.to_path_buf(),
                why: format!("{len} bytes is not a whole number of uint16 tokens"),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            file: Some(file),
            offset: 0,
            width: TokenWidth::U16,
            tokens: (len / 2) as usize,
        })
    }

    /// The shard with its file closed, checked as it was: each read opens
    /// it again (a few microseconds), so that a store of many thousands of
    /// shards does not run out of the process's file descriptors.
    pub fn without_file(mut self) -> Self {
        self.file = None;
        self
    }

    /// Whether the shard holds its file open.
    pub fn holds_file(&self) -> bool {
        self.file.is_some()
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the shard.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// How wide its tokens are.
    pub fn width(&self) -> TokenWidth {
        self.width
    }

    /// Reads `out.len()` tokens from token `start`. Panics if the range is
    /// outside the shard (callers check); an error where the file can no
    /// longer be read (it was removed or truncated under a running job).
    pub fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DataError> {
        assert!(
            start + out.len() <= self.tokens,
            "read past the shard's end"
        );
        let w = self.width.bytes();
        let mut bytes = vec![0u8; out.len() * w];
        let at = self.offset + (start * w) as u64;
        let read = match &self.file {
            Some(file) => file.read_exact_at(&mut bytes, at),
            None => File::open(&self.path).and_then(|file| file.read_exact_at(&mut bytes, at)),
        };
        read.map_err(|source| DataError::ShardUnreadable {
            path: self.path.clone(),
            source,
        })?;
        match self.width {
            TokenWidth::U16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u32::from(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            TokenWidth::U32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
        Ok(())
    }
}

fn open_len(path: &Path) -> Result<(File, u64), DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    Ok((file, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_reads_back_what_was_written_in_either_width() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (width, ids) in [
            (TokenWidth::U16, vec![0u32, 1, 50256, 65535, 7]),
            (TokenWidth::U32, vec![0u32, 128_000, 70_000, 3]),
        ] {
            let path = dir.path().join("s.bin");
            write_shard(&path, &ids, width).expect("writes");
            let shard = Shard::open(&path).expect("opens");
            assert_eq!(shard.tokens(), ids.len());
            assert_eq!(shard.width(), width);
            let mut out = vec![0u32; ids.len() - 1];
            shard.read(1, &mut out).expect("read");
            assert_eq!(out, ids[1..]);
        }
        let err = encode_tokens(&[70_000], TokenWidth::U16, &mut Vec::new()).expect_err("too big");
        assert!(err.to_string().contains("70000"), "{err}");
    }

    #[test]
    fn a_header_that_disagrees_with_the_size_names_the_shard() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x_train_000000.bin");
        write_shard(&path, &[1, 2, 3, 4], TokenWidth::U16).expect("writes");
        let bytes = std::fs::read(&path).expect("read");
        std::fs::write(&path, &bytes[..bytes.len() - 2]).expect("truncate");
        let err = Shard::open(&path).expect_err("truncated").to_string();
        assert!(
            err.contains("x_train_000000.bin") && err.contains("says 4 tokens"),
            "{err}"
        );
        std::fs::write(&path, [0u8; 2048]).expect("zeros");
        let err = Shard::open(&path).expect_err("no magic").to_string();
        assert!(err.contains("magic 0"), "{err}");
    }
}
