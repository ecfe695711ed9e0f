//! Resolving a `RunConfig` from its layers with figment, keeping the source
//! of every value and turning every failure into an error that names the key,
//! the value and the layer.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::error::Kind;
use figment::value::Value;
use kiln_hwdetect::HardwareReport;

use crate::error::{ConfigError, did_you_mean};
use crate::foreign::{foreign_name, foreign_setting};
use crate::layer::{Layer, LayerKind, Source, leaf_keys};
use crate::preset::{PresetChoice, choose_preset};
use crate::presets::Presets;
use crate::schema::{RunConfig, Workload};

/// Everything `resolve` reads. Nothing is read from the process environment
/// directly: the caller passes it, so that tests can too.
#[derive(Debug)]
pub struct LoadOptions<'a> {
    /// The presets: built in, and a directory over them if any.
    pub presets: &'a Presets,
    /// `--config FILE`, each over the one before it.
    pub config_files: &'a [PathBuf],
    /// Command-line overrides, `key=value`, in order.
    pub overrides: &'a [String],
    /// The environment (only `KILN_*` variables are read).
    pub env: &'a [(OsString, OsString)],
    /// The machine, for `hardware=auto`.
    pub hardware: &'a HardwareReport,
}

/// A resolved configuration: the typed values and where each came from.
#[derive(Clone, Debug)]
pub struct ResolvedConfig {
    /// The typed, validated values.
    pub config: RunConfig,
    /// Dotted key → source, for every leaf key.
    pub sources: BTreeMap<String, Source>,
    /// The automatic hardware choice, when `hardware=auto`.
    pub hardware_choice: Option<PresetChoice>,
}

/// One line of `kiln config --explain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplainRow {
    /// The key, dotted.
    pub key: String,
    /// Its value, as TOML.
    pub value: String,
    /// Where it was set.
    pub source: Source,
    /// Why a run of this configuration does not read the key, if it does
    /// not ([`RunConfig::unused_keys`]).
    pub unused: Option<String>,
}

impl ResolvedConfig {
    /// The configuration as TOML, in the order of `RunConfig`'s fields.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.config)
            .unwrap_or_else(|e| format!("# not serialisable: {e}\n"))
    }

    /// The configuration as YAML (a file `--config` reads back, as it does
    /// [`ResolvedConfig::to_toml`]'s), in the order of `RunConfig`'s fields:
    /// sections as nested mappings, strings double-quoted, lists in flow
    /// style.
    pub fn to_yaml(&self) -> String {
        match toml::Value::try_from(&self.config) {
            Ok(toml::Value::Table(table)) => {
                let mut out = String::new();
                yaml_table(&table, 0, &mut out);
                out
            }
            Ok(_) => String::new(),
            Err(e) => format!("# not serialisable: {e}\n"),
        }
    }

    /// Every key with its value and source, in `RunConfig` order.
    pub fn explain(&self) -> Vec<ExplainRow> {
        let Ok(value) = toml::Value::try_from(&self.config) else {
            return Vec::new();
        };
        let unused = self.config.unused_keys();
        let mut rows = Vec::new();
        flatten(&value, "", &mut |key, v| {
            if let Some(source) = self.sources.get(key) {
                rows.push(ExplainRow {
                    key: key.to_string(),
                    value: v.to_string(),
                    source: source.clone(),
                    unused: unused
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, why)| why.clone()),
                });
            }
        });
        rows
    }

    /// Where `key` (dotted) was set, if it is a key.
    pub fn source(&self, key: &str) -> Option<&Source> {
        self.sources.get(key)
    }
}

/// `table`'s keys as YAML at `indent` levels: a table as a nested mapping,
/// anything else on its key's line.
fn yaml_table(table: &toml::Table, indent: usize, out: &mut String) {
    for (key, value) in table {
        out.push_str(&"  ".repeat(indent));
        out.push_str(key);
        match value {
            toml::Value::Table(inner) => {
                out.push_str(":\n");
                yaml_table(inner, indent + 1, out);
            }
            other => {
                out.push_str(": ");
                out.push_str(&yaml_scalar(other));
                out.push('\n');
            }
        }
    }
}

