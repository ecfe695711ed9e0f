//! What every workload sets up the same way before its first step: the
//! training device and the model's first weights, the precision, the peak
//! MFU counts against, and the start-of-run lines about them.

use burn::module::Module;
use burn::tensor::Device;
use kiln_config::RunConfig;
use kiln_hwdetect::{CpuInfo, CpuPeak, HardwareReport, IsaFeatures};
use kiln_model::ComputeDtype;
use kiln_plan::{AttentionMemory, LogitsMemory, ModelSize, estimate_memory_with, run_gpu};

use crate::params::param_entries;
use crate::precision::{LossScaler, PrecisionChoice};
use crate::{DeviceChoice, TrainError, TrainOptions};

/// The device a model trains on: `inner` with autodiff (and gradient
/// checkpointing when the config asks), its RNG seeded with `seed`.
pub(crate) fn train_device(config: &RunConfig, inner: &Device, seed: u64) -> Device {
    let mut device = inner.clone().autodiff();
    if config.model.gradient_checkpointing {
        device = device.gradient_checkpointing();
    }
    device.seed(seed);
    device
}

/// Builds a model whose initial weights depend on `seed` alone, not on the
/// device or on what draws from the device's RNG later. Burn initialises a
/// parameter lazily, at its first use: left alone, the draw would happen in
/// the first training step, after the loop has reseeded the RNG for that
/// step, and a model drawn on the CPU and copied over would not match. So
/// every parameter is materialised here; on any other device than flex
/// (a GPU, Burn's CubeCL CPU) the values are drawn on flex,
/// seeded as `device` is, and copied over, so a wgpu, CUDA or cubecl-cpu
/// run starts from the weights a flex run of the same seed starts from, and
/// the two can be compared step by step.
pub(crate) fn init_model<M: Module>(
    config: &RunConfig,
    device: &Device,
    seed: u64,
    init: impl Fn(&Device) -> M,
) -> M {
    #[cfg(feature = "flex")]
    if !crate::device::is_flex(device) {
        let cpu = train_device(config, &Device::flex(), seed);
        let values = crate::params::param_values(&init(&cpu))
            .into_iter()
            .map(|(path, shape, v)| (path, (shape, v)))
            .collect();
        // Same model, same paths: loading cannot fail; if it did, the
        // device's own draw is still a valid start.
        if let Ok(model) = crate::params::load_values(init(device), values, device) {
            return model;
        }
    }
    let _ = (config, seed);
    let model = init(device);
    // Visiting reads every parameter, which materialises it now, in order.
    let _ = param_entries(&model);
    model
}

