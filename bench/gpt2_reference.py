#!/usr/bin/env python3
"""GPT-2's ids as tiktoken gives them: the reference for kiln's built-in GPT-2
tokenizer, and the reference speed for `kiln prepare` (docs/PERFORMANCE.md).

tiktoken downloads OpenAI's `vocab.bpe` and `encoder.json` on first use; on a
machine without that network access, pass the files (the `tiktoken-rs`
crate ships copies under its `assets/`): `vocab.bpe` is checked against the
sha256 tiktoken's `gpt2` encoding pins, so the ranks are OpenAI's.

  ids:   gpt2_reference.py ids --vocab-bpe V --encoder-json E > crates/data/test_data/gpt2_ids.json
  speed: gpt2_reference.py speed --vocab-bpe V --encoder-json E --threads 2 FILE...
  verify: gpt2_reference.py verify --vocab-bpe V --encoder-json E --store STORE FILE.jsonl
          (kiln prepare's store of FILE.jsonl holds tiktoken's ids of each document,
          after an <|endoftext|>: the documents as multisets, since the two splits
          interleave them)
"""
import argparse
import json
import os
import sys
import time

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# What tiktoken's own `gpt2` constructor pins (tiktoken_ext/openai_public.py).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

SAMPLES = [
    "Hello world",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs\n\n\n\nfour newlines, then    four spaces before this",
    "I'm sure you'll see they've done it; we'd say it's John's CAN'T",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 3 != 0]  # comment\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{v:?}\");\n}\n",
    "Numbers: 3.14159, 1,000,000, 2026-12-01, 0x7fff_ffff and 1e-8",
    "Ünïcödé — naïve café, déjà vu; Ελληνικά, русский, עברית, العربية",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉🔥 and 👩‍👩‍👧‍👦 families, ZWJ and \u00a0no-break\u200bspaces",
    "<|endoftext|> is ordinary text here",
    "URLs: https://example.com/path?q=1&r=two#frag and emails a.b@c.org",
    "\n",
    " ",
    "a" * 300,
    "   \n\t  \r\n mixed whitespace \u3000 ideographic",
]


def encoding(vocab_bpe, encoder_json):
    if vocab_bpe is None:
        return tiktoken.get_encoding("gpt2")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=vocab_bpe,
        encoder_json_file=encoder_json,
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=None,
    )
    # The pattern and special token tiktoken's `gpt2` uses.
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["ids", "speed", "verify"])
    p.add_argument("--store", help="verify: the store kiln prepared from the files")
    p.add_argument("--vocab-bpe")
    p.add_argument("--encoder-json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-bytes", type=int, default=16 << 20, help="text handed to one encode_ordinary_batch call")
    p.add_argument("files", nargs="*")
    a = p.parse_intermixed_args()
    if (a.vocab_bpe is None) != (a.encoder_json is None):
        p.error("--vocab-bpe and --encoder-json go together")
    enc = encoding(a.vocab_bpe, a.encoder_json)
    if a.what == "ids":
        cases = [json.dumps({"text": t, "ids": enc.encode_ordinary(t)}, ensure_ascii=False) for t in SAMPLES]
        sys.stdout.write('{"tiktoken": "%s", "cases": [\n%s\n]}\n' % (tiktoken.__version__, ",\n".join(cases)))
        return
    if not a.files:
        p.error("speed and verify need files")
    if a.what == "verify":
        verify(enc, a.store, a.files)
        return
    # As nanoGPT's prepare.py and llm.c's fineweb.py do: documents in batches
    # to encode_ordinary_batch, which runs tiktoken's Rust core on a thread pool.
    total_bytes = 0
    total_tokens = 0
    started = time.perf_counter()
    for path in a.files:
        with open(path, encoding="utf-8") as f:
            batch, size = [], 0
            for line in f:
                # JSON lines: the document's text, as kiln reads it.
                doc = json.loads(line)["text"] if path.endswith(".jsonl") else line
                batch.append(doc)
                size += len(doc.encode("utf-8"))
                if size >= a.batch_bytes:
                    total_tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=a.threads)))
                    total_bytes += size
                    batch, size = [], 0
            if batch:
                total_tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=a.threads)))
                total_bytes += size
    seconds = time.perf_counter() - started
    print(json.dumps({"tiktoken": tiktoken.__version__, "threads": a.threads, "bytes": total_bytes,
                      "tokens": total_tokens, "seconds": seconds, "mb_per_s": total_bytes / 1e6 / seconds}))


def verify(enc, store, files):
    import collections
    import glob
    import struct

    manifest = json.load(open(os.path.join(store, "manifest.json")))
    stream = []
    for shard in manifest["shards"]:
        with open(os.path.join(store, shard["file"]), "rb") as f:
            magic, version, count = struct.unpack("<3i", f.read(12))
            assert (magic, version) == (20240520, 1), (shard, magic, version)
            f.seek(1024)
            stream.extend(struct.unpack("<%dH" % count, f.read(2 * count)))
    ours = collections.Counter()
    doc = None
    for t in stream:
        if t == 50256:
            if doc is not None:
                ours[tuple(doc)] += 1
            doc = []
        else:
            doc.append(t)
    ours[tuple(doc)] += 1
    theirs = collections.Counter()
    for path in files:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        for ids in enc.encode_ordinary_batch(texts, num_threads=2):
            theirs[tuple(ids)] += 1
    docs = sum(theirs.values())
    missing = theirs - ours
    extra = ours - theirs
    print(json.dumps({"documents": docs, "tokens_store": len(stream),
                      "tokens_tiktoken": sum(len(k) * v for k, v in theirs.items()) + docs,
                      "documents_differing": sum(missing.values()), "store_documents_not_in_tiktoken": sum(extra.values())}))
    if missing or extra:
        sys.exit(1)


if __name__ == "__main__":
    main()
