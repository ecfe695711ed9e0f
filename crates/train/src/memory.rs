//! The guides' MemoryTracker: current and peak memory of the run. On the CPU
//! that is the process's resident set (RSS); the peak is the kernel's
//! high-water mark where Linux has one, else the highest value sampled. On
//! a GPU ([`MemoryTracker::for_device`]) it is what CubeCL's allocator
//! holds there (`kiln_model::device_memory`): the bytes live, and the most
//! its pools have held.

use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// Samples the process's memory.
#[derive(Debug)]
pub struct MemoryTracker {
    system: Option<System>,
    pid: Option<Pid>,
    peak: u64,
    /// The GPU whose allocator is read instead of the process.
    gpu: Option<burn::tensor::Device>,
}

impl Default for MemoryTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryTracker {
    /// A tracker of this process.
    pub fn new() -> Self {
        Self {
            system: System::new().ok(),
            pid: sysinfo::get_current_pid().ok(),
            peak: 0,
            gpu: None,
        }
    }

    /// A tracker of `device`'s memory where it is a GPU whose allocator
    /// kiln can read (wgpu, CUDA), else of this process.
    pub fn for_device(device: &burn::tensor::Device) -> Self {
        Self {
            gpu: kiln_model::device_memory(device).map(|_| device.clone()),
            ..Self::new()
        }
    }

    /// Whether [`MemoryTracker::sample`] reads a GPU's allocator.
    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Current and peak memory in bytes (0 where unknown): the process's
    /// resident set, or on a GPU the allocator's live bytes and the most
    /// its pools have held.
    pub fn sample(&mut self) -> (u64, u64) {
        if let Some(memory) = self.gpu.as_ref().and_then(kiln_model::device_memory) {
            self.peak = self.peak.max(memory.peak_reserved);
            return (memory.in_use, self.peak);
        }
        let current = match (self.pid, self.system.as_mut()) {
            (Some(pid), Some(system)) => {
                system.refresh_processes_specifics(
                    ProcessesToUpdate::Some(&[pid]),
                    true,
                    ProcessRefreshKind::nothing().with_memory(),
                );
                system.process(pid).map_or(0, |p| p.memory())
            }
            _ => 0,
        };
        self.peak = self
            .peak
            .max(current)
            .max(linux_high_water_mark().unwrap_or(0));
        (current, self.peak)
    }

    /// Forgets the peak (the guides' `reset`).
    pub fn reset(&mut self) {
        self.peak = 0;
    }
}

/// `VmHWM` of /proc/self/status, in bytes.
fn linux_high_water_mark() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_covers_current_and_grows_with_an_allocation() {
        let mut t = MemoryTracker::new();
        let (cur, peak) = t.sample();
        assert!(cur > 0 && peak >= cur, "{cur} {peak}");
        // black_box: an optimised build would not allocate an unused vector.
        let big = std::hint::black_box(vec![1u8; 64 << 20]);
        let (cur2, peak2) = t.sample();
        assert!(cur2 >= cur + (32 << 20), "{cur} → {cur2}");
        assert!(peak2 >= cur2);
        drop(big);
    }
}
