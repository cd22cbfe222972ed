"""The OpenAI-compatible server with continuous batching (SPEC §10).

``amplituhedron serve`` (or :func:`serve`) loads a model, builds its engine and serves
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/health`` and ``/metrics`` (``docs/serving.md``).
The wire format lives in :mod:`.protocol`, the error mapping in :mod:`.errors`, the routes
in :mod:`.app`; the scheduling itself is the Rust engine's, stepped by :mod:`.frontend`.
Depends on :mod:`amplituhedron_rs.runtime` (and the core); nothing but the CLI imports it.
Importing this package loads no HTTP stack (:mod:`.options` is what the CLI reads).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from amplituhedron_rs._core import InputError
from amplituhedron_rs.serve.options import ServeOptions

if TYPE_CHECKING:
    from fastapi import FastAPI

    from amplituhedron_rs.runtime.tokenizer import Tokenizer
    from amplituhedron_rs.serve.frontend import EngineFront

__all__ = ["ServeOptions", "build_app", "serve"]


def build_app(o: ServeOptions) -> FastAPI:
    """Loads the model (or connects to its mesh) and returns the ASGI app (the engine starts
    with the app)."""
    from amplituhedron_rs.runtime.gguf_file import chat_warning, model_id, read_model_file
    from amplituhedron_rs.serve.app import ServeSettings, create_app

    model_file = read_model_file(o.model_path)
    template = _read_template(o.chat_template)
    if o.mesh is not None or o.stations is not None:
        front, tokenizer, context_len = _mesh_front(o)
    else:
        front, tokenizer, context_len = _local_front(o)
    if template is not None:
        tokenizer.set_chat_template(template)
    # Logged once, at the first chat request (completions on a base model are fine).
    warning = None if template is not None else chat_warning(model_file, o.model_path)
    settings = ServeSettings(
        model_name=o.served_model_name or model_id(o.model_path),
        context_len=context_len,
        api_keys=o.api_keys,
        draft_by_default=o.draft,
        draft_max=o.draft_max,
        shared_cache_keys=o.shared_cache_keys,
        allow_special_tokens_in_content=o.allow_special_tokens_in_content,
        open_metrics=o.open_metrics,
        max_body_bytes=o.max_body_bytes,
        chat_warning=warning,
    )
    return create_app(front, tokenizer, settings)


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InputError(f"cannot read the chat template {path}: {exc}") from exc


def _context_len(o: ServeOptions, model_context: int, slots: int) -> int:
    """The positions a request may use: ``max_model_len`` when given (within the model's
    context and a session's ring), else as many as both allow."""
    room = min(slots, model_context)
    if o.max_model_len is None:
        return room
    if not 0 < o.max_model_len <= room:
        raise InputError(
            f"max_model_len {o.max_model_len} is outside 1..{room} (the model's context is "
            f"{model_context}, a session's ring {slots} positions)"
        )
    return o.max_model_len


def _local_front(o: ServeOptions) -> tuple[EngineFront, Tokenizer, int]:
    """The in-process engine over the whole model."""
    from amplituhedron_rs.runtime import BatchOptions, CacheOptions, SessionOptions, load_model
    from amplituhedron_rs.serve.frontend import EngineFront

    # A longer max_model_len than the default ring gets rings that long (within the model).
    session = SessionOptions()
    if o.max_model_len is not None and o.max_model_len > session.slots:
        session = replace(session, slots=o.max_model_len)
    model = load_model(
        o.model_path,
        precision=o.precision,  # type: ignore[arg-type]
        kv_dtype=o.kv_dtype,  # type: ignore[arg-type]
        session=session,
        batch=BatchOptions(
            max_running=o.max_batch, max_queue=o.max_queue, step_tokens=o.step_tokens
        ),
        cache=CacheOptions(
            enabled=o.cache,
            max_entries=o.max_entries,
            max_prefix_len=o.max_prefix_len,
            policy=o.policy,  # type: ignore[arg-type]
            min_prefix_reuse=o.min_prefix_reuse,
            cache_dir=o.cache_dir,
            max_disk_bytes=o.max_disk_bytes,
        ),
    )
    context_len = _context_len(o, int(model.file.config["context_len"]), session.slots)
    return EngineFront(model.engine), model.tokenizer, context_len


def _mesh_front(o: ServeOptions) -> tuple[EngineFront, Tokenizer, int]:
    """The external engine stepped through a mesh of stations (started here with
    ``stations``), each step one request per station."""
    from amplituhedron_rs import _core
    from amplituhedron_rs.mesh.engine import MeshStepper
    from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
    from amplituhedron_rs.runtime.gguf_file import read_model_file
    from amplituhedron_rs.runtime.options import SessionOptions
    from amplituhedron_rs.runtime.tokenizer import Tokenizer
    from amplituhedron_rs.serve.frontend import EngineFront

    model_file = read_model_file(o.model_path)
    local = None
    if o.stations is not None:
        local = LocalMesh(
            o.stations,
            model_path=o.model_path,
            token=o.mesh_token,  # None: the mesh draws one (spec.token)
            # Room for every running sequence, plus one being opened while one closes.
            station_args=[
                *("--precision", o.precision, "--kv-dtype", o.kv_dtype),
                *("--max-sessions", str(o.max_batch + 2)),
                *("--max-prefix-len", str(o.max_prefix_len)),
                *("--max-entries", str(o.max_entries), "--policy", o.policy),
                *("--min-prefix-reuse", str(o.min_prefix_reuse)),
                *(() if o.cache else ("--no-cache",)),
                *(("--cache-dir", o.cache_dir) if o.cache_dir else ()),
                *(("--max-disk-bytes", str(o.max_disk_bytes)) if o.max_disk_bytes else ()),
            ],
        )
        spec = local.start()
    else:
        assert o.mesh is not None
        spec = MeshSpec.load(o.mesh, o.mesh_token)  # a given token overrides the file's
    engine = _core.Engine.external(
        max_running=o.max_batch, max_queue=o.max_queue, step_tokens=o.step_tokens
    )
    stepper = MeshStepper(engine, spec, owned=local)
    try:
        stepper.open()
    except BaseException:
        stepper.close()
        raise
    context_len = _context_len(o, int(model_file.config["context_len"]), SessionOptions().slots)
    return EngineFront(engine, stepper), Tokenizer(model_file), context_len


def serve(o: ServeOptions) -> None:
    """Runs the server until interrupted."""
    from amplituhedron_rs.edge.server import run

    app = build_app(o)
    run(app, o.host, o.port, o.edge_limits())
