"""Configurable size limits of what a store writes, with their documented defaults.

A :class:`Limits` value is given to :meth:`agentkeep.Store.open` /
:meth:`agentkeep.AsyncStore.open` (``limits=Limits(...)``); without one the
store uses :data:`DEFAULT_LIMITS`. Every value a statement *writes* (the
values of an ``INSERT`` / ``UPDATE``, ``ON CONFLICT ... DO UPDATE`` included)
is measured in :meth:`agentkeep.db.Driver.execute`, the one place values meet
the database, against the limit of the column it is written to. The column's
kind comes from the models, once per compiled statement
(:func:`column_kind`):

* ``id``: a text column named ``id`` or ``*_id`` (run, task, session, batch,
  input, node, runtime, mob, owner ids ...): at most
  :attr:`Limits.max_id_length` characters;
* ``snapshot``: the runtime's session snapshot column: at most
  :attr:`Limits.max_snapshot_bytes` bytes;
* ``blob``: the session store's content-addressed blobs (checkpoint
  content): at most :attr:`Limits.max_blob_bytes` bytes;
* ``payload``: every other text or binary column (JSON payloads, records,
  names, keys): at most :attr:`Limits.max_payload_bytes` bytes (UTF-8 bytes
  for text).

A value over its limit raises :class:`~agentkeep.errors.PayloadTooLarge` (an
:class:`~agentkeep.errors.InvalidInput`) naming the column, the size and the
limit; the unit of work it ran in is rolled back, so nothing is written.
Values only compared or looked up (a ``WHERE`` parameter) are not measured:
a row written under larger limits stays readable after they are lowered.

Defaults, and why:

* ids 255 characters: every id the stores make is a UUID or a short prefixed
  token (under 64 characters); 255 leaves room for callers' own ids (URLs,
  composite keys) while keeping index entries small (both backends index ids).
* payloads 8 MiB: a queued batch item, a turn input, a session node or a
  runtime record is one message or one state record; 8 MiB holds a large
  tool output, and bounds what one call holds in memory (the value, its
  JSON text and its UTF-8 bytes coexist while it is written).
* snapshots and blobs 64 MiB: a runtime session snapshot or a checkpoint
  blob holds a whole transcript; 64 MiB is far above what an agent session
  reaches in practice, and well below Postgres's 1 GB ``bytea`` limit and
  SQLite's default 1 GB ``SQLITE_MAX_LENGTH``.

A limit of ``None`` turns that check off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from sqlalchemy import Column, LargeBinary

from agentkeep.errors import InvalidInput, PayloadTooLarge

__all__ = [
    "DEFAULT_LIMITS",
    "MIB",
    "ColumnKind",
    "Limits",
    "column_kind",
]

MIB: Final = 1024 * 1024

ColumnKind: TypeAlias = Literal["id", "payload", "snapshot", "blob"]
"""Which limit a written column gets (see the module docstring)."""

#: ``(table, column)`` pairs holding snapshots and blobs; every other column is an id or a payload.
_SNAPSHOT_COLUMNS: Final = frozenset({("runtime_session_snapshots", "session_snapshot")})
_BLOB_COLUMNS: Final = frozenset({("blobs", "content")})


@dataclass(frozen=True, slots=True)
class Limits:
    """The largest values a store writes (``None``: no limit for that kind).

    Attributes:
        max_id_length: characters of an id (a text column ``id`` / ``*_id``).
            Default 255.
        max_payload_bytes: bytes of any other text (UTF-8) or binary value:
            JSON payloads, records, names. Default 8 MiB.
        max_snapshot_bytes: bytes of a runtime session snapshot. Default 64 MiB.
        max_blob_bytes: bytes of a session checkpoint blob. Default 64 MiB.

    Raises:
        InvalidInput: a limit that is not a positive ``int`` (or None).
    """

    max_id_length: int | None = 255
    max_payload_bytes: int | None = 8 * MIB
    max_snapshot_bytes: int | None = 64 * MIB
    max_blob_bytes: int | None = 64 * MIB

    def __post_init__(self) -> None:
        for name in ("max_id_length", "max_payload_bytes", "max_snapshot_bytes", "max_blob_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidInput(name, f"expected a positive int or None, got {value!r}")

    def of(self, kind: ColumnKind) -> int | None:
        """The limit of a column kind."""
        if kind == "id":
            return self.max_id_length
        if kind == "snapshot":
            return self.max_snapshot_bytes
        if kind == "blob":
            return self.max_blob_bytes
        return self.max_payload_bytes

    def text_bounds(self) -> dict[ColumnKind, float]:
        """Per kind, the longest ``str`` (in characters) :meth:`check` passes unmeasured.

        An id of at most ``max_id_length`` characters, or other text of at
        most a quarter of its byte limit (4 UTF-8 bytes per character at most),
        is within its limit whatever it holds; no limit is ``inf``. The
        driver checks written text against these first and calls
        :meth:`check` only for longer text (and every binary value).
        """
        inf = float("inf")
        kinds: tuple[ColumnKind, ...] = ("id", "payload", "snapshot", "blob")
        bounds: dict[ColumnKind, float] = {}
        for kind in kinds:
            limit = self.of(kind)
            bounds[kind] = inf if limit is None else limit if kind == "id" else limit // 4
        return bounds

    def check(self, field: str, kind: ColumnKind, value: object) -> None:
        """Measure one written value of column ``field`` (of ``kind``) against its limit.

        Ids are measured in characters, other text in UTF-8 bytes, binary
        values in bytes; other values (integers, None) are not measured.

        Raises:
            PayloadTooLarge: the value is over the limit.
        """
        limit = self.of(kind)
        if limit is None:
            return
        if isinstance(value, str):
            if kind == "id":
                size = len(value)
            elif len(value) <= limit // 4:  # at most 4 UTF-8 bytes per character
                return
            else:
                size = len(value.encode("utf-8", "surrogatepass"))
            unit = "characters" if kind == "id" else "bytes"
        elif isinstance(value, (bytes, bytearray)):
            size, unit = len(value), "bytes"
        elif isinstance(value, memoryview):
            size, unit = value.nbytes, "bytes"
        else:
            return
        if size > limit:
            raise PayloadTooLarge(field, size, limit, unit)


#: The limits of a store opened without ``limits=``.
DEFAULT_LIMITS: Final = Limits()


def column_kind(column: Column[object]) -> ColumnKind:
    """The limit kind of a model column (see the module docstring)."""
    key = (column.table.name, column.name)
    if key in _SNAPSHOT_COLUMNS:
        return "snapshot"
    if key in _BLOB_COLUMNS:
        return "blob"
    if not isinstance(column.type, LargeBinary) and (
        column.name == "id" or column.name.endswith("_id")
    ):
        return "id"
    return "payload"
