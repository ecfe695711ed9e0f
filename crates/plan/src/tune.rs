//! `kiln tune`: the micro-batch, gradient accumulation and loader settings
//! of this machine, measured rather than taken from a table.
//!
//! The search is a pure function over a [`Probe`], which runs one candidate
//! (forward, backward and the optimizer step, timed) and says what it
//! measured or why it failed. The CLI's probe runs each candidate in a child
//! process, because running out of memory in Burn is a panic that can leave
//! a GPU unusable; tests use a fake one. Rules:
//!
//! - the experiment's effective batch (`batch_size × gradient_accumulation_steps`)
//!   is kept: only divisors of it are tried as micro-batches, the
//!   accumulation making up the rest (Hugging Face's finder halves the batch
//!   and silently changes the effective one);
//! - the micro-batch is searched from the largest down: sizes that fail or
//!   exceed the memory limit (on a GPU the device's memory less a safety
//!   margin, on the CPU the available RAM) are passed over, then a smaller
//!   size is taken as long as no larger one gains `min_gain` (3 %) or more
//!   over it; the first that is clearly slower ends the search. The result
//!   is the smallest size within 3 % of the fastest, which a climb from 1
//!   that stops at the first step gaining under 3 % would also find on a
//!   smooth curve, but not on a noisy, flat one;
//! - only a candidate that ran and stayed within the limit is ever returned
//!   (Lightning's finder returns sizes that then run out of memory);
//! - the loader is changed only when the chosen size measured a data-wait:
//!   more workers, then a deeper prefetch, each kept if it measured faster.

use std::fmt::Write as _;

use serde::Serialize;

/// One setting to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (the effective batch kept).
    pub accumulation: usize,
    /// Loader worker threads.
    pub num_workers: usize,
    /// Batches each worker keeps ready.
    pub prefetch_factor: usize,
}

/// What a probe measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measurement {
    /// Samples per second of whole optimizer steps: `accumulation`
    /// micro-steps (data, forward, backward) and one optimizer step.
    pub samples_per_s: f64,
    /// Median milliseconds of one micro-batch's forward and backward.
    pub ms_per_micro_step: f64,
    /// Share of the time spent waiting for data, in percent.
    pub data_wait_pct: f64,
    /// Peak resident memory of the probe's process.
    pub peak_memory_bytes: u64,
    /// GPU memory in use after the probe's steps (GPU runs with NVML).
    pub device_memory_used_bytes: Option<u64>,
    /// The most the GPU allocator held during the probe (this process's
    /// own), preferred over `device_memory_used_bytes` where known.
    pub device_memory_peak_bytes: Option<u64>,
    /// Wall time the probe took, start-up included.
    pub seconds: f64,
}

/// A probe's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum ProbeResult {
    /// The probe ran: what it measured.
    Ran(Measurement),
    /// The probe did not finish (out of memory, a crash): why, and the wall
    /// time it cost.
    Failed {
        /// What went wrong.
        why: String,
        /// Wall time the probe cost.
        seconds: f64,
    },
}

impl ProbeResult {
    fn seconds(&self) -> f64 {
        match self {
            Self::Ran(m) => m.seconds,
            Self::Failed { seconds, .. } => *seconds,
        }
    }
}

/// Runs one candidate.
pub trait Probe {
    /// Runs `candidate` and reports what it measured, or why it failed.
    fn probe(&mut self, candidate: &Candidate) -> ProbeResult;
}

/// What may be tried.
#[derive(Clone, Debug, Serialize)]
pub struct TuneSpace {
    /// `batch_size × gradient_accumulation_steps` of the experiment: kept.
    pub effective_batch: usize,
    /// Micro-batches to try, ascending (divisors of the effective batch).
    pub micro_batches: Vec<usize>,
    /// Loader settings: the configured one first.
    pub workers: Vec<usize>,
    /// Prefetch depths to try with them.
    pub prefetch: Vec<usize>,
    /// Memory a candidate may use, in bytes: the device's less a margin.
    pub memory_limit: u64,
    /// How `memory_limit` was reached, in words.
    pub memory_limit_what: String,
    /// Whether the run is on a GPU (memory is then the device's).
    pub is_gpu: bool,
    /// A larger micro-batch must gain at least this much (0.03 = 3 %).
    pub min_gain: f64,
}

