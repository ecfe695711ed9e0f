//! `model.init_from` for the sentence-pair encoder: a fold starts from the
//! weights of a Hugging Face `transformers` BERT folder (`config.json`,
//! `model.safetensors`, `tokenizer.json`: `google-bert/bert-base-uncased`
//! and its kin, a `BertModel`, `BertForPreTraining` or
//! `BertForSequenceClassification`) instead of random ones, as
//! `BertForSequenceClassification.from_pretrained` does: the encoder and
//! the pooler from the folder, the classifier new unless the folder's was
//! trained for the run's labels (named by its `id2label` or by
//! `model.init_labels`, in any order: its outputs are reordered to
//! `data.labels`). RoBERTa folders (`roberta-base` and its
//! kin) load too ([`Family::Roberta`]): positions after its padding id, its
//! one segment embedding (`model.segments = 1`), its classification head
//! (`classifier.dense`, `classifier.out_proj`) as the pooler and the head;
//! ELECTRA's discriminator too ([`Family::Electra`]): BERT's layout, with
//! RoBERTa's head applying the GELU (`model.pooler_activation`); and
//! DistilBERT ([`Family::Distilbert`]): its own names, no segments
//! (`model.segments = 0`), a ReLU `pre_classifier`.
//!
//! kiln's encoder is BERT's architecture (post-LayerNorm blocks, token,
//! position and segment embeddings, `model.pooling = "pooler"` for BERT's
//! pooler), so every tensor has one counterpart: the query, key and value
//! matrices are packed into kiln's one projection, and PyTorch's `[out,
//! in]` linear weights are transposed to Burn's `[in, out]`. What the
//! weights need of the run is checked before anything is written, each
//! mismatch named with its fix: the shape, the GELU, LayerNorm's ε
//! (`model.layer_norm_eps`), the positions (`model.max_length` within
//! `max_position_embeddings`: cropped) and the tokenizer: each fold
//! tokenizes with the folder's `tokenizer.json` instead of training one.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kiln_config::{Gelu, PoolerActivation, Pooling, RunConfig, Workload, label_order};
use kiln_data::Tokenizer;
use kiln_model::EncoderClassifier;
use serde_json::Value;

use super::{
    Entry, Fit, fail, gelu_named, positive, read_config, read_header, tensor_values, weights_file,
};
use crate::error::TrainError;
use crate::params::{NamedValues, load_values, param_entries, param_values};

/// The BERT folder `model.init_from` names for an NLI run, checked against
/// it: its tokenizer, and the header of its weights (read when they are
/// loaded, [`BertFolder::load_into`]).
#[derive(Debug)]
pub(crate) struct BertFolder {
    folder: PathBuf,
    weights: PathBuf,
    /// Each tensor's name (`bert.` dropped), dtype, shape and byte range.
    tensors: Vec<(String, Entry)>,
    data_start: usize,
    shape: BertShape,
    /// The folder's tokenizer, which every fold tokenizes with.
    pub(crate) tokenizer: Tokenizer,
    /// Whether the folder's classifier is loaded: where it was trained for
    /// the run's labels (its `id2label`, or `model.init_labels`), for each
    /// of `data.labels` the folder's output it is; else the reason it is
    /// not.
    classifier: Result<Vec<usize>, String>,
}

/// Which of the folder's classifier outputs (`outputs` of them, `None`
/// where it has no classifier) each of the run's labels is, by the names
/// `model.init_labels` gives them, else by the folder's `id2label`
/// (`theirs`), letter case aside: `Ok(order)` to load it, `Err(reason)`
/// for a new head. `model.init_labels` that cannot be loaded is an error.
fn classifier_order(
    outputs: Option<usize>,
    theirs: Option<&[String]>,
    config: &RunConfig,
) -> Result<Result<Vec<usize>, String>, String> {
    let ours = &config.data.labels;
    let named = &config.model.init_labels;
    let Some(outputs) = outputs else {
        return match named.is_empty() {
            true => Ok(Err("none in the folder".to_string())),
            false => Err(
                "has no classifier, whose outputs model.init_labels names: leave model.init_labels=[] for a new one"
                    .to_string(),
            ),
        };
    };
    let order = |names: &[String]| label_order(names, ours);
    if !named.is_empty() {
        return match (named.len() == outputs, order(named)) {
            (true, Some(order)) => Ok(Ok(order)),
            _ => Err(format!(
                "has a classifier of {outputs} outputs; model.init_labels names {} ([{}]) and the run's labels are [{}]",
                named.len(),
                named.join(", "),
                ours.join(", ")
            )),
        };
    }
    let Some(theirs) = theirs else {
        return Ok(Err("the folder's config.json has no id2label".to_string()));
    };
    Ok(match order(theirs) {
        Some(order) if theirs.len() == outputs => Ok(order),
        Some(_) => Err(format!(
            "config.json's id2label names {} labels, its classifier has {outputs} outputs",
            theirs.len()
        )),
        None if theirs.iter().all(|n| generic_label(n)) && theirs.len() == ours.len() => {
            Err(format!(
                "the folder's id2label names its outputs [{}] only: model.init_labels='[\"…\", …]' names them, in that order, to load it",
                theirs.join(", ")
            ))
        }
        None => Err(format!(
            "the folder's was trained for the labels [{}], the run's are [{}]",
            theirs.join(", "),
            ours.join(", ")
        )),
    })
}

/// `transformers`' placeholder name for an output: `LABEL_<n>`.
fn generic_label(name: &str) -> bool {
    name.strip_prefix("LABEL_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The architectures kiln's encoder is, tensor for tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Family {
    /// BERT (`model_type` "bert").
    Bert,
    /// RoBERTa and its kin ("roberta", "xlm-roberta", "camembert"): BERT's
    /// blocks, positions counted from after the padding id, one segment,
    /// and a classification head of its own (`classifier.dense`, which is
    /// BERT's pooler in all but dropout, and `classifier.out_proj`).
    Roberta,
    /// ELECTRA's discriminator ("electra", base and large: embeddings as
    /// wide as the model): BERT's embeddings and blocks, and RoBERTa's
    /// classification head with the GELU for its activation
    /// (`model.pooler_activation = "gelu"`).
    Electra,
    /// DistilBERT ("distilbert"): BERT's blocks under other names
    /// (`transformer.layer.i.attention.q_lin`, ...), no segment embedding
    /// (`model.segments = 0`), LayerNorm's ε always 1e-12, and a
    /// `pre_classifier` with ReLU as its pooler (`model.pooler_activation =
    /// "relu"`).
    Distilbert,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Self::Bert => "BERT",
            Self::Roberta => "RoBERTa",
            Self::Electra => "ELECTRA",
            Self::Distilbert => "DistilBERT",
        }
    }

    /// The prefix `transformers` gives the encoder's tensors.
    fn prefix(self) -> &'static str {
        match self {
            Self::Bert => "bert.",
            Self::Roberta => "roberta.",
            Self::Electra => "electra.",
            Self::Distilbert => "distilbert.",
        }
    }

    /// The file's name for the tensor BERT calls `name` (the classification
    /// head's differ).
    fn file_name(self, name: &str) -> String {
        match (self, name) {
            (Self::Bert, _) => name.to_string(),
            (Self::Distilbert, _) => distilbert_name(name),
            (_, "pooler.dense.weight") => "classifier.dense.weight".into(),
            (_, "pooler.dense.bias") => "classifier.dense.bias".into(),
            (_, "classifier.weight") => "classifier.out_proj.weight".into(),
            (_, "classifier.bias") => "classifier.out_proj.bias".into(),
            _ => name.to_string(),
        }
    }

    /// The activation its classification head applies to the pooled
    /// [CLS] state.
    fn pooler_activation(self) -> PoolerActivation {
        match self {
            Self::Bert | Self::Roberta => PoolerActivation::Tanh,
            Self::Electra => PoolerActivation::Gelu,
            Self::Distilbert => PoolerActivation::Relu,
        }
    }

    /// The family `kiln export` writes an encoder as whose pooler applies
    /// `activation` and that has `segments` segment rows: RoBERTa's head
    /// with its one row, else by the head.
    pub(crate) fn for_export(activation: PoolerActivation, segments: usize) -> Self {
        match activation {
            PoolerActivation::Tanh if segments == 1 => Self::Roberta,
            PoolerActivation::Tanh => Self::Bert,
            PoolerActivation::Gelu => Self::Electra,
            PoolerActivation::Relu => Self::Distilbert,
        }
    }

    /// The first position row a sequence uses where the padding id is
    /// `pad_token_id`: RoBERTa counts positions from after it, the
    /// others from row 0.
    pub(crate) fn position_offset(self, pad_token_id: usize) -> usize {
        match self {
            Self::Roberta => pad_token_id + 1,
            Self::Bert | Self::Electra | Self::Distilbert => 0,
        }
    }

    /// Its `model_type` in `config.json`.
    pub(crate) fn model_type(self) -> &'static str {
        match self {
            Self::Bert => "bert",
            Self::Roberta => "roberta",
            Self::Electra => "electra",
            Self::Distilbert => "distilbert",
        }
    }

    /// Its `transformers` sentence classifier.
    pub(crate) fn class(self) -> &'static str {
        match self {
            Self::Bert => "BertForSequenceClassification",
            Self::Roberta => "RobertaForSequenceClassification",
            Self::Electra => "ElectraForSequenceClassification",
            Self::Distilbert => "DistilBertForSequenceClassification",
        }
    }
}

