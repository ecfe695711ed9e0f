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
    /// `[run]`: where runs go.
    pub run: RunSection,
    /// `[model]`: the model's shape and options.
    pub model: ModelSection,
    /// `[data]`: the corpus or pairs and the tokenizer.
    pub data: DataSection,
    /// `[training]`: batch, steps, optimizer and schedule.
    pub training: TrainingSection,
    /// `[eval]`: how often and on how much to evaluate.
    pub eval: EvalSection,
    /// `[logging]`: how often to log.
    pub logging: LoggingSection,
    /// `[checkpoint]`: how often to checkpoint and how many to keep.
    pub checkpoint: CheckpointSection,
    /// `[precision]`: mixed precision and loss scaling.
    pub precision: PrecisionSection,
    /// `[optimization]`: compile and kernels.
    pub optimization: OptimizationSection,
    /// `[loader]`: loader workers and prefetch.
    pub loader: LoaderSection,
    /// `[device]`: which backend and device.
    pub device: DeviceSection,
    /// `[cv]`: cross-validation.
    pub cv: CvSection,
    /// `[sample]`: text sampled after training.
    pub sample: SampleSection,
}

/// What a run trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// GPT-style decoder on a text corpus.
    Lm,
    /// Transformer encoder classifying sentence pairs.
    Nli,
}

/// `[run]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RunSection {
    /// Run directory; `{time}`, `{experiment}` and `{data}` (the data
    /// file's name without its extension, or the folder's) are filled in
    /// at start ([`RunConfig::run_dir_template`] fills the last two).
    pub dir: String,
}

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ModelSection {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads; must divide `model.hidden`.
    pub heads: usize,
    /// Width of the residual stream (d_model).
    pub hidden: usize,
    /// Width of the MLP's inner layer.
    pub intermediate: usize,
    /// Dropout probability, in [0, 1): on the embeddings and the residual
    /// branches (and before the encoder's head).
    pub dropout: f64,
    /// Dropout on the attention probabilities, in [0, 1): BERT's
    /// `attention_probs_dropout_prob`, GPT-2's `attn_pdrop`. A run saved
    /// before this key existed resumes with 0 (kiln had none).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Tokens per sequence (the LM's block size, the encoder's maximum).
    pub max_length: usize,
    /// Recompute activations in the backward pass: less memory, about 20–30 % more time.
    pub gradient_checkpointing: bool,
    /// Train only the classification head (encoder workloads).
    pub freeze_encoder: bool,
    /// Encoder workloads: `cls` (the [CLS] token), `pooler` (BERT's dense
    /// layer and tanh on it) or `mean` (mean over real tokens).
    pub pooling: Pooling,
    /// Encoder workloads: the embeddings' width where it is narrower than
    /// `hidden` (ELECTRA-small's 128 under 256: a linear layer projects them
    /// to `hidden`); 0: as wide as the model. A run saved before this key
    /// existed resumes with 0.
    #[serde(default)]
    pub embedding_size: usize,
    /// Encoder workloads: rows of the segment embedding, 2 (BERT's: premise
    /// and hypothesis), 1 (RoBERTa's: one row for every token) or 0
    /// (DistilBERT's: none). A run saved before this key existed resumes
    /// with 2.
    #[serde(default = "bert_segments")]
    pub segments: usize,
    /// Encoder workloads with `pooling = "pooler"`: the pooler's activation,
    /// `tanh` (BERT's, RoBERTa's), `gelu` (ELECTRA's classification head)
    /// or `relu` (DistilBERT's `pre_classifier`).
    /// A run saved before this key existed resumes with `tanh`.
    #[serde(default = "bert_pooler")]
    pub pooler_activation: PoolerActivation,
    /// Encoder workloads: every LayerNorm's ε (PyTorch's 1e-5; BERT's
    /// 1e-12). A run saved before this key existed resumes with 1e-5.
    #[serde(default = "torch_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// `exact` (erf) or `tanh` (the approximation); never switched silently.
    pub gelu: Gelu,
    /// Language models: the embedding and the logits padded to a multiple
    /// of this many tokens (nanoGPT's 50,304 for GPT-2's 50,257), for the
    /// GPU's tiles and vector loads; the padding ids never occur and their
    /// logits are masked out of the loss. 1: no padding. A run saved
    /// before this key existed resumes with 1.
    #[serde(default = "no_vocab_padding")]
    pub vocab_multiple: usize,
    /// Start from the weights of a Hugging Face `transformers` folder
    /// (`config.json`, `model.safetensors`) instead of random ones, to
    /// fine-tune them: a GPT-2 for language models (OpenAI's from the Hub,
    /// or a `kiln export`), a BERT, RoBERTa, ELECTRA or DistilBERT for the sentence-pair encoder
    /// (`bert-base-uncased`, `roberta-base` and their kin); `None` (`"none"` in TOML) starts
    /// from random weights. The folder's shape, GELU and tokenizer must be
    /// the run's.
    #[serde(default, with = "none::text")]
    pub init_from: Option<String>,
    /// The sentence-pair encoder's `model.init_from`: the names of the
    /// folder's classifier outputs, in its order, where its `id2label` does
    /// not say them (`LABEL_0`, `LABEL_1`, ...). Its classifier is then
    /// loaded, its outputs reordered to `data.labels`. Empty: its
    /// `id2label`, matched to `data.labels` in any order.
    #[serde(default)]
    pub init_labels: Vec<String>,
}

