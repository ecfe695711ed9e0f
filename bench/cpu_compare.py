"""kiln against PyTorch eager on this CPU, in one sitting, interleaved: the
comparison of docs/PERFORMANCE.md ("At a glance") as one command.

Each round runs, for each kiln build given and each workload, `kiln bench`
and the PyTorch reference at the same shape (../shared/PEERS.md's: the GPT
at block 128, batch 32; the encoder padded to 128, batch 32, no dropout, an
optimizer step a batch), a pause between runs, kiln first in odd rounds and
PyTorch first (the whole round reversed) in even ones, so that neither side
always runs on a warmer or a quieter machine. The figure is the median of
the per-round ratios (kiln over PyTorch, each round's pair), with the
medians of each side; this machine's speed drifts between minutes, which
the pairing cancels and a single run would not.

    python3 bench/cpu_compare.py --kiln target/release/kiln --python ~/venv/bin/python
    python3 bench/cpu_compare.py --kiln target/release/kiln \
        --kiln-avx2 target/avx2/release/kiln --python ~/venv/bin/python --rounds 5

`--kiln` is compared with PyTorch as it runs; `--kiln-avx2` (a build
without the AVX-512 kernels: `cargo build --release -p kiln-cli
--no-default-features --features flex`) with PyTorch limited to AVX2
(`--avx2` of its scripts). `--python` is an interpreter that can import
torch (the scripts run on 2 threads, fp32, eager). `--workloads` picks
among `gpt` and `encoder` (the default, both), `encoder-dropout` (the
encoder with BERT's dropout, 0.1 on the hidden states and the attention
probabilities, on both sides) and `gpt-ddp` (the GPT's 32 rows as a job of
2 ranks × 16, one thread each: `kiln launch --nproc-per-node 2 bench lm`
against `python -m torch.distributed.run --nproc-per-node 2
pytorch_gpt.py`, DistributedDataParallel over gloo; each side's rate the
job's). `cargo xtask compare` builds the binaries and runs this.

Prints a table; `--out` writes every run (its command, the rates, the final
loss, PyTorch's `cpu_capability`) and the summary as JSON. Python's
standard library only. Exit 0 when every run succeeded, 1 when one failed
(its output's end is printed), 2 on bad arguments.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name → (kiln bench arguments, PyTorch script and arguments, the rate both print)
WORKLOADS = {
    "gpt": (
        ["bench", "lm", "model.max_length=128", "training.batch_size=32", "--steps", "24", "--warmup", "4"],
        ["pytorch_gpt.py", "--block", "128", "--batch", "32", "--steps", "24", "--warmup", "4"],
        "tokens_per_s_median",
    ),
    "encoder": (
        ["bench", "nli", "--pad-to-max-length", "training.batch_size=32", "model.dropout=0.0",
         "model.attention_dropout=0.0",
         "training.gradient_accumulation_steps=1", "--steps", "16", "--warmup", "4"],
        ["pytorch_encoder.py", "--batch", "32", "--steps", "16", "--warmup", "4"],
        "samples_per_s_median",
    ),
    # The encoder as BERT trains: dropout 0.1 on the hidden states and on
    # the attention probabilities, on both sides (kiln's fused dropout and
    # attention kernels' mask against PyTorch's dropout and SDPA's
    # dropout_p); not in the default set, `--workloads` names it.
    "encoder-dropout": (
        ["bench", "nli", "--pad-to-max-length", "training.batch_size=32", "model.dropout=0.1",
         "model.attention_dropout=0.1",
         "training.gradient_accumulation_steps=1", "--steps", "16", "--warmup", "4"],
        ["pytorch_encoder.py", "--batch", "32", "--steps", "16", "--warmup", "4",
         "--dropout", "0.1", "--attention-dropout", "0.1"],
        "samples_per_s_median",
    ),
}

# The data-parallel GPT: PEERS.md's 32 rows as 2 ranks × 16, one thread a
# rank, kiln's launcher against torchrun's DistributedDataParallel (gloo);
# both print the job's tokens/s. Not in the default set.
WORKLOADS["gpt-ddp"] = (
    ["launch", "--nproc-per-node", "2", "bench", "lm", "model.max_length=128", "training.batch_size=16",
     "--steps", "24", "--warmup", "4"],
    ["pytorch_gpt.py", "--block", "128", "--batch", "16", "--threads", "1", "--steps", "24", "--warmup", "4"],
    "tokens_per_s_median",
)

# How PyTorch's side of a workload is started, where it is not plain
# `python script`: torchrun's module, before the script.
TORCH_LAUNCHER = {"gpt-ddp": ["-m", "torch.distributed.run", "--nproc-per-node", "2"]}

# --tiny: the same runs at toy sizes, for checking the comparison itself.
TINY_KILN = {
    "gpt": ["bench", "lm", "model.layers=1", "model.heads=2", "model.hidden=32", "model.max_length=16",
            "training.batch_size=4", "--steps", "2", "--warmup", "1"],
    "encoder": ["bench", "nli", "--pad-to-max-length", "model.layers=1", "model.heads=2", "model.hidden=32",
                "model.intermediate=64", "model.max_length=16", "training.batch_size=4", "model.dropout=0.0",
                "model.attention_dropout=0.0",
                "training.gradient_accumulation_steps=1", "--steps", "2", "--warmup", "1"],
}
TINY_KILN["gpt-ddp"] = ["launch", "--nproc-per-node", "2", *TINY_KILN["gpt"]]
TINY_KILN["encoder-dropout"] = [
    a.replace("dropout=0.0", "dropout=0.1") for a in TINY_KILN["encoder"]
]


def run_json(cmd, cwd):
    """Runs `cmd`, returns (its JSON output or None, seconds, the end of its output)."""
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    tail = (p.stdout + p.stderr)[-2000:]
    if p.returncode != 0:
        return None, seconds, tail
    try:
        return json.loads(p.stdout), seconds, tail
    except json.JSONDecodeError:
        return None, seconds, tail


def one_run(side, pair, workload, args):
    """One kiln bench or one PyTorch script: a record of what it measured."""
    kiln_args, torch_args, rate_key = WORKLOADS[workload]
    if side == "kiln":
        if args.tiny:
            kiln_args = TINY_KILN[workload]
        if args.master_port and kiln_args[:1] == ["launch"]:
            kiln_args = ["launch", "--master-port", str(args.master_port), *kiln_args[1:]]
        cmd = [pair["kiln"], *kiln_args, "--json"]
        out, seconds, tail = run_json(cmd, args.workdir)
        bench = (out or {}).get("bench", {})
        rate = bench.get(rate_key)
        extra = {"final_loss": bench.get("final_loss"), "isa": bench.get("isa"),
                 "ms_per_step": bench.get("ms_per_step_median"),
                 "world_size": bench.get("world_size", 1)}
    else:
        script, *rest = torch_args
        launcher = TORCH_LAUNCHER.get(workload, [])
        if args.master_port and launcher:
            launcher = [*launcher, "--master-port", str(args.master_port)]
        cmd = [args.python, *launcher, os.path.join(args.scripts, script), *rest, *pair["torch_flags"]]
        out, seconds, tail = run_json(cmd, args.workdir)
        out = out or {}
        rate = out.get(rate_key)
        extra = {"final_loss": out.get("final_loss"), "cpu_capability": out.get("cpu_capability"),
                 "ms_per_step": out.get("ms_per_step_median"), "world_size": out.get("world_size", 1)}
    record = {"side": side, "pair": pair["name"], "workload": workload, "command": cmd,
              "seconds": round(seconds, 1), "rate": rate, "rate_unit": rate_key, **extra}
    if rate is None:
        record["error"] = tail
    return record


def round_order(number, pairs, workloads):
    """The runs of round `number` (from 1): kiln before PyTorch in odd rounds,
    and the whole sequence reversed in even ones."""
    runs = [(side, pair, w) for pair in pairs for w in workloads for side in ("kiln", "torch")]
    return runs if number % 2 == 1 else runs[::-1]


def summarize(records, pairs, workloads):
    """Per pair and workload: each side's median rate and the per-round ratios."""
    rows = []
    for pair in pairs:
        for w in workloads:
            ratios, kiln, torch = [], [], []
            for r in sorted({x["round"] for x in records}):
                got = {x["side"]: x["rate"] for x in records
                       if x["round"] == r and x["pair"] == pair["name"] and x["workload"] == w}
                if got.get("kiln") and got.get("torch"):
                    kiln.append(got["kiln"])
                    torch.append(got["torch"])
                    ratios.append(got["kiln"] / got["torch"])
            rows.append({
                "pair": pair["name"], "workload": w,
                "kiln_median": statistics.median(kiln) if kiln else None,
                "torch_median": statistics.median(torch) if torch else None,
                "ratios": [round(x, 3) for x in ratios],
                "median_ratio": statistics.median(ratios) if ratios else None,
            })
    return rows


