//! Times the `gemm` crate on the products of a kiln GPT step's linear layers,
//! split over the threads as kiln's CPU kernels split them
//! (crates/model/src/kernels/cpu/mod.rs): the forward product in chunks of rows,
//! one single-threaded gemm per chunk onto the bias; the input gradient as
//! one gemm over all threads; the weight gradient as one part per thread over
//! the rows, summed. `python bench/pytorch_linear.py` times PyTorch's
//! products (MKL on x86) at the same shapes, so the two give the matrix
//! products' share of the comparison of `kiln bench lm` with
//! `bench/pytorch_gpt.py` (docs/PERFORMANCE.md).
//!
//!     cargo run --release -p kiln-gemm-shapes -- [--rows 4096] [--width 128] \
//!         [--layers 4] [--vocab 65] [--reps 40]
//!     cargo run --release -p kiln-gemm-shapes --no-default-features   # gemm's AVX2 kernels
//!     cargo run --release -p kiln-gemm-shapes -- --square 512,1024,2048  # the kernels' peak
//!
//! The defaults are the PEERS shape of `kiln bench lm` (block 128 × batch 32
//! tokens, 4 layers 128 wide, the character vocabulary). The attention's
//! products (per head, inside kiln's fused attention) are not timed here.

#![allow(clippy::print_stdout, reason = "a bench prints its table")]

use rayon::prelude::*;
use std::time::Instant;

/// A row-major view: pointer, row stride, column stride (in elements).
#[derive(Clone, Copy, Debug)]
struct View(*const f32, isize, isize);

impl View {
    fn rows(data: &[f32], cols: usize) -> Self {
        Self(data.as_ptr(), cols as isize, 1)
    }
    fn t(self) -> Self {
        Self(self.0, self.2, self.1)
    }
}

/// `dst (m × n, contiguous) = lhs · rhs`, plus what `dst` holds when `acc`.
///
/// # Safety
/// The views must cover `m × k` and `k × n` values, `dst` `m × n`.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    lhs: View,
    rhs: View,
    acc: bool,
    par: gemm::Parallelism,
) {
    // SAFETY: forwarded; gemm takes the column stride first.
    unsafe {
        gemm::gemm(
            m, n, k, dst, 1, n as isize, acc, lhs.0, lhs.2, lhs.1, rhs.0, rhs.2, rhs.1, 1.0, 1.0,
            false, false, false, par,
        )
    }
}

/// `y = x · w + b` in chunks of rows as kiln's `linear_rows`: 256 rows, or
/// fewer (a multiple of 16) so that every thread gets one.
fn forward(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32]) {
    let (n, k) = (b.len(), w.len() / b.len());
    let rows = y.len() / n;
    let share = rows
        .div_ceil(rayon::current_num_threads())
        .next_multiple_of(16);
    let chunk = 256.min(share).max(1);
    y.par_chunks_mut(chunk * n)
        .enumerate()
        .for_each(|(c, out)| {
            for row in out.chunks_exact_mut(n) {
                row.copy_from_slice(b);
            }
            // SAFETY: the chunk's rows of x and y, w is k × n.
            unsafe {
                product(
                    out.len() / n,
                    n,
                    k,
                    out.as_mut_ptr(),
                    View::rows(&x[c * chunk * k..], k),
                    View::rows(w, n),
                    true,
                    gemm::Parallelism::None,
                )
            }
        });
}

