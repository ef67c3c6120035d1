"""Input states of a runtime: reads, upserts, and the part that runs the batch compare-and-swap.

Described in docs/runtime.md#input-states.

One row per ``(runtime_id, input_id)`` in ``runtime_input_states`` holds the
canonical JSON of a :class:`~agentkeep.runtime.domain.StoredInputState`. Rows
are only ever upserted (last writer wins); reads decode fail-closed (a row
without ``stored_input_state_version``, or one whose payload names another
input, is :class:`~agentkeep.runtime.errors.ReadFailed`, never "absent").

What lives here: the statements on ``runtime_input_states`` except the
batch swap's, the steps other writers share as plain functions
(:func:`encode_input_states`, :func:`upsert_input_states`,
:func:`input_state_bytes`), and the repository part :class:`InputStateOps`
(``uow.runtime.inputs``).

Writes take the ``runtime:<id>`` write lock first (``BEGIN IMMEDIATE`` on
SQLite, the runtime's advisory lock on Postgres), so every read-check-write
below is race-free against every other writer of the runtime.

The batch compare-and-swap
(docs/runtime.md#compare_and_swap_input_states_atomically), the adoption fence
for a set of inputs, lives whole in :mod:`~agentkeep.runtime.input_cas` (its
preparation, its fenced write and its outcomes);
:meth:`InputStateOps.compare_and_swap_input_states_atomically` runs it. The
upserts here have no fence: last writer wins.

Input ids must be canonical (lower-case, hyphenated) UUIDs: any other id is
:class:`~agentkeep.errors.InvalidInput` before the database is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, TypeAlias

from sqlalchemy import bindparam as p
from sqlalchemy import select

from agentkeep.arguments import check_methods
from agentkeep.db import LockNamespace
from agentkeep.one_call import read
from agentkeep.runtime.access import RuntimeAccess, as_bytes, upsert_replacing
from agentkeep.runtime.calls import RuntimeCallsBase
from agentkeep.runtime.domain import (
    InputStatePersistenceRecord,
    RuntimeDomain,
    StoredInputState,
    canonical_uuid,
)
from agentkeep.runtime.errors import ReadFailed
from agentkeep.runtime.input_cas import (
    InputStateCasOutcome,
    apply_input_state_batch_cas,
    prepare_input_state_batch_cas,
)
from agentkeep.runtime.models import InputStateRow
from agentkeep.statements import Statement

__all__ = [
    "InputStateCalls",
    "InputStateCasOutcome",
    "InputStateOps",
    "InputStateRecord",
    "encode_input_states",
    "input_state_bytes",
    "upsert_input_states",
]

#: What the input-state writers accept: a machine-authorized record or a bare state.
InputStateRecord: TypeAlias = InputStatePersistenceRecord | StoredInputState

_TABLE: Final = InputStateRow.__tablename__
_COLUMN: Final = "state_json"

_OF_RUNTIME = InputStateRow.runtime_id == p("rt")
_LOAD_ALL: Final = Statement(
    select(InputStateRow.input_id, InputStateRow.state_json)
    .where(_OF_RUNTIME)
    .order_by(InputStateRow.input_id.asc()),
    name="runtime.input.load_all",
)
_LOAD_ONE: Final = Statement(
    select(InputStateRow.state_json).where(_OF_RUNTIME, InputStateRow.input_id == p("iid")),
    name="runtime.input.load_one",
)
_UPSERT: Final = Statement(
    lambda d: upsert_replacing(
        d,
        InputStateRow,
        {"runtime_id": p("rt"), "input_id": p("iid"), "state_json": p("data")},
        key=[InputStateRow.runtime_id, InputStateRow.input_id],
        replace=["state_json"],
    ),
    name="runtime.input.upsert",
)


def _stored(record: InputStateRecord) -> StoredInputState:
    return record.into_stored() if isinstance(record, InputStatePersistenceRecord) else record


def encode_input_states(
    domain: RuntimeDomain[Any], records: Iterable[InputStateRecord]
) -> tuple[tuple[str, bytes], ...]:
    """Check and encode input states for an upsert, in order (pure: no database).

    Args:
        domain: the codec.
        records: machine-authorized records or bare states.

    Returns:
        ``(input_id, canonical bytes)`` per record, in the given order.

    Raises:
        InvalidInput: an input id is not a canonical UUID.
        WriteFailed: a state does not encode.
    """
    encoded = []
    for record in records:
        state = _stored(record)
        canonical_uuid(state.input_id, "input_id")
        encoded.append((state.input_id, domain.encode_input_state(state)))
    return tuple(encoded)


def input_state_bytes(access: RuntimeAccess, runtime_id: str, input_id: str) -> bytes | None:
    """The stored bytes of one input state (TEXT as UTF-8), or None.

    Raises:
        ReadFailed: the SELECT failed, or the value is not bytes/text.
    """
    return access.one_bytes(
        _LOAD_ONE,
        {"rt": runtime_id, "iid": input_id},
        table=_TABLE,
        key=f"{runtime_id}, {input_id}",
        column=_COLUMN,
    )


def upsert_input_states(
    access: RuntimeAccess, runtime_id: str, encoded: Iterable[tuple[str, bytes]]
) -> None:
    """Upsert encoded states in order, inside the caller's locked transaction.

    Rows are only ever upserted, so the last writer wins
    (docs/runtime.md#input-states); an input named twice is written once,
    with its last state, which is what upserting them in order leaves (and
    lets the writes go out as one statement on asyncpg, where two upserts of
    one row could not: :meth:`RuntimeAccess.pipelined`).

    Takes no lock and opens no savepoint: the caller holds the runtime's
    write lock and makes its whole operation atomic. Encode first with
    :func:`encode_input_states`.

    Raises:
        WriteFailed: an upsert failed.
    """
    last = dict(encoded)  # an input named twice: its last state
    rows = [{"rt": runtime_id, "iid": input_id, "data": data} for input_id, data in last.items()]
    access.write_many(_UPSERT, rows, f"{_TABLE}[{runtime_id}] ({len(rows)} rows)")


def _decode_row(
    access: RuntimeAccess, runtime_id: str, input_id: str, value: Any
) -> StoredInputState:
    key = f"{runtime_id}, {input_id}"
    state = access.domain.decode_input_state(as_bytes(value, table=_TABLE, key=key, column=_COLUMN))
    if state.input_id != input_id:
        raise ReadFailed(f"{_TABLE}[{key}].{_COLUMN} holds input {state.input_id}")
    return state


@check_methods
class InputStateOps:
    """Repository part (``uow.runtime.inputs``): input-state rows and the batch compare-and-swap."""

    __slots__ = ("_access",)

    def __init__(self, access: RuntimeAccess) -> None:
        self._access = access

    # -- reads -------------------------------------------------------------

    def load_input_states(self, runtime_id: str) -> list[StoredInputState]:
        """Load every input state of a runtime, ordered by input id (byte order).

        Args:
            runtime_id: the logical runtime id.

        Returns:
            The decoded states (empty if the runtime has none).

        Raises:
            ReadFailed: the SELECT failed, or any row does not decode (one bad
                row fails the whole call; a missing ``stored_input_state_version``
                is named in the message).
        """
        access = self._access
        rows = access.select(_LOAD_ALL, {"rt": runtime_id}, f"{_TABLE}[{runtime_id}]").fetchall()
        return [_decode_row(access, runtime_id, input_id, value) for input_id, value in rows]

    def load_input_state(self, runtime_id: str, input_id: str) -> StoredInputState | None:
        """Load one input state, decoded fail-closed.

        Args:
            runtime_id: the logical runtime id.
            input_id: the input (canonical UUID).

        Returns:
            The state, or None if there is no row.

        Raises:
            InvalidInput: ``input_id`` is not a canonical UUID.
            ReadFailed: the SELECT failed or the row does not decode.
        """
        canonical_uuid(input_id, "input_id")
        data = input_state_bytes(self._access, runtime_id, input_id)
        return None if data is None else _decode_row(self._access, runtime_id, input_id, data)

    # -- writes ------------------------------------------------------------

    def persist_input_state(self, runtime_id: str, record: InputStateRecord) -> None:
        """Upsert one input state (last writer wins).

        Args:
            runtime_id: the logical runtime id.
            record: the state to store, keyed by its input id.

        Raises:
            InvalidInput: the input id is not a canonical UUID (nothing written).
            WriteFailed: the state does not encode, or the upsert failed.
        """
        self.persist_input_states_atomically(runtime_id, (record,))

    def persist_input_states_atomically(
        self, runtime_id: str, records: Sequence[InputStateRecord]
    ) -> None:
        """Upsert several input states in one transaction: all of them or none.

        Rows are written in the given order (a repeated id: the last one
        wins). An empty list still takes the lock and commits an empty
        transaction.

        Args:
            runtime_id: the logical runtime id.
            records: the states to store.

        Raises:
            InvalidInput: an input id is not a canonical UUID (nothing written).
            WriteFailed: a state does not encode, or an upsert failed (none of
                the rows stays written).
        """
        self.apply_input_states(runtime_id, encode_input_states(self._access.domain, records))

    def apply_input_states(self, runtime_id: str, encoded: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`persist_input_states_atomically` after :func:`encode_input_states`."""
        access = self._access
        access.begin_write(LockNamespace.RUNTIME, runtime_id)
        with access.atomic():
            upsert_input_states(access, runtime_id, encoded)

    def compare_and_swap_input_states_atomically(
        self,
        runtime_id: str,
        expected: Sequence[StoredInputState],
        replacements: Sequence[InputStateRecord],
    ) -> InputStateCasOutcome:
        """Swap a batch of input states iff every row still holds its expected value.

        Described in docs/runtime.md#compare_and_swap_input_states_atomically.

        See :mod:`~agentkeep.runtime.input_cas` for the exact order of the
        checks and the fence.

        Args:
            runtime_id: the logical runtime id.
            expected: the rows the caller believes are stored (at most
                :data:`~agentkeep.runtime.domain.MAX_INPUT_STATE_BATCH_CAS`).
            replacements: one replacement per expected input id (any order).

        Returns:
            SWAPPED: every row now holds its replacement (written now, or
            already: the idempotent retry; or the batch was empty).
            STALE: a row is missing or holds another value; nothing written.

        Raises:
            InvalidInputStateBatchCas: the batch shape is invalid (nothing touched).
            InvalidInput: an input id is not a canonical UUID (nothing touched).
            ReadFailed: a row could not be read (or is not bytes).
            WriteFailed: a replacement does not encode, or a write failed
                (no row of the batch stays written).
            ConcurrentModification: a row changed between its locked read
                and the swap (a writer bypassed the lock; nothing stays written).
        """
        prepared = prepare_input_state_batch_cas(self._access.domain, expected, replacements)
        return apply_input_state_batch_cas(self._access, runtime_id, prepared)


class InputStateCalls(RuntimeCallsBase):
    """One-call part: each input-state operation in its own unit of work."""

    _repository = "runtime.inputs"

    load_input_states = read(InputStateOps.load_input_states)

    def load_input_state(self, runtime_id: str, input_id: str) -> StoredInputState | None:
        """One-call form of :meth:`InputStateOps.load_input_state`."""
        canonical_uuid(input_id, "input_id")
        return self._read(lambda repo: repo.inputs.load_input_state(runtime_id, input_id))

    def persist_input_state(self, runtime_id: str, record: InputStateRecord) -> None:
        """One-call form of :meth:`InputStateOps.persist_input_state`."""
        encoded = encode_input_states(self.domain, (record,))  # refused before the unit opens
        self._write(lambda repo: repo.inputs.apply_input_states(runtime_id, encoded))

    def persist_input_states_atomically(
        self, runtime_id: str, records: Sequence[InputStateRecord]
    ) -> None:
        """One-call form of :meth:`InputStateOps.persist_input_states_atomically`."""
        encoded = encode_input_states(self.domain, records)  # refused before the unit opens
        self._write(lambda repo: repo.inputs.apply_input_states(runtime_id, encoded))

    def compare_and_swap_input_states_atomically(
        self,
        runtime_id: str,
        expected: Sequence[StoredInputState],
        replacements: Sequence[InputStateRecord],
    ) -> InputStateCasOutcome:
        """One-call form of :meth:`InputStateOps.compare_and_swap_input_states_atomically`.

        The batch is prepared before the unit of work opens; an empty batch
        returns SWAPPED without opening a connection.
        """
        prepared = prepare_input_state_batch_cas(self.domain, expected, replacements)
        if not prepared:
            return InputStateCasOutcome.SWAPPED
        return self._write(
            lambda repo: apply_input_state_batch_cas(repo.access, runtime_id, prepared)
        )
