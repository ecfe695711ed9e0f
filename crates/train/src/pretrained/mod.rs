//! `model.init_from`: a language-model run starts from the weights of a
//! Hugging Face `transformers` GPT-2 folder instead of random ones, to
//! fine-tune them: nanoGPT's `init_from = "gpt2"`, `transformers`'
//! `GPT2LMHeadModel.from_pretrained`. The folder is OpenAI's GPT-2 from the
//! Hub (`openai-community/gpt2`, `-medium`, `-large`, `-xl`, `distilgpt2`)
//! or what `kiln export` writes: `config.json` and `model.safetensors`, and
//! the tokenizer (`tokenizer.json` or `vocab.json`).
//!
//! kiln's GPT is GPT-2's architecture ([`hf_name`] maps one onto the
//! other), so loading changes no value. What the weights need of the run
//! is checked before anything is written, each mismatch named with its
//! fix: the shape (`model.layers`, `heads`, `hidden`, `intermediate`
//! against `n_layer`, `n_head`, `n_embd`, `n_inner`), the GELU (GPT-2's
//! `gelu_new` is `model.gelu = "tanh"`), the block (`model.max_length`
//! within `n_positions`: the position embeddings are cropped, as nanoGPT's
//! `crop_block_size`), LayerNorm's ε, and the tokenizer, compared token by
//! token (weights learnt for other ids would train, but on nonsense). A
//! padded vocabulary's extra rows (`model.vocab_multiple`) start at zero:
//! those ids never occur and their logits are masked out of the loss.
//!
//! [`bert`] does the same for the sentence-pair encoder from a BERT folder,
//! and gives `kiln export` BERT's names for an encoder; the safetensors
//! header reader and the dtype conversions here serve both.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kiln_config::{Gelu, RunConfig};
use kiln_data::Tokenizer;
use serde_json::Value;

use crate::error::TrainError;
use crate::params::{load_values, param_entries};

pub(crate) mod bert;

