//! `kiln bench attention`: the model's self-attention alone, at the
//! configured shape (micro-batch × `model.max_length`, `model.heads` heads
//! of `model.hidden / model.heads`; causal for the GPT, not for the
//! encoder, and no padding) and compute dtype,
//! forward and forward + backward, with each implementation the device has
//! (`optimization.attention`: `flash`, `memory-efficient`, `math`): the
//! kernel-level figure a whole step's profile only gives as a share, and
//! the one FlashAttention's own benchmarks report (TFLOP/s by its count,
//! causal halved), so that `bench/pytorch_attention.py` at the same shape
//! gives the ratio against PyTorch's `scaled_dot_product_attention`.

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use kiln_config::RunConfig;
use kiln_hwdetect::HardwareReport;
use kiln_model::AttentionKernel;
use kiln_model::kernels::{AttentionRoute, attention_route, self_attention};
use serde::Serialize;

use crate::TrainError;
use crate::bench::{BenchOptions, bench_device};

/// One implementation's times.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionRow {
    /// The `optimization.attention` value that selects it.
    pub attention: &'static str,
    /// What runs, in words ([`AttentionRoute::describe`]).
    pub runs: &'static str,
    /// Why it did not run here, where it did not (then no times).
    pub skipped: Option<String>,
    /// The calls timed of each pass, forward and forward + backward:
    /// `--steps`, or more to fill `--min-seconds`.
    pub calls: Option<[usize; 2]>,
    /// Milliseconds a forward pass (the mean over the timed calls).
    pub forward_ms: Option<f64>,
    /// Milliseconds a forward and backward pass (the gradient of the
    /// packed projection).
    pub forward_backward_ms: Option<f64>,
    /// The forward pass's rate, by [`AttentionBenchResult::forward_flops`].
    pub forward_tflops: Option<f64>,
    /// The backward pass's rate (`forward_backward_ms − forward_ms`), by
    /// [`AttentionBenchResult::backward_flops`].
    pub backward_tflops: Option<f64>,
}

/// What `kiln bench attention` measured.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionBenchResult {
    /// The device ("cuda (GPU 0)", "flex (CPU)").
    pub backend: String,
    /// The compute dtype the tensors are in ("bf16", "f32").
    pub dtype: String,
    /// Sequences a call (`training.batch_size`, the micro-batch).
    pub batch: usize,
    /// Tokens a sequence (`model.max_length`).
    pub seq: usize,
    /// Heads (`model.heads`).
    pub heads: usize,
    /// Each head's width (`model.hidden / model.heads`).
    pub head_dim: usize,
    /// Query `i` sees keys `≤ i` (the GPT's mask; not the encoder's).
    pub causal: bool,
    /// Untimed calls of each pass first (`--warmup`)...
    pub warmup: usize,
    /// ...then at least this many timed ones (`--steps`; more where
    /// `--min-seconds` asks: each row's `calls`).
    pub calls: usize,
    /// FlashAttention's count: `4 · batch · heads · seq² · head_dim`, halved
    /// when causal (the two products; the softmax not counted).
    pub forward_flops: f64,
    /// 2.5 × the forward's (five products, as FlashAttention-2 counts).
    pub backward_flops: f64,
    /// One row for each of `flash`, `memory-efficient`, `math`.
    pub rows: Vec<AttentionRow>,
}

/// FlashAttention's FLOP count of one forward pass.
fn forward_flops(batch: usize, seq: usize, heads: usize, head_dim: usize, causal: bool) -> f64 {
    let full = 4.0 * (batch * heads * head_dim) as f64 * (seq as f64) * (seq as f64);
    if causal { full / 2.0 } else { full }
}

