//! `kiln bench --kernel-profile`: where a GPU step's device time goes, kernel
//! by kernel — the GPU's counterpart of `perf record` on the CPU.
//!
//! A few training steps after the timed ones run under CubeCL's launch
//! observer (`cubecl_runtime::logging::LaunchObservation`), which counts
//! every kernel the process issues and brackets each with device timestamps
//! left unread until the steps are over (`TimingRequest::Deferred`), so the
//! kernels still run back to back. The durations are then read, summed by
//! kernel, and set against the timed steps' median: the device's busy share
//! of a step says whether the step is bound by its kernels or by the host
//! (launches, the autodiff graph, synchronisation).
//!
//! Only CubeCL backends issue kernels this way (wgpu, CUDA, Burn's CubeCL
//! CPU backend); flex runs kiln's and Burn's Rust loops, which `perf record`
//! profiles (docs/PERFORMANCE.md).

use std::collections::HashMap;

use serde::Serialize;

/// Kernels listed by name; the rest are summed into one row.
#[cfg_attr(
    not(feature = "gpu"),
    allow(
        dead_code,
        reason = "the GPU backends' observer uses it; tested in every build"
    )
)]
const TOP: usize = 15;

/// Where the profiled steps' device time went.
#[derive(Clone, Debug, Serialize)]
pub struct KernelProfile {
    /// Training steps profiled (after the timed ones).
    pub profiled_steps: usize,
    /// Kernel launches per step.
    pub launches_per_step: f64,
    /// Device time of the launches, per step, in ms: the sum of the kernels'
    /// durations.
    pub device_ms_per_step: f64,
    /// `device_ms_per_step` as a share of the timed steps' median (%): well
    /// under 100 means the device waits for the host between kernels.
    pub device_busy_pct: f64,
    /// Launches whose timing came back empty (not in the sums).
    pub untimed_launches: usize,
    /// How the durations were measured: `device` (timestamps on the GPU),
    /// `system` (host wall clock around a blocking launch: includes the
    /// submission) or `mixed`.
    pub timing: &'static str,
    /// The kernels with the most device time, most first; the last row,
    /// `(other kernels)`, sums the rest.
    pub kernels: Vec<KernelRow>,
}

/// One kernel (by name, generics abbreviated) in a [`KernelProfile`].
#[derive(Clone, Debug, Serialize)]
pub struct KernelRow {
    /// The kernel's type name, module paths dropped.
    pub name: String,
    /// Device ms per step.
    pub ms_per_step: f64,
    /// Share of the profiled device time (%).
    pub share_pct: f64,
    /// Launches per step.
    pub launches_per_step: f64,
}

/// The launch observer (CubeCL GPU backends only).
#[cfg(feature = "gpu")]
mod observe {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use cubecl_runtime::logging::{
        Duration, LaunchObservation, LaunchObserver, ProfileDuration, TimingMethod, TimingRequest,
    };

    use super::{KernelProfile, Timed, summarise};

    /// The observer: launches counted, measurements kept unread.
    #[derive(Default)]
    struct Recorder {
        launches: Mutex<HashMap<&'static str, usize>>,
        pending: Mutex<Vec<(&'static str, ProfileDuration)>>,
        /// Durations the launch path read itself (when CubeCL's profiling logger
        /// is on too, it reads every measurement and hands over its length).
        read: Mutex<Vec<Timed>>,
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    impl LaunchObserver for Recorder {
        fn launched(&self, kernel: &'static str) {
            *lock(&self.launches).entry(kernel).or_default() += 1;
        }
        fn timing(&self) -> TimingRequest {
            TimingRequest::Deferred
        }
        fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
            lock(&self.pending).push((kernel, profile));
        }
        fn timed(&self, kernel: &'static str, duration: Duration, method: TimingMethod) {
            lock(&self.read).push((kernel, duration.as_secs_f64(), method_name(method)));
        }
    }

    /// An observation in progress: every kernel the process launches until
    /// [`Profiler::finish`].
    pub(crate) struct Profiler {
        recorder: Arc<Recorder>,
        observation: LaunchObservation,
        /// cuBLAS's products and their time when observing began
        /// (`kiln_model::kernels::cublas_time`): they are no CubeCL launch.
        cublas_before: (u64, std::time::Duration),
    }