/// `dx = g · wᵀ`, one gemm over all threads, as kiln's `linear_backward`.
fn input_grad(g: &[f32], w: &[f32], k: usize, dx: &mut [f32]) {
    let n = w.len() / k;
    let rows = g.len() / n;
    // SAFETY: g is rows × n, wᵀ n × k, dx rows × k.
    unsafe {
        product(
            rows,
            k,
            n,
            dx.as_mut_ptr(),
            View::rows(g, n),
            View::rows(w, n).t(),
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

/// `dw = xᵀ · g` as kiln's `weight_grad`: one part of the rows per thread
/// (each part at least 256 rows), each its own gemm, summed in order.
fn weight_grad(x: &[f32], g: &[f32], k: usize, n: usize) -> Vec<f32> {
    let rows = x.len() / k;
    let threads = rayon::current_num_threads();
    let parts = threads.min(rows / 256).max(1);
    let per_part = threads / parts;
    let par = if parts == 1 {
        gemm::Parallelism::Rayon(0)
    } else if per_part > 1 {
        gemm::Parallelism::Rayon(per_part)
    } else {
        gemm::Parallelism::None
    };
    let share = rows.div_ceil(parts);
    let partials: Vec<Vec<f32>> = (0..parts)
        .into_par_iter()
        .map(|p| {
            let (r0, r1) = ((p * share).min(rows), ((p + 1) * share).min(rows));
            let mut dw = vec![0.0f32; k * n];
            // SAFETY: rows r0..r1 of x (k wide) and g (n wide); dw is k × n.
            unsafe {
                product(
                    k,
                    n,
                    r1 - r0,
                    dw.as_mut_ptr(),
                    View::rows(&x[r0 * k..], k).t(),
                    View::rows(&g[r0 * n..], n),
                    false,
                    par,
                )
            }
            dw
        })
        .collect();
    let mut parts = partials.into_iter();
    let mut dw = parts.next().unwrap_or_default();
    for other in parts {
        for (s, v) in dw.iter_mut().zip(other) {
            *s += v;
        }
    }
    dw
}

/// Median seconds of `reps` runs after 3 unmeasured ones.
fn median_secs(reps: usize, mut run: impl FnMut()) -> f64 {
    for _ in 0..3 {
        run();
    }
    let mut secs: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64()
        })
        .collect();
    secs.sort_by(f64::total_cmp);
    secs[secs.len() / 2]
}

/// Values that are not all equal (a product of constants would let a
/// kernel's error hide).
fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.5)
        .collect()
}

/// The level of gemm's kernels on this CPU and build, as `kiln bench`
/// names it (`bench.isa.gemm`).
fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
            "avx512f"
        } else if std::arch::is_x86_feature_detected!("fma") {
            "avx2+fma"
        } else {
            "sse"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "the target's own"
    }
}

/// The shape of the step whose linear products are timed: by default the
/// PEERS shape of `kiln bench lm`.
#[derive(clap::Parser, Debug)]
#[command(about)]
struct Args {
    /// Tokens in the step (block × batch).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    rows: u32,
    /// The model's width; the MLP is four times as wide.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    width: u32,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    layers: u32,
    /// The head's outputs (the vocabulary).
    #[arg(long, default_value_t = 65, value_parser = clap::value_parser!(u32).range(1..))]
    vocab: u32,
    /// Timed runs of each product (the median is printed).
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(1..))]
    reps: u32,
    /// Instead of the step: square products `n × n · n × n` at these sizes
    /// (e.g. `512,1024,2048`), one gemm over all threads each: the rate the
    /// kernels reach where packing and thin shapes cost least.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    square: Vec<u32>,
}

