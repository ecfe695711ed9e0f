//! Reading a text corpus: UTF-8 checked with the offending byte and line named.

use std::path::{Path, PathBuf};

use crate::DataError;

/// A corpus read into memory.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// The file it was read from.
    pub path: PathBuf,
    /// The text (cut to `max_chars` characters when asked).
    pub text: String,
}

/// Reads a UTF-8 text file (decompressed where its name ends in `.gz` or
/// `.zst`), keeping at most `max_chars` characters (`None`: all of it).
pub fn read_corpus(path: &Path, max_chars: Option<usize>) -> Result<Corpus, DataError> {
    let bytes = read_maybe_compressed(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    let mut text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let offset = e.utf8_error().valid_up_to();
            let bytes = e.as_bytes();
            let line = bytes[..offset].iter().filter(|b| **b == b'\n').count() + 1;
            return Err(DataError::NotUtf8 {
                path: path.to_path_buf(),
                offset,
                line,
                byte: bytes[offset],
            });
        }
    };
    if let Some(max_chars) = max_chars
        && let Some((cut, _)) = text.char_indices().nth(max_chars)
    {
        text.truncate(cut);
    }
    if text.trim().is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(Corpus {
        path: path.to_path_buf(),
        text,
    })
}

/// The bytes of `path`, through gzip or zstd by its name.
fn read_maybe_compressed(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut bytes = Vec::new();
    if name.ends_with(".gz") {
        flate2::read::MultiGzDecoder::new(std::fs::File::open(path)?).read_to_end(&mut bytes)?;
    } else if name.ends_with(".zst") {
        zstd::stream::read::Decoder::new(std::fs::File::open(path)?)?.read_to_end(&mut bytes)?;
    } else {
        bytes = std::fs::read(path)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("c.txt");
        std::fs::write(&path, bytes).expect("write");
        (dir, path)
    }

    #[test]
    fn bad_corpora_are_named_errors() {
        let (_d, empty) = file(b"");
        assert!(matches!(
            read_corpus(&empty, None),
            Err(DataError::Empty { .. })
        ));
        let (_d, blank) = file(b"  \n\n");
        assert!(matches!(
            read_corpus(&blank, None),
            Err(DataError::Empty { .. })
        ));
        let (_d, latin1) = file(b"ok\nline two\ncaf\xe9\n");
        let err = read_corpus(&latin1, None)
            .expect_err("not utf-8")
            .to_string();
        assert!(err.contains("byte 0xe9 at byte 15 (line 3)"), "{err}");
        let err = read_corpus(Path::new("/no/such/file.txt"), None).expect_err("missing");
        assert!(err.to_string().contains("/no/such/file.txt"));
    }

    #[test]
    fn max_chars_cuts_on_a_character_boundary() {
        let (_d, path) = file("héllo wörld".as_bytes());
        assert_eq!(read_corpus(&path, Some(4)).expect("reads").text, "héll");
        assert_eq!(read_corpus(&path, None).expect("reads").text, "héllo wörld");
    }

    /// `.gz` and `.zst` are read through their decompressors (`kiln eval
    /// --data test.txt.gz` failed on byte 0x8b, gzip's magic); a damaged
    /// one is an error naming the file.
    #[test]
    fn compressed_text_reads_as_its_text() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let text = "to be, or not to be\n";
        let gz = dir.path().join("t.txt.gz");
        let mut w = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        w.write_all(text.as_bytes()).expect("gzip");
        std::fs::write(&gz, w.finish().expect("gzip")).expect("write");
        assert_eq!(read_corpus(&gz, None).expect("reads").text, text);
        let zst = dir.path().join("t.txt.zst");
        std::fs::write(&zst, zstd::encode_all(text.as_bytes(), 3).expect("zstd")).expect("write");
        assert_eq!(read_corpus(&zst, None).expect("reads").text, text);
        std::fs::write(&gz, text).expect("write");
        let err = read_corpus(&gz, None).expect_err("not gzip").to_string();
        assert!(err.contains("t.txt.gz"), "{err}");
    }
}