    impl Profiler {
        /// Starts observing (process-wide); `None` in a build without a
        /// GPU backend.
        pub(crate) fn start() -> Option<Self> {
            let recorder = Arc::new(Recorder::default());
            let observation = LaunchObservation::new(recorder.clone());
            kiln_model::kernels::cublas_timing(true);
            Some(Self {
                recorder,
                observation,
                cublas_before: kiln_model::kernels::cublas_time(),
            })
        }

        /// Stops observing and reads the measurements (each read waits for
        /// its kernel); `steps` were profiled, and the timed steps' median
        /// was `median_step_ms`.
        pub(crate) fn finish(self, steps: usize, median_step_ms: f64) -> KernelProfile {
            drop(self.observation);
            let recorder = self.recorder;
            let mut read = std::mem::take(&mut *lock(&recorder.read));
            let pending = std::mem::take(&mut *lock(&recorder.pending));
            let mut untimed = 0;
            for (kernel, profile) in pending {
                let method = method_name(profile.timing_method());
                match futures_lite::future::block_on(profile.resolve()) {
                    Some(ticks) => read.push((kernel, ticks.duration().as_secs_f64(), method)),
                    None => untimed += 1,
                }
            }
            let mut launches = std::mem::take(&mut *lock(&recorder.launches));
            let (calls, time) = kiln_model::kernels::cublas_time();
            kiln_model::kernels::cublas_timing(false);
            let calls = calls - self.cublas_before.0;
            if calls > 0 {
                let seconds = (time - self.cublas_before.1).as_secs_f64();
                launches.insert(CUBLAS_ROW, usize::try_from(calls).unwrap_or(usize::MAX));
                read.push((CUBLAS_ROW, seconds, "device"));
            }
            summarise(steps, median_step_ms, &launches, &read, untimed)
        }
    }

    /// The row of cuBLAS's products (`optimization.matmul = "cublas"`),
    /// timed by CUDA events queued around each on its stream.
    const CUBLAS_ROW: &str = "cuBLAS gemm";

    fn method_name(method: TimingMethod) -> &'static str {
        match method {
            TimingMethod::Device => "device",
            TimingMethod::System => "system",
        }
    }
}

#[cfg(feature = "gpu")]
pub(crate) use observe::Profiler;

/// Without a GPU backend built in there is nothing to observe (and the
/// bench refuses `--kernel-profile` before any step): no profiler exists.
#[cfg(not(feature = "gpu"))]
pub(crate) enum Profiler {}

#[cfg(not(feature = "gpu"))]
impl Profiler {
    pub(crate) fn start() -> Option<Self> {
        None
    }

    pub(crate) fn finish(self, _steps: usize, _median_step_ms: f64) -> KernelProfile {
        match self {}
    }
}

/// A kernel's measured launch: its name, seconds, and how it was timed.
#[cfg_attr(
    not(feature = "gpu"),
    allow(
        dead_code,
        reason = "the GPU backends' observer uses it; tested in every build"
    )
)]
type Timed = (&'static str, f64, &'static str);

/// A kernel's type name with the paths dropped: `a::b::K<c::D, 2>` → `K<D, 2>`.
#[cfg_attr(
    not(feature = "gpu"),
    allow(
        dead_code,
        reason = "the GPU backends' observer uses it; tested in every build"
    )
)]
fn short_name(kernel: &str) -> String {
    let mut out = String::with_capacity(kernel.len());
    let mut token = String::new();
    for c in kernel.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            token.push(c);
        } else {
            out.push_str(token.rsplit("::").next().unwrap_or(&token));
            token.clear();
            out.push(c);
        }
    }
    out.push_str(token.rsplit("::").next().unwrap_or(&token));
    out
}

