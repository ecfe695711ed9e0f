//! GPT-2's tokenizer as a Hugging Face `tokenizer.json`, built from the
//! ranks tiktoken's `gpt2` (r50k_base) encoding holds, which the
//! `tiktoken-rs` crate embeds (MIT licence; OpenAI's vocabulary). Run
//! directories and exported models carry this file, which Python's
//! `tokenizers` and `transformers` load; kiln encodes with tiktoken's
//! algorithm, which gives the same ids about ten times faster.
//!
//! The merges are rebuilt from the ranks as Hugging Face's own converter
//! (`TikTokenConverter`) does: for each token in rank order, every split
//! into two tokens of the vocabulary, ordered by the ranks of the halves.

use std::collections::HashMap;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use crate::DataError;

/// Tokens in GPT-2's vocabulary, `<|endoftext|>` included.
pub(crate) const VOCAB_SIZE: usize = 50_257;
/// `<|endoftext|>`'s id.
pub(crate) const END_OF_TEXT_ID: u32 = 50_256;

/// The `tokenizer.json` text (built once a process).
pub(crate) fn json() -> Result<&'static str, DataError> {
    static JSON: OnceLock<Result<String, String>> = OnceLock::new();
    JSON.get_or_init(build)
        .as_deref()
        .map_err(|e| DataError::Tokenizer(e.clone()))
}

/// Whether `text` (a `tokenizer.json` file) is GPT-2's, as kiln writes it.
pub(crate) fn is_gpt2_json(text: &str) -> bool {
    static DIGEST: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    let canonical = DIGEST.get_or_init(|| {
        let t = json().ok()?.parse::<tokenizers::Tokenizer>().ok()?;
        Some(Sha256::digest(t.to_string(true).ok()?.as_bytes()).to_vec())
    });
    canonical
        .as_deref()
        .is_some_and(|d| d == Sha256::digest(text.as_bytes()).as_slice())
}

/// GPT-2's encoder as kiln runs it: tiktoken's pattern scanned by hand
/// ([`pieces`]), then tiktoken's own byte-pair merge
/// (`tiktoken_rs::byte_pair_split`) over OpenAI's ranks. The same ids as
/// tiktoken (tested against it on samples, fuzzed strings and a corpus),
/// over twice as fast: the regex engine took 60 % of tiktoken's time.
pub(crate) struct Encoder {
    /// Each token's bytes, by rank (`<|endoftext|>` not among them).
    tokens: Vec<Vec<u8>>,
    ranks: rustc_hash::FxHashMap<Vec<u8>, u32>,
    letters: Vec<(u32, u32)>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

/// The encoder, built once a process.
pub(crate) fn encoder() -> Result<&'static Encoder, DataError> {
    static ENCODER: OnceLock<Result<Encoder, String>> = OnceLock::new();
    ENCODER
        .get_or_init(Encoder::build)
        .as_ref()
        .map_err(|e| DataError::Tokenizer(e.clone()))
}

