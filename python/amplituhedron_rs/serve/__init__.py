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

__all__ = ["ServeOptions", "build_app", "serve"]


def build_app(o: ServeOptions) -> FastAPI:
    """Loads the model and returns the ASGI app (the engine starts with the app)."""
    from amplituhedron_rs.runtime import BatchOptions, load_model
    from amplituhedron_rs.runtime.gguf_file import model_id
    from amplituhedron_rs.serve.app import ServeSettings, create_app
    from amplituhedron_rs.serve.frontend import EngineFront

    model = load_model(
        o.model_path,
        precision=o.precision,  # type: ignore[arg-type]
        batch=BatchOptions(
            max_running=o.max_batch, max_queue=o.max_queue, step_tokens=o.step_tokens
        ),
    )
    settings = ServeSettings(
        model_name=o.served_model_name or model_id(o.model_path),
        context_len=min(model.session_options.slots, int(model.file.config["context_len"])),
        api_keys=o.api_keys,
        draft_by_default=o.draft,
        draft_max=o.draft_max,
    )
    return create_app(EngineFront(model.engine), model.tokenizer, settings)


def serve(o: ServeOptions) -> None:
    """Runs the server until interrupted."""
    import uvicorn

    app = build_app(o)
    uvicorn.run(app, host=o.host, port=o.port, log_level="warning", access_log=False)
