#!/usr/bin/env bash
# What a sidecar reading llama-server's own load (`kvgate sidecar --engine-load slots`, a GET
# /slots every interval) costs the engine, side by side in one run: one llama-server (SmolLM2
# Q4_1, --parallel 2, one thread), and per round one generation (n_predict 128, ignore_eos,
# temperature 0) sent straight to it while, in front of it, either no sidecar runs or a sidecar
# reads /slots every 100 ms or every 20 ms. The arms alternate round by round, so machine load
# affects them alike. Prints, per arm, llama-server's own `timings` (generation and prompt
# tokens per second: min / median / max) and the median ratio to "no sidecar", the sidecar's
# reads counted by its metrics, and its CPU time per second of wall time. Slow (llama.cpp is
# built by scripts/build-llamacpp.sh, ~20 min the first time), so never in CI.
#   ROUNDS     rounds per arm (default 8)
#   KVGATE_BIN the kvgate binary (default: a debug build of this tree)
#   OUT        logs (default bench-out/engine-load)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NAME=bench-engine-load
rounds="${ROUNDS:-8}"
out="${OUT:-bench-out/engine-load}"
# shellcheck source=scripts/bench-common.sh
source scripts/bench-common.sh
./scripts/setup.sh >/dev/null
llama_bin="$(./scripts/build-llamacpp.sh)"
kvgate_bin
bench_model
model="$MODEL"
py="$root/.venv/bin/python3"
rm -rf "$out"
mkdir -p "$out"
engine_port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$llama_bin/llama-server" -m "$model" --host 127.0.0.1 --port "$engine_port" --parallel 2 \
  --cache-ram 0 -c 8192 -t 1 --no-webui >"$out/llama-server.log" 2>&1 &
engine_pid=$!
trap 'kill $engine_pid 2>/dev/null || true; wait $engine_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -fsS -o /dev/null "http://127.0.0.1:$engine_port/health" 2>/dev/null && break
  sleep 0.5
done
"$py" - "$KVGATE" "$engine_port" "$rounds" "$out" <<'PY'
import json, os, signal, socket, statistics, subprocess, sys, time, urllib.request

kvgate, engine_port, rounds, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
engine = f"http://127.0.0.1:{engine_port}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def generate(n):
    body = json.dumps({"prompt": f"Tell a long story about harbour number {n}.", "n_predict": 128,
                       "ignore_eos": True, "temperature": 0, "cache_prompt": False}).encode()
    req = urllib.request.Request(engine + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        t = json.load(r)["timings"]
    return t["predicted_per_second"], t["prompt_per_second"]


OK_READS = 'kvgate_sidecar_engine_load_reads_total{outcome="ok"}'


def sidecar(interval_ms, n):
    port = free_port()
    p = subprocess.Popen(
        [kvgate, "sidecar", "--engine", engine, "--listen", f"127.0.0.1:{port}", "--id", f"s{n}",
         "--state-dir", f"{out}/state-{n}", "--engine-load", "slots",
         "--engine-load-interval-ms", str(interval_ms)],
        stdout=subprocess.DEVNULL, stderr=open(f"{out}/sidecar.log", "a"))
    for _ in range(100):
        try:
            if OK_READS in get(f"http://127.0.0.1:{port}/metrics"):
                return p, port
        except OSError:
            pass
        time.sleep(0.05)
    p.kill()
    raise SystemExit("bench-engine-load: the sidecar never read /slots")


arms = [("no sidecar", None), ("/slots every 100 ms", 100), ("/slots every 20 ms", 20)]
results = {a: [] for a, _ in arms}
reads = {a: [] for a, _ in arms}
cpu_ms = {a: [] for a, _ in arms}
wall_s = {a: [] for a, _ in arms}
n = 0
for r in range(rounds):
    for arm, interval in arms:
        n += 1
        proc = None
        if interval is not None:
            started = time.time()
            proc, port = sidecar(interval, n)
        t0 = time.time()
        gen, prompt = generate(n)
        elapsed = time.time() - t0
        if proc is not None:
            m = get(f"http://127.0.0.1:{port}/metrics")
            ok = next((float(l.split()[-1]) for l in m.splitlines()
                       if l.startswith(OK_READS)), 0.0)
            reads[arm].append(ok)
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu_ms[arm].append((int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK"))
            wall_s[arm].append(time.time() - started)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        results[arm].append((gen, prompt, elapsed))
        print(f"round {r + 1} {arm}: generation {gen:.1f} tok/s, prompt {prompt:.1f} tok/s", flush=True)

base = statistics.median(g for g, _, _ in results["no sidecar"])
base_p = statistics.median(p for _, p, _ in results["no sidecar"])
print()
print("| arm | generation tok/s min / median / max | × no sidecar | prompt tok/s median | × no sidecar | /slots reads in a round (median) | sidecar CPU per second (median, incl. start) |")
print("|---|---|---:|---:|---:|---:|---:|")
for arm, _ in arms:
    g = sorted(x[0] for x in results[arm])
    p = statistics.median(x[1] for x in results[arm])
    rd = f"{statistics.median(reads[arm]):.0f}" if reads[arm] else "—"
    cpu = (f"{statistics.median(c / w for c, w in zip(cpu_ms[arm], wall_s[arm])):.1f} ms"
           if cpu_ms[arm] else "—")
    print(f"| {arm} | {g[0]:.1f} / {statistics.median(g):.1f} / {g[-1]:.1f} | {statistics.median(g) / base:.3f} "
          f"| {p:.0f} | {p / base_p:.3f} | {rd} | {cpu} |")
PY
