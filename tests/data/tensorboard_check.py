"""Reads a kiln run's TensorBoard event files with TensorBoard's own reader
(`EventAccumulator`, from the `tensorboard` package) and compares every
scalar with the run's metrics.jsonl (and a cross-validation's
cv_summary.json): each record's values under the tags listed below, at its
step, exactly once (a resumed run's superseded events must be dropped by
TensorBoard as metrics.jsonl was cut). The tag table is written here from
metrics.jsonl's fields, not taken from kiln, so that the two are checked
against each other.

    python3 tests/data/tensorboard_check.py RUN_DIR

Prints one line per folder checked and exits 1 on any difference.
"""

import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEP = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "ms_per_step": "perf/ms_per_step",
    "data_wait_pct": "perf/data_wait_pct",
    "tokens_seen": "train/tokens_seen",
    "mfu": "perf/mfu",
    "comm_pct": "perf/comm_pct",
}


def expected_of(record):
    """(tag, value) pairs a metrics.jsonl record should have become."""
    kind = record["kind"]
    out = []
    if kind == "step":
        for field, tag in STEP.items():
            if record.get(field) is not None:
                out.append((tag, record[field]))
        gpu = record.get("device_memory", False)
        out.append(("memory/gpu_bytes" if gpu else "memory/bytes", record["memory_bytes"]))
        out.append(("memory/gpu_peak_bytes" if gpu else "memory/peak_bytes", record["peak_memory_bytes"]))
    elif kind == "eval":
        out.append(("eval/val_loss", record["val_loss"]))
        if "train_loss" in record:
            out.append(("eval/train_loss", record["train_loss"]))
        if "scores" in record:
            out.append(("eval/accuracy", record["scores"]["accuracy"]))
            out.append(("eval/macro_f1", record["scores"]["macro_f1"]))
        if record.get("score") is not None:
            out.append(("eval/score", record["score"]))
    elif kind == "skipped":
        out.append(("precision/skipped_step", 1.0))
        if record.get("loss_scale") is not None:
            out.append(("precision/loss_scale", record["loss_scale"]))
    elif kind == "loss_scale":
        out.append(("precision/loss_scale", record["scale"]))
    return out


def read(folder):
    """tag → [(step, value)] as TensorBoard reads `folder/tensorboard`."""
    acc = EventAccumulator(os.path.join(folder, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    return scalars, tags


def close(a, b):
    # TensorBoard keeps f32: compare at f32's precision.
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30) or (math.isnan(a) and math.isnan(b))


def compare(name, expected, actual):
    """Every expected (tag, step, value) once in `actual`, and nothing else."""
    problems = []
    want = {}
    for tag, step, value in expected:
        want.setdefault(tag, []).append((step, value))
    for tag in sorted(set(want) | set(actual)):
        w = sorted(want.get(tag, []))
        a = sorted(actual.get(tag, []))
        if [s for s, _ in w] != [s for s, _ in a]:
            problems.append(f"{name}: {tag}: steps {[s for s, _ in a]}, metrics have {[s for s, _ in w]}")
            continue
        for (s, wv), (_, av) in zip(w, a):
            if not close(float(wv), float(av)):
                problems.append(f"{name}: {tag} at step {s}: {av}, metrics have {wv}")
    return problems


def check_run(folder):
    expected = []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                expected += [(tag, record["step"], v) for tag, v in expected_of(record)]
    actual, tags = read(folder)
    problems = compare(folder, expected, actual)
    if "config" not in tags.get("tensors", []):
        problems.append(f"{folder}: no `config` text (tensors: {tags.get('tensors')})")
    print(f"{folder}: {len(expected)} scalars, {len(actual)} tags", flush=True)
    return problems


def check_cv(folder):
    with open(os.path.join(folder, "cv_summary.json")) as f:
        summary = json.load(f)
    expected = []
    for fold in summary["folds"]:
        k = fold["fold"]
        expected += [
            ("cv/fold_accuracy", k, fold["scores"]["accuracy"]),
            ("cv/fold_macro_f1", k, fold["scores"]["macro_f1"]),
            ("cv/fold_val_loss", k, fold["val_loss"]),
            ("cv/fold_majority_baseline", k, fold["majority_baseline"]),
        ]
    last = len(summary["folds"])
    for key in ("accuracy_mean", "accuracy_std", "macro_f1_mean", "macro_f1_std"):
        expected.append((f"cv/{key}", last, summary[key]))
    actual, _ = read(folder)
    problems = compare(folder, expected, actual)
    print(f"{folder}: {len(expected)} cross-validation scalars", flush=True)
    for fold in summary["folds"]:
        problems += check_run(os.path.join(folder, f"fold-{fold['fold']}"))
    return problems


def main():
    folder = sys.argv[1]
    if os.path.exists(os.path.join(folder, "cv_summary.json")):
        problems = check_cv(folder)
    else:
        problems = check_run(folder)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
