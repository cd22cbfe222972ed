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
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from amplituhedron_rs import _core

log = logging.getLogger("amplituhedron.serve")


class EngineFailed(RuntimeError):
    """The engine's stepping thread stopped on an error: nothing more will run (every
    waiting request is failed with this, and new ones are refused)."""


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
    """The events of one submitted request, ending with its ``finished`` event (or an
    :class:`EngineFailed` if the engine died first)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[_core.EngineEvent | EngineFailed] = asyncio.Queue()
        self.finished: _core.EngineEvent | None = None

    async def events(self) -> AsyncIterator[_core.EngineEvent]:
        while self.finished is None:
            ev = await self.queue.get()
            if isinstance(ev, EngineFailed):
                raise ev
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
        #: Why the stepping thread stopped, if it died (then nothing runs any more).
        self.failure: str | None = None

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

    @property
    def alive(self) -> bool:
        """Whether the engine steps (started, not stopped, not dead)."""
        thread = self._thread
        return self.failure is None and thread is not None and thread.is_alive()

    def submit(self, p: GenerationParams) -> RequestStream:
        """Queues a request. Raises ValueError (bad request), QueueFullError (queue full) or
        EngineFailed (the engine died); nothing is queued then."""
        with self._wake:
            if self.failure is not None:
                raise EngineFailed(self.failure)
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

    def cancel(self, stream: RequestStream) -> _core.EngineEvent | None:
        """Stops a request (its client left, or a stop sequence ended it): its KV is freed at
        the next step. Returns its end (figures included), or None when it had already ended
        in the engine: that end is then still delivered to its stream."""
        with self._wake:
            ev = self.engine.cancel(stream.seq)
            if ev is not None:
                self._streams.pop(stream.seq, None)
            self._wake.notify()
        return ev

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
        except BaseException as exc:
            # Per-sequence failures finish their sequence inside the step; reaching here is
            # a bug or a broken backend. Say so on /health and end every waiting request
            # now rather than leave them waiting for a step that never comes.
            log.exception("the engine thread failed")
            self._die(f"the engine stopped: {type(exc).__name__}: {exc}")
        finally:
            try:
                self.stepper.close()
            except Exception:
                log.exception("closing the engine's executor failed")

    def _die(self, failure: str) -> None:
        with self._wake:
            self.failure = failure
            streams = list(self._streams.values())
            self._streams.clear()
        if streams and self._loop is not None and not self._loop.is_closed():
            error = EngineFailed(failure)
            deliveries: list[Delivery] = [(stream, error) for stream in streams]
            self._loop.call_soon_threadsafe(_deliver, deliveries)

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
            deliveries: list[Delivery] = []
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


#: An event (or the engine's failure) for one request's stream.
Delivery = tuple[RequestStream, "_core.EngineEvent | EngineFailed"]


def _deliver(deliveries: list[Delivery]) -> None:
    for stream, ev in deliveries:
        stream.queue.put_nowait(ev)