impl Encoder {
    fn build() -> Result<Self, String> {
        let bpe = tiktoken_rs::r50k_base_singleton();
        let tokens = (0..END_OF_TEXT_ID)
            .map(|rank| {
                bpe.decode_bytes(&[rank])
                    .map_err(|e| format!("GPT-2's rank {rank} is missing: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ranks = tokens.iter().cloned().zip(0..).collect();
        Ok(Self {
            tokens,
            ranks,
            letters: letter_ranges()?,
        })
    }

    /// The bytes of `ids` (`<|endoftext|>` as its text). Errors naming an
    /// id past the vocabulary.
    pub(crate) fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            match self.tokens.get(id as usize) {
                Some(bytes) => out.extend_from_slice(bytes),
                None if id == END_OF_TEXT_ID => {
                    out.extend_from_slice(crate::tokenizer::END_OF_TEXT.as_bytes())
                }
                None => {
                    return Err(DataError::Tokenizer(format!(
                        "decoding: id {id} is not in GPT-2's vocabulary"
                    )));
                }
            }
        }
        Ok(out)
    }

    /// Appends the ids of `text` (tiktoken's `encode_ordinary`).
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut at = 0;
        while at < text.len() {
            let end = self.piece_end(text, at);
            let piece = &text.as_bytes()[at..end];
            match self.ranks.get(piece) {
                Some(&rank) => out.push(rank),
                None => {
                    for part in tiktoken_rs::byte_pair_split(piece, &self.ranks) {
                        // Every part byte_pair_split returns is a token.
                        out.push(self.ranks.get(part).copied().unwrap_or(u32::MAX));
                    }
                }
            }
            at = end;
        }
    }

    fn class(&self, c: char) -> Class {
        if c.is_ascii() {
            return match c {
                'a'..='z' | 'A'..='Z' => Class::Letter,
                '0'..='9' => Class::Number,
                ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r' => Class::Space,
                _ => Class::Other,
            };
        }
        if c.is_whitespace() {
            Class::Space
        } else if c.is_numeric() {
            Class::Number
        } else if self.is_letter(c) {
            Class::Letter
        } else {
            Class::Other
        }
    }

    fn is_letter(&self, c: char) -> bool {
        let c = u32::from(c);
        let i = self.letters.partition_point(|&(start, _)| start <= c);
        i > 0 && c <= self.letters[i - 1].1
    }

    /// Where the piece that starts at `at` ends: tiktoken's GPT-2 pattern
    /// `'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s`,
    /// its alternatives tried in order. Every character starts a match of
    /// one of them, so the pieces cover the text.
    fn piece_end(&self, text: &str, at: usize) -> usize {
        let rest = &text[at..];
        let bytes = rest.as_bytes();
        let mut chars = rest.chars();
        let Some(c0) = chars.next() else {
            return at;
        };
        if c0 == '\'' {
            if bytes.len() >= 2 && matches!(bytes[1], b's' | b'd' | b'm' | b't') {
                return at + 2;
            }
            if bytes.len() >= 3 && matches!(&bytes[1..3], b"ll" | b"ve" | b"re") {
                return at + 3;
            }
        }
        let c1 = chars.next();
        let (offset, class) = match c1 {
            Some(c1) if c0 == ' ' && self.class(c1) != Class::Space => (1, self.class(c1)),
            _ => (0, self.class(c0)),
        };
        if class != Class::Space {
            // A possessive run of the class (after one optional space).
            let run: usize = rest[offset..]
                .chars()
                .take_while(|&c| self.class(c) == class)
                .map(char::len_utf8)
                .sum();
            return at + offset + run;
        }
        let run: usize = rest
            .chars()
            .take_while(|&c| self.class(c) == Class::Space)
            .map(char::len_utf8)
            .sum();
        if run == rest.len() {
            // `\s++$`: whitespace to the end.
            return at + run;
        }
        let last = rest[..run].chars().next_back().map_or(0, char::len_utf8);
        if run > last {
            // `\s+(?!\S)`: all but the last, which the next piece starts with.
            at + run - last
        } else {
            // `\s`: one.
            at + run
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// `\p{L}` as the regex crates' tables have it (sorted, inclusive ranges).
fn letter_ranges() -> Result<Vec<(u32, u32)>, String> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(r"\p{L}")
        .map_err(|e| format!("the letter class: {e}"))?;
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(class)) => Ok(class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect()),
        other => Err(format!("the letter class parsed as {other:?}")),
    }
}

/// GPT-2's byte-to-character map (`bytes_to_unicode` in its `encoder.py`):
/// printable Latin-1 bytes stand for themselves, the others are shifted
/// past 255, so that every token is a string without spaces.
fn byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[usize::from(b)] = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\u{fffd}')
        };
    }
    map
}

