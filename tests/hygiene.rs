//! Checks that keep the repository honest: every module documented, every
//! preset value explained, the docs in step with the code and the presets.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::support::root;

fn files_with_extension(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            files_with_extension(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "tests", "bench"] {
        files_with_extension(&root().join(dir), "rs", &mut files);
    }
    assert!(files.len() > 10);
    // A library crate's root may open with its README as the crate doc
    // (whose example is then a doctest), followed by `//!` lines.
    let readme_doc = "#![doc = include_str!(\"../README.md\")]";
    let undocumented: Vec<_> = files
        .iter()
        .filter(|f| {
            let text = read(f);
            let text = text.trim_start();
            let text = text.strip_prefix(readme_doc).unwrap_or(text).trim_start();
            !text.starts_with("//!")
        })
        .collect();
    assert!(
        undocumented.is_empty(),
        "files without a leading `//!` doc: {undocumented:?}"
    );
}

#[test]
fn every_library_crate_documents_its_public_items() {
    // With clippy's `-D warnings` in CI, an undocumented public item fails it.
    for lib in [
        "hwdetect", "config", "plan", "data", "model", "train", "dist",
    ] {
        let path = root().join("crates").join(lib).join("src/lib.rs");
        assert!(
            read(&path).contains("\n#![warn(missing_docs)]\n"),
            "{} lacks `#![warn(missing_docs)]`",
            path.display()
        );
    }
}

#[test]
fn the_presets_users_read_are_the_ones_built_in() {
    // One folder, no copy that can drift: kiln-config compiles its presets
    // from `crates/config/presets`, a link to the top-level `presets/` (cargo
    // package follows it, so the published crate carries the files).
    let top = root().join("presets");
    let crate_dir = root().join("crates/config/presets");
    assert!(
        std::fs::symlink_metadata(&crate_dir)
            .expect("crates/config/presets")
            .file_type()
            .is_symlink(),
        "crates/config/presets must link to the top-level presets/"
    );
    assert_eq!(
        crate_dir.canonicalize().expect("resolves"),
        top.canonicalize().expect("presets/")
    );
}

#[test]
fn every_preset_value_says_why() {
    // Each key line needs a comment above it, directly or heading its group of
    // consecutive keys, in the same table.
    let mut files = Vec::new();
    files_with_extension(&root().join("presets"), "toml", &mut files);
    assert!(files.len() >= 15, "{files:?}");
    for file in files {
        let mut explained = false;
        for (n, line) in read(&file).lines().enumerate() {
            let line = line.trim();
            if line.starts_with('#') {
                explained = true;
            } else if line.is_empty() || line.starts_with('[') {
                explained = false;
            } else if !explained && !line.contains(" # ") {
                panic!(
                    "{}:{}: `{line}` has no comment saying why",
                    file.display(),
                    n + 1
                );
            }
        }
    }
}

/// Every dotted key of the configuration, from `kiln config` on the defaults.
fn config_keys() -> BTreeSet<String> {
    leaf_keys(&root().join("presets/defaults.toml"))
}

/// The dotted leaf keys a TOML file sets.
fn leaf_keys(path: &Path) -> BTreeSet<String> {
    let table: toml::Table = toml::from_str(&read(path)).expect("TOML parses");
    let mut keys = BTreeSet::new();
    fn walk(t: &toml::Table, prefix: &str, out: &mut BTreeSet<String>) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(inner) => walk(inner, &key, out),
                _ => {
                    out.insert(key);
                }
            }
        }
    }
    walk(&table, "", &mut keys);
    keys
}

#[test]
fn defaults_name_every_key_of_run_config() {
    // A RunConfig serialised has every field; defaults.toml must set each.
    let run = crate::support::kiln(&["config", "hardware=cpu"])
        .run()
        .expect_code(0);
    let resolved: toml::Table = toml::from_str(&run.stdout).expect("TOML");
    let mut from_struct = BTreeSet::new();
    for (k, v) in &resolved {
        match v {
            toml::Value::Table(t) => from_struct.extend(t.keys().map(|f| format!("{k}.{f}"))),
            _ => {
                from_struct.insert(k.clone());
            }
        }
    }
    assert_eq!(from_struct, config_keys());
}

