//! `kiln bench lm | nli`: warm-up steps excluded, then the median and
//! spread of timed optimizer steps — [`train_step`], the function training
//! runs, with gradient accumulation and loss scaling as configured — each
//! split into its phases (the device is synchronised between them, which a
//! training run does not do).

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use kiln_config::{RunConfig, Workload};
use kiln_data::{BatchSource, Loader, benchmark_loader};
use kiln_dist::{Group, Reduce};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::kernel_profile::{KernelProfile, Profiler};
use crate::optim::AdamW;
use crate::precision::{LossScaler, PrecisionChoice};
use crate::report::median;
use crate::setup::{init_model, mfu_peak, run_precision, train_device};
use crate::step::{Phase, PhaseTimer, StepState, train_step};
use crate::task::{Task, Work};
use crate::translate::kernels;
use crate::workload::lm::{collectives, on_rank_device, prepare_in_turn};
use crate::workload::{lm, nli};
use crate::{MemoryTracker, TrainError, open_device};

/// How many steps to run, and how to pad pairs.
#[derive(Clone, Copy, Debug)]
pub struct BenchOptions {
    /// Untimed steps first (compilation, autotuning, caches).
    pub warmup: usize,
    /// Timed steps, at least...
    pub steps: usize,
    /// ...and at least this many seconds of them (short steps are noisy:
    /// more of them), up to 50 × `steps`.
    pub min_seconds: f64,
    /// Pad every pair batch to `model.max_length` (PyTorch comparisons pad so).
    pub pad_to_max_length: bool,
    /// Steps run after the timed ones with every kernel launch timed on the
    /// device ([`KernelProfile`]); 0: none. CubeCL backends only (wgpu,
    /// CUDA): elsewhere a bench asking for it is refused.
    pub kernel_profile_steps: usize,
}

/// Median milliseconds per phase of an optimizer step (the first four
/// summed over its micro-batches).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseTimes {
    /// Waiting for the loader.
    pub data_wait_ms: f64,
    /// Moving the batch to the device.
    pub host_to_device_ms: f64,
    /// The forward pass and the loss.
    pub forward_ms: f64,
    /// The backward pass.
    pub backward_ms: f64,
    /// In a data-parallel job: the gradients' all-reduce, the wait for the
    /// slowest rank included (0 in one process).
    pub all_reduce_ms: f64,
    /// Clipping and the optimizer's update.
    pub optimizer_ms: f64,
    /// ZeRO-1 in a job (`optimization.zero_stage = 1`): the all-gather of
    /// the updated weights (0 otherwise).
    pub all_gather_ms: f64,
}

