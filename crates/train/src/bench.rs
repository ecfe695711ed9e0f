//! `kiln bench lm`: warm-up steps excluded, then the median and spread of
//! timed training steps, each split into its phases (device synchronised
//! between them, which a training run does not do).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::optim::GradientsParams;
use kiln_config::RunConfig;
use kiln_data::{LmWindows, Loader, Split, encode_cached, read_corpus};
use kiln_hwdetect::HardwareReport;
use serde::Serialize;

use crate::lm::{batch_tensors, gpt_config, make_tokenizer};
use crate::optim::{AdamW, AdamWConfig, global_grad_norm};
use crate::report::median;
use crate::{MemoryTracker, TrainError, select_device};

/// How many steps to run.
#[derive(Clone, Copy, Debug)]
pub struct BenchOptions {
    pub warmup: usize,
    pub steps: usize,
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

/// What `bench_lm` measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub workload: &'static str,
    pub backend: String,
    pub warmup_steps: usize,
    pub timed_steps: usize,
    pub tokens_per_step: usize,
    pub tokens_per_s_median: f64,
    pub tokens_per_s_min: f64,
    pub tokens_per_s_max: f64,
    pub ms_per_step_median: f64,
    pub mfu: Option<f64>,
    pub mfu_peak: String,
    pub flops_per_token: f64,
    pub parameters: usize,
    pub data_wait_pct: f64,
    pub peak_memory_bytes: u64,
    pub phases: PhaseTimes,
    pub final_loss: f64,
}

/// Times training steps of the language model of `config`.
pub fn bench_lm(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<BenchResult, TrainError> {
    let choice = select_device(config.device.backend)?;
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
    let mut loader = Loader::new(
        source,
        0,
        config.loader.num_workers,
        config.loader.prefetch_factor,
    );
    let gpt = gpt_config(config, tokenizer.vocab_size());
    let device = choice.device.clone().autodiff();
    device.seed(t.seed);
    let mut model = gpt.init(&device);
    let mut optim = AdamW::new(AdamWConfig {
        beta1: t.beta1,
        beta2: t.beta2,
        eps: t.eps,
        weight_decay: t.weight_decay,
    });
    let sync = || {
        let _ = device.sync();
    };
    let mut memory = MemoryTracker::new();
    let mut step_s = Vec::new();
    let mut phases: [Vec<f64>; 5] = Default::default();
    let mut final_loss = f64::NAN;
    for i in 0..options.warmup + options.steps {
        let start = Instant::now();
        let loaded = loader.next_batch();
        let t_data = loaded.wait.as_secs_f64();
        let t0 = Instant::now();
        let (x, y) = batch_tensors(&loaded.batch, &device);
        sync();
        let t1 = Instant::now();
        let loss = model.loss(x, y);
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
        final_loss = f64::from(loss.into_scalar::<f32>());
        let t4 = Instant::now();
        if i >= options.warmup {
            step_s.push(start.elapsed().as_secs_f64());
            for (list, v) in phases.iter_mut().zip([
                t_data,
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                (t3 - t2).as_secs_f64(),
                (t4 - t3).as_secs_f64(),
            ]) {
                list.push(v * 1e3);
            }
        }
    }
    let (_, peak_memory) = memory.sample();
    let tokens_per_step = t.batch_size * block;
    let mut tps: Vec<f64> = step_s.iter().map(|s| tokens_per_step as f64 / s).collect();
    let mut ms: Vec<f64> = step_s.iter().map(|s| s * 1e3).collect();
    let total: f64 = step_s.iter().sum();
    let waited: f64 = phases[0].iter().sum::<f64>() / 1e3;
    let tokens_per_s_median = median(&mut tps);
    let (peak, mfu_peak) = match hardware.cpu.peak.fp32_flops {
        Some(p) if !choice.is_gpu => (Some(p), format!("CPU fp32 {}", hardware.cpu.peak.how)),
        _ => (None, "unknown".to_string()),
    };
    let [mut d, mut h, mut f, mut b, mut o] = phases;
    Ok(BenchResult {
        workload: "lm",
        backend: choice.name,
        warmup_steps: options.warmup,
        timed_steps: options.steps,
        tokens_per_step,
        tokens_per_s_median,
        tokens_per_s_min: tps.first().copied().unwrap_or(0.0),
        tokens_per_s_max: tps.last().copied().unwrap_or(0.0),
        ms_per_step_median: median(&mut ms),
        mfu: peak.map(|p| gpt.flops_per_token() * tokens_per_s_median / p),
        mfu_peak,
        flops_per_token: gpt.flops_per_token(),
        parameters: gpt.num_params(),
        data_wait_pct: if total > 0.0 {
            100.0 * waited / total
        } else {
            0.0
        },
        peak_memory_bytes: peak_memory,
        phases: PhaseTimes {
            data_wait_ms: median(&mut d),
            host_to_device_ms: median(&mut h),
            forward_ms: median(&mut f),
            backward_ms: median(&mut b),
            optimizer_ms: median(&mut o),
        },
        final_loss,
    })
}
