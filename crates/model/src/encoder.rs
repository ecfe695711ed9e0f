//! A BERT-style encoder classifier for sentence pairs: token, position and
//! segment embeddings, post-LayerNorm blocks with padding-masked
//! self-attention and a GELU MLP, [CLS], BERT's pooler or mean pooling,
//! dropout and a linear head: with the pooler and LayerNorm's ε at 1e-12,
//! `transformers`' `BertForSequenceClassification`, tensor for tensor.

use burn::module::Module;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    Linear, LinearConfig,
};
use burn::tensor::{Bool, Device, Int, Tensor, activation};

use crate::GeluKind;
use crate::kernels::{self, AttentionKernel, Kernels, LAYER_NORM_EPSILON};
use crate::precision::{self, ComputeDtype};

/// How the sequence becomes one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingKind {
    /// The first token's ([CLS]) output.
    Cls,
    /// BERT's pooler: a dense layer and tanh on the [CLS] token's output
    /// (what `BertForSequenceClassification` classifies).
    Pooler,
    /// The mean over non-padding tokens.
    Mean,
}

/// The pooler's activation ([`PoolingKind::Pooler`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolerActivation {
    /// BERT's (`BertPooler`, RoBERTa's classification head).
    Tanh,
    /// ELECTRA's classification head: the exact GELU.
    Gelu,
    /// DistilBERT's `pre_classifier`.
    Relu,
}

/// The shape of an encoder classifier: [`EncoderConfig::new`], then
/// `with_*` for the rest.
///
/// ```
/// use kiln_model::{EncoderConfig, PoolingKind};
/// let config = EncoderConfig::new(8000, 128, 4, 4, 256, 3).with_pooling(PoolingKind::Mean);
/// assert_eq!(config.intermediate, 1024);
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct EncoderConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The longest input (position embeddings).
    pub max_positions: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block; `hidden` is a multiple of it.
    pub heads: usize,
    /// The model's width.
    pub hidden: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
    /// Dropout on the embeddings, the residual branches and before the
    /// head, in training (BERT's `hidden_dropout_prob`).
    pub dropout: f64,
    /// Dropout on the attention probabilities, in training (BERT's
    /// `attention_probs_dropout_prob`).
    pub attention_dropout: f64,
    /// Output classes.
    pub classes: usize,
    /// The embeddings' width where it is not `hidden` (ELECTRA-small's 128
    /// under 256): a linear layer projects them to `hidden` after their
    /// LayerNorm. `None`: as wide as the model.
    pub embedding: Option<usize>,
    /// Rows of the segment embedding: 2 (BERT's: the premise's and the
    /// hypothesis's), 1 (RoBERTa's: one row added to every token) or 0
    /// (DistilBERT's: none).
    pub segments: usize,
    /// How the sequence becomes one vector for the head.
    pub pooling: PoolingKind,
    /// The pooler's activation (with [`PoolingKind::Pooler`]).
    pub pooler_activation: PoolerActivation,
    /// The MLP's GELU.
    pub gelu: GeluKind,
    /// Every LayerNorm's ε ([`LAYER_NORM_EPSILON`] unless set; BERT's is
    /// 1e-12).
    pub layer_norm_eps: f64,
}

impl EncoderConfig {
    /// An encoder of `layers` blocks of `heads` heads, `hidden` wide, for
    /// `classes` classes, with BERT's MLP of `4·hidden`, no dropout, [CLS]
    /// pooling and the exact GELU.
    pub fn new(
        vocab_size: usize,
        max_positions: usize,
        layers: usize,
        heads: usize,
        hidden: usize,
        classes: usize,
    ) -> Self {
        Self {
            vocab_size,
            max_positions,
            layers,
            heads,
            hidden,
            intermediate: 4 * hidden,
            dropout: 0.0,
            attention_dropout: 0.0,
            classes,
            embedding: None,
            segments: 2,
            pooling: PoolingKind::Cls,
            pooler_activation: PoolerActivation::Tanh,
            gelu: GeluKind::Exact,
            layer_norm_eps: LAYER_NORM_EPSILON,
        }
    }