/// A value on one line: a string double-quoted (JSON's escapes, which
/// YAML's double-quoted style reads), a list in flow style.
fn yaml_scalar(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => {
            let mut quoted = String::from("\"");
            for c in s.chars() {
                match c {
                    '"' => quoted.push_str("\\\""),
                    '\\' => quoted.push_str("\\\\"),
                    '\n' => quoted.push_str("\\n"),
                    '\t' => quoted.push_str("\\t"),
                    c if c.is_control() => quoted.push_str(&format!("\\u{:04x}", u32::from(c))),
                    c => quoted.push(c),
                }
            }
            quoted.push('"');
            quoted
        }
        toml::Value::Array(items) => format!(
            "[{}]",
            items.iter().map(yaml_scalar).collect::<Vec<_>>().join(", ")
        ),
        toml::Value::Table(table) => format!(
            "{{{}}}",
            table
                .iter()
                .map(|(k, v)| format!("{k}: {}", yaml_scalar(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

fn flatten(value: &toml::Value, prefix: &str, f: &mut dyn FnMut(&str, &toml::Value)) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(v, &key, f);
            }
        }
        other => f(prefix, other),
    }
}

/// Resolves `presets` with command-line `overrides` alone (no config file,
/// no environment) for `hardware`: [`resolve`] for a program or a test that
/// builds its configuration in code.
///
/// ```
/// let presets = kiln_config::Presets::built_in();
/// let machine = kiln_hwdetect::detect_cpu_only();
/// let resolved = kiln_config::resolve_overrides(&presets, &["training.batch_size=8"], &machine)?;
/// assert_eq!(resolved.config.training.batch_size, 8);
/// assert_eq!(resolved.config.experiment, "shakespeare_char");
/// # Ok::<(), kiln_config::ConfigError>(())
/// ```
pub fn resolve_overrides(
    presets: &Presets,
    overrides: &[&str],
    hardware: &HardwareReport,
) -> Result<ResolvedConfig, ConfigError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    resolve(&LoadOptions {
        presets,
        config_files: &[],
        overrides: &overrides,
        env: &[],
        hardware,
    })
}

