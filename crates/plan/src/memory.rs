//! Memory a training step needs, estimated from the shapes.

use kiln_config::{RunConfig, Workload};
use serde::Serialize;

/// A model's parameter counts, as kiln-model counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelSize {
    /// All parameters of the model.
    pub parameters: usize,
    /// Parameters that train (all, or the head alone of a frozen encoder).
    pub trainable: usize,
}

/// What a step's attention keeps for its backward pass, per layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionMemory {
    /// The `heads × T × T` scores, mask and probabilities (Burn's attention,
    /// and kiln's reduced-precision composition): quadratic in T.
    #[default]
    Scores,
    /// One log-sum-exp per query and head, the scores rebuilt in the
    /// backward pass (kiln's attention kernels: flex in f32, wgpu and
    /// CUDA): linear in T.
    LogSumExp,
}

/// What a language model's step keeps of its logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogitsMemory {
    /// The logits and their softmax for every token (Burn's composition):
    /// `2 × tokens × vocabulary` floats.
    #[default]
    All,
    /// The head fused with the loss (kiln's, on flex and the CubeCL GPUs):
    /// chunks of at most `elements` logits (three such buffers at a time),
    /// and the gradients of the hidden states and of the embedding kept
    /// for the backward pass.
    Chunks {
        /// Logits of one chunk.
        elements: u64,
    },
}

/// Memory a training step needs, in bytes (f32 everywhere).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoryEstimate {
    /// Parameters of the model.
    pub parameters: usize,
    /// The f32 weights, in bytes.
    pub weights: u64,
    /// The gradients of the trainable parameters, in bytes.
    pub gradients: u64,
    /// AdamW's two moments (a rank's share of them under ZeRO-1:
    /// [`MemoryEstimate::sharded`]).
    pub optimizer: u64,
    /// The ranks AdamW's moments are split between (ZeRO-1); 1: each rank
    /// keeps them all.
    pub optimizer_ranks: usize,
    /// Activations kept for backward, without gradient checkpointing...
    pub activations: u64,
    /// ...of which attention's part: its scores and probabilities (the T²
    /// term), or its log-sum-exp, as `attention_kept` says.
    pub attention: u64,
    /// What attention keeps for the backward pass.
    pub attention_kept: AttentionMemory,
    /// ...and the language model's head and loss: its logits, or its
    /// chunks and the gradients they give (0 for the encoder).
    pub logits: u64,
    /// What the head and loss keep.
    pub logits_kept: LogitsMemory,
    /// Activations with gradient checkpointing (layer inputs, one layer recomputed).
    pub activations_checkpointed: u64,
    /// Weights + gradients + optimizer + activations as configured.
    pub total: u64,
    /// An evaluation's forward pass at `eval.batch_size`: the weights and
    /// AdamW's moments (they live on), one layer's activations at a time,
    /// the embedding's and the head's output (nothing is kept for a
    /// backward pass).
    pub eval: u64,
    /// What the device has: free GPU memory, or available RAM.
    pub available: u64,
    /// What `available` is ("free GPU memory", "available RAM").
    pub available_what: String,
}

/// Bytes of f32.
const F32: u64 = 4;

/// Memory of a training step at the configured micro-batch. Activations are
/// counted as Burn's autodiff keeps them for these models, per token and
/// layer: about 16·hidden + 4·intermediate floats (inputs of the linear
/// layers, LayerNorm and GELU intermediates, the residual stream) plus
/// 3·heads·T for attention (scores, mask, probabilities); and per token at
/// the output, 2·vocab for the language model's logits and their softmax
/// (the vocabulary padded to `model.vocab_multiple`).
/// With gradient checkpointing a layer keeps only its input and one layer's
/// activations exist at a time. The parameter counts come from the model
/// (kiln-model counts them), so this crate needs no model code. Attention is
/// counted as keeping its scores: [`estimate_memory_with`] says otherwise.
pub fn estimate_memory(config: &RunConfig, vocab: usize, size: ModelSize) -> MemoryEstimate {
    estimate_memory_with(
        config,
        vocab,
        size,
        AttentionMemory::Scores,
        LogitsMemory::All,
    )
}