fn build() -> Result<String, String> {
    let tokens = &encoder().map_err(|e| e.to_string())?.tokens;
    let chars = byte_chars();
    let as_text =
        |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[usize::from(b)]).collect() };
    let ranks: HashMap<&[u8], usize> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let mut vocab = serde_json::Map::with_capacity(VOCAB_SIZE);
    let mut merges = Vec::new();
    for (rank, token) in tokens.iter().enumerate() {
        vocab.insert(as_text(token), serde_json::Value::from(rank));
        let mut splits: Vec<(usize, usize, usize)> = (1..token.len())
            .filter_map(|i| {
                let (l, r) = token.split_at(i);
                Some((ranks.get(l).copied()?, ranks.get(r).copied()?, i))
            })
            .collect();
        splits.sort_unstable();
        for (_, _, i) in splits {
            let (l, r) = token.split_at(i);
            merges.push(serde_json::Value::from(format!(
                "{} {}",
                as_text(l),
                as_text(r)
            )));
        }
    }
    vocab.insert(
        crate::tokenizer::END_OF_TEXT.into(),
        serde_json::Value::from(END_OF_TEXT_ID),
    );
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{ "id": END_OF_TEXT_ID, "content": crate::tokenizer::END_OF_TEXT,
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": true, "special": true }],
        "normalizer": null,
        "pre_tokenizer": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        "post_processor": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true },
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges }
    });
    Ok(json.to_string())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::Tokenizer;

    /// Samples and the ids tiktoken 0.14's `gpt2` encoding gives them
    /// (`tiktoken.get_encoding("gpt2").encode_ordinary(text)`, with OpenAI's
    /// `encoder.json`/`vocab.bpe`): `test_data/gpt2_ids.json`, made by
    /// `bench/gpt2_reference.py`.
    fn samples() -> Vec<(String, Vec<u32>)> {
        let text = include_str!("../test_data/gpt2_ids.json");
        let file: serde_json::Value = serde_json::from_str(text).expect("json");
        file["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .map(|c| {
                let ids = c["ids"]
                    .as_array()
                    .expect("ids")
                    .iter()
                    .map(|v| v.as_u64().expect("id") as u32)
                    .collect();
                (c["text"].as_str().expect("text").to_string(), ids)
            })
            .collect()
    }

    #[test]
    fn gpt2_ids_equal_tiktoken_s_by_both_encoders() {
        let t = Tokenizer::gpt2().expect("builds");
        assert_eq!(t.vocab_size(), VOCAB_SIZE);
        assert_eq!(t.end_of_text(), Some(END_OF_TEXT_ID));
        let hf = Tokenizer {
            gpt2: None,
            ..t.clone()
        };
        let cases = samples();
        assert!(cases.len() >= 8);
        for (text, expected) in &cases {
            assert_eq!(
                &t.encode(text).expect("encodes"),
                expected,
                "tiktoken's algorithm on {text:?}"
            );
            assert_eq!(
                &t.encode_piece(text).expect("encodes"),
                expected,
                "one piece: {text:?}"
            );
            // Hugging Face's tokenizers (GPT-2's own tokenizer.json too) take
            // `<|endoftext|>` in text as the special token; tiktoken's
            // encode_ordinary, which kiln follows, as text.
            if !text.contains(crate::tokenizer::END_OF_TEXT) {
                let e = hf.inner.encode(text.as_str(), false).expect("hf encodes");
                assert_eq!(
                    e.get_ids(),
                    expected.as_slice(),
                    "the tokenizer.json on {text:?}"
                );
            }
            assert_eq!(&t.decode(expected).expect("decodes"), text);
        }
    }

    #[test]
    fn the_hand_scanned_pattern_gives_tiktoken_s_ids_on_fuzzed_text() {
        use rand::{RngExt, SeedableRng};
        let tiktoken = tiktoken_rs::r50k_base_singleton();
        let ours = encoder().expect("encoder");
        // Letters, numbers, spaces and others of several scripts, marks,
        // apostrophes and contractions, the whitespace the pattern treats apart.
        let alphabet: Vec<&str> = vec![
            "a", "Z", "é", "ß", "日", "본", "ж", "ا", "\u{301}", "0", "7", "٣", "½", "Ⅻ", " ",
            "  ", "\t", "\n", "\r\n", "\u{a0}", "\u{3000}", "\u{2028}", "\u{85}", "'", "'s", "'ll",
            "'ve", "'re", "'d", "'m", "'t", "'S", ".", ",", "(", "!", "🎉", "\u{200d}", "_", "-",
            "$", "word", " word", "123", "\u{0}", "\u{7f}",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(47);
        for case in 0..3000 {
            let n = rng.random_range(0..24);
            let text: String = (0..n)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let mut ids = Vec::new();
            ours.encode(&text, &mut ids);
            assert_eq!(
                ids,
                tiktoken.encode_ordinary(&text),
                "case {case}: {text:?}"
            );
        }
        // And the shipped corpus, whole.
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/data/tinyshakespeare.txt");
        let shakespeare = std::fs::read_to_string(&path).expect("the shipped corpus");
        let mut ids = Vec::new();
        ours.encode(&shakespeare, &mut ids);
        assert_eq!(ids, tiktoken.encode_ordinary(&shakespeare));
    }

    #[test]
    fn a_saved_gpt2_tokenizer_loads_as_gpt2_and_pieces_encode_as_the_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer.json");
        let t = Tokenizer::gpt2().expect("builds");
        t.save(&path).expect("saves");
        assert!(Tokenizer::load(&path).expect("loads").is_gpt2());
        let text: String = samples()
            .into_iter()
            .map(|(t, _)| t)
            .collect::<Vec<_>>()
            .join("\n")
            .repeat(40);
        let whole = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
        let mut pieces = Vec::new();
        let mut start = 0;
        while let Some(cut) = t.split_point(&text, start + 100) {
            pieces.extend(t.encode_piece(&text[start..cut]).expect("piece"));
            start = cut;
        }
        pieces.extend(t.encode_piece(&text[start..]).expect("last"));
        assert_eq!(pieces, whole);
        assert_eq!(t.encode(&text).expect("parallel"), whole);
    }
}
