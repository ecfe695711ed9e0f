//! The commands of `kiln`, one module each, and what they share: the
//! machine and the presets (`Context`), the configuration layers a command
//! takes, and how an error becomes exit code 2.

pub(crate) mod bench;
pub(crate) mod config;
pub(crate) mod diagnose;
pub(crate) mod eval;
pub(crate) mod export;
pub(crate) mod hardware;
pub(crate) mod kernels;
pub(crate) mod launch;
pub(crate) mod lr_find;
pub(crate) mod prepare;
pub(crate) mod sample;
pub(crate) mod sweep;
pub(crate) mod train;
pub(crate) mod tune;

use std::path::{Path, PathBuf};

use kiln_config::{LoadOptions, ResolvedConfig};
use kiln_hwdetect::HardwareReport;

/// What every command runs with: the machine (detected, or a saved report)
/// and the global flags.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) report: HardwareReport,
    pub(crate) presets: Option<PathBuf>,
    pub(crate) hardware_report: Option<PathBuf>,
}

impl Context {
    pub(crate) fn new(
        presets: Option<PathBuf>,
        hardware_report: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let report = match &hardware_report {
            Some(path) => read_report(path)?,
            None => kiln_hwdetect::detect(),
        };
        Ok(Self {
            report,
            presets,
            hardware_report,
        })
    }

    /// The global flags a child `kiln` needs to see the same presets and
    /// machine, their paths absolute (a child may start elsewhere, a sweep
    /// resume from another folder).
    pub(crate) fn prefix(&self) -> Vec<String> {
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let mut args = Vec::new();
        if let Some(p) = &self.presets {
            args.push(format!("--presets={}", absolute(p).display()));
        }
        if let Some(r) = &self.hardware_report {
            args.push(format!("--hardware-report={}", absolute(r).display()));
        }
        args
    }

    /// The context `prefix` gave a child: the same presets and machine.
    pub(crate) fn from_prefix(prefix: &[String]) -> anyhow::Result<Self> {
        let flag = |name: &str| {
            prefix
                .iter()
                .find_map(|a| a.strip_prefix(name))
                .map(PathBuf::from)
        };
        Self::new(flag("--presets="), flag("--hardware-report="))
    }

    /// The configuration `layers` resolve to on this machine.
    pub(crate) fn resolve(&self, layers: &Layers) -> anyhow::Result<ResolvedConfig> {
        self.with_options(layers, kiln_config::resolve)
    }

    /// `f` of the load options of `layers` on this machine.
    fn with_options<T>(
        &self,
        layers: &Layers,
        f: impl FnOnce(&LoadOptions<'_>) -> Result<T, kiln_config::ConfigError>,
    ) -> anyhow::Result<T> {
        let presets = kiln_config::Presets::discover(self.presets.as_deref())?;
        let env: Vec<_> = std::env::vars_os().collect();
        Ok(f(&LoadOptions {
            presets: &presets,
            config_files: &layers.config,
            overrides: &layers.overrides,
            env: &env,
            hardware: &self.report,
        })?)
    }

    /// Resolves for a sentence-pair command (`cv`, `bench nli`): the
    /// experiment any layer chose, or `nli_snli` where none did (the
    /// defaults' experiment is the language model's). The choice is read
    /// before anything is checked, so that a key of the sentence pairs'
    /// alone (`training.layer_lr_decay`) is checked against the experiment
    /// the command runs, not the defaults' language model.
    pub(crate) fn resolve_nli(&self, mut layers: Layers) -> anyhow::Result<ResolvedConfig> {
        if !self.with_options(&layers, kiln_config::experiment_chosen)? {
            // The defaults' experiment, where it is a sentence-pair one
            // (`--presets` of one's own); else `nli_snli`.
            if let Ok(resolved) = self.resolve(&layers)
                && resolved.config.workload == kiln_config::Workload::Nli
            {
                return Ok(resolved);
            }
            layers
                .overrides
                .insert(0, "experiment=nli_snli".to_string());
        }
        self.resolve(&layers)
    }
}

/// The configuration layers a command takes.
#[derive(Debug, clap::Args)]
pub(crate) struct Layers {
    /// A configuration file layered above the presets and below the
    /// environment: TOML, or YAML (.yaml, .yml) or JSON (.json) by its
    /// name. Given again, each file goes over the one before it
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Vec<PathBuf>,
    /// Overrides in Hydra's syntax: `hardware=t4 experiment=nli_snli training.batch_size=20`
    #[arg(value_name = "KEY=VALUE")]
    pub(crate) overrides: Vec<String>,
}

impl Layers {
    pub(crate) fn none() -> Self {
        Self {
            config: Vec::new(),
            overrides: Vec::new(),
        }
    }
}

/// An error caused by what the user gave (exit code 2).
#[derive(Debug)]
pub(crate) struct BadInput(pub(crate) String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

fn read_report(path: &Path) -> anyhow::Result<HardwareReport> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        BadInput(format!(
            "failed to read hardware report `{}`: {e}",
            path.display()
        ))
    })?;
    // `check-hardware --json` wraps the report; a bare report is accepted too.
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        BadInput(format!(
            "hardware report `{}` line {}: {e}",
            path.display(),
            e.line()
        ))
    })?;
    let inner = value.get("hardware").cloned().unwrap_or(value);
    serde_json::from_value(inner)
        .map_err(|e| BadInput(format!("hardware report `{}`: {e}", path.display())).into())
}

/// Training errors the user can fix are bad input (exit 2). The message
/// keeps the error's causes ("failed to read `x`: No such file or
/// directory"): `{:#}` lists them for an `anyhow::Error`, not for a plain one.
pub(crate) fn train_error(e: kiln_train::TrainError) -> anyhow::Error {
    let bad_input = e.is_bad_input();
    let err = anyhow::Error::new(e);
    if bad_input {
        anyhow::Error::new(BadInput(format!("{err:#}")))
    } else {
        err
    }
}

/// A count that means nothing at 0 (a bench's steps or batches, which
/// would print zeros as rates; `kiln sample -n`, which would print nothing).
/// A count of threads or processes on one machine: 1 to 1024 (more is a
/// typo, and would start that many).
pub(crate) fn thread_count(s: &str) -> Result<usize, String> {
    whole_number_in(s, 1, MAX_PER_MACHINE)
}

/// `s` as a whole number from `low` to `high`.
pub(crate) fn whole_number_in(s: &str, low: usize, high: usize) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (low..=high).contains(&n) => Ok(n),
        _ => Err(format!("`{s}` is not a whole number from {low} to {high}")),
    }
}

/// The most threads or processes kiln starts on one machine for one flag.
pub(crate) const MAX_PER_MACHINE: usize = 1024;

pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a whole number of 1 or more")),
    }
}
