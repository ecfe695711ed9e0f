//! The precision a run computes in, and fp16's dynamic loss scaling.
//!
//! The machine's capabilities decide first ([`kiln_config::effective_precision`]:
//! bf16 from Ampere on, else fp16, the guides' T4 rule); then the Burn
//! device itself is asked (`Device::supports_dtype`), since a backend may
//! lack a dtype the chip has (wgpu has no bf16). Parameters and optimizer
//! state stay f32 whatever is chosen; see [`kiln_model::precision`].

use burn::tensor::FloatDType;
use kiln_config::{AmpDtype, EffectivePrecision, PrecisionSection};
use kiln_hwdetect::GpuInfo;
use kiln_model::ComputeDtype;

use crate::DeviceChoice;

/// What a run computes in, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct PrecisionChoice {
    /// The dtype of the products; the weights stay f32.
    pub compute: ComputeDtype,
    /// "bf16 compute, f32 master weights", "f32", ...
    pub label: String,
    /// Why: the configuration, or what the device supports.
    pub why: String,
}

impl PrecisionChoice {
    /// fp16 needs dynamic loss scaling to keep small gradients from flushing to zero.
    pub fn loss_scaling(&self) -> bool {
        self.compute == ComputeDtype::F16
    }
}

fn compute_of(amp: AmpDtype) -> ComputeDtype {
    match amp {
        AmpDtype::Bf16 => ComputeDtype::Bf16,
        AmpDtype::Fp16 => ComputeDtype::F16,
    }
}

/// The precision for `precision` on `device`. `gpu` is the NVIDIA GPU the
/// hardware report found for it, if any (its compute capability decides
/// first); `supports` answers whether the Burn device computes in a dtype.
pub fn choose_precision_with(
    precision: &PrecisionSection,
    device: &DeviceChoice,
    gpu: Option<&GpuInfo>,
    supports: impl Fn(FloatDType) -> bool,
) -> PrecisionChoice {
    let gpu = gpu.filter(|_| device.is_gpu);
    let hw = if device.is_gpu && gpu.is_none() && precision.amp {
        // A GPU without a capability table (not NVIDIA, or llvmpipe): the
        // device's own answer below decides.
        EffectivePrecision {
            compute: Some(precision.amp_dtype),
            label: String::new(),
            why: format!(
                "precision.amp_dtype = {}; no NVIDIA capability table for this device, so {} decides",
                precision.amp_dtype.name(),
                device.name
            ),
        }
    } else {
        kiln_config::effective_precision(precision, gpu)
    };
    let Some(mut amp) = hw.compute else {
        return PrecisionChoice {
            compute: ComputeDtype::F32,
            label: hw.label,
            why: hw.why,
        };
    };
    let mut why = hw.why;
    if amp == AmpDtype::Bf16 && !supports(FloatDType::BF16) {
        amp = AmpDtype::Fp16;
        why = format!("{why}; {} has no bf16 → fp16", device.name);
    }
    if amp == AmpDtype::Fp16 && !supports(FloatDType::F16) {
        why = format!("{why}; {} has no fp16 either → f32", device.name);
        return PrecisionChoice {
            compute: ComputeDtype::F32,
            label: EffectivePrecision::label_for(None),
            why,
        };
    }
    // Keep the hardware label's TF32 note where the dtype did not change.
    let label = if hw
        .label
        .starts_with(&EffectivePrecision::label_for(Some(amp)))
    {
        hw.label
    } else {
        EffectivePrecision::label_for(Some(amp))
    };
    PrecisionChoice {
        compute: compute_of(amp),
        label,
        why,
    }
}

/// [`choose_precision_with`] asking the device itself what it supports.
pub fn choose_precision(
    precision: &PrecisionSection,
    device: &DeviceChoice,
    gpu: Option<&GpuInfo>,
) -> PrecisionChoice {
    choose_precision_with(precision, device, gpu, |dtype| {
        device.device.supports_dtype(dtype)
    })
}