/// The peak FLOP/s MFU is counted against on this device for the dtype the
/// products compute in, and where it came from: on a CubeCL GPU measured by
/// Burn's `performance_stats` (cached by CubeCL), else kiln-hwdetect's table
/// for the GPU and dtype; on flex the fp32 rate of its matrix products,
/// measured ([`kiln_model::kernels::measure_fp32_peak`]: the clock's
/// estimate is below what boosting cores do, and MFU read over 100 %), on
/// another CPU backend kiln-hwdetect's estimate (flex converts bf16/fp16
/// products to f32, so fp32 is their ceiling too). Mixed
/// precision counts against the bf16/fp16 peak, as the guides count MFU.
pub(crate) fn mfu_peak(
    config: &RunConfig,
    device: &DeviceChoice,
    precision: &PrecisionChoice,
    hardware: &HardwareReport,
) -> (Option<f64>, String) {
    let dtype = precision.compute.name();
    if device.is_gpu {
        #[cfg(feature = "gpu")]
        if let Some(p) = crate::precision::measured_peak(&device.device, precision.compute) {
            return (
                Some(p),
                format!(
                    "{} {dtype} of {}, measured by Burn's performance_stats (cached by CubeCL)",
                    flops_rate(p),
                    device.name
                ),
            );
        }
        let Some(gpu) = run_gpu(config, hardware) else {
            return (
                None,
                format!(
                    "no peak: {} reported none and it is not an NVIDIA GPU kiln knows",
                    device.name
                ),
            );
        };
        let (Some(peak), Some(source)) = (&gpu.peak, &gpu.peak_source) else {
            return (
                None,
                format!("no peak: the {} is not in kiln's table", gpu.name),
            );
        };
        let value = match precision.compute {
            ComputeDtype::F32 => Some(peak.fp32),
            ComputeDtype::Bf16 => peak.bf16,
            ComputeDtype::F16 => peak.fp16,
        };
        return match value {
            Some(p) => (
                Some(p),
                format!(
                    "{} {dtype} of the {} ({source}; not measured on this device)",
                    flops_rate(p),
                    gpu.name
                ),
            ),
            None => (
                None,
                format!(
                    "no peak: kiln's table has no {dtype} figure for the {}",
                    gpu.name
                ),
            ),
        };
    }
    let peak = cpu_peak_of_build(&hardware.cpu);
    let reduced = if precision.compute.is_reduced() {
        " (flex computes bf16/fp16 products in f32, so this is their ceiling too)"
    } else {
        ""
    };
    if let Some(measured) = device.is_flex().then(measured_cpu_peak).flatten() {
        let estimate = match peak.fp32_flops {
            Some(p) => format!("{:.1} GFLOP/s", p / 1e9),
            None => "unknown".into(),
        };
        return (
            Some(measured.flops),
            format!(
                "{}, in this process{reduced}; the clock's estimate: {estimate}",
                measured.describe()
            ),
        );
    }
    match peak.fp32_flops {
        Some(p) => (
            Some(p),
            format!("{:.1} GFLOP/s fp32, the CPU {}{reduced}", p / 1e9, peak.how),
        ),
        None => (None, format!("unknown ({})", peak.how)),
    }
}

/// The fp32 rate of flex's matrix products on this machine, measured once
/// a process (a run's folds and a bench share it): what MFU on flex counts
/// against (`kiln check-hardware` shows it beside the clock's estimate).
/// `None` in a build without flex. The measurement is timed against this
/// CPU's clock estimate (detected here, not read from a hardware report),
/// and again for up to a second where it falls well short of it.
pub fn measured_cpu_peak() -> Option<kiln_model::kernels::MeasuredPeak> {
    #[cfg(feature = "flex")]
    {
        static PEAK: std::sync::OnceLock<kiln_model::kernels::MeasuredPeak> =
            std::sync::OnceLock::new();
        Some(*PEAK.get_or_init(|| {
            let cpu = kiln_hwdetect::detect_cpu();
            let estimate = cpu_peak_of_build(&cpu).fp32_flops.map(|flops| {
                kiln_model::kernels::ClockEstimate {
                    flops,
                    cores: cpu.peak_cores(),
                }
            });
            kiln_model::kernels::measure_fp32_peak(estimate)
        }))
    }
    #[cfg(not(feature = "flex"))]
    None
}

/// The CPU's peak for the kernels this build has: on an AVX-512 CPU, a
/// build without kiln-model's `avx512` feature runs AVX2 + FMA kernels, so
/// its estimate is the AVX2 peak (what MFU counts against on a CPU backend
/// other than flex, and the figure beside flex's measured rate).
fn cpu_peak_of_build(cpu: &CpuInfo) -> CpuPeak {
    if !cpu.features.avx512f || kiln_model::kernels::AVX512_BUILT {
        return cpu.peak.clone();
    }
    let mut peak = cpu.peak_with(&IsaFeatures {
        avx512f: false,
        avx512_bf16: false,
        ..cpu.features
    });
    peak.how
        .push_str(" (this build has no AVX-512 kernels: built without kiln's `avx512` feature)");
    peak
}

/// A peak in TFLOP/s, or GFLOP/s below one TFLOP/s (software devices).
fn flops_rate(flops: f64) -> String {
    if flops >= 1e12 {
        format!("{:.1} TFLOP/s", flops / 1e12)
    } else {
        format!("{:.1} GFLOP/s", flops / 1e9)
    }
}

/// The precision a run computes in on its device, and why.
pub(crate) fn run_precision(
    c: &RunConfig,
    device: &DeviceChoice,
    hardware: &HardwareReport,
) -> PrecisionChoice {
    crate::precision::choose_precision(&c.precision, device, run_gpu(c, hardware))
}

