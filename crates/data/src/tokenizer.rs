//! Tokenizers: character-level and byte-level BPE, both Hugging Face
//! `tokenizers` models, so that `tokenizer.json` loads in Python as well.

use std::collections::BTreeSet;
use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{TruncationParams, TruncationStrategy};

use crate::DataError;

/// Which kind of tokenizer to build from a corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// One token per character; the vocabulary is the corpus' characters.
    Char,
    /// Byte-level BPE (GPT-2 style) trained to `vocab_size` tokens.
    Bpe {
        /// The vocabulary size to train to.
        vocab_size: usize,
    },
}

/// Token ids and segment ids of one encoded pair.
pub type PairIds = (Vec<u32>, Vec<u32>);

/// BERT's special tokens, `[PAD]` first so that its id is 0.
pub const SPECIALS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// GPT-2's end-of-text token (also what a token store puts before each
/// document with a trained tokenizer, which gets it as its last id).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// A tokenizer and its vocabulary size.
#[derive(Clone)]
pub struct Tokenizer {
    pub(crate) inner: tokenizers::Tokenizer,
    /// GPT-2's byte-level BPE as tiktoken encodes it (the same ids as
    /// `inner`, about ten times faster): set for the built-in GPT-2
    /// tokenizer, and for a `tokenizer.json` that is it.
    pub(crate) gpt2: Option<&'static crate::gpt2::Encoder>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("gpt2", &self.gpt2.is_some())
            .finish()
    }
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
        Ok(Self { inner, gpt2: None })
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
        Ok(Self { inner, gpt2: None })
    }

    /// A BERT-style WordPiece tokenizer built from `texts` (lower-cased,
    /// special tokens `[PAD]` = 0, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`),
    /// whose pairs encode as `[CLS] a [SEP] b [SEP]` with segment ids and
    /// are cut longest-first to `max_length`.
    ///
    /// The vocabulary is deterministic: the specials, every character seen
    /// (alone and as a `##` continuation, sorted), then whole words by
    /// frequency (ties alphabetical) up to `vocab_size`. Hugging Face's
    /// trainer breaks ties through randomly seeded hash maps, so two runs on
    /// the same text could disagree; this one cannot. Words outside the
    /// vocabulary fall back to characters.
    pub fn wordpiece<'a>(
        texts: impl Iterator<Item = &'a str>,
        vocab_size: usize,
        max_length: usize,
    ) -> Result<Self, DataError> {
        use std::collections::{BTreeMap, BTreeSet};
        use tokenizers::{
            Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
        };
        let normalizer = BertNormalizer::default();
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for text in texts {
            let mut pts = PreTokenizedString::from(text);
            pts.normalize(|s| normalizer.normalize(s))
                .and_then(|()| BertPreTokenizer.pre_tokenize(&mut pts))
                .map_err(|e| DataError::Tokenizer(format!("pre-tokenizing: {e}")))?;
            for (word, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
                *counts.entry(word.to_string()).or_default() += 1;
            }
        }
        let chars: BTreeSet<char> = counts.keys().flat_map(|w| w.chars()).collect();
        let mut vocab: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        vocab.extend(chars.iter().map(|c| c.to_string()));
        vocab.extend(chars.iter().map(|c| format!("##{c}")));
        let mut words: Vec<(&String, &u64)> = counts
            .iter()
            .filter(|(w, _)| w.chars().count() > 1)
            .collect();
        words.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let room = vocab_size.saturating_sub(vocab.len());
        vocab.extend(words.into_iter().take(room).map(|(w, _)| w.clone()));
        let ids: serde_json::Map<String, serde_json::Value> = vocab
            .iter()
            .zip(0u32..)
            .map(|(t, i)| (t.clone(), serde_json::Value::from(i)))
            .collect();
        let added: Vec<serde_json::Value> = SPECIALS
            .iter()
            .zip(0u32..)
            .map(|(t, id)| {
                serde_json::json!({ "id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true })
            })
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": { "type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                "strip_accents": null, "lowercase": true },
            "pre_tokenizer": { "type": "BertPreTokenizer" },
            "post_processor": null,
            "decoder": { "type": "WordPiece", "prefix": "##", "cleanup": true },
            "model": { "type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                "max_input_chars_per_word": 100, "vocab": ids }
        });
        let inner = json
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| DataError::Tokenizer(format!("building WordPiece: {e}")))?;
        let mut t = Self { inner, gpt2: None };
        t.set_pair_template(max_length)?;
        Ok(t)
    }

    /// `[CLS] a [SEP] b [SEP]` for pairs (BERT's; RoBERTa's `<s> a </s></s>
    /// b </s>` for a vocabulary with `<s>` and `</s>` but no `[CLS]`), the
    /// second sentence's tokens in segment 1, longest-first truncation to
    /// `max_length`.
    pub fn set_pair_template(&mut self, max_length: usize) -> Result<(), DataError> {
        let id = |t: &str| self.inner.token_to_id(t);
        let (single, pair, specials) = match (id("[CLS]"), id("[SEP]"), id("<s>"), id("</s>")) {
            (Some(cls), Some(sep), _, _) => (
                "[CLS] $A [SEP]",
                "[CLS] $A [SEP] $B:1 [SEP]:1",
                vec![("[CLS]", cls), ("[SEP]", sep)],
            ),
            (None, _, Some(bos), Some(eos)) => (
                "<s> $A </s>",
                "<s> $A </s> </s>:1 $B:1 </s>:1",
                vec![("<s>", bos), ("</s>", eos)],
            ),
            _ => {
                return Err(DataError::Tokenizer(
                    "the vocabulary has neither BERT's [CLS] and [SEP] nor RoBERTa's <s> and </s> to mark a pair's sentences".into(),
                ));
            }
        };
        let template = TemplateProcessing::builder()
            .try_single(single)
            .and_then(|b| b.try_pair(pair))
            .map_err(|e| DataError::Tokenizer(e.to_string()))?
            .special_tokens(specials)
            .build()
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        self.inner.with_post_processor(Some(template));
        self.inner
            .with_truncation(Some(TruncationParams {
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                ..TruncationParams::default()
            }))
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        Ok(())
    }

    /// Encodes sentence pairs (in parallel): token ids and segment ids of each.
    pub fn encode_pairs(&self, pairs: &[(&str, &str)]) -> Result<Vec<PairIds>, DataError> {
        let inputs: Vec<tokenizers::EncodeInput<'_>> =
            pairs.iter().map(|&(a, b)| (a, b).into()).collect();
        let encodings = self
            .inner
            .encode_batch(inputs, true)
            .map_err(|e| DataError::Tokenizer(format!("encoding pairs: {e}")))?;
        Ok(encodings
            .into_iter()
            .map(|e| (e.get_ids().to_vec(), e.get_type_ids().to_vec()))
            .collect())
    }

    /// The id of a token, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
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
        let gpt2 = if inner.get_vocab_size(true) == crate::gpt2::VOCAB_SIZE
            && crate::gpt2::is_gpt2_json(&text)
        {
            Some(crate::gpt2::encoder()?)
        } else {
            None
        };
        Ok(Self { inner, gpt2 })
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

    /// Every token and its id, special tokens included.
    pub fn vocab(&self) -> std::collections::HashMap<String, u32> {
        self.inner.get_vocab(true)
    }

    /// Tokens in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// GPT-2's tokenizer (byte-level BPE, 50,257 ids, `<|endoftext|>` =
    /// 50256): OpenAI's ranks as tiktoken's `gpt2` encoding has them (the
    /// `tiktoken-rs` crate embeds them, MIT), encoded by tiktoken's
    /// algorithm, and as a Hugging Face `tokenizer.json` with the same ids.
    pub fn gpt2() -> Result<Self, DataError> {
        let inner = crate::gpt2::json()?
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| DataError::Tokenizer(format!("building GPT-2's tokenizer: {e}")))?;
        Ok(Self {
            inner,
            gpt2: Some(crate::gpt2::encoder()?),
        })
    }

    /// Whether this is GPT-2's tokenizer.
    pub fn is_gpt2(&self) -> bool {
        self.gpt2.is_some()
    }

    /// The end-of-text token's id, if the vocabulary has one.
    pub fn end_of_text(&self) -> Option<u32> {
        self.inner.token_to_id(END_OF_TEXT)
    }

    /// This tokenizer with `<|endoftext|>` added as a special token (the
    /// next id) if it lacks one: a token store puts it before each document.
    pub fn with_end_of_text(mut self) -> Self {
        if self.end_of_text().is_none() {
            self.inner
                .add_special_tokens(&[tokenizers::AddedToken::from(END_OF_TEXT, true)]);
        }
        self
    }

    /// Encodes one piece of a document on the calling thread (callers run
    /// many pieces in parallel). Where [`Tokenizer::split_point`] cut a
    /// document, its pieces' ids are the whole document's.
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self.gpt2 {
            Some(encoder) => {
                let mut ids = Vec::with_capacity(text.len() / 3);
                encoder.encode(text, &mut ids);
                Ok(ids)
            }
            None => {
                let mut ids = Vec::new();
                for line in text.split_inclusive('\n') {
                    let e = self
                        .inner
                        .encode_fast(line, false)
                        .map_err(|e| DataError::Tokenizer(format!("encoding: {e}")))?;
                    ids.extend_from_slice(e.get_ids());
                }
                Ok(ids)
            }
        }
    }

    /// The first byte offset at or after `at` where `text` can be cut into
    /// pieces that encode to the same ids as the whole: after a newline for
    /// the Hugging Face tokenizers (kiln encodes line by line), and for GPT-2
    /// before a space between two ASCII letters (no piece of GPT-2's
    /// pre-tokenizer spans it, and `" word"` starts one). `None` if there is
    /// none.
    pub fn split_point(&self, text: &str, at: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        let from = at.max(1);
        if from >= bytes.len() {
            return None;
        }
        if self.gpt2.is_some() {
            (from..bytes.len().saturating_sub(1)).find(|&i| {
                bytes[i] == b' '
                    && bytes[i - 1].is_ascii_alphabetic()
                    && bytes[i + 1].is_ascii_alphabetic()
            })
        } else {
            (from..bytes.len()).find(|&i| bytes[i - 1] == b'\n')
        }
    }

    /// Encodes text. Text is split into lines, each encoded on its own (in
    /// parallel), and the ids concatenated: the same result however the text
    /// is later chunked. GPT-2's tokenizer encodes the text as tiktoken
    /// does (as a whole), in parallel pieces cut where that changes nothing.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        if self.gpt2.is_some() {
            use rayon::prelude::*;
            let mut pieces = Vec::new();
            let mut start = 0;
            while let Some(cut) = self.split_point(text, start + (1 << 16)) {
                pieces.push(&text[start..cut]);
                start = cut;
            }
            pieces.push(&text[start..]);
            let ids: Vec<Result<Vec<u32>, DataError>> =
                pieces.par_iter().map(|p| self.encode_piece(p)).collect();
            let mut all = Vec::new();
            for part in ids {
                all.extend(part?);
            }
            return Ok(all);
        }
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
        if let Some(encoder) = self.gpt2 {
            let bytes = encoder.decode_bytes(ids)?;
            return Ok(String::from_utf8_lossy(&bytes).into_owned());
        }
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
    fn wordpiece_encodes_pairs_with_segments_and_truncates_longest_first() {
        let texts = [
            "A man is playing a guitar.",
            "A person plays music.",
            "Two dogs run in a field.",
            "The dogs are sleeping.",
        ];
        let t = Tokenizer::wordpiece(texts.iter().copied(), 200, 12).expect("trains");
        assert_eq!(t.token_id("[PAD]"), Some(0));
        let again = Tokenizer::wordpiece(texts.iter().copied(), 200, 12).expect("trains");
        assert_eq!(
            t.to_json().expect("json"),
            again.to_json().expect("json"),
            "deterministic"
        );
        // A word never seen (spelled with seen letters) falls back to characters, not [UNK].
        let unseen = t.encode_pairs(&[("spade", "a")]).expect("encodes");
        assert!(!unseen[0].0.contains(&t.token_id("[UNK]").expect("unk")));
        let cls = t.token_id("[CLS]").expect("cls");
        let sep = t.token_id("[SEP]").expect("sep");
        let enc = t.encode_pairs(&[("A man.", "A person.")]).expect("encodes");
        let (ids, types) = &enc[0];
        assert_eq!(ids[0], cls);
        assert_eq!(ids.iter().filter(|&&i| i == sep).count(), 2);
        let first_sep = ids.iter().position(|&i| i == sep).expect("sep");
        assert!(types[..=first_sep].iter().all(|&s| s == 0));
        assert!(types[first_sep + 1..].iter().all(|&s| s == 1));
        let long = t
            .encode_pairs(&[(
                "a man is playing a guitar a man is playing a guitar",
                "dogs",
            )])
            .expect("encodes");
        assert_eq!(long[0].0.len(), 12);
        assert!(
            long[0].0.contains(&t.encode("dogs").expect("dogs")[0]),
            "the short side is kept"
        );
    }

    /// A word-level tokenizer of `tokens` (ids in order), whitespace split.
    fn word_level(tokens: &[&str]) -> Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), serde_json::Value::from(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": { "type": "Whitespace" },
            "post_processor": null, "decoder": null,
            "model": { "type": "WordLevel", "vocab": vocab, "unk_token": tokens[0] }
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).expect("write");
        Tokenizer::load(&path).expect("loads")
    }

    #[test]
    fn robertas_specials_mark_a_pair_where_berts_are_missing() {
        let mut t = word_level(&["<s>", "<pad>", "</s>", "a", "man", "person"]);
        t.set_pair_template(16).expect("RoBERTa's template");
        let enc = t.encode_pairs(&[("a man", "person")]).expect("encodes");
        // <s> a man </s> </s> person </s>, the second sentence in segment 1.
        assert_eq!(enc[0].0, [0, 3, 4, 2, 2, 5, 2]);
        assert_eq!(enc[0].1, [0, 0, 0, 0, 1, 1, 1]);
        let mut none = word_level(&["<unk>", "a", "man"]);
        let err = none
            .set_pair_template(16)
            .expect_err("no specials")
            .to_string();
        assert!(
            err.contains("neither BERT's [CLS] and [SEP] nor RoBERTa's <s> and </s>"),
            "{err}"
        );
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
