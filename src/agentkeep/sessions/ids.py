"""Derived ids of queued batches and turn inputs: the ``Debug`` rendering of a source key.

The original store hashes ``session_id``, the Rust ``Debug`` rendering of the
optional source key, ``now`` and a process-local nonce; we add 64 random bits
so two hosts (or two processes sharing a file) never mint the same id
(docs/decisions.md#derived-ids-carry-random-bits). This module holds the one
``Debug`` renderer both derivations use (the formulas:
docs/sessions.md#enqueue_queued_work and
docs/sessions.md#enqueue_pending_turn_input).
"""

from __future__ import annotations

import unicodedata
from typing import Final

__all__ = ["rust_debug"]


_SIMPLE_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\0": "\\0",
}


def rust_debug(value: str | None) -> str:
    """Rust's ``Debug`` rendering of an ``Option<String>``: ``None`` or ``Some("…")``.

    Inside the quotes ``"`` and ``\\`` are backslash-escaped; newline, carriage
    return, tab and NUL become ``\\n``, ``\\r``, ``\\t``, ``\\0``; other
    non-printable characters (the same categories as :meth:`str.isprintable`)
    and combining marks (Mn/Me, standing in for Unicode ``Grapheme_Extend``)
    become ``\\u{<lowercase hex>}``.
    """
    if value is None:
        return "None"
    out = []
    for ch in value:
        simple = _SIMPLE_ESCAPES.get(ch)
        if simple is not None:
            out.append(simple)
        elif ch.isprintable() and unicodedata.category(ch) not in ("Mn", "Me"):
            out.append(ch)
        else:
            out.append(f"\\u{{{ord(ch):x}}}")
    return 'Some("' + "".join(out) + '")'
