"""PyTorch reference for `kiln bench nli --pad-to-max-length`: the same encoder.

../shared/PEERS.md's BERT shape: 4 layers, hidden 256, 4 heads, intermediate
1024, post-LayerNorm blocks, exact GELU, [CLS] pooling, 3 classes, sequences
padded to 128 with a key-padding mask, vocabulary 8000, AdamW (lr 3e-4),
global-norm clip 1.0, no dropout, an optimizer step every batch, eager fp32
on 2 threads. Inputs are random token ids with real lengths drawn around the
SNLI mean: padding is computed on anyway, so only the shapes matter for
speed. Run kiln without dropout (the NLI experiment's default is BERT's 0.1)
and without accumulation (the `cpu` preset's encoder accumulates 8 batches
an optimizer step):

    python bench/pytorch_encoder.py --batch 32 --steps 10 --warmup 3
    kiln bench nli --pad-to-max-length training.batch_size=32 \
        training.gradient_accumulation_steps=1 model.dropout=0.0 model.attention_dropout=0.0

On a GPU (`--device cuda`, `--dtype bf16` for autocast; `bench/gpu_check.py`
runs it so at BERT-base's shape against `kiln bench nli` in bf16) the model
is on the device, TF32 is on for what stays in f32, AdamW is the fused one,
and each step ends when the device has finished it.

`--dropout 0.1` adds BERT's dropout where kiln's `model.dropout` applies
(the embeddings, each block's attention and MLP outputs, the pooled [CLS]),
`--attention-dropout 0.1` BERT's on the attention probabilities (kiln's
`model.attention_dropout`; SDPA's `dropout_p`): the NLI experiments set
both to 0.1.

Prints one JSON object: samples/s (median, min, max) and ms/step.
Not used by tests or CI.
"""

import argparse
import json
import statistics
import time

from cpu_isa import limit_to_avx2_if_asked

limit_to_avx2_if_asked()  # `--avx2`: before torch is imported

import torch
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, d, h, f, p, attn_p):
        super().__init__()
        self.h = h
        self.attn_p = attn_p
        self.drop = nn.Dropout(p)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, f)
        self.fc_out = nn.Linear(f, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x, pad):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :],
                                           dropout_p=self.attn_p if self.training else 0.0)
        x = self.ln1(x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, d))))
        return self.ln2(x + self.drop(self.fc_out(F.gelu(self.fc(x)))))


class Encoder(nn.Module):
    def __init__(self, vocab, max_len, layers, heads, d, f, classes, p, attn_p):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.seg = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(Layer(d, heads, f, p, attn_p) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, ids, seg, pad, labels):
        t = ids.shape[1]
        x = self.ln(self.tok(ids) + self.pos(torch.arange(t, device=ids.device)) + self.seg(seg))
        x = self.drop(x)
        for layer in self.layers:
            x = layer(x, pad)
        return F.cross_entropy(self.head(self.drop(x[:, 0])), labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--mean-len", type=int, default=28)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--avx2", action="store_true",
                    help="CPU kernels at AVX2 at most (set before torch is imported, above)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8000,
                    help="the shape's defaults are PEERS.md's; BERT-base: --layers 12 --heads 12 "
                    "--hidden 768 --intermediate 3072 --vocab 30522 (kiln's bert_base experiment)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout where kiln's encoder has it: after the embeddings' LayerNorm, "
                         "on the attention's and the MLP's outputs, on the pooled [CLS]")
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="dropout on the attention probabilities (kiln's model.attention_dropout)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "fp16"],
                    help="bf16/fp16: autocast (mixed precision), the weights in f32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = Encoder(args.vocab, args.max_len, args.layers, args.heads, args.hidden, args.intermediate, 3,
                    args.dropout, args.attention_dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                            **({"fused": True} if cuda else {}))
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    times = []
    for i in range(args.warmup + args.steps):
        lengths = torch.clamp(torch.poisson(torch.full((args.batch,), float(args.mean_len))), 4, args.max_len).long()
        pad = torch.arange(args.max_len)[None, :] >= lengths[:, None]
        ids = torch.randint(5, args.vocab, (args.batch, args.max_len)).masked_fill(pad, 0)
        seg = torch.zeros_like(ids)
        labels = torch.randint(0, 3, (args.batch,))
        start = time.perf_counter()
        # The batch's copy to the device is in the step, as a loader's is.
        ids, seg, pad, labels = (z.to(device) for z in (ids, seg, pad, labels))
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = model(ids, seg, pad, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    sps = sorted(args.batch / t for t in times)
    print(json.dumps({
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "threads": args.threads,
        "cpu_capability": None if cuda else torch.backends.cpu.get_cpu_capability(),
        "batch": args.batch,
        "dropout": args.dropout,
        "attention_dropout": args.attention_dropout,
        "max_len": args.max_len,
        "shape": [args.layers, args.heads, args.hidden, args.intermediate, args.vocab],
        "samples_per_s_median": statistics.median(sps),
        "samples_per_s_min": sps[0],
        "samples_per_s_max": sps[-1],
        "ms_per_step_median": 1e3 * statistics.median(times),
    }))


if __name__ == "__main__":
    main()
