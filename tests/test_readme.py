"""Every code block of the README and of docs/*.md runs as written, in document order, or is
tagged as not runnable in CI with its reason, on the line right before its fence:

    <!-- not-in-ci: multi-GB bench, minutes on 2 cores -->

Python blocks run in one namespace per file (later blocks use the names of earlier ones).
Shell blocks run command by command, in a scratch directory, against the real model:
``amplituhedron …`` as a subprocess (``serve`` and ``mesh up``, which run until stopped, in
the background, on free ports instead of the ones written); ``curl`` as the same HTTP
request. A server the file started answers the blocks after it that name
``http://127.0.0.1:8000`` and the key ``sk-local``. A command no runner knows fails the test:
tag its block instead. Every untagged block must have run, so none is skipped silently."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from test_serve import KEY, Server, start_server

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- not-in-ci: (?P<reason>\S.*?) -->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
RUNNABLE = {"python", "py", "sh"}
#: What the docs' server examples name; the test's server is on a free port with its own key.
DOC_URL, DOC_KEY = "http://127.0.0.1:8000", "sk-local"
DOC_URL_LOCALHOST = "http://localhost:8000"  # the same server, by name
COMMAND_TIMEOUT_S = 180

pytestmark = [pytest.mark.model, pytest.mark.mesh, pytest.mark.serve]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's, 1-based
    lang: str
    code: str
    not_in_ci: str | None  # the marker's reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: a code block is never closed"
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        reason = marker["reason"] if marker else None
        out.append(Block(path, i + 1, fence["lang"], code, reason))
        i = end + 1
    return out


def test_every_block_is_runnable_or_says_why_not() -> None:
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert "~~~" not in text, f"{path.name}: use ``` fences, which this test reads"
        lines = text.splitlines()
        for number, line in enumerate(lines, start=1):
            if "not-in-ci" in line:
                assert MARKER.fullmatch(line.strip()), f"{path.name}:{number}: malformed marker"
                following = lines[number] if number < len(lines) else ""
                assert FENCE.match(following), f"{path.name}:{number}: a marker tags no block"
        for block in blocks_of(path):
            assert block.lang in RUNNABLE or block.not_in_ci, (
                f"{block.where}: a ```{block.lang} block cannot run; tag it not-in-ci with why"
            )


def test_the_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    # The set-up block CI runs (.ci/run calls `make test`) and newcomers copy.
    assert "\nmake run    # the main job" in text and "\nmake test   # every test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    (python, *_) = [b for b in blocks_of(README) if b.lang == "python"]
    assert python.code.startswith("import amplituhedron_rs as ar\n\nm = ar.load_model()")


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_and_anchors_resolve() -> None:
    for path in DOCS:
        for link in LINK.finditer(path.read_text(encoding="utf-8")):
            target = link["target"]
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            assert resolved.exists(), f"{path.name}: {target} does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", resolved.read_text(encoding="utf-8"), re.M)
                anchors = {_anchor(h) for h in headings}
                assert anchor in anchors, f"{path.name}: no heading for #{anchor} in {file}"


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free on loopback right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + n > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _option(argv: list[str], name: str) -> str:
    assert name in argv, f"expected {name} in {shlex.join(argv)}"
    return argv[argv.index(name) + 1]


def _without(argv: list[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` and their values."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        else:
            out.append(arg)
    return out


def commands_of(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comment lines dropped."""
    out: list[str] = []
    pending = ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            out.append(command)
    assert not pending, "a shell block ends with a continuation"
    return out


