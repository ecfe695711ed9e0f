//! `kiln sample`: text from a trained GPT, as nanoGPT's `sample.py` — from
//! a language-model run's newest good checkpoint, or from a `transformers`
//! GPT-2 folder (OpenAI's GPT-2, a `kiln export`) read as
//! `model.init_from` reads it. The run's own `samples.txt` is written by
//! the same code ([`generate_texts`]): with the run's settings and seed,
//! `kiln sample RUN` gives its texts again.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::Module;
use burn::tensor::Device;
use kiln_config::{RunConfig, SampleSection, Workload};
use kiln_data::Tokenizer;
use kiln_model::Gpt;
use rand::SeedableRng;
use serde::Serialize;

use crate::checkpoint;
use crate::device::select_device;
use crate::error::TrainError;
use crate::rundir::RunDir;

/// What to generate; `None` takes the run's `sample.*` (a GPT-2 folder:
/// the built-in defaults) and its `training.seed`.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct SampleRequest {
    /// The text the samples continue; `None`: a newline, as the run's own.
    pub prompt: Option<String>,
    /// Texts to generate.
    pub count: Option<usize>,
    /// Tokens each.
    pub tokens: Option<usize>,
    /// Sampling temperature (above 0).
    pub temperature: Option<f64>,
    /// Among the k most likely tokens; 0: among all.
    pub top_k: Option<usize>,
    /// Among the most likely tokens whose probabilities first reach it; 1:
    /// among all.
    pub top_p: Option<f64>,
    /// The random stream's seed.
    pub seed: Option<u64>,
    /// A run's best model (`best.safetensors`) instead of its newest
    /// checkpoint.
    pub best: bool,
}

/// What [`sample`] generated.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Samples {
    /// What the weights came from: a run's checkpoint or a GPT-2 folder.
    pub source: String,
    /// The device it ran on.
    pub device: String,
    /// The prompt, and its length in tokens.
    pub prompt: String,
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// The settings used.
    pub tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Top-k (0: all).
    pub top_k: usize,
    /// Top-p (1: all).
    pub top_p: f64,
    /// The seed.
    pub seed: u64,
    /// Each text after the prompt.
    pub continuations: Vec<String>,
    /// Notes on damaged checkpoints skipped on the way.
    pub notes: Vec<String>,
}

/// Texts a model generated.
pub(crate) struct Generated {
    /// The prompt's tokens.
    pub(crate) prompt_tokens: usize,
    /// Each text after the prompt.
    pub(crate) texts: Vec<String>,
    /// A stop was asked before the last text had all its tokens: the last
    /// is cut short, and the texts after it missing.
    pub(crate) cut_short: bool,
}

/// `count` continuations of `prompt` by `model` (`source` names it in
/// errors), from one random stream seeded with `seed`, until `stop` is
/// asked.
#[allow(clippy::too_many_arguments, reason = "what the texts are drawn from")]
pub(crate) fn generate_texts(
    model: &Gpt,
    source: &str,
    tokenizer: &Tokenizer,
    prompt: &str,
    settings: &SampleSection,
    seed: u64,
    device: &Device,
    stop: Option<&AtomicBool>,
) -> Result<Generated, TrainError> {
    let model = model.valid();
    let ids = tokenizer.encode(prompt).map_err(|e| TrainError::Prompt {
        why: unencodable(tokenizer, prompt, &e),
    })?;
    let ids = if ids.is_empty() { vec![0] } else { ids };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let sampling =
        kiln_model::Sampling::new(settings.temperature, settings.top_k).with_top_p(settings.top_p);
    let mut texts = Vec::new();
    let mut cut_short = false;
    for _ in 0..settings.count {
        let out = model
            .generate_until(&ids, settings.tokens, &sampling, &mut rng, device, || {
                stop.is_some_and(|f| f.load(Ordering::Relaxed))
            })
            .map_err(|e| TrainError::Diverged {
                model: source.to_string(),
                why: e.to_string(),
            })?;
        texts.push(tokenizer.decode(&out[ids.len()..])?);
        if out.len() < ids.len() + settings.tokens {
            cut_short = true;
            break;
        }
    }
    Ok(Generated {
        prompt_tokens: ids.len(),
        texts,
        cut_short,
    })
}

