#!/usr/bin/env python3
"""One Markdown table row from a `kvgate bench --engine-model` report and a `llama-bench -o json`
output of the same file and thread count (scripts/bench-architectures.sh,
scripts/bench-vs-llamacpp.sh).

Usage: engine_bench_row.py KVGATE_TXT LLAMA_JSON [--full]
Prints: prefill | pp | ratio | decode | tg | ratio   (tok/s; ratios kvgate / llama.cpp)
--full adds: 8-stream aggregate | its multiple of one stream | 16-stream aggregate |
             cached-16-after-1024 as % of uncached
llama-bench's decode figure is its one `n_gen > 0` run (tg64 or tg128, whatever was asked).
"""
import json
import re
import sys


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    report = open(sys.argv[1]).read()

    def grab(pattern: str) -> float:
        m = re.search(pattern, report)
        if not m:
            sys.exit(f"engine_bench_row: no figure {pattern!r} in {sys.argv[1]}:\n{report}")
        return float(m.group(1))

    kp = grab(r"prefill, 512 tokens, 1 stream \| ([0-9.]+) tok/s")
    kd = grab(r"\| decode, 1 stream \| ([0-9.]+) tok/s")
    runs = json.load(open(sys.argv[2]))
    lp = next(r["avg_ts"] for r in runs if r["n_prompt"] == 512 and r["n_gen"] == 0)
    ld = next(r["avg_ts"] for r in runs if r["n_prompt"] == 0 and r["n_gen"] > 0)
    row = f"{kp:.0f} | {lp:.0f} | {kp / lp:.2f}x | {kd:.1f} | {ld:.1f} | {kd / ld:.2f}x"
    if len(sys.argv) == 4 and sys.argv[3] == "--full":
        a8 = grab(r"decode, 8 streams \(aggregate\) \| ([0-9.]+) tok/s")
        a16 = grab(r"decode, 16 streams \(aggregate\) \| ([0-9.]+) tok/s")
        pct = grab(r"after 1024 cached \| [0-9.]+ ms \(([0-9.]+)% of uncached\)")
        row += f" | {a8:.0f} | {a8 / kd:.2f}x | {a16:.0f} | {pct:.1f}%"
    print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
