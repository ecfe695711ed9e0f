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
/// A measurement below this share of what the clock's estimate expects is
/// timed again: the CPU was busy with something else for a moment (another
/// process, the host of a virtual machine). The products reach the
/// estimate or pass it on the Zen 4s kiln is measured on (AVX2: 164-171
/// GFLOP/s against 166).
pub(crate) const PLAUSIBLE_SHARE: f64 = 0.85;
/// How long a measurement below [`PLAUSIBLE_SHARE`] goes on being timed
/// again before its fastest round is taken as it is.
pub(crate) const RETIME_FOR: Duration = Duration::from_secs(1);

/// The CPU's peak as kiln-hwdetect estimates it from its clock: what a
/// measurement is expected to come near.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockEstimate {
    /// fp32 FLOP/s of all `cores` together.
    pub flops: f64,
    /// The cores the estimate counts.
    pub cores: usize,
}

impl ClockEstimate {
    /// What `threads` of rayon's should reach: their share of the cores
    /// (all of them where there are at least as many threads as cores).
    pub fn for_threads(&self, threads: usize) -> f64 {
        self.flops * threads.min(self.cores) as f64 / self.cores.max(1) as f64
    }
}

/// A measured matrix-product rate.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct MeasuredPeak {
    /// fp32 FLOP/s of the fastest product (`2·n³` over its time).
    pub flops: f64,
    /// The side of the square products timed.
    pub n: usize,
    /// How many products of that size were timed in the round that counts.
    pub products: usize,
    /// The threads they were split over (rayon's, as kiln's kernels).
    pub threads: usize,
    /// The `gemm` crate's microkernels that ran ([`crate::kernels::CpuIsa::gemm`]).
    pub gemm: &'static str,
    /// What the clock's estimate expects of these threads (`None`: no
    /// estimate, and no measurement timed again).
    pub expected: Option<f64>,
    /// Rounds timed: more than one where the first ran below 85 % of
    /// `expected`.
    pub rounds: usize,
}

impl MeasuredPeak {
    /// One line for people: the rate and how it was measured.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "{:.1} GFLOP/s fp32, measured: the fastest of {} square f32 products (n = {}) by the gemm crate's {} kernels on {} thread{}",
            self.flops / 1e9,
            self.products,
            self.n,
            self.gemm,
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        );
        if let (true, Some(expected)) = (self.rounds > 1, self.expected) {
            let floor = PLAUSIBLE_SHARE * expected / 1e9;
            line += &format!(
                "; timed in {} rounds, as the first ran below {:.0} % of the clock's estimate ({floor:.1} GFLOP/s)",
                self.rounds,
                PLAUSIBLE_SHARE * 100.0
            );
            if self.flops < PLAUSIBLE_SHARE * expected {
                line += &format!(
                    " and every round did for {:.0} s: the CPU busy with other work, or slower than its clock says",
                    RETIME_FOR.as_secs_f64()
                );
            }
        }
        line
    }
}

/// One round of timing: square products, `n` doubling from 128 until a
/// product (the faster of two) takes 5 ms or `n` reaches 1024, then 8 more
/// at that size.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Round {
    n: usize,
    fastest: Duration,
}

impl Round {
    fn flops(&self) -> f64 {
        2.0 * (self.n as f64).powi(3) / self.fastest.as_secs_f64().max(1e-9)
    }
}

/// Times square f32 products with the `gemm` crate as kiln's kernels call
/// it (split over rayon's threads, this build's microkernels), in rounds
/// of [`Round`]'s; the fastest product counts. One round is about 0.1 s on
/// a 2-core AVX2 CPU. Where a round runs below 85 % of what `estimate`
/// expects of these threads, rounds go on for up to 1 s until one does
/// not: 0.1 s of other work on the CPU would otherwise set the peak of a
/// whole run, and its MFU with it (99.6 % read where 67 % was true). In an
/// unoptimised build the products stay small (and so does the rate), and
/// a build with debug assertions times one round only.
pub fn measure_fp32_peak(estimate: Option<ClockEstimate>) -> MeasuredPeak {
    let threads = rayon::current_num_threads();
    let expected = estimate.map(|e| e.for_threads(threads));
    let started = Instant::now();
    // A build with debug assertions (the tests') has kiln's loops
    // unoptimised and runs the products at half the rate or less whatever
    // the load: timing it again would only cost each process a second.
    let floor = expected
        .filter(|_| !cfg!(debug_assertions))
        .map(|e| PLAUSIBLE_SHARE * e);
    let (best, rounds) = fastest_round(timed_round, floor, || started.elapsed() < RETIME_FOR);
    MeasuredPeak {
        flops: best.flops(),
        n: best.n,
        products: TIMED,
        threads,
        gemm: crate::kernels::cpu_isa().gemm,
        expected,
        rounds,
    }
}