/// kiln's parameter path → GPT-2's name in `GPT2LMHeadModel`'s state dict.
pub fn hf_name(path: &str) -> Option<String> {
    let top = match path {
        "wte.weight" => Some("transformer.wte.weight"),
        "wpe.weight" => Some("transformer.wpe.weight"),
        "ln_f.gamma" => Some("transformer.ln_f.weight"),
        "ln_f.beta" => Some("transformer.ln_f.bias"),
        _ => None,
    };
    if let Some(name) = top {
        return Some(name.to_string());
    }
    let rest = path.strip_prefix("blocks.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, param) = rest.split_once('.')?;
    let module = match module {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "qkv" => "attn.c_attn",
        "attn_proj" => "attn.c_proj",
        "fc" => "mlp.c_fc",
        "mlp_proj" => "mlp.c_proj",
        _ => return None,
    };
    let param = match (module, param) {
        ("ln_1" | "ln_2", "gamma") => "weight",
        ("ln_1" | "ln_2", "beta") => "bias",
        (_, "weight") => "weight",
        (_, "bias") => "bias",
        _ => return None,
    };
    Some(format!("transformer.h.{layer}.{module}.{param}"))
}

/// The GPT-2 folder `model.init_from` names, checked against the run: its
/// weights are read when they are loaded ([`Pretrained::load_into`]).
#[derive(Debug)]
pub(crate) struct Pretrained {
    folder: PathBuf,
    weights: PathBuf,
    /// The safetensors header: each tensor's name (`transformer.` dropped),
    /// dtype, shape and byte range.
    tensors: Vec<(String, Entry)>,
    /// Where the tensors' bytes start in the file.
    data_start: usize,
    positions: usize,
    vocab_size: usize,
    /// Which tokenizer file the run's was compared with, if the folder has one.
    tokenizer: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// `transformers`' GPT-2 buffers that are no parameters (older exports
/// saved the causal mask): skipped.
fn is_buffer(name: &str) -> bool {
    name.strip_prefix("h.").is_some_and(|rest| {
        rest.split_once('.').is_some_and(|(layer, what)| {
            layer.parse::<usize>().is_ok() && matches!(what, "attn.bias" | "attn.masked_bias")
        })
    })
}

fn fail(path: &Path, why: impl Into<String>) -> TrainError {
    TrainError::Pretrained {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// The folder `model.init_from` names, checked against `config` and the
/// run's `tokenizer` (everything but the weights' values); `None` where the
/// key is unset.
pub(crate) fn open(
    config: &RunConfig,
    tokenizer: &Tokenizer,
) -> Result<Option<Pretrained>, TrainError> {
    let Some(folder) = config.model.init_from.as_deref() else {
        return Ok(None);
    };
    if !config.model.init_labels.is_empty() {
        return Err(fail(
            Path::new(folder),
            "is a language model's: model.init_labels names a sentence-pair classifier's outputs, which a GPT-2 has not; leave it []",
        ));
    }
    open_folder(Path::new(folder), config, tokenizer).map(Some)
}

/// The GPT-2 folder `folder`, checked against `config` and the run's
/// `tokenizer` (everything but the weights' values).
pub(crate) fn open_folder(
    folder: &Path,
    config: &RunConfig,
    tokenizer: &Tokenizer,
) -> Result<Pretrained, TrainError> {
    let folder = folder.to_path_buf();
    if !folder.is_dir() {
        return Err(fail(
            &folder,
            "is not a folder: it names a transformers GPT-2 folder (config.json and model.safetensors): \
             OpenAI's GPT-2 (`huggingface-cli download openai-community/gpt2 config.json model.safetensors tokenizer.json --local-dir gpt2`) or a \
             `kiln export` of a run",
        ));
    }
    let (config_path, shape) = read_shape(&folder)?;
    shape.check(config).map_err(|why| fail(&config_path, why))?;
    if tokenizer.vocab_size() != shape.vocab_size {
        return Err(fail(
            &config_path,
            format!(
                "has a vocabulary of {} tokens, the run's tokenizer (data.tokenizer = {}) has {}: \
                 tokenize as the weights were (data.tokenizer=gpt2 for OpenAI's GPT-2, or \
                 data.tokenizer_file={})",
                shape.vocab_size,
                tokenizer_name(config),
                tokenizer.vocab_size(),
                folder.join("tokenizer.json").display()
            ),
        ));
    }
    let tokenizer_file = check_tokenizer(&folder, config, tokenizer)?;

    let weights = weights_file(&folder, "GPT2LMHeadModel")?;
    let (data_start, tensors) = read_header(&weights)?;
    Ok(Pretrained {
        folder,
        weights,
        tensors,
        data_start,
        positions: shape.positions,
        vocab_size: shape.vocab_size,
        tokenizer: tokenizer_file,
    })
}

/// A run configuration for the GPT-2 folder `folder` on its own (`kiln
/// sample`): the built-in defaults with the folder's shape, its full
/// context as the block, its tokenizer, and `model.init_from` set to it.
pub(crate) fn config_for_folder(
    folder: &Path,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<RunConfig, TrainError> {
    let (_, shape) = read_shape(folder)?;
    let mut config =
        kiln_config::resolve_overrides(&kiln_config::Presets::built_in(), &[], hardware)?.config;
    let m = &mut config.model;
    (m.layers, m.heads, m.hidden, m.intermediate, m.gelu) = (
        shape.layers,
        shape.heads,
        shape.hidden,
        shape.intermediate,
        shape.gelu,
    );
    (m.max_length, m.vocab_multiple) = (shape.positions, 1);
    (m.dropout, m.attention_dropout) = (0.0, 0.0);
    m.init_from = Some(folder.display().to_string());
    config.data.tokenizer_file = Some(folder.join("tokenizer.json").display().to_string());
    Ok(config)
}

/// The folder's `model.safetensors`; where it holds its weights otherwise,
/// the error says how to save them as kiln reads them (`class` is the
/// `transformers` class that loads them).
fn weights_file(folder: &Path, class: &str) -> Result<PathBuf, TrainError> {
    let weights = folder.join("model.safetensors");
    if weights.is_file() {
        return Ok(weights);
    }
    let why = if folder.join("model.safetensors.index.json").is_file() {
        "holds its weights in several safetensors files (model.safetensors.index.json); kiln reads one model.safetensors".to_string()
    } else if folder.join("pytorch_model.bin").is_file() {
        format!(
            "holds its weights as pytorch_model.bin (a Python pickle), which kiln does not read: save them as \
             safetensors (`{class}.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)`)"
        )
    } else {
        "has no model.safetensors".to_string()
    };
    Err(fail(folder, why))
}

/// The folder's `config.json` (its path, for messages) and the shape it
/// describes.
fn read_shape(folder: &Path) -> Result<(PathBuf, Gpt2Shape), TrainError> {
    read_config(folder, Gpt2Shape::from_json)
}

/// `folder`'s `config.json` (its path, for messages) read by `parse`; each
/// failure names the file.
fn read_config<S>(
    folder: &Path,
    parse: impl Fn(&Value) -> Result<S, String>,
) -> Result<(PathBuf, S), TrainError> {
    let config_path = folder.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| fail(&config_path, format!("cannot be read: {e}")))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| fail(&config_path, format!("is not JSON: {e}")))?;
    let shape = parse(&json).map_err(|why| fail(&config_path, why))?;
    Ok((config_path, shape))
}

fn tokenizer_name(config: &RunConfig) -> String {
    match &config.data.tokenizer_file {
        Some(file) => format!("the file {file}"),
        None => format!("{:?}", config.data.tokenizer).to_lowercase(),
    }
}

/// GPT-2's shape as its `config.json` says, with `transformers`' defaults.
#[derive(Debug, PartialEq)]
struct Gpt2Shape {
    layers: usize,
    heads: usize,
    hidden: usize,
    intermediate: usize,
    positions: usize,
    vocab_size: usize,
    gelu: Gelu,
}

impl Gpt2Shape {
    fn from_json(json: &Value) -> Result<Self, String> {
        let model_type = json.get("model_type").and_then(Value::as_str);
        if model_type != Some("gpt2") {
            return Err(format!(
                "describes a `{}` model; kiln's GPT loads GPT-2's architecture (model_type \"gpt2\")",
                model_type.unwrap_or("(no model_type)")
            ));
        }
        let count = |key: &str| positive(json, key);
        let hidden = count("n_embd")?;
        let intermediate = match json.get("n_inner") {
            None | Some(Value::Null) => 4 * hidden,
            Some(_) => count("n_inner")?,
        };
        let activation = json
            .get("activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        let gelu = gelu_named(activation, "activation_function", "GPT")?;
        let epsilon = json
            .get("layer_norm_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5);
        let kiln_epsilon = kiln_model::kernels::LAYER_NORM_EPSILON;
        if (epsilon - kiln_epsilon).abs() > 1e-12 {
            return Err(format!(
                "has layer_norm_epsilon {epsilon:e}; kiln's LayerNorm uses GPT-2's {kiln_epsilon:e}"
            ));
        }
        for (key, want, meaning) in [
            ("scale_attn_weights", true, "scores scaled by 1/√head width"),
            (
                "scale_attn_by_inverse_layer_idx",
                false,
                "no scaling by layer",
            ),
            (
                "tie_word_embeddings",
                true,
                "the output projection tied to the token embedding",
            ),
        ] {
            if let Some(v) = json.get(key).and_then(Value::as_bool)
                && v != want
            {
                return Err(format!(
                    "has {key} = {v}; kiln's GPT is GPT-2's default ({meaning})"
                ));
            }
        }
        let positions = match json.get("n_positions") {
            Some(_) => count("n_positions")?,
            None => count("n_ctx")?,
        };
        Ok(Self {
            layers: count("n_layer")?,
            heads: count("n_head")?,
            hidden,
            intermediate,
            positions,
            vocab_size: count("vocab_size")?,
            gelu,
        })
    }

    /// Every key of the run's model that the weights need otherwise, in one
    /// message with the overrides that fix them.
    fn check(&self, config: &RunConfig) -> Result<(), String> {
        let mut fit = Fit::new(config);
        fit.shape([
            ("layers", "n_layer", self.layers),
            ("heads", "n_head", self.heads),
            ("hidden", "n_embd", self.hidden),
            ("intermediate", "n_inner", self.intermediate),
        ]);
        fit.gelu(self.gelu);
        fit.positions(self.positions, "n_positions");
        fit.into_result("GPT-2")
    }
}

/// The keys of the run's `model.*` a folder's weights need otherwise, each
/// with the override that fixes it, gathered into one message.
pub(super) struct Fit<'a> {
    config: &'a RunConfig,
    /// What differs, and its fix.
    wrong: Vec<(String, String)>,
}

impl<'a> Fit<'a> {
    pub(super) fn new(config: &'a RunConfig) -> Self {
        Self {
            config,
            wrong: Vec::new(),
        }
    }

    /// A mismatch: what differs, and the override that fixes it.
    pub(super) fn push(&mut self, what: String, fix: String) {
        self.wrong.push((what, fix));
    }

    /// `model.<key>` against the folder's `<field>` for each `(key, field,
    /// theirs)` of layers, heads, hidden and intermediate.
    pub(super) fn shape(&mut self, fields: [(&str, &str, usize); 4]) {
        let m = &self.config.model;
        let runs = [m.layers, m.heads, m.hidden, m.intermediate];
        for ((key, field, theirs), run) in fields.into_iter().zip(runs) {
            if run != theirs {
                self.push(
                    format!("model.{key} = {run} where its {field} is {theirs}"),
                    format!("model.{key}={theirs}"),
                );
            }
        }
    }

    /// `model.gelu` against the GELU the weights were trained with.
    pub(super) fn gelu(&mut self, theirs: Gelu) {
        let run = self.config.model.gelu;
        if run != theirs {
            self.push(
                format!(
                    "model.gelu = \"{}\" where it was trained with the {} GELU",
                    run.as_str(),
                    theirs.as_str()
                ),
                format!("model.gelu={}", theirs.as_str()),
            );
        }
    }

    /// `model.max_length` within the folder's `positions` (`field` says
    /// where they come from).
    pub(super) fn positions(&mut self, positions: usize, field: &str) {
        let run = self.config.model.max_length;
        if run > positions {
            self.push(
                format!(
                    "model.max_length = {run} is longer than its {positions} positions ({field})"
                ),
                format!("model.max_length={positions}"),
            );
        }
    }

    /// `Ok` where nothing differs; else one message naming every mismatch
    /// of the `architecture`'s weights, and all the fixes.
    pub(super) fn into_result(self, architecture: &str) -> Result<(), String> {
        if self.wrong.is_empty() {
            return Ok(());
        }
        let what: Vec<&str> = self.wrong.iter().map(|w| w.0.as_str()).collect();
        let fix: Vec<&str> = self.wrong.iter().map(|w| w.1.as_str()).collect();
        Err(format!(
            "holds {} {architecture} the run's model does not match: {}. Set the run's to the weights': {}",
            if architecture.starts_with(['A', 'E', 'I', 'O', 'U']) {
                "an"
            } else {
                "a"
            },
            what.join("; "),
            fix.join(" ")
        ))
    }
}

/// The positive integer `key` of a `config.json`.
pub(super) fn positive(json: &Value, key: &str) -> Result<usize, String> {
    json.get(key)
        .and_then(Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("has no positive integer `{key}`"))
}

/// `transformers`' activation name as kiln's GELU.
pub(super) fn gelu_named(activation: &str, key: &str, model: &str) -> Result<Gelu, String> {
    match activation {
        "gelu" => Ok(Gelu::Exact),
        "gelu_new" | "gelu_pytorch_tanh" => Ok(Gelu::Tanh),
        other => Err(format!(
            "has {key} \"{other}\"; kiln's {model} has GELU, exact (\"gelu\") or tanh (\"gelu_new\")"
        )),
    }
}

/// Compares the run's tokenizer with the folder's (`tokenizer.json`, else
/// `vocab.json`) token by token; returns the file compared, `None` where
/// the folder has neither (then only the vocabulary's size was checked).
fn check_tokenizer(
    folder: &Path,
    config: &RunConfig,
    tokenizer: &Tokenizer,
) -> Result<Option<PathBuf>, TrainError> {
    let json = folder.join("tokenizer.json");
    let vocab_json = folder.join("vocab.json");
    let (file, theirs) = if json.is_file() {
        let theirs = Tokenizer::load(&json).map_err(|e| fail(&json, e.to_string()))?;
        (json, theirs.vocab())
    } else if vocab_json.is_file() {
        let text = std::fs::read_to_string(&vocab_json)
            .map_err(|e| fail(&vocab_json, format!("cannot be read: {e}")))?;
        let theirs: HashMap<String, u32> = serde_json::from_str(&text).map_err(|e| {
            fail(
                &vocab_json,
                format!("is not a JSON object of tokens and ids: {e}"),
            )
        })?;
        (vocab_json, theirs)
    } else {
        return Ok(None);
    };
    let ours = tokenizer.vocab();
    let mut differing: Vec<(&String, u32)> = theirs
        .iter()
        .filter(|(token, id)| ours.get(*token) != Some(id))
        .map(|(token, id)| (token, *id))
        .collect();
    if differing.is_empty() && ours.len() == theirs.len() {
        return Ok(Some(file));
    }
    differing.sort_by_key(|(token, id)| (*id, token.as_str()));
    let example = match differing.first() {
        Some((token, id)) => match ours.get(*token) {
            Some(here) => format!(": {token:?} is id {id} there and {here} in the run's"),
            None => format!(": {token:?} (id {id} there) is not in the run's"),
        },
        None => String::new(),
    };
    Err(fail(
        &file,
        format!(
            "is another tokenizer than the run's (data.tokenizer = {}): {} of its {} tokens differ{example}. \
             Tokenize as the weights were: data.tokenizer=gpt2 for OpenAI's GPT-2, or data.tokenizer_file={}",
            tokenizer_name(config),
            differing.len(),
            theirs.len(),
            file.display()
        ),
    ))
}

/// A safetensors file's header: where the data starts, and each tensor.
fn read_header(path: &Path) -> Result<(usize, Vec<(String, Entry)>), TrainError> {
    let bad = |why: String| fail(path, why);
    let mut file = std::fs::File::open(path).map_err(|e| bad(format!("cannot be read: {e}")))?;
    let size = file
        .metadata()
        .map_err(|e| bad(format!("cannot be read: {e}")))?
        .len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("is not a safetensors file (shorter than its header)".into()))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 || 8 + len > size {
        return Err(bad(format!(
            "is not a safetensors file (a header of {len} bytes in a file of {size})"
        )));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(format!("cannot be read: {e}")))?;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("is not a safetensors file (its header: {e})")))?;
    let data_len = (size - 8 - len) as usize;
    let mut tensors = Vec::new();
    for (name, value) in header {
        if name == "__metadata__" {
            continue;
        }
        let entry: Option<Entry> = (|| {
            let dtype = value.get("dtype")?.as_str()?.to_string();
            let shape = value
                .get("shape")?
                .as_array()?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<Vec<_>>>()?;
            let offsets = value.get("data_offsets")?.as_array()?;
            let start = offsets.first()?.as_u64()? as usize;
            let end = offsets.get(1)?.as_u64()? as usize;
            Some(Entry {
                dtype,
                shape,
                start,
                end,
            })
        })();
        let entry = entry.ok_or_else(|| bad(format!("has a malformed entry for `{name}`")))?;
        if entry.start > entry.end || entry.end > data_len {
            return Err(bad(format!(
                "is cut short: `{name}` ends at byte {} of {data_len}",
                entry.end
            )));
        }
        let name = name
            .strip_prefix("transformer.")
            .map_or(name.clone(), str::to_string);
        tensors.push((name, entry));
    }
    Ok((8 + len as usize, tensors))
}

/// The values of the tensor `name` (`entry` in the header of `weights`,
/// whose data is `data`) as f32; an unread dtype or a size that is not its
/// shape's is an error naming it.
fn tensor_values(
    weights: &Path,
    data: &[u8],
    name: &str,
    entry: &Entry,
) -> Result<Vec<f32>, TrainError> {
    let values = data
        .get(entry.start..entry.end)
        .and_then(|b| to_f32(b, &entry.dtype))
        .ok_or_else(|| {
            fail(
                weights,
                format!(
                    "holds `{name}` as {}; kiln reads F32, F16, BF16 and F64",
                    entry.dtype
                ),
            )
        })?;
    if values.len() != entry.shape.iter().product::<usize>() {
        return Err(fail(
            weights,
            format!(
                "holds {} values for `{name}` of shape {:?}",
                values.len(),
                entry.shape
            ),
        ));
    }
    Ok(values)
}

/// A tensor's bytes as f32 (F32, F16, BF16 and F64 read).
fn to_f32(bytes: &[u8], dtype: &str) -> Option<Vec<f32>> {
    Some(match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "F16" => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "F64" => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32)
            .collect(),
        _ => return None,
    })
}