#[test]
fn config_doc_lists_every_key_with_its_default() {
    let doc = read(&root().join("docs/CONFIG.md"));
    let defaults: toml::Table =
        toml::from_str(&read(&root().join("presets/defaults.toml"))).expect("parses");
    let mut documented = BTreeSet::new();
    for line in doc.lines() {
        // | `training.batch_size` | `12` | meaning |
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let key = cells[1].trim_matches('`');
        if !key.contains('.') && !["hardware", "experiment", "workload"].contains(&key) {
            continue;
        }
        let mut value = toml::Value::Table(defaults.clone());
        for part in key.split('.') {
            value = value
                .get(part)
                .cloned()
                .unwrap_or_else(|| panic!("docs/CONFIG.md documents `{key}`, which is not a key"));
        }
        assert_eq!(
            cells[2].trim_matches('`'),
            value.to_string(),
            "docs/CONFIG.md default of `{key}`"
        );
        documented.insert(key.to_string());
    }
    let missing: Vec<_> = config_keys().difference(&documented).cloned().collect();
    assert!(missing.is_empty(), "docs/CONFIG.md lacks {missing:?}");
}

/// The preset table of docs/PRESETS.md, made from the preset files.
fn presets_table() -> String {
    let presets = kiln_config::Presets::built_in();
    let report = kiln_hwdetect::detect_cpu_only();
    let resolve = |hardware: &str, experiment: &str| {
        let overrides = [
            format!("hardware={hardware}"),
            format!("experiment={experiment}"),
        ];
        let overrides: Vec<&str> = overrides.iter().map(String::as_str).collect();
        kiln_config::resolve_overrides(&presets, &overrides, &report)
            .unwrap_or_else(|e| panic!("{hardware}: {e}"))
            .config
    };
    let mut out = String::from(
        "| preset | for | batch × accum (lm) | batch × accum (nli) | max_length (lm) | precision | tf32 | compile | grad. checkpointing | freeze encoder | workers |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for name in presets.names("hardware") {
        let lm = resolve(&name, "shakespeare_char");
        let nli = resolve(&name, "nli_snli");
        let gpus = kiln_config::PRESET_GPUS
            .iter()
            .chain(kiln_config::PRESET_OTHER_GPUS)
            .find(|(p, _)| *p == name)
            .map(|(_, models)| models.join(", "))
            .unwrap_or_else(|| match name.as_str() {
                "cpu" => "no GPU".to_string(),
                "low_mem" => "8–12 GB GPUs".to_string(),
                "conservative" => "any GPU".to_string(),
                n if n == kiln_config::APPLE_PRESET => "Apple M1–M4".to_string(),
                _ => String::from("—"),
            });
        let p = &lm.precision;
        let precision = if p.amp {
            format!("{:?}", p.amp_dtype).to_lowercase()
        } else {
            "f32".to_string()
        };
        let yes = |b: bool| if b { "yes" } else { "no" };
        out.push_str(&format!(
            "| `{name}` | {gpus} | {} × {} | {} × {} | {} | {precision} | {} | {} | {} | {} | {} |\n",
            lm.training.batch_size,
            lm.training.gradient_accumulation_steps,
            nli.training.batch_size,
            nli.training.gradient_accumulation_steps,
            lm.model.max_length,
            yes(p.tf32),
            yes(lm.optimization.compile),
            yes(lm.model.gradient_checkpointing),
            yes(lm.model.freeze_encoder),
            lm.loader.num_workers,
        ));
    }
    out
}

#[test]
fn presets_doc_tables_match_the_files() {
    let table = presets_table();
    for doc_name in ["docs/PRESETS.md", "docs/GPU_TUNING.md"] {
        let path = root().join(doc_name);
        let doc = read(&path);
        let (start, end) = ("<!-- presets:start -->\n", "<!-- presets:end -->");
        let (Some(a), Some(b)) = (doc.find(start), doc.find(end)) else {
            panic!("{doc_name} lacks the {start:?} … {end:?} markers");
        };
        let current = &doc[a + start.len()..b];
        if current != table {
            if std::env::var_os("UPDATE_DOCS").is_some() {
                let updated = format!("{}{table}{}", &doc[..a + start.len()], &doc[b..]);
                std::fs::write(&path, updated).expect("write the doc");
            } else {
                panic!(
                    "{doc_name} is out of date with presets/: run `UPDATE_DOCS=1 cargo test -p kiln-tests` to regenerate. Expected:\n{table}"
                );
            }
        }
    }
}

