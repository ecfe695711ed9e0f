//! The fp32 rate of the CPU's matrix products, measured: what MFU on flex
//! counts against. kiln-hwdetect's peak is an estimate from the clock it
//! reads (cores × clock × FLOPs per cycle), and a CPU that boosts above
//! that clock — most do, virtual machines' vCPUs included — runs the
//! products faster than the estimate allows: training then reported MFU
//! over 100 % (110 % for the padded encoder on a Zen 4 whose clock reads
//! 2.6 GHz). ../shared/PEERS.md counts MFU against a measured matmul peak,
//! as Burn measures a GPU's; this is the CPU's.

use std::time::{Duration, Instant};

/// The largest square product measured (4 MiB an operand).
const MAX_N: usize = 1024;
/// A product at least this long is timed without growing `n` further.
const LONG_ENOUGH: Duration = Duration::from_millis(5);
/// Products timed at the final size; the fastest one counts.
const TIMED: usize = 8;

/// A measured matrix-product rate.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct MeasuredPeak {
    /// fp32 FLOP/s of the fastest product (`2·n³` over its time).
    pub flops: f64,
    /// The side of the square products timed.
    pub n: usize,
    /// How many products of that size were timed.
    pub products: usize,
    /// The threads they were split over (rayon's, as kiln's kernels).
    pub threads: usize,
    /// The `gemm` crate's microkernels that ran ([`crate::kernels::CpuIsa::gemm`]).
    pub gemm: &'static str,
}

impl MeasuredPeak {
    /// One line for people: the rate and how it was measured.
    pub fn describe(&self) -> String {
        format!(
            "{:.1} GFLOP/s fp32, measured: the fastest of {} square f32 products (n = {}) by the gemm crate's {} kernels on {} thread{}",
            self.flops / 1e9,
            self.products,
            self.n,
            self.gemm,
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )
    }
}

/// Times square f32 products with the `gemm` crate as kiln's kernels call
/// it (split over rayon's threads, this build's microkernels), `n` doubling
/// from 128 until a product (the faster of two) takes 5 ms or `n` reaches
/// 1024, then 8 more at that size; the fastest counts. About 0.1 s on a
/// 2-core AVX2 CPU; in an unoptimised build the products stay small (and so
/// does the rate).
pub fn measure_fp32_peak() -> MeasuredPeak {
    let mut n = 128;
    loop {
        // The faster of two: the first product at a size also faults its
        // buffers in (and the very first starts rayon's threads), which
        // alone would stop `n` from growing.
        let time = timed_products(n, 2);
        if time >= LONG_ENOUGH || n >= MAX_N {
            break;
        }
        n *= 2;
    }
    let best = timed_products(n, TIMED);
    MeasuredPeak {
        flops: 2.0 * (n as f64).powi(3) / best.as_secs_f64().max(1e-9),
        n,
        products: TIMED,
        threads: rayon::current_num_threads(),
        gemm: crate::kernels::cpu_isa().gemm,
    }
}

/// The fastest of `count` products `c = a · b` of `n × n` matrices.
fn timed_products(n: usize, count: usize) -> Duration {
    let (a, b) = operands(n);
    let mut c = vec![0.0f32; n * n];
    let mut best = Duration::MAX;
    for _ in 0..count {
        let start = Instant::now();
        multiply(n, &a, &b, &mut c);
        best = best.min(start.elapsed());
    }
    std::hint::black_box(&c);
    best
}

/// Two `n × n` operands of values of both signs in [-1, 1] (no denormals,
/// no overflow).
fn operands(n: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..n * n).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
    let b = (0..n * n).map(|i| (i % 13) as f32 / 6.0 - 1.0).collect();
    (a, b)
}

/// `c = a · b`, all three `n × n` and row-major: the kernels' own call of
/// the `gemm` crate over rayon's threads.
fn multiply(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    super::row_major_product(n, n, n, a, b, c);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_a_rate_of_the_largest_product_timed() {
        let p = measure_fp32_peak();
        assert!(
            p.flops.is_finite() && p.flops > 1e8,
            "{} FLOP/s is no CPU's matrix-product rate",
            p.flops
        );
        assert!([128, 256, 512, 1024].contains(&p.n), "n = {}", p.n);
        assert_eq!(p.products, TIMED);
        assert_eq!(p.threads, rayon::current_num_threads());
        assert_eq!(p.gemm, crate::kernels::cpu_isa().gemm);
        let line = p.describe();
        assert!(
            line.contains("measured") && line.contains(&format!("n = {}", p.n)),
            "{line}"
        );
    }

    #[test]
    fn the_product_timed_is_the_product() {
        // The timed call's strides, checked on a small case against a plain
        // triple loop.
        let n = 24;
        let (a, b) = operands(n);
        let mut c = vec![0.0f32; n * n];
        multiply(n, &a, &b, &mut c);
        for i in 0..n {
            for j in 0..n {
                let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
                assert!((c[i * n + j] - want).abs() < 1e-4, "c[{i}][{j}]");
            }
        }
    }
}
