//! Writing `presets/tuned/<machine>.toml`, next to the code that reads it
//! ([`crate::tuned_path`], `hardware=tuned`).

use std::path::Path;

/// Writes `block` into the tuned-preset file at `path`, replacing the
/// experiment's earlier block and keeping the others; atomically, so an
/// interrupted write leaves the old file whole.
pub fn write_tuned(path: &Path, experiment: &str, block: &str) -> std::io::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    fn marker(line: &str) -> Option<&str> {
        line.strip_prefix("# == ")?.strip_suffix(" ==")
    }
    let mut kept = String::new();
    let mut skipping = false;
    let mut preamble = true;
    for line in old.lines() {
        if let Some(name) = marker(line) {
            preamble = false;
            skipping = name == experiment;
        }
        if preamble && line.starts_with('#') {
            continue; // the file header is written anew
        }
        if !skipping {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let kept = kept.trim();
    let mut text = String::from(
        "# Written by `kiln tune`: this machine's measured settings, one block per\n\
         # experiment, used with hardware=tuned (over the preset hardware=auto picks).\n\n",
    );
    if !kept.is_empty() {
        text.push_str(kept);
        text.push_str("\n\n");
    }
    text.push_str(block);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut tmp, text.as_bytes())?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_replaces_its_experiment_and_keeps_the_others() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("tuned/m.toml");
        let block = |e: &str, v: u32| format!("# == {e} ==\n[{e}.training]\nbatch_size = {v}\n");
        write_tuned(&path, "a", &block("a", 1)).expect("write");
        write_tuned(&path, "b", &block("b", 2)).expect("write");
        write_tuned(&path, "a", &block("a", 3)).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        let parsed: toml::Table = toml::from_str(&text).expect("valid TOML");
        assert_eq!(parsed["a"]["training"]["batch_size"].as_integer(), Some(3));
        assert_eq!(parsed["b"]["training"]["batch_size"].as_integer(), Some(2));
        assert_eq!(text.matches("# == a ==").count(), 1);
        assert!(text.starts_with("# Written by `kiln tune`"));
    }
}
