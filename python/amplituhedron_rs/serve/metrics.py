"""Prometheus series of the server, named after vLLM's so that a vLLM Grafana dashboard
works after renaming the prefix (``vllm:`` → ``amplituhedron:``); every series carries a
``model_name`` label, as vLLM's do.

vLLM's names: the scheduler's state (``num_requests_running``, ``num_requests_waiting``,
``kv_cache_usage_perc``), tokens (``prompt_tokens_total``, ``generation_tokens_total``), the
prefix cache in tokens (``prefix_cache_queries_total``, ``prefix_cache_hits_total``), finished
sequences by reason (``request_success_total``), and per-request histograms (time to first
token, inter-token latency, end-to-end latency, queue, prefill, decode and inference time,
prompt and generation lengths). Ours, with the same prefix: the engine's load
(``engine_steps_total``, ``engine_rows_total``, ``engine_busy_seconds_total``), requests
accepted and refused, sequences holding KV, batched steps sent to stations and a mesh's
failover counters. ``docs/serving.md`` lists them; ``docs/grafana/amplituhedron.json`` charts
them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from amplituhedron_rs.serve.frontend import EngineFront

PREFIX = "amplituhedron:"
LABEL = "model_name"

# vLLM's buckets (seconds; tokens), so that dashboards' quantiles compare.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_N_BUCKETS = (1, 2, 5, 10, 20)


class FailoverCollector:
    """A mesh's failover counters, read from the executor at scrape time (none in process)."""

    HELP: ClassVar[dict[str, str]] = {
        "failovers": "Station failures the mesh executor handled (a replica took over)",
        "rebuilt_sequences": "Sequences rebuilt on a new chain of stations after a failure",
        "rebuild_seconds": "Seconds spent rebuilding sequences after failures",
    }

    def __init__(self, front: EngineFront, model: str) -> None:
        self.front = front
        self.model = model

    def collect(self) -> Iterator[Metric]:
        counters = self.front.stepper.failover_counters()
        p = f"{PREFIX}mesh_"
        for key, help_ in self.HELP.items():
            if key in counters:
                c = CounterMetricFamily(f"{p}{key}", help_, labels=[LABEL])
                c.add_metric([self.model], counters[key])
                yield c
        if "stations_down" in counters:
            g = GaugeMetricFamily(f"{p}stations_down", "Stations marked down now", labels=[LABEL])
            g.add_metric([self.model], counters["stations_down"])
            yield g


class EngineCollector:
    """The engine's state and load, read at scrape time: the scheduler's queues, the KV rings
    in use, batches run, their rows, and the seconds a batch was in flight. ``busy_seconds``
    over a wall time is how busy the executor was; tokens over ``busy_seconds`` is what the
    engine sustains with the HTTP layer's cost taken out."""

    def __init__(self, front: EngineFront, model: str) -> None:
        self.front = front
        self.model = model

    def _gauge(self, name: str, help_: str, value: float) -> Metric:
        g = GaugeMetricFamily(f"{PREFIX}{name}", help_, labels=[LABEL])
        g.add_metric([self.model], value)
        return g

    def collect(self) -> Iterator[Metric]:
        engine, m = self.front.engine, [self.model]
        yield self._gauge("num_requests_running", "Sequences running", engine.running)
        yield self._gauge(
            "num_requests_waiting", "Requests waiting for a place in the batch", engine.waiting
        )
        live = self.front.live_sequences
        yield self._gauge(
            "kv_cache_usage_perc",
            "Fraction of the engine's KV rings in use (one per running sequence, "
            "max-batch in all; 1 = full)",
            min(1.0, live / max(1, engine.limits[0])),
        )
        yield self._gauge(
            "live_sequences", "Sequences holding KV (0 when idle: nothing leaked)", live
        )
        hops = CounterMetricFamily(
            f"{PREFIX}station_requests",
            "Batched steps sent to stations (over a mesh: one per station per step)",
            labels=[LABEL],
        )
        hops.add_metric(m, self.front.stepper.station_requests)
        yield hops
        t = engine.step_totals
        steps = CounterMetricFamily(f"{PREFIX}engine_steps", "Batched steps run", labels=[LABEL])
        steps.add_metric(m, t.steps)
        yield steps
        rows = CounterMetricFamily(
            f"{PREFIX}engine_rows",
            "Rows computed: prompt (prefill) or decode (drafts included)",
            labels=[LABEL, "kind"],
        )
        rows.add_metric([*m, "prompt"], t.prompt_rows)
        rows.add_metric([*m, "decode"], t.decode_rows)
        yield rows
        busy = CounterMetricFamily(
            f"{PREFIX}engine_busy_seconds", "Seconds a batched step was in flight", labels=[LABEL]
        )
        busy.add_metric(m, t.busy_seconds)
        yield busy


