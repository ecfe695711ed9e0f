//! One configuration layer: a TOML file, the `KILN_` environment, or the
//! command line, as a figment provider that also remembers where each key was
//! written (file and line, variable name, or argument).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use figment::value::{Dict, Map, Value};
use figment::{Metadata, Profile, Provider};
use saphyr::{LoadableYamlNode, MarkedYaml, Scalar, YamlData};

use crate::error::ConfigError;

/// Which layer a value came from, lowest first.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LayerKind {
    /// The built-in `defaults.toml`, with a presets directory's over it.
    Defaults,
    /// The hardware preset of this name.
    Hardware(String),
    /// The experiment preset of this name.
    Experiment(String),
    /// `presets/tuned/<machine>.toml`, written by `kiln tune`.
    Tuned(String),
    /// `--config FILE`.
    ConfigFile,
    /// `KILN_*` environment variables.
    Environment,
    /// `key=value` arguments.
    CommandLine,
    /// `hardware=auto` resolved from the detected machine.
    HardwareDetection,
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Defaults => write!(f, "defaults"),
            Self::Hardware(name) => write!(f, "hardware preset `{name}`"),
            Self::Experiment(name) => write!(f, "experiment `{name}`"),
            Self::Tuned(machine) => write!(f, "tuned preset `{machine}`"),
            Self::ConfigFile => write!(f, "config file"),
            Self::Environment => write!(f, "environment"),
            Self::CommandLine => write!(f, "command line"),
            Self::HardwareDetection => write!(f, "hardware detection"),
        }
    }
}

/// Where a resolved value was set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// Which layer.
    pub layer: LayerKind,
    /// `presets/hardware/t4.toml:12`, `KILN_TRAINING__BATCH_SIZE`,
    /// `training.batch_size=10`, or the reason for an automatic choice.
    pub location: String,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.layer, self.location)
    }
}

/// A parsed layer.
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    pub(crate) kind: LayerKind,
    pub(crate) dict: Dict,
    /// Dotted key → where it was written.
    pub(crate) locations: BTreeMap<String, String>,
    /// The file, for file layers.
    pub(crate) file: Option<PathBuf>,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        let meta = Metadata::named(self.kind.to_string());
        match &self.file {
            Some(path) => meta.source(figment::Source::File(path.clone())),
            None => meta,
        }
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// The formats a configuration file can be in, by its name's extension.
pub(crate) const FILE_EXTENSIONS: &[&str] = &["toml", "yaml", "yml", "json"];

