//! Tokenizers: character-level and byte-level BPE, both Hugging Face
//! `tokenizers` models, so that `tokenizer.json` loads in Python as well.

use std::collections::BTreeSet;
use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::DataError;

/// Which kind of tokenizer to build from a corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// One token per character; the vocabulary is the corpus' characters.
    Char,
    /// Byte-level BPE (GPT-2 style) trained to `vocab_size` tokens.
    Bpe { vocab_size: usize },
}

/// A tokenizer and its vocabulary size.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Builds a tokenizer from training text.
    pub fn train(kind: TokenizerKind, text: &str) -> Result<Self, DataError> {
        match kind {
            TokenizerKind::Char => Self::char_level(text),
            TokenizerKind::Bpe { vocab_size } => Self::bpe(text, vocab_size),
        }
    }

    /// A character-level tokenizer over the characters of `text`, ids in
    /// code-point order (as nanoGPT's `sorted(set(text))`).
    pub fn char_level(text: &str) -> Result<Self, DataError> {
        let chars: BTreeSet<char> = text.chars().collect();
        let vocab: serde_json::Map<String, serde_json::Value> = chars
            .iter()
            .zip(0u32..)
            .map(|(c, i)| (c.to_string(), serde_json::Value::from(i)))
            .collect();
        // WordLevel over single characters: the pre-tokenizer isolates every
        // character (newlines too), and the Fuse decoder joins them back.
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {
                "type": "Split",
                "pattern": { "Regex": "[\\s\\S]" },
                "behavior": "Isolated",
                "invert": false
            },
            "post_processor": null,
            "decoder": { "type": "Fuse" },
            "model": { "type": "WordLevel", "vocab": vocab, "unk_token": "\u{fffd}" }
        });
        let inner = json
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| DataError::Tokenizer(format!("building the character tokenizer: {e}")))?;
        Ok(Self { inner })
    }

    /// Byte-level BPE trained on `text` (line by line).
    pub fn bpe(text: &str, vocab_size: usize) -> Result<Self, DataError> {
        let trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut trainer = TrainerWrapper::from(trainer);
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        inner
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
            .with_decoder(Some(ByteLevel::default()));
        inner
            .train(&mut trainer, text.split_inclusive('\n'))
            .map_err(|e| DataError::Tokenizer(format!("training BPE: {e}")))?;
        Ok(Self { inner })
    }

    /// Loads a `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let inner = text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| DataError::BadTokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        if inner.get_vocab_size(true) == 0 {
            return Err(DataError::BadTokenizer {
                path: path.to_path_buf(),
                message: "the vocabulary is empty".into(),
            });
        }
        Ok(Self { inner })
    }

    /// The tokenizer as `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String, DataError> {
        self.inner
            .to_string(true)
            .map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), DataError> {
        std::fs::write(path, self.to_json()?).map_err(|source| DataError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text. Text is split into lines, each encoded on its own (in
    /// parallel), and the ids concatenated: the same result however the text
    /// is later chunked.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let encodings = self
            .inner
            .encode_batch_fast(lines, false)
            .map_err(|e| DataError::Tokenizer(format!("encoding: {e}")))?;
        let total = encodings.iter().map(|e| e.get_ids().len()).sum();
        let mut ids = Vec::with_capacity(total);
        for e in &encodings {
            ids.extend_from_slice(e.get_ids());
        }
        Ok(ids)
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::Tokenizer(format!("decoding: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str =
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n";

    #[test]
    fn char_level_round_trips_and_sorts_its_vocabulary() {
        let t = Tokenizer::char_level(TEXT).expect("builds");
        let distinct: BTreeSet<char> = TEXT.chars().collect();
        assert_eq!(t.vocab_size(), distinct.len());
        let ids = t.encode(TEXT).expect("encodes");
        assert_eq!(ids.len(), TEXT.chars().count());
        assert_eq!(
            ids[..2],
            [t.encode("F").expect("F")[0], t.encode("i").expect("i")[0]]
        );
        // "\n" is the smallest code point present, so id 0.
        assert_eq!(t.encode("\n").expect("newline"), vec![0]);
        assert_eq!(t.decode(&ids).expect("decodes"), TEXT);
    }

    #[test]
    fn bpe_round_trips_and_compresses() {
        let text = TEXT.repeat(20);
        let t = Tokenizer::bpe(&text, 300).expect("trains");
        let ids = t.encode(&text).expect("encodes");
        assert!(
            ids.len() < text.len() / 2,
            "{} ids for {} bytes",
            ids.len(),
            text.len()
        );
        assert_eq!(t.decode(&ids).expect("decodes"), text);
    }

    #[test]
    fn saved_tokenizers_load_and_broken_ones_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer.json");
        let t = Tokenizer::char_level(TEXT).expect("builds");
        t.save(&path).expect("saves");
        let back = Tokenizer::load(&path).expect("loads");
        assert_eq!(back.encode(TEXT).expect("a"), t.encode(TEXT).expect("b"));
        std::fs::write(&path, "{\"version\": \"1.0\", \"model\": ").expect("write");
        let err = Tokenizer::load(&path).expect_err("broken").to_string();
        assert!(
            err.contains("invalid tokenizer") && err.contains("tokenizer.json"),
            "{err}"
        );
    }
}