/// What a benchmark measured.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct BenchResult {
    /// `lm` or `nli`.
    pub workload: &'static str,
    /// The device it ran on ("flex (CPU)", "cuda (GPU 0)"); in a job, rank 0's.
    pub backend: String,
    /// The processes of the data-parallel job timed (`kiln launch … bench`),
    /// 1 alone. The rates and MFU are the whole job's.
    pub world_size: usize,
    /// In a job: what reduces the gradients (NCCL, or the rendezvous's
    /// sockets); `None` alone.
    pub collectives: Option<String>,
    /// In a job: the median step's share spent in the gradients' all-reduce
    /// (and under ZeRO-1 the weights' all-gather), the wait for the
    /// slowest rank included, in percent; `None` alone.
    pub comm_pct: Option<f64>,
    /// What the products computed in: "f32", "bf16 compute, f32 master weights", ...
    pub precision: String,
    /// Optimizer steps: each of `gradient_accumulation_steps` micro-batches.
    pub warmup_steps: usize,
    /// Timed optimizer steps.
    pub timed_steps: usize,
    /// Samples per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// fp16's loss scale at the end (`None`: no loss scaling).
    pub loss_scale: Option<f64>,
    /// Samples (windows or pairs) per second, the median step.
    pub samples_per_s_median: f64,
    /// Tokens that carry data (no padding) per second.
    pub tokens_per_s_median: f64,
    /// The slowest step's tokens per second.
    pub tokens_per_s_min: f64,
    /// The fastest step's tokens per second.
    pub tokens_per_s_max: f64,
    /// The spread: 10th and 90th percentiles of the timed steps.
    pub tokens_per_s_p10: f64,
    /// See `tokens_per_s_p10`.
    pub tokens_per_s_p90: f64,
    /// Tokens computed on, padding included, per second.
    pub padded_tokens_per_s_median: f64,
    /// Milliseconds per optimizer step, the median.
    pub ms_per_step_median: f64,
    /// Model FLOPs/s over the device peak (`None`: peak unknown).
    pub mfu: Option<f64>,
    /// The peak the MFU is measured against, and where it comes from.
    pub mfu_peak: String,
    /// Model FLOPs per sample over the padded length, and over real tokens only.
    pub flops_per_sample_padded: f64,
    /// See `flops_per_sample_padded`.
    pub flops_per_sample_real: f64,
    /// The model's parameters.
    pub parameters: usize,
    /// The vocabulary the model was built with (a trained BPE or WordPiece
    /// can stop below `data.vocab_size` on a small corpus).
    pub vocab_size: usize,
    /// Share of the step spent waiting for the loader, in percent.
    pub data_wait_pct: f64,
    /// Peak resident memory of the process (host RAM).
    pub peak_memory_bytes: u64,
    /// The most CubeCL's allocator held on the GPU while the bench ran (its
    /// pools' high-water mark: this process's own, what `kiln tune`
    /// compares with the GPU's memory; `None` on the CPU).
    pub device_memory_peak_bytes: Option<u64>,
    /// Memory in use on the GPU after the timed steps, as NVML reports it
    /// (the whole device, other processes and the CUDA context included;
    /// `None` on the CPU or without NVML).
    pub device_memory_used_bytes: Option<u64>,
    /// The GPU's memory, as NVML reports it.
    pub device_memory_total_bytes: Option<u64>,
    /// Whether blocks recompute their activations in backward.
    pub gradient_checkpointing: bool,
    /// Where the median step's time goes.
    pub phases: PhaseTimes,
    /// The loss of the last timed step.
    pub final_loss: f64,
    /// CPU time of the whole process (all threads, user and system) over
    /// the wall time of the timed steps, in percent of one core: 200 is two
    /// cores busy throughout. `None` where the platform does not report it.
    pub cpu_util_pct: Option<f64>,
    /// The instruction sets kiln's CPU kernels ran with (`None` on a GPU and
    /// on cubecl-cpu, where none of them run).
    pub isa: Option<kiln_model::kernels::CpuIsa>,
    /// Where the device time of a step went, kernel by kernel (when asked:
    /// [`BenchOptions::kernel_profile_steps`]).
    pub kernel_profile: Option<KernelProfile>,
}

/// Per-step measurements.
#[derive(Default)]
struct Timings {
    step_s: Vec<f64>,
    phases: [Vec<f64>; 7],
    work: Vec<Work>,
    final_loss: f64,
    loss_scale: Option<f64>,
    cpu_util_pct: Option<f64>,
    kernel_profile: Option<KernelProfile>,
}

/// The bench's phase timer: synchronises the device at the end of each
/// phase and adds the time since the last mark to the phase.
struct SyncTimer<'a> {
    device: &'a Device,
    last: Instant,
    /// Seconds per phase in the current step.
    step: [f64; 7],
}

impl SyncTimer<'_> {
    fn start_step(&mut self) {
        self.step = [0.0; 7];
        self.last = Instant::now();
    }
}

impl PhaseTimer for SyncTimer<'_> {
    fn end(&mut self, phase: Phase) {
        let _ = self.device.sync();
        let now = Instant::now();
        let i = match phase {
            Phase::Data => 0,
            Phase::Upload => 1,
            Phase::Forward => 2,
            Phase::Backward => 3,
            Phase::Reduce => 4,
            Phase::Optimizer => 5,
            Phase::Gather => 6,
        };
        self.step[i] += (now - self.last).as_secs_f64();
        self.last = now;
    }
}

