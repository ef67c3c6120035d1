"""The input-state batch compare-and-swap: its preparation, its fence and its outcomes.

Described in docs/runtime.md#compare_and_swap_input_states_atomically.
``compare_and_swap_input_states_atomically`` swaps a batch of input states
iff every row still holds the value the caller expects: it is the adoption
fence for a set of inputs. All of it lives here:

1. :func:`prepare_input_state_batch_cas` — outside the database (in the
   one-call form, before the unit opens): check the batch's shape
   (:class:`~agentkeep.runtime.errors.InvalidInputStateBatchCas`: counts
   differ or exceed :data:`~agentkeep.runtime.domain.MAX_INPUT_STATE_BATCH_CAS`,
   an id repeats, the id sets differ), encode both sides with the domain
   (``WriteFailed`` on an encode failure) and check every input id is a
   canonical UUID (:class:`~agentkeep.errors.InvalidInput`). An empty batch
   prepares to no rows: :attr:`InputStateCasOutcome.SWAPPED` without opening
   a connection.
2. :func:`apply_input_state_batch_cas` — in the unit, under the
   ``runtime:<id>`` write lock: read each row in the order of ``expected``
   and compare it in Python with the expected and the replacement bytes (a
   TEXT-degraded SQLite row compares by its UTF-8 bytes):

   * a missing row: :attr:`~InputStateCasOutcome.STALE` at once, no write;
   * every row already equal to its replacement:
     :attr:`~InputStateCasOutcome.SWAPPED` with no write (the idempotent
     retry after a lost acknowledgement; checked before the expected values);
   * any row not equal to its expected value (including a half-swapped
     batch): :attr:`~InputStateCasOutcome.STALE`, no write;
   * otherwise every row is swapped through the fence below:
     :attr:`~InputStateCasOutcome.SWAPPED`.

**The fence** (:func:`swap_input_states_if_current`): each row is written by
``UPDATE runtime_input_states SET state_json = :data WHERE runtime_id = :rt
AND input_id = :iid AND state_json = :stored``, with ``stored`` the value
exactly as it was read under the lock (bytes, or the text of a TEXT-degraded
row), and the rows changed must be the batch's size. Under the lock that
always holds; a row that changed after it was compared (only a writer that
bypassed the lock can do that) makes the whole swap fail with
:class:`~agentkeep.errors.ConcurrentModification` — a bug signal, not an
outcome, not retried, raised as itself by ``uow.runtime`` and
``store.runtime`` — and nothing of the batch stays written (a savepoint
inside a caller's unit, the unit's rollback otherwise). A failing row (a
trigger abort) is ``WriteFailed``, with the same all-or-nothing rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import select, update

from agentkeep.db import LockNamespace
from agentkeep.errors import ConcurrentModification
from agentkeep.runtime.access import RuntimeAccess, as_bytes, stored_form
from agentkeep.runtime.domain import (
    MAX_INPUT_STATE_BATCH_CAS,
    InputStatePersistenceRecord,
    RuntimeDomain,
    StoredInputState,
    canonical_uuid,
)
from agentkeep.runtime.errors import InvalidInputStateBatchCas
from agentkeep.runtime.models import InputStateRow
from agentkeep.statements import Statement

__all__ = [
    "InputStateCasOutcome",
    "PreparedInputStateCas",
    "apply_input_state_batch_cas",
    "prepare_input_state_batch_cas",
    "stored_input_state",
    "swap_input_states_if_current",
]

_TABLE: Final = InputStateRow.__tablename__
_ROW = (InputStateRow.runtime_id == p("rt"), InputStateRow.input_id == p("iid"))

#: The locked read of the value to compare (as stored: bytes, or text on SQLite).
_READ: Final = Statement(
    select(InputStateRow.state_json).where(*_ROW), name="runtime.input_cas.read"
)
#: The fence: the row is written only while it still holds the value read.
_SWAP: Final = Statement(
    update(InputStateRow)
    .values(state_json=p("data"))
    .where(*_ROW, InputStateRow.state_json == p("stored")),
    name="runtime.input_cas.swap",
)


class InputStateCasOutcome(StrEnum):
    """The verdict of ``compare_and_swap_input_states_atomically``."""

    #: Every row now holds its replacement (written by this call, or already).
    SWAPPED = "swapped"
    #: A row is missing or differs from its expected value; nothing was written.
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class PreparedInputStateCas:
    """One row of a prepared batch: compare ``expected_json``, write ``replacement_json``."""

    input_id: str
    expected_json: bytes
    replacement_json: bytes


def prepare_input_state_batch_cas(
    domain: RuntimeDomain[Any],
    expected: Sequence[StoredInputState],
    replacements: Sequence[InputStatePersistenceRecord | StoredInputState],
) -> tuple[PreparedInputStateCas, ...]:
    """Check a batch's shape and encode both sides (pure: no database).

    Step 1 of docs/runtime.md#compare_and_swap_input_states_atomically.

    Args:
        domain: encodes the states (:meth:`RuntimeDomain.encode_input_state`).
        expected: the rows the caller believes are stored.
        replacements: the rows to store instead, one per expected input id
            (any order).

    Returns:
        The prepared rows in the order of ``expected`` (empty for an empty batch).

    Raises:
        InvalidInputStateBatchCas: the counts differ, exceed
            :data:`~agentkeep.runtime.domain.MAX_INPUT_STATE_BATCH_CAS`, an id
            repeats on either side, or the two id sets differ.
        WriteFailed: a state does not encode.
        InvalidInput: an input id is not a canonical UUID.
    """
    repl = [
        r.into_stored() if isinstance(r, InputStatePersistenceRecord) else r for r in replacements
    ]
    if len(expected) != len(repl):
        raise InvalidInputStateBatchCas(
            f"{len(expected)} expected rows but {len(repl)} replacements"
        )
    if len(expected) > MAX_INPUT_STATE_BATCH_CAS:
        raise InvalidInputStateBatchCas(
            f"{len(expected)} rows exceed the maximum of {MAX_INPUT_STATE_BATCH_CAS}"
        )
    by_expected: dict[str, StoredInputState] = {}
    for state in expected:
        if state.input_id in by_expected:
            raise InvalidInputStateBatchCas(f"input {state.input_id} repeats in expected")
        by_expected[state.input_id] = state
    by_replacement: dict[str, StoredInputState] = {}
    for state in repl:
        if state.input_id in by_replacement:
            raise InvalidInputStateBatchCas(f"input {state.input_id} repeats in replacements")
        by_replacement[state.input_id] = state
    for input_id in by_expected:
        if input_id not in by_replacement:
            raise InvalidInputStateBatchCas(f"expected input {input_id} has no replacement")
    for input_id in by_replacement:  # unreachable after the checks above; kept as a guard
        if input_id not in by_expected:
            raise InvalidInputStateBatchCas(f"replacement input {input_id} was not expected")
    prepared = tuple(
        PreparedInputStateCas(
            input_id=state.input_id,
            expected_json=domain.encode_input_state(state),
            replacement_json=domain.encode_input_state(by_replacement[state.input_id]),
        )
        for state in expected
    )
    for row in prepared:
        canonical_uuid(row.input_id, "input_id")
    return prepared


def stored_input_state(access: RuntimeAccess, runtime_id: str, input_id: str) -> Any:
    """One input's ``state_json`` exactly as stored (bytes, or str if TEXT), or None.

    Raises:
        ReadFailed: the SELECT failed.
    """
    row = access.select(
        _READ, {"rt": runtime_id, "iid": input_id}, f"{_TABLE}[{runtime_id}, {input_id}]"
    ).fetchone()
    return None if row is None else stored_form(row[0])


def apply_input_state_batch_cas(
    access: RuntimeAccess, runtime_id: str, prepared: Sequence[PreparedInputStateCas]
) -> InputStateCasOutcome:
    """Lock, read, compare, swap through the fence, on a prepared batch.

    Steps 2–6 of docs/runtime.md#compare_and_swap_input_states_atomically.

    An empty batch returns SWAPPED without touching the database.

    Returns:
        SWAPPED: every row now holds its replacement (written now, or already).
        STALE: a row is missing or holds another value; nothing written.

    Raises:
        InvalidInput: an input id is not a canonical UUID (nothing touched).
        ReadFailed: a row could not be read (or is not bytes or text).
        WriteFailed: a write failed (no row of the batch stays written).
        ConcurrentModification: a row changed between its locked read and the
            swap (no row of the batch stays written).
    """
    if not prepared:
        return InputStateCasOutcome.SWAPPED
    for row in prepared:
        canonical_uuid(row.input_id, "input_id")
    access.begin_write(LockNamespace.RUNTIME, runtime_id)
    all_expected = True
    all_replacements = True
    swaps: list[tuple[str, Any, bytes]] = []
    for row in prepared:
        stored = stored_input_state(access, runtime_id, row.input_id)
        if stored is None:
            return InputStateCasOutcome.STALE
        current = (  # a TEXT-degraded row as its UTF-8 bytes; the key named only then
            stored
            if type(stored) is bytes
            else as_bytes(
                stored, table=_TABLE, key=f"{runtime_id}, {row.input_id}", column="state_json"
            )
        )
        all_expected = all_expected and current == row.expected_json
        all_replacements = all_replacements and current == row.replacement_json
        swaps.append((row.input_id, stored, row.replacement_json))
    if all_replacements:
        return InputStateCasOutcome.SWAPPED
    if not all_expected:
        return InputStateCasOutcome.STALE
    with access.atomic():
        swap_input_states_if_current(access, runtime_id, swaps)
    return InputStateCasOutcome.SWAPPED


def swap_input_states_if_current(
    access: RuntimeAccess, runtime_id: str, swaps: Sequence[tuple[str, Any, bytes]]
) -> None:
    """The fence: write each ``(input_id, stored, replacement)`` only where ``stored`` still is.

    ``stored`` is the value as read under the lock (bytes, or the str of a
    TEXT-degraded row). Takes no lock and opens no savepoint: the caller
    holds the runtime's write lock and makes the batch atomic.

    Raises:
        ConcurrentModification: fewer rows than ``len(swaps)`` still held
            their value (the caller's savepoint or unit undoes the others).
        WriteFailed: a row failed (a trigger abort).
    """
    rows = [
        {"rt": runtime_id, "iid": input_id, "stored": stored, "data": data}
        for input_id, stored, data in swaps
    ]
    changed = access.dml_many(_SWAP, rows, f"{_TABLE}[{runtime_id}] ({len(rows)} rows)")
    if changed != len(rows):
        raise ConcurrentModification(
            f"{_TABLE}[{runtime_id}]: {len(rows) - changed} of {len(rows)} input states "
            "changed under the write lock"
        )