/// docs/GPU_TUNING.md explains every key a hardware preset sets, and every
/// key it explains exists.
#[test]
fn tuning_guide_explains_every_preset_knob() {
    let doc = read(&root().join("docs/GPU_TUNING.md"));
    let keys = config_keys();
    let explained: BTreeSet<String> = doc
        .lines()
        .filter(|l| l.starts_with("**`"))
        .flat_map(|l| {
            let head = l.split("** ").next().unwrap_or(l).to_string();
            head.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    for key in &explained {
        assert!(
            keys.contains(key),
            "docs/GPU_TUNING.md explains `{key}`, which is not a config key"
        );
    }
    let mut files = Vec::new();
    files_with_extension(&root().join("presets/hardware"), "toml", &mut files);
    let set: BTreeSet<String> = files.iter().flat_map(|f| leaf_keys(f)).collect();
    let set: BTreeSet<String> = set
        .into_iter()
        .map(|k| {
            k.strip_prefix("lm.")
                .or(k.strip_prefix("nli."))
                .map_or(k.clone(), str::to_string)
        })
        .collect();
    let missing: Vec<_> = set.difference(&explained).collect();
    assert!(
        missing.is_empty(),
        "docs/GPU_TUNING.md does not explain {missing:?}, which presets set"
    );
}

#[test]
fn detection_config_and_planning_crates_do_not_depend_on_burn() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    for krate in ["kiln-hwdetect", "kiln-config", "kiln-plan", "kiln-dist"] {
        let out = std::process::Command::new(&cargo)
            .args([
                "tree",
                "--offline",
                "--package",
                krate,
                "--edges",
                "normal",
                "--prefix",
                "none",
            ])
            .current_dir(root())
            .output()
            .expect("run cargo tree");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let tree = String::from_utf8_lossy(&out.stdout);
        assert!(tree.contains(krate), "{tree}");
        let ml: Vec<&str> = tree
            .lines()
            .filter(|l| {
                l.starts_with("burn")
                    || l.starts_with("cubecl")
                    || l.starts_with("kiln-model")
                    || l.starts_with("kiln-train")
            })
            .collect();
        assert!(ml.is_empty(), "{krate} depends on {ml:?}");
    }
}

/// The top-level modules of a crate's `src/` that each module's `use
/// crate::...` lines name (a folder module with its files counts as one).
fn module_imports(
    src: &Path,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut graph = std::collections::BTreeMap::new();
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let modules: std::collections::BTreeSet<String> = files
        .iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(src).ok()?;
            let first = rel.components().next()?.as_os_str().to_str()?;
            Some(first.trim_end_matches(".rs").to_string())
        })
        .filter(|m| m != "lib" && m != "main")
        .collect();
    // What lib.rs re-exports, by name: `pub use module::{A, B};`.
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let mut exported: std::collections::BTreeMap<String, String> = Default::default();
    for stmt in lib.split("pub use ").skip(1) {
        let stmt = stmt.split(';').next().unwrap_or("");
        let Some((module, rest)) = stmt.split_once("::") else {
            continue;
        };
        for name in rest.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if !name.is_empty() {
                exported.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    let ident = |t: &str| -> String {
        t.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for f in &files {
        let rel = f.strip_prefix(src).expect("under src");
        let Some(first) = rel.components().next().and_then(|c| c.as_os_str().to_str()) else {
            continue;
        };
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read module");
        // Only the module's own code, not its tests.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut names = Vec::new();
        for after in code.split("crate::").skip(1) {
            if let Some(group) = after.strip_prefix('{') {
                let group = group.split('}').next().unwrap_or("");
                names.extend(group.split(',').map(ident));
            } else {
                names.push(ident(after));
            }
        }
        let deps: &mut std::collections::BTreeSet<String> =
            graph.entry(module.clone()).or_default();
        for name in names {
            let target = if modules.contains(&name) {
                Some(name)
            } else {
                exported.get(&name).cloned()
            };
            if let Some(t) = target.filter(|t| t != &module) {
                deps.insert(t);
            }
        }
    }
    graph
}

#[test]
fn kiln_train_modules_import_each_other_without_a_circle() {
    let graph = module_imports(&root().join("crates/train/src"));
    assert!(
        graph.contains_key("step") && graph.contains_key("workload"),
        "{graph:?}"
    );
    // Depth-first search for a back edge.
    fn visit(
        m: &str,
        graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) {
        if let Some(i) = path.iter().position(|p| p == m) {
            panic!("import circle: {} → {m}", path[i..].join(" → "));
        }
        if done.contains(m) {
            return;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            visit(d, graph, path, done);
        }
        path.pop();
        done.insert(m.to_string());
    }
    let mut done = std::collections::BTreeSet::new();
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done);
    }
}