impl Pretrained {
    /// The start line: where the weights came from and what was adapted.
    pub(crate) fn describe(&self, config: &RunConfig, padded_vocab: usize) -> String {
        let mut notes = Vec::new();
        if config.model.max_length < self.positions {
            notes.push(format!(
                "position embeddings cropped {} → {}",
                self.positions, config.model.max_length
            ));
        }
        if padded_vocab > self.vocab_size {
            notes.push(format!(
                "vocabulary rows {} → {padded_vocab}, the padding's at zero",
                self.vocab_size
            ));
        }
        match &self.tokenizer {
            Some(file) => notes.push(format!(
                "tokenizer equal to {}",
                file.file_name()
                    .map_or(String::new(), |f| f.to_string_lossy().into_owned())
            )),
            None => notes.push(
                "no tokenizer.json or vocab.json beside them: only the vocabulary's size checked"
                    .into(),
            ),
        }
        format!(
            "weights: from {} (GPT-2, {}; {})",
            self.folder.display(),
            self.weights
                .file_name()
                .map_or(String::new(), |f| f.to_string_lossy().into_owned()),
            notes.join("; ")
        )
    }

    /// `model` (a GPT) with every parameter replaced by the folder's: each
    /// kiln parameter under its GPT-2 name ([`hf_name`]), the
    /// position embeddings cropped to the block, a padded vocabulary's
    /// rows at zero. Fails, naming the tensor, where the file lacks one,
    /// has another shape, or holds a tensor the model does not have.
    pub(crate) fn load_into<M: burn::module::Module>(
        &self,
        model: M,
        device: &Device,
    ) -> Result<M, TrainError> {
        let bytes = std::fs::read(&self.weights)
            .map_err(|e| fail(&self.weights, format!("cannot be read: {e}")))?;
        let data = &bytes[self.data_start.min(bytes.len())..];
        let mut file: HashMap<&str, &Entry> = self
            .tensors
            .iter()
            .filter(|(name, _)| !is_buffer(name))
            .map(|(name, entry)| (name.as_str(), entry))
            .collect();
        let read = |name: &str, entry: &Entry| tensor_values(&self.weights, data, name, entry);
        let mut values = HashMap::new();
        let mut wte = None;
        for param in param_entries(&model) {
            let hf = hf_name(&param.path).ok_or_else(|| {
                fail(
                    &self.weights,
                    format!(
                        "cannot fill `{}`: kiln's GPT has no GPT-2 name for it",
                        param.path
                    ),
                )
            })?;
            let name = hf.strip_prefix("transformer.").unwrap_or(&hf);
            let entry = file.remove(name).ok_or_else(|| {
                fail(
                    &self.weights,
                    format!("has no `{name}` (kiln's `{}`)", param.path),
                )
            })?;
            let mut v = read(name, entry)?;
            let want = &param.shape;
            let fits = match (name, entry.shape.as_slice(), want.as_slice()) {
                // The block may be shorter than the positions learnt.
                ("wpe.weight", [p, d], [block, width]) if d == width && block <= p => {
                    v.truncate(block * width);
                    true
                }
                // A padded vocabulary: the extra ids never occur.
                ("wte.weight", [rows, d], [padded, width]) if d == width && rows <= padded => {
                    v.resize(padded * width, 0.0);
                    true
                }
                (_, have, want) => have == want,
            };
            if !fits {
                return Err(fail(
                    &self.weights,
                    format!(
                        "holds `{name}` as {:?}; the run's model has {:?} for `{}`",
                        entry.shape, want, param.path
                    ),
                ));
            }
            if name == "wte.weight" {
                wte = Some(entry);
            }
            values.insert(param.path, (want.clone(), v));
        }
        // The output projection is the token embedding in both models; a
        // file that writes it out must hold the same values.
        if let Some(head) = file.remove("lm_head.weight")
            && let Some(wte) = wte
            && (head.shape != wte.shape
                || read("lm_head.weight", head)? != read("wte.weight", wte)?)
        {
            return Err(fail(
                &self.weights,
                "has an lm_head.weight other than its token embedding; kiln's GPT ties the two, as GPT-2 does",
            ));
        }
        if let Some(extra) = file.keys().min() {
            return Err(fail(
                &self.weights,
                format!(
                    "holds `{extra}`, which kiln's GPT has no parameter for ({} such tensors)",
                    file.len()
                ),
            ));
        }
        drop(bytes);
        load_values(model, values, device).map_err(|why| fail(&self.weights, why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn safetensors_file(
        dir: &Path,
        tensors: &[(&str, &str, Vec<usize>, Vec<u8>)],
    ) -> PathBuf {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            header.insert(
                name.to_string(),
                serde_json::json!({
                    "dtype": dtype,
                    "shape": shape,
                    "data_offsets": [data.len(), data.len() + bytes.len()],
                }),
            );
            data.extend_from_slice(bytes);
        }
        let header = serde_json::to_vec(&header).expect("json");
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&header);
        out.extend_from_slice(&data);
        let path = dir.join("model.safetensors");
        std::fs::write(&path, out).expect("write");
        path
    }

    #[test]
    fn every_gpt_parameter_has_its_gpt2_name() {
        let _rng = crate::tests::flex_rng();
        let config = crate::tests::config(&["model.layers=2"]);
        let gpt = crate::translate::gpt_config(&config, 65);
        let model = gpt.init(&burn::tensor::Device::flex());
        let names: Vec<String> = crate::params::param_entries(&model)
            .iter()
            .map(|e| hf_name(&e.path).unwrap_or_else(|| panic!("{} unmapped", e.path)))
            .collect();
        assert_eq!(names.len(), 4 + 2 * 12);
        assert!(names.contains(&"transformer.h.1.attn.c_attn.weight".to_string()));
        assert!(names.contains(&"transformer.h.0.ln_2.bias".to_string()));
        assert_eq!(hf_name("blocks.0.dropout.x"), None);
        assert_eq!(hf_name("blocks.x.fc.weight"), None);
    }

    #[test]
    fn f16_bf16_f64_and_f32_read_as_f32() {
        let values = [1.5f32, -0.25, 3.0e-3, 65504.0];
        let f32s: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16s: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f64s: Vec<u8> = values
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect();
        assert_eq!(to_f32(&f32s, "F32").expect("f32"), values);
        let f16 = to_f32(&f16s, "F16").expect("f16");
        let bf16 = to_f32(&bf16s, "BF16").expect("bf16");
        for (i, v) in values.iter().enumerate() {
            assert!(
                (f16[i] - v).abs() <= v.abs() * 1e-3,
                "f16 {} vs {v}",
                f16[i]
            );
            assert!(
                (bf16[i] - v).abs() <= v.abs() * 8e-3,
                "bf16 {} vs {v}",
                bf16[i]
            );
        }
        assert_eq!(f16[0], 1.5);
        assert_eq!(bf16[1], -0.25);
        assert_eq!(to_f32(&f64s, "F64").expect("f64"), values);
        assert!(to_f32(&f32s, "I8").is_none());
    }

    #[test]
    fn the_header_drops_transformers_prefix_and_checks_the_byte_ranges() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = safetensors_file(
            dir.path(),
            &[
                ("transformer.wte.weight", "F32", vec![2], vec![0; 8]),
                ("h.0.attn.bias", "F32", vec![1], vec![0; 4]),
            ],
        );
        let (start, tensors) = read_header(&path).expect("header");
        let names: Vec<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
        assert_eq!(names, ["h.0.attn.bias", "wte.weight"]);
        assert_eq!(
            start + 12,
            std::fs::metadata(&path).expect("meta").len() as usize
        );
        assert!(is_buffer("h.0.attn.bias") && is_buffer("h.11.attn.masked_bias"));
        assert!(!is_buffer("h.0.attn.c_attn.bias") && !is_buffer("ln_f.bias"));

        // A file cut short is named, with the tensor that runs past its end.
        let bytes = std::fs::read(&path).expect("read");
        std::fs::write(&path, &bytes[..bytes.len() - 4]).expect("write");
        let err = read_header(&path).expect_err("cut short").to_string();
        assert!(
            err.contains("is cut short: `transformer.wte.weight`")
                || err.contains("is cut short: `h.0.attn.bias`"),
            "{err}"
        );
        std::fs::write(&path, b"not a safetensors file").expect("write");
        let err = read_header(&path).expect_err("garbage").to_string();
        assert!(err.contains("is not a safetensors file"), "{err}");
    }