fn no_vocab_padding() -> usize {
    1
}

fn one() -> f64 {
    1.0
}

fn a_fifth() -> f64 {
    0.2
}

fn cosine() -> LrSchedule {
    LrSchedule::Cosine
}

/// The learning rate's course after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Cosine decay from `learning_rate` to `min_lr` at the last step.
    Cosine,
    /// Linear decay from `learning_rate` to `min_lr` at the last step.
    Linear,
    /// `learning_rate` to the end (`min_lr` unused).
    Constant,
    /// Warm-up, stable, decay (the trapezoid of modded-nanogpt and
    /// MiniCPM, `transformers`' `warmup_stable_decay`): `learning_rate`
    /// until the last `decay_fraction` of the steps after the warm-up,
    /// then linear decay to `min_lr` at the last step.
    Wsd,
}

fn bert_segments() -> usize {
    2
}

fn bert_pooler() -> PoolerActivation {
    PoolerActivation::Tanh
}

/// The activation of the encoder's pooler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolerActivation {
    /// BERT's pooler and RoBERTa's classification head.
    Tanh,
    /// ELECTRA's classification head (the exact GELU).
    Gelu,
    /// DistilBERT's `pre_classifier`.
    Relu,
}

fn torch_layer_norm_eps() -> f64 {
    1e-5
}

/// How the encoder pools a sequence for the classifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The `[CLS]` token's state.
    Cls,
    /// BERT's pooler (a dense layer and tanh on the `[CLS]` state), as
    /// `BertForSequenceClassification` classifies.
    Pooler,
    /// The mean over the real (unpadded) tokens.
    Mean,
}

/// Which GELU the MLPs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gelu {
    /// The exact erf form, as BERT was trained (`transformers`' `gelu`).
    Exact,
    /// The tanh approximation, as OpenAI's GPT-2 was trained
    /// (`transformers`' `gelu_new`).
    Tanh,
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DataSection {
    /// The corpus (lm) or the pairs file (nli).
    pub path: String,
    /// `char` (vocabulary from the corpus), `bpe` or `wordpiece` (trained on the training text).
    pub tokenizer: TokenizerKind,
    /// Vocabulary size for trained BPE / WordPiece tokenizers (char: ignored).
    pub vocab_size: usize,
    /// Fraction held out for validation (lm: the tail of the corpus).
    pub val_fraction: f64,
    /// Use only the first N characters of the corpus; `None` (`"none"` in
    /// TOML) reads all of it.
    #[serde(with = "none::count")]
    pub max_chars: Option<usize>,
    /// A `tokenizer.json` to use instead of training one; `None` (`"none"`
    /// in TOML) trains one.
    #[serde(with = "none::text")]
    pub tokenizer_file: Option<String>,
    /// Where encoded corpora are cached, keyed by corpus and tokenizer, and
    /// where documents given as `data.path` are prepared into token stores.
    pub cache_dir: String,
    /// The JSON field or parquet column holding a document's text.
    pub text_field: String,
    /// Text a tokenizer trained for a token store learns from, at most
    /// (bytes, the corpus' first documents).
    pub tokenizer_sample_bytes: u64,
    /// Tokens per shard of a token store (llm.c's 10^8).
    pub shard_tokens: usize,
    /// Sentence pairs: the fields (JSONL) or columns (TSV/CSV) to read.
    pub premise_field: String,
    /// The field or column of the second sentence.
    pub hypothesis_field: String,
    /// The field or column of the label (a name, or in JSON an index into `data.labels`).
    pub label_field: String,
    /// The label names, in class order.
    pub labels: Vec<String>,
    /// Rows with a missing or unknown label or an empty text.
    pub bad_rows: BadRowsMode,
    /// The pairs file layout.
    pub format: PairsFormat,
}

/// What reading pairs does with a bad row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadRowsMode {
    /// Skip it, count it and name its line.
    Skip,
    /// Stop with an error naming its line.
    Error,
}