/// [`estimate_memory`] with attention keeping `attention` and the LM head
/// `logits`: with [`AttentionMemory::LogSumExp`] its `3·heads·T` floats per
/// token become `heads`; with [`LogitsMemory::Chunks`] the `2·vocabulary`
/// per token become three chunks' logits, plus `hidden` per token and the
/// embedding's size (the gradients the chunks give).
pub fn estimate_memory_with(
    config: &RunConfig,
    vocab: usize,
    size: ModelSize,
    attention: AttentionMemory,
    logits_kept: LogitsMemory,
) -> MemoryEstimate {
    let m = &config.model;
    let s = m.max_length as u64;
    let (h, i, a, l) = (
        m.hidden as u64,
        m.intermediate as u64,
        m.heads as u64,
        m.layers as u64,
    );
    let parameters = size.parameters;
    let p = parameters as u64;
    let padded = vocab.next_multiple_of(m.vocab_multiple.max(1)) as u64;
    // A pass over `b` sequences: attention's part of a layer, a layer, the
    // LM's logits (0 for the encoder), the output, the embedding's part.
    let pass = |b: u64| {
        let tokens = b.saturating_mul(s);
        let attention_layer = match attention {
            AttentionMemory::Scores => 3 * a * s * tokens * F32,
            AttentionMemory::LogSumExp => a * tokens * F32,
        };
        let layer = (16 * h + 4 * i) * tokens * F32 + attention_layer;
        let logits = match (config.workload, logits_kept) {
            (Workload::Nli, _) => 0,
            (Workload::Lm, LogitsMemory::All) => 2 * padded * tokens * F32,
            (Workload::Lm, LogitsMemory::Chunks { elements }) => {
                (3 * elements.min(padded * tokens) + h * tokens + padded * h) * F32
            }
        };
        let output = match config.workload {
            Workload::Lm => logits,
            Workload::Nli => 2 * h * b * F32,
        };
        (attention_layer, layer, logits, output, 3 * h * tokens * F32)
    };
    let b = config.training.batch_size as u64;
    let tokens = b * s;
    let (attention_layer, layer, logits, output, embed) = pass(b);
    let activations = l * layer + output + embed;
    let checkpointed = l * h * tokens * F32 + layer + output + embed;
    // A forward pass without autodiff holds about a third of what the
    // backward keeps of a layer: 6·hidden + 2·intermediate floats a token
    // (its input, LayerNorm's output, q, k and v, the MLP's two widths),
    // and attention's part as in training. Measured on the CPU (the
    // baby GPT, 4 × 128, block 64, eval.batch_size 2,048 / 4,096 / 8,192):
    // the run's peak RSS 0.76 / 1.41 / 3.87 GB against this estimate's
    // 1.3 / 2.7 / 5.3 GB; GPT-2 small at block 1,024 and eval.batch_size
    // 128: 7.4 GB against 8.8 GB.
    let eb = config.eval.batch_size as u64;
    let (eval_attention, _, _, eval_output, eval_embed) = pass(eb);
    let eval_layer = (6 * h + 2 * i) * eb.saturating_mul(s) * F32 + eval_attention;
    let trainable = size.trainable as u64;
    let weights = p * F32;
    let gradients = trainable * F32;
    let optimizer = 2 * trainable * F32;
    let kept = if m.gradient_checkpointing {
        checkpointed
    } else {
        activations
    };
    MemoryEstimate {
        parameters,
        weights,
        gradients,
        optimizer,
        optimizer_ranks: 1,
        activations,
        attention: l * attention_layer,
        attention_kept: attention,
        logits,
        logits_kept,
        activations_checkpointed: checkpointed,
        total: weights + gradients + optimizer + kept,
        eval: weights + optimizer + eval_layer + eval_output + eval_embed,
        available: 0,
        available_what: String::new(),
    }
}

impl MemoryEstimate {
    /// The estimate of one rank of a job of `ranks` under ZeRO-1
    /// (`optimization.zero_stage = 1`): AdamW's moments split between the
    /// ranks (by whole tensors, so about evenly), the rest as it was.
    pub fn sharded(mut self, ranks: usize) -> Self {
        let ranks = ranks.max(1);
        let share = self.optimizer.div_ceil(ranks as u64);
        self.total = self.total - self.optimizer + share;
        self.optimizer = share;
        self.optimizer_ranks = ranks;
        self
    }

    /// Whether the step fits in 90 % of what the device has (true where
    /// that is not known).
    pub fn fits(&self) -> bool {
        self.available == 0 || self.total as f64 <= 0.9 * self.available as f64
    }

