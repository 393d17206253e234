#!/usr/bin/env python3
"""kvgate's reading of vLLM's KV events, checked against vLLM's own publisher.

Run by scripts/check-vllm-events.sh, which provides a virtualenv (msgspec, pyzmq, xxhash), the
file `vllm/distributed/kv_events.py` taken from the vLLM wheel on PyPI (SHA-256 pinned) and a
built `kvgate`. No torch: that module imports only msgspec, zmq and three small vLLM modules,
stubbed here (a logger, a config dataclass, network helpers used for `tcp://*:0` only).

What it does, with vLLM's real `ZmqEventPublisher` (PUB and replay ROUTER sockets, libzmq) and
real `KVEventBatch` / `BlockStored` / `BlockRemoved` / `AllBlocksCleared` classes:

1. publishes two batches *before* any sidecar listens (a chain root carrying the kvgate salt,
   then its continuation);
2. starts two `kvgate sidecar --kind vllm` on the publisher, kvgate blocks of 16 (vLLM's size)
   and of 32; the first live batch makes each read the replay socket from seq 0;
3. publishes live: another chain (integer block hashes), an unsalted chain, a LoRA chain, the
   eviction of two blocks, and AllBlocksCleared;
4. restarts the engine's publisher (new process: seqs from 0, an empty cache) and publishes a
   new chain: the sidecars must hold only that chain;
5. after each step, the set of keys each sidecar's `GET /v1/kv/events` stream says the engine
   holds must equal the set the independent Python block-key reference
   (prefix-index/tools/block_keys_reference.py, written from docs/block-keys.md) computes from
   the tokens of the blocks vLLM still holds.

With --fixture PATH it writes what vLLM's publisher sent (each message's seq and payload, hex)
and the key sets expected after each message, for the Rust test that decodes the same bytes in
CI (`worker::sidecar::vllm` tests).
"""
import argparse
import hashlib
import importlib.util
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
from dataclasses import dataclass

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "prefix-index", "tools"))
import block_keys_reference as ref  # noqa: E402