    with_setters! {
        /// The MLP's inner width.
        with_intermediate: intermediate: usize;
        /// Dropout in training (0 for none).
        with_dropout: dropout: f64;
        /// Dropout on the attention probabilities in training (0 for none).
        with_attention_dropout: attention_dropout: f64;
        /// The embeddings' width, where it is not the model's.
        with_embedding: embedding: Option<usize>;
        /// Rows of the segment embedding (0, 1 or 2).
        with_segments: segments: usize;
        /// How the sequence becomes one vector.
        with_pooling: pooling: PoolingKind;
        /// The pooler's activation.
        with_pooler_activation: pooler_activation: PoolerActivation;
        /// The MLP's GELU.
        with_gelu: gelu: GeluKind;
        /// Every LayerNorm's ε.
        with_layer_norm_eps: layer_norm_eps: f64;
    }

    /// Parameters in the transformer blocks (no embeddings, no head).
    pub fn block_params(&self) -> usize {
        let (d, f) = (self.hidden, self.intermediate);
        self.layers * (d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d + 4 * d)
    }

    /// Parameters of the classification head: the linear layer, and BERT's
    /// pooler where there is one (both train with a frozen encoder).
    pub fn head_params(&self) -> usize {
        let pooler = if self.pooling == PoolingKind::Pooler {
            self.hidden * self.hidden + self.hidden
        } else {
            0
        };
        pooler + self.hidden * self.classes + self.classes
    }

    /// All parameters.
    pub fn num_params(&self) -> usize {
        let e = self.embedding_width();
        let projection = if e == self.hidden {
            0
        } else {
            e * self.hidden + self.hidden
        };
        (self.vocab_size + self.max_positions + self.segments) * e
            + 2 * e
            + projection
            + self.block_params()
            + self.head_params()
    }

    /// Model FLOPs of one training step on one sequence of `len` tokens:
    /// `6·N·T` for the blocks (embeddings are lookups) plus attention's
    /// `12·L·T²·d` (PEERS.md's count: 2.63 GFLOP at T = 128 for its shape).
    /// With a frozen encoder only the forward pass runs through the blocks
    /// (a third of that) and the head trains.
    pub fn flops_per_sequence(&self, len: usize, frozen_encoder: bool) -> f64 {
        let t = len as f64;
        let blocks = 6.0 * self.block_params() as f64 * t
            + 12.0 * self.layers as f64 * t * t * self.hidden as f64;
        let head = 6.0 * self.head_params() as f64;
        if frozen_encoder {
            blocks / 3.0 + head
        } else {
            blocks + head
        }
    }

    /// Builds the model on `device`: embeddings and linear layers drawn
    /// from N(0, 0.02), BERT's scale; LayerNorms start at one and zero.
    pub fn init(&self, device: &Device) -> EncoderClassifier {
        self.build(device, true)
    }

    /// The model with every weight zero, for weights about to be loaded
    /// into it: nothing is drawn (quicker than [`EncoderConfig::init`], and
    /// the device's random generator is left as it was).
    pub fn init_unset(&self, device: &Device) -> EncoderClassifier {
        self.build(device, false)
    }

    /// The embeddings' width: [`EncoderConfig::embedding`], else `hidden`.
    pub fn embedding_width(&self) -> usize {
        self.embedding.unwrap_or(self.hidden)
    }

