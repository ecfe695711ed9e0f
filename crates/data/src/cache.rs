//! The token cache: a corpus is encoded once per (corpus, tokenizer), and
//! later runs read the ids back.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Corpus, DataError, Tokenizer};

const MAGIC: &[u8; 8] = b"KILNTOK1";

/// Whether the ids came from the cache, and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheOutcome {
    /// Whether the ids were read from the cache (else encoded and written).
    pub hit: bool,
    /// The cache file.
    pub path: PathBuf,
}

/// The ids of `corpus` under `tokenizer`, read from `cache_dir` if encoded
/// before, else encoded (in parallel) and written there atomically. A cache
/// file that is damaged is encoded again.
pub fn encode_cached(
    tokenizer: &Tokenizer,
    corpus: &Corpus,
    cache_dir: &Path,
) -> Result<(Vec<u32>, CacheOutcome), DataError> {
    let mut hasher = Sha256::new();
    hasher.update(corpus.text.as_bytes());
    hasher.update([0u8]);
    hasher.update(tokenizer.to_json()?.as_bytes());
    let key: String = hasher
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let path = cache_dir.join(format!("tokens-{key}.bin"));
    if let Some(ids) = read_cache(&path) {
        return Ok((ids, CacheOutcome { hit: true, path }));
    }
    let ids = tokenizer.encode(&corpus.text)?;
    write_cache(&path, &ids)?;
    Ok((ids, CacheOutcome { hit: false, path }))
}

fn read_cache(path: &Path) -> Option<Vec<u32>> {
    let bytes = std::fs::read(path).ok()?;
    let rest = bytes.strip_prefix(MAGIC)?;
    let (count, data) = rest.split_at_checked(8)?;
    let count = usize::try_from(u64::from_le_bytes(count.try_into().ok()?)).ok()?;
    if data.len() != count.checked_mul(4)? {
        return None;
    }
    Some(
        data.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

fn write_cache(path: &Path, ids: &[u32]) -> Result<(), DataError> {
    let write_err = |source| DataError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        if let Some(file) = crate::file_in_the_way(dir) {
            return Err(DataError::InvalidArgument {
                what: "data.cache_dir",
                why: format!("`{}` is a file, not a folder", file.display()),
            });
        }
        std::fs::create_dir_all(dir).map_err(write_err)?;
    }
    let mut bytes = Vec::with_capacity(16 + ids.len() * 4);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    for id in ids {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes).map_err(write_err)?;
    std::fs::rename(&tmp, path).map_err(write_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_encoding_hits_the_cache_and_damage_is_repaired() {
        let dir = tempfile::tempdir().expect("tempdir");
        let corpus = Corpus {
            path: PathBuf::from("c.txt"),
            text: "to be or not to be\nthat is the question\n".repeat(10),
        };
        let t = Tokenizer::char_level(&corpus.text).expect("tokenizer");
        let (a, first) = encode_cached(&t, &corpus, dir.path()).expect("encodes");
        assert!(!first.hit);
        let (b, second) = encode_cached(&t, &corpus, dir.path()).expect("reads");
        assert!(second.hit);
        assert_eq!(a, b);
        std::fs::write(&second.path, b"KILNTOK1garbage").expect("damage");
        let (c, third) = encode_cached(&t, &corpus, dir.path()).expect("re-encodes");
        assert!(!third.hit);
        assert_eq!(a, c);
        // Another tokenizer, another key.
        let other = Tokenizer::char_level("abc to be").expect("tokenizer");
        let other_corpus = Corpus {
            text: "to be".into(),
            ..corpus
        };
        let (_, fourth) = encode_cached(&other, &other_corpus, dir.path()).expect("encodes");
        assert_ne!(fourth.path, first.path);
        // A cache folder under a file is the config's (exit 2), named.
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "x").expect("write");
        let err = encode_cached(&other, &other_corpus, &file.join("cache")).expect_err("a file");
        assert!(
            matches!(
                err,
                DataError::InvalidArgument {
                    what: "data.cache_dir",
                    ..
                }
            ) && err.to_string().contains("is a file, not a folder"),
            "{err}"
        );
    }
}