impl Layer {
    /// Reads and parses a configuration file: YAML where its name ends in
    /// `.yaml` or `.yml` (Hydra's configs), JSON where it ends in `.json`,
    /// else TOML. A syntax error names file, line and column.
    pub(crate) fn from_file(kind: LayerKind, path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => Self::from_yaml(kind, path, &text, "YAML"),
            // JSON is YAML 1.2 (flow style), which saphyr reads.
            Some("json") => Self::from_yaml(kind, path, &text, "JSON"),
            _ => Self::from_toml(kind, path, &text),
        }
    }

    /// Parses YAML (or JSON, `format`): one document, a mapping of keys;
    /// `null` is kiln's `"none"`. Anchors and aliases are resolved.
    pub(crate) fn from_yaml(
        kind: LayerKind,
        path: &Path,
        text: &str,
        format: &'static str,
    ) -> Result<Self, ConfigError> {
        let mut reader = YamlReader {
            path,
            format,
            locations: BTreeMap::new(),
        };
        let docs = MarkedYaml::load_from_str(text)
            .map_err(|e| reader.syntax(e.marker(), e.info().to_string()))?;
        let dict = match docs.as_slice() {
            [] => Dict::new(),
            [doc] => match &doc.data {
                YamlData::Mapping(map) => reader.dict(map, "")?,
                YamlData::Value(Scalar::Null) => Dict::new(),
                _ => {
                    return Err(reader.syntax(
                        &doc.span.start,
                        "expected a mapping of keys (`training:` then `  batch_size: 16` on the next line)".into(),
                    ));
                }
            },
            [_, second, ..] => {
                return Err(reader.syntax(
                    &second.span.start,
                    "a second document (after `---`): a configuration file is one".into(),
                ));
            }
        };
        Ok(Self {
            kind,
            dict,
            locations: reader.locations,
            file: Some(path.to_path_buf()),
        })
    }

    pub(crate) fn from_toml(kind: LayerKind, path: &Path, text: &str) -> Result<Self, ConfigError> {
        let syntax = |e: toml::de::Error| {
            let (line, column) = e.span().map(|s| line_col(text, s.start)).unwrap_or((1, 1));
            ConfigError::Syntax {
                path: path.to_path_buf(),
                format: "TOML",
                line,
                column,
                message: e.message().trim().to_string(),
            }
        };
        let spanned = toml::de::DeTable::parse(text).map_err(syntax)?;
        let dict: Dict = toml::from_str(text).map_err(syntax)?;
        let mut locations = BTreeMap::new();
        collect_lines(spanned.get_ref(), "", text, path, &mut locations);
        Ok(Self {
            kind,
            dict,
            locations,
            file: Some(path.to_path_buf()),
        })
    }

    /// A layer from `key=value` pairs (environment or command line); `origin`
    /// is what to show as the location of each pair.
    pub(crate) fn from_pairs(
        kind: LayerKind,
        pairs: &[(String, String, String)],
    ) -> Result<Self, ConfigError> {
        let mut dict = Dict::new();
        let mut locations = BTreeMap::new();
        for (key, raw, origin) in pairs {
            check_key(key, origin)?;
            insert_dotted(&mut dict, key, parse_value(raw));
            locations.insert(key.clone(), origin.clone());
        }
        Ok(Self {
            kind,
            dict,
            locations,
            file: None,
        })
    }

    /// The location of `key` in this layer (of a table, its first key's:
    /// `nonsense.key=1` for the unknown table `nonsense`), falling back to
    /// the file.
    pub(crate) fn location_of(&self, key: &str) -> String {
        if let Some(loc) = self.locations.get(key) {
            return loc.clone();
        }
        let table = format!("{key}.");
        if let Some((_, loc)) = self.locations.iter().find(|(k, _)| k.starts_with(&table)) {
            return loc.clone();
        }
        match &self.file {
            Some(p) => p.display().to_string(),
            None => String::from("?"),
        }
    }

    /// Removes a top-level table and returns it with its locations, keys
    /// re-rooted (used for the `[lm]` / `[nli]` sections of hardware presets).
    pub(crate) fn take_section(&mut self, name: &str) -> Option<(Dict, BTreeMap<String, String>)> {
        let Some(Value::Dict(_, section)) = self.dict.remove(name) else {
            return None;
        };
        let prefix = format!("{name}.");
        let moved: BTreeMap<String, String> = self
            .locations
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix(&prefix)
                    .map(|rest| (rest.to_string(), format!("{v}, [{name}] section")))
            })
            .collect();
        self.locations
            .retain(|k, _| !k.starts_with(&prefix) && k != name);
        Some((section, moved))
    }

    /// Merges `over` into this layer's values (later wins).
    pub(crate) fn overlay(&mut self, over: Dict, locations: BTreeMap<String, String>) {
        deep_merge(&mut self.dict, over);
        self.locations.extend(locations);
    }
}

/// Parses a command-line or environment value as TOML (`20`, `true`, `1e-3`,
/// `"text"`, `[1, 2]`); anything that is not TOML is taken as a string.
/// Hydra's `null` is kiln's `"none"`, as YAML's is.
pub(crate) fn parse_value(raw: &str) -> Value {
    if raw == "null" {
        return Value::from("none");
    }
    let doc = format!("v = {raw}");
    match toml::from_str::<Dict>(&doc) {
        Ok(mut d) => d
            .remove("v")
            .unwrap_or_else(|| Value::from(raw.to_string())),
        Err(_) => Value::from(raw.to_string()),
    }
}

fn check_key(key: &str, origin: &str) -> Result<(), ConfigError> {
    let ok = !key.is_empty()
        && key.split('.').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(ConfigError::BadOverride {
            arg: origin.to_string(),
            reason: format!(
                "`{key}` is not a key: keys are words joined by dots, like training.batch_size"
            ),
        })
    }
}

fn insert_dotted(dict: &mut Dict, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            dict.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = dict
                .entry(head.to_string())
                .or_insert_with(|| Value::from(Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert_dotted(inner, rest, value);
            }
        }
    }
}

pub(crate) fn deep_merge(base: &mut Dict, over: Dict) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(Value::Dict(_, b)), Value::Dict(_, o)) => deep_merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