/// Refuses `optimization.attention = "flash"` where FlashAttention on the
/// matrix unit cannot run: Burn's composition asked for
/// (`optimization.kernels = "reference"`), products in f32, or a device
/// without a matrix instruction for the dtype and the heads' width
/// (`kiln_model::kernels::attention_on_tensor_cores`). Every other choice
/// runs anywhere, with `model.attention_dropout` or without (kiln's
/// kernels drop the probabilities out themselves): `auto` takes the best
/// there is.
pub(crate) fn check_attention_choice(
    c: &RunConfig,
    device: &DeviceChoice,
    precision: &PrecisionChoice,
) -> Result<(), TrainError> {
    use kiln_config::AttentionChoice;
    if c.optimization.attention != AttentionChoice::Flash {
        return Ok(());
    }
    let compute = precision.compute;
    let head_dim = c.model.hidden / c.model.heads.max(1);
    let why = if c.optimization.kernels == kiln_config::KernelChoice::Reference {
        "optimization.kernels = \"reference\" runs Burn's composition of attention".to_string()
    } else if !compute.is_reduced() {
        format!(
            "the run computes in f32 ({}), and the matrix-unit kernels take bf16 or fp16 (precision.amp = true on a GPU that has them)",
            precision.why
        )
    } else if kiln_model::kernels::attention_on_tensor_cores(
        &device.device,
        compute.float_dtype().into(),
        head_dim,
    ) {
        return Ok(());
    } else {
        format!(
            "{} has no matrix instruction (tensor cores, Vulkan's cooperative matrices) that kiln's kernels can use for {} with heads {head_dim} wide (model.hidden / model.heads: a multiple of the instruction's 8 or 16)",
            device.name,
            compute.name()
        )
    };
    Err(TrainError::FlashAttentionNotHere { why })
}

/// The precision line's words on TF32 for a GPU that has it: which f32
/// products `precision.tf32` decides (cuBLAS's, with `matmul` `cublas`),
/// and that CubeCL's autotune decides Burn's.
fn tf32_note(gpu: &str, matmul: kiln_config::MatmulChoice, tf32: bool) -> String {
    let cublas = match (matmul, tf32) {
        (kiln_config::MatmulChoice::Cublas, true) => {
            "cuBLAS's f32 products use it (precision.tf32 = true), and "
        }
        (kiln_config::MatmulChoice::Cublas, false) => {
            "cuBLAS's f32 products do not (precision.tf32 = false), but "
        }
        (kiln_config::MatmulChoice::Burn, _) => "",
    };
    let whose = if cublas.is_empty() {
        "its"
    } else {
        "the other"
    };
    format!(
        "; TF32: the {gpu} has it; {cublas}CubeCL's matmul autotuner may pick TF32 tensor-core kernels for {whose} f32 products whatever precision.tf32 says"
    )
}

/// Start lines about the device, precision, compile, loader and MFU.
pub(crate) fn device_lines(
    c: &RunConfig,
    device: &DeviceChoice,
    precision: &PrecisionChoice,
    options: &TrainOptions,
    peak_name: &str,
) -> Vec<String> {
    let tf32 = match (device.is_gpu, run_gpu(c, &options.hardware)) {
        (true, Some(gpu)) if gpu.capabilities.tf32 => {
            tf32_note(&gpu.name, c.optimization.matmul, c.precision.tf32)
        }
        (true, _) => "; TF32: not on this device".to_string(),
        (false, _) => String::new(),
    };
    let mut lines = vec![
        format!("backend: {} — {}", device.name, device.why),
        format!("precision: {} — {}{tf32}", precision.label, precision.why),
        device.compile.clone(),
        format!(
            "loader: {} worker thread{}, {} batches ahead each",
            c.loader.num_workers,
            if c.loader.num_workers == 1 { "" } else { "s" },
            c.loader.prefetch_factor
        ),
        format!("MFU is measured against {peak_name}"),
        match (device.is_gpu, run_gpu(c, &options.hardware)) {
            (true, Some(gpu)) => format!("device: {}", gpu.name),
            _ => {
                let cores = options.hardware.cpu.logical_cores;
                // flex's pool: fewer than the cores where ranks share them
                // (`kiln launch` splits them) or RAYON_NUM_THREADS says so.
                match measured_cpu_peak().filter(|_| device.is_flex()) {
                    Some(p) if p.threads < cores => {
                        format!("threads: {} of the {cores} cores for compute", p.threads)
                    }
                    _ => format!("threads: {cores} cores for compute"),
                }
            }
        },
    ];
    if precision.loss_scaling() {
        lines.push(format!(
            "loss scaling: dynamic, from {} (×2 after {} clean steps, ×0.5 and the step skipped on overflow)",
            LossScaler::INITIAL,
            LossScaler::GROWTH_INTERVAL
        ));
    }
    if c.model.gradient_checkpointing {
        lines.push("gradient checkpointing: on (activations recomputed in backward)".into());
    }
    if c.optimization.matmul == kiln_config::MatmulChoice::Cublas {
        lines.push(
            "matrix products: cuBLAS (the linear layers' in bf16/fp16, forward and backward)"
                .into(),
        );
    }
    lines
}

