//! Running out of device memory, said as an error with its fix.
//!
//! Burn reports a GPU allocation that fails as a panic (CubeCL's
//! "can't allocate buffer of size: …", CUDA's out-of-memory error), deep
//! in whatever operation first needed the memory, with a backtrace. The
//! fix is always the same, and it is the guides' rule: lower the batch
//! first (keeping the effective batch through accumulation), then the
//! length, then recompute activations. The panic hook here recognises such
//! a panic, prints that as one `error:` line (the last line, which `kiln
//! tune` quotes for a probe that failed) and exits with code 2; any other
//! panic goes to the default hook as before. Checkpoints already written
//! are complete files (written atomically), so nothing saved is lost.

/// What Burn's and CubeCL's messages say when an allocation fails.
const OUT_OF_MEMORY: [&str; 4] = [
    "can't allocate buffer",
    "out of memory",
    "out_of_memory",
    "outofmemory",
];

/// The line of a panic message that says the device ran out of memory.
pub(crate) fn out_of_memory_line(message: &str) -> Option<&str> {
    message.lines().map(str::trim).find(|line| {
        let lower = line.to_lowercase();
        OUT_OF_MEMORY.iter().any(|pattern| lower.contains(pattern))
    })
}

/// The error printed for it.
pub(crate) fn message(cause: &str) -> String {
    format!(
        "error: out of device memory ({cause}): lower training.batch_size and raise \
         training.gradient_accumulation_steps by the same factor (the effective batch stays), \
         then lower model.max_length, then set model.gradient_checkpointing=true; \
         `kiln diagnose` estimates a step's memory and `kiln tune` measures what fits. \
         Checkpoints already saved are kept: `kiln resume <run dir>` goes on from the newest, \
         a language model's run with the smaller batch given as overrides \
         (`kiln resume <run dir> training.batch_size=… training.gradient_accumulation_steps=…`)."
    )
}

/// Installs the hook (before any work starts).
pub(crate) fn install_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        match payload.and_then(out_of_memory_line) {
            Some(cause) => {
                let message = message(cause);
                eprintln!("{message}");
                crate::write_error_file(message.trim_start_matches("error: "));
                std::process::exit(2);
            }
            None => default(info),
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cubecls_and_cudas_messages_and_nothing_else() {
        // What wgpu printed when Burn's attention asked for 2 GiB on
        // llvmpipe (docs/PERFORMANCE.md), shortened.
        let wgpu = "Error while reading data: use `try_into_scalar` instead\n  \
                    The bytes were never written\n  An IO error happened\n  \
                    can't allocate buffer of size: 2147483648\n";
        assert_eq!(
            out_of_memory_line(wgpu),
            Some("can't allocate buffer of size: 2147483648")
        );
        assert!(out_of_memory_line("CUDA_ERROR_OUT_OF_MEMORY: out of memory").is_some());
        assert!(out_of_memory_line("index out of bounds: the len is 3").is_none());
        assert!(out_of_memory_line("called `Option::unwrap()` on a `None` value").is_none());
        let m = message("can't allocate buffer of size: 2147483648");
        assert!(m.starts_with("error: out of device memory (can't allocate"));
        assert!(m.contains("training.batch_size") && m.contains("model.max_length"));
        assert!(!m.contains('\n'), "one line, the one kiln tune quotes");
    }
}