    fn hub_config() -> Value {
        // OpenAI's GPT-2 (124 M) as the Hub's config.json has it.
        serde_json::json!({
            "activation_function": "gelu_new",
            "architectures": ["GPT2LMHeadModel"],
            "layer_norm_epsilon": 1e-05,
            "model_type": "gpt2",
            "n_ctx": 1024,
            "n_embd": 768,
            "n_head": 12,
            "n_inner": null,
            "n_layer": 12,
            "n_positions": 1024,
            "vocab_size": 50257
        })
    }

    #[test]
    fn gpt2s_config_reads_with_transformers_defaults() {
        let shape = Gpt2Shape::from_json(&hub_config()).expect("gpt2");
        assert_eq!(
            shape,
            Gpt2Shape {
                layers: 12,
                heads: 12,
                hidden: 768,
                intermediate: 3072,
                positions: 1024,
                vocab_size: 50257,
                gelu: Gelu::Tanh,
            }
        );
        let mut llama = hub_config();
        llama["model_type"] = "llama".into();
        let err = Gpt2Shape::from_json(&llama).expect_err("llama");
        assert!(err.contains("a `llama` model"), "{err}");
        let mut relu = hub_config();
        relu["activation_function"] = "relu".into();
        assert!(
            Gpt2Shape::from_json(&relu)
                .expect_err("relu")
                .contains("\"relu\"")
        );
        let mut untied = hub_config();
        untied["tie_word_embeddings"] = false.into();
        assert!(
            Gpt2Shape::from_json(&untied)
                .expect_err("untied")
                .contains("tie_word_embeddings = false")
        );
    }

