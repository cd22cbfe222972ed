"""The OpenAI-compatible server with continuous batching (SPEC §10).

``amplituhedron serve`` (or :func:`serve`) loads a model, builds its engine and serves
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics``.
The wire format lives in :mod:`.protocol`, the error mapping in :mod:`.errors`, the routes
in :mod:`.app`; the scheduling itself is the Rust engine's, stepped by :mod:`.frontend`.
Depends on :mod:`amplituhedron_rs.runtime` (and the core); nothing but the CLI imports it.
Importing this package loads no HTTP stack (:mod:`.options` is what the CLI reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amplituhedron_rs.serve.options import ServeOptions

if TYPE_CHECKING:
    from fastapi import FastAPI

    from amplituhedron_rs.runtime.tokenizer import Tokenizer
    from amplituhedron_rs.serve.frontend import EngineFront

__all__ = ["ServeOptions", "build_app", "serve"]


def build_app(o: ServeOptions) -> FastAPI:
    """Loads the model (or connects to its mesh) and returns the ASGI app (the engine starts
    with the app)."""
    from amplituhedron_rs.runtime.gguf_file import model_id
    from amplituhedron_rs.serve.app import ServeSettings, create_app

    if o.mesh is not None or o.stations is not None:
        front, tokenizer, context_len = _mesh_front(o)
    else:
        front, tokenizer, context_len = _local_front(o)
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
    )
    return create_app(front, tokenizer, settings)


def _local_front(o: ServeOptions) -> tuple[EngineFront, Tokenizer, int]:
    """The in-process engine over the whole model."""
    from amplituhedron_rs.runtime import BatchOptions, CacheOptions, load_model
    from amplituhedron_rs.serve.frontend import EngineFront

    model = load_model(
        o.model_path,
        precision=o.precision,  # type: ignore[arg-type]
        kv_dtype=o.kv_dtype,  # type: ignore[arg-type]
        batch=BatchOptions(
            max_running=o.max_batch, max_queue=o.max_queue, step_tokens=o.step_tokens
        ),
        cache=CacheOptions(
            max_prefix_len=o.max_prefix_len,
            cache_dir=o.cache_dir,
            max_disk_bytes=o.max_disk_bytes,
        ),
    )
    context_len = min(model.session_options.slots, int(model.file.config["context_len"]))
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
    context_len = min(SessionOptions().slots, int(model_file.config["context_len"]))
    return EngineFront(engine, stepper), Tokenizer(model_file), context_len


def serve(o: ServeOptions) -> None:
    """Runs the server until interrupted."""
    from amplituhedron_rs.edge.server import run

    app = build_app(o)
    run(app, o.host, o.port, o.edge_limits())
