"""The scheduler front: hands requests to the engine and streams its events back.

The engine (Rust) does the scheduling — continuous batching, chunked prefill under a step
budget, admission through the volume cache. This front only owns the thread that steps it:
a dedicated thread calls its :class:`Stepper` (the in-process engine's ``step()``, which
releases the GIL while the model runs, or a mesh executor's step through the stations)
while the event loop submits and cancels; each step's events are delivered to the requests'
asyncio queues in one hand-off.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from amplituhedron_rs import _core


class Stepper(Protocol):
    """Runs the engine's steps: one interface for the in-process and the mesh executor."""

    def step(self) -> list[_core.EngineEvent]:
        """One step; what it reported."""
        ...

    @property
    def live_sequences(self) -> int:
        """Sequences holding KV (0 when idle: nothing leaked)."""
        ...

    @property
    def station_requests(self) -> int:
        """Batched steps sent to stations (a mesh: one per station per step; else 0)."""
        ...

    def failover_counters(self) -> dict[str, float]:
        """A mesh's failover counters (failovers, rebuilt_sequences, rebuild_seconds,
        stations_down); empty in process. Read from the metrics thread."""
        ...

    def close(self) -> None:
        """Frees what the executor holds (called once, by the stepping thread, at the end)."""
        ...


class LocalStepper:
    """The in-process engine steps itself (one batched forward over the whole model)."""

    def __init__(self, engine: _core.Engine) -> None:
        self.engine = engine

    def step(self) -> list[_core.EngineEvent]:
        return self.engine.step()

    @property
    def live_sequences(self) -> int:
        return self.engine.live_sequences or 0

    @property
    def station_requests(self) -> int:
        return 0

    def failover_counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class GenerationParams:
    """What the engine needs to run one request."""

    prompt: list[int]
    max_new_tokens: int
    sampling: dict[str, Any]
    stop_ids: list[int] = field(default_factory=list)
    salt: str | None = None
    use_cache: bool = True
    draft_max: int | None = None
    #: Report each token's log-probability with this many alternatives (None: none).
    logprobs: int | None = None
    #: The same for every prompt token after the first (None: none).
    prompt_logprobs: int | None = None
    #: The compiled constraint its tokens are sampled under (None: free).
    grammar: _core.Grammar | None = None


class RequestStream:
    """The events of one submitted request, ending with its ``finished`` event."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[_core.EngineEvent] = asyncio.Queue()
        self.finished: _core.EngineEvent | None = None

    async def events(self) -> AsyncIterator[_core.EngineEvent]:
        while self.finished is None:
            ev = await self.queue.get()
            if ev.kind == "finished":
                self.finished = ev
            yield ev


class EngineFront:
    """Steps an engine in a background thread and routes its events to request streams."""

    def __init__(self, engine: _core.Engine, stepper: Stepper | None = None) -> None:
        self.engine = engine
        self.stepper: Stepper = stepper if stepper is not None else LocalStepper(engine)
        self._streams: dict[int, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0

    def start(self) -> None:
        """Starts the stepping thread (call from the event loop that awaits the streams)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="amplituhedron-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, p: GenerationParams) -> RequestStream:
        """Queues a request. Raises ValueError (bad request) or RuntimeError (queue full);
        nothing is queued then."""
        with self._wake:
            seq = self.engine.submit(
                p.prompt,
                p.max_new_tokens,
                **p.sampling,
                stop_ids=p.stop_ids,
                salt=p.salt,
                use_cache=p.use_cache,
                draft_max=p.draft_max,
                logprobs=p.logprobs,
                prompt_logprobs=p.prompt_logprobs,
                grammar=p.grammar,
            )
            stream = RequestStream(seq)
            self._streams[seq] = stream
            self._wake.notify()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Stops a request (its client left): its KV is freed at the next step."""
        with self._wake:
            self._streams.pop(stream.seq, None)
            self.engine.cancel(stream.seq)
            self._wake.notify()

    @property
    def live_sequences(self) -> int:
        return self.stepper.live_sequences

    @property
    def live_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    def _run(self) -> None:
        try:
            self._loop_steps()
        finally:
            self.stepper.close()

    def _loop_steps(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_work:
                    self._wake.wait()
                if self._stopped:
                    return
            events = self.stepper.step()
            self.steps += 1
            if not events:
                continue
            deliveries = []
            with self._lock:
                for ev in events:
                    stream = self._streams.get(ev.seq)
                    if stream is None:
                        continue  # cancelled meanwhile
                    if ev.kind == "finished":
                        del self._streams[ev.seq]
                    deliveries.append((stream, ev))
            if deliveries and self._loop is not None:
                self._loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[tuple[RequestStream, _core.EngineEvent]]) -> None:
    for stream, ev in deliveries:
        stream.queue.put_nowait(ev)