    fn build(&self, device: &Device, draw: bool) -> EncoderClassifier {
        let width = self.embedding_width();
        let normal = if draw {
            Initializer::Normal {
                mean: 0.0,
                std: 0.02,
            }
        } else {
            Initializer::Zeros
        };
        let linear = |i: usize, o: usize| {
            LinearConfig::new(i, o)
                .with_initializer(normal.clone())
                .init(device)
        };
        let layer_norm_of = |d: usize| {
            LayerNormConfig::new(d)
                .with_epsilon(self.layer_norm_eps)
                .init(device)
        };
        let layer_norm = || layer_norm_of(self.hidden);
        let embedding = |n: usize| {
            EmbeddingConfig::new(n, width)
                .with_initializer(normal.clone())
                .init(device)
        };
        EncoderClassifier {
            tokens: embedding(self.vocab_size),
            positions: embedding(self.max_positions),
            segments: (self.segments > 0).then(|| embedding(self.segments)),
            ln_embed: layer_norm_of(width),
            embed_proj: (width != self.hidden).then(|| linear(width, self.hidden)),
            blocks: (0..self.layers)
                .map(|_| EncoderBlock {
                    qkv: linear(self.hidden, 3 * self.hidden),
                    attn_out: linear(self.hidden, self.hidden),
                    ln1: layer_norm(),
                    fc: linear(self.hidden, self.intermediate),
                    fc_out: linear(self.intermediate, self.hidden),
                    ln2: layer_norm(),
                    dropout: DropoutConfig::new(self.dropout).init(),
                    attention_dropout: self.attention_dropout,
                    heads: self.heads,
                    tanh_gelu: self.gelu == GeluKind::Tanh,
                    ln_eps: self.layer_norm_eps,
                })
                .collect(),
            dropout: DropoutConfig::new(self.dropout).init(),
            pooler: (self.pooling == PoolingKind::Pooler).then(|| linear(self.hidden, self.hidden)),
            head: linear(self.hidden, self.classes),
            mean_pooling: self.pooling == PoolingKind::Mean,
            pooler_activation: self.pooler_activation,
            ln_eps: self.layer_norm_eps,
            compute: ComputeDtype::F32,
            kernels: Kernels::Fused,
            attention: AttentionKernel::Auto,
        }
    }
}

/// The encoder classifier.
#[derive(Module, Debug)]
pub struct EncoderClassifier {
    tokens: Embedding,
    positions: Embedding,
    segments: Option<Embedding>,
    ln_embed: LayerNorm,
    embed_proj: Option<Linear>,
    blocks: Vec<EncoderBlock>,
    dropout: Dropout,
    pooler: Option<Linear>,
    head: Linear,
    #[module(skip)]
    mean_pooling: bool,
    #[module(skip)]
    pooler_activation: PoolerActivation,
    #[module(skip)]
    ln_eps: f64,
    #[module(skip)]
    compute: ComputeDtype,
    #[module(skip)]
    kernels: Kernels,
    #[module(skip)]
    attention: AttentionKernel,
}

#[derive(Module, Debug)]
struct EncoderBlock {
    qkv: Linear,
    attn_out: Linear,
    ln1: LayerNorm,
    fc: Linear,
    fc_out: Linear,
    ln2: LayerNorm,
    dropout: Dropout,
    /// Dropout on the attention probabilities, while `dropout` trains (not
    /// a module of its own: the records of runs saved before it stay
    /// loadable).
    #[module(skip)]
    attention_dropout: f64,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    tanh_gelu: bool,
    #[module(skip)]
    ln_eps: f64,
}

impl EncoderBlock {
    /// `pad` is `[b, t]`, true where a key is padding; products in `c`, hot
    /// spots run by `k`, self-attention by `a`.
    fn forward(
        &self,
        x: Tensor<3>,
        pad: Tensor<2, Bool>,
        c: ComputeDtype,
        k: Kernels,
        a: AttentionKernel,
    ) -> Tensor<3> {
        let y = precision::attention(
            &self.qkv,
            &self.attn_out,
            x.clone(),
            self.heads,
            Some(pad),
            false,
            c,
            k,
            a,
            precision::while_training(&self.dropout, self.attention_dropout),
        );
        let x = kernels::layer_norm_with(
            &self.ln1,
            x + kernels::dropout(&self.dropout, y, k),
            self.ln_eps,
            k,
        );
        let hidden = precision::mlp_hidden(&self.fc, x.clone(), self.tanh_gelu, c, k);
        kernels::layer_norm_with(
            &self.ln2,
            x + kernels::dropout(
                &self.dropout,
                precision::linear(&self.fc_out, hidden, c, k),
                k,
            ),
            self.ln_eps,
            k,
        )
    }
}