class Runner:
    """Runs one file's blocks in order; holds what they started until :meth:`close`."""

    def __init__(self, workdir: Path, stack: contextlib.ExitStack) -> None:
        self.workdir = workdir
        self.stack = stack
        self.namespace: dict[str, object] = {"__name__": "docs"}
        self.server: Server | None = None
        self.bin = Path(sys.executable).parent
        self.env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}"}

    def run(self, block: Block) -> int:
        """Runs ``block``; the statements or commands it ran."""
        if block.lang in ("python", "py"):
            code = self._for_our_server(block.code, block)
            exec(compile(code, block.where, "exec"), self.namespace)
            return len(ast.parse(code).body)
        commands = commands_of(block.code)
        for command in commands:
            self._shell(command, block)
        return len(commands)

    def _for_our_server(self, text: str, block: Block) -> str:
        """``text`` (a block, or a piece of one) addressed to the server this file started."""
        if DOC_URL not in block.code and DOC_URL_LOCALHOST in block.code:
            text = text.replace(DOC_URL_LOCALHOST, DOC_URL)
            block = Block(
                block.path,
                block.line,
                block.lang,
                block.code.replace(DOC_URL_LOCALHOST, DOC_URL),
                block.not_in_ci,
            )
        if DOC_URL not in block.code:
            return text
        assert self.server is not None, f"{block.where}: names {DOC_URL} but no server started"
        assert DOC_KEY in block.code, f"{block.where}: talks to the server without its key"
        return text.replace(DOC_URL, self.server.url).replace(DOC_KEY, KEY)

    def _shell(self, command: str, block: Block) -> None:
        argv = shlex.split(command, comments=True)
        if argv[0] == "amplituhedron":
            self._amplituhedron(argv, block)
        elif argv[0] == "curl":
            self._curl(argv, block)
        else:
            pytest.fail(
                f"{block.where}: no runner for `{argv[0]}`; run it another way or tag the "
                "block <!-- not-in-ci: reason -->"
            )

    def _amplituhedron(self, argv: list[str], block: Block) -> None:
        args = argv[1:]
        long_running = "--help" not in args and "--version" not in args
        if long_running and args[:1] == ["serve"]:
            assert self.server is None, f"{block.where}: a second server"
            assert _option(args, "--port") == "8000" and _option(args, "--api-key") == DOC_KEY
            rest = _without(args[1:], "--port", "--api-key")
            self.server = self.stack.enter_context(start_server(*rest))
        elif long_running and args[:2] == ["mesh", "up"]:
            self._mesh_up(args, block)
        else:
            done = subprocess.run(
                [str(self.bin / "amplituhedron"), *args],
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            assert done.returncode == 0, f"{block.where}: {shlex.join(argv)}\n{done.stderr}"
            assert done.stdout.strip(), f"{block.where}: {shlex.join(argv)} printed nothing"

    def _mesh_up(self, args: list[str], block: Block) -> None:
        stations = int(_option(args, "--stations")) * int(
            _option(args, "--replicas") if "--replicas" in args else "1"
        )
        mesh_file = self.workdir / _option(args, "--mesh-file")
        args = [*_without(args, "--port"), "--port", str(_free_ports(2 * stations))]
        process = subprocess.Popen(
            [str(self.bin / "amplituhedron"), *args], cwd=self.workdir, env=self.env
        )
        self.stack.callback(_interrupt, process)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not mesh_file.exists():
            assert process.poll() is None, f"{block.where}: mesh up exited {process.returncode}"
            assert time.monotonic() < deadline, f"{block.where}: no mesh file in time"
            time.sleep(0.2)

    def _curl(self, argv: list[str], block: Block) -> None:
        """The request ``curl -s URL -H … -d BODY`` makes, sent with httpx."""
        headers: dict[str, str] = {}
        body: str | None = None
        url: str | None = None
        args = iter(argv[1:])
        for arg in args:
            if arg == "-s":
                continue
            if arg == "-H":
                name, _, value = next(args).partition(":")
                headers[name.strip()] = self._for_our_server(value.strip(), block)
            elif arg == "-d":
                body = next(args)
            elif not arg.startswith("-") and url is None:
                url = self._for_our_server(arg, block)
            else:
                pytest.fail(f"{block.where}: curl option {arg} is not understood here")
        assert url is not None and body is not None, f"{block.where}: curl without URL or -d"
        reply = httpx.post(url, headers=headers, content=body, timeout=COMMAND_TIMEOUT_S)
        assert reply.status_code == 200, f"{block.where}: {reply.status_code} {reply.text}"
        assert json.loads(reply.text)["choices"], f"{block.where}: no choices"


def _interrupt(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as the docs say to stop it; killed if it does not stop."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _runner(workdir: Path) -> Iterator[Runner]:
    with contextlib.ExitStack() as stack:
        yield Runner(workdir, stack)


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_untagged_block_runs_as_written(path: Path, tmp_path: Path) -> None:
    ran = 0
    with _runner(tmp_path) as runner:
        for block in blocks_of(path):
            if block.not_in_ci is None:
                assert runner.run(block) > 0, f"{block.where}: an empty block"
                ran += 1
    assert path != README or ran >= 6  # the tour: Python, CLI, server, client, curl, mesh