def load_vllm_events(path):
    """vLLM's kv_events.py, its three vLLM imports stubbed (none of them shapes the wire)."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    @dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    for pkg in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]:
        module(pkg, __path__=[])
    module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
           get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
           is_valid_ipv6_address=lambda ip: False,
           split_zmq_path=lambda p: tuple(p.replace("//", "").split(":")))
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm.distributed.kv_events"] = mod
    spec.loader.exec_module(mod)
    return mod


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stream:
    """The keys a sidecar's /v1/kv/events stream says are held, applied as docs/kv-events.md
    says (cleared drops everything; stored adds; removed drops)."""

    def __init__(self, url):
        self.held = set()
        self.lock = threading.Lock()
        self.applied = 0
        self.resp = urllib.request.urlopen(url, timeout=60)
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for raw in self.resp:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            with self.lock:
                if ev["type"] == "cleared":
                    self.held.clear()
                elif ev["type"] == "stored":
                    self.held.update(ev["keys"])
                elif ev["type"] == "removed":
                    self.held.difference_update(ev["keys"])
                self.applied += 1

    def wait_for(self, want, what, timeout=10.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if self.held == want:
                    return
            time.sleep(0.02)
        with self.lock:
            got = set(self.held)
        raise SystemExit(f"FAIL {what}: {len(got)} keys held, {len(want)} expected; "
                         f"missing {sorted(want - got)[:4]}, extra {sorted(got - want)[:4]}")


class Engine:
    """What the test's vLLM holds: block hash → (tokens of the whole prefix), per chain."""

    def __init__(self, ev, publisher, block_size=16):
        self.ev = ev
        self.pub = publisher
        self.bs = block_size
        self.prefix = {}   # hash → all tokens up to and including that block
        self.salted = {}   # hash → the seed its chain's root carried (None: unsalted / LoRA)

    def store(self, hashes, parent, tokens, salt_seed=None, salt=None, lora=None):
        n = len(hashes)
        extra = None
        if salt is not None:
            extra = [(salt,)] + [None] * (n - 1)
        ev = self.ev.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
            block_size=self.bs, lora_id=1 if lora else None, medium="GPU",
            lora_name=lora, extra_keys=extra, group_idx=0)
        base = self.prefix[parent] if parent is not None else []
        seed = self.salted[parent] if parent is not None else (None if lora else salt_seed)
        for i, h in enumerate(hashes):
            base = base + tokens[i * self.bs:(i + 1) * self.bs]
            self.prefix[h] = base
            self.salted[h] = seed
        return ev

    def remove(self, hashes):
        for h in hashes:
            self.prefix.pop(h, None)
            self.salted.pop(h, None)
        return self.ev.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)

    def clear(self):
        self.prefix.clear()
        self.salted.clear()
        return self.ev.AllBlocksCleared()

    def publish(self, events):
        self.pub.publish(self.ev.KVEventBatch(ts=time.time(), events=events))

    def expected(self, b):
        """The kvgate keys (blocks of b) held: a key is held while some held vLLM block
        completes it (its prefix, in a kvgate-salted chain, reaches past the key's end and the
        block starts before it)."""
        want = set()
        for h, toks in self.prefix.items():
            seed = self.salted[h]
            if seed is None:
                continue
            keys = ref.chain(seed, "xxh3", b, toks)
            start = len(toks) - self.bs
            for j, k in enumerate(keys):
                end = (j + 1) * b
                if start < end <= len(toks):
                    want.add(k)
        return want


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvgate", required=True)
    ap.add_argument("--kv-events-py", required=True)
    ap.add_argument("--fixture")
    args = ap.parse_args()
    ev = load_vllm_events(args.kv_events_py)
    rng = random.Random(20261207)
    pub_port, replay_port = free_port(), free_port()
    publisher = ev.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=1000)
    # Record what the publisher puts on the wire (for the fixture), as a subscriber would.
    ctx = zmq.Context.instance()
    tap = ctx.socket(zmq.SUB)
    tap.connect(f"tcp://127.0.0.1:{pub_port}")
    tap.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    wire = []

    def drain_tap():
        while tap.poll(200):
            _topic, seq, payload = tap.recv_multipart()
            wire.append((int.from_bytes(seq, "big"), payload))

    engine = Engine(ev, publisher)
    seed = hashlib.sha256(b"check-vllm-events namespace").digest()
    salt = "kvgate/v1/xxh3/" + seed.hex()
    h = lambda: hashlib.sha256(rng.randbytes(16)).digest()  # noqa: E731  vLLM's default: bytes
    toks = lambda n: [rng.randrange(0, 49152) for _ in range(n)]  # noqa: E731

    steps = []  # (description, expected sets) after each published batch

    def step(what, events):
        engine.publish(events)
        time.sleep(0.05)
        drain_tap()
        steps.append((what, {b: engine.expected(b) for b in (16, 32)}))

    # 1. Before any sidecar listens: a salted root chain of 3 blocks, then 2 more.
    a = [h() for _ in range(5)]
    ta = toks(80)
    step("root chain, before the sidecars", [engine.store(a[:3], None, ta[:48], seed, salt)])
    step("its continuation", [engine.store(a[3:], a[2], ta[48:])])

    tmp = tempfile.mkdtemp(prefix="vllm-events-")
    procs, streams = [], {}
    try:
        for b in (16, 32):
            port = free_port()
            procs.append(subprocess.Popen(
                [args.kvgate, "sidecar", "--kind", "vllm", "--engine",
                 f"http://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{port}",
                 "--id", f"vllm-b{b}", "--state-dir", os.path.join(tmp, str(b)),
                 "--kv-events", f"tcp://127.0.0.1:{pub_port}",
                 "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}", "--block-size", str(b)],
                stderr=open(os.path.join(tmp, f"sidecar-{b}.log"), "w")))
            deadline = time.time() + 30
            while True:
                try:
                    streams[b] = Stream(f"http://127.0.0.1:{port}/v1/kv/events")
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
        time.sleep(1.0)  # the SUB subscriptions reach the publisher

        # 2. Live: a chain with integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); the first
        # live batch also brings step 1 through the replay socket.
        c = [rng.getrandbits(63) for _ in range(4)]
        step("int-hash chain (and the replay of step 1)",
             [engine.store(c, None, toks(64), seed, salt)])
        # 3. Unsalted and LoRA chains: not mapped.
        step("unsalted chain", [engine.store([h(), h()], None, toks(32))])
        step("LoRA chain", [engine.store([h()], None, toks(16), seed, salt, lora="adapter-a")])
        # 4. A branch off the first chain's second block, then evictions.
        d = [h(), h()]
        step("a branch", [engine.store(d, a[1], toks(32))])
        step("evict two blocks", [engine.remove([a[4], d[1]])])
        step("evict a middle block", [engine.remove([a[2]])])
        for b, s in streams.items():
            s.wait_for(steps[-1][1][b], f"B={b} after '{steps[-1][0]}'")
        # 5. Everything cleared.
        step("all cleared", [engine.clear()])
        for b, s in streams.items():
            s.wait_for(steps[-1][1][b], f"B={b} after '{steps[-1][0]}'")
            assert not steps[-1][1][b]
        recorded = (list(wire), list(steps))
        # 6. The engine restarts: a new publisher on the same ports, seqs from 0 again, an
        # empty cache. It stores one chain, then the old publisher's first chain comes back
        # under the same hashes; the sidecars must hold what the new engine holds only.
        step("a chain before the restart", [engine.store([h(), h()], None, toks(32), seed, salt)])
        for b, s in streams.items():
            s.wait_for(steps[-1][1][b], f"B={b} after '{steps[-1][0]}'")
        publisher.shutdown()
        time.sleep(0.5)
        publisher = ev.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}",
            replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=1000)
        engine = Engine(ev, publisher)
        time.sleep(1.0)  # the SUB sockets reconnect
        e = [h() for _ in range(3)]
        want = None
        deadline = time.time() + 10
        te = toks(48)
        # Published until seen: a message sent before a SUB reconnected is lost (and the
        # replay socket then has it).
        events = [engine.store(e, None, te, seed, salt)]
        engine.publish(events)
        want = {b: engine.expected(b) for b in (16, 32)}
        for b, s in streams.items():
            s.wait_for(want[b], f"B={b} after the engine restarted", timeout=max(1, deadline - time.time()))
        print(f"ok: {len(wire)} batches from vLLM's publisher; both sidecars (kvgate blocks of 16 and "
              f"32) held exactly the reference keys, including what they read from the replay socket, "
              f"and only the restarted engine's after a restart")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        publisher.shutdown()
    wire, steps = recorded

    if args.fixture:
        # The key sets after each message, the messages as sent (seq, payload hex).
        by_seq = dict(wire)
        assert sorted(by_seq) == list(range(len(steps))), sorted(by_seq)
        doc = {
            "what": "vLLM 0.34.0's ZmqEventPublisher output (scripts/check-vllm-events.py) and the "
                    "kvgate keys held after each message, by the independent block-key reference",
            "namespace_seed": seed.hex(),
            "algorithm": "xxh3",
            "vllm_block_size": 16,
            "messages": [
                {"step": what, "seq": i, "payload_hex": by_seq[i].hex(),
                 "held": {str(b): sorted(want[b]) for b in (16, 32)}}
                for i, (what, want) in enumerate(steps)
            ],
        }
        with open(args.fixture, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.fixture}")


if __name__ == "__main__":
    main()