impl EncoderClassifier {
    /// Class logits `[b, classes]` for token ids, segment ids and the mask
    /// (true on real tokens), each `[b, t]`.
    pub fn forward(
        &self,
        ids: Tensor<2, Int>,
        segments: Tensor<2, Int>,
        mask: Tensor<2, Bool>,
    ) -> Tensor<2> {
        let [b, t] = ids.dims();
        let x = kernels::token_embeddings(&self.tokens, ids, self.kernels)
            + kernels::position_embeddings(&self.positions, b, 0, t, self.kernels);
        let x = match &self.segments {
            // One row (RoBERTa's): every token's, whatever its segment.
            Some(rows) if rows.weight.dims()[0] == 1 => {
                let [_, d] = rows.weight.dims();
                x + rows.weight.val().reshape([1, 1, d])
            }
            Some(rows) => x + rows.forward(segments),
            None => x,
        };
        let x = kernels::layer_norm_with(&self.ln_embed, x, self.ln_eps, self.kernels);
        let mut x = kernels::dropout(&self.dropout, x, self.kernels);
        if let Some(projection) = &self.embed_proj {
            x = precision::linear(projection, x, self.compute, self.kernels);
        }
        let pad = mask.clone().bool_not();
        for block in &self.blocks {
            x = block.forward(x, pad.clone(), self.compute, self.kernels, self.attention);
        }
        let [_, _, d] = x.dims();
        let pooled = if self.mean_pooling {
            let keep = mask.float().reshape([b, t, 1]);
            let count = keep.clone().sum_dim(1).reshape([b, 1]).clamp_min(1.0);
            (x * keep).sum_dim(1).reshape([b, d]) / count
        } else {
            let cls = x.narrow(1, 0, 1).reshape([b, d]);
            match &self.pooler {
                Some(pooler) => {
                    let dense = precision::linear(pooler, cls, self.compute, self.kernels);
                    match self.pooler_activation {
                        PoolerActivation::Tanh => dense.tanh(),
                        PoolerActivation::Gelu => activation::gelu(dense),
                        PoolerActivation::Relu => activation::relu(dense),
                    }
                }
                None => cls,
            }
        };
        precision::linear(
            &self.head,
            kernels::dropout(&self.dropout, pooled, self.kernels),
            self.compute,
            self.kernels,
        )
    }

    /// The same model computing its products in `compute` (parameters stay
    /// f32; see [`crate::precision`]).
    pub fn with_compute(self, compute: ComputeDtype) -> Self {
        Self { compute, ..self }
    }

    /// The dtype the products compute in.
    pub fn compute(&self) -> ComputeDtype {
        self.compute
    }

