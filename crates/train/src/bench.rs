//! `kiln bench lm | nli`: warm-up steps excluded, then the median and spread
//! of timed training steps, each split into its phases (the device is
//! synchronised between them, which a training run does not do).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use kiln_config::{RunConfig, Workload};
use kiln_data::{
    BatchSource, EncodedPair, LmWindows, Loader, PairBatch, PairBatches, Split, Tokenizer,
    benchmark_loader, encode_cached, encode_dataset, pad_batch, read_corpus, read_pairs,
};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::lm::{batch_tensors, gpt_config, make_tokenizer};
use crate::nli::{encoder_config, pair_tensors, schema};
use crate::optim::{AdamW, global_grad_norm};
use crate::precision::PrecisionChoice;
use crate::report::median;
use crate::trainer::{Work, init_model, kernels, train_device};
use crate::{MemoryTracker, TrainError, open_device};

/// How many steps to run, and how to pad pairs.
#[derive(Clone, Copy, Debug)]
pub struct BenchOptions {
    pub warmup: usize,
    /// Timed steps, at least...
    pub steps: usize,
    /// ...and at least this many seconds of them (short steps are noisy:
    /// more of them), up to 50 × `steps`.
    pub min_seconds: f64,
    /// Pad every pair batch to `model.max_length` (PyTorch comparisons pad so).
    pub pad_to_max_length: bool,
}

/// Median milliseconds per phase of a step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseTimes {
    pub data_wait_ms: f64,
    pub host_to_device_ms: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
}

/// What a benchmark measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub workload: &'static str,
    pub backend: String,
    /// What the products computed in: "f32", "bf16 compute, f32 master weights", ...
    pub precision: String,
    pub warmup_steps: usize,
    pub timed_steps: usize,
    pub batch_size: usize,
    pub samples_per_s_median: f64,
    /// Tokens that carry data (no padding) per second.
    pub tokens_per_s_median: f64,
    pub tokens_per_s_min: f64,
    pub tokens_per_s_max: f64,
    /// The spread: 10th and 90th percentiles of the timed steps.
    pub tokens_per_s_p10: f64,
    pub tokens_per_s_p90: f64,
    /// Tokens computed on, padding included, per second.
    pub padded_tokens_per_s_median: f64,
    pub ms_per_step_median: f64,
    pub mfu: Option<f64>,
    pub mfu_peak: String,
    /// Model FLOPs per sample over the padded length, and over real tokens only.
    pub flops_per_sample_padded: f64,
    pub flops_per_sample_real: f64,
    pub parameters: usize,
    /// The vocabulary the model was built with (a trained BPE or WordPiece
    /// can stop below `data.vocab_size` on a small corpus).
    pub vocab_size: usize,
    pub data_wait_pct: f64,
    /// Peak resident memory of the process (host RAM).
    pub peak_memory_bytes: u64,
    /// Memory in use on the GPU after the timed steps, as NVML reports it
    /// (the whole device; `None` on the CPU or without NVML).
    pub device_memory_used_bytes: Option<u64>,
    pub device_memory_total_bytes: Option<u64>,
    pub gradient_checkpointing: bool,
    pub phases: PhaseTimes,
    pub final_loss: f64,
    /// CPU time of the whole process (all threads, user and system) over
    /// the wall time of the timed steps, in percent of one core: 200 is two
    /// cores busy throughout. `None` where the platform does not report it.
    pub cpu_util_pct: Option<f64>,
}

