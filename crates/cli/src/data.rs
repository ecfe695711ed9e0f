//! The data of kiln's default experiments, built into the binary: a `kiln`
//! installed anywhere trains `experiment=shakespeare_char` and cross-validates
//! `experiment=nli_snli` from an empty directory. The first run that needs a
//! corpus writes it where the configuration looks for it (`data/…` under the
//! working directory), with `data/README.md` giving its source and license.

use std::path::Path;

use anyhow::Context as _;

/// The built-in corpora, by the path the shipped presets give them.
const CORPORA: &[(&str, &[u8])] = &[
    (
        "data/tinyshakespeare.txt",
        include_bytes!("../data/tinyshakespeare.txt"),
    ),
    (
        "data/snli_sample.jsonl",
        include_bytes!("../data/snli_sample.jsonl"),
    ),
];

/// Where the corpora come from and under which licenses.
const ATTRIBUTION: &str = include_str!("../data/README.md");

/// Writes the built-in corpus `path` names (as the shipped presets spell it,
/// relative to `base`) when it is missing; any other path is left to the
/// loader to read (and to report if missing). Returns what was written.
pub(crate) fn provide(base: &Path, path: &Path) -> anyhow::Result<Option<String>> {
    let Some((name, bytes)) = CORPORA.iter().find(|(name, _)| Path::new(name) == path) else {
        return Ok(None);
    };
    let path = base.join(path);
    if path.exists() {
        return Ok(None);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating `{}`", dir.display()))?;
    // Atomically, so that an interrupted write leaves no half corpus behind.
    kiln_train::write_atomic(&path, bytes)?;
    let readme = dir.join("README.md");
    if !readme.exists() {
        kiln_train::write_atomic(&readme, ATTRIBUTION.as_bytes())?;
    }
    let shown = Path::new(name).with_file_name("README.md");
    Ok(Some(format!(
        "wrote kiln's built-in `{name}` ({:.1} MB; source and license: `{}`)",
        bytes.len() as f64 / 1e6,
        shown.display()
    )))
}

/// [`provide`] for a command about to read the configuration's corpus; says
/// on stderr what it wrote.
pub(crate) fn provide_for(config: &kiln_config::RunConfig) -> anyhow::Result<()> {
    if let Some(note) = provide(Path::new("."), Path::new(&config.data.path))? {
        eprintln!("{note}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_default_corpus_is_written_once_with_its_attribution() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("data/tinyshakespeare.txt");
        // Only the presets' own relative paths are built in.
        assert!(provide(tmp.path(), &path).expect("provide").is_none());
        assert!(
            provide(tmp.path(), Path::new("data/other.txt"))
                .expect("provide")
                .is_none()
        );
        assert!(!path.exists());

        let name = Path::new("data/tinyshakespeare.txt");
        let first = provide(tmp.path(), name).expect("written").expect("a note");
        assert!(first.contains("data/README.md"), "{first}");
        let second = provide(tmp.path(), name).expect("ok");
        assert!(second.is_none(), "an existing corpus is kept");
        let text = std::fs::read_to_string(&path).expect("corpus");
        assert_eq!(text.len(), 1_115_394);
        assert!(text.starts_with("First Citizen:"));
        let readme = std::fs::read_to_string(tmp.path().join("data/README.md")).expect("readme");
        assert!(readme.contains("tinyshakespeare.txt") && readme.contains("CC BY-SA 4.0"));
    }
}
