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
    let bpe = tiktoken_rs::r50k_base_singleton();
    let chars = byte_chars();
    let as_text =
        |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[usize::from(b)]).collect() };
    let mut tokens: Vec<Vec<u8>> = Vec::with_capacity(VOCAB_SIZE);
    for rank in 0..END_OF_TEXT_ID {
        let bytes = bpe
            .decode_bytes(&[rank])
            .map_err(|e| format!("GPT-2's rank {rank} is missing: {e}"))?;
        tokens.push(bytes);
    }
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
