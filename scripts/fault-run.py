#!/usr/bin/env python3
"""A hostile client's and operator's run against the built `kvgate` binary.

Starts two simulated workers (`--engine sim`, tickets required, small queues) and a gateway with
a decision log and an admin token over three services (round robin, KV-exact salted by a header,
KV-exact behind API keys with rate limits), then tries every fault in the table it prints:
malformed and oversized bodies through the gateway and directly, forged / expired / replayed /
misdirected tickets, the workers' side doors, admin without or with bad tokens, invalid rules by
the API, by file and by SIGHUP, 10x overload, `kill -9` of a worker mid-stream and its restart
(replays refused across it), SIGTERM of a worker mid-stream (it drains), SIGTERM of the gateway
and its restart over its stored responses (`--response-store-file`), a full worker's 429
retried on another worker, tenant keys, limits and cache isolation, cancellation, `promtool`
on both servers, the receipts audit, and key files read by OpenSSL.

    .venv/bin/python3 scripts/fault-run.py [--bin target/debug/kvgate] [--keep DIR]

Build first (`cargo build`); the pinned model must be in models/ (scripts/fetch-model.sh). Uses
only the standard library, `cryptography` (from scripts/setup.sh's .venv) and promtool
(.cache/tools/bin). Exit status 0 when every case passes. Not part of CI (it starts real
processes and sleeps through rate-limit windows: about a minute).
"""

import argparse
import base64
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path(os.environ.get("KVGATE_MODEL_DIR", ROOT / "models")) / "SmolLM2-135M-Instruct.Q4_1.gguf"
ADMIN_TOKEN = "fault-run-admin-token"

results = []


def case(name):
    """Decorator that runs the case at once and records PASS/FAIL with its message."""

    def run(f):
        t = time.time()
        try:
            detail = f() or ""
            results.append((name, True, detail, time.time() - t))
        except AssertionError as e:
            results.append((name, False, str(e)[:300], time.time() - t))
        except Exception as e:  # a crash of the case itself is a failure too
            results.append((name, False, f"{type(e).__name__}: {e}"[:300], time.time() - t))
        return f

    return run


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Reply:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return {}

    def code(self):
        return (self.json().get("error") or {}).get("code")

    def h(self, name):
        return self.headers.get(name.lower())

    def __repr__(self):
        return f"{self.status} {self.body[:200]!r}"


def request(port, method, path, body=None, headers=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"content-type": "application/json"}
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    try:
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, data.decode("utf-8", "replace"))
    finally:
        c.close()


def raw_expect_continue(port, length, headers=None):
    """POST a body of `length` bytes with `Expect: 100-continue`: the server must answer before
    the body is sent. Returns the answer (the body is never sent when it is refused)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
                  + f"content-length: {length}\r\nexpect: 100-continue\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100"):
            # Told to send a body the server will refuse: that is the failure under test.
            return Reply(100, {}, "100 Continue for a body over the limit")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return Reply(status, headers, rest.decode("utf-8", "replace"))
    finally:
        s.close()


def chat(model, text, max_tokens=4, **extra):
    b = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    b.update(extra)
    return b


def b64u(b):
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def unb64u(s):
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class Ticket:
    """A ticket header split into its payload object and signature."""

    def __init__(self, header):
        p, s = header.split(".")
        self.payload = json.loads(unb64u(p))
        self.sig = unb64u(s)

    @staticmethod
    def sign(payload, key):
        msg = b"kvgate.ticket.v1\n" + canonical(payload)
        return b64u(canonical(payload)) + "." + b64u(key.sign(msg))


class Proc:
    def __init__(self, name, args, log):
        self.name, self.args, self.log = name, args, log
        self.p = None

    def start(self):
        self.out = open(self.log, "ab")
        self.p = subprocess.Popen(self.args, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill9(self):
        if self.p and self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()

    def stop(self):
        if self.p and self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()


def wait_http(port, path="/ready", timeout=60, want=200, headers=None):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            r = request(port, "GET", path, headers=headers, timeout=5)
            if r.status == want:
                return r
            last = r
        except OSError as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"port {port}{path} not {want} after {timeout}s: {last}")


class Run:
    def __init__(self, binary, work):
        self.bin, self.work = str(binary), Path(work)
        self.keys = self.work / "keys"
        self.gw_pub = self.work / "gateway-pub"
        self.workers = {}
        self.wport = {}
        subprocess.run([self.bin, "keygen", "--out", str(self.keys), "--name", "gateway"], check=True,
                       stdout=subprocess.DEVNULL)
        self.gw_pub.mkdir()
        shutil.copy(self.keys / "gateway.pub", self.gw_pub / "gateway.pub")
        from cryptography.hazmat.primitives import serialization

        self.gw_key = serialization.load_pem_private_key((self.keys / "gateway.key").read_bytes(), None)

    def start_worker(self, wid, port=None, running=4, waiting=4):
        port = port or free_port()
        self.wport[wid] = port
        args = [self.bin, "worker", "--engine", "sim", "--id", wid, "--listen", f"127.0.0.1:{port}",
                "--model", str(MODEL), "--state-dir", str(self.work / wid), "--gateway-keys", str(self.gw_pub),
                "--require-ticket", "--max-running", str(running), "--max-waiting", str(waiting),
                "--admission-timeout-ms", "200", "--sim-decode-us-base", "3000", "--max-body-bytes", str(1 << 20)]
        p = Proc(wid, args, self.work / f"{wid}.log")
        p.start()
        self.workers[wid] = p
        wait_http(port)
        return port

    def write_rules(self, text=None):
        (self.work / "rules.toml").write_text(text if text is not None else self.rules)

    def start_gateway(self):
        prof = request(self.wport["w1"], "GET", "/v1/profile").json()
        self.acme_key, self.beta_key = "acme-secret-key", "beta-secret-key"
        sha = lambda k: hashlib.sha256(k.encode()).hexdigest()
        self.rules = f"""
