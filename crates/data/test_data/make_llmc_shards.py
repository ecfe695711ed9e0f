#!/usr/bin/env python3
"""Writes llm.c shards for kiln-data's round-trip test with a writer of its
own that follows the layout of llm.c's `write_datafile`
(dev/data/data_common.py): 256 little-endian int32 (magic, version, token
count, zeros), then the tokens; "gpt-2" is magic 20240520 version 1 with
uint16 tokens, "llama-3" magic 20240801 version 7 with uint32 ones.

gpt2_shard.bin and llama3_shard.bin hold the tokens range(0, 70000, 997),
the uint16 one modulo 65536. Run it in this folder."""
import struct

FORMATS = {"gpt-2": (20240520, 1, "H"), "llama-3": (20240801, 7, "I")}


def write_shard(path, tokens, model):
    magic, version, code = FORMATS[model]
    assert len(tokens) < 2**31
    header = [magic, version, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%d%s" % (len(tokens), code), *tokens))


if __name__ == "__main__":
    tokens = list(range(0, 70000, 997))
    write_shard("gpt2_shard.bin", [t % 65536 for t in tokens], "gpt-2")
    write_shard("llama3_shard.bin", tokens, "llama-3")