    /// The same model running its element-wise hot spots with `kernels`
    /// (see [`crate::kernels`]).
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Self { kernels, ..self }
    }

    /// The kernels the model runs.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The same model running its self-attention with `attention` (with
    /// `Kernels::Reference`, Burn's composition whatever this says).
    pub fn with_attention(self, attention: AttentionKernel) -> Self {
        Self { attention, ..self }
    }

    /// Mean cross-entropy of the logits against `labels [b]`.
    pub fn loss(
        &self,
        ids: Tensor<2, Int>,
        segments: Tensor<2, Int>,
        mask: Tensor<2, Bool>,
        labels: Tensor<1, Int>,
    ) -> Tensor<1> {
        self.smoothed_loss(ids, segments, mask, labels, 0.0)
    }

    /// [`EncoderClassifier::loss`] with label smoothing `epsilon`
    /// ([`EncoderClassifier::smoothed_cross_entropy`]).
    pub fn smoothed_loss(
        &self,
        ids: Tensor<2, Int>,
        segments: Tensor<2, Int>,
        mask: Tensor<2, Bool>,
        labels: Tensor<1, Int>,
        epsilon: f64,
    ) -> Tensor<1> {
        Self::smoothed_cross_entropy(self.forward(ids, segments, mask), labels, epsilon)
    }

    /// Mean cross-entropy of `logits [b, classes]` against `labels [b]`
    /// (what [`EncoderClassifier::loss`] computes of its logits).
    pub fn cross_entropy(logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
        Self::smoothed_cross_entropy(logits, labels, 0.0)
    }

    /// [`EncoderClassifier::cross_entropy`] with label smoothing `epsilon`,
    /// as PyTorch's `CrossEntropyLoss(label_smoothing=ε)`: against the
    /// target `1 − ε` on the label plus `ε / classes` on every class, that
    /// is `(1 − ε) · nll + ε · mean over classes of −log p`.
    pub fn smoothed_cross_entropy(
        logits: Tensor<2>,
        labels: Tensor<1, Int>,
        epsilon: f64,
    ) -> Tensor<1> {
        let classes = logits.dims()[1];
        crate::gpt::smoothed_rows(logits, labels, classes, epsilon)
    }

    /// Where the parameter at `path` (a path of this module's, as Burn's
    /// visitor names it: `blocks.3.qkv.weight`) sits for layer-wise
    /// learning-rate decay in a model of `layers` blocks: 0 for the
    /// embeddings (tokens, positions, segments, their LayerNorm and
    /// projection), `i + 1` for block `i`, `layers + 1` for the pooler and
    /// the classifier. A parameter at depth `d` trains at
    /// `decay^(layers + 1 − d)` times the schedule's rate (BEiT's count).
    pub fn depth_of(path: &str, layers: usize) -> usize {
        let mut parts = path.split('.');
        match parts.next() {
            Some("tokens" | "positions" | "segments" | "ln_embed" | "embed_proj") => 0,
            Some("blocks") => parts
                .next()
                .and_then(|i| i.parse::<usize>().ok())
                .map_or(layers + 1, |i| (i + 1).min(layers)),
            _ => layers + 1,
        }
    }

    /// Stops gradients through everything but the head (`model.freeze_encoder`).
    pub fn freeze_encoder(mut self) -> Self {
        self.tokens = self.tokens.no_grad();
        self.positions = self.positions.no_grad();
        self.segments = self.segments.map(Module::no_grad);
        self.ln_embed = self.ln_embed.no_grad();
        self.embed_proj = self.embed_proj.map(Module::no_grad);
        self.blocks = self.blocks.into_iter().map(Module::no_grad).collect();
        self
    }
}