/// CPU seconds this process has used (user and system, all threads).
#[cfg(unix)]
fn process_cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is valid.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return None;
        }
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

#[cfg(not(unix))]
fn process_cpu_seconds() -> Option<f64> {
    None
}

/// Runs `warmup + steps` optimizer steps of `task`, timing each phase. In
/// a job (`group`) every rank runs the same steps: after each timed one
/// the ranks agree whether enough were timed (any rank's yes ends it; the
/// agreement is not timed).
fn time_steps<T: Task>(
    task: &T,
    mut model: T::Model,
    device: &Device,
    config: &RunConfig,
    options: BenchOptions,
    scaler: Option<LossScaler>,
    group: Option<&Arc<Group>>,
) -> Result<Timings, TrainError> {
    let mut loader = Loader::new(
        task.source(),
        0,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let mut optim = AdamW::for_run(config, &model, group.map(|g| &**g));
    let mut state = StepState::new(config, scaler);
    state.group = group.cloned();
    let mut timer = SyncTimer {
        device,
        last: Instant::now(),
        step: [0.0; 7],
    };
    let mut out = Timings::default();
    let mut timed = 0.0;
    let enough = |i: usize, timed: f64| {
        let steps = i.saturating_sub(options.warmup);
        i >= options.warmup
            && steps >= options.steps
            && (timed >= options.min_seconds || steps >= 50 * options.steps.max(1))
    };
    let mut i = 0;
    // (CPU seconds, wall clock) when the first timed step starts.
    let mut timed_from = None;
    // After the timed steps, the profiled ones (if asked).
    let mut profiler = None;
    let mut profiled = 0;
    let mut done = enough(0, 0.0);
    loop {
        let measuring = !done;
        if !measuring {
            if profiled == options.kernel_profile_steps {
                break;
            }
            if profiled == 0 {
                // (The phase timer synchronised the device at the end of
                // the last timed step.)
                profiler = Profiler::start();
            }
            profiled += 1;
        }
        i += 1;
        if i == options.warmup + 1 {
            timed_from = Some((process_cpu_seconds(), Instant::now()));
        }
        let start = Instant::now();
        timer.start_step();
        let (stepped, report) = train_step(
            task,
            model,
            &mut optim,
            &mut state,
            &mut loader,
            device,
            config.training.learning_rate,
            &config.training,
            &mut timer,
        )?;
        model = stepped;
        if measuring {
            out.final_loss = f64::from(report.loss);
        }
        if measuring && i > options.warmup {
            let seconds = start.elapsed().as_secs_f64();
            timed += seconds;
            out.step_s.push(seconds);
            out.work.push(report.work);
            for (list, v) in out.phases.iter_mut().zip(timer.step) {
                list.push(v * 1e3);
            }
        }
        if measuring {
            done = agree(group, enough(i, timed))?;
            if done {
                record_cpu_use(&mut out, timed_from.take());
            }
        }
    }
    out.kernel_profile = profiler.map(|p| {
        let mut ms: Vec<f64> = out.step_s.iter().map(|s| s * 1e3).collect();
        p.finish(profiled, median(&mut ms))
    });
    out.loss_scale = state.scaler.map(|s| s.scale);
    Ok(out)
}

/// Whether any rank of the job says yes (`yes` alone).
fn agree(group: Option<&Arc<Group>>, yes: bool) -> Result<bool, TrainError> {
    let Some(group) = group else {
        return Ok(yes);
    };
    let mut flag = [if yes { 1.0 } else { 0.0 }];
    group.all_reduce(&mut flag, Reduce::Max)?;
    Ok(flag[0] > 0.0)
}

/// The process's CPU use from `from` (CPU seconds, wall clock) to now.
fn record_cpu_use(out: &mut Timings, from: Option<(Option<f64>, Instant)>) {
    if let Some((Some(cpu0), wall0)) = from {
        let wall = wall0.elapsed().as_secs_f64();
        out.cpu_util_pct = process_cpu_seconds()
            .filter(|_| wall > 0.0)
            .map(|cpu1| 100.0 * (cpu1 - cpu0) / wall);
    }
}

/// A kernel profile needs a device whose kernels CubeCL launches: a GPU
/// backend (wgpu, CUDA) built in and chosen.
fn check_kernel_profile(
    options: BenchOptions,
    device: &crate::DeviceChoice,
) -> Result<(), TrainError> {
    if options.kernel_profile_steps == 0 {
        return Ok(());
    }
    let why = if !cfg!(feature = "gpu") {
        "and this kiln has no GPU backend built in (build it with `--features wgpu` or `cuda`)"
    } else if !device.is_gpu {
        "choose one with device.backend=wgpu or cuda; on the CPU, profile with `perf record` (docs/PERFORMANCE.md)"
    } else {
        return Ok(());
    };
    Err(TrainError::Unsupported(
        "--kernel-profile",
        format!(
            "it times the kernels CubeCL launches on a GPU backend, and this bench runs on {}: {why}",
            device.name
        ),
    ))
}

#[allow(clippy::too_many_arguments, reason = "what a result is made of")]
fn result(
    workload: &'static str,
    device: &crate::DeviceChoice,
    precision: &PrecisionChoice,
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
    (parameters, vocab_size): (usize, usize),
    flops_real: f64,
    mut t: Timings,
    job: Option<(&Group, String)>,
) -> BenchResult {
    let world = job.as_ref().map_or(1, |(g, _)| g.world_size());
    let mut memory = MemoryTracker::new();
    let (_, peak_memory) = memory.sample();
    let per_step = |v: &[usize]| -> Vec<f64> {
        v.iter()
            .zip(&t.step_s)
            .map(|(n, s)| *n as f64 / s)
            .collect()
    };
    let real: Vec<usize> = t.work.iter().map(|w| w.tokens).collect();
    let padded: Vec<usize> = t.work.iter().map(|w| w.padded_tokens).collect();
    let mut tps = per_step(&real);
    let mut padded = per_step(&padded);
    let mut sps: Vec<f64> = t
        .work
        .iter()
        .zip(&t.step_s)
        .map(|(w, s)| w.samples as f64 / s)
        .collect();
    let mut flops: Vec<f64> = t
        .work
        .iter()
        .zip(&t.step_s)
        .map(|(w, s)| w.flops / s)
        .collect();
    let mut ms: Vec<f64> = t.step_s.iter().map(|s| s * 1e3).collect();
    let total: f64 = t.step_s.iter().sum();
    let waited: f64 = t.phases[0].iter().sum::<f64>() / 1e3;
    let samples: usize = t.work.iter().map(|w| w.samples).sum();
    let flops_padded = t.work.iter().map(|w| w.flops).sum::<f64>() / samples.max(1) as f64;
    // A job's rate is counted against the peak of all its devices.
    let (peak, mut mfu_peak) = mfu_peak(config, device, precision, hardware);
    let peak = peak.map(|p| p * world as f64);
    if world > 1 {
        mfu_peak = format!("{world} × {mfu_peak}");
    }
    let mut comm: Vec<f64> = t.phases[4]
        .iter()
        .zip(&t.phases[6])
        .zip(&t.step_s)
        .map(|((reduce, gather), s)| comm_share(*reduce, *gather, *s))
        .collect();
    let comm_pct = job.is_some().then(|| median(&mut comm));
    let tokens_per_s_median = median(&mut tps);
    let percentile = |v: &[f64], q: f64| -> f64 {
        // `median` sorted `tps`; nearest rank.
        v.get(((v.len().saturating_sub(1)) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let gpu_memory = device
        .is_gpu
        .then(|| {
            let index = kiln_plan::run_gpu(config, hardware).map(|g| g.index);
            kiln_hwdetect::detect_gpus()
                .into_iter()
                .find(|g| Some(g.index) == index)
                .map(|g| {
                    (
                        g.memory_total_bytes - g.memory_free_bytes,
                        g.memory_total_bytes,
                    )
                })
        })
        .flatten();
    let [d, h, f, b, r, o, g] = &mut t.phases;
    BenchResult {
        workload,
        backend: device.name.clone(),
        world_size: world,
        collectives: job.map(|(_, how)| how),
        comm_pct,
        precision: precision.label.clone(),
        warmup_steps: options.warmup,
        timed_steps: t.step_s.len(),
        batch_size: config.training.batch_size,
        gradient_accumulation_steps: config.training.gradient_accumulation_steps,
        loss_scale: t.loss_scale,
        samples_per_s_median: median(&mut sps),
        tokens_per_s_median,
        tokens_per_s_min: tps.first().copied().unwrap_or(0.0),
        tokens_per_s_max: tps.last().copied().unwrap_or(0.0),
        tokens_per_s_p10: percentile(&tps, 0.1),
        tokens_per_s_p90: percentile(&tps, 0.9),
        padded_tokens_per_s_median: median(&mut padded),
        ms_per_step_median: median(&mut ms),
        mfu: peak.map(|p| median(&mut flops) / p),
        mfu_peak,
        flops_per_sample_padded: flops_padded,
        flops_per_sample_real: flops_real,
        parameters,
        vocab_size,
        data_wait_pct: if total > 0.0 {
            100.0 * waited / total
        } else {
            0.0
        },
        peak_memory_bytes: peak_memory,
        device_memory_peak_bytes: device
            .is_gpu
            .then(|| kiln_model::device_memory(&device.device))
            .flatten()
            .map(|m| m.peak_reserved),
        device_memory_used_bytes: gpu_memory.map(|(used, _)| used),
        device_memory_total_bytes: gpu_memory.map(|(_, total)| total),
        gradient_checkpointing: config.model.gradient_checkpointing,
        phases: PhaseTimes {
            data_wait_ms: median(d),
            host_to_device_ms: median(h),
            forward_ms: median(f),
            backward_ms: median(b),
            all_reduce_ms: median(r),
            optimizer_ms: median(o),
            all_gather_ms: median(g),
        },
        final_loss: t.final_loss,
        cpu_util_pct: t.cpu_util_pct,
        isa: device.is_flex().then(kiln_model::kernels::cpu_isa),
        kernel_profile: t.kernel_profile,
    }
}

/// One loader setting of [`bench_loader`].
#[derive(Clone, Debug, Serialize)]
pub struct LoaderRow {
    /// Loader worker threads.
    pub num_workers: usize,
    /// Batches each worker makes ahead.
    pub prefetch_factor: usize,
    /// Batches per second.
    pub batches_per_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Mean time the consumer waited for a batch.
    pub mean_wait_ms: f64,
    /// Whether this is the configured setting.
    pub configured: bool,
}

/// What `kiln bench loader` measured: the loader alone, as fast as it can go.
#[derive(Clone, Debug, Serialize)]
pub struct LoaderBenchResult {
    /// `lm` or `nli`.
    pub workload: &'static str,
    /// Samples per batch.
    pub batch_size: usize,
    /// Batches pulled per setting.
    pub batches: usize,
    /// One row per loader setting.
    pub rows: Vec<LoaderRow>,
}

/// The guides' `benchmark_dataloader`: pulls `batches` batches of the
/// configured workload with the configured loader and with 0, 1, 2 and 4
/// workers, nothing else running, and reports the rates. Compare
/// `samples_per_s` with the training step's to see whether loading can keep up.
pub fn bench_loader(config: &RunConfig, batches: usize) -> Result<LoaderBenchResult, TrainError> {
    let l = &config.loader;
    let mut settings = vec![(l.num_workers, l.prefetch_factor)];
    for w in [0, 1, 2, 4] {
        if w != l.num_workers {
            settings.push((w, l.prefetch_factor));
        }
    }
    let batch = config.training.batch_size;
    let (workload, rows) = match config.workload {
        Workload::Lm => {
            let prepared = lm::prepare(config, lm::TokenizerFrom::Config)?;
            let task = prepared.task(config, &Device::flex())?;
            ("lm", loader_rows(task.source(), &settings, batches, batch)?)
        }
        Workload::Nli => {
            let pairs = nli::read(config)?;
            let prepared = nli::prepare(config, &pairs, 0, None, (0, 1))?;
            (
                "nli",
                loader_rows(prepared.train, &settings, batches, batch)?,
            )
        }
    };
    Ok(LoaderBenchResult {
        workload,
        batch_size: batch,
        batches,
        rows,
    })
}

/// One row per loader setting (the first is the configured one).
fn loader_rows<S: BatchSource>(
    source: Arc<S>,
    settings: &[(usize, usize)],
    batches: usize,
    batch: usize,
) -> Result<Vec<LoaderRow>, TrainError> {
    settings
        .iter()
        .enumerate()
        .map(|(i, &(w, p))| {
            let mut loader = Loader::new(Arc::clone(&source), 0, w, p);
            let bench = benchmark_loader(&mut loader, batches)?;
            Ok(LoaderRow {
                num_workers: w,
                prefetch_factor: p,
                batches_per_s: bench.batches_per_second,
                samples_per_s: bench.batches_per_second * batch as f64,
                mean_wait_ms: bench.mean_wait.as_secs_f64() * 1e3,
                configured: i == 0,
            })
        })
        .collect()
}

/// The device a benchmark runs on, its seeded training device, and the
/// precision the model computes in there.
pub(crate) fn bench_device(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<(crate::DeviceChoice, Device, PrecisionChoice), TrainError> {
    let choice = open_device(config, hardware.gpu_vendor())?;
    check_kernel_profile(options, &choice)?;
    let device = train_device(config, &choice.device, config.training.seed);
    let precision = run_precision(config, &choice, hardware);
    crate::setup::check_attention_choice(config, &choice, &precision)?;
    Ok((choice, device, precision))
}

/// A bench's process: its configuration on the rank's GPU (`LOCAL_RANK`,
/// in a job), its device and precision, how the job's gradients travel
/// (`None` alone) and its (rank, world).
struct BenchRank {
    config: RunConfig,
    choice: crate::DeviceChoice,
    device: Device,
    precision: PrecisionChoice,
    how: Option<String>,
    share: (usize, usize),
}

fn bench_rank(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
    group: Option<&Arc<Group>>,
) -> Result<BenchRank, TrainError> {
    let config = on_rank_device(config, group.map(|g| &**g), hardware);
    let (choice, device, precision) = bench_device(&config, hardware, options)?;
    let how = group
        .map(|g| collectives(&choice, g, &config))
        .transpose()?;
    Ok(BenchRank {
        share: group.map_or((0, 1), |g| (g.rank(), g.world_size())),
        config,
        choice,
        device,
        precision,
        how,
    })
}

impl BenchRank {
    /// Times `task`'s steps on `model` from fp16's loss scaler a run
    /// starts from, and reports them for a model of `(parameters,
    /// vocabulary)` and `flops` per sample.
    fn time<T: Task>(
        &self,
        workload: &'static str,
        task: &T,
        model: T::Model,
        (hardware, options, group): (&HardwareReport, BenchOptions, Option<&Arc<Group>>),
        (size, flops): ((usize, usize), f64),
    ) -> Result<BenchResult, TrainError> {
        let config = &self.config;
        let scaler = self
            .precision
            .loss_scaling()
            .then(|| LossScaler::from_config(&config.precision));
        let timings = time_steps(task, model, &self.device, config, options, scaler, group)?;
        let job = group.map(|g| &**g).zip(self.how.clone());
        Ok(result(
            workload,
            &self.choice,
            &self.precision,
            config,
            hardware,
            options,
            size,
            flops,
            timings,
            job,
        ))
    }
}

/// Times training steps of the language model of `config`, prepared as a
/// run prepares it.
pub fn bench_lm(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<BenchResult, TrainError> {
    bench_lm_job(config, hardware, options, None)
}

/// [`bench_lm`] as one rank of a data-parallel job (`group`, as `kiln
/// launch … bench lm` starts them), or alone (`None`). Every rank of the
/// job runs it: each on its share of every batch and its own device
/// (`LOCAL_RANK`), the gradients all-reduced in each step as in training.
/// The result is the job's (its tokens/s and MFU over every rank) and
/// counts for rank 0; memory is each rank's own.
pub fn bench_lm_job(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
    group: Option<&Arc<Group>>,
) -> Result<BenchResult, TrainError> {
    let job = group.map(|g| &**g);
    let r = bench_rank(config, hardware, options, group)?;
    let config = &r.config;
    let prepared = prepare_in_turn(job, || lm::prepare(config, lm::TokenizerFrom::Config))?;
    let task = prepared.shared_task(config, &r.choice.device, r.share.0, r.share.1)?;
    let gpt = &prepared.gpt;
    // The weights do not change the time: drawn, not read from a folder.
    let model = lm_model(config, &prepared, &r.device, &r.precision, false)?;
    let flops = gpt.flops_per_token() * config.model.max_length as f64;
    r.time(
        "lm",
        &task,
        model,
        (hardware, options, group),
        ((gpt.num_params(), gpt.vocab_size), flops),
    )
}

/// Times training steps of the sentence-pair encoder of `config` on its
/// first fold, prepared as the run prepares it.
pub fn bench_nli(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<BenchResult, TrainError> {
    bench_nli_job(config, hardware, options, None)
}

/// [`bench_nli`] as one rank of a data-parallel job (`kiln launch … bench
/// nli`), or alone (`None`), as [`bench_lm_job`] times the language
/// model's: each rank on its share of the first fold's batches.
pub fn bench_nli_job(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
    group: Option<&Arc<Group>>,
) -> Result<BenchResult, TrainError> {
    let r = bench_rank(config, hardware, options, group)?;
    let config = &r.config;
    let pad_to = options.pad_to_max_length.then_some(config.model.max_length);
    let (prepared, model, task) = nli_first_fold(
        config,
        &r.choice,
        &r.device,
        &r.precision,
        (pad_to, false),
        r.share,
    )?;
    let encoder = &prepared.encoder;
    let flops = encoder.flops_per_sequence(
        prepared.mean_length.round() as usize,
        config.model.freeze_encoder,
    );
    let size = (encoder.num_params(), encoder.vocab_size);
    r.time(
        "nli",
        &task,
        model,
        (hardware, options, group),
        (size, flops),
    )
}

/// The GPT of `prepared` as a run starts it: its weights drawn from the
/// seed on `device` (with `pretrained`, `model.init_from`'s where it names
/// a folder), its products in the run's precision, its kernels.
pub(crate) fn lm_model(
    config: &RunConfig,
    prepared: &lm::Prepared,
    device: &Device,
    precision: &PrecisionChoice,
    pretrained: bool,
) -> Result<kiln_model::Gpt, TrainError> {
    let gpt = &prepared.gpt;
    let folder = if pretrained {
        crate::pretrained::open(config, &prepared.tokenizer)?
    } else {
        None
    };
    let model = match folder {
        Some(folder) => folder.load_into(gpt.init_unset(device), device)?,
        None => init_model(config, device, config.training.seed, |d| gpt.init(d)),
    };
    Ok(model
        .with_compute(precision.compute)
        .with_kernels(kernels(config))
        .with_attention(crate::translate::attention(config)))
}

/// The sentence-pair encoder of `config` on its first fold, as the run
/// starts it (with `pretrained`, from `model.init_from`'s weights where it
/// names a folder; frozen where `model.freeze_encoder` says), and its task
/// (`pad_to`: every batch padded to it; `share`: (rank, world) of a job's
/// rank, whose share of each batch it trains on).
pub(crate) fn nli_first_fold(
    config: &RunConfig,
    choice: &crate::DeviceChoice,
    device: &Device,
    precision: &PrecisionChoice,
    (pad_to, pretrained): (Option<usize>, bool),
    share: (usize, usize),
) -> Result<(nli::Prepared, kiln_model::EncoderClassifier, nli::NliTask), TrainError> {
    let pairs = nli::read(config)?;
    let prepared = nli::prepare(config, &pairs, 0, None, share)?;
    let encoder = &prepared.encoder;
    let mut model = init_model(config, device, prepared.seed, |d| encoder.init(d));
    if pretrained && let Some(bert) = crate::pretrained::bert::open(config)? {
        model = bert.load_into(model, device)?;
    }
    let mut model = model
        .with_compute(precision.compute)
        .with_kernels(kernels(config))
        .with_attention(crate::translate::attention(config));
    if config.model.freeze_encoder {
        model = model.freeze_encoder();
    }
    let task = prepared.task(config, &pairs.data.labels, &choice.device, pad_to);
    Ok((prepared, model, task))
}

/// The percentage of a step of `step_s` seconds spent between the ranks:
/// the gradients' reduction and ZeRO's weights' all-gather (each in ms).
fn comm_share(reduce_ms: f64, gather_ms: f64, step_s: f64) -> f64 {
    (reduce_ms + gather_ms) / (10.0 * step_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communication_counts_the_reduction_and_the_gather() {
        assert_eq!(comm_share(30.0, 0.0, 0.1), 30.0);
        assert_eq!(comm_share(30.0, 20.0, 0.1), 50.0);
    }

    /// A tiny model on a slice of the shipped corpus, with `extra` overrides.
    fn tiny(cache: &std::path::Path, extra: &[&str]) -> RunConfig {
        // The checkout `cargo test` runs in, as in tests/support.rs.
        let corpus = std::env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(
                || env!("CARGO_MANIFEST_DIR").into(),
                std::path::PathBuf::from,
            )
            .join("../../data/tinyshakespeare.txt");
        let mut overrides = vec![
            format!("data.path={}", corpus.display()),
            format!("data.cache_dir={}", cache.display()),
            "data.max_chars=40000".to_string(),
            "model.layers=1".into(),
            "model.heads=2".into(),
            "model.hidden=16".into(),
            "model.intermediate=32".into(),
            "model.max_length=16".into(),
            "training.batch_size=4".into(),
            "loader.num_workers=0".into(),
        ];
        overrides.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        crate::tests::config(&refs)
    }

    #[test]
    fn bench_times_the_training_step_with_accumulation_and_loss_scaling() {
        let cache = tempfile::tempdir().expect("tempdir");
        let config = tiny(
            cache.path(),
            &[
                "training.gradient_accumulation_steps=4",
                "precision.amp=true",
                "precision.amp_dtype=fp16",
            ],
        );
        let hardware = kiln_hwdetect::detect_cpu_only();
        let options = BenchOptions {
            warmup: 1,
            steps: 3,
            min_seconds: 0.0,
            pad_to_max_length: false,
            kernel_profile_steps: 0,
        };
        let before = crate::step::steps_run();
        let r = bench_lm(&config, &hardware, options).expect("bench runs");
        // Each warm-up and timed step was one call of the loop's step...
        assert_eq!(
            crate::step::steps_run() - before,
            (r.warmup_steps + r.timed_steps) as u64
        );
        assert_eq!(r.timed_steps, 3);
        // ...of four micro-batches, its fp16 loss scaled.
        assert_eq!(r.gradient_accumulation_steps, 4);
        assert!(r.loss_scale.is_some_and(|s| s > 1.0), "{:?}", r.loss_scale);
        let tokens_per_step = r.tokens_per_s_median * r.ms_per_step_median / 1e3;
        assert!(
            (tokens_per_step - (4 * 4 * 16) as f64).abs() < 1.0,
            "{tokens_per_step} tokens per step"
        );
        assert!(r.final_loss.is_finite());
    }
}