/// The device's peak FLOP/s for `compute`, measured by CubeCL's throughput
/// probes (`Device::performance_stats`): the better of its tensor-core
/// (16×16×16 tiles, f32 accumulators) and plain kernels. CubeCL keeps the
/// measurement in its on-disk cache (see [`crate::apply_compile`]), so a
/// machine pays for it once. `None` where the device reports none.
#[cfg(feature = "gpu")]
pub(crate) fn measured_peak(device: &burn::tensor::Device, compute: ComputeDtype) -> Option<f64> {
    use cubecl_ir::{ElemType, FloatKind};
    use cubecl_runtime::throughput::compute_throughput_key;
    let kind = match compute {
        ComputeDtype::F32 => FloatKind::F32,
        ComputeDtype::Bf16 => FloatKind::BF16,
        ComputeDtype::F16 => FloatKind::F16,
    };
    let f32 = ElemType::Float(FloatKind::F32);
    let mut keys = vec![compute_throughput_key(
        None,
        ElemType::Float(kind),
        ElemType::Float(kind),
    )];
    if compute.is_reduced() {
        keys.push(compute_throughput_key(
            Some((16, 16, 16)),
            ElemType::Float(kind),
            f32,
        ));
    }
    device
        .performance_stats(&keys)
        .into_iter()
        .filter_map(|stat| stat.value.ok().map(|v| v.ops_per_s()))
        .filter(|flops| flops.is_finite() && *flops > 0.0)
        .reduce(f64::max)
}

/// fp16's dynamic loss scaling, with PyTorch's `GradScaler` defaults: the
/// loss is multiplied by the scale before backward and the gradients divided
/// by it before the update; a step whose gradients overflow is skipped and
/// halves the scale; 2000 clean steps in a row double it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    /// The factor the loss is multiplied by.
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub clean: u64,
    /// Clean steps in a row that double the scale.
    pub growth_interval: u64,
    /// Overflowed (skipped) steps in this session.
    pub overflows: u64,
}

/// What the scaler made of a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScaleVerdict {
    /// Finite gradients: apply the update.
    Apply {
        /// Whether this step's clean run doubled the scale.
        grown: bool,
    },
    /// Overflow: skip the update; the scale was halved to `to`.
    Overflow {
        /// The new scale.
        to: f64,
    },
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new(Self::INITIAL, 0)
    }
}

impl LossScaler {
    /// 2^16, as PyTorch starts.
    pub const INITIAL: f64 = 65536.0;
    /// Clean steps that double the scale, as PyTorch's `GradScaler`.
    pub const GROWTH_INTERVAL: u64 = 2000;

    /// A scaler at `scale` with `clean` clean steps behind it (a resumed run's state).
    pub fn new(scale: f64, clean: u64) -> Self {
        Self {
            scale,
            clean,
            growth_interval: Self::GROWTH_INTERVAL,
            overflows: 0,
        }
    }

    /// A fresh scaler as `precision` configures it.
    pub fn from_config(precision: &PrecisionSection) -> Self {
        Self {
            growth_interval: precision.loss_scale_growth_interval.max(1),
            ..Self::new(precision.loss_scale_init, 0)
        }
    }

    /// Records a step whose scaled gradients were `finite` or not.
    pub fn update(&mut self, finite: bool) -> ScaleVerdict {
        if !finite {
            self.scale *= 0.5;
            self.clean = 0;
            self.overflows += 1;
            return ScaleVerdict::Overflow { to: self.scale };
        }
        self.clean += 1;
        if self.clean >= self.growth_interval {
            self.scale *= 2.0;
            self.clean = 0;
            return ScaleVerdict::Apply { grown: true };
        }
        ScaleVerdict::Apply { grown: false }
    }

