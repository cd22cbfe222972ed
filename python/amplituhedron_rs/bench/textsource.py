"""Real English text for benches, available offline on every CPython install.

CPython ships its interactive help as plain prose in ``pydoc_data.topics``; a fixed, sorted
slice of it gives reproducible prompts of any length without downloading anything.
"""

from __future__ import annotations

from collections.abc import Callable


def reference_text(min_chars: int) -> str:
    """At least ``min_chars`` characters of prose (help topics in sorted order)."""
    from pydoc_data.topics import topics

    parts: list[str] = []
    size = 0
    for key in sorted(topics):
        text = " ".join(topics[key].split())
        parts.append(text)
        size += len(text) + 1
        if size >= min_chars:
            break
    return "\n".join(parts)


def text_of_tokens(encode: Callable[[str], list[int]], n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of reference text, starting ``offset`` tokens in."""
    chars = 6 * (n_tokens + offset) + 1000
    while True:
        ids = encode(reference_text(chars))
        if len(ids) >= n_tokens + offset:
            return ids[offset : offset + n_tokens]
        chars *= 2
