//! `kiln eval`: a language model's loss, perplexity and bits per byte on a
//! text file or on a split of a token store, every token scored once —
//! what one reports for a test set after training (nanoGPT's `val loss`,
//! Hugging Face's "Perplexity of fixed-length models"). The tokens are cut
//! into windows of the model's block: with the stride equal to the block,
//! each window is new text (the first tokens of each have little context,
//! as in training); with a shorter stride each window moves on by `stride`
//! tokens and scores only those, the rest of it their context, as Hugging
//! Face's sliding window.
//!
//! A token store's split (kiln's, llm.c's shards, nanoGPT's `.bin`) is
//! read from its shards a batch of windows at a time, so that a held-out
//! split of billions of tokens is scored in the memory of one batch; its
//! tokens must be ids of the model's tokenizer (the same vocabulary), and
//! its bytes for bits per byte are those of its documents' text, decoded
//! a document at a time.

use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_data::store::{StoreKind, TokenWidth};
use kiln_data::{DataError, MemoryTokens, Split, TokenSpan, TokenStore, Tokenizer};
use kiln_model::Gpt;
use serde::Serialize;

use crate::error::TrainError;
use crate::generate::{Loaded, load_lm, unencodable};
use crate::tokens::{gpt2_files, kiln_store_tokenizer};

/// How to score.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct EvalRequest {
    /// A run's best model (`best.safetensors`) instead of its newest
    /// checkpoint.
    pub best: bool,
    /// Tokens each window moves on (and scores); `None`: the block, so
    /// that the windows do not overlap.
    pub stride: Option<usize>,
    /// A token store's split to score (`None`: validation, the held-out
    /// one); only for a store.
    pub split: Option<Split>,
}

/// What [`evaluate_text`] measured.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct TextEval {
    /// What the weights came from: a run's checkpoint or a GPT-2 folder.
    pub source: String,
    /// The device it ran on.
    pub device: String,
    /// The text file, or the token store and its split (`store (val)`).
    pub file: String,
    /// Its size in bytes (a store's split: its documents' text, UTF-8).
    pub bytes: u64,
    /// Tokens scored: every token of the text but the first, which
    /// nothing precedes.
    pub tokens: usize,
    /// The model's context, tokens.
    pub block: usize,
    /// Tokens each window moved on by.
    pub stride: usize,
    /// Windows run through the model.
    pub windows: usize,
    /// Mean cross-entropy, nats per token.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// The text's cross-entropy in bits per byte of UTF-8: comparable
    /// between tokenizers.
    pub bits_per_byte: f64,
    /// Tokens scored per second.
    pub tokens_per_s: f64,
    /// Notes on damaged checkpoints skipped on the way.
    pub notes: Vec<String>,
}

