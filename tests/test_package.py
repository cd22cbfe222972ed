"""The package as a user meets it: the curated top-level API, light imports, subpackages
that depend only downward, one exception hierarchy, and defaults read from the core."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import amplituhedron_rs as ar
from amplituhedron_rs import _core
from amplituhedron_rs.cli import build_parser, main

PACKAGE = Path(ar.__file__).parent
HTTP_STACKS = ("fastapi", "uvicorn", "aiohttp", "prometheus_client")
SUBPACKAGES = ("runtime", "mesh", "serve", "bench", "oracle", "cli")
#: What each subpackage may import from the others (the core is open to all).
ALLOWED = {
    "runtime": set(),
    "oracle": set(),
    "mesh": {"runtime"},
    "serve": {"runtime", "mesh"},
    "bench": {"runtime", "mesh", "oracle"},
    "cli": {"runtime", "mesh", "serve", "bench", "oracle"},
    "": {"runtime", "mesh", "oracle"},  # the top-level __init__ (mesh lazily)
}
MAX_MODULE_LINES = 500


def test_version_matches_cargo() -> None:
    import tomllib

    cargo = tomllib.loads((Path(__file__).parents[1] / "Cargo.toml").read_text())
    assert ar.__version__ == cargo["package"]["version"]


def test_the_top_level_api_is_curated() -> None:
    assert set(ar.__all__) == {
        "__version__",
        "load_model",
        "synthetic_model",
        "Model",
        "Generation",
        "SessionOptions",
        "CacheOptions",
        "BatchOptions",
        "SamplingParams",
        "AmplituhedronCache",
        "AmplituhedronVolume",
        "prefix_hash",
        "RingBuffer",
        "SemanticSpan",
        "SpanType",
        "TokenLogprobs",
        "attend",
        "Coordinator",
        "MeshSpec",
        "LocalMesh",
        "AmplituhedronError",
        "InputError",
        "CacheError",
        "RingError",
        "ModelError",
        "MeshError",
        "QueueFullError",
        "oracle",
    }
    for name in ar.__all__:
        assert getattr(ar, name) is not None
    assert not [name for name in dir(ar) if name.startswith(("oracle_", "quant_"))]
    assert ar.oracle.fib(10) == 55 and ar.oracle.CLINAMEN_SWERVE == 1
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ar.nothing_here  # noqa: B018


def _loaded_after(code: str) -> list[str]:
    """The HTTP stacks in sys.modules after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint([m for m in {HTTP_STACKS!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    loaded: list[str] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return loaded


def test_importing_the_package_loads_no_http_stack() -> None:
    assert _loaded_after("import amplituhedron_rs as ar; ar.MeshSpec; ar.load_model") == []
    # The mesh client is imported on first use, and then it is the real class.
    assert "aiohttp" in _loaded_after("import amplituhedron_rs as ar; ar.Coordinator")


@pytest.mark.model
def test_generate_in_one_process_loads_no_http_stack() -> None:
    code = (
        "from amplituhedron_rs.cli import main\n"
        "assert main(['generate', '--prompt-ids', '12615,36411', '--max-tokens', '2', "
        "'--json']) == 0"
    )
    assert _loaded_after(code) == []


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _subpackage(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def _imported_subpackages(path: Path) -> set[str]:
    """Subpackages ``path`` imports anywhere (module level, functions, TYPE_CHECKING)."""
    out: set[str] = set()
    package_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "amplituhedron_rs" and len(parts) > 1 and parts[1] in SUBPACKAGES:
                out.add(parts[1])
    return out


def test_subpackages_depend_only_downward_and_nothing_imports_the_cli() -> None:
    edges: dict[str, set[str]] = {}
    for path in _modules():
        here = _subpackage(path)
        if here not in ALLOWED:
            continue
        used = _imported_subpackages(path) - {here}
        assert used <= ALLOWED[here], f"{path.relative_to(PACKAGE)} imports {used - ALLOWED[here]}"
        if here != "cli":
            assert "cli" not in used, f"{path.relative_to(PACKAGE)} imports the CLI"
        if here:
            edges.setdefault(here, set()).update(used)
    # The graph actually present is acyclic (a topological order exists).
    order: list[str] = []
    pending = {k: set(v) for k, v in edges.items()}
    while pending:
        ready = [k for k, v in pending.items() if not v - set(order)]
        assert ready, f"import cycle among {sorted(pending)}"
        order += sorted(ready)
        for k in ready:
            del pending[k]
    # The walker sees the real dependencies.
    assert "runtime" in edges["mesh"] and {"runtime", "mesh", "oracle"} <= edges["bench"]


def test_no_module_is_longer_than_about_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_one_exception_hierarchy() -> None:
    for cls in (
        ar.InputError,
        ar.CacheError,
        ar.RingError,
        ar.ModelError,
        ar.MeshError,
        ar.QueueFullError,
    ):
        assert issubclass(cls, ar.AmplituhedronError)
        assert cls.__module__ == "amplituhedron_rs"
        assert cls is getattr(_core, cls.__name__)
    assert issubclass(ar.AmplituhedronError, Exception)
    assert issubclass(ar.InputError, ValueError)
    assert issubclass(ar.QueueFullError, RuntimeError)  # as before the typed errors
    for cls in (ar.CacheError, ar.RingError, ar.ModelError, ar.MeshError):
        assert not issubclass(cls, ValueError)
    # Raised by the core as their types.
    with pytest.raises(ar.InputError, match="at least 1"):
        ar.AmplituhedronCache(max_entries=0)
    with pytest.raises(ar.InputError, match="temperature"):
        _core.Sampler(greedy=False, temperature=-1.0)
    with pytest.raises(ar.MeshError, match="tile"):
        ar.MeshSpec.from_json({"stations": [{"url": "http://a", "layer_lo": 1, "layer_hi": 2}]})


def test_a_model_file_the_core_cannot_use_is_a_model_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"\0" * 1024)
    config = {
        "arch": "llama",
        "n_layers": 1,
        "hidden": 32,
        "ffn": 64,
        "n_heads": 2,
        "n_kv_heads": 2,
        "vocab": 8,
        "rope_base": 10000.0,
        "rms_eps": 1e-5,
        "context_len": 64,
        "head_dim": 16,
        "attn_scale": 0.25,
    }
    with pytest.raises(ar.ModelError, match="missing tensor"):
        _core.ModelWeights(str(path), config, [("token_embd.weight", 0, [32, 8], 0)])
    with pytest.raises(ar.ModelError, match="cannot open"):
        _core.ModelWeights(str(tmp_path / "absent.gguf"), config, [])
    with pytest.raises(ar.ModelError) as raised:
        ar.load_model(tmp_path / "absent.gguf")
    assert isinstance(raised.value, ValueError)  # ModelFileError keeps its ValueError base


def test_options_and_constructors_take_the_core_defaults() -> None:
    d = _core.DEFAULTS
    assert ar.SessionOptions() == ar.SessionOptions(d.slots, d.recall, d.n_sys, d.max_chunk)
    c = ar.CacheOptions()
    assert (c.max_entries, c.max_prefix_len, c.max_bytes, c.policy, c.min_prefix_reuse) == (
        d.max_entries,
        d.max_prefix_len,
        d.max_bytes,
        d.policy,
        d.min_prefix_reuse,
    )
    cache = ar.AmplituhedronCache()
    assert (cache.max_entries, cache.max_prefix_len, cache.policy) == (
        d.max_entries,
        d.max_prefix_len,
        d.policy,
    )
    assert ar.RingBuffer(1, 1, 8).slots == d.slots
    station = build_parser().parse_args(["station", "serve", "--layers", "0:1"])
    assert (station.max_entries, station.max_prefix_len, station.min_prefix_reuse) == (
        d.max_entries,
        d.max_prefix_len,
        d.min_prefix_reuse,
    )
    assert (d.max_entries, d.max_prefix_len, d.slots) == (4, 512, 4096)  # SPEC §2, §3
    # One default for the KV storage type: the core's, read by the runtime and every CLI.
    assert d.kv_dtype == "f16" and ar.RingBuffer(1, 1, 8).kv_dtype == d.kv_dtype
    for argv in (
        ["station", "serve", "--layers", "0:1"],
        ["serve"],
        ["generate", "--prompt", "x"],
        ["bench-serve"],
        ["bench-model"],
    ):
        assert build_parser().parse_args(argv).kv_dtype == d.kv_dtype, argv
    assert build_parser().parse_args(["serve", "--kv-dtype", "f32"]).kv_dtype == "f32"
    assert build_parser().parse_args(["serve"]).max_prefix_len == d.max_prefix_len


def test_serve_refuses_cache_options_for_a_mesh_it_did_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--mesh", "http://127.0.0.1:9", "--max-prefix-len", "64"]) == 2
    assert "station serve" in capsys.readouterr().err


def test_cli_help_names_the_claims_not_the_design_notes() -> None:
    import argparse

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    texts = [parser.format_help()] + [p.format_help() for p in sub.choices.values()]
    assert len(texts) == len(sub.choices) + 1 >= 9
    assert not [t for t in texts if "seed 0" in t]
    assert "session 2 is at least 80 % faster" in sub.choices["bench"].format_help()
