#!/usr/bin/env python3
"""Independent reference implementation of docs/block-keys.md (written from the document, not
from the Rust code). Prints the test vectors as JSON; the Rust test `vectors_from_docs` checks
that the document's vectors match the crate, and this script checks they match the document:

    python3 -m venv /tmp/v && /tmp/v/bin/pip install xxhash
    /tmp/v/bin/python prefix-index/tools/block_keys_reference.py --check docs/block-keys.md
"""
import hashlib
import json
import struct
import sys

import xxhash

DOMAIN = b"kvgate/block-keys/v1"


def lp(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def opt(s):
    return b"\x00" if s is None else b"\x01" + lp(s)


def seed_input(v):
    return (DOMAIN + lp(v["model_id"]) + lp(v["revision"]) + lp(v["template_sha256"])
            + lp(v["tokenizer_sha256"]) + struct.pack("<I", v["block_size"])
            + lp(v["algorithm"]) + opt(v["salt"]) + opt(v["adapter"]))


def chain(seed, algorithm, b, toks):
    """The keys (16 hex digits each) of the full blocks of `toks` in the namespace `seed`
    (32 bytes)."""
    d = seed[:8] if algorithm == "xxh3" else seed
    out = []
    for i in range(len(toks) // b):
        data = d + b"".join(struct.pack("<I", t) for t in toks[i * b:(i + 1) * b])
        if algorithm == "xxh3":
            d = struct.pack(">Q", xxhash.xxh3_64_intdigest(data))
        else:
            d = hashlib.sha256(data).digest()
        out.append(d[:8].hex())
    return out


def keys(v):
    seed = hashlib.sha256(seed_input(v)).digest()
    return seed.hex(), chain(seed, v["algorithm"], v["block_size"], v["tokens"])


PROFILE = {
    "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "revision": "main",
    "template_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "tokenizer_sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
}
T40 = [1, 4093, 198] + list(range(100, 137))          # 40 tokens: 2 full blocks of 16 + 8
T14 = [0, 1, 2, 3, 4294967295, 65536, 256, 49151, 7, 7, 7, 7, 42, 43]  # 3 blocks of 4 + 2


def cases():
    c = [
        ("xxh3-b16", "xxh3", 16, None, None, T40),
        ("xxh3-b16-salt", "xxh3", 16, "tenant-a", None, T40),
        ("sha256-b16", "sha256", 16, None, None, T40),
        ("sha256-b16-salt", "sha256", 16, "tenant-a", None, T40),
        ("xxh3-b4-chain", "xxh3", 4, None, None, T14),
        ("sha256-b4-chain-salt-adapter", "sha256", 4, "svc/chat", "lora-7", T14),
        ("xxh3-b4-empty-salt", "xxh3", 4, "", None, T14),
        ("xxh3-b16-short", "xxh3", 16, None, None, T14),
    ]
    for name, alg, b, salt, adapter, toks in c:
        v = dict(name=name, **PROFILE, block_size=b, algorithm=alg, salt=salt, adapter=adapter,
                 tokens=toks)
        v["seed_input"] = seed_input(v).hex()
        v["seed"], v["keys"] = keys(v)
        yield v


def doc_vectors(path):
    text = open(path).read()
    start = text.index("```json vectors") + len("```json vectors")
    return json.loads(text[start:text.index("```", start)])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        vs = doc_vectors(sys.argv[2])
        for v in vs:
            seed, ks = keys(v)
            assert seed_input(v).hex() == v["seed_input"], v["name"]
            assert (seed, ks) == (v["seed"], v["keys"]), v["name"]
        print(f"{len(vs)} vectors reproduced")
    else:
        objs = []
        for v in cases():
            fields = ",\n".join(f"  {json.dumps(k)}: {json.dumps(x)}" for k, x in v.items())
            objs.append("{\n" + fields + "\n}")
        print("[\n" + ",\n".join(objs) + "\n]")
