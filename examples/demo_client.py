#!/usr/bin/env python3
"""The demo's client: a short multi-turn conversation through each gateway service with the
official `openai` Python client. Prints every answer, the routing decision the gateway reported in
its response headers (worker, rule, rule version, reason) and the prompt tokens the worker reused
from its prefix cache (usage.prompt_tokens_details.cached_tokens).

usage: demo_client.py GATEWAY_URL MODEL [MODEL ...]
       demo_client.py --admin ADMIN_URL      (print the gateway's view of its workers)
Exit status 1 when any request fails.
"""
import sys

import openai

QUESTIONS = [
    "What is the capital of France?",
    "And what river flows through it?",
    "Name one famous museum there.",
]


def converse(client, model):
    print(f"\n=== service for model `{model}` ===")
    messages = [{"role": "system", "content": "You are a concise assistant. Answer in one sentence."}]
    for turn, q in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": q})
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=32, temperature=0
        )
        resp = raw.parse()
        answer = resp.choices[0].message.content or ""
        usage = resp.usage
        cached = 0
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        h = raw.headers
        decision = {k: v for k, v in h.items() if k.lower().startswith("x-kvgate-") and k.lower() != "x-kvgate-ticket"}
        print(f"turn {turn} user: {q}")
        print(f"       assistant: {answer.strip()}")
        print(
            f"       routing: {decision}  prompt_tokens={usage.prompt_tokens if usage else '?'} "
            f"cached_tokens={cached} finish={resp.choices[0].finish_reason}"
        )
        messages.append({"role": "assistant", "content": answer})


def show_workers(admin_url):
    import json
    import urllib.request

    with urllib.request.urlopen(admin_url.rstrip("/") + "/admin/workers", timeout=10) as r:
        view = json.load(r)
    print(f"rules version {view.get('rules_version')}")
    for w in view["workers"]:
        ev = w.get("events", {})
        print(
            f"{w['id']}: healthy={w['healthy']} contract={w['contract']['state']} "
            f"indexed_blocks={w['indexed_blocks']} events={ev.get('state')} applied={ev.get('applied')}"
        )
    return 0


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--admin":
        return show_workers(sys.argv[2])
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    url = sys.argv[1].rstrip("/") + "/v1"
    client = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0, timeout=120)
    try:
        for model in sys.argv[2:]:
            converse(client, model)
    except openai.APIError as e:
        print(f"demo: request failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
