//! The typed run configuration: every key kiln reads, its type and its valid
//! range. Defaults live in the built-in `defaults.toml` (`presets/` of this
//! crate), which names every key; [`RunConfig::default`] reads it.

use serde::{Deserialize, Serialize};

/// The whole configuration of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RunConfig {
    /// Hardware preset (`hardware/<name>.toml`), or `auto` to detect.
    pub hardware: String,
    /// Experiment preset (`experiment/<name>.toml`).
    pub experiment: String,
    /// What is trained: a language model or a sentence-pair classifier.
    pub workload: Workload,
    pub run: RunSection,
    pub model: ModelSection,
    pub data: DataSection,
    pub training: TrainingSection,
    pub eval: EvalSection,
    pub logging: LoggingSection,
    pub checkpoint: CheckpointSection,
    pub precision: PrecisionSection,
    pub optimization: OptimizationSection,
    pub loader: LoaderSection,
    pub device: DeviceSection,
    pub cv: CvSection,
    pub sample: SampleSection,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// GPT-style decoder on a text corpus.
    Lm,
    /// Transformer encoder classifying sentence pairs.
    Nli,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RunSection {
    /// Run directory; `{time}` and `{experiment}` are filled in at start.
    pub dir: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ModelSection {
    pub layers: usize,
    pub heads: usize,
    /// Width of the residual stream (d_model).
    pub hidden: usize,
    /// Width of the MLP's inner layer.
    pub intermediate: usize,
    pub dropout: f64,
    /// Tokens per sequence (the LM's block size, the encoder's maximum).
    pub max_length: usize,
    pub gradient_checkpointing: bool,
    /// Train only the classification head (encoder workloads).
    pub freeze_encoder: bool,
    pub pooling: Pooling,
    pub gelu: Gelu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    Cls,
    Mean,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gelu {
    Exact,
    Tanh,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DataSection {
    /// The corpus (lm) or the pairs file (nli).
    pub path: String,
    pub tokenizer: TokenizerKind,
    /// Vocabulary size for trained BPE / WordPiece tokenizers (char: ignored).
    pub vocab_size: usize,
    /// Fraction held out for validation (lm: the tail of the corpus).
    pub val_fraction: f64,
    /// Use only the first N characters of the corpus; 0 uses all of it.
    pub max_chars: usize,
    /// A `tokenizer.json` to use instead of training one; empty trains one.
    pub tokenizer_file: String,
    /// Where encoded corpora are cached, keyed by corpus and tokenizer.
    pub cache_dir: String,
    /// Sentence pairs: the fields (JSONL) or columns (TSV/CSV) to read.
    pub premise_field: String,
    pub hypothesis_field: String,
    pub label_field: String,
    /// The label names, in class order.
    pub labels: Vec<String>,
    /// Rows with a missing or unknown label or an empty text.
    pub bad_rows: BadRowsMode,
    /// The pairs file layout.
    pub format: PairsFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadRowsMode {
    Skip,
    Error,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairsFormat {
    Auto,
    Jsonl,
    Tsv,
    Csv,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    Char,
    Bpe,
    Wordpiece,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TrainingSection {
    /// Micro-batch per optimizer step and accumulation step.
    pub batch_size: usize,
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps; 0 trains for `epochs` instead.
    pub max_steps: usize,
    pub epochs: usize,
    pub seed: u64,
    pub learning_rate: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EvalSection {
    /// Evaluate every N optimizer steps (never at step 0).
    pub eval_steps: usize,
    /// Batches per evaluation.
    pub eval_iters: usize,
    pub batch_size: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LoggingSection {
    pub logging_steps: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CheckpointSection {
    /// Write a checkpoint every N optimizer steps (and always at the end).
    pub every_steps: usize,
    /// How many checkpoints to keep.
    pub keep: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PrecisionSection {
    /// Mixed precision: compute in `amp_dtype`, master weights in f32.
    pub amp: bool,
    pub amp_dtype: AmpDtype,
    /// Allow TF32 matmuls where the device has them.
    pub tf32: bool,
    /// Steps in a row whose loss or gradient norm is not finite (each
    /// skipped, no update) before the run stops.
    pub max_bad_steps: usize,
    /// fp16's dynamic loss scale: where it starts (PyTorch: 2^16).
    pub loss_scale_init: f64,
    /// Clean steps in a row after which the loss scale doubles (PyTorch: 2000).
    pub loss_scale_growth_interval: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmpDtype {
    Bf16,
    Fp16,
}

impl AmpDtype {
    /// `bf16` or `fp16`, as the configuration spells it.
    pub fn name(self) -> &'static str {
        match self {
            AmpDtype::Bf16 => "bf16",
            AmpDtype::Fp16 => "fp16",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OptimizationSection {
    /// Kernel fusion and autotuning on backends that have them.
    pub compile: bool,
    pub compile_mode: CompileMode,
    /// kiln's fused CPU kernels (linear, GELU, attention, LayerNorm) or Burn's plain
    /// composition of the same math.
    pub kernels: KernelChoice,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelChoice {
    Fused,
    Reference,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompileMode {
    Default,
    ReduceOverhead,
    MaxAutotune,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LoaderSection {
    /// Worker threads preparing batches; 0 prepares them on the training thread.
    pub num_workers: usize,
    /// Batches queued ahead per worker.
    pub prefetch_factor: usize,
    /// Sentence pairs: batch pairs of similar length together (less padding).
    pub bucket_by_length: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DeviceSection {
    pub backend: Backend,
    /// Which GPU of several.
    pub index: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Auto,
    Cuda,
    Wgpu,
    Flex,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CvSection {
    /// Cross-validation folds (nli).
    pub folds: usize,
    /// Stop a fold after this many evaluations without a better macro-F1; 0 never stops early.
    pub patience: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SampleSection {
    /// Texts generated at the end of a language-model run.
    pub count: usize,
    /// Tokens per text.
    pub tokens: usize,
    pub temperature: f64,
    /// Sample among the k most likely tokens; 0 samples among all.
    pub top_k: usize,
}

/// A value outside its valid range: the key and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeProblem {
    pub key: &'static str,
    pub problem: String,
}

impl RunConfig {
    /// Checks what types cannot: ranges and relations between keys.
    pub fn validate(&self) -> Vec<RangeProblem> {
        let mut out = Vec::new();
        let mut check = |ok: bool, key: &'static str, problem: &str| {
            if !ok {
                out.push(RangeProblem {
                    key,
                    problem: problem.to_string(),
                });
            }
        };
        let m = &self.model;
        check(m.layers >= 1, "model.layers", "must be at least 1");
        check(m.heads >= 1, "model.heads", "must be at least 1");
        check(
            m.heads >= 1 && m.hidden.is_multiple_of(m.heads),
            "model.hidden",
            &format!("must be a multiple of model.heads ({})", m.heads),
        );
        check(
            m.intermediate >= 1,
            "model.intermediate",
            "must be at least 1",
        );
        check(
            (0.0..1.0).contains(&m.dropout),
            "model.dropout",
            "must be in [0, 1)",
        );
        check(m.max_length >= 2, "model.max_length", "must be at least 2");
        check(
            self.precision.max_bad_steps >= 1,
            "precision.max_bad_steps",
            "must be at least 1",
        );
        check(
            self.precision.loss_scale_init.is_finite() && self.precision.loss_scale_init >= 1.0,
            "precision.loss_scale_init",
            "must be a finite number of at least 1",
        );
        check(
            self.precision.loss_scale_growth_interval >= 1,
            "precision.loss_scale_growth_interval",
            "must be at least 1",
        );
        let d = &self.data;
        check(!d.path.trim().is_empty(), "data.path", "must not be empty");
        check(
            d.val_fraction > 0.0 && d.val_fraction < 1.0,
            "data.val_fraction",
            "must be between 0 and 1 (exclusive)",
        );
        check(
            d.tokenizer == TokenizerKind::Char || d.vocab_size >= 16,
            "data.vocab_size",
            "must be at least 16 for a trained tokenizer",
        );
        let t = &self.training;
        check(
            t.batch_size >= 1,
            "training.batch_size",
            "must be at least 1",
        );
        check(
            t.gradient_accumulation_steps >= 1,
            "training.gradient_accumulation_steps",
            "must be at least 1",
        );
        check(
            t.max_steps >= 1 || t.epochs >= 1,
            "training.max_steps",
            "is 0, so training.epochs must be at least 1",
        );
        check(
            t.learning_rate > 0.0 && t.learning_rate.is_finite(),
            "training.learning_rate",
            "must be a positive number",
        );
        check(
            t.min_lr >= 0.0 && t.min_lr <= t.learning_rate,
            "training.min_lr",
            &format!(
                "must be between 0 and training.learning_rate ({})",
                t.learning_rate
            ),
        );
        check(
            t.weight_decay >= 0.0 && t.weight_decay.is_finite(),
            "training.weight_decay",
            "must be 0 or more",
        );
        check(
            (0.0..1.0).contains(&t.beta1),
            "training.beta1",
            "must be in [0, 1)",
        );
        check(
            (0.0..1.0).contains(&t.beta2),
            "training.beta2",
            "must be in [0, 1)",
        );
        check(t.eps > 0.0, "training.eps", "must be positive");
        check(
            t.grad_clip >= 0.0 && t.grad_clip.is_finite(),
            "training.grad_clip",
            "must be 0 (off) or more",
        );
        let e = &self.eval;
        check(e.eval_steps >= 1, "eval.eval_steps", "must be at least 1");
        check(e.eval_iters >= 1, "eval.eval_iters", "must be at least 1");
        check(e.batch_size >= 1, "eval.batch_size", "must be at least 1");
        check(
            self.logging.logging_steps >= 1,
            "logging.logging_steps",
            "must be at least 1",
        );
        check(
            self.checkpoint.every_steps >= 1,
            "checkpoint.every_steps",
            "must be at least 1",
        );
        check(
            self.checkpoint.keep >= 1,
            "checkpoint.keep",
            "must be at least 1",
        );
        check(
            self.loader.prefetch_factor >= 1,
            "loader.prefetch_factor",
            "must be at least 1",
        );
        check(self.cv.folds >= 2, "cv.folds", "must be at least 2");
        check(
            !self.run.dir.trim().is_empty(),
            "run.dir",
            "must not be empty",
        );
        out
    }

    /// Sequences per optimizer step: micro-batch × accumulation.
    pub fn effective_batch(&self) -> usize {
        self.training.batch_size * self.training.gradient_accumulation_steps
    }
}