/// The layout of a pairs file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairsFormat {
    /// From the file's extension.
    Auto,
    /// JSON lines.
    Jsonl,
    /// Tab-separated, with a header.
    Tsv,
    /// Comma-separated, with a header.
    Csv,
}

/// Which tokenizer a run trains (or loads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per character of the corpus.
    Char,
    /// Byte-level BPE, as GPT-2.
    Bpe,
    /// GPT-2's own tokenizer (50,257 ids, built in).
    Gpt2,
    /// WordPiece, as BERT.
    Wordpiece,
}

/// `[training]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TrainingSection {
    /// Micro-batch per optimizer step and accumulation step.
    pub batch_size: usize,
    /// Micro-batches per optimizer step; gradients are averaged.
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps; 0 trains for `epochs` instead.
    pub max_steps: usize,
    /// Passes over the training data when `max_steps` is 0.
    pub epochs: usize,
    /// Seeds initialisation, sampling and the loader: same seed, same run.
    pub seed: u64,
    /// Peak learning rate, reached after warm-up.
    pub learning_rate: f64,
    /// Where the decay ends; between 0 and `learning_rate`.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// The warm-up as a share of the run's optimizer steps, rounded up
    /// (transformers' `warmup_ratio`: BERT's 0.1), in [0, 1); above 0 it
    /// replaces `warmup_steps`, so a run by epochs warms up for the same
    /// share on any corpus. A run saved before this key existed resumes
    /// with 0.
    #[serde(default)]
    pub warmup_ratio: f64,
    /// After the warm-up: `cosine` decay to `min_lr` (nanoGPT's), `linear`
    /// decay to it (BERT's, `transformers`' Trainer's default), `constant`
    /// at `learning_rate`, or `wsd` (held, then linear over the last
    /// `decay_fraction`). A run saved before this key existed resumes with
    /// `cosine`.
    #[serde(default = "cosine")]
    pub lr_schedule: LrSchedule,
    /// `lr_schedule = "wsd"`: the share of the steps after the warm-up
    /// that decay to `min_lr` (the rest hold `learning_rate`). A run saved
    /// before this key existed resumes with 0.2.
    #[serde(default = "a_fifth")]
    pub decay_fraction: f64,
    /// The sentence-pair encoder: layer-wise learning-rate decay (ELECTRA's
    /// and BEiT's fine-tuning recipe). The classifier (and pooler) train at
    /// the schedule's rate, the top block at `decay` times it, each block
    /// below at `decay` times the one above, the embeddings at
    /// `decay^(layers + 1)`. 1: one rate for every layer. A run saved
    /// before this key existed resumes with 1.
    #[serde(default = "one")]
    pub layer_lr_decay: f64,
    /// Label smoothing ε of the training loss, as PyTorch's
    /// `CrossEntropyLoss(label_smoothing=ε)` and `transformers`'
    /// `label_smoothing_factor`: the target is `1 − ε` on the label (the
    /// next token) and `ε / classes` (`/ vocabulary`) spread over every
    /// class. Validation loss stays the plain cross-entropy. 0: off. A run
    /// saved before this key existed resumes with 0.
    #[serde(default)]
    pub label_smoothing: f64,
    /// AdamW weight decay, applied to weight matrices only.
    pub weight_decay: f64,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2 (PyTorch's default is 0.999; 0.95 is the GPT choice).
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
}

/// `[eval]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EvalSection {
    /// Evaluate every N optimizer steps (never at step 0).
    pub eval_steps: usize,
    /// Batches per evaluation.
    pub eval_iters: usize,
    /// Batch size of evaluation (no activations kept for backward, so it can be larger).
    pub batch_size: usize,
    /// Language models: stop after this many evaluations without a better
    /// validation loss (`transformers`' `EarlyStoppingCallback`); 0 never
    /// stops early. Cross-validation folds have `cv.patience`. A run
    /// saved before this key existed resumes with 0.
    #[serde(default)]
    pub patience: usize,
}

/// `[logging]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LoggingSection {
    /// Log every N optimizer steps.
    pub logging_steps: usize,
    /// TensorBoard event files in the run directory (`RUN/tensorboard/`),
    /// written as the run goes: `tensorboard --logdir runs`. A run saved
    /// before this key existed resumes with them on.
    #[serde(default = "tensorboard_on")]
    pub tensorboard: bool,
}

fn tensorboard_on() -> bool {
    true
}

/// `[checkpoint]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CheckpointSection {
    /// Write a checkpoint every N optimizer steps (and always at the end).
    pub every_steps: usize,
    /// How many checkpoints to keep.
    pub keep: usize,
}

