//! Where presets come from: the ones compiled into this crate, with an
//! optional directory over them that adds presets or replaces them by name.

use std::path::{Path, PathBuf};

use crate::error::ConfigError;
use crate::layer::{FILE_EXTENSIONS, Layer, LayerKind};

/// kiln's shipped presets, `group/name` → TOML text, compiled in so that a
/// packaged crate or an installed binary resolves with no files at all.
/// A test checks this list against the `presets/` folder of the crate.
const BUILT_IN: &[(&str, &str)] = &[
    ("defaults", include_str!("../presets/defaults.toml")),
    (
        "experiment/bert_base",
        include_str!("../presets/experiment/bert_base.toml"),
    ),
    (
        "experiment/bert_finetune",
        include_str!("../presets/experiment/bert_finetune.toml"),
    ),
    (
        "experiment/gpt2_finetune",
        include_str!("../presets/experiment/gpt2_finetune.toml"),
    ),
    (
        "experiment/gpt2_small",
        include_str!("../presets/experiment/gpt2_small.toml"),
    ),
    (
        "experiment/nli_snli",
        include_str!("../presets/experiment/nli_snli.toml"),
    ),
    (
        "experiment/shakespeare_char",
        include_str!("../presets/experiment/shakespeare_char.toml"),
    ),
    (
        "hardware/a100",
        include_str!("../presets/hardware/a100.toml"),
    ),
    (
        "hardware/a100_80gb",
        include_str!("../presets/hardware/a100_80gb.toml"),
    ),
    ("hardware/a30", include_str!("../presets/hardware/a30.toml")),
    ("hardware/a40", include_str!("../presets/hardware/a40.toml")),
    (
        "hardware/apple_m",
        include_str!("../presets/hardware/apple_m.toml"),
    ),
    (
        "hardware/arc_a770",
        include_str!("../presets/hardware/arc_a770.toml"),
    ),
    (
        "hardware/conservative",
        include_str!("../presets/hardware/conservative.toml"),
    ),
    ("hardware/cpu", include_str!("../presets/hardware/cpu.toml")),
    (
        "hardware/gpu_3090",
        include_str!("../presets/hardware/gpu_3090.toml"),
    ),
    (
        "hardware/gpu_4080",
        include_str!("../presets/hardware/gpu_4080.toml"),
    ),
    (
        "hardware/gpu_4090",
        include_str!("../presets/hardware/gpu_4090.toml"),
    ),
    (
        "hardware/h100",
        include_str!("../presets/hardware/h100.toml"),
    ),
    (
        "hardware/low_mem",
        include_str!("../presets/hardware/low_mem.toml"),
    ),
    (
        "hardware/mi250",
        include_str!("../presets/hardware/mi250.toml"),
    ),
    (
        "hardware/mi300x",
        include_str!("../presets/hardware/mi300x.toml"),
    ),
    (
        "hardware/rx_7900_xtx",
        include_str!("../presets/hardware/rx_7900_xtx.toml"),
    ),
    ("hardware/t4", include_str!("../presets/hardware/t4.toml")),
    (
        "hardware/v100",
        include_str!("../presets/hardware/v100.toml"),
    ),
];

/// The built-in `defaults.toml`: every key kiln reads, with its default.
pub(crate) fn built_in_defaults() -> &'static str {
    BUILT_IN[0].1
}

impl Default for crate::RunConfig {
    /// kiln's built-in defaults (`defaults.toml`), before any preset applies.
    fn default() -> Self {
        toml::from_str(built_in_defaults())
            .expect("the built-in defaults.toml sets every key of RunConfig (tested)")
    }
}

/// Whether `dir` is the folder the built-in presets were compiled from:
/// `crates/config/presets` of the kiln source this crate was built from,
/// which in a checkout is a link to the top-level `presets/` (in a published
/// crate, the packaged copy). Compared after resolving links; `false` when
/// either path cannot be resolved.
pub(crate) fn is_built_in_source(dir: &Path) -> bool {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("presets");
    match (dir.canonicalize(), source.canonicalize()) {
        (Ok(dir), Ok(source)) => dir == source,
        _ => false,
    }
}