impl TuneSpace {
    /// The space for an effective batch, with the configured loader first.
    pub fn new(
        effective_batch: usize,
        workers: usize,
        prefetch: usize,
        cores: usize,
        memory_limit: u64,
        memory_limit_what: String,
        is_gpu: bool,
    ) -> Self {
        let mut w = vec![workers];
        for n in [0, 1, 2, 4, 8] {
            if n <= cores.max(1) * 2 && !w.contains(&n) {
                w.push(n);
            }
        }
        let mut p = vec![prefetch];
        for n in [2, 4] {
            if !p.contains(&n) {
                p.push(n);
            }
        }
        Self {
            effective_batch,
            micro_batches: divisors(effective_batch),
            workers: w,
            prefetch: p,
            memory_limit,
            memory_limit_what,
            is_gpu,
            min_gain: 0.03,
        }
    }

    fn candidate(&self, micro_batch: usize, num_workers: usize, prefetch: usize) -> Candidate {
        Candidate {
            micro_batch,
            accumulation: self.effective_batch / micro_batch,
            num_workers,
            prefetch_factor: prefetch,
        }
    }

    /// Whether a measurement stayed within the memory limit.
    fn fits(&self, m: &Measurement) -> bool {
        let used = match (
            self.is_gpu,
            m.device_memory_peak_bytes.or(m.device_memory_used_bytes),
        ) {
            (true, Some(used)) => used,
            (true, None) => return true,
            (false, _) => m.peak_memory_bytes,
        };
        used <= self.memory_limit
    }
}

/// The memory a candidate may use, and what that is: the run's GPU
/// memory, else the available RAM, each less a 10 % margin (the allocator's
/// pools and fragmentation need room that no estimate counts).
pub fn memory_limit(
    config: &kiln_config::RunConfig,
    hardware: &kiln_hwdetect::HardwareReport,
    is_gpu: bool,
) -> (u64, String) {
    let ram = (
        hardware.memory.available_bytes / 10 * 9,
        "available RAM less a 10 % margin".to_string(),
    );
    if !is_gpu {
        return ram;
    }
    if let Some(g) = crate::run_gpu(config, hardware) {
        return (
            g.memory_total_bytes / 10 * 9,
            format!("GPU {} memory less a 10 % margin", g.index),
        );
    }
    match hardware
        .other_gpu()
        .and_then(|g| Some((g, g.memory_total_bytes?)))
    {
        // Apple's unified memory: Metal lets a process's GPU allocations
        // reach about 75 % of it, and no more than the OS has free.
        Some((g, total)) if g.unified_memory => (
            (total / 4 * 3).min(hardware.memory.available_bytes) / 10 * 9,
            format!(
                "{}: the least of 75 % of its unified memory (Metal's working set) and the available RAM, less a 10 % margin",
                g.name
            ),
        ),
        Some((g, total)) => (
            total / 10 * 9,
            format!("{} memory less a 10 % margin", g.name),
        ),
        None => ram,
    }
}

/// The divisors of `n`, ascending.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n.max(1))
        .filter(|d| n.max(1).is_multiple_of(*d))
        .collect()
}

/// One probe and what the search made of it.
#[derive(Clone, Debug, Serialize)]
pub struct Trial {
    /// The settings probed.
    pub candidate: Candidate,
    /// What the probe measured, or why it failed.
    pub result: ProbeResult,
    /// Ran and stayed within the memory limit.
    pub usable: bool,
    /// What the search made of it, in words.
    pub note: String,
}

/// The outcome of a search.
#[derive(Clone, Debug, Serialize)]
pub struct TuneResult {
    /// The settings chosen.
    pub chosen: Candidate,
    /// What they measured.
    pub measurement: Measurement,
    /// Every probe, in the order run.
    pub trials: Vec<Trial>,
    /// Wall time of all probes.
    pub seconds: f64,
    /// Why the loader is what it is.
    pub loader_why: String,
}