/// Resolves the configuration:
/// `defaults.toml` < `hardware/<name>.toml` (with its `[lm]`/`[nli]` section
/// for the workload) < `experiment/<name>.toml` < each `--config FILE`, in
/// order < `KILN_*` environment < command-line overrides.
pub fn resolve(opts: &LoadOptions<'_>) -> Result<ResolvedConfig, ConfigError> {
    // Pass 1: which presets (only the layers above the presets may choose).
    let (mut layers, known_keys) = choosing_layers(opts)?;
    let select = Resolver::new(&layers, &known_keys);
    let hardware_asked: String = select.extract("hardware")?;
    let experiment: String = select.extract("experiment")?;
    let hardware_source = select.source_of("hardware");
    let experiment_source = select.source_of("experiment");

    let tuned = hardware_asked == "tuned";
    let choice = (hardware_asked == "auto" || tuned).then(|| choose_preset(opts.hardware));
    let hardware = choice
        .as_ref()
        .map_or(hardware_asked.clone(), |c| c.name.clone());
    let mut hw_layer = preset_layer(
        opts.presets,
        "hardware",
        &hardware,
        hardware_source,
        LayerKind::Hardware(hardware.clone()),
    )?;
    let exp_layer = preset_layer(
        opts.presets,
        "experiment",
        &experiment,
        experiment_source,
        LayerKind::Experiment(experiment.clone()),
    )?;
    for (layer, reserved) in [
        (&hw_layer, &["hardware", "experiment", "workload"][..]),
        (&exp_layer, &["hardware", "experiment"][..]),
    ] {
        if let Some(key) = reserved.iter().find(|k| layer.dict.contains_key(**k)) {
            return Err(ConfigError::KeyNotAllowedHere {
                key: key.to_string(),
                set_by: Box::new(Source {
                    layer: layer.kind.clone(),
                    location: layer.location_of(key),
                }),
            });
        }
    }
    let sections = [
        ("lm", Workload::Lm, hw_layer.take_section("lm")),
        ("nli", Workload::Nli, hw_layer.take_section("nli")),
    ];
    let tuned_layer = if tuned {
        Some(tuned_layer(opts, &experiment)?)
    } else {
        None
    };
    layers.splice(1..1, [hw_layer, exp_layer].into_iter().chain(tuned_layer));

    // Pass 2: the workload decides which section of the hardware preset applies.
    let workload: Workload = Resolver::new(&layers, &known_keys).extract("workload")?;
    for (_, w, section) in sections {
        if let (true, Some((dict, locations))) = (w == workload, section) {
            layers[1].overlay(dict, locations);
        }
    }

    // Pass 3: everything.
    let resolver = Resolver::new(&layers, &known_keys);
    let mut config: RunConfig = resolver.extract_all()?;
    let mut sources = BTreeMap::new();
    let merged: figment::value::Dict = resolver.figment.extract().unwrap_or_default();
    for key in leaf_keys(&merged) {
        sources.insert(key.clone(), resolver.source_of(&key));
    }
    let mut choice = choice;
    if let Some(choice) = &mut choice {
        if tuned {
            choice.why = format!(
                "`{}` as measured by `kiln tune` ({}), over `{}`: {}",
                opts.hardware.machine_id(),
                tuned_path(opts.presets, opts.hardware).display(),
                choice.name,
                choice.why
            );
            choice.name = "tuned".to_string();
        }
        config.hardware = choice.name.clone();
        sources.insert(
            "hardware".to_string(),
            Source {
                layer: LayerKind::HardwareDetection,
                location: format!("{hardware_asked}: {}", choice.why),
            },
        );
        // The run trains on the GPU the preset was chosen for, unless a
        // layer above the defaults names one.
        let index_set = sources
            .get("device.index")
            .is_some_and(|s| s.layer != LayerKind::Defaults);
        if let (Some(index), false) = (choice.gpu_index, index_set) {
            config.device.index = index as usize;
            sources.insert(
                "device.index".to_string(),
                Source {
                    layer: LayerKind::HardwareDetection,
                    location: format!(
                        "{hardware_asked}: GPU {index}, the GPU the preset was chosen for"
                    ),
                },
            );
        }
    }
    resolver.check_ranges(&config)?;
    Ok(ResolvedConfig {
        config,
        sources,
        hardware_choice: choice,
    })
}

/// Whether a layer above the defaults (`--config FILE`, `KILN_*`, an
/// override) names the experiment: what the first pass of [`resolve`]
/// reads, without resolving or checking the rest. A command with a
/// workload of its own (`kiln cv`) picks its experiment where none did.
pub fn experiment_chosen(opts: &LoadOptions<'_>) -> Result<bool, ConfigError> {
    let (layers, known_keys) = choosing_layers(opts)?;
    Ok(Resolver::new(&layers, &known_keys)
        .source_of("experiment")
        .layer
        != LayerKind::Defaults)
}

/// The layers that may choose the presets: the defaults, each `--config
/// FILE`, `KILN_*` and the overrides; and every key the defaults know.
fn choosing_layers(opts: &LoadOptions<'_>) -> Result<(Vec<Layer>, Vec<String>), ConfigError> {
    let (defaults, built_in_defaults) = opts.presets.defaults()?;
    let known_keys = leaf_keys(&built_in_defaults.dict);
    let files = opts
        .config_files
        .iter()
        .map(|p| Layer::from_file(LayerKind::ConfigFile, p))
        .collect::<Result<Vec<_>, _>>()?;
    let layers = std::iter::once(defaults)
        .chain(files)
        .chain([env_layer(opts.env)?, cli_layer(opts.overrides)?])
        .collect();
    Ok((layers, known_keys))
}