    #[test]
    fn a_run_of_another_shape_is_told_every_key_to_set() {
        let shape = Gpt2Shape::from_json(&hub_config()).expect("gpt2");
        let mut config = crate::tests::config(&["hardware=cpu"]);
        let err = shape.check(&config).expect_err("the baby GPT is no GPT-2");
        for part in [
            "model.layers = 4 where its n_layer is 12",
            "model.gelu = \"exact\" where it was trained with the tanh GELU",
            "model.layers=12 model.heads=12 model.hidden=768 model.intermediate=3072 model.gelu=tanh",
        ] {
            assert!(err.contains(part), "{part} in {err}");
        }
        let m = &mut config.model;
        (m.layers, m.heads, m.hidden, m.intermediate, m.gelu) = (12, 12, 768, 3072, Gelu::Tanh);
        m.max_length = 256;
        assert_eq!(shape.check(&config), Ok(()));
        config.model.max_length = 2048;
        let err = shape.check(&config).expect_err("too long");
        assert!(
            err.contains("longer than its 1024 positions") && err.contains("model.max_length=1024"),
            "{err}"
        );
    }

    #[test]
    fn a_language_models_init_labels_is_refused_before_the_folder_is_read() {
        let config = crate::tests::config(&[
            "hardware=cpu",
            "model.init_from=gpt2",
            r#"model.init_labels=["entailment", "neutral", "contradiction"]"#,
        ]);
        let tokenizer = Tokenizer::char_level("ab").expect("tokenizer");
        let Err(err) = open(&config, &tokenizer) else {
            panic!("refused")
        };
        let err = err.to_string();
        assert!(
            err.contains("gpt2")
                && err.contains("model.init_labels names a sentence-pair classifier's outputs"),
            "{err}"
        );
    }
}
