"""PyTorch's side of `cargo run --release -p kiln-gemm-shapes`: the matrix
products of a kiln GPT step's linear layers at the same shapes, as
`nn.Linear` runs them (forward `addmm` onto the bias, input gradient
`g · W`, weight gradient `gᵀ · x`; MKL on x86). Eager fp32 on 2 threads.

    python bench/pytorch_linear.py [--avx2] [--rows 4096] [--width 128] \
        [--layers 4] [--vocab 65] [--reps 40]
    python bench/pytorch_linear.py [--avx2] --square 512,1024,2048

`--avx2` limits ATen, MKL and oneDNN to AVX2 (bench/cpu_isa.py).
Prints a table like kiln-gemm-shapes' (median ms and GFLOP/s of each
product, and the sum over one step's linear layers). Not used by tests or CI.
"""

import argparse
import time

from cpu_isa import limit_to_avx2_if_asked

limit_to_avx2_if_asked()  # `--avx2`: before torch is imported

import torch


def median_secs(reps, run):
    for _ in range(3):
        run()
    secs = []
    for _ in range(max(reps, 1)):
        start = time.perf_counter()
        run()
        secs.append(time.perf_counter() - start)
    secs.sort()
    return secs[len(secs) // 2]


def sizes(text):
    """`--square`'s value: positive sizes separated by commas."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive sizes like 512,1024")
    return values


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--avx2", action="store_true")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--square",
        type=sizes,
        default=[],
        help="instead of the step: square products at these sizes (e.g. 512,1024,2048)",
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.square:
        print(
            f"PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
            f"{torch.get_num_threads()} threads, square products; median of {a.reps} runs"
        )
        for n in a.square:
            x, y = torch.rand(n, n) - 0.5, torch.rand(n, n) - 0.5
            secs = median_secs(a.reps, lambda: x.mm(y))
            print(f"{n:>5}: {secs * 1e3:.2f} ms, {2.0 * n**3 / secs / 1e9:.1f} GFLOP/s")
        return
    w = a.width
    shapes = [
        ("qkv", w, 3 * w, a.layers),
        ("attn out", w, w, a.layers),
        ("mlp in", w, 4 * w, a.layers),
        ("mlp out", 4 * w, w, a.layers),
        ("head", w, a.vocab, 1),
    ]
    print(
        f"PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads, {a.rows} rows; median of {a.reps} runs, ms (GFLOP/s)"
    )
    step_secs = step_flop = 0.0
    for name, k, n, count in shapes:
        x, weight = torch.rand(a.rows, k) - 0.5, torch.rand(n, k) - 0.5
        bias, g = torch.rand(n), torch.rand(a.rows, n) - 0.5
        secs = [
            median_secs(a.reps, lambda: torch.addmm(bias, x, weight.t())),
            median_secs(a.reps, lambda: g.mm(weight)),
            median_secs(a.reps, lambda: g.t().mm(x)),
        ]
        flop = 2.0 * a.rows * k * n
        cells = [f"{s * 1e3:.2f} ({flop / s / 1e9:.0f})" for s in secs]
        print(f"{name:>8} {k:>4}→{n:<4} ×{count}: fwd {cells[0]}  dx {cells[1]}  dw {cells[2]}")
        step_secs += count * sum(secs)
        step_flop += count * 3 * flop
    print(
        f"linear layers of one step: {step_secs * 1e3:.1f} ms, {step_flop / 1e9:.1f} GFLOP "
        f"({step_flop / step_secs / 1e9:.1f} GFLOP/s)"
    )


if __name__ == "__main__":
    main()