/// Where `kiln tune` keeps the measured settings of `hardware`'s machine:
/// `<presets>/tuned/<machine id>.toml` (see [`Presets::tuned_dir`]).
pub fn tuned_path(presets: &Presets, hardware: &HardwareReport) -> PathBuf {
    presets
        .tuned_dir()
        .join(format!("{}.toml", hardware.machine_id()))
}

/// `presets/tuned/<machine>.toml`'s section for `experiment`, as a layer
/// above the experiment: the tuner measured these values for it.
fn tuned_layer(opts: &LoadOptions<'_>, experiment: &str) -> Result<Layer, ConfigError> {
    let path = tuned_path(opts.presets, opts.hardware);
    let machine = opts.hardware.machine_id();
    if !path.is_file() {
        return Err(ConfigError::NotTuned {
            path,
            what: format!("for this machine, `{machine}`"),
            tune_args: format!(" experiment={experiment}"),
        });
    }
    let mut file = Layer::from_file(LayerKind::Tuned(machine), &path)?;
    let Some((dict, locations)) = file.take_section(experiment) else {
        return Err(ConfigError::NotTuned {
            path,
            what: format!("of experiment `{experiment}` in it"),
            tune_args: format!(" experiment={experiment}"),
        });
    };
    file.dict = dict;
    file.locations = locations;
    for key in ["hardware", "experiment", "workload"] {
        if file.dict.contains_key(key) {
            return Err(ConfigError::KeyNotAllowedHere {
                key: key.to_string(),
                set_by: Box::new(Source {
                    layer: file.kind.clone(),
                    location: file.location_of(key),
                }),
            });
        }
    }
    Ok(file)
}

/// Reads a configuration a run saved (its `config.toml`): one file that sets
/// every key, checked as strictly as a resolved one.
pub fn read_run_config(path: &Path) -> Result<RunConfig, ConfigError> {
    Ok(resume_run_config(path, &[])?.config)
}

/// A saved run configuration under the overrides of `kiln resume RUN
/// key=value ...`: what the run continues with, and what changed.
#[derive(Clone, Debug)]
pub struct ResumedConfig {
    /// The configuration the run continues with.
    pub config: RunConfig,
    /// The configuration the run saved, before the overrides.
    pub saved: RunConfig,
    /// The keys whose value the overrides changed, in `RunConfig` order.
    pub changes: Vec<ResumeChange>,
}

/// One key a resumed run changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumeChange {
    /// The key, dotted.
    pub key: String,
    /// The saved value, as TOML.
    pub from: String,
    /// The new value, as TOML.
    pub to: String,
    /// The override that set it.
    pub source: Source,
}

/// Reads the configuration a run saved (`config.toml`) under command-line
/// `overrides` for `kiln resume`. The checkpoint fixes the model, the data
/// and the order the data is drawn in, so only keys that leave them as they
/// are may change ([`fixed_when_resuming`]): for a language model the
/// length of the run, the optimizer's hyperparameters, the micro-batch and
/// evaluation; for both workloads precision, device, loader, logging and
/// checkpoints. Any other key is refused, naming it and why.
pub fn resume_run_config(path: &Path, overrides: &[String]) -> Result<ResumedConfig, ConfigError> {
    let saved_layer = Layer::from_file(LayerKind::ConfigFile, path)?;
    let known_keys = leaf_keys(&saved_layer.dict);
    let saved_only = [saved_layer.clone()];
    let saved_resolver = Resolver::new(&saved_only, &known_keys);
    let saved: RunConfig = saved_resolver.extract_all()?;
    saved_resolver.check_ranges(&saved)?;
    let layers = [saved_layer, cli_layer(overrides)?];
    let resolver = Resolver::new(&layers, &known_keys);
    let config: RunConfig = resolver.extract_all()?;
    let (before, after) = match (
        toml::Value::try_from(&saved),
        toml::Value::try_from(&config),
    ) {
        (Ok(before), Ok(after)) => (before, after),
        (Err(e), _) | (_, Err(e)) => {
            return Err(ConfigError::BadOverride {
                arg: overrides.join(" "),
                reason: format!("the saved configuration could not be compared with it: {e}"),
            });
        }
    };
    let mut old = BTreeMap::new();
    flatten(&before, "", &mut |key, v| {
        old.insert(key.to_string(), v.to_string());
    });
    let mut changes = Vec::new();
    let mut refused = Vec::new();
    flatten(&after, "", &mut |key, v| {
        let to = v.to_string();
        let from = old.get(key).cloned().unwrap_or_default();
        if from == to {
            return;
        }
        let source = resolver.source_of(key);
        match fixed_when_resuming(key, saved.workload) {
            Some(why) => refused.push(ConfigError::InvalidValue {
                key: key.to_string(),
                value: to,
                problem: format!(
                    "the run has {from}, and a resumed run keeps its {why}; start a new run to change it"
                ),
                set_by: Box::new(source),
            }),
            None => changes.push(ResumeChange {
                key: key.to_string(),
                from,
                to,
                source,
            }),
        }
    });
    if !refused.is_empty() {
        return Err(many(refused));
    }
    resolver.check_ranges(&config)?;
    Ok(ResumedConfig {
        config,
        saved,
        changes,
    })
}

