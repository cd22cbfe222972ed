"""The systems ``bench-serve`` measures, as server processes on loopback: this server (alone,
or in front of a local mesh) and the peers that are present — llama.cpp's ``llama-server``
and ``python -m llama_cpp.server``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import aiohttp

from amplituhedron_rs.mesh.launcher import free_ports, get_json


def free_port() -> int:
    """A port free on loopback right now."""
    return free_ports(1)[0]


class Server:
    """A server process speaking the OpenAI wire format on loopback."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str) -> None:
        self.name = name
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by __exit__

    def __enter__(self) -> Server:
        if self.proc is None:
            self.start()
        return self

    def start(self) -> None:
        """Starts the server and waits for its health check; RuntimeError (with the end of
        its output) if it exits or does not come up."""
        # Its output goes to a file, so a server that fails to start can say why.
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}: {' / '.join(tail)}"
                )
            try:
                # /v1/models: every OpenAI-compatible server has it (llama_cpp.server has
                # no /health). Any failure (refused, an HTTP error, not HTTP) is "not up yet".
                get_json(f"{self.url}/v1/models", timeout=1)
                return
            except (OSError, ValueError):
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not come up in 300 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def systems(a: argparse.Namespace, model_path: str) -> list[tuple[str, list[str] | str]]:
    """(name, command) of every system to run, or (name, why it is skipped)."""
    out: list[tuple[str, list[str] | str]] = []

    def ours(*extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "amplituhedron_rs.cli",
            "serve",
            "--model",
            model_path,
            "--port",
            str(free_port()),
            "--max-batch",
            str(a.max_batch),
            "--max-queue",
            "256",
            "--step-tokens",
            str(a.step_tokens),
            "--precision",
            a.precision,
            "--kv-dtype",
            a.kv_dtype,
            *extra,
        ]

    out.append(("amplituhedron", ours()))
    if a.stations:
        out.append(
            (f"amplituhedron {a.stations}-station mesh", ours("--stations", str(a.stations)))
        )
    if a.llama_server:
        port = free_port()
        out.append(
            (
                f"llama-server -np {a.llama_parallel}",
                [
                    a.llama_server,
                    "-m",
                    model_path,
                    "--port",
                    str(port),
                    "-np",
                    str(a.llama_parallel),
                    "-c",
                    str(2048 * a.llama_parallel),
                    "-t",
                    str(os.cpu_count() or 2),
                ],
            )
        )
    else:
        out.append(("llama-server", "not given (--llama-server PATH)"))
    if a.no_llama_cpp_python:
        pass
    elif importlib.util.find_spec("llama_cpp") is None:
        out.append(("llama_cpp.server", "llama-cpp-python is not installed (peers extra)"))
    elif importlib.util.find_spec("sse_starlette") is None:
        out.append(
            (
                "llama_cpp.server",
                "llama-cpp-python's server extra is missing: "
                "pip install 'llama-cpp-python[server]' (or the peers extra)",
            )
        )
    else:
        port = free_port()
        out.append(
            (
                "llama_cpp.server",
                [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    model_path,
                    "--port",
                    str(port),
                    "--n_ctx",
                    "4096",
                    # Its default abandons a streaming request whenever another arrives:
                    # queue them instead, so every client gets its whole reply.
                    "--interrupt_requests",
                    "False",
                ],
            )
        )
    return out


def port_of(cmd: list[str]) -> int:
    """The ``--port`` of a server command."""
    return int(cmd[cmd.index("--port") + 1])


async def served_model(srv: Server) -> str:
    """The id the server gives its model (``/v1/models``)."""
    async with aiohttp.ClientSession() as http, http.get(f"{srv.url}/v1/models") as r:
        return str((await r.json())["data"][0]["id"])