fn collect_lines(
    table: &toml::de::DeTable<'_>,
    prefix: &str,
    text: &str,
    path: &Path,
    out: &mut BTreeMap<String, String>,
) {
    for (key, value) in table {
        let full = if prefix.is_empty() {
            key.get_ref().to_string()
        } else {
            format!("{prefix}.{}", key.get_ref())
        };
        let (line, _) = line_col(text, key.span().start);
        out.insert(full.clone(), format!("{}:{line}", path.display()));
        if let toml::de::DeValue::Table(inner) = value.get_ref() {
            collect_lines(inner, &full, text, path, out);
        }
    }
}

/// A YAML file read into a layer's dict, each key's line recorded under
/// its dotted name.
struct YamlReader<'a> {
    path: &'a Path,
    /// "YAML" or "JSON", for errors.
    format: &'static str,
    locations: BTreeMap<String, String>,
}

impl YamlReader<'_> {
    fn syntax(&self, at: &saphyr::Marker, message: String) -> ConfigError {
        ConfigError::Syntax {
            path: self.path.to_path_buf(),
            format: self.format,
            line: at.line(),
            column: at.col() + 1,
            message,
        }
    }

    /// A mapping under `prefix` (dotted; "" at the top) as a dict.
    fn dict(
        &mut self,
        map: &saphyr::AnnotatedMapping<'_, MarkedYaml<'_>>,
        prefix: &str,
    ) -> Result<Dict, ConfigError> {
        let mut dict = Dict::new();
        for (key, value) in map {
            let YamlData::Value(Scalar::String(name)) = &key.data else {
                return Err(self.syntax(
                    &key.span.start,
                    "a key must be a name, like batch_size".into(),
                ));
            };
            let full = if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}.{name}")
            };
            self.locations.insert(
                full.clone(),
                format!("{}:{}", self.path.display(), key.span.start.line()),
            );
            let value = self.value(value, &full)?;
            dict.insert(name.to_string(), value);
        }
        Ok(dict)
    }

    /// The value of `key` (dotted).
    fn value(&mut self, node: &MarkedYaml<'_>, key: &str) -> Result<Value, ConfigError> {
        Ok(match &node.data {
            // kiln's optional keys take "none" (TOML has no null).
            YamlData::Value(Scalar::Null) => Value::from("none"),
            YamlData::Value(Scalar::Boolean(b)) => Value::from(*b),
            YamlData::Value(Scalar::Integer(i)) => Value::from(*i),
            YamlData::Value(Scalar::FloatingPoint(f)) => Value::from(f.into_inner()),
            YamlData::Value(Scalar::String(s)) => Value::from(s.to_string()),
            YamlData::Sequence(items) => Value::from(
                items
                    .iter()
                    .map(|item| self.value(item, key))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            YamlData::Mapping(map) => Value::from(self.dict(map, key)?),
            YamlData::Tagged(_, inner) => self.value(inner, key)?,
            YamlData::Representation(..) | YamlData::Alias(_) | YamlData::BadValue => {
                return Err(self.syntax(
                    &node.span.start,
                    format!("the value of `{key}` could not be read"),
                ));
            }
        })
    }
}