[gateway]
health_interval_ms = 200

[[workers]]
id = "w1"
url = "http://127.0.0.1:{self.wport['w1']}"

[[workers]]
id = "w2"
url = "http://127.0.0.1:{self.wport['w2']}"

[[pools]]
id = "all"
workers = ["w1", "w2"]

[[profiles]]
id = "smol"
model_id = "{prof['model_id']}"
revision = "{prof['revision']}"
source = {{ gguf = "{MODEL}" }}
template_sha256 = "{prof['template_sha256']}"
tokenizer_sha256 = "{prof['tokenizer_sha256']}"
block_size = {prof['block_size']}
hash_algorithm = "{prof['hash_algorithm']}"
context_limit = {prof['context_limit']}
native_reserve_tokens = 0

[[tenants]]
id = "acme"
api_keys_sha256 = ["{sha(self.acme_key)}"]

[[tenants]]
id = "beta"
api_keys_sha256 = ["{sha(self.beta_key)}"]
requests_per_second = 0.5
request_burst = 3

[[services]]
name = "rr"
pool = "all"
match = {{ models = ["rr"] }}
max_body_bytes = 2097152
rule = {{ type = "round_robin" }}

[[services]]
name = "exact"
pool = "all"
match = {{ models = ["smol"] }}
rule = {{ type = "kv_exact", profile = "smol", salt = {{ mode = "tenant_header", header = "x-tenant-id" }} }}

