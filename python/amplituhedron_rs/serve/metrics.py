"""Prometheus series of the server: requests, tokens, cache hits, queue, latencies, and the
engine's load (steps, rows, busy seconds)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from amplituhedron_rs.serve.frontend import EngineFront

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class FailoverCollector:
    """A mesh's failover counters, read from the executor at scrape time (none in process)."""

    HELP: ClassVar[dict[str, str]] = {
        "failovers": "Station failures the mesh executor handled (a replica took over)",
        "rebuilt_sequences": "Sequences rebuilt on a new chain of stations after a failure",
        "rebuild_seconds": "Seconds spent rebuilding sequences after failures",
    }

    def __init__(self, front: EngineFront) -> None:
        self.front = front

    def collect(self) -> Iterator[Metric]:
        counters = self.front.stepper.failover_counters()
        p = "amplituhedron_serve_mesh"
        for key, help_ in self.HELP.items():
            if key in counters:
                c = CounterMetricFamily(f"{p}_{key}", help_)
                c.add_metric([], counters[key])
                yield c
        if "stations_down" in counters:
            g = GaugeMetricFamily(f"{p}_stations_down", "Stations marked down now")
            g.add_metric([], counters["stations_down"])
            yield g


class EngineCollector:
    """The engine's load, read at scrape time: batches run, their rows, and the seconds a
    batch was in flight. ``busy_seconds`` over a wall time is how busy the executor was;
    tokens over ``busy_seconds`` is what the engine sustains with the HTTP layer's cost
    taken out."""

    def __init__(self, front: EngineFront) -> None:
        self.front = front

    def collect(self) -> Iterator[Metric]:
        t = self.front.engine.step_totals
        p = "amplituhedron_serve_engine"
        steps = CounterMetricFamily(f"{p}_steps", "Batched steps run")
        steps.add_metric([], t.steps)
        yield steps
        rows = CounterMetricFamily(
            f"{p}_rows",
            "Rows computed: prompt (prefill) or decode (drafts included)",
            labels=["kind"],
        )
        rows.add_metric(["prompt"], t.prompt_rows)
        rows.add_metric(["decode"], t.decode_rows)
        yield rows
        busy = CounterMetricFamily(f"{p}_busy_seconds", "Seconds a batched step was in flight")
        busy.add_metric([], t.busy_seconds)
        yield busy


class ServeMetrics:
    """One registry per server (several servers in one process never collide)."""

    def __init__(self, front: EngineFront) -> None:
        r = self.registry = CollectorRegistry()
        p = "amplituhedron_serve"
        self.requests = Counter(f"{p}_requests", "Requests accepted", ["endpoint"], registry=r)
        self.rejected = Counter(f"{p}_rejected", "Requests refused: queue full", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            f"{p}_cached_tokens", "Prompt tokens served from a replayed volume", registry=r
        )
        self.cache_hits = Counter(
            f"{p}_cache_hits", "Requests whose whole prompt was replayed", registry=r
        )
        self.draft_proposed = Counter(
            f"{p}_draft_proposed", "Draft tokens proposed by prompt lookup", registry=r
        )
        self.draft_accepted = Counter(
            f"{p}_draft_accepted", "Draft tokens the model accepted", registry=r
        )
        self.finished_by = Counter(
            f"{p}_finished", "Sequences finished, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            f"{p}_inter_token_seconds", "Time between tokens", registry=r, buckets=_ITL_BUCKETS
        )
        self.latency = Histogram(
            f"{p}_request_seconds", "Request latency", registry=r, buckets=_LATENCY_BUCKETS
        )
        waiting = Gauge(f"{p}_queue_waiting", "Requests waiting for a place", registry=r)
        waiting.set_function(lambda: front.engine.waiting)
        running = Gauge(f"{p}_running", "Sequences running", registry=r)
        running.set_function(lambda: front.engine.running)
        live = Gauge(
            f"{p}_live_sequences", "Sequences holding KV (0 when idle: nothing leaked)", registry=r
        )
        live.set_function(lambda: front.live_sequences)
        hops = Gauge(
            f"{p}_station_requests",
            "Batched steps sent to stations (over a mesh: one per station per step)",
            registry=r,
        )
        hops.set_function(lambda: front.stepper.station_requests)
        r.register(FailoverCollector(front))
        r.register(EngineCollector(front))

    def finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        stats: Mapping[str, int | float | bool],
        reason: str,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(int(stats.get("cached_tokens", 0)))
        self.draft_proposed.inc(int(stats.get("draft_proposed", 0)))
        self.draft_accepted.inc(int(stats.get("draft_accepted", 0)))
        if stats.get("cache_hit"):
            self.cache_hits.inc()
        self.finished_by.labels(reason).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()
