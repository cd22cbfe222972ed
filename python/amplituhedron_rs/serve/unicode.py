"""The string type of every request field: valid Unicode, refused with a 400 otherwise (one
module, so :mod:`.protocol`, :mod:`.structured` and :mod:`.tools` share it)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _unicode_text(value: str) -> str:
    """Text that is valid Unicode: JSON's ``"\\ud800"`` escapes decode to lone surrogates,
    which no UTF-8 tokenizer, grammar compiler, header or log line can carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"invalid Unicode at character {exc.start} (a lone UTF-16 surrogate)"
        ) from None
    return value


#: Every string a request carries: valid Unicode, refused with a 400 otherwise.
Text = Annotated[str, AfterValidator(_unicode_text)]