/// The table of a profile: by kernel name ([`short_name`]), most device
/// time first, the rest after [`TOP`] summed.
#[cfg_attr(
    not(feature = "gpu"),
    allow(
        dead_code,
        reason = "the GPU backends' observer uses it; tested in every build"
    )
)]
fn summarise(
    steps: usize,
    median_step_ms: f64,
    launches: &HashMap<&'static str, usize>,
    read: &[Timed],
    untimed: usize,
) -> KernelProfile {
    let steps_f = steps.max(1) as f64;
    // name → (seconds, launches)
    let mut by_name: HashMap<String, (f64, usize)> = HashMap::new();
    for (kernel, count) in launches {
        by_name.entry(short_name(kernel)).or_default().1 += count;
    }
    let mut methods = Vec::new();
    for (kernel, seconds, method) in read {
        by_name.entry(short_name(kernel)).or_default().0 += seconds;
        if !methods.contains(method) {
            methods.push(*method);
        }
    }
    let total_s: f64 = by_name.values().map(|(s, _)| s).sum();
    let total_launches: usize = by_name.values().map(|(_, n)| n).sum();
    let mut rows: Vec<(String, f64, usize)> =
        by_name.into_iter().map(|(k, (s, n))| (k, s, n)).collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let row = |name: String, s: f64, n: usize| KernelRow {
        name,
        ms_per_step: s * 1e3 / steps_f,
        share_pct: if total_s > 0.0 {
            100.0 * s / total_s
        } else {
            0.0
        },
        launches_per_step: n as f64 / steps_f,
    };
    let rest = rows.split_off(rows.len().min(TOP));
    let mut kernels: Vec<KernelRow> = rows.into_iter().map(|(k, s, n)| row(k, s, n)).collect();
    if !rest.is_empty() {
        let (s, n) = rest.iter().fold((0.0, 0), |(s, n), r| (s + r.1, n + r.2));
        kernels.push(row(format!("(other kernels: {})", rest.len()), s, n));
    }
    let device_ms_per_step = total_s * 1e3 / steps_f;
    KernelProfile {
        profiled_steps: steps,
        launches_per_step: total_launches as f64 / steps_f,
        device_ms_per_step,
        device_busy_pct: if median_step_ms > 0.0 {
            100.0 * device_ms_per_step / median_step_ms
        } else {
            0.0
        },
        untimed_launches: untimed,
        timing: match methods.as_slice() {
            [] => "none",
            [one] => one,
            _ => "mixed",
        },
        kernels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MATMUL: &str = "cubek_matmul::kernel::MatmulKernel<f32, cubek_matmul::Tile<16>>";
    const GELU: &str = "kiln_model::kernels::GeluKernel<f32>";

    fn ms(v: u64) -> f64 {
        v as f64 / 1e3
    }

    /// Sums by kernel per step, shares of the device time, the busy share of
    /// the median step, and the rows past the top summed into one.
    #[test]
    fn a_profile_sums_each_kernel_per_step_and_keeps_the_largest_first() {
        let launches = HashMap::from([(MATMUL, 6), (GELU, 2)]);
        let read = [
            (MATMUL, ms(3), "device"),
            (GELU, ms(1), "device"),
            (MATMUL, ms(3), "device"),
            (MATMUL, ms(2), "device"),
        ];
        let p = summarise(2, 10.0, &launches, &read, 1);
        assert_eq!(p.launches_per_step, 4.0);
        assert!((p.device_ms_per_step - 4.5).abs() < 1e-9);
        assert!((p.device_busy_pct - 45.0).abs() < 1e-9);
        assert_eq!(p.untimed_launches, 1);
        assert_eq!(p.timing, "device");
        assert_eq!(p.kernels.len(), 2);
        let (first, second) = (&p.kernels[0], &p.kernels[1]);
        assert_eq!(first.name, "MatmulKernel<f32, Tile<16>>");
        assert!((first.ms_per_step - 4.0).abs() < 1e-9);
        assert!((first.share_pct - 100.0 * 8.0 / 9.0).abs() < 1e-9);
        assert_eq!(first.launches_per_step, 3.0);
        assert_eq!(second.name, "GeluKernel<f32>");
        assert!((second.ms_per_step - 0.5).abs() < 1e-9);

        // More kernels than the table lists: the smallest are one row.
        let names: Vec<&'static str> = (0..TOP + 3)
            .map(|i| &*Box::leak(format!("k::K{i:02}").into_boxed_str()))
            .collect();
        let launches: HashMap<_, _> = names.iter().map(|n| (*n, 1)).collect();
        let read: Vec<_> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (*n, ms(100 - i as u64), "system"))
            .collect();
        let p = summarise(1, 0.0, &launches, &read, 0);
        assert_eq!(p.kernels.len(), TOP + 1);
        assert_eq!(p.kernels[0].name, "K00");
        let other = &p.kernels[TOP];
        assert_eq!(other.name, "(other kernels: 3)");
        assert_eq!(other.launches_per_step, 3.0);
        assert!((other.ms_per_step - f64::from(3 * 100 - 3 * TOP as u32 - 3)).abs() < 1e-9);
        assert_eq!(p.timing, "system");
        assert_eq!(p.device_busy_pct, 0.0, "no median, no share");
        let total: f64 = p.kernels.iter().map(|k| k.share_pct).sum();
        assert!((total - 100.0).abs() < 1e-9);
    }
}