/// The fastest of the rounds `round` times: one, and more while the
/// fastest is below `floor` FLOP/s and `more_time` says there is time.
fn fastest_round(
    mut round: impl FnMut() -> Round,
    floor: Option<f64>,
    mut more_time: impl FnMut() -> bool,
) -> (Round, usize) {
    let mut best = round();
    let mut rounds = 1;
    while floor.is_some_and(|f| best.flops() < f) && more_time() {
        let next = round();
        rounds += 1;
        if next.flops() > best.flops() {
            best = next;
        }
    }
    (best, rounds)
}

/// One [`Round`] of products on this CPU.
fn timed_round() -> Round {
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
    Round {
        n,
        fastest: timed_products(n, TIMED),
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

    /// A round of products of side 1000 taking `ms` each: 2 GFLOP over it.
    fn round_of(ms: u64) -> Round {
        Round {
            n: 1000,
            fastest: Duration::from_millis(ms),
        }
    }

    #[test]
    fn a_round_below_the_floor_is_timed_again_until_one_is_not() {
        // 20 ms is 100 GFLOP/s, 10 ms 200: a floor of 150 GFLOP/s takes
        // rounds until the fast one, and keeps the fastest.
        let mut times = [20, 25, 10, 30].into_iter();
        let (best, rounds) = fastest_round(
            || round_of(times.next().expect("a round more than the test has")),
            Some(150e9),
            || true,
        );
        assert_eq!((best, rounds), (round_of(10), 3));

        // Above the floor at once: one round.
        let (best, rounds) =
            fastest_round(|| round_of(10), Some(150e9), || panic!("no time asked"));
        assert_eq!((best, rounds), (round_of(10), 1));

        // No estimate, no floor: one round, however slow.
        let (best, rounds) = fastest_round(|| round_of(40), None, || true);
        assert_eq!((best, rounds), (round_of(40), 1));

        // Below the floor for as long as there is time: the fastest of
        // the rounds there was time for.
        let mut times = [40, 30, 35, 20].into_iter();
        let mut left = 2;
        let (best, rounds) = fastest_round(
            || round_of(times.next().expect("a round more than the test has")),
            Some(150e9),
            || {
                left -= 1;
                left >= 0
            },
        );
        assert_eq!((best, rounds), (round_of(30), 3));
    }

    #[test]
    fn the_estimate_expected_of_some_threads_is_their_share_of_the_cores() {
        let e = ClockEstimate {
            flops: 160e9,
            cores: 4,
        };
        assert_eq!(e.for_threads(1), 40e9);
        assert_eq!(e.for_threads(4), 160e9);
        // Hyper-threads add no FMA pipes.
        assert_eq!(e.for_threads(8), 160e9);
    }

    #[test]
    fn a_measurement_timed_again_says_why_and_whether_it_stayed_slow() {
        let mut p = MeasuredPeak {
            flops: 150e9,
            n: 1024,
            products: TIMED,
            threads: 2,
            gemm: "avx2+fma",
            expected: Some(160e9),
            rounds: 1,
        };
        assert!(!p.describe().contains("round"), "{}", p.describe());
        p.rounds = 3;
        let line = p.describe();
        assert!(line.contains("timed in 3 rounds, as the first ran below 85 % of the clock's estimate (136.0 GFLOP/s)"), "{line}");
        assert!(!line.contains("every round"), "{line}");
        p.flops = 100e9;
        let line = p.describe();
        assert!(line.contains("every round did for 1 s"), "{line}");
    }

    #[test]
    fn the_peak_is_a_rate_of_the_largest_product_timed() {
        let p = measure_fp32_peak(None);
        assert_eq!(p.rounds, 1, "no estimate, no second round");
        assert_eq!(p.expected, None);
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