/// The presets a configuration resolves from: kiln's built-in presets, and
/// optionally a directory over them (`--presets DIR`, or `./presets` when
/// present). A file of the directory replaces the built-in preset of the same
/// name (`hardware/t4.toml`) or adds a new one; its `defaults.toml`, if any,
/// overrides single defaults (the built-in defaults stay underneath, and name
/// the valid keys). `kiln tune` writes under the directory's `tuned/`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Presets {
    dir: Option<PathBuf>,
}

impl Presets {
    /// The built-in presets alone.
    pub fn built_in() -> Self {
        Self { dir: None }
    }

    /// The built-in presets with `dir` over them; `dir` must be a directory.
    pub fn with_dir(dir: impl Into<PathBuf>) -> Result<Self, ConfigError> {
        let dir = dir.into();
        if dir.is_dir() {
            Ok(Self { dir: Some(dir) })
        } else {
            Err(ConfigError::NoPresetsDir { path: dir })
        }
    }

    /// `explicit` over the built-in presets if given (it must exist); else
    /// `./presets` if the working directory has one and it is not the folder
    /// the built-in presets were compiled from (a kiln checkout's own
    /// top-level `presets/`, which would only repeat them); else the built-in
    /// presets alone.
    pub fn discover(explicit: Option<&Path>) -> Result<Self, ConfigError> {
        let here = Path::new("presets");
        match explicit {
            Some(dir) => Self::with_dir(dir),
            None if here.is_dir() && !is_built_in_source(here) => Self::with_dir(here),
            None => Ok(Self::built_in()),
        }
    }

    /// The directory over the built-in presets, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Where `kiln tune` keeps its measured presets: `tuned/` in the presets
    /// directory, or `presets/tuned/` under the working directory.
    pub fn tuned_dir(&self) -> PathBuf {
        self.dir
            .as_deref()
            .unwrap_or(Path::new("presets"))
            .join("tuned")
    }

    /// The preset names of a group (`hardware` or `experiment`), built-in and
    /// from the directory, sorted, each once.
    pub fn names(&self, group: &str) -> Vec<String> {
        let prefix = format!("{group}/");
        let mut names: Vec<String> = BUILT_IN
            .iter()
            .filter_map(|(key, _)| key.strip_prefix(&prefix).map(String::from))
            .collect();
        if let Some(dir) = &self.dir
            && let Ok(entries) = std::fs::read_dir(dir.join(group))
        {
            names.extend(entries.filter_map(Result::ok).filter_map(|e| {
                let path = e.path();
                (path
                    .extension()
                    .is_some_and(|x| FILE_EXTENSIONS.iter().any(|e| x == *e)))
                .then(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()))
                .flatten()
            }));
        }
        names.sort();
        names.dedup();
        names
    }

    /// Where presets are looked up, in words: "built in" or
    /// "built in and in `presets/`".
    pub fn describe(&self) -> String {
        match &self.dir {
            Some(dir) => format!("built in and in `{}`", dir.display()),
            None => "built in".to_string(),
        }
    }

    /// The layer of `key` (`defaults`, `hardware/t4`): the directory's file if
    /// it has one, else the built-in text; `None` if neither exists.
    pub(crate) fn layer(&self, kind: LayerKind, key: &str) -> Result<Option<Layer>, ConfigError> {
        if let Some(dir) = &self.dir
            && let Some(path) = preset_file(dir, key)?
        {
            return Layer::from_file(kind, &path).map(Some);
        }
        BUILT_IN
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, text)| {
                Layer::from_toml(kind, &PathBuf::from(format!("built-in {key}.toml")), text)
            })
            .transpose()
    }

    /// The defaults: the built-in ones, with the directory's `defaults.toml`
    /// (if any) over them. The second value is the built-in defaults alone,
    /// whose keys are the valid ones.
    pub(crate) fn defaults(&self) -> Result<(Layer, Layer), ConfigError> {
        let built_in = Layer::from_toml(
            LayerKind::Defaults,
            Path::new("built-in defaults.toml"),
            built_in_defaults(),
        )?;
        let mut merged = built_in.clone();
        if let Some(dir) = &self.dir
            && let Some(path) = preset_file(dir, "defaults")?
        {
            let over = Layer::from_file(LayerKind::Defaults, &path)?;
            merged.overlay(over.dict, over.locations);
        }
        Ok((merged, built_in))
    }
}

