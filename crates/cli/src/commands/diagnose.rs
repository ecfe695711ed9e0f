//! `kiln diagnose`: the pre-flight check as kiln-train measures it, for
//! people or as JSON; exit 2 when a problem would make the run fail.

use std::fmt::Write as _;
use std::io::Write;
use std::process::ExitCode;

use kiln_plan::{AttentionMemory, LogitsMemory, gib};
use kiln_train::Diagnosis;

use super::{Context, Layers, train_error};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Training steps to time for the time estimate and the loader's
    /// verdict (0: none)
    #[arg(long, default_value_t = 10)]
    burst: usize,
    /// Data-parallel ranks to estimate the gradients' all-reduce for (and a
    /// cross-validation's steps: its folds step through every rank's pairs)
    /// [default: the ranks `kiln launch` would start here]
    #[arg(long, value_name = "N")]
    ranks: Option<usize>,
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layers: Layers,
}

pub(crate) fn run(args: Args, ctx: &Context) -> anyhow::Result<ExitCode> {
    let resolved = ctx.resolve(&args.layers)?;
    crate::data::provide_for(&resolved.config)?;
    let ranks = args
        .ranks
        .unwrap_or_else(|| super::hardware::ranks(&ctx.report).count);
    let d = kiln_train::diagnose(&resolved.config, &ctx.report, args.burst, ranks)
        .map_err(train_error)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let value = serde_json::json!({
            "schema": "kiln.diagnose/1",
            "experiment": resolved.config.experiment,
            "hardware_preset": resolved.config.hardware,
            "diagnosis": d,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        let mut head = format!(
            "kiln diagnose: experiment `{}` ({:?}), hardware preset `{}`",
            resolved.config.experiment, resolved.config.workload, resolved.config.hardware
        );
        if let Some(choice) = &resolved.hardware_choice {
            head.push_str(&format!(" ({})", choice.why));
        }
        write!(out, "{}", diagnosis_text(&d, &head))?;
    }
    if d.has_errors() {
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}

/// A read rate in MB/s, or kB/s under 1 MB/s.
fn rate(mb_per_s: f64) -> String {
    if mb_per_s >= 1.0 {
        format!("{mb_per_s:.1} MB/s")
    } else {
        format!("{:.1} kB/s", mb_per_s * 1e3)
    }
}

/// Epochs to two decimals; a small fraction of one (a large corpus) to
/// three significant digits.
fn epochs(e: f64) -> String {
    if e >= 0.01 || e == 0.0 {
        format!("{e:.2}")
    } else {
        format!("{e:.3e}")
    }
}

/// `kiln diagnose` for people.
fn diagnosis_text(d: &Diagnosis, header: &str) -> String {
    let mut s = format!("{header}\n");
    let _ = writeln!(s, "device:    {} ({})", d.device, d.device_why);
    let _ = writeln!(s, "precision: {} ({})", d.precision, d.precision_why);
    let data = &d.data;
    let _ = write!(
        s,
        "data:      {} training {}, {} validation; {} samples per epoch",
        data.train, data.unit, data.validation, data.samples_per_epoch
    );
    if let Some(longest) = data.longest {
        let _ = write!(
            s,
            "; pairs up to {longest} tokens, 99 % within {}; {} longer than model.max_length",
            data.p99_length.unwrap_or(0),
            data.truncated
        );
    }
    s.push('\n');
    if let Some(r) = &d.store {
        let _ = write!(
            s,
            "store:     `{}`, {} shards of {}-byte tokens; windows read at {:.1} MB/s now (page cache included)",
            r.path.display(),
            r.shards,
            r.bytes_per_token,
            r.disk_mb_per_s
        );
        if let Some(need) = r.needed_mb_per_s {
            let _ = write!(s, "; the run needs {}", rate(need));
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "budget:    {} optimizer steps, {} per epoch: {} epochs",
        d.total_steps,
        (d.steps_per_epoch * 10.0).round() / 10.0,
        epochs(d.epochs)
    );
    let m = &d.memory;
    let attention = match m.attention_kept {
        AttentionMemory::Scores => "attention's T² part",
        AttentionMemory::LogSumExp => "attention keeps no T² scores, its log-sum-exp",
    };
    let logits = match (m.logits, m.logits_kept) {
        (0, _) => String::new(),
        (bytes, LogitsMemory::All) => format!(", the LM head's logits {}", gib(bytes)),
        (bytes, LogitsMemory::Chunks { .. }) => format!(
            ", the LM head's chunks of logits and their gradients {}",
            gib(bytes)
        ),
    };
    // kiln-hwdetect reads 0 where it cannot read the figure.
    let available = match m.available {
        0 => format!("{} (not known here)", m.available_what),
        bytes => format!("{} {}", gib(bytes), m.available_what),
    };
    let _ = writeln!(
        s,
        "memory:    estimate {} = weights {} + gradients {} + AdamW {}{} + activations {} \
         ({attention} {}{logits}; {} with gradient checkpointing), of {available}; {:.2} M parameters; \
         an evaluation pass {}",
        gib(m.total),
        gib(m.weights),
        gib(m.gradients),
        gib(m.optimizer),
        if m.optimizer_ranks > 1 {
            format!(
                " (a rank's share of {}, ZeRO-{})",
                m.optimizer_ranks,
                d.reduction.as_ref().map_or(1, |r| r.zero_stage)
            )
        } else {
            String::new()
        },
        gib(m.activations),
        gib(m.attention),
        gib(m.activations_checkpointed),
        m.parameters as f64 / 1e6,
        gib(m.eval)
    );
    match &d.burst {
        Some(b) => {
            let _ = writeln!(
                s,
                "measured:  {} steps, {:.1} ms per optimizer step, peak RAM {}: {} per epoch, {} for the run's {} steps (evaluation not included)\n\
                 loader:    {}",
                b.steps,
                b.ms_per_step,
                gib(b.peak_memory_bytes),
                duration(b.seconds_per_epoch),
                duration(b.seconds_total),
                d.total_steps,
                b.loader_verdict
            );
        }
        None => {
            s.push_str("measured:  no burst (--burst 0, or an error above makes it pointless)\n")
        }
    }
    if let Some(r) = &d.reduction {
        let links: Vec<String> = r
            .per_link_ms
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.2} ms"))
            .collect();
        let _ = writeln!(
            s,
            "ranks:     {} — the gradients' {} ({:.2} MB a step){}, as a ring (NCCL) would take: {}",
            r.ranks,
            r.reduction(),
            r.gradient_bytes as f64 / 1e6,
            r.gather_words(),
            links.join(", ")
        );
    }
    if d.findings.is_empty() {
        s.push_str("problems:  none found\n");
    } else {
        s.push_str("problems:\n");
        for f in &d.findings {
            let level = match f.severity {
                kiln_plan::Severity::Error => "error",
                kiln_plan::Severity::Warning => "warning",
                kiln_plan::Severity::Note => "note",
            };
            let _ = writeln!(
                s,
                "  {level:<7} {}: {}\n          fix: {}",
                f.key, f.problem, f.fix
            );
        }
    }
    s
}

/// Seconds as "1 h 02 min", "3 min 05 s" or "12.3 s".
fn duration(seconds: f64) -> String {
    let s = seconds.round() as u64;
    if s >= 3600 {
        format!("{} h {:02} min", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{} min {:02} s", s / 60, s % 60)
    } else {
        format!("{seconds:.1} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(12.34), "12.3 s");
        assert_eq!(duration(185.0), "3 min 05 s");
        assert_eq!(duration(3720.0), "1 h 02 min");
    }
}
