"""Token ids → the text a client receives: incremental, whole characters only, special tokens
hidden (unless asked for), and cut at the first stop sequence (returned only when asked
for)."""

from __future__ import annotations

from amplituhedron_rs.runtime.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    """Turns one request's tokens into text deltas, honouring its stop sequences.

    Text that could still turn out to be the start of a stop sequence is held back until
    the next token decides it, so a stop sequence never leaks to the client, even when it
    spans several tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str],
        *,
        skip_special: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decoder = StreamDecoder(tokenizer, skip_special=skip_special)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._text = ""
        self._sent = 0
        #: The stop sequence found is sent too (vLLM's ``include_stop_str_in_output``).
        self._include_stop = include_stop
        #: Tokens before which no stop sequence ends the reply (vLLM's ``min_tokens``).
        self._min_tokens = min_tokens
        self._tokens = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Adds one token; returns the text that is now safe to send (possibly empty)."""
        if self.stopped:
            return ""
        self._text += self._decoder.push(token)
        self._tokens += 1
        if not self._stops:
            return self._take(len(self._text))
        if self._tokens < self._min_tokens:
            # No stop may end the reply yet; what could still start one waits as usual.
            return self._take(len(self._text) - self._held_back())
        search_from = max(0, self._sent - self._longest)
        hits = [(i, len(s)) for s in self._stops if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            self.stopped = True
            at, length = min(hits)
            return self._take(at + length if self._include_stop else at)
        return self._take(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The text still held back once generation ended without a stop sequence."""
        return "" if self.stopped else self._take(len(self._text))

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._text[: self._sent]

    def _held_back(self) -> int:
        """Length of the longest suffix that is a proper prefix of some stop sequence."""
        text = self._text
        for n in range(min(self._longest - 1, len(text) - self._sent), 0, -1):
            tail = text[len(text) - n :]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        piece = self._text[self._sent : end]
        self._sent = end
        return piece