/// `[precision]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PrecisionSection {
    /// Mixed precision: compute in `amp_dtype`, master weights in f32.
    pub amp: bool,
    /// `bf16` (Ampere and newer) or `fp16` (with loss scaling).
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
    /// In a data-parallel job, the type the gradients travel and are
    /// averaged in (FSDP's `reduce_dtype`; DDP's `bf16_compress_hook`):
    /// `f32`, or `bf16` for half the bytes.
    #[serde(default)]
    pub reduce_dtype: ReduceDtype,
}

/// `precision.reduce_dtype`: the gradients' type in a job's all-reduce.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceDtype {
    /// float32: the gradients as computed.
    #[default]
    F32,
    /// bfloat16: half the bytes over the links, each rank's gradients and
    /// their mean rounded to 8 bits of mantissa.
    Bf16,
}

impl ReduceDtype {
    /// Bytes a value takes over the links.
    pub fn bytes(self) -> u64 {
        match self {
            ReduceDtype::F32 => 4,
            ReduceDtype::Bf16 => 2,
        }
    }
}

/// The dtype products compute in under `precision.amp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmpDtype {
    /// bfloat16 (Ampere or later).
    Bf16,
    /// float16, with loss scaling.
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

/// `[optimization]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OptimizationSection {
    /// Kernel fusion and autotuning on backends that have them.
    pub compile: bool,
    /// `default` and `reduce-overhead` → CubeCL autotune level `balanced`, `max-autotune` → `full`; tuned kernels cached across runs in builds with `autotune-cache`.
    pub compile_mode: CompileMode,
    /// kiln's fused CPU kernels (linear, GELU, attention, LayerNorm) or Burn's plain
    /// composition of the same math.
    pub kernels: KernelChoice,
    /// Which self-attention runs (with `kernels = "fused"`), as PyTorch's
    /// `sdpa_kernel` picks: `auto`, `flash` (on the matrix unit; a run
    /// where it cannot is refused), `memory-efficient` (kiln's kernels
    /// without the matrix unit) or `math` (Burn's composition).
    #[serde(default)]
    pub attention: AttentionChoice,
    /// Which library runs the linear layers' matrix products on a CUDA
    /// GPU: `burn` (CubeCL's autotuned kernels) or `cublas` (NVIDIA's
    /// cuBLAS, loaded at run time; a run where it cannot run is refused at
    /// its start). Other devices run Burn's either way.
    #[serde(default)]
    pub matmul: MatmulChoice,
    /// In a data-parallel job, how AdamW's state is kept (DeepSpeed's
    /// `zero_optimization.stage`): `0`, every rank holds all of it, as
    /// DDP; `1`, each rank holds the moments of its share of the
    /// parameters, updates that share, and the ranks all-gather the
    /// updated weights (ZeRO-1, PyTorch's `ZeroRedundancyOptimizer`);
    /// `2`, besides, the gradients are reduce-scattered, each rank
    /// receiving the average of its share alone (ZeRO-2, FSDP's
    /// `SHARD_GRAD_OP`).
    #[serde(default)]
    pub zero_stage: u8,
}

/// `optimization.attention`: which self-attention the models run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionChoice {
    /// FlashAttention-2 on the matrix unit where the device and dtype
    /// have it (f16/bf16 on a GPU with tensor cores or cooperative
    /// matrices), else kiln's memory-efficient kernels, else Burn's.
    #[default]
    Auto,
    /// FlashAttention-2 on the matrix unit; the run is refused (exit 2)
    /// where it cannot run.
    Flash,
    /// kiln's memory-efficient kernels without the matrix unit (scalar on
    /// GPUs; flex's fused kernel on the CPU).
    MemoryEfficient,
    /// Burn's composition, which keeps the `heads × T × T` scores.
    Math,
}

impl AttentionChoice {
    /// The name in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionChoice::Auto => "auto",
            AttentionChoice::Flash => "flash",
            AttentionChoice::MemoryEfficient => "memory-efficient",
            AttentionChoice::Math => "math",
        }
    }
}

/// `optimization.matmul`: which library runs the linear layers' matrix
/// products on a CUDA GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatmulChoice {
    /// Burn's (CubeCL's autotuned kernels).
    #[default]
    Burn,
    /// NVIDIA's cuBLAS in bf16/fp16 with f32 sums, and in f32 (TF32 as
    /// `precision.tf32` says); refused (exit 2) where it cannot run.
    Cublas,
}

/// Which CPU kernels the models use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelChoice {
    /// kiln's fused kernels.
    Fused,
    /// Burn's own operations (the reference the kernels are tested against).
    Reference,
}