/// Scores the text of `data` (a text file, or a token store's split) with
/// the language model of `from` (a run, or a `transformers` GPT-2 folder),
/// as [`EvalRequest`] says.
pub fn evaluate_text(
    from: &Path,
    data: &Path,
    request: &EvalRequest,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<TextEval, TrainError> {
    if TokenStore::detect(data).is_some() {
        return evaluate_store(from, data, request, hardware);
    }
    if request.split.is_some() {
        return Err(TrainError::Data(DataError::InvalidArgument {
            what: "--split",
            why: format!(
                "`{}` is a text file, scored whole; --split picks a token store's split",
                data.display()
            ),
        }));
    }
    // The text first: a missing or undecodable file is named before any
    // model is read.
    let corpus = kiln_data::read_corpus(data, None)?;
    let loaded = load_lm(
        from,
        request.best,
        "scoring text with a sentence-pair classifier",
        hardware,
    )?;
    let ids = loaded
        .tokenizer
        .encode(&corpus.text)
        .map_err(|e| TrainError::TextNotEncodable {
            path: data.to_path_buf(),
            why: unencodable(&loaded.tokenizer, &corpus.text, &e),
        })?;
    if ids.len() < 2 {
        return Err(TrainError::TextNotEncodable {
            path: data.to_path_buf(),
            why: format!(
                "it is {} token{}: scoring needs two, one to predict from and one to predict",
                ids.len(),
                if ids.len() == 1 { "" } else { "s" }
            ),
        });
    }
    let bytes = corpus.text.len() as u64;
    let tokens = MemoryTokens(ids.into());
    scored(loaded, &tokens, data.display().to_string(), bytes, request)
}

/// Scores a token store's split (validation unless `request.split` says
/// otherwise), read from its shards.
fn evaluate_store(
    from: &Path,
    data: &Path,
    request: &EvalRequest,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<TextEval, TrainError> {
    let split = request.split.unwrap_or(Split::Val);
    // The store first: a damaged one is named before any model is read.
    let store = TokenStore::open(data)?;
    let mismatch = |why: String| {
        TrainError::Data(DataError::StoreMismatch {
            path: data.to_path_buf(),
            why,
        })
    };
    let tokens = store.split(split).clone();
    if tokens.len() < 2 {
        return Err(mismatch(format!(
            "its {split} split holds {} token{}: scoring needs two, one to predict from and one to predict",
            tokens.len(),
            if tokens.len() == 1 { "" } else { "s" }
        )));
    }
    let mut loaded = load_lm(
        from,
        request.best,
        "scoring tokens with a sentence-pair classifier",
        hardware,
    )?;
    // The store's ids must mean the model's tokens.
    let (theirs, what) = match (&store.kind, &store.manifest) {
        (StoreKind::Kiln, Some(manifest)) => (
            Some(kiln_store_tokenizer(data, manifest)?),
            "the tokenizer it was prepared with".to_string(),
        ),
        _ if store.width() == TokenWidth::U32 => {
            loaded.notes.push(format!(
                "`{}` holds llm.c's uint32 shards, which name no tokenizer: its ids are scored as the model's, unchecked",
                data.display()
            ));
            (None, String::new())
        }
        _ => (
            Some(Tokenizer::gpt2()?),
            format!(
                "GPT-2's tokenizer ({} hold GPT-2's ids)",
                gpt2_files(store.kind)
            ),
        ),
    };
    if let Some(theirs) = &theirs
        && theirs.vocab() != loaded.tokenizer.vocab()
    {
        return Err(mismatch(format!(
            "its tokens are ids of {what}, {} tokens, not of the model's tokenizer ({} tokens): score a store prepared with the model's tokenizer, or the text itself",
            theirs.vocab_size(),
            loaded.tokenizer.vocab_size()
        )));
    }
    let bytes = split_bytes(&*tokens, &loaded.tokenizer).map_err(TrainError::Data)?;
    scored(
        loaded,
        &*tokens,
        format!("{} ({split})", data.display()),
        bytes,
        request,
    )
}

/// Scores `tokens` with the loaded model: the windows, their batches, the
/// measures.
fn scored(
    loaded: Loaded,
    tokens: &dyn TokenSpan,
    file: String,
    bytes: u64,
    request: &EvalRequest,
) -> Result<TextEval, TrainError> {
    let Loaded {
        model,
        source,
        notes,
        device,
        ..
    } = loaded;
    let block = model.block_size();
    let stride = request.stride.unwrap_or(block);
    if stride == 0 || stride > block {
        return Err(TrainError::Data(DataError::InvalidArgument {
            what: "--stride",
            why: format!(
                "it is {stride}: a window scores the tokens it moves on by, 1 to the model's block ({block})"
            ),
        }));
    }
    let started = Instant::now();
    let n = tokens.len();
    let windows = windows(n, block, stride);
    let nats = score(&model.valid(), tokens, &windows, &device.device, &file)?;
    let predicted = n - 1;
    let loss = nats / predicted as f64;
    Ok(TextEval {
        source,
        device: device.name,
        file,
        bytes,
        tokens: predicted,
        block,
        stride,
        windows: windows.len(),
        loss,
        perplexity: loss.exp(),
        bits_per_byte: nats / std::f64::consts::LN_2 / bytes.max(1) as f64,
        tokens_per_s: predicted as f64 / started.elapsed().as_secs_f64().max(1e-9),
        notes,
    })
}

/// Tokens a store's split is read and decoded in at a time.
const DECODE_CHUNK: usize = 1 << 20;

/// The UTF-8 bytes of the text a split's tokens encode: its documents (the
/// end-of-text id before each marks where one begins) decoded one at a
/// time, the end-of-text ids left out. A document longer than
/// [`DECODE_CHUNK`] tokens is decoded in pieces of that many, each piece
/// its own decode (a character whose bytes a piece boundary splits counts
/// as U+FFFD's three bytes: a few bytes in megabytes).
fn split_bytes(tokens: &dyn TokenSpan, tokenizer: &Tokenizer) -> Result<u64, DataError> {
    let eot = tokenizer.end_of_text();
    let mut bytes = 0u64;
    let mut chunk = vec![0u32; DECODE_CHUNK.min(tokens.len())];
    let mut document: Vec<u32> = Vec::new();
    let flush = |document: &mut Vec<u32>| -> Result<u64, DataError> {
        let n = if document.is_empty() {
            0
        } else {
            tokenizer.decode(document)?.len() as u64
        };
        document.clear();
        Ok(n)
    };
    let mut at = 0;
    while at < tokens.len() {
        let n = chunk.len().min(tokens.len() - at);
        tokens.read(at, &mut chunk[..n])?;
        for &id in &chunk[..n] {
            if Some(id) == eot {
                bytes += flush(&mut document)?;
            } else {
                document.push(id);
                if document.len() == DECODE_CHUNK {
                    bytes += flush(&mut document)?;
                }
            }
        }
        at += n;
    }
    bytes += flush(&mut document)?;
    Ok(bytes)
}

/// A window of the text: the model reads `ids[start..end - 1]` and predicts
/// `ids[start + 1..end]`, of which the last `scored` count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Window {
    start: usize,
    end: usize,
    scored: usize,
}

/// The windows over `n` tokens: the first predicts up to `block` tokens,
/// each next one moves on by `stride` (at most `block`) and scores those,
/// with up to `block` tokens of context. Every token but the first is
/// scored once.
fn windows(n: usize, block: usize, stride: usize) -> Vec<Window> {
    let mut out = Vec::new();
    // The next token to score, and the end of the window scoring it.
    let mut next = 1;
    while next < n {
        let size = if out.is_empty() { block } else { stride };
        let end = (next + size).min(n);
        let start = end.saturating_sub(block + 1);
        out.push(Window {
            start,
            end,
            scored: end - next,
        });
        next = end;
    }
    out
}

/// The largest logits tensor one forward makes, in values (256 MiB of f32).
const LOGITS_BUDGET: usize = 1 << 26;

/// The sum of the negative log-probabilities of the scored tokens of
/// `windows`, in f64; windows of one length run as a batch, read from
/// `tokens` a batch at a time. An error names an id past the model's
/// vocabulary in `file`, where one is read.
fn score(
    model: &Gpt,
    tokens: &dyn TokenSpan,
    windows: &[Window],
    device: &Device,
    file: &str,
) -> Result<f64, DataError> {
    let vocab = model.vocab_size();
    let mut nats = 0.0;
    let mut i = 0;
    let mut ids = Vec::new();
    while i < windows.len() {
        let len = windows[i].end - windows[i].start - 1;
        let batch_max = (LOGITS_BUDGET / (len * vocab).max(1)).clamp(1, 64);
        let batch: Vec<&Window> = windows[i..]
            .iter()
            .take(batch_max)
            .take_while(|w| w.end - w.start - 1 == len)
            .collect();
        let b = batch.len();
        // Each window's `len + 1` tokens, read once.
        ids.clear();
        ids.resize(b * (len + 1), 0);
        for (w, out) in batch.iter().zip(ids.chunks_mut(len + 1)) {
            tokens.read(w.start, out)?;
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(DataError::InvalidArgument {
                what: "token id",
                why: format!("`{file}` holds the id {id}, past the model's vocabulary of {vocab}"),
            });
        }
        let take = |offset: usize| -> Vec<i64> {
            ids.chunks(len + 1)
                .flat_map(|w| w[offset..offset + len].iter())
                .map(|&t| i64::from(t))
                .collect()
        };
        let inputs = Tensor::<2, Int>::from_data(TensorData::new(take(0), [b, len]), device);
        let targets = Tensor::<2, Int>::from_data(TensorData::new(take(1), [b, len]), device);
        let log_probs: Vec<f32> = model
            .token_log_probs(inputs, targets)
            .into_data()
            .iter::<f32>()
            .collect();
        for (row, w) in log_probs.chunks(len).zip(&batch) {
            nats -= row[len - w.scored..]
                .iter()
                .map(|&v| f64::from(v))
                .sum::<f64>();
        }
        i += b;
    }
    Ok(nats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_but_the_first_is_scored_once_with_its_context() {
        for (n, block, stride) in [
            (10, 4, 4),
            (10, 4, 1),
            (11, 4, 3),
            (3, 8, 8),
            (2, 1, 1),
            (100, 16, 5),
        ] {
            let ws = windows(n, block, stride);
            let mut scored = vec![0; n];
            for w in &ws {
                assert!(w.end - w.start - 1 <= block, "{n} {block} {stride}: {w:?}");
                assert!(w.scored >= 1 && w.scored < w.end - w.start);
                for t in w.end - w.scored..w.end {
                    scored[t] += 1;
                    // Each scored token has all the text before it as
                    // context, or at least the block less the stride.
                    assert!(
                        t - w.start >= t.min(block + 1 - stride),
                        "{n} {block} {stride}: token {t} in {w:?}"
                    );
                }
            }
            assert_eq!(scored[0], 0);
            assert!(
                scored[1..].iter().all(|&c| c == 1),
                "{n} {block} {stride}: {scored:?}"
            );
        }
        // A sliding window of stride 1 gives every token after the first
        // block the whole block as context.
        let ws = windows(10, 4, 1);
        assert_eq!(
            ws[0],
            Window {
                start: 0,
                end: 5,
                scored: 4
            }
        );
        assert_eq!(
            ws[1],
            Window {
                start: 1,
                end: 6,
                scored: 1
            }
        );
        assert_eq!(
            ws.last(),
            Some(&Window {
                start: 5,
                end: 10,
                scored: 1
            })
        );
    }

    #[test]
    fn the_score_of_whole_windows_is_the_models_own_loss() {
        // Non-overlapping windows score every prediction of each: their
        // mean is the fused head-and-loss path's mean, through another path
        // (logits, log-softmax, gather).
        let device = Device::flex();
        let config = kiln_model::GptConfig::new(11, 8, 2, 2, 16);
        let model = config.init(&device);
        let ids: Vec<u32> = (0..3 * 8 + 1).map(|i| (i * 7 % 11) as u32).collect();
        let ws = windows(ids.len(), 8, 8);
        assert_eq!(ws.len(), 3);
        let nats = score(
            &model,
            &MemoryTokens(ids.clone().into()),
            &ws,
            &device,
            "ids",
        )
        .expect("ids");
        let rows = |offset: usize| -> Vec<i64> {
            (0..3)
                .flat_map(|w| ids[w * 8 + offset..w * 8 + offset + 8].iter())
                .map(|&t| i64::from(t))
                .collect()
        };
        let inputs = Tensor::<2, Int>::from_data(TensorData::new(rows(0), [3, 8]), &device);
        let targets = Tensor::<2, Int>::from_data(TensorData::new(rows(1), [3, 8]), &device);
        let loss: f32 = model.loss(inputs, targets).into_scalar();
        let mean = nats / 24.0;
        assert!(
            (mean - f64::from(loss)).abs() < 1e-5,
            "{mean} against {loss}"
        );
    }
}