    /// Whether an evaluation pass fits in 90 % of what the device has.
    pub fn eval_fits(&self) -> bool {
        self.available == 0 || self.eval as f64 <= 0.9 * self.available as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::config;

    const SIZE: ModelSize = ModelSize {
        parameters: 100_000,
        trainable: 100_000,
    };

    #[test]
    fn memory_estimate_grows_as_the_shapes_say() {
        let base = estimate_memory(&config(&[]), 65, SIZE);
        let twice_batch = estimate_memory(&config(&["training.batch_size=24"]), 65, SIZE);
        let twice_len = estimate_memory(&config(&["model.max_length=128"]), 65, SIZE);
        // Activations are linear in the batch; attention is quadratic in T.
        assert_eq!(twice_batch.activations, 2 * base.activations);
        assert_eq!(twice_len.attention, 4 * base.attention);
        assert_eq!(twice_batch.weights, base.weights);
        // Weights, gradients and AdamW: 4 + 4 + 8 bytes per parameter.
        assert_eq!(base.weights, 4 * base.parameters as u64);
        assert_eq!(base.optimizer, 2 * base.gradients);
        // ZeRO-1 among 4 ranks: a quarter of the moments, nothing else.
        let zero = base.clone().sharded(4);
        assert_eq!(zero.optimizer, base.optimizer.div_ceil(4));
        assert_eq!(base.total - zero.total, base.optimizer - zero.optimizer);
        assert_eq!((zero.optimizer_ranks, base.optimizer_ranks), (4, 1));
        assert!(base.activations_checkpointed < base.activations);
        let ckpt = estimate_memory(&config(&["model.gradient_checkpointing=true"]), 65, SIZE);
        assert_eq!(
            ckpt.total,
            base.total - base.activations + base.activations_checkpointed
        );
        // A frozen encoder keeps gradients and moments for the head only.
        let nli = config(&["experiment=nli_snli"]);
        let frozen = ModelSize {
            trainable: 500,
            ..SIZE
        };
        let all = estimate_memory(&nli, 8000, SIZE);
        let head = estimate_memory(&nli, 8000, frozen);
        assert_eq!(head.gradients * 200, all.gradients);
        assert_eq!(head.weights, all.weights);
    }

    #[test]
    fn a_fused_head_keeps_chunks_not_every_tokens_logits() {
        // GPT-2's vocabulary padded to 64 (50,304) on 12 × 64 tokens.
        let overrides = ["data.tokenizer=gpt2", "model.vocab_multiple=64"];
        let estimate = |logits| {
            estimate_memory_with(
                &config(&overrides),
                50257,
                SIZE,
                AttentionMemory::Scores,
                logits,
            )
        };
        let all = estimate(LogitsMemory::All);
        assert_eq!(all.logits, 2 * 50304 * 12 * 64 * 4);
        assert_eq!(all.logits_kept, LogitsMemory::All);
        // Chunks of 2^25 logits are more than these 768 tokens' 38.6 M:
        // three buffers of all of them, the hidden states' gradient and
        // the embedding's.
        let big = estimate(LogitsMemory::Chunks { elements: 1 << 25 });
        assert_eq!(big.logits, (3 * (1 << 25) + 128 * 768 + 50304 * 128) * 4);
        let small = estimate(LogitsMemory::Chunks { elements: 1 << 20 });
        assert_eq!(small.logits, (3 * (1 << 20) + 128 * 768 + 50304 * 128) * 4);
        assert_eq!(all.total - small.total, all.logits - small.logits);
        // The encoder has no LM head.
        let nli = estimate_memory_with(
            &config(&["experiment=nli_snli"]),
            8000,
            SIZE,
            AttentionMemory::Scores,
            LogitsMemory::Chunks { elements: 1 << 20 },
        );
        assert_eq!(nli.logits, 0);
    }

    #[test]
    fn attention_without_scores_is_linear_in_the_length() {
        let streamed = |overrides: &[&str]| {
            estimate_memory_with(
                &config(overrides),
                65,
                SIZE,
                AttentionMemory::LogSumExp,
                LogitsMemory::All,
            )
        };
        let (base, twice_len) = (streamed(&[]), streamed(&["model.max_length=128"]));
        assert_eq!(twice_len.attention, 2 * base.attention);
        assert_eq!(base.attention_kept, AttentionMemory::LogSumExp);
        // One f32 per token, head and layer: the defaults' 4 heads, 4
        // layers, 12 × 64 tokens.
        assert_eq!(base.attention, 4 * 4 * 12 * 64 * 4);
        // The scores' 3·T floats per token and head are what it saves.
        let scores = estimate_memory(&config(&[]), 65, SIZE);
        assert_eq!(scores.attention, 3 * 64 * base.attention);
        assert_eq!(scores.total - base.total, scores.attention - base.attention);
    }
}
