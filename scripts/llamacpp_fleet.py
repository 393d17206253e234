"""Driver of scripts/check-llamacpp-fleet.sh: the official `openai` client against the gateway
in front of two llama-server engines behind kvgate sidecars.

  check: multi-turn conversations through the round-robin and the KV-exact services, whole and
         streamed; every answer names its worker and its receipt; the KV-exact second turn goes
         back to the engine that served the first and that engine reports cached tokens.
  direct: a conversation's first turn through the KV-exact service; then two clients straight
         to the llama-server that served it (around its sidecar: no gateway sees them) stream
         long answers into both of its slots. The sidecar reads the engine's own GET /slots, so
         the gateway's /admin/workers shows them in that worker's reported load (the time until
         it does is printed), and the conversation's next turn goes to the other engine; when
         the direct clients hang up, the report empties again.
  kill:  starts a long stream through the KV-exact service, kills (SIGKILL) the sidecar serving
         it after the first chunks, and checks that the client sees the stream fail; then that
         the next request is served by the other sidecar.
Exit status 0 when every check holds.
"""
import json
import os
import signal
import sys
import threading
import time
import urllib.request

import openai

BASE = os.environ["KVGATE_BASE_URL"]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)


def fail(msg):
    print(f"llamacpp_fleet: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def chat(model, messages, max_tokens=12, stream=False):
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        c = raw.parse()
        return raw.headers, c.choices[0].message.content or "", c.usage
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        text, usage = "", None
        for chunk in resp.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        return resp.headers, text, usage


def check():
    system = {"role": "system", "content": "You are a concise assistant."}
    topic = "Explain how a paged KV cache lets an inference server reuse a shared prompt prefix. " * 4
    for model in ("smol-rr", "smol"):
        for stream in (False, True):
            msgs = [system, {"role": "user", "content": topic + f"({model}, stream={stream})"}]
            h1, a1, u1 = chat(model, msgs, stream=stream)
            if not a1:
                fail(f"{model} stream={stream}: empty answer")
            for h in ("x-kvgate-worker", "x-kvgate-receipt", "x-request-id"):
                if not h1.get(h):
                    fail(f"{model} stream={stream}: no {h} header")
            msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter, please."}]
            h2, a2, u2 = chat(model, msgs, stream=stream)
            cached = (u2.prompt_tokens_details.cached_tokens or 0) if u2 and u2.prompt_tokens_details else 0
            print(
                f"llamacpp_fleet: {model} stream={stream}: turn 1 on {h1['x-kvgate-worker']}, "
                f"turn 2 on {h2['x-kvgate-worker']}, turn 2 cached {cached} of {u2.prompt_tokens if u2 else '?'} prompt tokens"
            )
            if model == "smol":
                if h1["x-kvgate-worker"] != h2["x-kvgate-worker"]:
                    fail("KV-exact sent the second turn to another engine")
                if cached < 32:
                    fail(f"the engine reported only {cached} cached tokens on the KV-exact second turn")


def reported_load(worker):
    with urllib.request.urlopen(os.environ["KVGATE_ADMIN_URL"] + "/admin/workers", timeout=5) as r:
        workers = json.load(r)["workers"]
    w = next(w for w in workers if w["id"] == worker)
    return w.get("reported_load") or {}


def direct():
    engines = json.loads(os.environ["KVGATE_ENGINE_URLS"])
    system = {"role": "system", "content": "You are a concise assistant."}
    msgs = [system, {"role": "user", "content": "Explain what a load balancer does for a fleet of servers. " * 6}]
    h1, a1, _ = chat("smol", msgs)
    w = h1["x-kvgate-worker"]
    other = next(k for k in engines if k != w)
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And for LLM servers?"}]
    before = reported_load(w)
    print(f"llamacpp_fleet: turn 1 on {w}; its reported load before: {before}")

    stop = threading.Event()
    seen = []

    def direct_client(n):
        engine = openai.OpenAI(base_url=engines[w] + "/v1", api_key="unused", max_retries=0, timeout=300)
        with engine.chat.completions.with_streaming_response.create(
            model="any",
            messages=[{"role": "user", "content": f"Tell a very long story, part {n}."}],
            max_tokens=3000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as resp:
            for _ in resp.parse():
                seen.append(n)
                if stop.is_set():
                    return  # closing the stream cancels the engine's task

    threads = [threading.Thread(target=direct_client, args=(n,), daemon=True) for n in range(2)]
    t0 = time.time()
    for t in threads:
        t.start()
    while True:
        load = reported_load(w)
        if load.get("running", 0) >= 2 and load.get("decode_tokens", 0) > 4000:
            break
        if time.time() - t0 > 30:
            stop.set()
            fail(f"the direct clients never showed in {w}'s reported load: {load}")
        time.sleep(0.02)
    print(
        f"llamacpp_fleet: {w}'s reported load shows the direct clients {1000 * (time.time() - t0):.0f} ms "
        f"after they started ({len(seen)} chunks streamed by then): {load}"
    )
    h2, a2, _ = chat("smol", msgs)
    reason = h2.get("x-kvgate-route-reason")
    print(f"llamacpp_fleet: turn 2 on {h2['x-kvgate-worker']} (reason {reason})")
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if h2["x-kvgate-worker"] != other:
        fail(f"turn 2 stayed on {w}, busy with direct clients (reason {reason})")
    t1 = time.time()
    while reported_load(w).get("running", 1) != 0:
        if time.time() - t1 > 30:
            fail(f"{w}'s reported load did not empty after the direct clients left: {reported_load(w)}")
        time.sleep(0.05)
    print(f"llamacpp_fleet: {w}'s reported load empty {1000 * (time.time() - t1):.0f} ms after the direct clients hung up")


def kill():
    pids = json.loads(os.environ["KVGATE_SIDECAR_PIDS"])
    msgs = [{"role": "user", "content": "Write a very long story about a lighthouse keeper. " * 3}]
    killed = None
    try:
        with client.chat.completions.with_streaming_response.create(
            model="smol", messages=msgs, max_tokens=400, temperature=0, stream=True
        ) as resp:
            worker = resp.headers["x-kvgate-worker"]
            n = 0
            for _ in resp.parse():
                n += 1
                if n == 3:
                    killed = worker
                    os.kill(pids[worker], signal.SIGKILL)
                    print(f"llamacpp_fleet: killed sidecar {worker} (pid {pids[worker]}) after {n} chunks")
        fail("the stream completed although its sidecar was killed")
    except (openai.APIError, openai.APIConnectionError, Exception) as e:  # noqa: BLE001
        if killed is None:
            fail(f"the stream failed before the kill: {e!r}")
        print(f"llamacpp_fleet: the client saw the stream break: {type(e).__name__}")
    # The gateway notices (failed connect / health) and serves from the other sidecar.
    deadline = time.time() + 20
    while True:
        try:
            h, a, _ = chat("smol", [{"role": "user", "content": "Hello after the kill."}])
            if h["x-kvgate-worker"] != killed and a:
                print(f"llamacpp_fleet: next request served by {h['x-kvgate-worker']}")
                return
        except openai.APIError as e:
            print(f"llamacpp_fleet: retrying after {e!r}")
        if time.time() > deadline:
            fail("no request succeeded on the surviving sidecar within 20 s")
        time.sleep(0.5)


if __name__ == "__main__":
    {"check": check, "direct": direct, "kill": kill}[sys.argv[1]]()
    print(f"llamacpp_fleet: {sys.argv[1]}: PASS")