/// `optimization.compile_mode`, as `torch.compile` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompileMode {
    /// Balanced autotuning.
    Default,
    /// Balanced autotuning (CubeCL has no graph capture to reduce overhead with).
    ReduceOverhead,
    /// Full autotuning.
    MaxAutotune,
}

/// The largest `data.vocab_size` a trained tokenizer takes (2^22): the
/// `tokenizers` trainer reserves about 70 bytes for each id asked, so a
/// billion aborted on its 70 GB.
pub const MAX_TRAINED_VOCAB: usize = 1 << 22;

/// The most texts one sampling draws (`sample.count`, `kiln sample -n`):
/// they are held in memory until written.
pub const MAX_SAMPLE_COUNT: usize = 10_000;

/// The most tokens one sampled text holds (`sample.tokens`, `kiln sample
/// --tokens`): past the block, every token is a forward pass over a whole
/// block, so a million is hours on a CPU already.
pub const MAX_SAMPLE_TOKENS: usize = 1_000_000;

/// `[loader]`.
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

/// `[device]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DeviceSection {
    /// `auto` (the machine's GPU through the backend this build has for its vendor: CUDA for NVIDIA's, ROCm for AMD's, else wgpu (Vulkan, Metal) for AMD's, Intel's and Apple's; otherwise the CPU), `cuda`, `rocm`, `wgpu` (force that device; exit 2 if the build lacks its feature), `flex` (the CPU) or `cubecl-cpu` (the CPU through Burn's CubeCL backend; built with the `cubecl-cpu` feature).
    pub backend: Backend,
    /// Which GPU of several.
    pub index: usize,
}

/// Which Burn backend a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// A GPU when one is found and built in, else the CPU.
    Auto,
    /// NVIDIA GPUs through CUDA.
    Cuda,
    /// AMD GPUs through ROCm/HIP.
    Rocm,
    /// GPUs through wgpu (Vulkan, Metal, DX12).
    Wgpu,
    /// The CPU, with kiln's fused kernels.
    Flex,
    /// The CPU through Burn's CubeCL backend (kernels compiled by LLVM):
    /// opt-in, for comparison (docs/PERFORMANCE.md).
    #[serde(rename = "cubecl-cpu")]
    CubeclCpu,
}

/// `[cv]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CvSection {
    /// Cross-validation folds (nli).
    pub folds: usize,
    /// Stop a fold after this many evaluations without a better macro-F1; 0 never stops early.
    pub patience: usize,
}

/// `[sample]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SampleSection {
    /// Texts generated at the end of a language-model run.
    pub count: usize,
    /// Tokens per text.
    pub tokens: usize,
    /// Sampling temperature: lower is more conservative; 0 takes the most
    /// likely token (greedy).
    pub temperature: f64,
    /// Sample among the k most likely tokens; 0 samples among all.
    pub top_k: usize,
    /// Nucleus sampling: among the most likely tokens whose probabilities
    /// first reach top_p in all (after top_k); 1 samples among all. A run
    /// saved before this key existed samples with 1.
    #[serde(default = "one")]
    pub top_p: f64,
}

/// A value outside its valid range: the key and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeProblem {
    /// The key, dotted.
    pub key: &'static str,
    /// What is wrong with its value.
    pub problem: String,
}

impl ModelSection {
    /// The encoder's embedding width: `embedding_size`, or `hidden` where
    /// that is 0.
    pub fn embedding_width(&self) -> usize {
        match self.embedding_size {
            0 => self.hidden,
            width => width,
        }
    }
}

impl PoolerActivation {
    /// Its name in the configuration (`model.pooler_activation`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tanh => "tanh",
            Self::Gelu => "gelu",
            Self::Relu => "relu",
        }
    }
}

impl Gelu {
    /// Its name in the configuration (`model.gelu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Tanh => "tanh",
        }
    }
}

/// Where each of `labels` is among `names` (letter case aside), where
/// `names` holds each of them exactly once and nothing else: how a
/// classifier's outputs named `names` map onto `labels`
/// (`model.init_labels`, a folder's `id2label`).
pub fn label_order(names: &[String], labels: &[String]) -> Option<Vec<usize>> {
    if names.len() != labels.len() {
        return None;
    }
    labels
        .iter()
        .map(|label| {
            let mut at = (0..names.len()).filter(|&i| names[i].eq_ignore_ascii_case(label));
            at.next().filter(|_| at.next().is_none())
        })
        .collect()
}

/// The placeholders `run.dir` may hold.
pub const RUN_DIR_PLACEHOLDERS: [&str; 3] = ["{time}", "{experiment}", "{data}"];

