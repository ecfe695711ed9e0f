//! `cargo xtask outside [DIR]`: kiln's library crates used as another
//! project uses them. A scratch crate outside the workspace (its own
//! `[workspace]`, `target/outside` by default) depends on each library crate
//! by path, gets the Rust example of each crate's README as an example
//! program, and builds and runs them all. It shares this workspace's target
//! directory and lock file, so Burn and the rest are not built again.

use std::fmt::Write as _;
use std::path::Path;

use crate::{cargo, root, run};

/// The library crates, by folder under `crates/` and package name.
const LIBRARIES: &[(&str, &str)] = &[
    ("hwdetect", "kiln-hwdetect"),
    ("config", "kiln-config"),
    ("data", "kiln-data"),
    ("model", "kiln-model"),
    ("plan", "kiln-plan"),
    ("train", "kiln-train"),
];

/// The first ```rust block of a README, as a program (wrapped in `main`
/// where the block has none).
fn readme_program(readme: &str) -> Option<String> {
    let start = readme.find("```rust\n")? + "```rust\n".len();
    let len = readme[start..].find("\n```")?;
    let code = &readme[start..start + len + 1];
    Some(if code.contains("fn main(") {
        code.to_string()
    } else {
        let body: String = code.lines().map(|l| format!("    {l}\n")).collect();
        format!("fn main() {{\n{body}}}\n")
    })
}

pub(crate) fn outside(args: &[String]) -> Result<std::process::ExitCode, String> {
    let root = root();
    let dir = args.first().map_or_else(
        || root.join("target/outside"),
        |d| Path::new(d).to_path_buf(),
    );
    let examples = dir.join("examples");
    std::fs::create_dir_all(&examples).map_err(|e| format!("{}: {e}", examples.display()))?;
    let write = |path: &Path, text: &str| {
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    // The workspace's profiles, so that the shared target directory's
    // dependency builds are reused.
    let mut manifest = String::from(
        "[package]\nname = \"kiln-outside\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         # Its own workspace: not a member of kiln's.\n[workspace]\n\n\
         [profile.dev]\nopt-level = 1\ndebug = \"line-tables-only\"\n\n\
         [profile.dev.package.\"*\"]\nopt-level = 3\ndebug = false\n\n[dependencies]\n",
    );
    let mut names = Vec::new();
    for (folder, package) in LIBRARIES {
        let crate_dir = root.join("crates").join(folder);
        let _ = writeln!(
            manifest,
            "{package} = {{ path = \"{}\" }}",
            crate_dir.display()
        );
        let readme_path = crate_dir.join("README.md");
        let readme = std::fs::read_to_string(&readme_path)
            .map_err(|e| format!("{}: {e}", readme_path.display()))?;
        let program = readme_program(&readme)
            .ok_or_else(|| format!("{} has no ```rust example", readme_path.display()))?;
        let name = format!("readme_{folder}");
        write(&examples.join(format!("{name}.rs")), &program)?;
        names.push(name);
    }
    write(&dir.join("Cargo.toml"), &manifest)?;
    std::fs::create_dir_all(dir.join("src")).map_err(|e| e.to_string())?;
    write(&dir.join("src/lib.rs"), "//! Only the examples matter.\n")?;
    let lock = root.join("Cargo.lock");
    std::fs::copy(&lock, dir.join("Cargo.lock")).map_err(|e| format!("{}: {e}", lock.display()))?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from);
    for name in &names {
        eprintln!("xtask: outside the workspace, README example `{name}`");
        let mut cmd = cargo();
        cmd.current_dir(&dir)
            .env("CARGO_TARGET_DIR", &target)
            .args(["run", "--quiet", "--example", name]);
        let code = run(cmd)?;
        if code != std::process::ExitCode::SUCCESS {
            return Err(format!("README example `{name}` failed"));
        }
    }
    eprintln!(
        "xtask: {} README examples built and ran in `{}`, outside the workspace",
        names.len(),
        dir.display()
    );
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_examples_become_programs() {
        let with_main = "x\n```rust\nfn main() {\n    f();\n}\n```\nrest";
        assert_eq!(
            readme_program(with_main).as_deref(),
            Some("fn main() {\n    f();\n}\n")
        );
        let bare = "```rust\nlet a = 1;\n```\n";
        assert_eq!(
            readme_program(bare).as_deref(),
            Some("fn main() {\n    let a = 1;\n}\n")
        );
        assert_eq!(readme_program("```sh\nls\n```\n"), None);
    }

    #[test]
    fn every_library_crate_has_a_readme_example() {
        for (folder, _) in LIBRARIES {
            let readme =
                std::fs::read_to_string(root().join("crates").join(folder).join("README.md"))
                    .expect("README");
            assert!(readme_program(&readme).is_some(), "{folder}");
        }
    }
}
