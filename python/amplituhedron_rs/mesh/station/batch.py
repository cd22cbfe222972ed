"""The batched step: one request runs one step of many sessions (SPEC §10, §11).

``POST /batch/step`` (bearer token; framing in :mod:`amplituhedron_rs.mesh.protocol`) runs
every entry's rows through this station's layers in ONE forward pass (weights read once per
step), so a mesh pays each hop once per step, not once per session. Per entry it first rolls
the session back to the entry's ``start`` (positions of drafts rejected last step), and at
the exit station it emits: the first token after a prompt's last chunk, or for a decode
entry the verified drafts plus one token of the model's (each session's own seeded sampler,
keyed by position, so the tokens equal the single-process engine's). An entry that ends its
prompt with ``capture`` freezes the prompt's volume from this station's own KV, own last
output row and own logits: no client tensor is cached, and only a session whose forwarded
positions are exactly its prompt is captured (the rules of ``/amplituhedron/capture``). A
prompt longer than the cache's longest prefix caches that many of its first tokens instead,
from the ``capture`` chunk that computes the head's last position (its row is the tail).

Bounded like ``forward``: at most ``max_chunk`` rows per entry (and ``max_logits_rows`` for
a decode entry's verification logits), the body limit of octet bodies, and distinct live
sessions per entry. Everything is checked before any ring changes: a bad entry answers 4xx
and changes nothing. The step runs in a worker thread, which alone waits on session locks.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh.protocol import (
    BATCH_ROUTE,
    FRAME_HEADER,
    OCTETS,
    BatchEntryResult,
    BatchEntrySpec,
    BatchStepReply,
    BatchStepRequest,
    StepTiming,
    TokenLogprobsWire,
    split_frame,
)
from amplituhedron_rs.mesh.station.errors import BadBody, Conflict, TooLarge
from amplituhedron_rs.mesh.station.routes import (
    OCTET_BODY,
    StationDep,
    in_thread,
    read_body,
)
from amplituhedron_rs.mesh.station.session import FloatArray, LiveSession, LogitsRows, floats
from amplituhedron_rs.mesh.station.state import Station


@dataclass
class _Planned:
    spec: BatchEntrySpec
    live: LiveSession
    input: Any  # token ids (entry station) or an (n, hidden) float32 array


class BatchStepper:
    """A station's batched steps: one reusable set of step buffers (in the core's
    ``BatchForward``), used by one step at a time."""

    def __init__(self, station: Station) -> None:
        s = station.settings
        self.station = station
        self.forward = _core.BatchForward(station.weights, s.layer_lo, s.layer_hi)
        self.max_rows = int(station.max_rows)
        #: Whether a step ran since the buffers were last released.
        self.used = False

    def release_if_idle(self) -> bool:
        """Drops the step buffers grown by earlier steps (and returns the freed heap to the
        system) when the station holds no session and computes nothing: a station that
        prefilled keeps its chunk-sized buffers (≈ 26 MB at a 7B shape) otherwise. True when
        they were released."""
        if not self.used or not self.station.is_idle():
            return False
        released = self.forward.release_buffers()
        self.used = not released
        return released

    def step(self, body: bytes) -> bytes:
        """Runs one framed step (``/batch/step``'s body); returns the framed answer."""
        try:
            head, payload = split_frame(body)
        except ValueError as exc:
            raise BadBody(f"batch step body: {exc}") from exc
        received = time.monotonic()
        reply, out = self.run(parse_step(head), payload, received=received)
        return len(reply).to_bytes(FRAME_HEADER, "little") + reply + out

    def run(
        self,
        req: BatchStepRequest,
        payload: bytes | memoryview,
        *,
        received: float,
        wait: float | None = None,
    ) -> tuple[bytes, bytes]:
        """Runs one step: its parsed header (:func:`parse_step`) and payload in, the
        answer's JSON header and payload out. ``received``: when the request was in
        (``time.monotonic()``, for the timing answer). ``wait``: seconds to wait for a busy
        session (default: the station's ``busy_wait_s``); 0 on the event loop, where a busy
        session raises Busy before anything changed, so the caller can run the step in a
        worker instead."""
        st = self.station
        self.used = True
        planned = self._plan(req, payload)
        wait = st.settings.busy_wait_s if wait is None else wait
        # Locks in one global order (session id), so concurrent steps cannot deadlock; in a
        # worker thread waiting (bounded) for a busy session is fine, on the loop it is not.
        with st.computing(), contextlib.ExitStack() as held:
            for p in sorted(planned, key=lambda p: p.spec.session_id):
                held.enter_context(p.live.use(p.spec.session_id, wait))
            self._check_positions(planned)
            ready = time.monotonic()
            for p in planned:
                if p.live.session.clock > p.spec.start:
                    p.live.rollback(p.live.session, p.spec.start)
            outs = self.forward.run(
                [p.live.session for p in planned],
                [p.input for p in planned],
                [self._logits(p.spec) for p in planned],
                [
                    _core.SpanType.USER
                    if p.spec.kind == "prefill"
                    else _core.SpanType.RESPONSE_SENTENCE
                    for p in planned
                ],
            )
            computed = time.monotonic()
            results = [self._finish(p, h, lg) for p, (h, lg) in zip(planned, outs, strict=True)]
        out = b"" if st.is_exit else b"".join(_f32(h) for h, _ in outs)
        reply = BatchStepReply(entries=results)
        if req.timing:
            reply.timing = StepTiming(
                received=received, planned=ready, computed=computed, finished=time.monotonic()
            )
        return reply.model_dump_json().encode(), out

    def _plan(self, req: BatchStepRequest, payload: bytes | memoryview) -> list[_Planned]:
        """Every check that needs no session lock: sizes, kinds, the payload's shape."""
        st = self.station
        seen: set[str] = set()
        for i, e in enumerate(req.entries):
            if e.session_id in seen:
                raise BadBody(f"entry {i}: session {e.session_id!r} appears twice in the step")
            seen.add(e.session_id)
            if len(e.tokens) > self.max_rows:
                raise TooLarge(
                    f"entry {i}: {len(e.tokens)} rows exceed this station's {self.max_rows} "
                    "rows per entry"
                )
            scored = e.kind == "decode" or e.prompt_logprobs is not None
            if scored and st.is_exit and len(e.tokens) > st.settings.max_logits_rows:
                raise TooLarge(
                    f"entry {i}: {len(e.tokens)} rows to verify; at most "
                    f"{st.settings.max_logits_rows} rows of logits per entry"
                )
            bad = next((t for t in e.tokens if t >= st.vocab), None)
            if bad is not None:
                raise InputError(
                    f"entry {i}: token id {bad} is outside the vocabulary of {st.vocab}"
                )
            if e.kind == "decode" and (
                e.last or e.emit or e.capture or e.prompt_logprobs is not None
            ):
                raise BadBody(
                    f"entry {i}: last, emit, capture and prompt_logprobs are for prefill entries"
                )
            if e.emit and not e.last:
                raise BadBody(f"entry {i}: emit needs the prompt's last chunk")
        rows = sum(len(e.tokens) for e in req.entries)
        if st.is_entry:
            if len(payload):
                raise BadBody("the entry station takes token ids in the header, no payload")
            inputs: list[Any] = [list(e.tokens) for e in req.entries]
        else:
            values = floats(bytes(payload), "hidden rows")
            if values.size != rows * st.hidden:
                raise BadBody(
                    f"the payload must hold {rows} rows of {st.hidden} f32 "
                    f"({rows * st.hidden * 4} bytes), got {len(payload)} bytes"
                )
            table = values.reshape(rows, st.hidden)
            inputs, at = [], 0
            for e in req.entries:
                inputs.append(table[at : at + len(e.tokens)])
                at += len(e.tokens)
        return [
            _Planned(e, st.get_session(e.session_id), x)
            for e, x in zip(req.entries, inputs, strict=True)
        ]

    @staticmethod
    def _check_positions(planned: list[_Planned]) -> None:
        """Under the sessions' locks: each entry starts within its session's positions, a
        prefill entry carries the session's own prompt tokens, a decode entry follows it."""
        for p in planned:
            e, live = p.spec, p.live
            clock = int(live.session.clock)
            if e.start > clock:
                raise Conflict(
                    f"session {e.session_id!r} holds {clock} positions; "
                    f"the entry starts at {e.start}"
                )
            n = len(live.prompt)
            if e.kind == "prefill":
                end = e.start + len(e.tokens)
                if e.tokens != live.prompt[e.start : end] or e.last != (end == n):
                    raise Conflict(
                        f"session {e.session_id!r}: the entry is not its prompt's positions "
                        f"{e.start}:{end}" + (" (the prompt's last chunk)" if e.last else "")
                    )
            elif e.start < n:
                raise Conflict(
                    f"session {e.session_id!r}: a decode entry starts after the {n}-token "
                    f"prompt, not at {e.start}"
                )

    def _logits(self, e: BatchEntrySpec) -> LogitsRows:
        if not self.station.is_exit:
            return "none"
        if e.kind == "decode":
            return "last" if len(e.tokens) == 1 else "all"
        if e.prompt_logprobs is not None:
            return "all"
        return "last" if e.last else "none"

    def _finish(
        self, p: _Planned, hidden: FloatArray, logits: FloatArray | None
    ) -> BatchEntryResult:
        """Emission (exit station) and capture of one entry, under its session's lock."""
        st, e, live = self.station, p.spec, p.live
        # What a capture may freeze, recorded as ``forward`` does (the entry station's
        # prefill tokens were checked against the prompt already).
        ids = np.asarray(e.tokens, dtype=np.uint32) if st.is_entry else None
        live.note_prompt(ids, e.start, hidden, logits, self._logits(e))
        emitted: list[int] = []
        logprobs = prompt_logprobs = None
        if st.is_exit and logits is not None and e.prompt_logprobs is not None:
            # Row j predicts the prompt token after it (the last prompt row: the first output).
            after = live.prompt[e.start + 1 : e.start + 1 + len(e.tokens)]
            prompt_logprobs = [
                TokenLogprobsWire.of(_core.token_logprobs(logits[j], t, e.prompt_logprobs))
                for j, t in enumerate(after)
            ]
        done, error = False, None
        if st.is_exit and logits is not None:
            assert live.sampler is not None
            g = live.grammar
            try:
                if e.kind == "decode":
                    if g is not None:
                        # The grammar follows the tokens before the drafts (see align).
                        g.align(e.start + 1 - len(live.prompt), e.tokens[0])
                    # The row's token for the penalties; after the verification every row's,
                    # so a rebuilt session's pieces teach it the tokens it missed (the next
                    # step starts at the last emitted token and overwrites what was rejected).
                    live.sampler.observe(e.start, e.tokens[:1])
                    emitted = list(live.sampler.verify(logits, e.tokens[1:], e.start + 1, g))
                    live.sampler.observe(e.start, e.tokens)
                    rows = logits
                elif e.emit:
                    if g is not None:
                        g.align(0, 0)
                    index = e.start + len(e.tokens)
                    emitted = [int(live.sampler.sample(logits[-1], index, g))]
                    rows = logits[-1:]
            except InputError as exc:
                if g is None:
                    raise
                # A grammar that cannot go on ends its sequence, not the step.
                error, emitted = str(exc), []
            done = g is not None and g.done
            if e.logprobs is not None:
                logprobs = [
                    TokenLogprobsWire.of(_core.token_logprobs(rows[j], t, e.logprobs))
                    for j, t in enumerate(emitted)
                ]
        captured = 0
        if e.capture:
            # A refused (positions not the prompt), declined or failed capture never fails
            # the step: the entry reports 0 bytes.
            with contextlib.suppress(Conflict, _core.AmplituhedronError):
                captured = _capture_head(st, live, e.start, hidden)
            if e.last:
                with contextlib.suppress(Conflict, _core.AmplituhedronError):
                    captured += st.capture_own(live, live.session)
        return BatchEntryResult(
            clock=int(live.session.clock),
            rows=0 if st.is_exit else int(hidden.shape[0]),
            emitted=emitted,
            captured=captured,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            done=done,
            error=error,
        )


def _capture_head(st: Station, live: LiveSession, start: int, hidden: FloatArray) -> int:
    """A prompt longer than the cache's longest prefix caches that many of its first tokens
    when the chunk at ``start`` (this station's output rows ``hidden``) computed the head's
    last position: its row is the tail, without logits (a later exact hit runs that position
    again). 0 when the chunk does not end the head or nothing is captured. Under the
    session's lock."""
    head = st.max_prefix_len
    if not (len(live.prompt) > head and start < head <= start + hidden.shape[0]):
        return 0
    if not live.exact or st.declines_captures is not None:
        return 0
    tail = np.array(hidden[head - 1 - start], dtype=np.float32)
    with st.pipeline_lock:
        return int(
            st.pipeline.amplituhedron_capture(
                live.session, live.prompt[:head], tail, None, live.salt
            )
        )


def parse_step(head: bytes) -> BatchStepRequest:
    """A step's JSON header, validated (BadBody: it is not a step)."""
    try:
        return BatchStepRequest.model_validate_json(head)
    except ValidationError as exc:
        raise BadBody(f"batch step header: {exc}") from exc


def _f32(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def stepper_of(state: Any, station: Station) -> BatchStepper:
    """The app's one stepper (in its ``state``; its step buffers grow to the largest step).
    ``create_app`` makes it, so the step stream's threads only read it; one is made here
    only for an app whose station was replaced (tests), on the event loop."""
    stepper: BatchStepper | None = getattr(state, "batch_stepper", None)
    if stepper is None or stepper.station is not station:
        stepper = state.batch_stepper = BatchStepper(station)
    return stepper


async def current_stepper(request: Request, station: StationDep) -> BatchStepper:
    # async: FastAPI would run a plain function in a worker thread, a hand-off per step.
    return stepper_of(request.app.state, station)


StepperDep = Annotated[BatchStepper, Depends(current_stepper)]

router = APIRouter()


@router.post(
    BATCH_ROUTE,
    openapi_extra=OCTET_BODY,
    responses={200: {"description": "a frame (see mesh.protocol)", "content": {OCTETS: {}}}},
)
async def batch_step(station: StationDep, stepper: StepperDep, request: Request) -> Response:
    """One step of many sessions (framed body; see :mod:`amplituhedron_rs.mesh.protocol`)."""
    body = await read_body(request)
    return Response(await in_thread(stepper.step, body), media_type=OCTETS)