impl RunConfig {
    /// `run.dir` with `{experiment}` and `{data}` filled in: the data's
    /// name is `data.path`'s last part without its extension
    /// (`data/tinyshakespeare.txt` → `tinyshakespeare`, a shard folder
    /// `corpus/` → `corpus`). `{time}` is left for the run's start.
    ///
    /// ```
    /// let mut config = kiln_config::RunConfig::default();
    /// config.run.dir = "runs/{time}-{experiment}-{data}".into();
    /// config.data.path = "corpora/wiki.txt".into();
    /// assert_eq!(config.run_dir_template(), "runs/{time}-shakespeare_char-wiki");
    /// ```
    pub fn run_dir_template(&self) -> String {
        self.run
            .dir
            .replace("{experiment}", &self.experiment)
            .replace("{data}", &self.data_name())
    }

    /// The data's name in `run.dir`'s `{data}`: `data.path`'s last part
    /// without its extension ("data" where it has none).
    pub fn data_name(&self) -> String {
        let path = std::path::Path::new(&self.data.path);
        path.file_stem()
            .map_or_else(|| "data".into(), |n| n.to_string_lossy().into_owned())
    }

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
        // A `{...}` in run.dir that is none of the placeholders is a typo.
        let mut rest = self.run.dir.as_str();
        while let Some(open) = rest.find('{') {
            let close = rest[open..].find('}').map(|c| open + c + 1);
            let token = &rest[open..close.unwrap_or(rest.len())];
            check(
                RUN_DIR_PLACEHOLDERS.contains(&token),
                "run.dir",
                &format!(
                    "`{token}` is not a placeholder kiln fills in: use {}",
                    RUN_DIR_PLACEHOLDERS.join(", ")
                ),
            );
            rest = &rest[close.unwrap_or(rest.len())..];
        }
        let m = &self.model;
        check(m.layers >= 1, "model.layers", "must be at least 1");
        check(m.heads >= 1, "model.heads", "must be at least 1");
        check(
            m.heads >= 1 && m.hidden >= 1 && m.hidden.is_multiple_of(m.heads),
            "model.hidden",
            &format!(
                "must be a multiple of model.heads ({}), at least 1",
                m.heads
            ),
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
        check(
            (0.0..1.0).contains(&m.attention_dropout),
            "model.attention_dropout",
            "must be in [0, 1)",
        );
        check(m.max_length >= 2, "model.max_length", "must be at least 2");
        check(
            (1..=4096).contains(&m.vocab_multiple),
            "model.vocab_multiple",
            "must be between 1 (no padding) and 4096",
        );
        check(
            m.segments <= 2,
            "model.segments",
            "must be 2 (BERT's premise and hypothesis rows), 1 (RoBERTa's one row) or 0 (none, DistilBERT's)",
        );
        check(
            m.layer_norm_eps > 0.0 && m.layer_norm_eps < 1.0,
            "model.layer_norm_eps",
            "must be in (0, 1): PyTorch's 1e-5, BERT's 1e-12",
        );
        check(
            m.init_from.as_deref().is_none_or(|p| !p.trim().is_empty()),
            "model.init_from",
            "must be a folder (a transformers GPT-2 or BERT folder: config.json and model.safetensors), or \"none\"",
        );
        let named = &m.init_labels;
        check(
            named.is_empty() || m.init_from.is_some(),
            "model.init_labels",
            "names the classifier outputs of model.init_from's BERT, RoBERTa, ELECTRA or DistilBERT folder: set model.init_from, or leave it []",
        );
        check(
            named.is_empty() || label_order(named, &self.data.labels).is_some(),
            "model.init_labels",
            &format!(
                "must name each of data.labels ([{}]) once, in the order of the folder's classifier outputs",
                self.data.labels.join(", ")
            ),
        );
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
        check(
            self.optimization.zero_stage <= 2,
            "optimization.zero_stage",
            "must be 0 (every rank keeps all of AdamW's moments), 1 (each keeps its share: ZeRO-1) or 2 (its share of the gradients too: ZeRO-2); stage 3 (the weights sharded too, FSDP) is not built",
        );
        let d = &self.data;
        check(!d.path.trim().is_empty(), "data.path", "must not be empty");
        check(
            d.val_fraction > 0.0 && d.val_fraction < 1.0,
            "data.val_fraction",
            "must be between 0 and 1 (exclusive)",
        );
        check(
            matches!(d.tokenizer, TokenizerKind::Char | TokenizerKind::Gpt2) || d.vocab_size >= 16,
            "data.vocab_size",
            "must be at least 16 for a trained tokenizer",
        );
        check(
            matches!(d.tokenizer, TokenizerKind::Char | TokenizerKind::Gpt2)
                || d.vocab_size <= MAX_TRAINED_VOCAB,
            "data.vocab_size",
            "must be at most 4194304 for a trained tokenizer (the largest in use hold about 256,000 ids; the trainer reserves memory for every one asked)",
        );
        let distinct: std::collections::BTreeSet<&String> = d.labels.iter().collect();
        check(
            self.workload == Workload::Lm
                || (d.labels.len() >= 2 && distinct.len() == d.labels.len()),
            "data.labels",
            "must name 2 labels or more, each once: the classes the sentence-pair classifier tells apart",
        );
        check(
            d.tokenizer != TokenizerKind::Bpe || d.vocab_size >= 256,
            "data.vocab_size",
            "must be at least 256 for data.tokenizer = \"bpe\": byte-level BPE starts from the 256 bytes, which the vocabulary counts",
        );
        check(
            !d.text_field.trim().is_empty(),
            "data.text_field",
            "must not be empty",
        );
        check(
            d.tokenizer_sample_bytes >= 1024,
            "data.tokenizer_sample_bytes",
            "must be at least 1024",
        );
        check(
            d.shard_tokens >= 1 && d.shard_tokens < 1 << 31,
            "data.shard_tokens",
            "must be between 1 and 2^31 - 1 (llm.c's int32 token count)",
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
        check(
            (0.0..1.0).contains(&t.warmup_ratio),
            "training.warmup_ratio",
            "must be in [0, 1): the share of the run's steps that warm up (0: training.warmup_steps decides)",
        );
        check(
            t.decay_fraction > 0.0 && t.decay_fraction <= 1.0,
            "training.decay_fraction",
            "must be in (0, 1]: the share of the steps after the warm-up that lr_schedule = \"wsd\" decays over (1 is \"linear\")",
        );
        check(
            t.layer_lr_decay > 0.0 && t.layer_lr_decay <= 1.0,
            "training.layer_lr_decay",
            "must be in (0, 1]: 1 trains every layer at one rate; ELECTRA fine-tunes with 0.8 (base) and 0.9 (large)",
        );
        check(
            t.layer_lr_decay == 1.0 || self.workload == Workload::Nli,
            "training.layer_lr_decay",
            "is the sentence-pair encoder's (workload = \"nli\"): a language model ties its output layer to its embedding, so there is no classifier to keep at the full rate; leave it 1",
        );
        check(
            (0.0..1.0).contains(&t.label_smoothing),
            "training.label_smoothing",
            "must be in [0, 1): 0 is off, 0.1 the usual value",
        );
        let e = &self.eval;
        check(e.eval_steps >= 1, "eval.eval_steps", "must be at least 1");
        check(e.eval_iters >= 1, "eval.eval_iters", "must be at least 1");
        check(e.batch_size >= 1, "eval.batch_size", "must be at least 1");
        check(
            e.patience == 0 || self.workload == Workload::Lm,
            "eval.patience",
            "is the language model's: a cross-validation fold stops early by cv.patience; leave it 0",
        );
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
            (1..=1024).contains(&self.loader.prefetch_factor),
            "loader.prefetch_factor",
            "must be between 1 and 1024 (batches queued ahead per worker, each held in memory)",
        );
        check(
            self.loader.num_workers <= 1024,
            "loader.num_workers",
            "must be at most 1024 (threads; a few per core at most make batches faster)",
        );
        check(self.cv.folds >= 2, "cv.folds", "must be at least 2");
        check(
            self.sample.count <= MAX_SAMPLE_COUNT,
            "sample.count",
            "must be at most 10000 (texts drawn at the end of a run, held in memory until written)",
        );
        check(
            self.sample.tokens <= MAX_SAMPLE_TOKENS,
            "sample.tokens",
            "must be at most 1000000 (tokens a text; past the block each one is a forward pass over a whole block)",
        );
        check(
            self.sample.temperature >= 0.0,
            "sample.temperature",
            "must be 0 (greedy) or more",
        );
        check(
            self.sample.top_p > 0.0 && self.sample.top_p <= 1.0,
            "sample.top_p",
            "must be above 0 and at most 1 (1: no nucleus)",
        );
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

    /// The keys this configuration sets but a run of it does not read, each
    /// with the key that makes it so: `training.warmup_steps` beside a
    /// `training.warmup_ratio`, `training.epochs` beside a `max_steps`,
    /// the other workload's sections. `kiln config --explain` marks them.
    ///
    /// ```
    /// let mut config = kiln_config::RunConfig::default();
    /// config.training.warmup_ratio = 0.1;
    /// let unused = config.unused_keys();
    /// assert!(unused.iter().any(|(key, _)| *key == "training.warmup_steps"));
    /// ```
    pub fn unused_keys(&self) -> Vec<(&'static str, String)> {
        let mut out: Vec<(&'static str, String)> = Vec::new();
        let mut unused = |keys: &[&'static str], why: String| {
            out.extend(keys.iter().map(|key| (*key, why.clone())));
        };
        let t = &self.training;
        if t.warmup_ratio > 0.0 {
            unused(
                &["training.warmup_steps"],
                format!("training.warmup_ratio {} sets the warm-up", t.warmup_ratio),
            );
        }
        if t.max_steps > 0 {
            unused(
                &["training.epochs"],
                format!("training.max_steps {} sets the run's length", t.max_steps),
            );
        }
        match t.lr_schedule {
            LrSchedule::Constant => unused(
                &["training.min_lr", "training.decay_fraction"],
                "training.lr_schedule \"constant\" holds learning_rate".into(),
            ),
            LrSchedule::Wsd => {}
            LrSchedule::Cosine | LrSchedule::Linear => unused(
                &["training.decay_fraction"],
                "only training.lr_schedule \"wsd\" reads it".into(),
            ),
        }
        let d = &self.data;
        let lm = self.workload == Workload::Lm;
        if d.tokenizer_file.is_some() {
            unused(
                &["data.vocab_size"],
                "data.tokenizer_file is loaded, not trained".into(),
            );
        } else if lm && matches!(d.tokenizer, TokenizerKind::Char | TokenizerKind::Gpt2) {
            unused(
                &["data.vocab_size"],
                format!(
                    "data.tokenizer \"{}\" has no size to choose",
                    match d.tokenizer {
                        TokenizerKind::Char => "char",
                        _ => "gpt2",
                    }
                ),
            );
        } else if !lm && self.model.init_from.is_some() {
            unused(
                &["data.vocab_size"],
                "model.init_from's tokenizer is used".into(),
            );
        }
        if !lm && d.tokenizer != TokenizerKind::Wordpiece {
            unused(
                &["data.tokenizer"],
                "the sentence-pair encoder trains a WordPiece (or loads model.init_from's or data.tokenizer_file)".into(),
            );
        }
        if !self.precision.amp {
            unused(
                &[
                    "precision.amp_dtype",
                    "precision.loss_scale_init",
                    "precision.loss_scale_growth_interval",
                ],
                "precision.amp is off".into(),
            );
        }
        if lm {
            unused(
                &["cv.folds", "cv.patience"],
                "a language model is not cross-validated (workload = \"lm\")".into(),
            );
        } else {
            unused(
                &[
                    "sample.count",
                    "sample.tokens",
                    "sample.temperature",
                    "sample.top_k",
                    "sample.top_p",
                ],
                "only a language model samples text (workload = \"nli\")".into(),
            );
        }
        out
    }
}

/// `Option` keys in TOML, which has no null: `None` is written `"none"`.
/// Reading also takes the spellings of kiln 0.1's saved runs, `0` and `""`,
/// as none, so that their configurations resume.
mod none {
    use std::fmt;

    use serde::de::{self, Deserializer, Unexpected, Visitor};
    use serde::ser::Serializer;

    /// The word for none.
    const NONE: &str = "none";

    /// `Option<usize>`: a positive count, or `"none"`.
    pub(super) mod count {
        use super::*;

        pub(crate) fn serialize<S: Serializer>(v: &Option<usize>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(n) => s.serialize_u64(*n as u64),
                None => s.serialize_str(NONE),
            }
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<usize>, D::Error> {
            struct CountOrNone;
            impl Visitor<'_> for CountOrNone {
                type Value = Option<usize>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a positive whole number, or \"none\"")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                    match v {
                        0 => Ok(None),
                        n => usize::try_from(n)
                            .map(Some)
                            .map_err(|_| E::invalid_value(Unexpected::Unsigned(n), &self)),
                    }
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                    match u64::try_from(v) {
                        Ok(n) => self.visit_u64(n),
                        Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
                    }
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                    if v == NONE {
                        Ok(None)
                    } else {
                        Err(E::invalid_value(Unexpected::Str(v), &self))
                    }
                }
            }
            d.deserialize_any(CountOrNone)
        }
    }

    /// `Option<String>`: a text, or `"none"`.
    pub(super) mod text {
        use super::*;

        pub(crate) fn serialize<S: Serializer>(
            v: &Option<String>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            s.serialize_str(v.as_deref().unwrap_or(NONE))
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<String>, D::Error> {
            struct TextOrNone;
            impl Visitor<'_> for TextOrNone {
                type Value = Option<String>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a path, or \"none\"")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                    Ok((!v.is_empty() && v != NONE).then(|| v.to_string()))
                }
            }
            d.deserialize_any(TextOrNone)
        }
    }
}