/// Why no candidate could be chosen.
#[derive(Debug, thiserror::Error)]
#[error("no micro-batch of the effective batch {effective_batch} ran within {limit}: {tried}")]
pub struct NothingRan {
    /// The effective batch every candidate kept.
    pub effective_batch: usize,
    /// The memory limit, in words.
    pub limit: String,
    /// What was tried, and how each ended.
    pub tried: String,
}

struct Search<'a, P: Probe> {
    space: &'a TuneSpace,
    probe: &'a mut P,
    trials: Vec<Trial>,
}

impl<P: Probe> Search<'_, P> {
    fn run(&mut self, c: Candidate) -> Option<Measurement> {
        let result = self.probe.probe(&c);
        let (usable, note, m) = match &result {
            ProbeResult::Ran(m) if self.space.fits(m) => (true, String::new(), Some(m.clone())),
            ProbeResult::Ran(_) => (
                false,
                format!("over the memory limit ({})", self.space.memory_limit_what),
                None,
            ),
            ProbeResult::Failed { why, .. } => (false, format!("failed: {why}"), None),
        };
        self.trials.push(Trial {
            candidate: c,
            result,
            usable,
            note,
        });
        m
    }

    fn best(&self) -> Option<(Candidate, Measurement)> {
        self.trials
            .iter()
            .filter(|t| t.usable)
            .filter_map(|t| match &t.result {
                ProbeResult::Ran(m) => Some((t.candidate, m.clone())),
                ProbeResult::Failed { .. } => None,
            })
            .fold(
                None,
                |best: Option<(Candidate, Measurement)>, t| match best {
                    Some(b) if b.1.samples_per_s >= t.1.samples_per_s => Some(b),
                    _ => Some(t),
                },
            )
    }

    /// The result, with `chosen` (a usable trial) or else the fastest usable one.
    fn finish(
        self,
        chosen: Option<(Candidate, Measurement)>,
        loader_why: String,
    ) -> Result<TuneResult, NothingRan> {
        let seconds = self.trials.iter().map(|t| t.result.seconds()).sum();
        let Some((chosen, measurement)) = chosen.or_else(|| self.best()) else {
            return Err(NothingRan {
                effective_batch: self.space.effective_batch,
                limit: self.space.memory_limit_what.clone(),
                tried: self
                    .trials
                    .iter()
                    .map(|t| format!("batch {} {}", t.candidate.micro_batch, t.note))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        };
        Ok(TuneResult {
            chosen,
            measurement,
            trials: self.trials,
            seconds,
            loader_why,
        })
    }
}

/// The tuner: searches the micro-batch from the largest down, then adjusts
/// the loader only if the chosen size waited for data.
pub fn tune<P: Probe>(space: &TuneSpace, probe: &mut P) -> Result<TuneResult, NothingRan> {
    let mut s = Search {
        space,
        probe,
        trials: Vec::new(),
    };
    let (w0, p0) = (space.workers[0], space.prefetch[0]);
    // From the largest micro-batch down: a smaller one is taken while the
    // fastest larger one gains less than `min_gain` over it; the first that
    // is clearly slower ends the search. (Climbing up from 1 instead stops
    // at the first noisy step on a flat curve, as the CPU's is.)
    let mut best: Option<(Candidate, Measurement)> = None;
    let mut fastest = 0.0f64;
    for &m in space.micro_batches.iter().rev() {
        let c = space.candidate(m, w0, p0);
        let Some(measured) = s.run(c) else {
            if best.is_none() {
                continue; // too large: try a smaller one
            }
            break;
        };
        let rate = measured.samples_per_s;
        if best.is_some() && fastest >= rate * (1.0 + space.min_gain) {
            if let Some(t) = s.trials.last_mut() {
                t.note = format!(
                    "the fastest larger batch gains {:+.1} % (at least {:.0} %): stop",
                    100.0 * (fastest / rate - 1.0),
                    100.0 * space.min_gain
                );
            }
            break;
        }
        fastest = fastest.max(rate);
        best = Some((c, measured));
    }
    let Some((chosen, m)) = best else {
        return s.finish(None, String::new());
    };
    if m.data_wait_pct <= 2.0 {
        let why = format!(
            "data-wait {:.2} % at the chosen batch: not data-bound, loader kept at {}, prefetch {}",
            m.data_wait_pct,
            crate::counted(chosen.num_workers, "worker"),
            chosen.prefetch_factor
        );
        return s.finish(Some((chosen, m)), why);
    }
    let mut why = format!(
        "data-wait {:.1} % at batch {}",
        m.data_wait_pct, chosen.micro_batch
    );
    let mut current = (chosen, m.samples_per_s);
    let mut current_m = m;
    let more: Vec<usize> = space
        .workers
        .iter()
        .copied()
        .filter(|w| *w > chosen.num_workers)
        .collect();
    for w in more {
        let c = space.candidate(chosen.micro_batch, w, current.0.prefetch_factor);
        match s.run(c) {
            Some(r) if r.samples_per_s > current.1 * (1.0 + space.min_gain) => {
                let _ = write!(why, "; {w} workers: {:.1} samples/s, kept", r.samples_per_s);
                current = (c, r.samples_per_s);
                current_m = r;
            }
            _ => break,
        }
    }
    let deeper: Vec<usize> = space
        .prefetch
        .iter()
        .copied()
        .filter(|p| *p > current.0.prefetch_factor)
        .collect();
    for p in deeper {
        let c = space.candidate(chosen.micro_batch, current.0.num_workers, p);
        match s.run(c) {
            Some(r) if r.samples_per_s > current.1 * (1.0 + space.min_gain) => {
                let _ = write!(
                    why,
                    "; prefetch {p}: {:.1} samples/s, kept",
                    r.samples_per_s
                );
                current = (c, r.samples_per_s);
                current_m = r;
            }
            _ => break,
        }
    }
    s.finish(Some((current.0, current_m)), why)
}

/// Every candidate of the grid (micro-batch × workers × prefetch), for
/// judging the tuner; a micro-batch that fails ends the larger ones.
pub fn sweep<P: Probe>(space: &TuneSpace, probe: &mut P) -> Result<TuneResult, NothingRan> {
    let mut s = Search {
        space,
        probe,
        trials: Vec::new(),
    };
    'batches: for &m in &space.micro_batches {
        for &w in &space.workers {
            for &p in &space.prefetch {
                if s.run(space.candidate(m, w, p)).is_none() {
                    break 'batches; // failed or over the limit: larger ones would too
                }
            }
        }
    }
    s.finish(None, "the best of the whole grid".into())
}

