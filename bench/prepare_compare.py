#!/usr/bin/env python3
"""`kiln prepare` with GPT-2's tokenizer against tiktoken's
`encode_ordinary_batch` on the same documents and threads, in interleaved
rounds (kiln first in odd rounds, tiktoken first in even ones): each side's
MB/s of text, kiln's peak resident memory (GNU time's, /usr/bin/time -v), and the median of the per-round ratios.

  prepare_compare.py --kiln target/release/kiln --python VENV/bin/python \\
      --vocab-bpe V --encoder-json E --threads 2 --rounds 3 CORPUS.jsonl

The tiktoken side is bench/gpt2_reference.py's `speed` (it needs tiktoken in
that interpreter; --vocab-bpe/--encoder-json where it cannot download
OpenAI's files). Each kiln round prepares into a fresh folder under --work,
removed afterwards.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_kiln(a, round_no):
    out = os.path.join(a.work, f"round{round_no}.store")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [a.kiln, "prepare", f"data.path={a.corpus}", "data.tokenizer=gpt2", f"--out={out}",
           f"--threads={a.threads}"]
    # GNU time's "Maximum resident set size" is kiln's own peak.
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"kiln prepare failed ({done.returncode}):\n{done.stderr}")
    peak_kib = next(int(l.split(":")[1]) for l in done.stderr.splitlines() if "Maximum resident set size" in l)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    tokens = sum(s["tokens"] for s in manifest["shards"])
    shutil.rmtree(out, ignore_errors=True)
    return {"side": "kiln", "seconds": seconds, "text_bytes": manifest["text_bytes"], "tokens": tokens,
            "mb_per_s": manifest["text_bytes"] / 1e6 / seconds,
            "peak_rss_mib": peak_kib / 1024}


def run_tiktoken(a):
    cmd = [a.python, os.path.join(HERE, "gpt2_reference.py"), "speed", f"--threads={a.threads}", a.corpus]
    if a.vocab_bpe:
        cmd[3:3] = ["--vocab-bpe", a.vocab_bpe, "--encoder-json", a.encoder_json]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"tiktoken's side failed ({done.returncode}):\n{done.stderr}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["side"] = "tiktoken"
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--vocab-bpe")
    p.add_argument("--encoder-json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default="/tmp/kiln-prepare-compare")
    p.add_argument("--out", help="write every run as JSON here")
    p.add_argument("corpus")
    a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    os.makedirs(a.work, exist_ok=True)
    runs, ratios = [], []
    for r in range(1, a.rounds + 1):
        pair = {}
        order = ["kiln", "tiktoken"] if r % 2 else ["tiktoken", "kiln"]
        for side in order:
            pair[side] = run_kiln(a, r) if side == "kiln" else run_tiktoken(a)
            pair[side]["round"] = r
            runs.append(pair[side])
            print(json.dumps(pair[side]), flush=True)
            time.sleep(2)
        ratios.append(pair["kiln"]["mb_per_s"] / pair["tiktoken"]["mb_per_s"])
    summary = {
        "kiln_mb_per_s": statistics.median(x["mb_per_s"] for x in runs if x["side"] == "kiln"),
        "tiktoken_mb_per_s": statistics.median(x["mb_per_s"] for x in runs if x["side"] == "tiktoken"),
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "threads": a.threads,
    }
    print(json.dumps(summary))
    if a.out:
        json.dump({"runs": runs, "summary": summary}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