/// DistilBERT's name for the tensor BERT calls `name` (the prefix
/// dropped): its blocks are `transformer.layer.i` with `q_lin`, `k_lin`,
/// `v_lin`, `out_lin`, `sa_layer_norm`, `ffn.lin1`, `ffn.lin2` and
/// `output_layer_norm`; its pooler is `pre_classifier`.
fn distilbert_name(name: &str) -> String {
    if let Some(field) = name.strip_prefix("pooler.dense.") {
        return format!("pre_classifier.{field}");
    }
    let Some(rest) = name.strip_prefix("encoder.layer.") else {
        return name.to_string();
    };
    let Some((i, part)) = rest.split_once('.') else {
        return name.to_string();
    };
    let (module, field) = part.rsplit_once('.').unwrap_or((part, ""));
    let module = match module {
        "attention.self.query" => "attention.q_lin",
        "attention.self.key" => "attention.k_lin",
        "attention.self.value" => "attention.v_lin",
        "attention.output.dense" => "attention.out_lin",
        "attention.output.LayerNorm" => "sa_layer_norm",
        "intermediate.dense" => "ffn.lin1",
        "output.dense" => "ffn.lin2",
        "output.LayerNorm" => "output_layer_norm",
        other => other,
    };
    format!("transformer.layer.{i}.{module}.{field}")
}

/// BERT's shape as its `config.json` says, with `transformers`' defaults.
#[derive(Debug, PartialEq)]
struct BertShape {
    family: Family,
    /// The first position row a sequence uses (RoBERTa's rows up to its
    /// padding id are unused: 2 for RoBERTa, 0 for BERT).
    position_offset: usize,
    layers: usize,
    heads: usize,
    hidden: usize,
    intermediate: usize,
    positions: usize,
    vocab_size: usize,
    gelu: Gelu,
    layer_norm_eps: f64,
    /// Rows of its segment embedding (`type_vocab_size`; DistilBERT's 0).
    segments: usize,
    /// Its embeddings' width (ELECTRA's `embedding_size`; the others'
    /// `hidden_size`).
    embedding: usize,
    /// `id2label`'s names by id, where the config has them.
    labels: Option<Vec<String>>,
}

/// The BERT folder of an NLI run's `model.init_from`, checked against
/// `config`; `None` where the key is unset or the run is a language model.
pub(crate) fn open(config: &RunConfig) -> Result<Option<BertFolder>, TrainError> {
    match (&config.model.init_from, config.workload) {
        (Some(folder), Workload::Nli) => open_folder(Path::new(folder), config).map(Some),
        _ => Ok(None),
    }
}

fn open_folder(folder: &Path, config: &RunConfig) -> Result<BertFolder, TrainError> {
    if !folder.is_dir() {
        return Err(fail(
            folder,
            "is not a folder: it names a transformers BERT folder (config.json, model.safetensors and tokenizer.json): \
             `huggingface-cli download google-bert/bert-base-uncased config.json model.safetensors tokenizer.json --local-dir bert-base-uncased`",
        ));
    }
    let (config_path, shape) = read_shape(folder)?;
    shape.check(config).map_err(|why| fail(&config_path, why))?;

    let tokenizer_path = folder.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        return Err(fail(
            folder,
            "has no tokenizer.json, which the folds tokenize with: `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)` writes one",
        ));
    }
    let tokenizer =
        Tokenizer::load(&tokenizer_path).map_err(|e| fail(&tokenizer_path, e.to_string()))?;
    if tokenizer.vocab_size() > shape.vocab_size {
        return Err(fail(
            &tokenizer_path,
            format!(
                "has {} tokens, more than the {} rows of the weights' embedding (config.json's vocab_size)",
                tokenizer.vocab_size(),
                shape.vocab_size
            ),
        ));
    }
    if let Some(file) = &config.data.tokenizer_file {
        let other = Tokenizer::load(Path::new(file))?;
        if other.vocab() != tokenizer.vocab() {
            return Err(fail(
                &tokenizer_path,
                format!(
                    "is another tokenizer than data.tokenizer_file ({file}); the weights need theirs, \
                     which the folds use: set data.tokenizer_file=none"
                ),
            ));
        }
    }

    let weights = weights_file(folder, "BertForSequenceClassification")?;
    let (data_start, tensors) = read_header(&weights)?;
    let tensors: Vec<(String, Entry)> = tensors
        .into_iter()
        .map(|(name, entry)| {
            let name = name
                .strip_prefix(shape.family.prefix())
                .map_or(name.clone(), str::to_string);
            (name, entry)
        })
        .collect();
    let head = shape.family.file_name("classifier.weight");
    let outputs = tensors
        .iter()
        .find(|(n, _)| *n == head)
        .and_then(|(_, entry)| entry.shape.first().copied());
    let classifier = classifier_order(outputs, shape.labels.as_deref(), config)
        .map_err(|why| fail(&config_path, why))?;
    Ok(BertFolder {
        folder: folder.to_path_buf(),
        weights,
        tensors,
        data_start,
        shape,
        tokenizer,
        classifier,
    })
}

/// `folder`'s `config.json` and the shape it describes.
fn read_shape(folder: &Path) -> Result<(PathBuf, BertShape), TrainError> {
    read_config(folder, BertShape::from_json)
}

/// The overrides that make an NLI run's model the one a `folder` of any
/// [`Family`] holds (`kiln predict FOLDER`): `model.init_from`, its shape,
/// GELU and ε, segments, embedding width, its pooler and the pooler's
/// activation, and every position it has.
pub(crate) fn folder_overrides(folder: &Path) -> Result<Vec<String>, TrainError> {
    let (_, shape) = read_shape(folder)?;
    Ok(vec![
        format!("model.init_from={}", toml_string(&folder.to_string_lossy())),
        format!("model.layers={}", shape.layers),
        format!("model.heads={}", shape.heads),
        format!("model.hidden={}", shape.hidden),
        format!("model.intermediate={}", shape.intermediate),
        format!("model.gelu={}", shape.gelu.as_str()),
        format!("model.layer_norm_eps={:e}", shape.layer_norm_eps),
        "model.pooling=pooler".to_string(),
        format!(
            "model.pooler_activation={}",
            shape.family.pooler_activation().as_str()
        ),
        format!("model.segments={}", shape.segments),
        format!("model.embedding_size={}", shape.embedding_size()),
        format!("model.max_length={}", shape.positions),
    ])
}