/// The schedule, in one line.
pub(crate) fn schedule_line(c: &RunConfig, schedule: &kiln_plan::Schedule) -> String {
    let t = &c.training;
    let mut extra = String::new();
    if t.layer_lr_decay != 1.0 {
        extra += &format!(
            ", layer-wise lr decay {}: the top block at ×{}, the embeddings at ×{}",
            t.layer_lr_decay,
            t.layer_lr_decay,
            three_digits(t.layer_lr_decay.powi(c.model.layers as i32 + 1))
        );
    }
    if t.label_smoothing != 0.0 {
        extra += &format!(", label smoothing {}", t.label_smoothing);
    }
    format!(
        "schedule: {} steps, AdamW lr {} (warm-up {}{}, {}), β {}/{}, weight decay {} on matrices, clip {}{extra}",
        schedule.total_steps,
        t.learning_rate,
        schedule.warmup_steps,
        if t.warmup_ratio > 0.0 {
            format!(": training.warmup_ratio {}", t.warmup_ratio)
        } else {
            String::new()
        },
        match t.lr_schedule {
            kiln_config::LrSchedule::Cosine => format!("cosine to {}", t.min_lr),
            kiln_config::LrSchedule::Linear => format!("linear to {}", t.min_lr),
            kiln_config::LrSchedule::Constant => "then constant".to_string(),
            kiln_config::LrSchedule::Wsd => format!(
                "then constant, linear to {} over the last {} steps",
                t.min_lr,
                schedule.decay_steps()
            ),
        },
        t.beta1,
        t.beta2,
        t.weight_decay,
        t.grad_clip
    )
}

/// Start lines that warn of a schedule the config does not fit (an
/// evaluation, logging or warm-up longer than the run:
/// [`kiln_plan::check_schedule`]'s warnings, as `kiln diagnose` gives
/// them), each with its fix. The run goes on as configured.
pub(crate) fn schedule_warnings(c: &RunConfig, schedule: &kiln_plan::Schedule) -> Vec<String> {
    kiln_plan::check_schedule(c, schedule)
        .into_iter()
        .filter(|f| f.severity >= kiln_plan::Severity::Warning)
        .map(|f| format!("warning: {}; fix: {}", f.problem, f.fix))
        .collect()
}

