"""How far llama.cpp moves from its own committed reference when only one of its settings changes
(e.g. `-fa off`): the noise floor for engine/tests/vs_llamacpp.rs's agreement figures.

  .venv/bin/python3 scripts/llamacpp-self-agreement.py --server URL --fixture FILE

The server must run the fixture's model. Teacher-forced exactly as the Rust test does it: at
every position of every case the prompt is the case's prompt ids plus the fixture's greedy ids
before that position (one `/completion` with `n_predict` 1, no prompt cache), and the server's
top 5 there are compared with the fixture's. Prints, as the test does: positions, the largest
probability difference on the fixture's top-5 tokens, the mean |log-probability difference| over
them (a token missing from the server's top 5 is skipped here; the test looks it up in the full
distribution) and the positions where the greedy token differs, with both top-two gaps.
Driven by scripts/check-llamacpp-self-agreement.sh.
"""
import argparse
import json
import math
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--fixture", required=True)
    a = ap.parse_args()
    fx = json.load(open(a.fixture))
    positions, worst, diff_sum, diffs, differs = 0, 0.0, 0.0, 0, []
    for case in fx["cases"]:
        forced = [s["id"] for s in case["steps"]]
        for k, step in enumerate(case["steps"]):
            d = post(a.server + "/completion", {
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
        "fixture": a.fixture, "positions": positions,
        "largest_probability_difference": round(worst, 4),
        "mean_log_probability_difference": round(diff_sum / max(diffs, 1), 4),
        "greedy_differs": differs,
    }))


if __name__ == "__main__":
    main()
