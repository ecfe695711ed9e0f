//! `kiln config [--explain] [--format toml|yaml|json]`: the resolved
//! configuration, or each key with its value and the layer that set it.

use std::io::Write;
use std::process::ExitCode;

use kiln_config::ResolvedConfig;

use super::{Context, Layers, hardware};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Each key with its value and the layer that set it
    #[arg(long)]
    explain: bool,
    /// The configuration's format: each reads back with --config FILE.toml,
    /// .yaml or .json
    #[arg(long, value_enum, default_value_t = Format::Toml, conflicts_with = "explain")]
    format: Format,
    #[command(flatten)]
    layers: Layers,
}

/// What `kiln config` prints the configuration as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Toml,
    Yaml,
    Json,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    let mut out = std::io::stdout().lock();
    if args.explain {
        write!(out, "{}", explain_text(&resolved))?;
        write!(out, "{}", hardware::derived_text(&ctx.report, &resolved))?;
        return Ok(ExitCode::SUCCESS);
    }
    match args.format {
        Format::Toml => write!(out, "{}{}", header(&resolved), resolved.to_toml())?,
        Format::Yaml => write!(out, "{}{}", header(&resolved), resolved.to_yaml())?,
        // JSON has no comments: the automatic choice's reason is left out.
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&resolved.config)?)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn header(resolved: &ResolvedConfig) -> String {
    match &resolved.hardware_choice {
        Some(choice) => format!("# hardware = \"{}\": auto, {}\n", choice.name, choice.why),
        None => String::new(),
    }
}

pub(crate) fn explain_text(resolved: &ResolvedConfig) -> String {
    let rows = resolved.explain();
    let width = rows
        .iter()
        .map(|r| r.key.len() + r.value.len() + 3)
        .max()
        .unwrap_or(0);
    let mut text = String::new();
    for row in rows {
        let lhs = format!("{} = {}", row.key, row.value);
        let unused = row
            .unused
            .map(|why| format!("; unused: {why}"))
            .unwrap_or_default();
        text.push_str(&format!("{lhs:<width$}  # {}{unused}\n", row.source));
    }
    text
}