/// `x` (positive) to three significant digits, without trailing zeros:
/// 0.8¹³ is "0.055", 0.1² is "0.01".
fn three_digits(x: f64) -> String {
    let decimals = (2 - x.log10().floor() as i32).max(0) as usize;
    let text = format!("{x:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// The device a run trains on: [`select_device`] for `config.device`, with
/// `optimization.compile` applied to CubeCL first (its configuration must be
/// in place before the device's first kernel).
pub fn open_device(
    config: &kiln_config::RunConfig,
    gpu: Option<kiln_hwdetect::GpuVendor>,
) -> Result<DeviceChoice, TrainError> {
    let mut probe = crate::device::select_device(&config.device, gpu)?;
    set_matmul(config, &probe.device)?;
    let compile = crate::compile::apply_compile(&config.optimization, &probe);
    // wgpu's kernel language, once CubeCL's configuration is in place: it
    // is the adapter's and the build's (`vulkan`) to settle.
    if let Some(language) = kiln_model::gpu_runtime(&probe.device).and_then(wgpu_language) {
        probe.name = format!("wgpu (GPU, {language})");
    }
    Ok(DeviceChoice { compile, ..probe })
}

/// Applies `optimization.matmul` to this process
/// (`kiln_model::kernels::set_gpu_matmul`), refusing `cublas` where cuBLAS
/// cannot run on `device` (exit 2, saying why).
fn set_matmul(
    config: &kiln_config::RunConfig,
    device: &kiln_model::burn::tensor::Device,
) -> Result<(), TrainError> {
    use kiln_model::kernels::{GpuMatmul, cublas_unavailable, set_gpu_matmul, set_tf32};
    let choice = match config.optimization.matmul {
        kiln_config::MatmulChoice::Burn => GpuMatmul::Burn,
        kiln_config::MatmulChoice::Cublas => {
            if let Some(why) = cublas_unavailable(device) {
                return Err(TrainError::CublasNotHere { why });
            }
            GpuMatmul::Cublas
        }
    };
    set_gpu_matmul(choice);
    set_tf32(config.precision.tf32);
    Ok(())
}

/// The kernel language of a wgpu runtime named as CubeCL names it
/// (`wgpu<spirv>`): "SPIR-V", "WGSL", "MSL"; `None` for the others.
fn wgpu_language(runtime: &str) -> Option<&'static str> {
    match runtime {
        "wgpu<spirv>" => Some("SPIR-V"),
        "wgpu<wgsl>" => Some("WGSL"),
        "wgpu<msl>" => Some("MSL"),
        _ => None,
    }
}

/// What the step keeps of attention and of the LM head's logits on
/// `device`, computing in `compute`: the estimate's two choices.
pub(crate) fn kept_memory(
    config: &RunConfig,
    device: &DeviceChoice,
    compute: kiln_model::ComputeDtype,
) -> (AttentionMemory, LogitsMemory) {
    let kernels = crate::translate::kernels(config);
    let choice = kernels.attention(crate::translate::attention(config));
    let attention = if kiln_model::kernels::attention_keeps_scores(&device.device, compute, choice)
    {
        AttentionMemory::Scores
    } else {
        AttentionMemory::LogSumExp
    };
    let logits = if kiln_model::kernels::lm_head_keeps_logits(&device.device, kernels) {
        LogitsMemory::All
    } else {
        LogitsMemory::Chunks {
            elements: kiln_model::kernels::LM_HEAD_CHUNK_ELEMENTS as u64,
        }
    };
    (attention, logits)
}

/// `kiln train`'s and `kiln resume`'s refusal, before the run directory is
/// touched, of a run on the CPU whose step needs over twice the memory the
/// machine has available, by diagnose's estimate, with diagnose's fix.
/// Without it the operating system's OOM killer ended the run
/// (`training.batch_size=100000` on 24 GiB: killed after 43 s, the
/// machine's memory full). Twice: the estimate counts more than flex's
/// kernels keep at large batches (the default GPT at batch 3000: 12.2 GiB
/// estimated, a 7.1 GiB peak), so a step estimated between one and two
/// times the RAM may fit, and is left to run. Not on a GPU, where a failed
/// allocation is the run's error (exit 2, checkpoints kept), not the
/// machine's, and the estimate has not been checked against a GPU's peak;
/// not with `force`.
pub(crate) fn refuse_over_memory(
    config: &RunConfig,
    device: &DeviceChoice,
    hardware: &HardwareReport,
    (vocab, size): (usize, ModelSize),
    force: bool,
) -> Result<(), TrainError> {
    if device.is_gpu || force {
        return Ok(());
    }
    let compute = run_precision(config, device, hardware).compute;
    let (attention, logits) = kept_memory(config, device, compute);
    let mut memory = estimate_memory_with(config, vocab, size, attention, logits);
    memory.available = hardware.memory.available_bytes;
    memory.available_what = "available RAM".to_string();
    // 0: the memory could not be read; nothing to hold the estimate to.
    let over = |bytes: u64| memory.available > 0 && bytes > memory.available.saturating_mul(2);
    let finding = if over(memory.total) {
        kiln_plan::memory_finding(config, &memory)
    } else if over(memory.eval) {
        kiln_plan::eval_memory_finding(config, &memory)
    } else {
        None
    };
    match finding {
        Some(f) => Err(TrainError::OverMemory {
            key: f.key,
            problem: f.problem,
            fix: f.fix,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_decay_factors_are_written_to_three_digits() {
        assert_eq!(three_digits(0.8f64.powi(13)), "0.055");
        assert_eq!(three_digits(0.9f64.powi(25)), "0.0718");
        assert_eq!(three_digits(0.1f64.powi(2)), "0.01");
        assert_eq!(three_digits(0.9), "0.9");
        assert_eq!(three_digits(1.0), "1");
    }

    #[test]
    fn the_tf32_line_says_which_products_precision_tf32_decides() {
        use kiln_config::MatmulChoice;
        let burn = tf32_note("H200", MatmulChoice::Burn, true);
        assert!(!burn.contains("cuBLAS"), "{burn}");
        assert!(burn.contains("the H200 has it"), "{burn}");
        assert!(burn.contains("for its f32 products"), "{burn}");
        let on = tf32_note("H200", MatmulChoice::Cublas, true);
        assert!(on.contains("cuBLAS's f32 products use it"), "{on}");
        assert!(on.contains("for the other f32 products"), "{on}");
        let off = tf32_note("H200", MatmulChoice::Cublas, false);
        assert!(
            off.contains("cuBLAS's f32 products do not (precision.tf32 = false)"),
            "{off}"
        );
    }

    #[test]
    fn wgpu_runtimes_name_their_kernel_language() {
        assert_eq!(wgpu_language("wgpu<spirv>"), Some("SPIR-V"));
        assert_eq!(wgpu_language("wgpu<wgsl>"), Some("WGSL"));
        assert_eq!(wgpu_language("wgpu<msl>"), Some("MSL"));
        assert_eq!(wgpu_language("cuda"), None);
    }

    #[test]
    fn an_avx512_cpu_counts_the_peak_of_the_kernels_built() {
        let mut cpu = kiln_hwdetect::detect_cpu();
        cpu.vendor = "GenuineIntel".into();
        cpu.family = Some(6);
        cpu.frequency_mhz = Some(2000);
        cpu.features = IsaFeatures {
            avx: true,
            avx2: true,
            fma: true,
            avx512f: true,
            ..IsaFeatures::default()
        };
        cpu.peak = cpu.peak_with(&cpu.features);
        let peak = cpu_peak_of_build(&cpu);
        if kiln_model::kernels::AVX512_BUILT {
            assert_eq!(peak, cpu.peak);
        } else {
            // AVX2's 32 FLOP/cycle against AVX-512's 64 on this Intel core.
            assert_eq!(peak.fp32_flops, cpu.peak.fp32_flops.map(|p| p / 2.0));
            assert!(peak.how.contains("no AVX-512 kernels"), "{}", peak.how);
        }
        // A CPU without AVX-512 keeps its own peak in either build.
        cpu.features.avx512f = false;
        cpu.peak = cpu.peak_with(&cpu.features);
        assert_eq!(cpu_peak_of_build(&cpu), cpu.peak);
    }

    #[test]
    fn initial_weights_come_from_the_seed_not_the_first_step() {
        let _rng = crate::tests::flex_rng();
        let config = crate::tests::config(&[]);
        let gpt = kiln_model::GptConfig::new(11, 8, 1, 2, 8).with_intermediate(16);
        let draw = |reseed: bool| {
            let device = train_device(&config, &Device::flex(), 7);
            let model = init_model(&config, &device, 7, |d| gpt.init(d));
            if reseed {
                // What the loop does before each step.
                device.seed(12345);
            }
            crate::params::param_values(&model)
        };
        assert_eq!(draw(false), draw(true));
    }
}
