"""The text rule of every store: what a stored (or looked-up) string may hold.

Both backends keep text as UTF-8, and Postgres refuses a NUL character in
``text`` columns. So that both backends accept and refuse the same values,
every string bound to a statement, on either backend, must not hold:

* ``"\\x00"`` (NUL): Postgres cannot store it; SQLite could, but refusing it
  there too keeps a store portable (a database copied to Postgres, a test
  suite run on SQLite, never holds a value the other backend refuses);
* a lone UTF-16 surrogate (``"\\ud800"``): only a Python ``str`` can carry
  one; it has no UTF-8 form, so no backend can store or look it up.

The rule is applied in one place, where values meet the database:
:meth:`agentkeep.db.Driver.execute` / :meth:`~agentkeep.db.Driver.executemany`
check every ``str`` parameter of every statement (ids, names, JSON text:
reads and writes alike) and the advisory-lock keys, and raise
:class:`~agentkeep.errors.InvalidInput` naming the parameter. A refused write
is part of a unit of work that is then rolled back, so nothing is written.

JSON payloads are not affected by the NUL rule as values: the canonical JSON
text escapes a NUL inside a string as ``\\u0000`` (six ASCII characters), which
both backends store (JSON is kept in ``text`` / ``bytea`` columns, never
``jsonb``), and decodes back to the same string. A lone surrogate inside a
JSON value is refused by :mod:`agentkeep.strict_json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentkeep.errors import InvalidInput
from agentkeep.strict_json import has_lone_surrogate

__all__ = ["check_params", "check_text", "text_problem"]


def text_problem(text: str) -> str | None:
    """What breaks the text rule in ``text`` (a short phrase), or None when it is storable."""
    if "\x00" in text:
        return "holds a NUL character (\\x00), which Postgres cannot store"
    if has_lone_surrogate(text):
        return "holds a lone UTF-16 surrogate, which has no UTF-8 form"
    return None


def check_text(text: str, field: str) -> str:
    """Check ``text`` against the text rule.

    Returns:
        ``text``.

    Raises:
        InvalidInput: (field ``field``) it is not a ``str``, or it holds a NUL
            or a lone surrogate.
    """
    if type(text) is str and text.isascii() and "\x00" not in text:
        return text  # the common case, without a call (ASCII: no surrogate)
    if not isinstance(text, str):
        raise InvalidInput(field, f"expected a string, got {type(text).__name__}")
    problem = text_problem(text)
    if problem is not None:
        raise InvalidInput(field, problem)
    return text


def check_params(params: Mapping[str, Any]) -> None:
    """Check every ``str`` value of one statement's parameters (the driver's bind).

    NUL is looked for with one ``in`` per string (``memchr``); a lone
    surrogate only in non-ASCII strings (``isascii`` is free in CPython).

    Raises:
        InvalidInput: (field: the parameter's name) a string breaks the rule.
    """
    for name, value in params.items():
        if isinstance(value, str) and ("\x00" in value or not value.isascii()):
            check_text(value, name)