/// The block `kiln tune` writes for one experiment in
/// `presets/tuned/<machine>.toml`: every value with the measurement behind it.
pub fn tuned_block(
    experiment: &str,
    header: &str,
    space: &TuneSpace,
    result: &TuneResult,
) -> String {
    let c = result.chosen;
    let m = &result.measurement;
    let mut climb = String::new();
    for t in &result.trials {
        let same_loader = t.candidate.num_workers == space.workers[0]
            && t.candidate.prefetch_factor == space.prefetch[0];
        if !same_loader {
            continue;
        }
        let _ = write!(climb, "\n#   batch {:>3}: ", t.candidate.micro_batch);
        match &t.result {
            ProbeResult::Ran(r) => {
                let _ = write!(
                    climb,
                    "{:.1} samples/s, {:.1} ms/micro-step, peak RAM {:.0} MiB",
                    r.samples_per_s,
                    r.ms_per_micro_step,
                    r.peak_memory_bytes as f64 / f64::from(1u32 << 20)
                );
                if let Some(d) = r.device_memory_peak_bytes {
                    let _ = write!(
                        climb,
                        ", GPU peak {:.0} MiB",
                        d as f64 / f64::from(1u32 << 20)
                    );
                } else if let Some(d) = r.device_memory_used_bytes {
                    let _ = write!(climb, ", GPU {:.0} MiB", d as f64 / f64::from(1u32 << 20));
                }
            }
            ProbeResult::Failed { why, .. } => {
                let _ = write!(climb, "failed ({why})");
            }
        }
        if !t.note.is_empty() && !t.note.starts_with("failed") {
            let _ = write!(climb, " — {}", t.note);
        }
    }
    format!(
        "# == {experiment} ==\n\
         # {header}\n\
         [{experiment}.training]\n\
         # The smallest micro-batch within 3 % of the fastest: {:.1} samples/s. Measured at {}, prefetch {}:{climb}\n\
         batch_size = {}\n\
         # {} / {} = {}: the experiment's effective batch of {} is kept.\n\
         gradient_accumulation_steps = {}\n\
         \n\
         [{experiment}.loader]\n\
         # {}.\n\
         num_workers = {}\n\
         prefetch_factor = {}\n",
        m.samples_per_s,
        crate::counted(space.workers[0], "worker"),
        space.prefetch[0],
        c.micro_batch,
        space.effective_batch,
        c.micro_batch,
        c.accumulation,
        space.effective_batch,
        c.accumulation,
        result.loader_why,
        c.num_workers,
        c.prefetch_factor,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine where throughput rises with the batch up to a plateau,
    /// larger batches fail, and data-wait falls with workers.
    struct Fake {
        fail_from: usize,
        plateau: usize,
        wait_pct: f64,
        calls: Vec<Candidate>,
    }

    impl Probe for Fake {
        fn probe(&mut self, c: &Candidate) -> ProbeResult {
            self.calls.push(*c);
            if c.micro_batch >= self.fail_from {
                return ProbeResult::Failed {
                    why: "out of memory (simulated)".into(),
                    seconds: 1.0,
                };
            }
            let eff = c.micro_batch.min(self.plateau) as f64;
            let wait = self.wait_pct / (1.0 + c.num_workers as f64);
            ProbeResult::Ran(Measurement {
                samples_per_s: 100.0 * eff / (eff + 1.0) * (1.0 - wait / 100.0),
                ms_per_micro_step: 10.0,
                data_wait_pct: wait,
                peak_memory_bytes: 1000 * c.micro_batch as u64,
                device_memory_used_bytes: None,
                device_memory_peak_bytes: None,
                seconds: 0.1 * c.micro_batch as f64,
            })
        }
    }

    fn machine(fail_from: usize, plateau: usize, wait_pct: f64) -> Fake {
        Fake {
            fail_from,
            plateau,
            wait_pct,
            calls: Vec::new(),
        }
    }

    fn space(eff: usize) -> TuneSpace {
        TuneSpace::new(eff, 1, 2, 4, u64::MAX, "RAM".into(), false)
    }

    #[test]
    fn the_effective_batch_is_kept_by_every_probe() {
        let sp = space(24);
        let mut fake = machine(usize::MAX, 1000, 30.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        assert!(!fake.calls.is_empty());
        for c in &fake.calls {
            assert_eq!(c.micro_batch * c.accumulation, 24, "{c:?}");
        }
        assert_eq!(r.chosen.micro_batch * r.chosen.accumulation, 24);
        let s = sweep(&sp, &mut fake).expect("swept");
        assert!(
            s.trials
                .iter()
                .all(|t| t.candidate.micro_batch * t.candidate.accumulation == 24)
        );
    }

    #[test]
    fn a_failed_probe_is_never_returned_and_ends_the_climb() {
        let sp = space(16);
        let mut fake = machine(8, 1000, 0.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        assert_eq!(r.chosen.micro_batch, 4, "{:?}", r.trials);
        assert_eq!(
            fake.calls.iter().map(|c| c.micro_batch).collect::<Vec<_>>(),
            vec![16, 8, 4, 2],
            "16 and 8 fail; 4 gains 20 % over 2: stop"
        );
        assert!(
            r.trials
                .iter()
                .any(|t| !t.usable && t.note.contains("simulated"))
        );
        // Everything fails: an error, not a size that never ran.
        let mut broken = machine(1, 1, 0.0);
        let err = tune(&sp, &mut broken).expect_err("nothing ran").to_string();
        assert!(err.contains("batch 1 failed"), "{err}");
    }

    #[test]
    fn over_the_memory_limit_is_not_returned() {
        let mut sp = space(16);
        sp.memory_limit = 2500; // batches 1 and 2 fit (1000 bytes per sample)
        let mut fake = machine(usize::MAX, 1000, 0.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        assert_eq!(r.chosen.micro_batch, 2);
        assert_eq!(r.chosen.accumulation, 8);
    }

    #[test]
    fn the_smallest_batch_within_3_percent_of_the_fastest_is_chosen() {
        let sp = space(64);
        let mut fake = machine(usize::MAX, 8, 0.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        // 64, 32, 16 and 8 are as fast (plateau); 8 gains 11 % over 4: stop.
        assert_eq!(
            fake.calls.iter().map(|c| c.micro_batch).collect::<Vec<_>>(),
            vec![64, 32, 16, 8, 4]
        );
        assert_eq!(r.chosen.micro_batch, 8);
        // The sweep finds the same best in many more probes.
        let mut all = machine(usize::MAX, 8, 0.0);
        let s = sweep(&sp, &mut all).expect("swept");
        assert!(s.trials.len() > 5 * r.trials.len());
        assert!(r.measurement.samples_per_s >= 0.95 * s.measurement.samples_per_s);
    }

    #[test]
    fn a_data_bound_batch_gets_more_workers() {
        let sp = space(4);
        let mut fake = machine(usize::MAX, 1000, 40.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        assert!(r.chosen.num_workers > 1, "{:?}", r.chosen);
        assert!(r.loader_why.contains("workers"), "{}", r.loader_why);
    }

    #[test]
    fn the_memory_limit_is_the_gpus_whoever_made_it() {
        const GIB: u64 = 1 << 30;
        let config = crate::tests::config(&[]);
        let mut hw = kiln_hwdetect::detect_cpu_only();
        hw.memory.available_bytes = 40 * GIB;
        let (limit, why) = memory_limit(&config, &hw, true);
        assert_eq!(
            (limit, why.as_str()),
            (36 * GIB, "available RAM less a 10 % margin")
        );
        let radeon = kiln_hwdetect::OtherGpu::from_pci(
            0x1002,
            0x744c,
            Some(24 * GIB),
            Some("AMD Radeon RX 7900 XTX".into()),
        )
        .expect("AMD");
        hw.other_gpus = vec![radeon];
        let (limit, why) = memory_limit(&config, &hw, true);
        assert_eq!(limit, 24 * GIB / 10 * 9, "{why}");
        // On the CPU the GPU's memory does not count.
        assert_eq!(memory_limit(&config, &hw, false).0, 36 * GIB);
        // An M2 Max with 96 GB: 72 GB for Metal, but only 40 GB free.
        let m2 = kiln_hwdetect::apple_gpu_from("Apple M2 Max", 96 * GIB, "").expect("Apple");
        hw.other_gpus = vec![m2];
        let (limit, why) = memory_limit(&config, &hw, true);
        assert_eq!(limit, 36 * GIB, "{why}");
        hw.memory.available_bytes = 90 * GIB;
        let (limit, why) = memory_limit(&config, &hw, true);
        assert_eq!(limit, 72 * GIB / 10 * 9, "{why}");
        assert!(why.contains("75 % of its unified memory"), "{why}");
    }

    #[test]
    fn the_tuned_block_is_the_toml_hardware_tuned_reads() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("tuned/m.toml");
        let sp = space(4);
        let mut fake = machine(usize::MAX, 1000, 0.0);
        let r = tune(&sp, &mut fake).expect("tuned");
        kiln_config::write_tuned(&path, "a", &tuned_block("a", "first", &sp, &r)).expect("write");
        kiln_config::write_tuned(&path, "b", &tuned_block("b", "second", &sp, &r)).expect("write");
        kiln_config::write_tuned(&path, "a", &tuned_block("a", "third", &sp, &r)).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(!text.contains("first") && text.contains("second") && text.contains("third"));
        let parsed: toml::Table = toml::from_str(&text).expect("valid TOML");
        assert_eq!(parsed["a"]["training"]["batch_size"].as_integer(), Some(4));
        assert_eq!(parsed["b"]["loader"]["num_workers"].as_integer(), Some(1));
        assert_eq!(text.matches("# == a ==").count(), 1);
    }
}