/// `c = a · b`, all `n × n`, one gemm over all threads.
fn square(a: &[f32], b: &[f32], n: usize, c: &mut [f32]) {
    // SAFETY: a, b and c hold n × n values each.
    unsafe {
        product(
            n,
            n,
            n,
            c.as_mut_ptr(),
            View::rows(a, n),
            View::rows(b, n),
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let [rows, width, layers, vocab, reps] =
        [args.rows, args.width, args.layers, args.vocab, args.reps].map(|v| v as usize);
    let shapes = [
        ("qkv", width, 3 * width, layers),
        ("attn out", width, width, layers),
        ("mlp in", width, 4 * width, layers),
        ("mlp out", 4 * width, width, layers),
        ("head", width, vocab, 1),
    ];
    let isa = kernels();
    if !args.square.is_empty() {
        println!(
            "gemm crate, {} threads, square products, kernels {isa}; median of {reps} runs",
            rayon::current_num_threads()
        );
        for n in args.square.iter().map(|&n| n as usize) {
            let (a, b, mut c) = (filled(n * n, 1), filled(n * n, 2), vec![0.0; n * n]);
            let secs = median_secs(reps, || square(&a, &b, n, &mut c));
            let flop = 2.0 * (n * n * n) as f64;
            println!(
                "{n:>5}: {:.2} ms, {:.1} GFLOP/s",
                secs * 1e3,
                flop / secs / 1e9
            );
        }
        return;
    }
    println!(
        "gemm crate, {} threads, {rows} rows, kernels {isa}; median of {reps} runs, ms (GFLOP/s)",
        rayon::current_num_threads()
    );
    let (mut step_secs, mut step_flop) = (0.0, 0.0);
    for (name, k, n, count) in shapes {
        let (x, w, b, g) = (
            filled(rows * k, 1),
            filled(k * n, 2),
            filled(n, 3),
            filled(rows * n, 4),
        );
        let (mut y, mut dx) = (vec![0.0; rows * n], vec![0.0; rows * k]);
        let secs = [
            median_secs(reps, || forward(&x, &w, &b, &mut y)),
            median_secs(reps, || input_grad(&g, &w, k, &mut dx)),
            median_secs(reps, || {
                std::hint::black_box(weight_grad(&x, &g, k, n));
            }),
        ];
        let flop = 2.0 * (rows * k * n) as f64;
        let cells: Vec<String> = secs
            .iter()
            .map(|s| format!("{:.2} ({:.0})", s * 1e3, flop / s / 1e9))
            .collect();
        println!(
            "{name:>8} {k:>4}→{n:<4} ×{count}: fwd {}  dx {}  dw {}",
            cells[0], cells[1], cells[2]
        );
        step_secs += count as f64 * secs.iter().sum::<f64>();
        step_flop += count as f64 * 3.0 * flop;
    }
    println!(
        "linear layers of one step: {:.1} ms, {:.1} GFLOP ({:.1} GFLOP/s)",
        step_secs * 1e3,
        step_flop / 1e9,
        step_flop / step_secs / 1e9
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a (m × k) · b (k × n)` by the definition, in f64.
    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                (0..k)
                    .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                    .sum()
            })
            .collect()
    }

    fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|ji| a[(ji % rows) * cols + ji / rows])
            .collect()
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // f32 sums of up to 600 terms; a wrong row or column is off by O(1).
            let tolerance = 1e-4 * (1.0 + w.abs());
            assert!(
                (f64::from(*g) - w).abs() < tolerance,
                "element {i}: {g} against {w}"
            );
        }
    }

    /// The three timed products are the products: rows that leave a ragged
    /// chunk and a ragged part, on two threads and on one; and so is the
    /// square one.
    #[test]
    fn the_timed_products_are_the_linear_layers_products() {
        let (rows, k, n) = (600, 24, 40);
        let (x, w, b, g) = (
            filled(rows * k, 1),
            filled(k * n, 2),
            filled(n, 3),
            filled(rows * n, 4),
        );
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            pool.install(|| {
                let mut y = vec![0.0; rows * n];
                forward(&x, &w, &b, &mut y);
                let mut want = naive(&x, &w, rows, k, n);
                for (i, v) in want.iter_mut().enumerate() {
                    *v += f64::from(b[i % n]);
                }
                close(&y, &want);

                let mut dx = vec![0.0; rows * k];
                input_grad(&g, &w, k, &mut dx);
                close(&dx, &naive(&g, &transpose(&w, k, n), rows, n, k));

                let dw = weight_grad(&x, &g, k, n);
                close(&dw, &naive(&transpose(&x, rows, k), &g, k, rows, n));

                let (a, b) = (filled(70 * 70, 5), filled(70 * 70, 6));
                let mut c = vec![0.0; 70 * 70];
                square(&a, &b, 70, &mut c);
                close(&c, &naive(&a, &b, 70, 70, 70));
            });
        }
    }
}