/// The file of preset `key` (`hardware/t4`) in `dir`: `t4.toml`, or
/// `t4.yaml`, `t4.yml` or `t4.json`; an error where it has two of them.
fn preset_file(dir: &Path, key: &str) -> Result<Option<PathBuf>, ConfigError> {
    let found: Vec<PathBuf> = FILE_EXTENSIONS
        .iter()
        .map(|ext| dir.join(format!("{key}.{ext}")))
        .filter(|p| p.is_file())
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        [first, second, ..] => Err(ConfigError::TwoPresetFiles {
            first: first.clone(),
            second: second.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_list_is_the_presets_folder() {
        // The checkout `cargo test` runs in (a shared target directory may
        // hold a test binary compiled in another one).
        let root = std::env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(
                || env!("CARGO_MANIFEST_DIR").into(),
                std::path::PathBuf::from,
            )
            .join("presets");
        let mut on_disk = Vec::new();
        for group in ["", "hardware", "experiment"] {
            for entry in std::fs::read_dir(root.join(group)).expect("presets folder") {
                let path = entry.expect("entry").path();
                if path.extension().is_some_and(|x| x == "toml") {
                    let stem = path.file_stem().expect("stem").to_string_lossy();
                    let key = if group.is_empty() {
                        stem.into_owned()
                    } else {
                        format!("{group}/{stem}")
                    };
                    let text = std::fs::read_to_string(&path).expect("read");
                    on_disk.push((key, text));
                }
            }
        }
        on_disk.sort();
        let mut built_in: Vec<(String, String)> = BUILT_IN
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_string()))
            .collect();
        built_in.sort();
        let names = |v: &[(String, String)]| v.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(&built_in),
            names(&on_disk),
            "add new preset files to BUILT_IN"
        );
        assert_eq!(built_in, on_disk);
        assert_eq!(BUILT_IN[0].0, "defaults");
    }

    #[test]
    fn the_source_folder_is_the_built_ins_and_a_copy_is_not() {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("presets");
        assert!(is_built_in_source(&source));
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::copy(
            source.join("defaults.toml"),
            tmp.path().join("defaults.toml"),
        )
        .expect("copy");
        assert!(!is_built_in_source(tmp.path()));
        assert!(!is_built_in_source(&tmp.path().join("nope")));
    }

    #[test]
    fn a_directory_adds_and_replaces_presets() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(tmp.path().join("hardware")).expect("mkdir");
        std::fs::write(tmp.path().join("hardware/t4.toml"), "# mine\n").expect("write");
        std::fs::write(tmp.path().join("hardware/my_gpu.toml"), "").expect("write");
        let presets = Presets::with_dir(tmp.path()).expect("dir");
        let names = presets.names("hardware");
        assert!(names.contains(&"my_gpu".to_string()) && names.contains(&"a100".to_string()));
        assert_eq!(names.iter().filter(|n| *n == "t4").count(), 1);
        let t4 = presets
            .layer(LayerKind::Hardware("t4".into()), "hardware/t4")
            .expect("read")
            .expect("t4");
        assert!(
            t4.dict.is_empty(),
            "the directory's t4 replaces the built-in one"
        );
        let a100 = Presets::built_in()
            .layer(LayerKind::Hardware("a100".into()), "hardware/a100")
            .expect("read")
            .expect("a100");
        assert!(
            a100.location_of("training.batch_size")
                .starts_with("built-in hardware/a100.toml:")
        );
        assert!(Presets::with_dir(tmp.path().join("nope")).is_err());
    }
}
