//! Configuration errors. Each names what was wrong and where it was set.

use std::path::PathBuf;

use crate::layer::Source;

/// Why a configuration could not be resolved. Every variant is bad input
/// (the CLI exits 2) except `Io` on a file that exists but cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("failed to read `{}`", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("`{}` line {line}, column {column}: invalid TOML: {message}", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },

    #[error("unknown key `{key}` set by {set_by}{}", suggestion(.did_you_mean))]
    UnknownKey {
        key: String,
        did_you_mean: Option<String>,
        set_by: Box<Source>,
    },

    #[error("invalid value {value} for `{key}` set by {set_by}: {problem}")]
    InvalidValue {
        key: String,
        value: String,
        problem: String,
        set_by: Box<Source>,
    },

    #[error("missing key `{key}`: {}", hint)]
    MissingKey { key: String, hint: String },

    #[error("unknown {group} preset `{name}` set by {set_by}; available ({looked}): {}{}", available.join(", "), suggestion(.did_you_mean))]
    UnknownPreset {
        group: &'static str,
        name: String,
        /// Where presets were looked up: "built in", "built in and in `dir`".
        looked: String,
        available: Vec<String>,
        did_you_mean: Option<String>,
        set_by: Box<Source>,
    },

    #[error(
        "{set_by} sets `{key}`, which only the defaults, a config file, the environment or the command line may set"
    )]
    KeyNotAllowedHere { key: String, set_by: Box<Source> },

    #[error("bad override `{arg}`: {reason}")]
    BadOverride { arg: String, reason: String },

    #[error("environment variable `{var}` is not valid UTF-8")]
    NonUtf8Env { var: String },

    #[error("presets directory `{}` does not exist (kiln's presets are built in; a directory only adds or replaces presets)", path.display())]
    NoPresetsDir { path: PathBuf },

    #[error(
        "hardware=tuned: no tuning {what} (`{}`); run `kiln tune{}` on this machine first, or use hardware=auto", path.display(), tune_args
    )]
    NotTuned {
        path: PathBuf,
        /// "for this machine" or "of experiment `x` in it".
        what: String,
        tune_args: String,
    },

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