/// 1-based line and column of a byte offset.
pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Every leaf key of a dict, dotted.
pub(crate) fn leaf_keys(dict: &Dict) -> Vec<String> {
    fn walk(dict: &Dict, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in dict {
            let full = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Value::Dict(_, inner) => walk(inner, &full, out),
                _ => out.push(full),
            }
        }
    }
    let mut out = Vec::new();
    walk(dict, "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_as_toml_or_fall_back_to_strings() {
        assert_eq!(parse_value("20").to_i128(), Some(20));
        assert_eq!(parse_value("-1").to_i128(), Some(-1));
        assert_eq!(parse_value("true").to_bool(), Some(true));
        assert_eq!(parse_value("1e-3").to_f64(), Some(1e-3));
        assert_eq!(parse_value("abc").as_str(), Some("abc"));
        assert_eq!(parse_value("data/x.txt").as_str(), Some("data/x.txt"));
        assert_eq!(parse_value("\"20\"").as_str(), Some("20"));
        assert_eq!(parse_value("null").as_str(), Some("none"));
        assert_eq!(parse_value("\"null\"").as_str(), Some("null"));
    }

    #[test]
    fn file_layers_know_the_line_of_each_key() {
        let text = "# comment\nworkload = \"lm\"\n\n[training]\nbatch_size = 8\n\n[lm.training]\nbatch_size = 12\n";
        let mut layer =
            Layer::from_toml(LayerKind::Defaults, Path::new("d.toml"), text).expect("parses");
        assert_eq!(layer.location_of("workload"), "d.toml:2");
        assert_eq!(layer.location_of("training.batch_size"), "d.toml:5");
        let (section, locs) = layer.take_section("lm").expect("has [lm]");
        assert!(section.contains_key("training"));
        assert_eq!(locs["training.batch_size"], "d.toml:8, [lm] section");
        assert!(!layer.dict.contains_key("lm"));
    }

    #[test]
    fn syntax_errors_name_line_and_column() {
        let err = Layer::from_toml(LayerKind::Defaults, Path::new("x.toml"), "a = 1\nb = [\n")
            .expect_err("broken");
        match err {
            ConfigError::Syntax { line, .. } => assert!(line >= 2, "{line}"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn yaml_and_json_layers_know_the_line_of_each_key() {
        let text = "# Hydra's style\nworkload: lm\ntraining:\n  batch_size: 8\n  learning_rate: 3e-4\n  layers: &n 2\nmodel: {init_from: null, layers: *n}\nlm:\n  training:\n    batch_size: 12\n";
        let mut layer = Layer::from_yaml(LayerKind::Defaults, Path::new("d.yaml"), text, "YAML")
            .expect("parses");
        assert_eq!(layer.location_of("workload"), "d.yaml:2");
        assert_eq!(layer.location_of("training.batch_size"), "d.yaml:4");
        assert_eq!(layer.location_of("model.init_from"), "d.yaml:7");
        let training = layer.dict["training"].as_dict().expect("a table");
        assert_eq!(training["batch_size"].to_i128(), Some(8));
        assert_eq!(training["learning_rate"].to_f64(), Some(3e-4));
        let model = layer.dict["model"].as_dict().expect("a table");
        assert_eq!(model["init_from"].as_str(), Some("none"));
        assert_eq!(model["layers"].to_i128(), Some(2));
        let (_, locs) = layer.take_section("lm").expect("has lm");
        assert_eq!(locs["training.batch_size"], "d.yaml:10, [lm] section");

        let json = "{\n  \"training\": {\"batch_size\": 3, \"amp\": true},\n  \"data\": {\"labels\": [\"a\", \"b\"]}\n}\n";
        let layer = Layer::from_yaml(LayerKind::Defaults, Path::new("c.json"), json, "JSON")
            .expect("parses");
        assert_eq!(layer.location_of("training.batch_size"), "c.json:2");
        let data = layer.dict["data"].as_dict().expect("a table");
        assert_eq!(
            data["labels"].as_array().map(|a| a.len()),
            Some(2),
            "{:?}",
            data["labels"]
        );
        // An empty file is an empty layer.
        let empty = Layer::from_yaml(
            LayerKind::Defaults,
            Path::new("e.yaml"),
            "# nothing\n",
            "YAML",
        )
        .expect("parses");
        assert!(empty.dict.is_empty());
    }

    #[test]
    fn yaml_that_is_not_one_mapping_of_named_keys_names_line_and_column() {
        for (text, line, column, says) in [
            ("a: 1\nb: [\n", 3, 1, "invalid YAML: while parsing"),
            ("- a\n- b\n", 1, 1, "expected a mapping of keys"),
            ("a: 1\n---\nb: 2\n", 3, 1, "a second document"),
            ("training:\n  1: 2\n", 2, 3, "a key must be a name"),
            ("a: 1\na: 2\n", 2, 1, "duplicated key"),
        ] {
            let err = Layer::from_yaml(LayerKind::ConfigFile, Path::new("x.yaml"), text, "YAML")
                .expect_err(text);
            let shown = err.to_string();
            match err {
                ConfigError::Syntax {
                    line: l, column: c, ..
                } => assert_eq!((l, c), (line, column), "{text:?}: {shown}"),
                other => panic!("{text:?}: {other:?}"),
            }
            assert!(
                shown.starts_with("`x.yaml` line ") && shown.contains(says),
                "{shown}"
            );
        }
    }

    #[test]
    fn keys_must_be_dotted_words() {
        for bad in ["", ".a", "a..b", "a b", "+a"] {
            let pairs = vec![(bad.to_string(), "1".to_string(), format!("{bad}=1"))];
            assert!(
                Layer::from_pairs(LayerKind::CommandLine, &pairs).is_err(),
                "{bad:?}"
            );
        }
    }
}
