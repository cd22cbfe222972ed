"""What ``amplituhedron serve`` is started with (light to import: the CLI reads its
defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from amplituhedron_rs.edge.limits import DEFAULT_JSON_BYTES, EdgeLimits
from amplituhedron_rs.runtime.options import DEFAULT_KV_DTYPE, BatchOptions, CacheOptions


@dataclass
class ServeOptions:
    """Everything ``amplituhedron serve`` takes."""

    model_path: str | None = None
    #: The id clients name the model by (None: the known name, or the file's stem).
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    max_batch: int = BatchOptions.max_running
    max_queue: int = BatchOptions.max_queue
    #: Rows per step; smaller than a single process's default, to bound the inter-token
    #: latency of the running streams while a new prompt is prefilled.
    step_tokens: int = 64
    precision: str = "refined"
    kv_dtype: str = DEFAULT_KV_DTYPE
    draft: bool = False
    draft_max: int = 8
    #: Longest prefix the volume cache captures; a longer prompt caches its first this many
    #: tokens (raise it for system prompts or RAG preambles longer than the default).
    max_prefix_len: int = CacheOptions.max_prefix_len
    #: The volume cache (``False``: every prompt is prefilled, nothing is captured).
    cache: bool = True
    #: Volumes the cache holds, its eviction policy, and the shortest cached prefix a new
    #: prompt replays (0: exact prompts only).
    max_entries: int = CacheOptions.max_entries
    policy: str = CacheOptions.policy
    min_prefix_reuse: int = CacheOptions.min_prefix_reuse
    #: Persist captured volumes under this directory (None: memory only).
    cache_dir: str | None = None
    #: Disk budget of ``cache_dir`` (None: unbounded).
    max_disk_bytes: int | None = None
    #: Serve through a mesh: a mesh file or comma-separated station URLs (the server is the
    #: mesh's coordinator; ``model_path`` then only gives the tokenizer and chat template).
    mesh: str | None = None
    #: Serve through a local mesh of this many station processes, started with the server.
    stations: int | None = None
    #: The mesh's bearer token (None with ``stations``: a fresh one is generated).
    mesh_token: str | None = None
    #: Positions a request may use, prompt and reply (None: the model's context, bounded by
    #: a session's ring); in process it sizes the sessions' rings too.
    max_model_len: int | None = None
    #: A Jinja chat template file used instead of the model file's.
    chat_template: str | None = None
    #: Let every API key reuse every other key's cached prompts. Off by default: each key
    #: is its own cache partition, because ``usage.cached_tokens`` (and latency) tell a
    #: caller whether a prompt was cached, which lets one key recover another's prompts.
    shared_cache_keys: bool = False
    #: Parse special tokens spelled inside message content as control tokens (off: content
    #: is text, so no message can forge a system or assistant turn).
    allow_special_tokens_in_content: bool = False
    #: Serve /metrics without a key (for a scraper); /docs and /openapi.json stay closed.
    open_metrics: bool = False
    #: Largest request body, counted as it streams (chunked too).
    max_body_bytes: int = DEFAULT_JSON_BYTES
    #: Open connections; past it idle ones are closed first, then new ones get a 503.
    max_connections: int = EdgeLimits.max_connections
    #: Seconds a connection may take to send a request head, and then its body.
    header_timeout_s: float = EdgeLimits.header_timeout_s
    body_timeout_s: float = EdgeLimits.body_timeout_s

    def __post_init__(self) -> None:
        self.edge_limits()  # a bad bound is refused before the model loads

    def edge_limits(self) -> EdgeLimits:
        """The bounds of the server's HTTP surface."""
        return EdgeLimits(
            max_connections=self.max_connections,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            max_json_bytes=self.max_body_bytes,
            max_octet_bytes=self.max_body_bytes,
        )
