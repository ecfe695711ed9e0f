#!/usr/bin/env python3
"""GPT-2's forward pass as `transformers` computes it, in plain Python (no
torch, no numpy), over a folder written by `kiln export`: a check of the
exported numbers that runs anywhere `python3` does (the tests run it).

    python3 scripts/gpt2_forward.py runs/<run>/hf [--tolerance 1e-4]
    python3 scripts/gpt2_forward.py runs/<run>/hf --text FILE [--stride N] [--expect-loss X]

Reads `model.safetensors` and `config.json` as `GPT2LMHeadModel` would
(`Conv1D` weights stored input × output, the query, key and value in
thirds of `c_attn`, LayerNorm's `layer_norm_epsilon`, the activation
`gelu` or `gelu_new`, the LM head tied to `wte`), runs the ids of
`kiln_reference.json` and compares the logits with kiln's. Prints the
largest difference; exits 1 above the tolerance. With `--text` it scores
a text as `kiln eval` does (a character-level tokenizer's only): windows of
the block, each moving on by the stride and scoring the tokens it moves on
by, every token but the first scored once; it prints the mean loss and
compares it with `--expect-loss`. For small models: it is
slow (every product in Python). `scripts/check_hf_export.py` checks the
same folder with `transformers` itself.
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path


def load_safetensors(path):
    """Tensor name -> (shape, flat list of floats); F32 only."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {meta['dtype']}, this script reads F32")
        start, end = meta["data_offsets"]
        count = (end - start) // 4
        out[name] = (meta["shape"], list(struct.unpack(f"<{count}f", body[start:end])))
    return out


def rows(flat, cols):
    return [flat[i : i + cols] for i in range(0, len(flat), cols)]


def conv1d(x, weight, bias):
    """`transformers`' Conv1D: x (T × in) @ weight (in × out) + bias."""
    (n_in, n_out), w = weight
    w = rows(w, n_out)
    b = bias[1]
    out = []
    for row in x:
        acc = list(b)
        for i, xi in enumerate(row):
            if xi:
                wi = w[i]
                for j in range(n_out):
                    acc[j] += xi * wi[j]
        out.append(acc)
    return out


def layer_norm(x, weight, bias, eps):
    g, b = weight[1], bias[1]
    out = []
    for row in x:
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        inv = 1.0 / math.sqrt(var + eps)
        out.append([(v - mean) * inv * gi + bi for v, gi, bi in zip(row, g, b)])
    return out


def gelu(x, kind):
    if kind == "gelu":
        return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))
    if kind in ("gelu_new", "gelu_pytorch_tanh"):
        return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise SystemExit(f"activation_function {kind!r} is not GPT-2's")


def forward(t, config, ids):
    c = config["n_embd"]
    heads = config["n_head"]
    d = c // heads
    eps = config["layer_norm_epsilon"]
    wte = rows(t["transformer.wte.weight"][1], c)
    wpe = rows(t["transformer.wpe.weight"][1], c)
    h = [[a + b for a, b in zip(wte[i], wpe[p])] for p, i in enumerate(ids)]
    n = len(ids)
    for layer in range(config["n_layer"]):
        p = f"transformer.h.{layer}."
        a = layer_norm(h, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = conv1d(a, t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"])
        y = [[0.0] * c for _ in range(n)]
        for head in range(heads):
            lo = head * d
            q = [r[lo : lo + d] for r in qkv]
            k = [r[c + lo : c + lo + d] for r in qkv]
            v = [r[2 * c + lo : 2 * c + lo + d] for r in qkv]
            for i in range(n):
                scores = [sum(qi * kj for qi, kj in zip(q[i], k[j])) / math.sqrt(d) for j in range(i + 1)]
                top = max(scores)
                e = [math.exp(s - top) for s in scores]
                total = sum(e)
                for j, ej in enumerate(e):
                    w = ej / total
                    for m in range(d):
                        y[i][lo + m] += w * v[j][m]
        y = conv1d(y, t[p + "attn.c_proj.weight"], t[p + "attn.c_proj.bias"])
        h = [[a + b for a, b in zip(r, s)] for r, s in zip(h, y)]
        m = layer_norm(h, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        f = conv1d(m, t[p + "mlp.c_fc.weight"], t[p + "mlp.c_fc.bias"])
        f = [[gelu(v, config["activation_function"]) for v in r] for r in f]
        f = conv1d(f, t[p + "mlp.c_proj.weight"], t[p + "mlp.c_proj.bias"])
        h = [[a + b for a, b in zip(r, s)] for r, s in zip(h, f)]
    h = layer_norm(h, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
    # The head is tied to the token embedding (as GPT-2's).
    return [[sum(a * b for a, b in zip(r, token)) for token in wte] for r in h]


def text_loss(tensors, config, folder, text, stride):
    """The mean negative log-likelihood of `text`'s tokens after the first,
    nats per token, and how many were scored."""
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    if model.get("type") != "WordLevel":
        raise SystemExit("--text reads a character-level (WordLevel) tokenizer only")
    vocab = model["vocab"]
    ids = [vocab[ch] for ch in text]
    block = config["n_positions"]
    stride = stride or block
    nats, scored, first = 0.0, 0, True
    while scored + 1 < len(ids):
        # Tokens scored so far are 1..=scored; this window scores the next ones.
        end = min(scored + 1 + (block if first else stride), len(ids))
        start = max(0, end - block - 1)
        logits = forward(tensors, config, ids[start : end - 1])
        for pos in range(scored + 1, end):
            row = logits[pos - start - 1]
            top = max(row)
            log_total = top + math.log(sum(math.exp(v - top) for v in row))
            nats += log_total - row[ids[pos]]
        scored, first = end - 1, False
    return nats / scored, scored


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--text", type=Path, help="score this text as `kiln eval` does")
    parser.add_argument("--stride", type=int, default=0, help="with --text [default: the block]")
    parser.add_argument("--expect-loss", type=float, help="with --text: kiln eval's loss")
    args = parser.parse_args()
    config = json.loads((args.folder / "config.json").read_text())
    if args.text:
        tensors = load_safetensors(args.folder / "model.safetensors")
        loss, scored = text_loss(tensors, config, args.folder, args.text.read_text(), args.stride)
        ok = args.expect_loss is None or abs(loss - args.expect_loss) <= args.tolerance
        print(
            f"text: {scored} tokens scored, loss {loss:.6f} nats/token"
            + (
                f", kiln {args.expect_loss:.6f}, |difference| {abs(loss - args.expect_loss):.3e} "
                f"(tolerance {args.tolerance:g}) -> {'ok' if ok else 'FAILED'}"
                if args.expect_loss is not None
                else ""
            )
        )
        return 0 if ok else 1
    reference = json.loads((args.folder / "kiln_reference.json").read_text())
    tensors = load_safetensors(args.folder / "model.safetensors")
    logits = forward(tensors, config, reference["input_ids"])
    kept = reference["logits_first_vocab_entries"]
    diff = max(abs(a - b) for r, k in zip(logits, reference["logits"]) for a, b in zip(r[:kept], k))
    scale = max(abs(v) for k in reference["logits"] for v in k)
    biases = max(
        abs(v) for name, (_, values) in tensors.items() if name.endswith("attn.c_attn.bias") for v in values
    )
    ok = diff <= args.tolerance
    print(
        f"logits: {len(logits)} × {kept} compared, max |gpt2_forward - kiln| = {diff:.3e} "
        f"(logits up to {scale:.2f}, c_attn biases up to {biases:.3e}; tolerance {args.tolerance:g}) "
        f"-> {'ok' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