    /// Whether an overflow at this scale is the loss scale's doing: above 1
    /// the scale can still shrink; at or below 1 the gradients overflow on
    /// their own, and the step counts as non-finite.
    pub fn can_back_off(&self) -> bool {
        self.scale > 1.0
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use kiln_config::AmpDtype;

    use super::*;

    fn section(amp: bool, dtype: AmpDtype) -> PrecisionSection {
        let mut p = kiln_config::RunConfig::default().precision;
        p.amp = amp;
        p.amp_dtype = dtype;
        p.tf32 = false;
        p.max_bad_steps = 5;
        p.loss_scale_init = LossScaler::INITIAL;
        p.loss_scale_growth_interval = LossScaler::GROWTH_INTERVAL;
        p
    }

    fn gpu_device() -> DeviceChoice {
        DeviceChoice {
            device: Device::flex(),
            name: "wgpu (GPU)".into(),
            why: String::new(),
            is_gpu: true,
            compile: String::new(),
        }
    }

    #[test]
    fn a_device_without_bf16_falls_back_to_fp16_then_f32() {
        let p = section(true, AmpDtype::Bf16);
        let no_bf16 = choose_precision_with(&p, &gpu_device(), None, |d| d != FloatDType::BF16);
        assert_eq!(no_bf16.compute, ComputeDtype::F16);
        assert!(
            no_bf16.why.contains("has no bf16 → fp16"),
            "{}",
            no_bf16.why
        );
        assert!(no_bf16.loss_scaling());
        let neither = choose_precision_with(&p, &gpu_device(), None, |d| d == FloatDType::F32);
        assert_eq!(neither.compute, ComputeDtype::F32);
        assert!(
            neither.why.contains("no fp16 either → f32"),
            "{}",
            neither.why
        );
        let both = choose_precision_with(&p, &gpu_device(), None, |_| true);
        assert_eq!(both.compute, ComputeDtype::Bf16);
        assert!(!both.loss_scaling());
    }

    #[test]
    fn the_t4_rule_comes_before_the_device() {
        let t4 = GpuInfo::new(0, "Tesla T4", 15 << 30, 15 << 30, (7, 5));
        let p = section(true, AmpDtype::Bf16);
        let c = choose_precision_with(&p, &gpu_device(), Some(&t4), |_| true);
        assert_eq!(c.compute, ComputeDtype::F16);
        assert!(
            c.why.contains("compute capability 7.5 has no bf16"),
            "{}",
            c.why
        );
    }

    #[test]
    fn flex_computes_in_what_amp_asks_for() {
        let flex = crate::device::flex("device.backend = flex");
        for (dtype, compute) in [
            (AmpDtype::Bf16, ComputeDtype::Bf16),
            (AmpDtype::Fp16, ComputeDtype::F16),
        ] {
            let c = choose_precision(&section(true, dtype), &flex, None);
            assert_eq!(c.compute, compute, "{}", c.why);
            assert!(c.why.contains("slower"), "{}", c.why);
        }
        let off = choose_precision(&section(false, AmpDtype::Bf16), &flex, None);
        assert_eq!(
            (off.compute, off.label.as_str()),
            (ComputeDtype::F32, "f32")
        );
    }

    #[test]
    fn the_scaler_backs_off_skips_and_grows_as_pytorch() {
        let mut s = LossScaler::default();
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.update(false), ScaleVerdict::Overflow { to: 32768.0 });
        assert_eq!(s.update(false), ScaleVerdict::Overflow { to: 16384.0 });
        assert_eq!(s.overflows, 2);
        for _ in 0..1999 {
            assert_eq!(s.update(true), ScaleVerdict::Apply { grown: false });
        }
        assert_eq!(s.update(true), ScaleVerdict::Apply { grown: true });
        assert_eq!(s.scale, 32768.0);
        // An overflow restarts the count of clean steps.
        for _ in 0..10 {
            s.update(true);
        }
        s.update(false);
        assert_eq!((s.scale, s.clean), (16384.0, 0));
        assert!(s.can_back_off());
        assert!(!LossScaler::new(1.0, 0).can_back_off());
    }
}