/// What a resumed run of `workload` keeps that `key` would change, or
/// `None` where `key` may change on resume.
///
/// Fixed: what the run is (`hardware`, `experiment`, `workload`,
/// `run.dir`); the model the checkpoint holds (`model.*`, except
/// `model.gradient_checkpointing`, which trades memory for time); the data
/// and tokenizer (`data.*`, except `data.cache_dir`); the order the data is
/// drawn in (`training.seed`). For cross-validation also the folds and how
/// each is trained and evaluated (`cv.*`, `training.*`, `eval.*`): the
/// folds are compared with each other, so a fold trains as the ones before
/// it did. What runs it (`device`, `precision`, `optimization`, `loader`)
/// and what it writes (`logging`, `checkpoint`, `sample`) may change.
///
/// ```
/// use kiln_config::{Workload, fixed_when_resuming};
/// assert!(fixed_when_resuming("model.layers", Workload::Lm).is_some());
/// assert!(fixed_when_resuming("training.learning_rate", Workload::Lm).is_none());
/// assert!(fixed_when_resuming("training.batch_size", Workload::Lm).is_none());
/// assert!(fixed_when_resuming("training.batch_size", Workload::Nli).is_some());
/// ```
pub fn fixed_when_resuming(key: &str, workload: Workload) -> Option<&'static str> {
    let (section, _) = key.split_once('.').unwrap_or((key, ""));
    match (section, key, workload) {
        (_, "model.gradient_checkpointing" | "data.cache_dir", _) => None,
        ("hardware" | "experiment" | "workload", ..) => {
            Some("preset and workload (set the keys a preset sets instead)")
        }
        (_, "run.dir", _) => Some("directory"),
        ("model", ..) => Some("model, whose weights the checkpoint holds"),
        ("data", ..) => Some("data and tokenizer"),
        (_, "training.seed", _) => Some("seed, which orders its data"),
        ("training" | "eval" | "cv", _, Workload::Nli) => Some(
            "folds and how each is trained and evaluated, as the folds before were (their results are compared)",
        ),
        _ => None,
    }
}

fn preset_layer(
    presets: &Presets,
    group: &'static str,
    name: &str,
    asked_by: Source,
    kind: LayerKind,
) -> Result<Layer, ConfigError> {
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let layer = if valid_name {
        presets.layer(kind, &format!("{group}/{name}"))?
    } else {
        None
    };
    layer.ok_or_else(|| {
        let mut available = presets.names(group);
        if group == "hardware" {
            available.insert(0, "auto".to_string());
            available.insert(1, "tuned".to_string());
        }
        let did_you_mean = did_you_mean(name, available.iter().map(String::as_str));
        ConfigError::UnknownPreset {
            group,
            name: name.to_string(),
            looked: presets.describe(),
            available,
            did_you_mean,
            set_by: Box::new(asked_by),
        }
    })
}