/// Per-step measurements.
#[derive(Default)]
struct Timings {
    step_s: Vec<f64>,
    phases: [Vec<f64>; 5],
    work: Vec<Work>,
    padded_tokens: Vec<usize>,
    real_tokens: Vec<usize>,
    final_loss: f64,
    cpu_util_pct: Option<f64>,
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

/// Runs `warmup + steps` training steps, timing each phase.
#[allow(clippy::too_many_arguments, reason = "the parts of a timed step")]
fn time_steps<M: Module, S: BatchSource, I>(
    source: Arc<S>,
    mut model: M,
    optim: &mut AdamW,
    device: &Device,
    config: &RunConfig,
    options: BenchOptions,
    upload: impl Fn(&S::Batch, &Device) -> I,
    forward: impl Fn(&M, I) -> Tensor<1>,
    work: impl Fn(&S::Batch) -> (Work, usize),
) -> Timings {
    let t = &config.training;
    let mut loader = Loader::new(
        source,
        0,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let sync = || {
        let _ = device.sync();
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
    while !enough(i, timed) {
        i += 1;
        if i == options.warmup + 1 {
            timed_from = Some((process_cpu_seconds(), Instant::now()));
        }
        let start = Instant::now();
        let loaded = loader.next_batch();
        let t_data = loaded.wait.as_secs_f64();
        let t0 = Instant::now();
        let inputs = upload(&loaded.batch, device);
        sync();
        let t1 = Instant::now();
        let loss = forward(&model, inputs);
        sync();
        let t2 = Instant::now();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        sync();
        let t3 = Instant::now();
        let norm = global_grad_norm(&model, &grads);
        let scale = if t.grad_clip > 0.0 && norm > t.grad_clip {
            t.grad_clip / (norm + 1e-6)
        } else {
            1.0
        };
        model = optim.step(model, grads, t.learning_rate, scale);
        out.final_loss = f64::from(loss.into_scalar::<f32>());
        let t4 = Instant::now();
        if i > options.warmup {
            timed += start.elapsed().as_secs_f64();
            out.step_s.push(start.elapsed().as_secs_f64());
            let (w, padded) = work(&loaded.batch);
            out.work.push(w);
            out.real_tokens.push(w.tokens);
            out.padded_tokens.push(padded);
            let phases = [
                t_data,
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                (t3 - t2).as_secs_f64(),
                (t4 - t3).as_secs_f64(),
            ];
            for (list, v) in out.phases.iter_mut().zip(phases) {
                list.push(v * 1e3);
            }
        }
    }
    if let Some((Some(cpu0), wall0)) = timed_from {
        let wall = wall0.elapsed().as_secs_f64();
        out.cpu_util_pct = process_cpu_seconds()
            .filter(|_| wall > 0.0)
            .map(|cpu1| 100.0 * (cpu1 - cpu0) / wall);
    }
    out
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
) -> BenchResult {
    let mut memory = MemoryTracker::new();
    let (_, peak_memory) = memory.sample();
    let per_step = |v: &[usize]| -> Vec<f64> {
        v.iter()
            .zip(&t.step_s)
            .map(|(n, s)| *n as f64 / s)
            .collect()
    };
    let mut tps = per_step(&t.real_tokens);
    let mut padded = per_step(&t.padded_tokens);
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
    let (peak, mfu_peak) = crate::lm::mfu_peak(device, precision, hardware);
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
            let index = config.device.index;
            kiln_hwdetect::detect_gpus()
                .into_iter()
                .find(|g| g.index as usize == index)
                .map(|g| {
                    (
                        g.memory_total_bytes - g.memory_free_bytes,
                        g.memory_total_bytes,
                    )
                })
        })
        .flatten();
    let [d, h, f, b, o] = &mut t.phases;
    BenchResult {
        workload,
        backend: device.name.clone(),
        precision: precision.label.clone(),
        warmup_steps: options.warmup,
        timed_steps: t.step_s.len(),
        batch_size: config.training.batch_size,
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
        device_memory_used_bytes: gpu_memory.map(|(used, _)| used),
        device_memory_total_bytes: gpu_memory.map(|(_, total)| total),
        gradient_checkpointing: config.model.gradient_checkpointing,
        phases: PhaseTimes {
            data_wait_ms: median(d),
            host_to_device_ms: median(h),
            forward_ms: median(f),
            backward_ms: median(b),
            optimizer_ms: median(o),
        },
        final_loss: t.final_loss,
        cpu_util_pct: t.cpu_util_pct,
    }
}

/// The language model's training windows for `config`, and the vocabulary size.
pub(crate) fn lm_source(config: &RunConfig) -> Result<(Arc<LmWindows>, usize), TrainError> {
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = make_tokenizer(config, &corpus.text)?;
    let (ids, _) = encode_cached(&tokenizer, &corpus, Path::new(&config.data.cache_dir))?;
    let block = config.model.max_length;
    if ids.len() < block + 1 {
        return Err(kiln_data::DataError::TooShort {
            path: corpus.path.clone(),
            split: "train",
            tokens: ids.len(),
            need: block + 1,
        }
        .into());
    }
    let t = &config.training;
    let source = Arc::new(LmWindows::new(
        ids.into(),
        t.batch_size,
        block,
        t.seed,
        Split::Train,
    ));
    Ok((source, tokenizer.vocab_size()))
}

/// Batches of all of `config`'s pairs (a WordPiece vocabulary built on them),
/// the vocabulary size and the mean pair length in tokens.
pub(crate) fn nli_source(config: &RunConfig) -> Result<(Arc<PairBatches>, usize, f64), TrainError> {
    let data = read_pairs(Path::new(&config.data.path), &schema(config, true))?;
    let tokenizer = Tokenizer::wordpiece(
        data.pairs
            .iter()
            .flat_map(|p| [p.premise.as_str(), p.hypothesis.as_str()]),
        config.data.vocab_size,
        config.model.max_length,
    )?;
    let encoded: Arc<[EncodedPair]> = encode_dataset(&tokenizer, &data)?.into();
    let real_mean =
        encoded.iter().map(|p| p.ids.len()).sum::<usize>() as f64 / encoded.len().max(1) as f64;
    let t = &config.training;
    let source = Arc::new(PairBatches::new(
        encoded,
        t.batch_size,
        t.seed,
        config.loader.bucket_by_length,
    ));
    Ok((source, tokenizer.vocab_size(), real_mean))
}

/// One loader setting of [`bench_loader`].
#[derive(Clone, Debug, Serialize)]
pub struct LoaderRow {
    pub num_workers: usize,
    pub prefetch_factor: usize,
    pub batches_per_s: f64,
    pub samples_per_s: f64,
    /// Mean time the consumer waited for a batch.
    pub mean_wait_ms: f64,
    /// Whether this is the configured setting.
    pub configured: bool,
}

/// What `kiln bench loader` measured: the loader alone, as fast as it can go.
#[derive(Clone, Debug, Serialize)]
pub struct LoaderBenchResult {
    pub workload: &'static str,
    pub batch_size: usize,
    pub batches: usize,
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
        Workload::Lm => (
            "lm",
            loader_rows(lm_source(config)?.0, &settings, batches, batch),
        ),
        Workload::Nli => (
            "nli",
            loader_rows(nli_source(config)?.0, &settings, batches, batch),
        ),
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
) -> Vec<LoaderRow> {
    settings
        .iter()
        .enumerate()
        .map(|(i, &(w, p))| {
            let mut loader = Loader::new(Arc::clone(&source), 0, w, p);
            let bench = benchmark_loader(&mut loader, batches);
            LoaderRow {
                num_workers: w,
                prefetch_factor: p,
                batches_per_s: bench.batches_per_second,
                samples_per_s: bench.batches_per_second * batch as f64,
                mean_wait_ms: bench.mean_wait.as_secs_f64() * 1e3,
                configured: i == 0,
            }
        })
        .collect()
}

/// The device a benchmark runs on, its seeded training device, and the
/// precision the model computes in there.
fn bench_device(
    config: &RunConfig,
    hardware: &HardwareReport,
) -> Result<(crate::DeviceChoice, Device, PrecisionChoice), TrainError> {
    let choice = open_device(config, !hardware.gpus().is_empty())?;
    let device = train_device(config, &choice.device, config.training.seed);
    let precision = crate::lm::run_precision(config, &choice, hardware);
    Ok((choice, device, precision))
}

/// Times training steps of the language model of `config`.
pub fn bench_lm(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<BenchResult, TrainError> {
    let (choice, device, precision) = bench_device(config, hardware)?;
    let (source, vocab) = lm_source(config)?;
    let block = config.model.max_length;
    let gpt = gpt_config(config, vocab);
    let seed = config.training.seed;
    let model = init_model(config, &device, choice.is_gpu, seed, |d| gpt.init(d))
        .with_compute(precision.compute)
        .with_kernels(kernels(config));
    let per_token = gpt.flops_per_token();
    let timings = time_steps(
        source,
        model,
        &mut AdamW::for_training(&config.training),
        &device,
        config,
        options,
        batch_tensors,
        |m: &kiln_model::Gpt, (x, y)| m.loss(x, y),
        |b| {
            let tokens = b.batch_size * b.block;
            (
                Work {
                    samples: b.batch_size,
                    tokens,
                    flops: per_token * tokens as f64,
                },
                tokens,
            )
        },
    );
    Ok(result(
        "lm",
        &choice,
        &precision,
        config,
        hardware,
        options,
        (gpt.num_params(), vocab),
        per_token * block as f64,
        timings,
    ))
}

/// Pads a batch out to `len` tokens.
fn repad(b: &PairBatch, len: usize) -> PairBatch {
    if b.seq_len >= len {
        return b.clone();
    }
    let rows: Vec<EncodedPair> = (0..b.batch_size)
        .map(|r| {
            let row = r * b.seq_len..(r + 1) * b.seq_len;
            let n = b.mask[row.clone()].iter().filter(|m| **m).count();
            EncodedPair {
                ids: b.ids[row.start..row.start + n].to_vec(),
                segments: b.segments[row.start..row.start + n].to_vec(),
                label: b.labels[r],
            }
        })
        .collect();
    let refs: Vec<&EncodedPair> = rows.iter().collect();
    let mut out = pad_batch(b.index, &refs);
    let extra = len - out.seq_len;
    let widen = |v: &[u32]| -> Vec<u32> {
        v.chunks(out.seq_len)
            .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, extra)))
            .collect()
    };
    let mask: Vec<bool> = out
        .mask
        .chunks(out.seq_len)
        .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(false, extra)))
        .collect();
    out.ids = widen(&out.ids);
    out.segments = widen(&out.segments);
    out.mask = mask;
    out.seq_len = len;
    out
}