/// `text` as a TOML string, quoted and escaped.
fn toml_string(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

impl BertShape {
    /// `model.embedding_size` for its embeddings: 0 where they are as wide
    /// as the model.
    fn embedding_size(&self) -> usize {
        match self.embedding == self.hidden {
            true => 0,
            false => self.embedding,
        }
    }

    fn from_json(json: &Value) -> Result<Self, String> {
        let model_type = json.get("model_type").and_then(Value::as_str);
        let family = match model_type {
            Some("bert") => Family::Bert,
            Some("roberta" | "xlm-roberta" | "camembert") => Family::Roberta,
            Some("electra") => Family::Electra,
            Some("distilbert") => Family::Distilbert,
            _ => {
                return Err(format!(
                    "describes a `{}` model; kiln's encoder loads BERT's architecture (model_type \"bert\"), RoBERTa's (\"roberta\", \"xlm-roberta\", \"camembert\"), ELECTRA's (\"electra\") and DistilBERT's (\"distilbert\")",
                    model_type.unwrap_or("(no model_type)")
                ));
            }
        };
        let distil = family == Family::Distilbert;
        // DistilBertConfig's names for BERT's keys.
        let key = |bert: &'static str| -> &'static str {
            match (distil, bert) {
                (true, "num_hidden_layers") => "n_layers",
                (true, "num_attention_heads") => "n_heads",
                (true, "hidden_size") => "dim",
                (true, "intermediate_size") => "hidden_dim",
                (true, "hidden_act") => "activation",
                _ => bert,
            }
        };
        let count = |bert: &'static str| positive(json, key(bert));
        let activation = json
            .get(key("hidden_act"))
            .and_then(Value::as_str)
            .unwrap_or("gelu");
        let gelu = gelu_named(activation, key("hidden_act"), "encoder")?;
        if let Some(kind) = json.get("position_embedding_type").and_then(Value::as_str)
            && kind != "absolute"
        {
            return Err(format!(
                "has position_embedding_type \"{kind}\"; kiln's encoder has BERT's absolute position embeddings"
            ));
        }
        let segments = match json.get("type_vocab_size") {
            _ if distil => 0,
            None => 2,
            Some(_) => count("type_vocab_size")?,
        };
        if segments > 2 {
            return Err(format!(
                "has type_vocab_size {segments}; kiln's encoder has BERT's two segments (premise, hypothesis)"
            ));
        }
        // RoBERTa's position ids start after its padding id.
        let position_offset = family.position_offset(
            json.get("pad_token_id")
                .and_then(Value::as_u64)
                .map_or(1, |p| p as usize),
        );
        let hidden = count("hidden_size")?;
        // ELECTRA's embeddings may be narrower, projected (ElectraConfig's
        // default is 128, ELECTRA-small's); the others' are the model's.
        let embedding = match family {
            Family::Electra => json
                .get("embedding_size")
                .and_then(Value::as_u64)
                .map_or(128, |e| e as usize),
            _ => hidden,
        };
        let positions = count("max_position_embeddings")?;
        if positions <= position_offset {
            return Err(format!(
                "has max_position_embeddings {positions}, no more than RoBERTa's padding offset {position_offset}"
            ));
        }
        let labels = json.get("id2label").and_then(Value::as_object).map(|map| {
            let mut by_id: Vec<(u64, String)> = map
                .iter()
                .filter_map(|(id, name)| Some((id.parse().ok()?, name.as_str()?.to_string())))
                .collect();
            by_id.sort();
            by_id.into_iter().map(|(_, name)| name).collect()
        });
        Ok(Self {
            layers: count("num_hidden_layers")?,
            heads: count("num_attention_heads")?,
            hidden,
            embedding,
            intermediate: count("intermediate_size")?,
            family,
            position_offset,
            positions: positions - position_offset,
            vocab_size: count("vocab_size")?,
            gelu,
            // DistilBERT's LayerNorms are built with 1e-12, whatever its
            // config says.
            layer_norm_eps: match distil {
                true => 1e-12,
                false => json
                    .get("layer_norm_eps")
                    .and_then(Value::as_f64)
                    .unwrap_or(1e-12),
            },
            segments,
            labels,
        })
    }

    /// Every key of the run's model that the weights need otherwise, in one
    /// message with the overrides that fix them.
    fn check(&self, config: &RunConfig) -> Result<(), String> {
        let mut fit = Fit::new(config);
        fit.shape([
            ("layers", "num_hidden_layers", self.layers),
            ("heads", "num_attention_heads", self.heads),
            ("hidden", "hidden_size", self.hidden),
            ("intermediate", "intermediate_size", self.intermediate),
        ]);
        fit.gelu(self.gelu);
        let head = self.family.pooler_activation();
        if config.model.pooling == Pooling::Pooler && config.model.pooler_activation != head {
            fit.push(
                format!(
                    "model.pooler_activation = \"{}\" where its pooler applies {}",
                    config.model.pooler_activation.as_str(),
                    head.as_str()
                ),
                format!("model.pooler_activation={}", head.as_str()),
            );
        }
        let m = &config.model;
        if m.embedding_width() != self.embedding && m.hidden == self.hidden {
            fit.push(
                format!(
                    "model.embedding_size = {} where its embedding_size is {}",
                    m.embedding_size, self.embedding
                ),
                format!("model.embedding_size={}", self.embedding_size()),
            );
        }
        if config.model.segments != self.segments {
            let field = match self.family {
                Family::Distilbert => "DistilBERT has no segment embedding".to_string(),
                _ => format!("its type_vocab_size is {}", self.segments),
            };
            fit.push(
                format!("model.segments = {} where {field}", config.model.segments),
                format!("model.segments={}", self.segments),
            );
        }
        let eps = config.model.layer_norm_eps;
        if (eps - self.layer_norm_eps).abs() > 1e-3 * self.layer_norm_eps {
            fit.push(
                format!(
                    "model.layer_norm_eps = {eps:e} where its layer_norm_eps is {:e}",
                    self.layer_norm_eps
                ),
                format!("model.layer_norm_eps={:e}", self.layer_norm_eps),
            );
        }
        let field = match self.position_offset {
            0 => "max_position_embeddings".to_string(),
            rows => {
                format!("max_position_embeddings after RoBERTa's first {rows} rows, the padding's")
            }
        };
        fit.positions(self.positions, &field);
        fit.into_result(self.family.name())
    }
}

/// Where a kiln encoder parameter comes from in a BERT file.
#[derive(Debug, PartialEq)]
enum Source {
    /// One tensor as it is (embeddings, biases, LayerNorms).
    Same(String),
    /// A PyTorch linear weight (`[out, in]`), transposed to Burn's `[in, out]`.
    Transposed(String),
    /// An embedding cropped to the run's rows: the positions to
    /// `model.max_length` (`positions`: from the family's first row), the
    /// tokens to the tokenizer's (a file may have rows no token has).
    Cropped { name: String, positions: bool },
    /// The query, key and value of layer `i` packed in kiln's one
    /// projection (`weight`: transposed side by side; `bias`: end to end).
    Packed { layer: usize, weight: bool },
}

/// The BERT source of the kiln parameter `path`, `None` for none.
fn source(path: &str) -> Option<Source> {
    let norm = |prefix: &str, what: &str| {
        let field = match what {
            "gamma" => "weight",
            "beta" => "bias",
            _ => return None,
        };
        Some(Source::Same(format!("{prefix}.LayerNorm.{field}")))
    };
    let linear = |name: &str, what: &str| match what {
        "weight" => Some(Source::Transposed(format!("{name}.weight"))),
        "bias" => Some(Source::Same(format!("{name}.bias"))),
        _ => None,
    };
    let parts: Vec<&str> = path.split('.').collect();
    match parts.as_slice() {
        ["tokens", "weight"] => Some(Source::Cropped {
            name: "embeddings.word_embeddings.weight".into(),
            positions: false,
        }),
        ["positions", "weight"] => Some(Source::Cropped {
            name: "embeddings.position_embeddings.weight".into(),
            positions: true,
        }),
        ["segments", "weight"] => Some(Source::Same(
            "embeddings.token_type_embeddings.weight".into(),
        )),
        ["ln_embed", what] => norm("embeddings", what),
        ["embed_proj", what] => linear("embeddings_project", what),
        ["pooler", what] => linear("pooler.dense", what),
        ["head", what] => linear("classifier", what),
        ["blocks", i, module, what] => {
            let i: usize = i.parse().ok()?;
            let layer = format!("encoder.layer.{i}");
            match *module {
                "qkv" => Some(Source::Packed {
                    layer: i,
                    weight: *what == "weight",
                }),
                "attn_out" => linear(&format!("{layer}.attention.output.dense"), what),
                "ln1" => norm(&format!("{layer}.attention.output"), what),
                "fc" => linear(&format!("{layer}.intermediate.dense"), what),
                "fc_out" => linear(&format!("{layer}.output.dense"), what),
                "ln2" => norm(&format!("{layer}.output"), what),
                _ => None,
            }
        }
        _ => None,
    }
}

/// An encoder's parameters (path, shape, values) as the tensors of
/// `transformers`' `BertForSequenceClassification` or `family`'s
/// (`kiln export`): each under the name [`source`] reads it from,
/// PyTorch's linear weights transposed back to `[out, in]`, the packed
/// projection split into query, key and value; RoBERTa's positions after
/// `position_offset` rows of zeros (its padding id + 1: the rows its
/// position ids skip). Fails, naming it, on a parameter the family has no
/// place for (an encoder without the pooler is not a
/// `BertForSequenceClassification`).
pub(crate) fn hf_tensors(
    params: &[NamedValues],
    family: Family,
    position_offset: usize,
) -> Result<Vec<NamedValues>, String> {
    // The classifier is the model's own, beside `bert` (`electra`, ...).
    let bert = |name: &str| {
        let name = family.file_name(name);
        match name.starts_with("classifier.") || name.starts_with("pre_classifier.") {
            true => name,
            false => format!("{}{name}", family.prefix()),
        }
    };
    let mut out = Vec::new();
    let mut segments = false;
    for (path, shape, v) in params {
        let source = source(path).ok_or_else(|| format!("`{path}` has no BERT counterpart"))?;
        if path.starts_with("embed_proj.") && family != Family::Electra {
            return Err(format!(
                "the encoder's embeddings are narrower than the model (model.embedding_size), which only ELECTRA projects; {} has no place for `{path}`",
                family.class()
            ));
        }
        match (source, shape.as_slice()) {
            (Source::Same(name), [rows, d]) if path == "segments.weight" => {
                if family == Family::Distilbert {
                    return Err(format!(
                        "the encoder has {rows} segment rows (model.segments), which DistilBERT has not: one trained with model.segments=0 is a DistilBertForSequenceClassification"
                    ));
                }
                // RoBERTa's one row; BERT's two, where one is every
                // token's: the row twice.
                let rows_out = if family == Family::Roberta { 1 } else { 2 };
                out.push((bert(&name), vec![rows_out, *d], v.repeat(rows_out / rows)));
                segments = true;
            }
            (
                Source::Cropped {
                    name,
                    positions: true,
                },
                [rows, d],
            ) if family == Family::Roberta => {
                let mut padded = vec![0.0; position_offset * d];
                padded.extend_from_slice(v);
                out.push((bert(&name), vec![position_offset + rows, *d], padded));
            }
            (Source::Same(name) | Source::Cropped { name, .. }, _) => {
                out.push((bert(&name), shape.clone(), v.clone()));
            }
            (Source::Transposed(name), [i, o]) => {
                out.push((bert(&name), vec![*o, *i], transpose(v, *i, *o)));
            }
            (Source::Packed { layer, weight }, dims) => {
                let d = dims[dims.len() - 1] / 3;
                for (k, part) in ["query", "key", "value"].iter().enumerate() {
                    let field = if weight { "weight" } else { "bias" };
                    let name = bert(&format!(
                        "encoder.layer.{layer}.attention.self.{part}.{field}"
                    ));
                    if weight {
                        // Its third of each row, then PyTorch's [out, in].
                        let part: Vec<f32> = v
                            .chunks(3 * d)
                            .flat_map(|row| &row[k * d..(k + 1) * d])
                            .copied()
                            .collect();
                        out.push((name, vec![d, d], transpose(&part, d, d)));
                    } else {
                        out.push((name, vec![d], v[k * d..(k + 1) * d].to_vec()));
                    }
                }
            }
            (_, dims) => return Err(format!("`{path}` has an unexpected shape {dims:?}")),
        }
    }
    if !segments && family != Family::Distilbert {
        // No segment embedding (model.segments = 0): two rows of zeros.
        let width = params
            .iter()
            .find(|(p, _, _)| p == "tokens.weight")
            .and_then(|(_, shape, _)| shape.get(1).copied())
            .ok_or("the encoder has no token embedding")?;
        out.push((
            bert("embeddings.token_type_embeddings.weight"),
            vec![2, width],
            vec![0.0; 2 * width],
        ));
    }
    let pooler = bert("pooler.dense.weight");
    if !out.iter().any(|(n, _, _)| *n == pooler) {
        return Err(format!(
            "the encoder has no pooler (model.pooling is not \"pooler\"), which {} classifies: \
             train with model.pooling=pooler (the default pooling, \"cls\", classifies the [CLS] state itself)",
            family.class()
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Tensors a BERT file may hold that kiln's classifier may not use: the
/// pre-training heads (BERT's `cls.`, RoBERTa's `lm_head.`, ELECTRA's
/// `discriminator_predictions.` and its generator's, DistilBERT's
/// `vocab_transform`, `vocab_layer_norm`, `vocab_projector`), the position-id
/// buffer older files saved, the pooler (`model.pooling` other than
/// `"pooler"`, or RoBERTa's, which its classification models do not use)
/// and the classifier (trained for other labels).
fn may_go_unused(name: &str) -> bool {
    name.starts_with("cls.")
        || name.starts_with("lm_head.")
        || name.starts_with("discriminator_predictions.")
        || name.starts_with("generator_")
        || name.starts_with("vocab_")
        || name == "embeddings.position_ids"
        || name.starts_with("pooler.")
        || name.starts_with("pre_classifier.")
        || name.starts_with("classifier.")
}

/// `[rows, cols]` values transposed.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

impl BertFolder {
    /// The start line: where the weights came from and what was adapted.
    pub(crate) fn describe(&self, config: &RunConfig) -> String {
        let mut notes = vec![format!(
            "tokenizer.json ({} tokens) for every fold",
            self.tokenizer.vocab_size()
        )];
        if config.model.max_length < self.shape.positions {
            notes.push(format!(
                "position embeddings cropped {} → {}",
                self.shape.positions, config.model.max_length
            ));
        }
        let family = self.shape.family;
        match (
            config.model.pooling == Pooling::Pooler,
            self.pooler_from_file(),
        ) {
            (false, true) => {
                notes.push("its pooler unused (model.pooling is not \"pooler\")".into());
            }
            (true, false) => notes.push("a new pooler".into()),
            _ => {}
        }
        if self.shape.position_offset > 0 {
            notes.push(format!(
                "positions from row {} (RoBERTa's)",
                self.shape.position_offset
            ));
        }
        let named = &config.model.init_labels;
        let (theirs, by) = match named.is_empty() {
            true => (self.shape.labels.clone().unwrap_or_default(), "id2label"),
            false => (named.clone(), "model.init_labels"),
        };
        match &self.classifier {
            Ok(order) if order.iter().enumerate().all(|(i, &j)| i == j) => {
                notes.push(format!("its classifier, trained for these labels ({by})"));
            }
            Ok(_) => notes.push(format!(
                "its classifier, its outputs [{}] ({by}) reordered to data.labels",
                theirs.join(", ")
            )),
            Err(why) => notes.push(format!("a new classifier ({why})")),
        }
        format!(
            "weights: from {} ({}; {})",
            self.folder.display(),
            family.name(),
            notes.join("; ")
        )
    }

    /// Whether the folder's classifier is loaded; else why not.
    pub(crate) fn classifier(&self) -> Result<(), &str> {
        self.classifier.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Whether the folder holds a classifier at all.
    pub(crate) fn has_classifier(&self) -> bool {
        self.has(&self.shape.family.file_name("classifier.weight"))
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.iter().any(|(n, _)| n == name)
    }

    /// Whether the pooler comes from the file: BERT's where it has one;
    /// RoBERTa's (`classifier.dense`) with the classifier it belongs to.
    fn pooler_from_file(&self) -> bool {
        let family = self.shape.family;
        self.has(&family.file_name("pooler.dense.weight"))
            && (family == Family::Bert || self.classifier.is_ok())
    }

    /// `model` with its parameters replaced by the folder's (the classifier
    /// kept where the folder's is not loaded). Fails, naming the tensor,
    /// where the file lacks one, has another shape, or holds a tensor the
    /// model does not have.
    pub(crate) fn load_into(
        &self,
        model: EncoderClassifier,
        device: &Device,
    ) -> Result<EncoderClassifier, TrainError> {
        let bytes = std::fs::read(&self.weights)
            .map_err(|e| fail(&self.weights, format!("cannot be read: {e}")))?;
        let data = &bytes[self.data_start.min(bytes.len())..];
        let file: HashMap<&str, &Entry> = self
            .tensors
            .iter()
            .map(|(name, entry)| (name.as_str(), entry))
            .collect();
        let mut used: HashSet<String> = HashSet::new();
        let head = ["classifier.weight", "classifier.bias"].map(|n| self.shape.family.file_name(n));
        let head = head.iter().map(String::as_str).collect::<Vec<_>>();
        // A tensor by name (LayerNorms also under TensorFlow's gamma and
        // beta, as the original checkpoints have them), with its shape.
        let mut read = |name: &str| -> Result<(Vec<usize>, Vec<f32>), TrainError> {
            let legacy = name
                .strip_suffix("LayerNorm.weight")
                .map(|p| format!("{p}LayerNorm.gamma"))
                .or_else(|| {
                    name.strip_suffix("LayerNorm.bias")
                        .map(|p| format!("{p}LayerNorm.beta"))
                });
            let (name, entry) = match (file.get(name), &legacy) {
                (Some(entry), _) => (name, *entry),
                (None, Some(old)) if file.contains_key(old.as_str()) => {
                    (old.as_str(), file[old.as_str()])
                }
                _ => return Err(fail(&self.weights, format!("has no `{name}`"))),
            };
            used.insert(name.to_string());
            let values = tensor_values(&self.weights, data, name, entry)?;
            // The classifier's outputs (its rows) in data.labels' order.
            let values = match (&self.classifier, entry.shape.first()) {
                (Ok(order), Some(&rows)) if head.contains(&name) && rows == order.len() => {
                    let width = values.len() / rows;
                    order
                        .iter()
                        .flat_map(|&j| &values[j * width..(j + 1) * width])
                        .copied()
                        .collect()
                }
                _ => values,
            };
            Ok((entry.shape.clone(), values))
        };
        let mismatch = |name: &str, have: &[usize], want: &[usize], path: &str| {
            fail(
                &self.weights,
                format!("holds `{name}` as {have:?}; the run's model needs {want:?} for `{path}`"),
            )
        };
        let family = self.shape.family;
        // The head (and RoBERTa's pooler, part of its classification head)
        // comes from the file only where the folder's classifier fits the
        // run; else the model keeps its own, as `from_pretrained` starts a
        // new head.
        let from_file = |path: &str| {
            if path.starts_with("head.") {
                self.classifier.is_ok()
            } else if path.starts_with("pooler.") {
                self.pooler_from_file()
            } else {
                true
            }
        };
        let own: HashMap<String, Vec<f32>> = param_values(&model)
            .into_iter()
            .filter(|(path, _, _)| !from_file(path))
            .map(|(path, _, values)| (path, values))
            .collect();
        let mut values = HashMap::new();
        for param in param_entries(&model) {
            let want = param.shape.clone();
            if let Some(v) = own.get(&param.path) {
                values.insert(param.path, (want, v.clone()));
                continue;
            }
            let source = source(&param.path).ok_or_else(|| {
                fail(
                    &self.weights,
                    format!("cannot fill `{}`: kiln has no BERT name for it", param.path),
                )
            })?;
            let v = match source {
                Source::Same(name) => {
                    let name = family.file_name(&name);
                    let (shape, v) = read(&name)?;
                    if shape != want {
                        return Err(mismatch(&name, &shape, &want, &param.path));
                    }
                    v
                }
                Source::Transposed(name) => {
                    let name = family.file_name(&name);
                    let (shape, v) = read(&name)?;
                    match (shape.as_slice(), want.as_slice()) {
                        ([out, inp], [i, o]) if out == o && inp == i => transpose(&v, *out, *inp),
                        _ => return Err(mismatch(&name, &shape, &[want[1], want[0]], &param.path)),
                    }
                }
                Source::Cropped { name, positions } => {
                    let name = family.file_name(&name);
                    let (shape, v) = read(&name)?;
                    let skip = if positions {
                        self.shape.position_offset
                    } else {
                        0
                    };
                    match (shape.as_slice(), want.as_slice()) {
                        ([rows, d], [keep, width]) if d == width && skip + keep <= *rows => {
                            v[skip * width..(skip + keep) * width].to_vec()
                        }
                        _ => return Err(mismatch(&name, &shape, &want, &param.path)),
                    }
                }
                Source::Packed { layer, weight } => {
                    let d = want[want.len() - 1] / 3;
                    let parts = ["query", "key", "value"].map(|p| {
                        let field = if weight { "weight" } else { "bias" };
                        family
                            .file_name(&format!("encoder.layer.{layer}.attention.self.{p}.{field}"))
                    });
                    let mut out = vec![0.0; want.iter().product()];
                    for (k, name) in parts.iter().enumerate() {
                        let (shape, v) = read(name)?;
                        let fits = if weight {
                            shape == [d, d] && want == [d, 3 * d]
                        } else {
                            shape == [d]
                        };
                        if !fits {
                            let part = if weight { vec![d, d] } else { vec![d] };
                            return Err(mismatch(name, &shape, &part, &param.path));
                        }
                        if weight {
                            // kiln's [in, 3·out]: each row holds query, key
                            // and value's (transposed) side by side.
                            let part = transpose(&v, d, d);
                            for (row, from) in out.chunks_mut(3 * d).zip(part.chunks(d)) {
                                row[k * d..(k + 1) * d].copy_from_slice(from);
                            }
                        } else {
                            out[k * d..(k + 1) * d].copy_from_slice(&v);
                        }
                    }
                    out
                }
            };
            values.insert(param.path, (want, v));
        }
        let mut extra: Vec<&str> = self
            .tensors
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| !used.contains(*n) && !may_go_unused(n))
            .collect();
        extra.sort_unstable();
        if let Some(first) = extra.first() {
            return Err(fail(
                &self.weights,
                format!(
                    "holds `{first}`, which kiln's encoder has no parameter for ({} such tensors): \
                     is it a BERT?",
                    extra.len()
                ),
            ));
        }
        drop(bytes);
        load_values(model, values, device).map_err(|why| fail(&self.weights, why))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Bool, Int, Tensor, TensorData};

    use super::*;
    use crate::translate::encoder_config;

    /// An NLI run of a tiny BERT shape with BERT's pooler and ε.
    fn run_config(folder: &Path, extra: &[&str]) -> RunConfig {
        let init = format!("model.init_from={}", folder.display());
        let mut overrides = vec![
            "hardware=cpu",
            "experiment=nli_snli",
            "model.layers=2",
            "model.heads=2",
            "model.hidden=8",
            "model.intermediate=16",
            "model.max_length=12",
            "model.pooling=pooler",
            "model.layer_norm_eps=1e-12",
            init.as_str(),
        ];
        overrides.extend_from_slice(extra);
        crate::tests::config(&overrides)
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Writes `model`'s parameters to `dir` as `transformers` saves a
    /// `BertForSequenceClassification` (or, `legacy`, a TensorFlow-converted
    /// `BertModel`: no `bert.` prefix, LayerNorms' gamma and beta, no
    /// classifier), the position embeddings with 4 rows more than the run
    /// has and the word embeddings with 3: written here element by element,
    /// apart from the loader's mapping.
    fn write_bert(
        dir: &Path,
        model: &EncoderClassifier,
        tokenizer: &Tokenizer,
        labels: Option<&[&str]>,
        legacy: bool,
    ) {
        let values: HashMap<String, (Vec<usize>, Vec<f32>)> = param_values(model)
            .into_iter()
            .map(|(path, shape, v)| (path, (shape, v)))
            .collect();
        let get = |path: &str| values.get(path).cloned().expect(path);
        let prefix = if legacy { "" } else { "bert." };
        let (ln_w, ln_b) = if legacy {
            ("gamma", "beta")
        } else {
            ("weight", "bias")
        };
        let mut out: Vec<NamedValues> = Vec::new();
        let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| out.push((name, shape, v));
        // `[in, out]` → PyTorch's `[out, in]`.
        let torch = |shape: &[usize], v: &[f32]| -> (Vec<usize>, Vec<f32>) {
            let (i, o) = (shape[0], shape[1]);
            let mut t = vec![0.0; v.len()];
            for a in 0..i {
                for b in 0..o {
                    t[b * i + a] = v[a * o + b];
                }
            }
            (vec![o, i], t)
        };
        let (shape, mut v) = get("tokens.weight");
        v.extend(std::iter::repeat_n(9.0, 3 * shape[1]));
        put(
            format!("{prefix}embeddings.word_embeddings.weight"),
            vec![shape[0] + 3, shape[1]],
            v,
        );
        let (shape, mut v) = get("positions.weight");
        v.extend(std::iter::repeat_n(7.0, 4 * shape[1]));
        put(
            format!("{prefix}embeddings.position_embeddings.weight"),
            vec![shape[0] + 4, shape[1]],
            v,
        );
        if let Some((shape, v)) = values.get("segments.weight").cloned() {
            put(
                format!("{prefix}embeddings.token_type_embeddings.weight"),
                shape,
                v,
            );
        }
        put(
            format!("{prefix}embeddings.position_ids"),
            vec![1],
            vec![0.0],
        );
        for (kiln, hf) in [
            ("ln_embed", "embeddings.LayerNorm".to_string()),
            (
                "blocks.0.ln1",
                "encoder.layer.0.attention.output.LayerNorm".into(),
            ),
            (
                "blocks.1.ln1",
                "encoder.layer.1.attention.output.LayerNorm".into(),
            ),
            ("blocks.0.ln2", "encoder.layer.0.output.LayerNorm".into()),
            ("blocks.1.ln2", "encoder.layer.1.output.LayerNorm".into()),
        ] {
            let (shape, v) = get(&format!("{kiln}.gamma"));
            put(format!("{prefix}{hf}.{ln_w}"), shape, v);
            let (shape, v) = get(&format!("{kiln}.beta"));
            put(format!("{prefix}{hf}.{ln_b}"), shape, v);
        }
        let mut linears = vec![("pooler".to_string(), "pooler.dense".to_string())];
        if values.contains_key("embed_proj.weight") {
            linears.push(("embed_proj".into(), "embeddings_project".into()));
        }
        for l in 0..2 {
            let layer = format!("encoder.layer.{l}");
            linears.push((
                format!("blocks.{l}.attn_out"),
                format!("{layer}.attention.output.dense"),
            ));
            linears.push((
                format!("blocks.{l}.fc"),
                format!("{layer}.intermediate.dense"),
            ));
            linears.push((
                format!("blocks.{l}.fc_out"),
                format!("{layer}.output.dense"),
            ));
            // The packed projection's thirds: query, key, value.
            let (shape, w) = get(&format!("blocks.{l}.qkv.weight"));
            let (_, b) = get(&format!("blocks.{l}.qkv.bias"));
            let d = shape[0];
            for (k, part) in ["query", "key", "value"].iter().enumerate() {
                let mut t = vec![0.0; d * d];
                for out_j in 0..d {
                    for in_r in 0..d {
                        t[out_j * d + in_r] = w[in_r * 3 * d + k * d + out_j];
                    }
                }
                let name = format!("{prefix}{layer}.attention.self.{part}");
                put(format!("{name}.weight"), vec![d, d], t);
                put(
                    format!("{name}.bias"),
                    vec![d],
                    b[k * d..(k + 1) * d].to_vec(),
                );
            }
        }
        for (kiln, hf) in linears {
            let (shape, v) = get(&format!("{kiln}.weight"));
            let (shape, v) = torch(&shape, &v);
            put(format!("{prefix}{hf}.weight"), shape, v);
            let (shape, v) = get(&format!("{kiln}.bias"));
            put(format!("{prefix}{hf}.bias"), shape, v);
        }
        if !legacy {
            let (shape, v) = get("head.weight");
            let (shape, v) = torch(&shape, &v);
            put("classifier.weight".into(), shape, v);
            let (shape, v) = get("head.bias");
            put("classifier.bias".into(), shape, v);
            put("cls.predictions.bias".into(), vec![2], vec![0.0, 0.0]);
        }
        let tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = out
            .iter()
            .map(|(n, s, v)| (n.as_str(), "F32", s.clone(), f32_bytes(v)))
            .collect();
        super::super::tests::safetensors_file(dir, &tensors);
        let mut config = serde_json::json!({
            "model_type": "bert",
            "architectures": ["BertForSequenceClassification"],
            "hidden_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "hidden_act": "gelu",
            "max_position_embeddings": 16,
            "type_vocab_size": 2,
            "vocab_size": tokenizer.vocab_size() + 3,
            "layer_norm_eps": 1e-12,
        });
        if let Some(labels) = labels {
            let map: serde_json::Map<String, Value> = labels
                .iter()
                .enumerate()
                .map(|(i, l)| (i.to_string(), Value::from(*l)))
                .collect();
            config["id2label"] = Value::Object(map);
        }
        std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
        std::fs::write(
            dir.join("tokenizer.json"),
            tokenizer.to_json().expect("tokenizer json"),
        )
        .expect("tokenizer.json");
    }

    fn tokenizer() -> Tokenizer {
        let texts = [
            "a man plays a guitar on stage",
            "the woman is sleeping",
            "two dogs run in a park",
        ];
        Tokenizer::wordpiece(texts.iter().copied(), 64, 12).expect("wordpiece")
    }

    fn logits(model: &EncoderClassifier, device: &Device) -> Vec<f32> {
        logits_in(model, device, [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    }

    fn logits_in(model: &EncoderClassifier, device: &Device, segments: [i64; 12]) -> Vec<f32> {
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(vec![2i64, 7, 3, 9, 3, 0, 2, 5, 3, 11, 12, 3], [2, 6]),
            device,
        );
        let seg = Tensor::<2, Int>::from_data(TensorData::new(segments.to_vec(), [2, 6]), device);
        let mask = Tensor::<2, Bool>::from_data(
            TensorData::new(
                vec![
                    true, true, true, true, true, false, true, true, true, true, true, true,
                ],
                [2, 6],
            ),
            device,
        );
        model
            .forward(ids, seg, mask)
            .into_data()
            .iter::<f32>()
            .collect()
    }

    /// A test's folder, device, tokenizer, run, encoder shape and a model
    /// of it drawn with `seed` (under the caller's hold of flex's generator).
    fn fixture(
        seed: u64,
    ) -> (
        tempfile::TempDir,
        Device,
        Tokenizer,
        RunConfig,
        kiln_model::EncoderConfig,
        EncoderClassifier,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let device = Device::flex();
        let tokenizer = tokenizer();
        let config = run_config(dir.path(), &[]);
        let shape = encoder_config(&config, tokenizer.vocab_size());
        device.seed(seed);
        let source = shape.init(&device);
        (dir, device, tokenizer, config, shape, source)
    }

    #[test]
    fn a_bert_folder_fills_every_parameter_as_transformers_names_it() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, tokenizer, config, shape, source) = fixture(11);
        let labels = ["entailment", "neutral", "contradiction"];
        write_bert(dir.path(), &source, &tokenizer, Some(&labels), false);

        let bert = open(&config).expect("opens").expect("init_from set");
        assert_eq!(bert.classifier, Ok(vec![0, 1, 2]));
        let description = bert.describe(&config);
        assert!(
            description.contains("position embeddings cropped 16 → 12")
                && description.contains("its classifier, trained for these labels"),
            "{description}"
        );
        device.seed(12);
        let fresh = shape.init(&device);
        assert_ne!(logits(&fresh, &device), logits(&source, &device));
        let loaded = bert.load_into(fresh, &device).expect("loads");
        // Every value lands where it came from: the same function, bit for bit.
        assert_eq!(logits(&loaded, &device), logits(&source, &device));
    }

    #[test]
    fn the_classifier_loads_for_the_runs_labels_in_any_order_or_as_init_labels_names_them() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, tokenizer, config, shape, source) = fixture(13);
        // The source model saved with its outputs named `labels`, opened
        // for `config`, its start line holding `says`.
        let folder = |labels: &[&str], config: &RunConfig, says: &str| -> BertFolder {
            write_bert(dir.path(), &source, &tokenizer, Some(labels), false);
            let bert = open(config).expect("opens").expect("init_from set");
            let description = bert.describe(config);
            assert!(description.contains(says), "{says} in {description}");
            bert
        };
        let load = |bert: BertFolder| {
            device.seed(14);
            bert.load_into(shape.init(&device), &device).expect("loads")
        };
        // The source's logits, its outputs in the order 2, 1, 0.
        let reordered: Vec<f32> = logits(&source, &device)
            .chunks(3)
            .flat_map(|row| [row[2], row[1], row[0]])
            .collect();

        // As `roberta-large-mnli` names them: reordered to the run's labels.
        let bert = folder(
            &["CONTRADICTION", "NEUTRAL", "ENTAILMENT"],
            &config,
            "its classifier, its outputs [CONTRADICTION, NEUTRAL, ENTAILMENT] (id2label) reordered to data.labels",
        );
        assert_eq!(bert.classifier, Ok(vec![2, 1, 0]));
        assert_eq!(logits(&load(bert), &device), reordered);

        // Generic names: a new head, and the start line names the key that
        // loads it; everything else is the folder's.
        let bert = folder(
            &["LABEL_0", "LABEL_1", "LABEL_2"],
            &config,
            "a new classifier (the folder's id2label names its outputs [LABEL_0, LABEL_1, LABEL_2] only: model.init_labels=",
        );
        device.seed(14);
        let own: Vec<NamedValues> = param_values(&shape.init(&device));
        let loaded = param_values(&load(bert));
        let theirs = param_values(&source);
        for ((path, _, v), ((_, _, mine), (_, _, folder))) in
            loaded.iter().zip(own.iter().zip(&theirs))
        {
            let expected = if path.starts_with("head.") {
                mine
            } else {
                folder
            };
            assert_eq!(v, expected, "{path}");
        }
        // With the key, the outputs in its order.
        let named = run_config(
            dir.path(),
            &[r#"model.init_labels=["contradiction", "neutral", "entailment"]"#],
        );
        let bert = folder(
            &["LABEL_0", "LABEL_1", "LABEL_2"],
            &named,
            "its outputs [contradiction, neutral, entailment] (model.init_labels) reordered",
        );
        assert_eq!(logits(&load(bert), &device), reordered);

        // Other labels than the run's: the head is new.
        folder(
            &["positive", "neutral", "negative"],
            &config,
            "a new classifier (the folder's was trained for the labels [positive, neutral, negative], the run's are [entailment, neutral, contradiction])",
        );
        // model.init_labels for outputs the folder does not have: refused.
        let four = run_config(
            dir.path(),
            &[
                r#"data.labels=["a", "b", "c", "d"]"#,
                r#"model.init_labels=["d", "c", "b", "a"]"#,
            ],
        );
        let err = open(&four).expect_err("refused").to_string();
        assert!(
            err.contains("config.json")
                && err.contains("has a classifier of 3 outputs; model.init_labels names 4"),
            "{err}"
        );
    }

    #[test]
    fn a_tensorflow_converted_bert_model_loads_and_cls_pooling_leaves_the_pooler() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, tokenizer, config, shape, source) = fixture(21);
        write_bert(dir.path(), &source, &tokenizer, None, true);
        let bert = open(&config).expect("opens").expect("set");
        assert_eq!(
            bert.classifier,
            Err("none in the folder".to_string()),
            "a BertModel has no classifier"
        );
        device.seed(22);
        let loaded = bert
            .load_into(shape.init(&device), &device)
            .expect("gamma and beta read as weight and bias");
        let ours = param_values(&loaded);
        let theirs = param_values(&source);
        for ((path, _, a), (_, _, b)) in ours.iter().zip(&theirs) {
            assert_eq!(a == b, !path.starts_with("head."), "{path}");
        }

        let cls = run_config(dir.path(), &["model.pooling=cls"]);
        let bert = open(&cls).expect("opens").expect("set");
        assert!(bert.describe(&cls).contains("its pooler unused"));
        let shape = encoder_config(&cls, tokenizer.vocab_size());
        bert.load_into(shape.init(&device), &device)
            .expect("the pooler's tensors may go unused");
    }

    #[test]
    fn what_does_not_fit_is_named_with_its_fix() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, tokenizer, config, shape, source) = fixture(31);
        write_bert(dir.path(), &source, &tokenizer, None, false);

        let err = |overrides: &[&str]| -> String {
            open(&run_config(dir.path(), overrides))
                .expect_err("refused")
                .to_string()
        };
        let wrong = err(&[
            "model.layers=3",
            "model.layer_norm_eps=1e-5",
            "model.max_length=32",
        ]);
        for part in [
            "config.json",
            "model.layers = 3 where its num_hidden_layers is 2",
            "model.layer_norm_eps = 1e-5 where its layer_norm_eps is 1e-12",
            "longer than its 16 positions",
            "model.layers=2 model.layer_norm_eps=1e-12 model.max_length=16",
        ] {
            assert!(wrong.contains(part), "{part} in {wrong}");
        }
        let other = dir.path().join("other.json");
        std::fs::write(
            &other,
            Tokenizer::wordpiece(["other words entirely"].into_iter(), 40, 12)
                .expect("wordpiece")
                .to_json()
                .expect("json"),
        )
        .expect("write");
        let tokenizer_file = format!("data.tokenizer_file={}", other.display());
        assert!(err(&[&tokenizer_file]).contains("set data.tokenizer_file=none"));

        // A DeBERTa is not a BERT; a folder without tokenizer.json is refused.
        let json = std::fs::read_to_string(dir.path().join("config.json")).expect("read");
        std::fs::write(
            dir.path().join("config.json"),
            json.replace("\"bert\"", "\"deberta-v2\""),
        )
        .expect("write");
        assert!(err(&[]).contains("describes a `deberta-v2` model"));
        std::fs::write(dir.path().join("config.json"), json).expect("write");
        std::fs::remove_file(dir.path().join("tokenizer.json")).expect("rm");
        assert!(err(&[]).contains("has no tokenizer.json"));

        // A tensor kiln has no place for is named.
        write_bert(dir.path(), &shape.init(&device), &tokenizer, None, false);
        let weights = dir.path().join("model.safetensors");
        let (_, tensors) = read_header(&weights).expect("header");
        let mut kept: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let bytes = std::fs::read(&weights).expect("read");
        let (start, _) = read_header(&weights).expect("header");
        for (name, e) in &tensors {
            kept.push((
                name.clone(),
                e.shape.clone(),
                bytes[start + e.start..start + e.end].to_vec(),
            ));
        }
        kept.push((
            "bert.encoder.layer.0.attention.self.distance_embedding.weight".into(),
            vec![1],
            f32_bytes(&[0.0]),
        ));
        let refs: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = kept
            .iter()
            .map(|(n, s, b)| (n.as_str(), "F32", s.clone(), b.clone()))
            .collect();
        super::super::tests::safetensors_file(dir.path(), &refs);
        let bert = open(&config).expect("opens").expect("set");
        let err = bert
            .load_into(shape.init(&device), &device)
            .expect_err("an extra tensor")
            .to_string();
        assert!(
            err.contains("`encoder.layer.0.attention.self.distance_embedding.weight`"),
            "{err}"
        );
    }

    /// Rewrites the `BertForSequenceClassification` folder `write_bert` made
    /// in `dir` as `transformers` saves a `RobertaForSequenceClassification`
    /// (`roberta.` names, two padding rows before the positions, one
    /// segment: the first of kiln's, the classification head's
    /// `classifier.dense` and `classifier.out_proj`, a masked-LM head's
    /// tensor besides).
    fn as_roberta(dir: &Path) {
        rewrite(
            dir,
            |name, shape, data| {
                *name = match name.as_str() {
                    "bert.embeddings.position_embeddings.weight" => {
                        let mut padded = f32_bytes(&vec![5.0; 2 * shape[1]]);
                        padded.extend_from_slice(data);
                        *data = padded;
                        shape[0] += 2;
                        "roberta.embeddings.position_embeddings.weight".to_string()
                    }
                    "bert.embeddings.token_type_embeddings.weight" => {
                        data.truncate(shape[1] * 4);
                        shape[0] = 1;
                        "roberta.embeddings.token_type_embeddings.weight".to_string()
                    }
                    "cls.predictions.bias" => "lm_head.bias".to_string(),
                    other => head_named(other, "roberta."),
                };
            },
            |config| {
                config["model_type"] = "roberta".into();
                config["pad_token_id"] = 1.into();
                config["type_vocab_size"] = 1.into();
                config["max_position_embeddings"] = 18.into();
            },
        );
    }

    /// A `BertForSequenceClassification` tensor's name in a model with
    /// RoBERTa's classification head (`classifier.dense`, `out_proj`) and
    /// the encoder under `prefix`.
    fn head_named(name: &str, prefix: &str) -> String {
        match name {
            "classifier.weight" => "classifier.out_proj.weight".into(),
            "classifier.bias" => "classifier.out_proj.bias".into(),
            other => match other.strip_prefix("bert.pooler.dense.") {
                Some(field) => format!("classifier.dense.{field}"),
                None => other.replacen("bert.", prefix, 1),
            },
        }
    }

    /// Rewrites the weights and `config.json` `write_bert` made in `dir`:
    /// each tensor's name, shape and bytes through `tensor`, the config
    /// through `config`.
    fn rewrite(
        dir: &Path,
        tensor: impl Fn(&mut String, &mut Vec<usize>, &mut Vec<u8>),
        config: impl FnOnce(&mut Value),
    ) {
        let weights = dir.join("model.safetensors");
        let (start, tensors) = read_header(&weights).expect("header");
        let bytes = std::fs::read(&weights).expect("read");
        let out: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, e)| {
                let (mut name, mut shape) = (name.clone(), e.shape.clone());
                let mut data = bytes[start + e.start..start + e.end].to_vec();
                tensor(&mut name, &mut shape, &mut data);
                (name, shape, data)
            })
            .collect();
        let refs: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = out
            .iter()
            .map(|(n, s, b)| (n.as_str(), "F32", s.clone(), b.clone()))
            .collect();
        super::super::tests::safetensors_file(dir, &refs);
        let path = dir.join("config.json");
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        config(&mut json);
        std::fs::write(&path, json.to_string()).expect("write");
    }

    #[test]
    fn a_roberta_folder_loads_with_its_offset_positions_one_segment_and_its_head() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, tokenizer, config, _, source) = fixture(41);
        let labels = ["entailment", "neutral", "contradiction"];
        write_bert(dir.path(), &source, &tokenizer, Some(&labels), false);
        as_roberta(dir.path());
        // Its one segment row: named with its fix.
        let err = open(&config).expect_err("two rows").to_string();
        assert!(
            err.contains("model.segments = 2 where its type_vocab_size is 1")
                && err.contains("model.segments=1"),
            "{err}"
        );
        let config = run_config(dir.path(), &["model.segments=1"]);
        let shape = encoder_config(&config, tokenizer.vocab_size());
        let bert = open(&config).expect("opens").expect("set");
        let description = bert.describe(&config);
        assert!(
            description.contains("(RoBERTa;")
                && description.contains("positions from row 2")
                && description.contains("its classifier, trained for these labels"),
            "{description}"
        );
        device.seed(42);
        let loaded = bert.load_into(shape.init(&device), &device).expect("loads");
        // One segment for both sentences: the same function where the
        // input has the first only.
        let first_only = [0; 12];
        assert_eq!(
            logits_in(&loaded, &device, first_only),
            logits_in(&source, &device, first_only)
        );
        assert_ne!(logits(&loaded, &device), logits(&source, &device));

        // Exported back in RoBERTa's own layout: the folder's tensors, but
        // for the pre-training head (and the position-id buffer older
        // files saved), the two position rows before its
        // first (5.0 in the folder, never read; zeros in the export), the
        // positions past the run's 12 and the rows no token has.
        let family = Family::for_export(config.model.pooler_activation, config.model.segments);
        assert_eq!(family, Family::Roberta);
        let exported = hf_tensors(&param_values(&loaded), family, 2).expect("export");
        let weights = dir.path().join("model.safetensors");
        let (start, held) = read_header(&weights).expect("header");
        let bytes = std::fs::read(&weights).expect("read");
        let held: HashMap<String, (Vec<usize>, Vec<f32>)> = held
            .into_iter()
            .filter(|(n, _)| !n.starts_with("lm_head.") && !n.ends_with("position_ids"))
            .map(|(n, e)| {
                let v = bytes[start + e.start..start + e.end]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (n, (e.shape, v))
            })
            .collect();
        let names: HashSet<&String> = exported.iter().map(|(n, _, _)| n).collect();
        let held_names: HashSet<&String> = held.keys().collect();
        assert_eq!(
            held_names.difference(&names).collect::<Vec<_>>(),
            names.difference(&held_names).collect::<Vec<_>>()
        );
        for (name, shape, v) in &exported {
            let (held_shape, held_v) = &held[name];
            if name.ends_with("position_embeddings.weight") {
                assert_eq!((shape[0], &held_shape[..]), (14, &[18, 8][..]));
                assert!(v[..16].iter().all(|x| *x == 0.0), "{v:?}");
                assert_eq!(v[16..], held_v[16..14 * 8], "{name}");
            } else if name.ends_with("word_embeddings.weight") {
                // The tokenizer's 55 rows of the file's 58.
                assert_eq!((&shape[..], held_shape[0]), (&[55, 8][..], 58));
                assert_eq!(v[..], held_v[..55 * 8], "{name}");
            } else {
                assert_eq!((shape, v), (held_shape, held_v), "{name}");
            }
        }

        // Without id2label the classification head (pooler included) is new.
        let path = dir.path().join("config.json");
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        json.as_object_mut().map(|m| m.remove("id2label"));
        std::fs::write(&path, json.to_string()).expect("write");
        let bert = open(&config).expect("opens").expect("set");
        assert!(bert.describe(&config).contains("a new pooler"));
        device.seed(43);
        let fresh = shape.init(&device);
        let pooler = |m: &EncoderClassifier| -> Vec<f32> {
            param_values(m)
                .into_iter()
                .find(|(p, _, _)| p == "pooler.weight")
                .expect("a pooler")
                .2
        };
        let own = pooler(&fresh);
        let loaded = bert.load_into(fresh, &device).expect("loads");
        assert_eq!(pooler(&loaded), own);
        assert_ne!(pooler(&loaded), pooler(&source));

        // A position beyond its 16 (18 less RoBERTa's 2) is named.
        let err = open(&run_config(dir.path(), &["model.max_length=17"]))
            .expect_err("too long")
            .to_string();
        assert!(
            err.contains(
                "longer than its 16 positions (max_position_embeddings after RoBERTa's first 2 rows"
            ),
            "{err}"
        );
    }

    /// Rewrites the `BertForSequenceClassification` folder `write_bert` made
    /// in `dir` as `transformers` saves an `ElectraForSequenceClassification`
    /// (`electra.` names, the classification head's `classifier.dense` and
    /// `classifier.out_proj`, a discriminator head's tensor besides) whose
    /// embeddings are `embedding_size` wide.
    fn as_electra(dir: &Path, embedding_size: usize) {
        rewrite(
            dir,
            |name, _, _| {
                *name = match name.as_str() {
                    "cls.predictions.bias" => {
                        "discriminator_predictions.dense_prediction.bias".into()
                    }
                    other => head_named(other, "electra."),
                };
            },
            |config| {
                config["model_type"] = "electra".into();
                config["embedding_size"] = embedding_size.into();
            },
        );
    }

    /// A model of the run `extra` configures, saved as a
    /// `BertForSequenceClassification` folder that `convert` rewrites as
    /// `family`'s, opened and loaded back: the same function, and exported
    /// back under the names the folder holds (but its pre-training head's,
    /// `unused`). Returns the folder, the device, the loaded model and
    /// the run.
    fn family_round_trip(
        extra: &[&str],
        convert: impl Fn(&Path),
        family: &str,
        unused: &str,
    ) -> (tempfile::TempDir, Device, EncoderClassifier, RunConfig) {
        let dir = tempfile::tempdir().expect("tempdir");
        let device = Device::flex();
        let tokenizer = tokenizer();
        let config = run_config(dir.path(), extra);
        let shape = encoder_config(&config, tokenizer.vocab_size());
        device.seed(51);
        let source = shape.init(&device);
        let labels = ["entailment", "neutral", "contradiction"];
        write_bert(dir.path(), &source, &tokenizer, Some(&labels), false);
        convert(dir.path());
        let bert = open(&config).expect("opens").expect("set");
        let description = bert.describe(&config);
        assert!(
            description.contains(&format!("({family};"))
                && description.contains("its classifier, trained for these labels"),
            "{description}"
        );
        device.seed(52);
        let loaded = bert.load_into(shape.init(&device), &device).expect("loads");
        assert_eq!(logits(&loaded, &device), logits(&source, &device));
        let family = Family::for_export(config.model.pooler_activation, config.model.segments);
        let tensors = hf_tensors(&param_values(&loaded), family, 0).expect("export");
        let names: HashSet<String> = tensors.into_iter().map(|(n, _, _)| n).collect();
        let (_, file) = read_header(&dir.path().join("model.safetensors")).expect("header");
        let held: HashSet<String> = file
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !n.starts_with(unused) && !n.ends_with("position_ids"))
            .collect();
        assert_eq!(names, held);
        (dir, device, loaded, config)
    }

    #[test]
    fn an_electra_folder_loads_with_its_gelu_head_and_exports_back_under_its_names() {
        let _rng = crate::tests::flex_rng();
        let (dir, _, _, config) = family_round_trip(
            &["model.pooler_activation=gelu"],
            |dir| as_electra(dir, 8),
            "ELECTRA",
            "discriminator_",
        );
        // BERT's tanh would be another function: named with its fix.
        let err = open(&run_config(dir.path(), &[]))
            .expect_err("tanh")
            .to_string();
        assert!(
            err.contains("model.pooler_activation = \"tanh\" where its pooler applies gelu")
                && err.contains("model.pooler_activation=gelu"),
            "{err}"
        );
        // ELECTRA-small's layout: narrower embeddings, projected.
        let _ = family_round_trip(
            &["model.pooler_activation=gelu", "model.embedding_size=4"],
            |dir| as_electra(dir, 4),
            "ELECTRA",
            "discriminator_",
        );
        // Such a folder needs the run's embeddings as narrow: named with
        // its fix.
        as_electra(dir.path(), 4);
        let err = open(&config).expect_err("narrower").to_string();
        assert!(
            err.contains("model.embedding_size = 0 where its embedding_size is 4")
                && err.contains("model.embedding_size=4"),
            "{err}"
        );
    }

    /// Rewrites the `BertForSequenceClassification` folder `write_bert` made
    /// of a model without segments in `dir` as `transformers` saves a
    /// `DistilBertForSequenceClassification`: `distilbert.` names,
    /// `transformer.layer.i` blocks, `pre_classifier`, a masked-LM head's
    /// tensor besides, and DistilBertConfig's keys.
    fn as_distilbert(dir: &Path) {
        rewrite(
            dir,
            |name, _, _| {
                *name = name
                    .replacen("bert.", "distilbert.", 1)
                    .replace("distilbert.pooler.dense.", "pre_classifier.")
                    .replace("cls.predictions.", "vocab_projector.")
                    .replace(".encoder.layer.", ".transformer.layer.");
                for (bert, distil) in [
                    (".attention.self.query.", ".attention.q_lin."),
                    (".attention.self.key.", ".attention.k_lin."),
                    (".attention.self.value.", ".attention.v_lin."),
                    (".attention.output.dense.", ".attention.out_lin."),
                    (".attention.output.LayerNorm.", ".sa_layer_norm."),
                    (".intermediate.dense.", ".ffn.lin1."),
                    (".output.dense.", ".ffn.lin2."),
                    (".output.LayerNorm.", ".output_layer_norm."),
                ] {
                    *name = name.replace(bert, distil);
                }
            },
            |config| {
                let bert = config.clone();
                *config = serde_json::json!({
                    "model_type": "distilbert",
                    "architectures": ["DistilBertForSequenceClassification"],
                    "dim": bert["hidden_size"],
                    "n_layers": bert["num_hidden_layers"],
                    "n_heads": bert["num_attention_heads"],
                    "hidden_dim": bert["intermediate_size"],
                    "activation": "gelu",
                    "max_position_embeddings": bert["max_position_embeddings"],
                    "vocab_size": bert["vocab_size"],
                    "sinusoidal_pos_embds": false,
                    "id2label": bert["id2label"],
                });
            },
        );
    }

    #[test]
    fn a_distilbert_folder_loads_without_segments_and_with_its_relu_pre_classifier() {
        let _rng = crate::tests::flex_rng();
        let (dir, device, loaded, _) = family_round_trip(
            &["model.segments=0", "model.pooler_activation=relu"],
            as_distilbert,
            "DistilBERT",
            "vocab_",
        );
        // BERT's segments and tanh: each named with its fix.
        let err = open(&run_config(dir.path(), &[]))
            .expect_err("BERT's")
            .to_string();
        assert!(
            err.contains("model.segments = 2 where DistilBERT has no segment embedding")
                && err.contains("model.pooler_activation = \"tanh\" where its pooler applies relu")
                && err.contains("model.pooler_activation=relu model.segments=0"),
            "{err}"
        );
        // A model with segment rows has no DistilBERT layout; as a BERT, a
        // model without them gets two rows of zeros.
        let bert_shape = encoder_config(&run_config(dir.path(), &[]), tokenizer().vocab_size());
        let err = hf_tensors(
            &param_values(&bert_shape.init(&device)),
            Family::Distilbert,
            0,
        )
        .expect_err("segments");
        assert!(err.contains("model.segments=0"), "{err}");
        let as_bert = hf_tensors(&param_values(&loaded), Family::Bert, 0).expect("BERT");
        let rows = as_bert
            .iter()
            .find(|(n, _, _)| n == "bert.embeddings.token_type_embeddings.weight")
            .expect("segments");
        assert_eq!(
            (rows.1.clone(), rows.2.iter().all(|v| *v == 0.0)),
            (vec![2, 8], true)
        );
    }
}
