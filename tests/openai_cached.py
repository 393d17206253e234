#!/usr/bin/env python3
"""A cached prefix through the gateway's KV-exact service, with the official `openai` client.

Usage:
  python3 tests/openai_cached.py BASE_URL MODEL cold
      one chat request (greedy, nothing cached yet); prints {"worker", "content", "cached"}
  python3 tests/openai_cached.py BASE_URL MODEL cached COLD_JSON
      the same conversation again, non-streaming and streaming: on the worker that served the
      cold request, with cached prompt tokens, and the same greedy answer as the cold run; then
      once more with a fresh `cache_salt` (a namespace nothing is cached in): cold again, and the
      same answer; then a conversation the chat template refuses (a system message for a
      template that raises on one): the client gets a 400 with a stable code.
      Prints "cached flow ok" and a JSON summary.

Run by the Rust test `e2e_gemma3::gemma3_through_the_gateway_with_the_openai_client`, which
starts the workers and the gateway, passes the gateway's URL and waits between the two phases
until the gateway's index holds the cold request's blocks.
"""
import json
import sys
import uuid

MESSAGES = [
    {"role": "user", "content": "You are helping with a geography quiz. Answer in one short "
                                "sentence and never repeat the question. What is the capital "
                                "of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what is the capital of Italy?"},
]
MAX_TOKENS = 8


def cached_tokens(usage) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0


def chat(client, model, extra_body=None):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=extra_body)
    r = raw.parse()
    assert r.choices and isinstance(r.choices[0].message.content, str), r
    assert r.usage is not None and r.usage.prompt_tokens > 0, r.usage
    return {
        "worker": raw.headers.get("x-kvgate-worker"),
        "reason": raw.headers.get("x-kvgate-route-reason"),
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "cached": cached_tokens(r.usage),
        "prompt_tokens": r.usage.prompt_tokens,
    }


def main() -> int:
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    base_url, model, phase = sys.argv[1:4]
    try:
        import openai
    except ImportError:
        print("the `openai` package is not installed: run scripts/setup.sh", file=sys.stderr)
        return 3
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    if phase == "cold":
        cold = chat(client, model)
        assert cold["worker"], "the gateway did not name the worker"
        assert cold["content"], "empty cold answer"
        print(json.dumps(cold))
        return 0
    if phase != "cached" or len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    cold = json.loads(sys.argv[4])

    # The same conversation: the worker holding the prefix, prompt tokens served from its cache,
    # the cold answer.
    warm = chat(client, model)
    assert warm["worker"] == cold["worker"], (cold, warm)
    assert warm["cached"] >= 16, f"no cached prefix reported: {warm}"
    assert warm["content"] == cold["content"], f"cached answer differs from cold: {cold} {warm}"

    # Streamed, with usage in the last chunk: the same tokens.
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "no usage chunk"
    assert cached_tokens(usage) >= 16, f"streamed request found no cached prefix: {usage}"
    assert text == cold["content"], f"streamed cached answer differs: {text!r} vs {cold['content']!r}"

    # A fresh salt: a namespace with nothing cached (cold on whichever worker), same answer.
    salted = chat(client, model, extra_body={"cache_salt": "fresh-" + uuid.uuid4().hex})
    assert salted["cached"] == 0, f"a fresh salt found cached tokens: {salted}"
    assert salted["content"] == cold["content"], f"salted cold answer differs: {cold} {salted}"

    # A conversation the template refuses: a clear 400, not a crash.
    try:
        client.chat.completions.create(
            model=model, max_tokens=2,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        code = body.get("code") or (body.get("error") or {}).get("code")
        assert code, f"400 without a code: {e.body}"
        refused = code
    else:
        raise AssertionError("a system message was accepted by a template that refuses it")

    print("cached flow ok")
    print(json.dumps({"cold": cold, "warm": warm, "streamed_cached": cached_tokens(usage),
                      "salted": salted, "refused_code": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