/// Times training steps of the sentence-pair encoder of `config` on its data.
pub fn bench_nli(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<BenchResult, TrainError> {
    let (choice, device, precision) = bench_device(config, hardware)?;
    let (source, vocab, real_mean) = nli_source(config)?;
    let max_len = config.model.max_length;
    let encoder = encoder_config(config, vocab);
    let seed = config.training.seed;
    let mut model = init_model(config, &device, choice.is_gpu, seed, |d| encoder.init(d))
        .with_compute(precision.compute)
        .with_kernels(kernels(config));
    let frozen = config.model.freeze_encoder;
    if frozen {
        model = model.freeze_encoder();
    }
    let pad = options.pad_to_max_length;
    let enc = encoder.clone();
    let timings = time_steps(
        source,
        model,
        &mut AdamW::for_training(&config.training),
        &device,
        config,
        options,
        |b: &PairBatch, d: &Device| {
            if pad {
                pair_tensors(&repad(b, max_len), d)
            } else {
                pair_tensors(b, d)
            }
        },
        |m: &kiln_model::EncoderClassifier, (ids, seg, mask, labels)| {
            m.loss(ids, seg, mask, labels)
        },
        |b| {
            let len = if pad {
                max_len.max(b.seq_len)
            } else {
                b.seq_len
            };
            (
                Work {
                    samples: b.batch_size,
                    tokens: b.real_tokens,
                    flops: b.batch_size as f64 * enc.flops_per_sequence(len, frozen),
                },
                b.batch_size * len,
            )
        },
    );
    Ok(result(
        "nli",
        &choice,
        &precision,
        config,
        hardware,
        options,
        (encoder.num_params(), vocab),
        encoder.flops_per_sequence(real_mean.round() as usize, frozen),
        timings,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repadding_keeps_the_rows_and_widens_with_padding() {
        let pairs = [
            EncodedPair {
                ids: vec![2, 5, 3],
                segments: vec![0, 0, 0],
                label: 1,
            },
            EncodedPair {
                ids: vec![2, 3],
                segments: vec![0, 0],
                label: 0,
            },
        ];
        let b = pad_batch(0, &pairs.iter().collect::<Vec<_>>());
        let wide = repad(&b, 6);
        assert_eq!(wide.seq_len, 6);
        assert_eq!(wide.ids, vec![2, 5, 3, 0, 0, 0, 2, 3, 0, 0, 0, 0]);
        assert_eq!(wide.mask.iter().filter(|m| **m).count(), 5);
        assert_eq!(wide.labels, vec![1, 0]);
    }
}