class ServeMetrics:
    """One registry per server (several servers in one process never collide)."""

    def __init__(self, front: EngineFront, model: str) -> None:
        r = self.registry = CollectorRegistry()
        p, labels = PREFIX, [LABEL]
        self.model = model

        plain: list[Counter | Histogram] = []  # labelled by the model only

        def counter(name: str, help_: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(f"{p}{name}", help_, [*labels, *extra], registry=r)
            if not extra:
                plain.append(c)
            return c

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(f"{p}{name}", help_, labels, registry=r, buckets=buckets)
            plain.append(h)
            return h

        self.requests = counter("requests_accepted", "HTTP requests accepted", ("endpoint",))
        self.rejected = counter("requests_rejected", "Requests refused: the queue was full")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished sequences")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix (volume) cache"
        )
        self.cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from a replayed volume"
        )
        self.full_hits = counter(
            "prefix_cache_full_hits", "Sequences whose whole prompt was replayed (no prefill)"
        )
        self.draft_proposed = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed by prompt lookup"
        )
        self.draft_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the model accepted"
        )
        self.success = counter(
            "request_success",
            "Sequences finished, by reason (stop: EOS or a stop sequence; length; abort: "
            "the client left; error)",
            ("finished_reason",),
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Waiting for a place in the batch", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "From admission to the first token (replay and prefill)",
            _REQUEST_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the last", _REQUEST_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Prefill and decode", _REQUEST_BUCKETS
        )
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length", _TOKEN_BUCKETS)
        self.generation_len = histogram(
            "request_generation_tokens", "Tokens generated per sequence", _TOKEN_BUCKETS
        )
        self.max_generation_len = histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by a sequence of the request (one sequence per choice)",
            _TOKEN_BUCKETS,
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a request asked for", _TOKEN_BUCKETS
        )
        self.params_n = histogram("request_params_n", "Choices a request asked for", _N_BUCKETS)
        # Every series exists from the start (at 0), as vLLM's do: a dashboard shows zeros,
        # not "no data", before the first request of a kind.
        for metric in plain:
            metric.labels(model)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model, reason)
        for endpoint in ("chat", "completions"):
            self.requests.labels(model, endpoint)
        r.register(EngineCollector(front, model))
        r.register(FailoverCollector(front, model))

    def accepted(self, endpoint: str, max_tokens: int, choices: int) -> None:
        self.requests.labels(self.model, endpoint).inc()
        self.params_max_tokens.labels(self.model).observe(max_tokens)
        self.params_n.labels(self.model).observe(choices)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        stats: Mapping[str, int | float | bool],
        reason: str,
        e2e_seconds: float,
    ) -> None:
        """One sequence's end, whatever ended it (``reason``: stop, length, abort, error)."""
        m = self.model
        cached = int(stats.get("cached_tokens", 0))
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.cache_queries.labels(m).inc(prompt_tokens)
        self.cache_hits.labels(m).inc(cached)
        self.draft_proposed.labels(m).inc(int(stats.get("draft_proposed", 0)))
        self.draft_accepted.labels(m).inc(int(stats.get("draft_accepted", 0)))
        if stats.get("cache_hit"):
            self.full_hits.labels(m).inc()
        self.success.labels(m, reason).inc()
        prefill = float(stats.get("prefill_ms", 0.0)) / 1000
        decode = float(stats.get("decode_ms", 0.0)) / 1000
        self.e2e.labels(m).observe(e2e_seconds)
        self.queue_time.labels(m).observe(float(stats.get("queue_ms", 0.0)) / 1000)
        self.prefill_time.labels(m).observe(prefill)
        self.decode_time.labels(m).observe(decode)
        self.inference_time.labels(m).observe(prefill + decode)
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.generation_len.labels(m).observe(completion_tokens)
        self.max_generation_len.labels(m).observe(completion_tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