[[services]]
name = "secure"
pool = "all"
match = {{ models = ["secure"] }}
auth = "api_key"
rule = {{ type = "kv_exact", profile = "smol", salt = {{ mode = "tenant" }} }}
"""
        self.write_rules()
        self.gport, self.aport = free_port(), free_port()
        args = [self.bin, "gateway", "--rules", str(self.work / "rules.toml"), "--listen", f"127.0.0.1:{self.gport}",
                "--admin", f"127.0.0.1:{self.aport}", "--key", str(self.keys / "gateway.key"),
                "--admin-token", ADMIN_TOKEN, "--decision-log", str(self.work / "decisions.jsonl"),
                "--response-store-file", str(self.work / "responses.jsonl")]
        self.gateway_args = args
        self.gateway = Proc("gateway", args, self.work / "gateway.log")
        self.gateway.start()
        self.wait_gateway()

    def restart_gateway(self):
        """SIGTERM the gateway (it drains and exits) and start it again on the same ports."""
        self.gateway.stop()
        self.gateway = Proc("gateway", self.gateway_args, self.work / "gateway-restarted.log")
        self.gateway.start()
        self.wait_gateway()

    def wait_gateway(self):
        wait_http(self.aport, "/admin/rules", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        # Both workers healthy in the gateway's view.
        end = time.time() + 30
        while time.time() < end:
            w = self.admin("GET", "/admin/workers").json()
            items = w.get("workers", w) if isinstance(w, dict) else w
            healthy = {i.get("id") for i in items if i.get("healthy")} if isinstance(items, list) else set()
            if healthy >= {"w1", "w2"}:
                break
            time.sleep(0.1)

    def gw(self, method, path, body=None, headers=None, timeout=30):
        return request(self.gport, method, path, body, headers, timeout)

    def admin(self, method, path, body=None, token=ADMIN_TOKEN):
        h = {"authorization": f"Bearer {token}"} if token else {}
        return request(self.aport, method, path, body, h)

    def worker(self, wid, method, path, body=None, headers=None):
        return request(self.wport[wid], method, path, body, headers)

    def tickets(self):
        """(ticket header, worker, request id) of every routed decision so far."""
        out = []
        p = self.work / "decisions.jsonl"
        for line in p.read_text().splitlines() if p.exists() else []:
            d = json.loads(line)
            if d.get("ticket") and d.get("status") == 200:
                out.append((d["ticket"], d["worker"], d["request_id"]))
        return out

    def fresh_ticket(self, wid):
        """Route one RR request until it lands on `wid`; returns its ticket header."""
        for _ in range(6):
            r = self.gw("POST", "/v1/chat/completions", chat("rr", "ticket please", 1))
            assert r.status == 200, r
            if r.h("x-kvgate-worker") == wid:
                rid = r.h("x-request-id")
                for _ in range(50):
                    for t, w, i in self.tickets():
                        if i == rid:
                            return t
                    time.sleep(0.1)  # the decision log is fsynced in batches
        raise AssertionError(f"no request reached {wid}")

    def stop(self):
        for p in [getattr(self, "gateway", None), *self.workers.values()]:
            if p:
                p.stop()


def expect(r, status, code=None):
    assert r.status == status, f"expected {status} {code or ''}, got {r}"
    if code:
        assert r.code() == code, f"expected code {code}, got {r}"
    if status >= 400:
        j = r.json()
        assert set(j.get("error", {})) >= {"message", "type", "code"}, f"not an OpenAI error: {r}"
    return f"{r.status} {r.code() or ''}".strip()


def cases(run: Run):
    g = run.gw
    big = "x" * (3 << 20)

    # ---- bodies through the gateway ----
    @case("gw: malformed JSON -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", "{nope"), 400, "invalid_json")

    @case("gw: empty body -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", b""), 400, "invalid_json")

    @case("gw: JSON array body -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", "[1,2]"), 400, "invalid_json")

    @case("gw: body over every service's cap (17 MiB) -> 413 before reading it")
    def _():
        return expect(raw_expect_continue(run.gport, 17 << 20), 413, "request_too_large")

    @case("gw: valid JSON over its service's max_body_bytes (3 MiB > 2 MiB) -> 413")
    def _():
        body = json.dumps({"model": "rr", "pad": big, "messages": []})
        return expect(g("POST", "/v1/chat/completions", body), 413, "request_too_large")

    @case("gw: messages not a list (kv_exact) -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", {"model": "smol", "messages": "hi"}), 400)

    @case("gw: message without content or role (kv_exact) -> 400")
    def _():
        b = {"model": "smol", "messages": [{"name": "x"}]}
        return expect(g("POST", "/v1/chat/completions", b), 400)

    @case("gw: prompt over the context limit -> 400 context_length_exceeded")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("smol", "token " * 20000)), 400,
                      "context_length_exceeded")

    @case("gw: max_tokens over the context -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("smol", "hi", 10 ** 6)), 400, "context_length_exceeded")

    @case("gw: unknown model -> 404 service_not_found")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("nope", "hi")), 404, "service_not_found")

    @case("gw: PUT on chat completions -> 405")
    def _():
        return expect(g("PUT", "/v1/chat/completions", chat("rr", "hi")), 405, "method_not_allowed")

    @case("gw: GET on chat completions -> 405")
    def _():
        return expect(g("GET", "/v1/chat/completions"), 405, "method_not_allowed")

    @case("gw: bad parameter passes the worker's 400 through")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("rr", "hi", temperature=-3)), 400)

    @case("gw: cache_salt refused by a header-salted service without allow_body_salt")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("smol", "hi", cache_salt="s")), 400)

    @case("gw: a normal request is served with a receipt")
    def _():
        r = g("POST", "/v1/chat/completions", chat("smol", "hello there"))
        expect(r, 200)
        assert r.h("x-kvgate-receipt"), r.headers
        return f"200 via {r.h('x-kvgate-worker')}"

    @case("gw: JSON mode -> a JSON object, or a prefix of one when max_tokens cuts it")
    def _():
        r = g("POST", "/v1/chat/completions", chat("smol", "json please", max_tokens=24,
                                                   response_format={"type": "json_object"}))
        expect(r, 200)
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        assert text.lstrip().startswith("{"), text
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text
        return f"200 {choice['finish_reason']}"

    @case("gw: json_schema with a keyword it cannot enforce (look-ahead pattern) -> 400 unsupported_parameter")
    def _():
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x(?=y)"}}}
        body = chat("smol", "hi", response_format={"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": schema}})
        return expect(g("POST", "/v1/chat/completions", body), 400, "unsupported_parameter")

    @case("gw: json_schema with pattern, date-time, ipv4 and bounded numbers -> an answer that holds them")
    def _():
        import datetime
        import ipaddress
        import re
        schema = {"type": "object", "additionalProperties": False,
                  "required": ["sku", "when", "ip", "qty", "ratio"],
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                 "when": {"type": "string", "format": "date-time"},
                                 "ip": {"type": "string", "format": "ipv4"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9, "multipleOf": 3},
                                 "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}}}
        # The simulated engine draws random tokens (whitespace runs included): some answers
        # run out of tokens; every finished one must hold the schema.
        done = []
        for seed in range(6):
            r = g("POST", "/v1/chat/completions", chat(
                "smol", "an order as JSON", max_tokens=400, seed=seed, temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}))
            expect(r, 200)
            choice = r.json()["choices"][0]
            if choice["finish_reason"] != "stop":
                continue
            v = json.loads(choice["message"]["content"])
            assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", v["sku"]), v
            datetime.datetime.fromisoformat(v["when"].replace("Z", "+00:00"))
            ipaddress.IPv4Address(v["ip"])
            assert v["qty"] in (3, 6, 9) and 0 < v["ratio"] <= 0.5, v
            done.append(v)
        assert done, "no answer finished"
        return f"{len(done)}/6 finished, all valid: " + json.dumps(done[0])[:70]

    @case("gw: hostile json_schema ($ref chain of 5000, nesting of 5000) -> 400, nothing crashes")
    def _():
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
        defs["d5000"] = {"type": "object"}
        chain = {"$ref": "#/$defs/d0", "$defs": defs}
        r1 = g("POST", "/v1/chat/completions", chat("smol", "hi", response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": chain}}))
        expect(r1, 400, "unsupported_parameter")
        nested = '{"type":"object","properties":{"a":' * 5000 + '{"type":"string"}' + "}}" * 5000
        raw = ('{"model":"smol","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
               '"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":'
               + nested + "}}}")
        r2 = g("POST", "/v1/chat/completions", raw.encode(),
               headers={"content-type": "application/json"})
        expect(r2, 400)
        ok = g("POST", "/v1/chat/completions", chat("smol", "still there?"))
        expect(ok, 200)
        return f"{r1.status} {r1.code()}, {r2.status} {r2.code()}, then 200"

    @case("gw: forced tool call (named, required) -> tool_calls; bad tool_choice / parameters -> 400")
    def _():
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
                     "type": "object", "properties": {"x": {"type": "integer"}}}}},
                 {"type": "function", "function": {"name": "g"}}]
        named = g("POST", "/v1/chat/completions", chat(
            "smol", "call f", max_tokens=40, tools=tools,
            tool_choice={"type": "function", "function": {"name": "f"}}))
        expect(named, 200)
        call = named.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "f", named.json()
        expect(g("POST", "/v1/chat/completions", chat("smol", "x", tools=tools, tool_choice={
            "type": "function", "function": {"name": "nope"}})), 400, "invalid_value")
        expect(g("POST", "/v1/chat/completions", chat("smol", "x", tool_choice="required")),
               400, "invalid_value")
        bad = [{"type": "function", "function": {"name": "h", "parameters": {
            "type": "object", "properties": {"d": {"type": "string", "format": "iri"}}}}}]
        r = g("POST", "/v1/chat/completions", chat("smol", "x", tools=bad, tool_choice="required"))
        expect(r, 400, "unsupported_parameter")
        return f"f({call['arguments'][:40]}); 400 unknown name, 400 no tools, 400 {r.json()['error']['param']}"

    @case("gw: /v1/responses -> a response object, stored and continued; unknown previous_response_id, images -> 400 by name")
    def _():
        r = g("POST", "/v1/responses", json.dumps({"model": "smol", "input": "hello",
                                                   "max_output_tokens": 4}).encode(),
              headers={"content-type": "application/json"})
        expect(r, 200)
        assert r.json()["object"] == "response" and r.json()["output"], r.json()
        r2 = g("POST", "/v1/responses", json.dumps({"model": "smol", "input": "x",
                                                    "previous_response_id": "resp_1"}).encode(),
               headers={"content-type": "application/json"})
        expect(r2, 400, "previous_response_not_found")
        rid = r.json()["id"]
        r4 = g("POST", "/v1/responses", json.dumps({"model": "smol", "input": "and?",
                                                    "previous_response_id": rid,
                                                    "max_output_tokens": 4}).encode(),
               headers={"content-type": "application/json"})
        expect(r4, 200)
        assert r4.json()["usage"]["input_tokens"] > r.json()["usage"]["input_tokens"], r4.json()
        expect(g("GET", f"/v1/responses/{rid}"), 200)
        expect(g("DELETE", f"/v1/responses/{rid}"), 200)
        expect(g("GET", f"/v1/responses/{rid}"), 404, "response_not_found")
        r3 = g("POST", "/v1/responses", json.dumps({"model": "smol", "input": [{"role": "user",
               "content": [{"type": "input_image", "image_url": "x"}]}]}).encode(),
               headers={"content-type": "application/json"})
        expect(r3, 400, "unsupported_parameter")
        g_ = g("GET", "/v1/responses")
        expect(g_, 405)
        return (f"{r.json()['status']}; continued {r4.json()['usage']['input_tokens']} input tokens; "
                f"400 {r2.json()['error']['code']}, 400 {r3.json()['error']['param']}; GET 405")

    @case("gw: completion echo + logprobs, max_tokens 0 -> the prompt scored; echo 'yes', max_tokens 0 alone -> 400")
    def _():
        body = {"model": "smol", "prompt": "The capital of France is Paris", "max_tokens": 0,
                "echo": True, "logprobs": 2}
        r = g("POST", "/v1/completions", json.dumps(body).encode(),
              headers={"content-type": "application/json"})
        expect(r, 200)
        v = r.json()
        lp = v["choices"][0]["logprobs"]
        assert v["choices"][0]["text"] == body["prompt"], v
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == v["usage"]["prompt_tokens"], v
        assert v["usage"]["completion_tokens"] == 0, v["usage"]
        bad = g("POST", "/v1/completions", json.dumps({**body, "echo": "yes"}).encode(),
                headers={"content-type": "application/json"})
        expect(bad, 400, "invalid_type")
        zero = g("POST", "/v1/completions", json.dumps({"model": "smol", "prompt": "x",
                                                          "max_tokens": 0}).encode(),
                 headers={"content-type": "application/json"})
        expect(zero, 400, "invalid_value")
        return (f"{len(lp['tokens'])} prompt tokens scored, "
                f"ln p(' Paris') = {lp['token_logprobs'][-1]:.2f}; 400 echo, 400 max_tokens")

    @case("gw: n=3 -> three choices, one receipt; n=17 and n=0 -> 400 invalid_value")
    def _():
        r = g("POST", "/v1/chat/completions", chat("smol", "three please", max_tokens=5, n=3,
                                                  temperature=1.0, seed=1))
        expect(r, 200)
        v = r.json()
        assert [c["index"] for c in v["choices"]] == [0, 1, 2], v
        assert v["usage"]["completion_tokens"] == 15, v["usage"]
        for bad in (17, 0):
            expect(g("POST", "/v1/chat/completions", chat("smol", "x", n=bad)), 400, "invalid_value")
        return f"{len(v['choices'])} choices, {v['usage']['completion_tokens']} tokens; 400 for 17 and 0"

    @case("admin: cordon w1 -> new requests avoid it; uncordon -> it serves again")
    def _():
        r = run.admin("POST", "/admin/workers/w1/cordon")
        assert r.status == 200 and r.json()["cordoned"] is True, r
        seen = {g("POST", "/v1/chat/completions", chat("rr", f"c{i}")).h("x-kvgate-worker")
                for i in range(6)}
        assert "w1" not in seen, seen
        r = run.admin("POST", "/admin/workers/w1/uncordon")
        assert r.status == 200 and r.json()["cordoned"] is False, r
        back = {g("POST", "/v1/chat/completions", chat("rr", f"u{i}")).h("x-kvgate-worker")
                for i in range(6)}
        assert "w1" in back, back
        return f"cordoned: {sorted(seen)}; lifted: {sorted(back)}"

    # ---- directly to a worker ----
    w = run.worker

    @case("worker: no ticket -> 401 ticket_required")
    def _():
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi")), 401, "ticket_required")

    @case("worker: garbage ticket -> 401 malformed")
    def _():
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi"), {"x-kvgate-ticket": "a.b"}),
                      401, "malformed")

    t = Ticket(run.fresh_ticket("w1"))

    @case("worker: flipped signature byte -> 401 bad_signature")
    def _():
        sig = bytearray(t.sig)
        sig[0] ^= 1
        hdr = b64u(canonical(t.payload)) + "." + b64u(bytes(sig))
        p = dict(t.payload)
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi"),
                        {"x-kvgate-ticket": hdr, "x-request-id": p["request_id"]}), 401, "bad_signature")

    @case("worker: ticket by an unknown key -> 401 unknown_key")
    def _():
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        p = dict(t.payload, key_id="00000000000000ff", request_id="forged-1")
        hdr = Ticket.sign(p, Ed25519PrivateKey.generate())
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi"),
                        {"x-kvgate-ticket": hdr, "x-request-id": "forged-1"}), 401, "unknown_key")

    @case("worker: expired ticket (genuinely signed) -> 401 ticket_expired")
    def _():
        now = int(time.time() * 1000)
        p = dict(t.payload, request_id="old-1", issued_at_ms=now - 600_000, expires_at_ms=now - 540_000)
        hdr = Ticket.sign(p, run.gw_key)
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi"),
                        {"x-kvgate-ticket": hdr, "x-request-id": "old-1"}), 401, "ticket_expired")

    @case("worker: ticket for w1 sent to w2 -> 401 ticket_wrong_worker")
    def _():
        return expect(w("w2", "POST", "/v1/chat/completions", chat("m", "hi"),
                        {"x-kvgate-ticket": Ticket.sign(dict(t.payload), run.gw_key),
                         "x-request-id": t.payload["request_id"]}), 401, "ticket_wrong_worker")

    @case("worker: replayed ticket -> 401 ticket_replayed")
    def _():
        hdr = Ticket.sign(dict(t.payload), run.gw_key)
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "hi"),
                        {"x-kvgate-ticket": hdr, "x-request-id": t.payload["request_id"]}), 401, "ticket_replayed")

    @case("worker: oversized body with a valid ticket -> 413, and the ticket is not used up")
    def _():
        p = dict(t.payload, request_id="big-1")
        h = {"x-kvgate-ticket": Ticket.sign(p, run.gw_key), "x-request-id": "big-1"}
        expect(raw_expect_continue(run.wport["w1"], 3 << 20, h), 413)
        return expect(w("w1", "POST", "/v1/chat/completions", chat("m", "small now", 1), h), 200)

    @case("worker: malformed JSON with no ticket -> 401 before parsing")
    def _():
        r = w("w1", "POST", "/v1/chat/completions", "{nope")
        assert r.status in (400, 401), r
        return f"{r.status} {r.code()}"

    for path, method in [("/v1/tokenize", "POST"), ("/v1/kv/events", "GET"), ("/v1/receipts/x", "GET")]:
        @case(f"worker: side door {method} {path} without the access token -> 401")
        def _(path=path, method=method):
            body = {"prompt": "hi"} if method == "POST" else None
            return expect(w("w1", method, path, body), 401, "access_required")

    # ---- admin plane ----
    @case("admin: no token -> 401")
    def _():
        return expect(run.admin("GET", "/admin/rules", token=None), 401, "unauthorized")

    @case("admin: wrong token -> 401")
    def _():
        return expect(run.admin("GET", "/admin/rules", token="wrong"), 401, "unauthorized")

    def version():
        return run.admin("GET", "/admin/rules").json().get("version")

    @case("admin: invalid service by API -> 400 rules_rejected, version unchanged")
    def _():
        v = version()
        r = run.admin("PUT", "/admin/services/bad", {"name": "bad", "pool": "nope", "rule": {"type": "round_robin"}})
        expect(r, 400, "rules_rejected")
        assert version() == v, f"version moved {v} -> {version()}"
        return f"400, version {v}"

    @case("ops: invalid rules file (watch) and SIGHUP -> refused, still serving")
    def _():
        v = version()
        run.write_rules("this is [not toml")
        time.sleep(1.0)
        os.kill(run.gateway.p.pid, signal.SIGHUP)
        time.sleep(0.5)
        assert version() == v, f"version moved {v} -> {version()}"
        r = g("POST", "/v1/chat/completions", chat("rr", "still there?"))
        run.write_rules()
        expect(r, 200)
        return f"version {v} kept"

    # ---- tenants ----
    @case("tenants: no API key -> 401 invalid_api_key")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("secure", "hi")), 401, "invalid_api_key")

    @case("tenants: wrong API key -> 401")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("secure", "hi"), {"authorization": "Bearer nope"}),
                      401, "invalid_api_key")

    @case("tenants: body cache_salt from an authenticated tenant -> 400")
    def _():
        return expect(g("POST", "/v1/chat/completions", chat("secure", "hi", cache_salt="tenant:beta"),
                        {"authorization": f"Bearer {run.acme_key}"}), 400)

    @case("tenants: another tenant never reuses the first one's cached prefix")
    def _():
        text = "A long shared system prompt for isolation. " * 12
        a = {"authorization": f"Bearer {run.acme_key}"}
        r1 = g("POST", "/v1/chat/completions", chat("secure", text), a)
        expect(r1, 200)
        hit = None
        for _ in range(30):
            time.sleep(0.1)
            r2 = g("POST", "/v1/chat/completions", chat("secure", text), a)
            hit = r2.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            if hit:
                break
        assert hit, "acme never hit its own cache"
        rb = g("POST", "/v1/chat/completions", chat("secure", text), {"authorization": f"Bearer {run.beta_key}"})
        expect(rb, 200)
        cb = rb.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        assert cb == 0, f"beta reused {cb} cached tokens of acme"
        return f"acme cached {hit}, beta 0"

    @case("tenants: over the request rate -> 429 with Retry-After")
    def _():
        h = {"authorization": f"Bearer {run.beta_key}"}
        statuses = [g("POST", "/v1/chat/completions", chat("secure", "rate"), h) for _ in range(5)]
        limited = [r for r in statuses if r.status == 429]
        assert limited, [r.status for r in statuses]
        assert limited[0].code() == "rate_limit_exceeded" and limited[0].h("retry-after"), limited[0]
        return f"statuses {[r.status for r in statuses]}, Retry-After {limited[0].h('retry-after')}"

    # ---- overload ----
    @case("overload: 40 concurrent long requests -> only 200/429/503, with Retry-After, gateway fine")
    def _():
        out = []
        lock = threading.Lock()

        def one(i):
            try:
                r = g("POST", "/v1/chat/completions", chat("rr", f"load {i}", 200), timeout=60)
            except Exception as e:
                r = Reply(0, {}, str(e))
            with lock:
                out.append(r)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(40)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        bad = [r for r in out if r.status not in (200, 429, 503)]
        assert not bad, bad[:3]
        refused = [r for r in out if r.status in (429, 503)]
        assert refused, "10x overload was never refused (queues not bounded?)"
        assert all(r.h("retry-after") for r in refused), [r.headers for r in refused[:2]]
        expect(g("POST", "/v1/chat/completions", chat("rr", "after the storm", 1)), 200)
        return f"{sum(r.status == 200 for r in out)} served, {len(refused)} refused"

    # ---- cancellation ----
    @case("cancel: a client leaving mid-stream frees the worker's sequence")
    def _():
        s = socket.create_connection(("127.0.0.1", run.gport))
        body = json.dumps(chat("rr", "stream and leave", 2000, stream=True)).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        got = s.recv(4096)
        assert b"200" in got.split(b"\r\n")[0], got[:100]
        time.sleep(0.3)
        s.close()
        end = time.time() + 10
        while time.time() < end:
            running = 0
            for wid in ("w1", "w2"):
                m = run.worker(wid, "GET", "/metrics").body
                for line in m.splitlines():
                    if line.startswith("kvgate_worker_running_sequences "):
                        running += float(line.split()[1])
            if running == 0:
                return "running sequences back to 0"
            time.sleep(0.2)
        raise AssertionError("a sequence kept running after the client left")

    def stream_on_w1(text, max_tokens):
        """A stream through the round-robin service that landed on w1 (retried until one does),
        its first bytes read: (connection, response)."""
        for _ in range(6):
            c = http.client.HTTPConnection("127.0.0.1", run.gport, timeout=30)
            c.request("POST", "/v1/chat/completions", json.dumps(chat("rr", text, max_tokens, stream=True)),
                      {"content-type": "application/json"})
            resp = c.getresponse()
            if resp.getheader("x-kvgate-worker") == "w1":
                resp.read1(256)
                return c, resp
            resp.read()
            c.close()
        raise AssertionError("no stream landed on w1")

    # ---- kill -9 mid-stream, restart, replay across the restart ----
    @case("kill -9: a worker killed mid-stream; traffic moves; restart rejoins; replays stay refused")
    def _():
        t1 = Ticket(run.fresh_ticket("w1"))
        c, resp = stream_on_w1("long", 3000)
        run.workers["w1"].kill9()
        try:
            rest = resp.read()
        except Exception as e:
            rest = str(e).encode()
        assert b"[DONE]" not in rest, "a killed worker's stream claimed completion"
        c.close()
        served = [g("POST", "/v1/chat/completions", chat("rr", f"after kill {i}", 1)) for i in range(6)]
        assert all(r.status == 200 for r in served), [r for r in served if r.status != 200][:2]
        assert {r.h("x-kvgate-worker") for r in served[2:]} == {"w2"}, [r.h("x-kvgate-worker") for r in served]
        run.start_worker("w1", run.wport["w1"])
        end = time.time() + 20
        while time.time() < end:
            ws = {g("POST", "/v1/chat/completions", chat("rr", "back?", 1)).h("x-kvgate-worker") for _ in range(4)}
            if "w1" in ws:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("w1 never got traffic again")
        r = w("w1", "POST", "/v1/chat/completions", chat("m", "replay"),
              {"x-kvgate-ticket": Ticket.sign(dict(t1.payload), run.gw_key), "x-request-id": t1.payload["request_id"]})
        expect(r, 401, "ticket_replayed")
        return "stream cut without [DONE]; w2 took over; w1 rejoined; replay 401 after restart"

    # ---- a rolling restart: SIGTERM drains ----
    @case("SIGTERM: a worker stopped mid-stream drains; its stream completes; no request fails; it rejoins")
    def _():
        c, resp = stream_on_w1("drain me", 300)
        w1 = run.workers["w1"]
        os.killpg(w1.p.pid, signal.SIGTERM)
        served = [g("POST", "/v1/chat/completions", chat("rr", f"during the drain {i}", 1)) for i in range(10)]
        assert all(r.status == 200 for r in served), [(r.status, r.body[:120]) for r in served if r.status != 200][:2]
        rest = resp.read()
        c.close()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        code = w1.p.wait(30)
        assert code == 0, f"exit {code}"
        run.start_worker("w1", run.wport["w1"])
        end = time.time() + 20
        while time.time() < end:
            if "w1" in {g("POST", "/v1/chat/completions", chat("rr", "back?", 1)).h("x-kvgate-worker") for _ in range(4)}:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("w1 never got traffic again")
        return f"stream finished with [DONE]; 10/10 served during the drain ({sorted({r.h('x-kvgate-worker') for r in served})}); exit 0; rejoined"

    # ---- refusals: a full worker's 429 goes to the next candidate ----
    @case("refusals: a full worker (429) -> the gateway serves the request on another")
    def _():
        # w3 runs one sequence and queues one; services over the pool [w3, w2], with and without
        # refusal retries.
        run.start_worker("w3", running=1, waiting=1)
        run.rules += f"""