// (The tests run on flex, the CPU backend of the default features.)
#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    /// Probabilities (¼, ¼, ½) and the label 2: the loss is ln 2; the mean
    /// of −log p over the classes is (ln 4 + ln 4 + ln 2) / 3 = 5/3 ln 2;
    /// with ε = 0.3, 0.7 ln 2 + 0.3 · 5/3 ln 2 = 1.2 ln 2.
    #[test]
    fn label_smoothing_mixes_the_loss_with_the_uniform_targets() {
        let device = Device::flex();
        let logits = || {
            Tensor::<2>::from_data(
                TensorData::new(vec![0.0f32, 0.0, std::f32::consts::LN_2], [1, 3]),
                &device,
            )
        };
        let labels = || Tensor::<1, Int>::from_data(TensorData::new(vec![2i64], [1]), &device);
        let loss = |eps: f64| -> f32 {
            EncoderClassifier::smoothed_cross_entropy(logits(), labels(), eps).into_scalar()
        };
        let ln2 = std::f32::consts::LN_2;
        assert!((loss(0.0) - ln2).abs() < 1e-6, "{}", loss(0.0));
        assert!((loss(0.3) - 1.2 * ln2).abs() < 1e-6, "{}", loss(0.3));
        let plain: f32 = EncoderClassifier::cross_entropy(logits(), labels()).into_scalar();
        assert_eq!(plain, loss(0.0));
    }

    fn peers_shape() -> EncoderConfig {
        // ../shared/PEERS.md: 4 layers, hidden 256, 4 heads, intermediate 1024,
        // max length 128, vocabulary 8000, 3 classes; 5.3 M parameters,
        // 2.63 GFLOP per padded sample.
        EncoderConfig {
            vocab_size: 8000,
            max_positions: 128,
            layers: 4,
            heads: 4,
            hidden: 256,
            intermediate: 1024,
            dropout: 0.0,
            attention_dropout: 0.0,
            classes: 3,
            embedding: None,
            segments: 2,
            pooling: PoolingKind::Cls,
            pooler_activation: PoolerActivation::Tanh,
            gelu: GeluKind::Exact,
            layer_norm_eps: LAYER_NORM_EPSILON,
        }
    }

    #[test]
    fn counts_match_peers_md() {
        let c = peers_shape();
        // 5.24 M: PEERS.md's 5.3 M includes BERT's pooler (a 256 × 256 dense
        // layer before the head), which this model does without.
        assert!(
            (c.num_params() as f64 / 1e6 - 5.3).abs() < 0.1,
            "{}",
            c.num_params()
        );
        let gflop = c.flops_per_sequence(128, false) / 1e9;
        assert!((gflop - 2.63).abs() < 0.02, "{gflop}");
        assert!(c.flops_per_sequence(128, true) < c.flops_per_sequence(128, false) / 2.0);
        assert_eq!(c.init(&Device::flex()).num_params(), c.num_params());
    }

    fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>, Tensor<2, Bool>) {
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(vec![2i64, 7, 3, 9, 3, 0, 2, 5, 3, 0, 0, 0], [2, 6]),
            device,
        );
        let seg = Tensor::<2, Int>::from_data(
            TensorData::new(vec![0i64, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], [2, 6]),
            device,
        );
        let mask = Tensor::<2, Bool>::from_data(
            TensorData::new(
                vec![
                    true, true, true, true, true, false, true, true, true, false, false, false,
                ],
                [2, 6],
            ),
            device,
        );
        (ids, seg, mask)
    }

    /// A two-layer encoder small enough for exact checks.
    fn small() -> EncoderConfig {
        EncoderConfig {
            vocab_size: 20,
            max_positions: 16,
            layers: 2,
            heads: 2,
            hidden: 16,
            intermediate: 32,
            ..peers_shape()
        }
    }

    /// `m`'s logits for ids, segments and mask, flat.
    fn logits_of(
        m: &EncoderClassifier,
        (ids, seg, mask): (Tensor<2, Int>, Tensor<2, Int>, Tensor<2, Bool>),
    ) -> Vec<f32> {
        m.forward(ids, seg, mask)
            .into_data()
            .iter::<f32>()
            .collect()
    }

    #[test]
    fn padding_does_not_change_the_output() {
        let c = EncoderConfig {
            pooling: PoolingKind::Mean,
            ..small()
        };
        let device = Device::flex();
        device.seed(4);
        let model = c.init(&device);
        let (ids, seg, mask) = batch(&device);
        let padded: Vec<f32> = model
            .forward(ids.clone(), seg.clone(), mask.clone())
            .into_data()
            .iter::<f32>()
            .collect();
        // The second sequence alone, without its padding.
        let ids2 = ids.narrow(0, 1, 1).narrow(1, 0, 3);
        let seg2 = seg.narrow(0, 1, 1).narrow(1, 0, 3);
        let mask2 = mask.narrow(0, 1, 1).narrow(1, 0, 3);
        let alone: Vec<f32> = model
            .forward(ids2, seg2, mask2)
            .into_data()
            .iter::<f32>()
            .collect();
        for (a, b) in padded[3..].iter().zip(&alone) {
            assert!((a - b).abs() < 1e-5, "{padded:?} vs {alone:?}");
        }
    }

    #[test]
    fn the_pooler_applies_its_activation() {
        let device = Device::flex();
        let c = EncoderConfig {
            pooling: PoolingKind::Pooler,
            pooler_activation: PoolerActivation::Gelu,
            ..small()
        };
        assert_eq!(
            c.init_unset(&device).pooler_activation,
            PoolerActivation::Gelu
        );
        device.seed(6);
        let tanh = EncoderConfig {
            pooler_activation: PoolerActivation::Tanh,
            ..c
        }
        .init(&device);
        // The same weights: the activation is no parameter.
        let with = |pooler_activation| EncoderClassifier {
            pooler_activation,
            ..tanh.clone()
        };
        let logits = |m: &EncoderClassifier| logits_of(m, batch(&device));
        let (gelu, relu) = (with(PoolerActivation::Gelu), with(PoolerActivation::Relu));
        assert_ne!(logits(&tanh), logits(&gelu));
        assert_ne!(logits(&gelu), logits(&relu));
        assert_ne!(logits(&tanh), logits(&relu));
    }

    #[test]
    fn one_segment_row_ignores_the_segment_ids_and_none_has_no_parameter() {
        let device = Device::flex();
        let (ids, seg, mask) = batch(&device);
        for segments in [0, 1] {
            let c = EncoderConfig {
                segments,
                ..small()
            };
            let model = c.init(&device);
            assert_eq!(model.num_params(), c.num_params(), "{segments} rows");
            let run = |seg: Tensor<2, Int>| logits_of(&model, (ids.clone(), seg, mask.clone()));
            assert_eq!(
                run(seg.clone()),
                run(seg.clone().zeros_like()),
                "{segments} rows"
            );
        }
        // Narrower embeddings, projected: counted as built.
        let narrow = EncoderConfig {
            embedding: Some(8),
            ..small()
        };
        let model = narrow.init(&device);
        assert_eq!(model.num_params(), narrow.num_params());
        assert_eq!(logits_of(&model, batch(&device)).len(), 6);
        // Two rows: the hypothesis's is its own.
        let model = small().init(&device);
        let run = |seg: Tensor<2, Int>| logits_of(&model, (ids.clone(), seg, mask.clone()));
        assert_ne!(run(seg.clone()), run(seg.clone().zeros_like()));
    }

    #[test]
    fn reduced_compute_follows_the_f32_logits() {
        let c = small();
        let device = Device::flex();
        device.seed(8);
        let model = c.init(&device);
        let logits = |m: &EncoderClassifier| logits_of(m, batch(&device));
        let reference = logits(&model);
        for dtype in [ComputeDtype::Bf16, ComputeDtype::F16] {
            let low = logits(&model.clone().with_compute(dtype));
            assert_ne!(low, reference, "{dtype:?} must round somewhere");
            for (a, b) in low.iter().zip(&reference) {
                // Post-LayerNorm blocks keep activations near unit scale;
                // bf16 rounds at 2^-8 of that.
                assert!((a - b).abs() < 0.05, "{dtype:?}: {low:?} vs {reference:?}");
            }
        }
    }

    #[test]
    fn a_frozen_encoder_trains_only_the_head() {
        let c = EncoderConfig {
            vocab_size: 20,
            max_positions: 16,
            layers: 1,
            heads: 2,
            hidden: 8,
            intermediate: 16,
            ..peers_shape()
        };
        let device = Device::flex().autodiff();
        let model = c.init(&device).freeze_encoder();
        let (ids, seg, mask) = batch(&device);
        let labels = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64, 2], [2]), &device);
        let grads = model.loss(ids, seg, mask, labels).backward();
        assert!(model.head.weight.val().grad(&grads).is_some());
        assert!(model.tokens.weight.val().grad(&grads).is_none());
        assert!(model.blocks[0].qkv.weight.val().grad(&grads).is_none());
    }
}