/// Times the configured model's self-attention alone; see the module's
/// documentation. `options.warmup` untimed calls of each pass, then
/// `options.steps` timed ones (at least one), more until they add up to
/// `options.min_seconds`.
pub fn bench_attention(
    config: &RunConfig,
    hardware: &HardwareReport,
    options: BenchOptions,
) -> Result<AttentionBenchResult, TrainError> {
    let (choice, device, precision) = bench_device(config, hardware, options)?;
    let m = &config.model;
    let (batch, seq, heads) = (config.training.batch_size, m.max_length, m.heads.max(1));
    let head_dim = m.hidden / heads;
    // The GPT's mask; the encoder's attention sees every key.
    let causal = config.workload == kiln_config::Workload::Lm;
    let calls = options.steps.max(1);
    let dtype = precision.compute.float_dtype();
    // Drawn once, for every implementation.
    let qkv = Tensor::<3>::random(
        [batch, seq, 3 * heads * head_dim],
        Distribution::Normal(0.0, 1.0),
        &device,
    )
    .cast(dtype);
    let flops = forward_flops(batch, seq, heads, head_dim, causal);
    let sync = || {
        let _ = device.sync();
    };
    // Mean milliseconds a call of `pass` and the calls timed: after the
    // warm-up ones, `calls` calls, then as many again until they add up
    // to `options.min_seconds` (up to 50 × `calls`), each batch between
    // two synchronisations.
    let time = |pass: &dyn Fn()| {
        for _ in 0..options.warmup {
            pass();
        }
        sync();
        let (mut timed, mut seconds) = (0, 0.0);
        while timed == 0 || (seconds < options.min_seconds && timed < 50 * calls) {
            let start = Instant::now();
            for _ in 0..calls {
                pass();
            }
            sync();
            seconds += start.elapsed().as_secs_f64();
            timed += calls;
        }
        (seconds * 1e3 / timed as f64, timed)
    };
    let mut rows = Vec::new();
    for (name, kernel) in [
        ("flash", AttentionKernel::Flash),
        ("memory-efficient", AttentionKernel::MemoryEfficient),
        ("math", AttentionKernel::Math),
    ] {
        let route = attention_route(&qkv, heads, kernel);
        let skipped = match (kernel, route) {
            (AttentionKernel::Flash, r)
                if !matches!(r, AttentionRoute::MatrixUnit | AttentionRoute::Registers) =>
            {
                Some(format!(
                    "{} has no matrix instruction kiln's kernels use for {} with heads {head_dim} wide",
                    choice.name,
                    precision.compute.name()
                ))
            }
            (AttentionKernel::MemoryEfficient, AttentionRoute::Burn) => Some(format!(
                "kiln has no memory-efficient kernel for {} on {}",
                precision.compute.name(),
                choice.name
            )),
            _ => None,
        };
        let mut row = AttentionRow {
            attention: name,
            runs: route.describe(),
            skipped,
            calls: None,
            forward_ms: None,
            forward_backward_ms: None,
            forward_tflops: None,
            backward_tflops: None,
        };
        if row.skipped.is_none() {
            let (forward, forward_calls) = time(&|| {
                drop(self_attention(qkv.clone(), heads, None, causal, kernel));
            });
            let (both, both_calls) = time(&|| {
                let x = qkv.clone().require_grad();
                drop(self_attention(x, heads, None, causal, kernel).backward());
            });
            row.forward_ms = Some(forward);
            row.forward_backward_ms = Some(both);
            row.calls = Some([forward_calls, both_calls]);
            row.forward_tflops = Some(flops / (forward * 1e-3) / 1e12);
            let backward = both - forward;
            row.backward_tflops = (backward > 0.0).then(|| 2.5 * flops / (backward * 1e-3) / 1e12);
        }
        rows.push(row);
    }
    Ok(AttentionBenchResult {
        backend: choice.name.clone(),
        dtype: precision.compute.name().to_string(),
        batch,
        seq,
        heads,
        head_dim,
        causal,
        warmup: options.warmup,
        calls,
        forward_flops: flops,
        backward_flops: 2.5 * flops,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_are_flash_attentions_count() {
        // GPT-2 small's micro-batch: 16 × 1024, 12 heads of 64, causal:
        // 25.8 GFLOP forward (docs/PERFORMANCE.md's figure for a layer).
        let f = forward_flops(16, 1024, 12, 64, true);
        assert_eq!(f, 4.0 * 16.0 * 12.0 * 64.0 * 1024.0 * 1024.0 / 2.0);
        assert!((f / 1e9 - 25.77).abs() < 0.01, "{f}");
        assert_eq!(forward_flops(1, 8, 1, 4, false), 4.0 * 4.0 * 64.0);
    }
}