/// Environment variables named `KILN_…` that are not configuration: the
/// settings of kiln's build tool (`cargo xtask`), which runs `kiln` with
/// them still set, and process-wide switches of its GPU code that are
/// experiments rather than keys. The environment layer passes them over;
/// any other `KILN_…` variable is a key, and an unknown one an error.
pub const NOT_CONFIGURATION: &[&str] = &[
    // `cargo xtask`: the Cargo features kiln is built with, and where
    // `build-cuda` puts its LLVM.
    "KILN_FEATURES",
    "KILN_CUDA_LLVM_HOME",
    // cuBLAS's products waited for on the host (docs/GPU_TUNING.md).
    "KILN_CUBLAS_WAIT",
    // libdevice's fast exponential on CUDA (vendor/cubecl-llvm).
    "KILN_FAST_EXP",
    // A job's gradients (and ZeRO's weights) through host memory to NCCL,
    // as before they stayed on the GPU (docs/DISTRIBUTED.md).
    "KILN_NCCL_VIA_HOST",
    // Under torchrun: the port of kiln's own rendezvous, where its store
    // is not to be used (docs/DISTRIBUTED.md).
    "KILN_MASTER_PORT",
];

fn env_layer(env: &[(OsString, OsString)]) -> Result<Layer, ConfigError> {
    let mut pairs = Vec::new();
    for (name, value) in env {
        let Some(name_str) = name.to_str() else {
            continue;
        };
        if NOT_CONFIGURATION.contains(&name_str) {
            continue;
        }
        let Some(rest) = name_str.strip_prefix("KILN_") else {
            continue;
        };
        let value = value.to_str().ok_or_else(|| ConfigError::NonUtf8Env {
            var: name_str.to_string(),
        })?;
        let key = rest.to_ascii_lowercase().replace("__", ".");
        pairs.push((key, value.to_string(), name_str.to_string()));
    }
    pairs.sort();
    Layer::from_pairs(LayerKind::Environment, &pairs)
}

fn cli_layer(overrides: &[String]) -> Result<Layer, ConfigError> {
    let mut pairs = Vec::new();
    for arg in overrides {
        let Some((key, value)) = arg.split_once('=') else {
            return Err(ConfigError::BadOverride {
                arg: arg.clone(),
                reason: "expected KEY=VALUE, like training.batch_size=16 or hardware=t4".into(),
            });
        };
        if key.starts_with(['+', '~']) {
            return Err(ConfigError::BadOverride {
                arg: arg.clone(),
                reason: "Hydra's `+key` / `~key` are not supported: every key exists already, set it with key=value".into(),
            });
        }
        pairs.push((key.trim().to_string(), value.to_string(), arg.clone()));
    }
    Layer::from_pairs(LayerKind::CommandLine, &pairs)
}

fn many(mut errors: Vec<ConfigError>) -> ConfigError {
    if errors.len() == 1 {
        errors.remove(0)
    } else {
        ConfigError::Many(errors)
    }
}

/// A figment over some layers, and the means to explain its values.
struct Resolver<'a> {
    figment: Figment,
    layers: &'a [Layer],
    known_keys: &'a [String],
}

impl<'a> Resolver<'a> {
    fn new(layers: &'a [Layer], known_keys: &'a [String]) -> Self {
        let figment = layers
            .iter()
            .fold(Figment::new(), |f, layer| f.merge(layer.clone()));
        Self {
            figment,
            layers,
            known_keys,
        }
    }

    fn extract<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<T, ConfigError> {
        self.figment
            .extract_inner(key)
            .map_err(|e| self.map_error(e, Some(key)))
    }

    fn extract_all(&self) -> Result<RunConfig, ConfigError> {
        self.figment.extract().map_err(|e| self.map_error(e, None))
    }

