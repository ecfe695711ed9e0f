"""PyTorch reference for `kiln bench attention`: self-attention alone, as a
GPT's block runs it (nanoGPT's): the packed projection split into queries,
keys and values, each viewed as heads, `scaled_dot_product_attention`, the
heads merged back; forward, and forward + backward to the packed
projection's gradient. Each of PyTorch's SDPA backends (flash, efficient,
math) and its default choice, timed as kiln times its own: `--warmup`
calls, then `--steps` calls between two device synchronisations (again
until they add up to `--min-seconds`), the mean.
FLOPs by FlashAttention's count (4·b·h·t²·d forward, halved when causal;
the backward 2.5 times that), as kiln's.

Usage (a virtual environment outside the repository, `pip install torch`);
the GPU check (bench/gpu_check.py) runs, at GPT-2 small's shape:

    python bench/pytorch_attention.py --device cuda --dtype bf16 --batch 16 \
        --block 1024 --heads 12 --hidden 768

Prints one JSON object. Not used by tests or CI.
"""

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F


def attention(qkv, heads, causal):
    b, t, three_d = qkv.shape
    d = three_d // 3
    q, k, v = qkv.split(d, dim=2)
    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return y.transpose(1, 2).reshape(b, t, d)


def backend_context(name):
    """The SDPA backend `name` forced, or PyTorch's own choice ("default")."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--no-causal", action="store_true", help="every query sees every key (an encoder)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-seconds", type=float, default=0.0,
                    help="time more calls until they add up to this (up to 50 × --steps), as kiln's --min-seconds")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    args = ap.parse_args()

    torch.manual_seed(1337)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    causal = not args.no_causal
    head_dim = args.hidden // args.heads
    qkv = torch.randn(args.batch, args.block, 3 * args.hidden, device=args.device, dtype=dtype)
    full = 4.0 * args.batch * args.heads * head_dim * args.block * args.block
    forward_flops = full / 2 if causal else full

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(call):
        for _ in range(args.warmup):
            call()
        sync()
        calls, seconds = 0, 0.0
        while calls == 0 or (seconds < args.min_seconds and calls < 50 * args.steps):
            start = time.perf_counter()
            for _ in range(args.steps):
                call()
            sync()
            seconds += time.perf_counter() - start
            calls += args.steps
        return seconds * 1e3 / calls

    grad = torch.ones(args.batch, args.block, args.hidden, device=args.device, dtype=dtype)
    rows = []
    for name in ["default", "flash", "efficient", "math"]:
        row = {"backend": name}
        try:
            with backend_context(name):
                def forward():
                    with torch.no_grad():
                        attention(qkv, args.heads, causal)

                def forward_backward():
                    x = qkv.detach().requires_grad_(True)
                    attention(x, args.heads, causal).backward(grad)

                forward_ms = timed(forward)
                both_ms = timed(forward_backward)
        except RuntimeError as e:  # a backend that does not take this shape or dtype here
            row["skipped"] = str(e).splitlines()[0][:300]
            rows.append(row)
            continue
        backward_ms = both_ms - forward_ms
        row.update({
            "forward_ms": forward_ms,
            "forward_backward_ms": both_ms,
            "forward_tflops": forward_flops / (forward_ms * 1e-3) / 1e12,
            "backward_tflops": 2.5 * forward_flops / (backward_ms * 1e-3) / 1e12 if backward_ms > 0 else None,
        })
        rows.append(row)

    print(json.dumps({
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.block,
        "heads": args.heads,
        "head_dim": head_dim,
        "causal": causal,
        "warmup": args.warmup,
        "calls": args.steps,
        "forward_flops": forward_flops,
        "backward_flops": 2.5 * forward_flops,
        "rows": rows,
    }))


if __name__ == "__main__":
    main()
