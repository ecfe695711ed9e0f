//! Configuration errors. Each names what was wrong and where it was set.

use std::path::PathBuf;

use crate::layer::Source;

/// Why a configuration could not be resolved. Every variant is bad input
/// (the CLI exits 2) except `Io` on a file that exists but cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A file that exists could not be read.
    #[error("failed to read `{}`", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },

    /// A configuration file does not parse.
    #[error("`{}` line {line}, column {column}: invalid {format}: {message}", path.display())]
    Syntax {
        /// The file (`built-in <name>.toml` for a built-in preset).
        path: PathBuf,
        /// What the file was read as: "TOML", "YAML" or "JSON".
        format: &'static str,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The parser's message.
        message: String,
    },

    /// A key no section has.
    #[error("unknown key `{key}` set by {set_by}{}", suggestion(.did_you_mean))]
    UnknownKey {
        /// The key, dotted.
        key: String,
        /// The closest valid key, if one is close.
        did_you_mean: Option<String>,
        /// The layer that set it, and where.
        set_by: Box<Source>,
    },

    /// A value of the wrong type or out of range.
    #[error("invalid value {value} for `{key}` set by {set_by}: {problem}")]
    InvalidValue {
        /// The key, dotted.
        key: String,
        /// The value, as TOML.
        value: String,
        /// What is wrong with it.
        problem: String,
        /// The layer that set it, and where.
        set_by: Box<Source>,
    },

    /// A key no layer set (only in a saved run configuration: the built-in
    /// defaults set every key).
    #[error("missing key `{key}`: {}", hint)]
    MissingKey {
        /// The key, dotted.
        key: String,
        /// What to check.
        hint: String,
    },

    /// `hardware=` or `experiment=` names no preset.
    #[error("unknown {group} preset `{name}` set by {set_by}; available ({looked}): {}{}", available.join(", "), suggestion(.did_you_mean))]
    UnknownPreset {
        /// `hardware` or `experiment`.
        group: &'static str,
        /// The name asked for.
        name: String,
        /// Where presets were looked up: "built in", "built in and in `dir`".
        looked: String,
        /// The names there are.
        available: Vec<String>,
        /// The closest name, if one is close.
        did_you_mean: Option<String>,
        /// The layer that asked for it, and where.
        set_by: Box<Source>,
    },

    /// A preset sets a key only the layers above the presets may set
    /// (`hardware`, `experiment`, `workload`).
    #[error(
        "{set_by} sets `{key}`, which only the defaults, a config file, the environment or the command line may set"
    )]
    KeyNotAllowedHere {
        /// The key.
        key: String,
        /// The preset that set it, and where.
        set_by: Box<Source>,
    },

    /// A command-line override that is not `key=value`.
    #[error("bad override `{arg}`: {reason}")]
    BadOverride {
        /// The argument as given.
        arg: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A `KILN_*` variable whose value is not UTF-8.
    #[error("environment variable `{var}` is not valid UTF-8")]
    NonUtf8Env {
        /// The variable's name.
        var: String,
    },

    /// `--presets DIR` (or [`crate::Presets::with_dir`]) names no directory.
    #[error("presets directory `{}` {} (kiln's presets are built in; a directory only adds or replaces presets)", path.display(), if path.exists() { "is not a directory" } else { "does not exist" })]
    NoPresetsDir {
        /// The path given.
        path: PathBuf,
    },

    /// A presets directory has one preset in two files (`t4.toml` and
    /// `t4.yaml`).
    #[error(
        "`{}` and `{}` are the same preset in two files: keep one",
        first.display(),
        second.display()
    )]
    TwoPresetFiles {
        /// The first file, by format (TOML, YAML, JSON).
        first: PathBuf,
        /// The second.
        second: PathBuf,
    },

    /// `hardware=tuned` on a machine (or for an experiment) `kiln tune` has
    /// not measured.
    #[error(
        "hardware=tuned: no tuning {what} (`{}`); run `kiln tune{}` on this machine first, or use hardware=auto", path.display(), tune_args
    )]
    NotTuned {
        /// The tuned-preset file looked for.
        path: PathBuf,
        /// "for this machine" or "of experiment `x` in it".
        what: String,
        /// The arguments of the `kiln tune` to run.
        tune_args: String,
    },

    /// Several of the above, one per line.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
}

fn suggestion(s: &Option<String>) -> String {
    match s {
        Some(s) => format!("; did you mean `{s}`?"),
        None => String::new(),
    }
}

/// The closest candidate to `word`, if any is close enough to be a likely
/// typo: within a third of its length in edits (at least one), or very
/// similar by Jaro-Winkler.
pub(crate) fn did_you_mean<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let budget = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| {
            (
                strsim::levenshtein(word, c),
                strsim::jaro_winkler(word, c),
                c,
            )
        })
        .filter(|(edits, jw, _)| *edits <= budget || *jw > 0.85)
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)))
        .map(|(_, _, c)| c.to_string())
}