    /// `RunConfig::validate`'s problems, each with its value and source.
    fn check_ranges(&self, config: &RunConfig) -> Result<(), ConfigError> {
        let problems: Vec<ConfigError> = config
            .validate()
            .into_iter()
            .map(|p| ConfigError::InvalidValue {
                key: p.key.to_string(),
                value: self.value_text(p.key),
                problem: p.problem,
                set_by: Box::new(self.source_of(p.key)),
            })
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(many(problems))
        }
    }

    /// The layer that set `key` last, and where in it.
    fn source_of(&self, key: &str) -> Source {
        // The layer of the metadata's name and file: two `--config` files
        // are layers of one kind.
        let layer = self.figment.find_metadata(key).and_then(|m| {
            self.layers.iter().rev().find(|l| {
                let file = match &m.source {
                    Some(figment::Source::File(path)) => Some(path),
                    _ => None,
                };
                l.kind.to_string() == m.name && l.file.as_ref() == file
            })
        });
        match layer {
            Some(layer) => Source {
                layer: layer.kind.clone(),
                location: layer.location_of(key),
            },
            None => Source {
                layer: LayerKind::Defaults,
                location: "not set".to_string(),
            },
        }
    }

    fn value_text(&self, key: &str) -> String {
        match self.figment.find_value(key) {
            Ok(v) => value_text(&v),
            Err(_) => "(none)".to_string(),
        }
    }

    /// What another tool's setting `name`, set at `key`, means in kiln
    /// ([`foreign_setting`]), read with its value.
    fn foreign_setting(&self, key: &str, name: &str) -> Option<String> {
        let value = match self.figment.find_value(key).ok()? {
            Value::String(_, s) => s,
            other => value_text(&other),
        };
        foreign_setting(name, &value)
    }

    /// The keys of section `key` (up to three, then "…"), where `key` is a
    /// section.
    fn section_keys(&self, key: &str) -> Option<String> {
        let prefix = format!("{key}.");
        let keys: Vec<&str> = self
            .known_keys
            .iter()
            .filter(|k| k.starts_with(&prefix))
            .map(String::as_str)
            .collect();
        match keys.len() {
            0 => None,
            1..=3 => Some(keys.join(", ")),
            _ => Some(format!("{}, …", keys[..3].join(", "))),
        }
    }

    fn map_error(&self, err: figment::Error, inner_key: Option<&str>) -> ConfigError {
        many(
            err.into_iter()
                .map(|e| self.map_one(e, inner_key))
                .collect(),
        )
    }

    fn map_one(&self, e: figment::Error, inner_key: Option<&str>) -> ConfigError {
        let mut path: Vec<String> = inner_key
            .map(|k| k.split('.').map(String::from).collect())
            .unwrap_or_default();
        path.extend(e.path.iter().cloned());
        match e.kind {
            Kind::UnknownField(field, expected) => {
                if path.last() != Some(&field) {
                    path.push(field.clone());
                }
                let key = path.join(".");
                let parent = path[..path.len() - 1].join(".");
                // The same name in another section beats a typo in this one:
                // `training.max_length` means `model.max_length`; a name in
                // several (`batch_size`) names them all, training's first.
                let mut elsewhere: Vec<&str> = self
                    .known_keys
                    .iter()
                    .map(String::as_str)
                    .filter(|k| k.rsplit('.').next() == Some(field.as_str()))
                    .collect();
                elsewhere.sort_by_key(|k| !k.starts_with("training."));
                let elsewhere = (!elsewhere.is_empty()).then(|| elsewhere.join("` or `"));
                // Then what the name means in nanoGPT, transformers or
                // Lightning: `n_embd` is `model.hidden`, `bf16=true` is
                // `precision.amp=true precision.amp_dtype=bf16`.
                let foreign = || {
                    self.foreign_setting(&key, &field)
                        .or_else(|| foreign_name(&field).map(str::to_string))
                };
                let within = || {
                    did_you_mean(&field, expected.iter().copied()).map(|s| {
                        if parent.is_empty() {
                            s
                        } else {
                            format!("{parent}.{s}")
                        }
                    })
                };
                ConfigError::UnknownKey {
                    set_by: Box::new(self.source_of(&key)),
                    did_you_mean: elsewhere.or_else(foreign).or_else(within),
                    key,
                }
            }
            Kind::UnknownVariant(variant, expected) => {
                let key = path.join(".");
                let hint = did_you_mean(&variant, expected.iter().copied())
                    .map(|s| format!("; did you mean `{s}`?"))
                    .unwrap_or_default();
                ConfigError::InvalidValue {
                    value: format!("\"{variant}\""),
                    problem: format!("expected one of {}{hint}", quoted(expected)),
                    set_by: Box::new(self.source_of(&key)),
                    key,
                }
            }
            Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
                let key = path.join(".");
                let value = match self.figment.find_value(&key) {
                    Ok(v) => value_text(&v),
                    Err(_) => actual.to_string(),
                };
                let set_by = self.source_of(&key);
                let problem = match self.section_keys(&key) {
                    // `precision=bf16-mixed`, `device=cuda`: a section set
                    // as one value.
                    Some(keys) => format!(
                        "`{key}` is a section of keys ({keys}), not a value{}",
                        self.foreign_setting(&key, &key)
                            .map(|s| format!("; did you mean `{s}`?"))
                            .unwrap_or_default()
                    ),
                    None => format!(
                        "expected {}{}",
                        plain_expected(&expected, &value),
                        sweep_hint(&set_by)
                    ),
                };
                ConfigError::InvalidValue {
                    problem,
                    value,
                    set_by: Box::new(set_by),
                    key,
                }
            }
            Kind::MissingField(field) => {
                if path.last().map(String::as_str) != Some(&*field) {
                    path.push(field.to_string());
                }
                ConfigError::MissingKey {
                    key: path.join("."),
                    hint:
                        "a run's saved configuration sets every key; was it written by this kiln?"
                            .to_string(),
                }
            }
            other => {
                let key = path.join(".");
                ConfigError::InvalidValue {
                    value: self.value_text(&key),
                    problem: other.to_string(),
                    set_by: Box::new(self.source_of(&key)),
                    key,
                }
            }
        }
    }
}

