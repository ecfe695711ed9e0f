#!/usr/bin/env python3
"""A large corpus made from text already on the machine, for `kiln prepare`'s
benchmark (docs/PERFORMANCE.md): source files and docs under the given roots
(Python's library, Cargo's registry sources, /usr/share/doc, ...) as JSON
lines, a file a document, until --bytes of text. Files that are not UTF-8
are left out. Deterministic for the same machine: files in sorted order.

  make_corpus.py --out /tmp/corpus.jsonl --bytes 1100000000 ROOT...
"""
import argparse
import json
import os

EXTENSIONS = {".py", ".rs", ".md", ".txt", ".rst", ".c", ".h", ".toml", ".html", ".js", ".go", ".java"}


def files(roots):
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if os.path.splitext(name)[1] in EXTENSIONS:
                    yield os.path.join(dirpath, name)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--bytes", type=int, required=True, help="stop after this much text")
    p.add_argument("--text", action="store_true", help="write plain text (documents joined) instead of JSON lines")
    p.add_argument("roots", nargs="+")
    a = p.parse_args()
    written = 0
    docs = 0
    with open(a.out, "w", encoding="utf-8") as out:
        for path in files(a.roots):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip() or len(text) > 4 << 20:
                continue
            out.write(text + "\n" if a.text else json.dumps({"text": text, "path": path}) + "\n")
            written += len(text.encode("utf-8"))
            docs += 1
            if written >= a.bytes:
                break
    print(json.dumps({"out": a.out, "documents": docs, "text_bytes": written}))


if __name__ == "__main__":
    main()