/// Why `tokenizer` could not encode `text`: the characters its vocabulary
/// lacks (a character-level one holds its corpus's only), else `err`.
pub(crate) fn unencodable(tokenizer: &Tokenizer, text: &str, err: &kiln_data::DataError) -> String {
    let mut unknown: Vec<char> = text
        .chars()
        .filter(|c| tokenizer.token_id(&c.to_string()).is_none())
        .collect();
    unknown.sort_unstable();
    unknown.dedup();
    if unknown.is_empty() {
        return err.to_string();
    }
    let shown = unknown.len().min(20);
    format!(
        "{}{} {} not in the model's vocabulary ({} tokens; a character-level one holds its corpus's characters only)",
        unknown[..shown]
            .iter()
            .map(|c| format!("{c:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        if unknown.len() > shown {
            format!(" and {} more", unknown.len() - shown)
        } else {
            String::new()
        },
        if unknown.len() == 1 { "is" } else { "are" },
        tokenizer.vocab_size()
    )
}

/// Generates from `from`: a language-model run directory (its newest good
/// checkpoint) or a `transformers` GPT-2 folder (`config.json`,
/// `model.safetensors`, `tokenizer.json`), on the device the run's
/// `device.*` chooses (a folder: the defaults').
pub fn sample(
    from: &Path,
    request: &SampleRequest,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Samples, TrainError> {
    let Loaded {
        model,
        tokenizer,
        config,
        source,
        notes,
        device,
    } = load_lm(
        from,
        request.best,
        "sampling from a sentence-pair classifier",
        hardware,
    )?;
    let mut settings = config.sample.clone();
    settings.count = request.count.unwrap_or(settings.count);
    settings.tokens = request.tokens.unwrap_or(settings.tokens);
    settings.temperature = request.temperature.unwrap_or(settings.temperature);
    settings.top_k = request.top_k.unwrap_or(settings.top_k);
    settings.top_p = request.top_p.unwrap_or(settings.top_p);
    let seed = request.seed.unwrap_or(config.training.seed);
    let prompt = (request.prompt.clone())
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "\n".into());
    // `kiln sample` stops at Ctrl-C's default: the process ends.
    let generated = generate_texts(
        &model,
        &source,
        &tokenizer,
        &prompt,
        &settings,
        seed,
        &device.device,
        None,
    )?;
    let (prompt_tokens, continuations) = (generated.prompt_tokens, generated.texts);
    Ok(Samples {
        source,
        device: device.name,
        prompt,
        prompt_tokens,
        tokens: settings.tokens,
        temperature: settings.temperature,
        top_k: settings.top_k,
        top_p: settings.top_p,
        seed,
        continuations,
        notes,
    })
}

/// A language model ready to run: from a run or a GPT-2 folder.
pub(crate) struct Loaded {
    /// The model, on `device`.
    pub(crate) model: Gpt,
    /// Its tokenizer.
    pub(crate) tokenizer: Tokenizer,
    /// The run's configuration (a folder: the defaults with its shape).
    pub(crate) config: RunConfig,
    /// What the weights came from, for messages.
    pub(crate) source: String,
    /// Notes on damaged checkpoints skipped on the way.
    pub(crate) notes: Vec<String>,
    /// The device it runs on.
    pub(crate) device: crate::device::DeviceChoice,
}

/// The GPT of `from`: a language-model run directory (its newest good
/// checkpoint, or with `best` its best model) or a `transformers` GPT-2
/// folder (`config.json`, `model.safetensors`, `tokenizer.json`), on the
/// device the run's `device.*` chooses (a folder: the defaults').
pub(crate) fn load_lm(
    from: &Path,
    best: bool,
    what: &'static str,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Loaded, TrainError> {
    let (config, tokenizer, source, notes, weights) = if from.join("config.toml").is_file() {
        from_run(from, best, what)?
    } else if from.join("config.json").is_file() && best {
        return Err(TrainError::NotARun {
            path: from.to_path_buf(),
            why: "--best takes a run's best model, and a transformers folder holds one model: leave out --best".into(),
        });
    } else if from.join("config.json").is_file() {
        from_folder(from, hardware).map_err(not_as_init_from)?
    } else {
        return Err(TrainError::NotARun {
            path: from.to_path_buf(),
            why: "it has neither config.toml (a kiln run) nor config.json (a transformers GPT-2 folder)"
                .into(),
        });
    };
    let device = select_device(&config.device, hardware.gpu_vendor())?;
    let gpt = crate::translate::gpt_config(&config, tokenizer.vocab_size());
    let model = weights
        .load_into(gpt.init_unset(&device.device), &device.device)
        .map_err(not_as_init_from)?
        .with_kernels(crate::translate::kernels(&config))
        .with_attention(crate::translate::attention(&config));
    Ok(Loaded {
        model,
        tokenizer,
        config,
        source,
        notes,
        device,
    })
}

/// A folder's fault, told without `model.init_from` (the key the same
/// checks answer to in training): `kiln sample` and `kiln eval` name the
/// folder on their command line.
fn not_as_init_from(e: TrainError) -> TrainError {
    match e {
        TrainError::Pretrained { path, why } => TrainError::PretrainedFolder { path, why },
        other => other,
    }
}

/// Where the weights come from.
enum Weights {
    /// A run's checkpoint's parameters (its path, for messages).
    Checkpoint(std::path::PathBuf, Vec<crate::params::NamedValues>),
    /// A GPT-2 folder, checked.
    Folder(crate::pretrained::Pretrained),
}

impl Weights {
    /// A freshly built GPT filled with the weights.
    fn load_into(self, model: Gpt, device: &Device) -> Result<Gpt, TrainError> {
        match self {
            Self::Checkpoint(path, params) => {
                let values = params.into_iter().map(|(p, s, v)| (p, (s, v))).collect();
                crate::params::load_values(model, values, device)
                    .map_err(|why| TrainError::CheckpointMismatch { path, why })
            }
            Self::Folder(pretrained) => pretrained.load_into(model, device),
        }
    }
}

/// What the weights are read with: the configuration, the tokenizer, where
/// they come from (for messages), notes on skipped checkpoints.
type Source = (RunConfig, Tokenizer, String, Vec<String>, Weights);

/// A run's weights; `what` names the command's refusal of a
/// cross-validation run ("sampling from a sentence-pair classifier").
fn from_run(from: &Path, best: bool, what: &'static str) -> Result<Source, TrainError> {
    let (dir, config) = open_lm_run(from, what, "`kiln predict` labels pairs with it")?;
    let tokenizer = Tokenizer::load(&dir.file("tokenizer.json"))?;
    let (info, params, notes) = checkpoint::run_params(&dir, best)?;
    let source = format!(
        "{}step {} of `{}`",
        if best { "the best model, " } else { "" },
        info.step,
        from.display()
    );
    Ok((
        config,
        tokenizer,
        source,
        notes,
        Weights::Checkpoint(info.path, params),
    ))
}

fn from_folder(
    from: &Path,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Source, TrainError> {
    let tokenizer_file = from.join("tokenizer.json");
    if !tokenizer_file.is_file() {
        return Err(TrainError::Pretrained {
            path: from.to_path_buf(),
            why: "has no tokenizer.json, which encodes the prompt and decodes the samples".into(),
        });
    }
    let tokenizer = Tokenizer::load(&tokenizer_file)?;
    let config = crate::pretrained::config_for_folder(from, hardware)?;
    let pretrained = crate::pretrained::open_folder(from, &config, &tokenizer)?;
    let source = format!("the GPT-2 folder `{}`", from.display());
    Ok((
        config,
        tokenizer,
        source,
        Vec::new(),
        Weights::Folder(pretrained),
    ))
}

/// The language-model run `run` and its configuration; a cross-validation
/// run of the encoder is refused as `what`, with `instead`.
fn open_lm_run(
    run: &Path,
    what: &'static str,
    instead: &str,
) -> Result<(RunDir, RunConfig), TrainError> {
    let dir = RunDir::open(run)?;
    let config = kiln_config::read_run_config(&dir.file("config.toml"))?;
    if config.workload != Workload::Lm {
        return Err(TrainError::Unsupported(
            what,
            format!(
                "`{}` is a cross-validation run of the nli encoder; {instead}",
                run.display()
            ),
        ));
    }
    Ok((dir, config))
}