/// For a command-line value that would sweep under `-m`
/// (`training.learning_rate=1e-3,3e-4`): how to sweep it.
fn sweep_hint(set_by: &Source) -> &'static str {
    let sweeps = set_by.layer == LayerKind::CommandLine
        && crate::sweep::expand(std::slice::from_ref(&set_by.location))
            .is_ok_and(|(axes, _)| !axes.is_empty());
    if sweeps {
        "; to run one job per value, add -m (Hydra's multirun: `kiln train -m`)"
    } else {
        ""
    }
}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// serde's expectations, in words a user reads ("usize" → "a whole number ≥ 0");
/// for a whole number `value` too large, the largest there is.
fn plain_expected(expected: &str, value: &str) -> String {
    let too_large = value.parse::<u128>().is_ok();
    match expected {
        "usize" | "u64" if too_large => format!("a whole number up to {}", u64::MAX),
        "u32" if too_large => format!("a whole number up to {}", u32::MAX),
        "usize" | "u64" | "u32" => "a whole number, 0 or more".to_string(),
        "f64" | "f32" => "a number".to_string(),
        "a boolean" => "true or false".to_string(),
        other => other.to_string(),
    }
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(_, s) => format!("\"{s}\""),
        // Beyond TOML's 64-bit integers: the digits as given.
        Value::Num(_, n) if n.to_i128().is_some_and(|i| i64::try_from(i).is_err()) => {
            n.to_i128().map_or_else(String::new, |i| i.to_string())
        }
        Value::Num(_, n) if n.to_u128().is_some_and(|u| i64::try_from(u).is_err()) => {
            n.to_u128().map_or_else(String::new, |u| u.to_string())
        }
        other => toml::Value::try_from(other)
            .map(|t| t.to_string())
            .unwrap_or_else(|_| format!("{other:?}")),
    }
}
