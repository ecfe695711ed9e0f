#!/usr/bin/env python3
"""Checks a folder written by `kiln export` with Hugging Face's own code.

    python3 scripts/check_hf_export.py runs/<run>/hf [--tolerance 1e-4]

Needs `torch`, `transformers` and `tokenizers` (pip install torch
transformers). It loads the folder as `GPT2LMHeadModel` and as a fast
tokenizer, then checks against `kiln_reference.json` (written by kiln at
export):

- the logits of `transformers` for the reference token ids match kiln's
  (largest absolute difference at most --tolerance);
- Python's `tokenizers` encodes the reference line to kiln's ids;
- the model generates (greedy) from the line.

Prints what it measured; exits 1 if a check fails. Not run by the tests or CI
(which have no torch); they run `scripts/gpt2_forward.py`, the same forward
pass in plain Python. See docs/EXPORT.md.
"""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    reference = json.loads((args.folder / "kiln_reference.json").read_text())
    model = GPT2LMHeadModel.from_pretrained(args.folder)
    model.eval()
    print(
        f"loaded {args.folder} with transformers {transformers.__version__}, torch {torch.__version__}: "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, "
        f"activation {model.config.activation_function}"
    )
    ok = True

    ids = torch.tensor([reference["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, :, : reference["logits_first_vocab_entries"]]
    kiln = torch.tensor(reference["logits"])
    diff = (logits - kiln).abs().max().item()
    scale = kiln.abs().max().item()
    same_argmax = bool((logits.argmax(-1) == kiln.argmax(-1)).all())
    passed = diff <= args.tolerance
    ok &= passed
    print(
        f"logits: {tuple(kiln.shape)} compared, max |transformers - kiln| = {diff:.3e} "
        f"(logits up to {scale:.2f}; tolerance {args.tolerance:g}); same argmax at every position: {same_argmax} "
        f"-> {'ok' if passed else 'FAILED'}"
    )

    text, kiln_ids = reference["text"], reference["text_ids"]
    py_ids = Tokenizer.from_file(str(args.folder / "tokenizer.json")).encode(text).ids
    fast = PreTrainedTokenizerFast.from_pretrained(args.folder)
    fast_ids = fast(text)["input_ids"]
    passed = py_ids == kiln_ids and fast_ids == kiln_ids
    ok &= passed
    print(
        f"tokenizer: {text[:40]!r}... -> {len(kiln_ids)} ids; tokenizers {'same' if py_ids == kiln_ids else 'DIFFERENT'}, "
        f"PreTrainedTokenizerFast {'same' if fast_ids == kiln_ids else 'DIFFERENT'} -> {'ok' if passed else 'FAILED'}"
    )

    # GPT-2 has learned positions: prompt and continuation fit n_positions.
    half = model.config.n_positions // 2
    prompt = fast(text, return_tensors="pt")["input_ids"][:, -half:]
    new = min(24, model.config.n_positions - prompt.shape[1])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    print(f"generate: {fast.decode(out[0, prompt.shape[1]:])!r}")
    print("all checks passed" if ok else "a check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
