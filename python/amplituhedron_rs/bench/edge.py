"""``amplituhedron bench-edge``: what hostile traffic costs the OpenAI server (issue 45).

Starts the server (in process, with an API key and bodies allowed up to 16 MiB, so a 10 MB
prompt reaches the prompt checks instead of the body limit) and, while probing ``/health``
from another thread every 10 ms, runs each attack in turn:

- ``idle``: nothing (the baseline of the same run);
- ``10 MB prompt``: one completion whose prompt is 10 MB of text, with a valid key;
- ``4 × 100 MB unauthenticated``: four clients streaming 100 MB bodies without a key.

It reports per phase the /health latency (median, p95, max, and the median's ratio to idle),
the attack's answers and how long they took, and the server's RSS before and at its peak.
Targets: /health median ≤ 50 ms under each attack; ≤ 16 MiB of RSS per unauthenticated body.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from amplituhedron_rs.bench.host import describe_host
from amplituhedron_rs.bench.servers import free_port

KEY = "bench-edge-key"
MIB = 1 << 20


@dataclass
class Phase:
    name: str
    health_ms: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    attack_s: float = 0.0
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0

    def summary(self, idle_median: float | None) -> dict[str, Any]:
        lat = sorted(self.health_ms)
        median = statistics.median(lat) if lat else float("nan")
        return {
            "phase": self.name,
            "health_probes": len(lat),
            "health_median_ms": round(median, 2),
            "health_p95_ms": round(lat[int(0.95 * (len(lat) - 1))], 2) if lat else None,
            "health_max_ms": round(lat[-1], 2) if lat else None,
            "median_vs_idle": round(median / idle_median, 2) if idle_median else None,
            "answers": self.answers,
            "attack_s": round(self.attack_s, 2),
            "rss_before_mb": round(self.rss_before_mb, 1),
            "rss_peak_mb": round(self.rss_peak_mb, 1),
            "rss_added_mb": round(self.rss_peak_mb - self.rss_before_mb, 1),
        }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def start(model: str | None, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "amplituhedron_rs.cli", "serve", "--port", str(port)]
    cmd += ["--api-key", KEY, "--max-body-bytes", str(16 * MIB)]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up in 300 s")


def unauthenticated_upload(port: int, total: int) -> str:
    """Streams ``total`` bytes as a JSON body without a key; the answer's status line and
    the bytes sent when it came."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {total}\r\n\r\n"
    ).encode()
    chunk = b"a" * MIB
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # refused and closed: what we are measuring
        try:
            answer = s.recv(256).split(b"\r\n")[0].decode(errors="replace")
        except OSError as exc:
            answer = f"connection closed ({type(exc).__name__})"
    return f"{answer or 'closed'} after {sent // MIB} MiB sent"


def run_phase(name: str, port: int, pid: int, attack: Any | None, seconds: float = 3.0) -> Phase:
    phase = Phase(name, rss_before_mb=rss_mb(pid))
    phase.rss_peak_mb = phase.rss_before_mb
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(f"http://127.0.0.1:{port}/health")
                phase.health_ms.append((time.perf_counter() - t) * 1e3)
                phase.rss_peak_mb = max(phase.rss_peak_mb, rss_mb(pid))
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    started = time.perf_counter()
    if attack is None:
        time.sleep(seconds)
    else:
        phase.answers = attack()
    phase.attack_s = time.perf_counter() - started
    time.sleep(0.5)  # what the attack leaves behind
    stop.set()
    prober.join()
    return phase


def main(a: argparse.Namespace) -> int:
    port = free_port()
    proc = start(a.model, port)
    url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()[
            "data"
        ][0]["id"]

        def big_prompt() -> list[str]:
            body = {"model": model, "prompt": "word " * (a.prompt_mb * MIB // 5), "max_tokens": 4}
            r = httpx.post(
                f"{url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=300,
            )
            return [f"{r.status_code} {r.json()['error']['code'] if r.status_code >= 400 else ''}"]

        def unauthenticated() -> list[str]:
            with cf.ThreadPoolExecutor(a.bodies) as pool:
                jobs = [
                    pool.submit(unauthenticated_upload, port, a.body_mb * MIB)
                    for _ in range(a.bodies)
                ]
                return [j.result() for j in jobs]

        phases = [
            run_phase("idle", port, proc.pid, None),
            run_phase(f"{a.prompt_mb} MB prompt (valid key)", port, proc.pid, big_prompt),
            run_phase(
                f"{a.bodies} × {a.body_mb} MB unauthenticated", port, proc.pid, unauthenticated
            ),
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    idle = statistics.median(phases[0].health_ms)
    rows = [p.summary(idle) for p in phases]
    cpu = describe_host()
    print(f"bench-edge on {cpu}")
    print(
        f"{'phase':34} {'/health p50':>11} {'p95':>8} {'max':>8} {'×idle':>6} "
        f"{'RSS +MB':>8}  answers"
    )
    for r in rows:
        print(
            f"{r['phase']:34} {r['health_median_ms']:>9.2f}ms {r['health_p95_ms']:>6.2f}ms "
            f"{r['health_max_ms']:>6.2f}ms {r['median_vs_idle']:>6} {r['rss_added_mb']:>8}  "
            f"{'; '.join(r['answers'])}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "phases": rows}, indent=2))
    return 0
