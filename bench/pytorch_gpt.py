"""PyTorch reference for `kiln bench lm`: the same GPT, data and optimizer.

The shape and settings of ../shared/PEERS.md: a nanoGPT-style character GPT
(pre-LayerNorm, fused QKV, scaled_dot_product_attention with is_causal,
exact GELU, weight tying, no dropout), AdamW (lr 1e-3, weight decay 0.1 on
matrices, betas 0.9/0.95, eps 1e-8), global-norm clip 1.0, random windows
from Tiny Shakespeare (90/10 split). Eager fp32 on 2 threads by default.

Usage (a virtual environment outside the repository, `pip install torch`):

    python bench/pytorch_gpt.py --block 128 --batch 32 --steps 30 --warmup 5

On a GPU, as the best PyTorch training code runs it (bf16 autocast, flash
scaled_dot_product_attention, fused AdamW, TF32 for what stays in f32;
`--compile` adds torch.compile): the GPU check (bench/gpu_check.py) runs

    python bench/pytorch_gpt.py --device cuda --dtype bf16 --layers 12 --heads 12 \
        --hidden 768 --block 1024 --batch 16 --vocab 50257

`--vocab` other than the character vocabulary draws random token ids (the
speed does not depend on the text). Prints one JSON object: tokens/s
(median, min, max), ms/step and the loss. Not used by tests or CI.

Under torchrun (`WORLD_SIZE` set) it trains as DistributedDataParallel,
the reference for `kiln launch`: gloo on the CPU, NCCL on CUDA (a GPU a
rank, `LOCAL_RANK`), `--batch` rows a rank, each rank its own windows;
rank 0 prints, its tokens/s the job's (every rank's rows):

    python -m torch.distributed.run --nproc-per-node 2 bench/pytorch_gpt.py --threads 1 --batch 16
"""

import argparse
import json
import math
import os
import statistics
import time

from cpu_isa import limit_to_avx2_if_asked

limit_to_avx2_if_asked()  # `--avx2`: before torch is imported

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h, f):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, f)
        self.mlp_proj = nn.Linear(f, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, block, layers, heads, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, 4 * d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/tinyshakespeare.txt")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--avx2", action="store_true",
                    help="CPU kernels at AVX2 at most (set before torch is imported, above)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "fp16"],
                    help="autocast dtype of the products (f32: none)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="vocabulary size; 0 or the corpus' character count: characters")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # torchrun's job: DDP over gloo (CPU) or NCCL (a GPU a rank).
    ddp = "WORLD_SIZE" in os.environ
    world, rank = 1, 0
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    if cuda:
        # The guides: TF32 for whatever stays in f32 (Ampere and newer).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    text = open(args.data, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    vocab = len(chars)
    if args.vocab and args.vocab != vocab:
        vocab = args.vocab
        data = torch.randint(vocab, (len(data),), dtype=torch.long)
    train = data[: int(0.9 * len(data))].to(device)

    model = Gpt(vocab, args.block, args.layers, args.heads, args.hidden).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}),
    )
    step_model = DistributedDataParallel(model) if ddp else model
    step_model = torch.compile(step_model) if args.compile else step_model
    # Each rank its own windows (DDP gave every rank rank 0's weights).
    torch.manual_seed(args.seed + rank)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    offsets = torch.arange(args.block, device=device)
    times, loss = [], float("nan")
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        ix = torch.randint(len(train) - args.block, (args.batch, 1), device=device)
        x = train[ix + offsets]
        y = train[ix + offsets + 1]
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss_t = step_model(x, y)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    tokens = args.batch * args.block * world
    tps = sorted(tokens / t for t in times)
    if ddp:
        dist.destroy_process_group()
        if rank != 0:
            return
    print(json.dumps({
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "compiled": args.compile,
        "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": args.threads,
        "cpu_capability": None if cuda else torch.backends.cpu.get_cpu_capability(),
        "block": args.block,
        "batch": args.batch,
        "world_size": world,
        "backend": ("nccl" if cuda else "gloo") if ddp else None,
        "tokens_per_s_median": statistics.median(tps),
        "tokens_per_s_min": tps[0],
        "tokens_per_s_max": tps[-1],
        "ms_per_step_median": 1e3 * statistics.median(times),
        "final_loss": loss,
    }))


if __name__ == "__main__":
    main()