[[workers]]
id = "w3"
url = "http://127.0.0.1:{run.wport['w3']}"

[[pools]]
id = "cramped"
workers = ["w3", "w2"]

[[services]]
name = "cramped"
pool = "cramped"
match = {{ models = ["cramped"] }}
rule = {{ type = "round_robin" }}

[[services]]
name = "cramped0"
pool = "cramped"
match = {{ models = ["cramped0"] }}
rule = {{ type = "round_robin" }}
upstream = {{ refused_retries = 0 }}
"""
        run.write_rules()
        expect(run.admin("POST", "/admin/reload"), 200)
        end = time.time() + 20
        while time.time() < end:
            w = run.admin("GET", "/admin/workers").json()
            items = w.get("workers", w) if isinstance(w, dict) else w
            if any(i.get("id") == "w3" and i.get("healthy") for i in items):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("w3 never healthy in the gateway's view")

        # Six at once, 30 tokens each (~100 ms): three reach w3, which runs one, queues one and
        # refuses one; w2 has room for the three others and the refused one.
        def burst(model):
            out, lock = [], threading.Lock()

            def one(i):
                r = g("POST", "/v1/chat/completions", chat(model, f"burst {i}", 30), timeout=60)
                with lock:
                    out.append(r)

            ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            return out

        plain = burst("cramped0")
        refused = [r for r in plain if r.status != 200]
        assert refused, "w3 never refused: the burst did not overlap"
        codes = sorted({json.loads(r.body)["error"]["code"] for r in refused})
        for r in refused:
            expect(r, 429)
            assert json.loads(r.body)["error"]["code"] in ("queue_full", "admission_timeout"), r
            assert r.h("x-kvgate-worker") == "w3" and r.h("retry-after"), r.headers
        time.sleep(0.5)  # both workers idle again
        retried = burst("cramped")
        assert all(r.status == 200 for r in retried), [(r.status, r.body[:120]) for r in retried if r.status != 200]
        time.sleep(0.3)  # batched fsync of the decision log
        ids = {r.h("x-request-id") for r in retried}
        lines = [json.loads(l) for l in (run.work / "decisions.jsonl").read_text().splitlines()]
        again = [d for d in lines if d.get("phase") == "retried" and d["request_id"] in ids]
        assert again and all(d["worker"] == "w3" and d["status"] == 429 for d in again), again[:2]
        return (f"refused_retries 0: {len(refused)}/6 answered 429 {'/'.join(codes)} by w3; default: 6/6 served, "
                f"{len(again)} refused attempts retried on w2")

    # ---- observability and audit ----
    promtool = shutil.which("promtool") or str(ROOT / ".cache/tools/bin/promtool")
    for who, port, path, hdr in [("gateway", run.aport, "/metrics", {"authorization": f"Bearer {ADMIN_TOKEN}"}),
                                 ("worker", run.wport["w2"], "/metrics", {})]:
        @case(f"metrics: promtool check metrics on the {who} (classic text)")
        def _(port=port, path=path, hdr=hdr):
            r = request(port, "GET", path, headers=dict(hdr, accept="text/plain;version=0.0.4"))
            expect(r, 200)
            assert "# EOF" not in r.body, "OpenMetrics served to a classic scraper"
            p = subprocess.run([promtool, "check", "metrics"], input=r.body.encode(), capture_output=True)
            assert p.returncode == 0, (p.stdout + p.stderr).decode()[:300]
            return "clean"

    @case("SIGTERM: the gateway restarts; stored responses (--response-store-file) continue; a deleted one stays deleted")
    def _():
        post = lambda body: g("POST", "/v1/responses", json.dumps(body).encode(),
                              headers={"content-type": "application/json"})
        r1 = post({"model": "smol", "input": "Name three rivers of Europe.", "max_output_tokens": 8})
        expect(r1, 200)
        r2 = post({"model": "smol", "input": "And one more?", "previous_response_id": r1.json()["id"],
                   "max_output_tokens": 6})
        expect(r2, 200)
        gone = post({"model": "smol", "input": "forget this", "max_output_tokens": 2})
        expect(g("DELETE", f"/v1/responses/{gone.json()['id']}"), 200)
        run.restart_gateway()
        got = g("GET", f"/v1/responses/{r2.json()['id']}")
        expect(got, 200)
        assert got.json()["previous_response_id"] == r1.json()["id"], got.json()
        assert got.json()["output"] == r2.json()["output"], got.json()
        expect(g("GET", f"/v1/responses/{gone.json()['id']}"), 404, "response_not_found")
        r3 = post({"model": "smol", "input": "Thanks.", "previous_response_id": r2.json()["id"],
                   "max_output_tokens": 4})
        expect(r3, 200)
        cached = r3.json()["usage"]["input_tokens_details"]["cached_tokens"]
        assert r3.json()["usage"]["input_tokens"] > r2.json()["usage"]["input_tokens"], r3.json()
        mode = (run.work / "responses.jsonl").stat().st_mode & 0o777
        assert mode == 0o600, oct(mode)
        return (f"turn 3 after the restart: {r3.json()['usage']['input_tokens']} input tokens, {cached} cached "
                f"({r3.h('x-kvgate-route-reason')}); deleted turn 404; file mode {oct(mode)}")

    @case("keys: openssl reads the gateway's key file")
    def _():
        p = subprocess.run(["openssl", "pkey", "-in", str(run.keys / "gateway.key"), "-noout"], capture_output=True)
        assert p.returncode == 0, p.stderr.decode()
        return "openssl pkey OK"

    @case("audit: decision log vs every worker's receipts -> only the forged ticket flagged")
    def _():
        time.sleep(0.5)  # batched fsync of the decision log
        keydir = run.work / "audit-keys"
        keydir.mkdir(exist_ok=True)
        shutil.copy(run.keys / "gateway.pub", keydir)
        wids = sorted(run.workers)
        for wid in wids:
            for pub in (run.work / wid).glob("*.pub"):
                shutil.copy(pub, keydir)
        logs = [str(run.work / wid / "receipts.jsonl") for wid in wids]
        p = subprocess.run([run.bin, "receipts", "audit", "--decisions", str(run.work / "decisions.jsonl"),
                            "--receipts", *logs, "--keys", str(keydir)], capture_output=True, text=True)
        out = (p.stdout + p.stderr).strip()
        # The one request this run sent straight to a worker with a ticket it signed itself
        # (big-1, with the gateway's key) must be caught, and nothing else.
        found = [l.strip() for l in out.splitlines() if l.strip().startswith(("unissued_ticket:", "missing_receipt:",
                 "duplicate_receipt:", "mismatch", "unreceipted"))]
        assert "discrepancies: 1 (unissued_ticket 1)" in out, out[-800:]
        assert len(found) == 1 and "request big-1" in found[0], found
        return "the forged big-1 flagged unissued_ticket; nothing else"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target/debug/kvgate"))
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one, removed)")
    a = ap.parse_args()
    if not Path(a.bin).exists():
        sys.exit(f"{a.bin} missing: run `cargo build` first")
    if not MODEL.exists():
        sys.exit(f"{MODEL} missing: run scripts/fetch-model.sh")
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kvgate-fault-run-"))
    work.mkdir(parents=True, exist_ok=True)
    run = Run(a.bin, work)
    try:
        run.start_worker("w1")
        run.start_worker("w2")
        run.start_gateway()
        cases(run)
    finally:
        run.stop()
    width = max(len(n) for n, *_ in results)
    for name, ok, detail, secs in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<{width}}  {secs:5.1f}s  {detail}")
    failed = sum(not ok for _, ok, *_ in results)
    print(f"\n{len(results) - failed}/{len(results)} cases passed (logs in {work})")
    if not a.keep and failed == 0:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