def table(rows):
    lines = ["| builds | workload | kiln, median | PyTorch, median | per-round ratios | median ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        fmt = (lambda v: "—" if v is None else f"{v:,.1f}")
        ratio = "—" if r["median_ratio"] is None else f"**{r['median_ratio']:.2f}×**"
        lines.append(f"| {r['pair']} | {r['workload']} | {fmt(r['kiln_median'])} | {fmt(r['torch_median'])} "
                     f"| {' '.join(f'{x:.2f}' for x in r['ratios'])} | {ratio} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kiln", required=True, help="the kiln binary (the default build)")
    ap.add_argument("--kiln-avx2", help="a kiln built without AVX-512 kernels: against PyTorch --avx2")
    ap.add_argument("--python", default=sys.executable, help="an interpreter that imports torch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between runs")
    ap.add_argument("--workloads", default="gpt,encoder",
                    help="comma-separated: gpt, encoder, encoder-dropout (the encoder with BERT's dropout), "
                         "gpt-ddp (the GPT as 2 ranks × 16 rows: kiln launch against torchrun's DDP)")
    ap.add_argument("--scripts", default=os.path.join(ROOT, "bench"),
                    help="where pytorch_gpt.py and pytorch_encoder.py are")
    ap.add_argument("--master-port", type=int,
                    help="gpt-ddp's rendezvous port, both sides [default: each launcher's, 29500]")
    ap.add_argument("--out", help="write every run and the summary as JSON here")
    ap.add_argument("--tiny", action="store_true", help="toy kiln shapes (a check of the comparison itself)")
    args = ap.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        ap.error(f"--workloads: unknown {', '.join(bad) or '(none given)'}; "
                 f"the workloads are {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for flag, path in (("--kiln", args.kiln), ("--kiln-avx2", args.kiln_avx2)):
        if path is not None and not os.access(path, os.X_OK):
            ap.error(f"{flag} {path}: no executable there (build it first: cargo build --release -p kiln-cli)")
    args.kiln = os.path.abspath(args.kiln)
    args.workdir = ROOT
    pairs = [{"name": "kiln default, PyTorch as it runs", "kiln": args.kiln, "torch_flags": []}]
    if args.kiln_avx2:
        pairs.append({"name": "kiln AVX2-only, PyTorch --avx2", "kiln": os.path.abspath(args.kiln_avx2),
                      "torch_flags": ["--avx2"]})

    records, failed = [], False
    for number in range(1, args.rounds + 1):
        print(f"round {number}/{args.rounds}", file=sys.stderr)
        for side, pair, w in round_order(number, pairs, workloads):
            rec = one_run(side, pair, w, args)
            rec["round"] = number
            records.append(rec)
            shown = "failed" if rec["rate"] is None else f"{rec['rate']:,.1f} ({rec['rate_unit']})"
            print(f"  {side:5} {w:8} ({pair['name']}): {shown}", file=sys.stderr)
            if rec["rate"] is None:
                failed = True
                print(rec["error"], file=sys.stderr)
                if "No module named 'torch'" in rec["error"]:
                    print(f"cpu_compare: {args.python} cannot import torch; pass --python with an "
                          "interpreter that can (a virtual environment with `pip install torch`)",
                          file=sys.stderr)
            time.sleep(args.pause)
        if failed:
            break

    rows = summarize(records, pairs, workloads)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema": "kiln.cpu-compare/1", "rounds": args.rounds, "tiny": args.tiny,
                       "python": args.python, "runs": records, "summary": rows}, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
