"""Wire encodings of the session store's columns, and the row decoders.

One place for every column the lease, queue and turn-input repositories read
or write: owner columns (docs/sessions.md#lease-owners), policies and merge
keys (docs/sessions.md#queued-work), payloads, ingress
(docs/sessions.md#turn-inputs) and states. Every JSON column is written with
:func:`~agentkeep.strict_json.canonical_json` and read with the strict
:func:`~agentkeep.strict_json.loads` (re-exported here as :func:`loads` for the
other session modules): NaN, repeated keys, lone surrogates and nesting deeper
than 128 levels are corrupt values. Decoders raise
:class:`~agentkeep.errors.SessionCorrupt` naming the table, key and column;
the one deliberate exception is owner liveness, which is read as ``Opaque``
when NULL or undecodable, as the original store read it (a corrupt liveness
can only make a takeover *less* likely), and which is logged once per value.

The column tuples :data:`BATCH_COLUMNS`, :data:`ITEM_COLUMNS` and
:data:`INPUT_COLUMNS` are mapped columns of :mod:`agentkeep.sessions.models`;
statements select them in this order, and the decoders read rows by these
positions, so the two cannot drift apart. The module runs no statement and
holds no fence: it only supplies the claim-column expressions
(:func:`next_claim_fencing`, :data:`CLEARED_CLAIM`) that the fenced writes of
:mod:`agentkeep.sessions.queue` and :mod:`agentkeep.sessions.turn_inputs` use.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Final

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import case, literal, null

from agentkeep.base import BIGINT
from agentkeep.errors import SessionCorrupt
from agentkeep.sessions.domain import (
    MAX_I64,
    DeliveryPolicy,
    LeaseOwnerIdentity,
    MergeKey,
    Opaque,
    OwnerLiveness,
    PendingTurnInput,
    QueuedWorkBatch,
    QueuedWorkPayload,
    SlotPolicy,
    TurnInputIngress,
    TurnInputState,
    checked_batch,
    checked_input,
    checked_item,
    checked_owner,
    checked_payload,
)
from agentkeep.sessions.models import PendingTurnInputRow, QueuedWorkBatchRow, QueuedWorkItemRow
from agentkeep.strict_json import canonical_json, loads

__all__ = [
    "BATCH_COLUMNS",
    "CLEARED_CLAIM",
    "INPUT_COLUMNS",
    "ITEM_COLUMNS",
    "loads",
    "batch_from_row",
    "decode_owner",
    "encode_ingress",
    "encode_liveness",
    "encode_merge_key",
    "encode_payload",
    "input_from_row",
    "next_claim_fencing",
]

log = logging.getLogger("agentkeep.sessions")


_LIVENESS: Final = TypeAdapter(OwnerLiveness)
_INGRESS: Final = TypeAdapter(TurnInputIngress)
_warned: set[str] = set()

#: The columns a batch row is read with, in the positions :func:`batch_from_row` reads.
BATCH_COLUMNS: Final = (
    QueuedWorkBatchRow.enqueue_seq,
    QueuedWorkBatchRow.batch_id,
    QueuedWorkBatchRow.session_id,
    QueuedWorkBatchRow.source_key,
    QueuedWorkBatchRow.delivery_policy,
    QueuedWorkBatchRow.slot_policy,
    QueuedWorkBatchRow.merge_key_json,
    QueuedWorkBatchRow.available_at_ms,
    QueuedWorkBatchRow.enqueued_at_ms,
    QueuedWorkBatchRow.claim_id,
    QueuedWorkBatchRow.claim_owner_id,
    QueuedWorkBatchRow.claim_owner_incarnation_id,
    QueuedWorkBatchRow.claim_owner_liveness_json,
    QueuedWorkBatchRow.claim_token,
    QueuedWorkBatchRow.claim_fencing_token,
    QueuedWorkBatchRow.claim_session_lease_generation,
)
#: The columns of an item, in the order :func:`batch_from_row` unpacks item rows.
ITEM_COLUMNS: Final = (
    QueuedWorkItemRow.item_index,
    QueuedWorkItemRow.item_id,
    QueuedWorkItemRow.payload_json,
)
#: The columns a turn-input row is read with, in the positions :func:`input_from_row` reads.
INPUT_COLUMNS: Final = (
    PendingTurnInputRow.enqueue_seq,
    PendingTurnInputRow.input_id,
    PendingTurnInputRow.session_id,
    PendingTurnInputRow.source_key,
    PendingTurnInputRow.ingress_json,
    PendingTurnInputRow.submitted_ingress_json,
    PendingTurnInputRow.state,
    PendingTurnInputRow.input_json,
    PendingTurnInputRow.enqueued_at_ms,
    PendingTurnInputRow.claim_id,
    PendingTurnInputRow.claim_owner_id,
    PendingTurnInputRow.claim_owner_incarnation_id,
    PendingTurnInputRow.claim_owner_liveness_json,
    PendingTurnInputRow.claim_token,
    PendingTurnInputRow.claim_fencing_token,
    PendingTurnInputRow.claim_session_lease_generation,
)


def next_claim_fencing(column: Any) -> Any:
    """STAMP_CLAIM's new per-row counter: ``column + 1``, saturating at ``2**63-1``."""
    return case(
        (column >= literal(MAX_I64 - 1, BIGINT), literal(MAX_I64, BIGINT)),
        else_=column + 1,
    )


#: CLEAR_CLAIM's SET values: every claim column reset but ``claim_fencing_token``.
CLEARED_CLAIM: Final[dict[str, Any]] = {
    "claim_id": null(),
    "claim_owner_id": null(),
    "claim_owner_incarnation_id": null(),
    "claim_owner_liveness_json": null(),
    "claim_token": null(),
    "claim_session_lease_generation": 0,
}


# --------------------------------------------------------------------------
# Owners


_OPAQUE_TEXT: Final = canonical_json(Opaque().model_dump(mode="json"))

#: The last liveness encoded (not opaque) and its text: a worker presents the same
#: owner, and so the same frozen liveness object, on every claim. One tuple,
#: replaced whole, so a thread reads a matching pair.
_last_liveness: tuple[object, str] = (None, "")


def encode_liveness(owner: LeaseOwnerIdentity) -> str:
    """``{"kind":"opaque"}`` or ``{"kind":"local_process",...}``, canonical.

    Opaque liveness (its only field is its kind) is one constant text; another
    is encoded once per liveness object in a row (they are frozen models).
    """
    global _last_liveness
    liveness = owner.liveness
    if type(liveness) is Opaque:
        return _OPAQUE_TEXT
    last = _last_liveness
    if last[0] is liveness:
        return last[1]
    text = canonical_json(liveness.model_dump(mode="json"))
    _last_liveness = (liveness, text)
    return text


def _decode_liveness(raw: object) -> Any:
    if raw is None:
        return Opaque()
    if not isinstance(raw, str):
        return _undecodable(raw, ValueError(f"{type(raw).__name__} instead of text"))
    return _decode_liveness_text(raw)


@functools.lru_cache(maxsize=1024)
def _decode_liveness_text(raw: str) -> Any:
    """The liveness a column's text holds, decoded once per distinct text.

    The values are frozen models, shared by every lease row that holds the
    same text (a fenced write reads its own lease's row on every call).
    """
    try:
        return _LIVENESS.validate_python(loads(raw))
    except (ValueError, ValidationError) as exc:
        return _undecodable(raw, exc)


def _undecodable(raw: object, exc: Exception) -> Any:
    key = repr(raw)[:200]
    if key not in _warned:
        _warned.add(key)
        log.warning("undecodable lease owner liveness %s read as opaque: %s", key, exc)
    return Opaque()


def decode_owner(
    owner_id: object, incarnation_id: object, liveness: object
) -> LeaseOwnerIdentity | None:
    """An owner from its three columns: NULL id → None; NULL incarnation → the id.

    See docs/sessions.md#lease-owners.
    """
    if owner_id is None:
        return None
    owner = str(owner_id)
    return checked_owner(
        owner_id=owner,
        incarnation_id=owner if incarnation_id is None else str(incarnation_id),
        liveness=_decode_liveness(liveness),
    )


# --------------------------------------------------------------------------
# Queued work


def encode_merge_key(key: MergeKey) -> str:
    """``"never"``, ``"payload_default"`` or ``{"group":"<name>"}``."""
    return canonical_json(key.wire())


@functools.lru_cache(maxsize=1024)
def _decode_merge_key(text: str) -> MergeKey:
    """The merge key a column's text holds, decoded once per distinct text (a frozen
    value shared by the batches that hold it; an undecodable text raises every time)."""
    value = loads(text)
    if value in ("never", "payload_default"):
        return MergeKey(kind=value)
    if isinstance(value, dict) and set(value) == {"group"} and isinstance(value["group"], str):
        return MergeKey(kind="group", group=value["group"])
    raise ValueError(f"unknown merge key {text!r}")


def encode_payload(payload: QueuedWorkPayload) -> str:
    """``{"body":<json>,"kind":"<kind>"}``, canonical."""
    return canonical_json({"kind": payload.kind, "body": payload.body})


def _decode_payload(text: str) -> QueuedWorkPayload:
    value = loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        raise ValueError("expected an object with a string kind")
    return checked_payload(kind=value["kind"], body=value.get("body"))


class _Decoding:
    """Attribute each decode failure to its column."""

    def __init__(self, table: str, key: str) -> None:
        self.table = table
        self.key = key

    def __call__(self, column: str, fn: Any, raw: Any) -> Any:
        try:
            return fn(raw)
        except (ValueError, TypeError, ValidationError) as exc:
            raise SessionCorrupt(self.table, self.key, column, str(exc)) from None


def _item_index(raw: object) -> int:
    """A stored item index: an integer in ``0..2**63-1`` (SQLite's INTEGER column can
    hold text, which the record built without validation would otherwise keep)."""
    if type(raw) is not int:
        raise TypeError(f"{type(raw).__name__} instead of an integer")
    if not 0 <= raw <= MAX_I64:
        raise ValueError(f"{raw} is out of range")
    return raw


def _text(raw: object) -> str:
    if not isinstance(raw, str):
        raise TypeError(f"{type(raw).__name__} instead of text")
    return raw


def batch_from_row(row: Sequence[Any], item_rows: Sequence[Sequence[Any]]) -> QueuedWorkBatch:
    """A batch from a :data:`BATCH_COLUMNS` row and its :data:`ITEM_COLUMNS` rows.

    Decoded straight through; when a column does not decode,
    :func:`_name_failing_batch_column` decodes them again one by one to name
    the one that fails.

    Raises:
        SessionCorrupt: an item index, a policy, merge key or payload does not
            decode (naming its table and column); or validation refuses the
            row as a whole (column: the field it names).
    """
    try:
        items = tuple(
            checked_item(
                item_index=_item_index(index),
                item_id=item_id,
                payload=_decode_payload(_text(payload)),
            )
            for index, item_id, payload in item_rows
        )
        return checked_batch(
            enqueue_seq=row[0],
            batch_id=row[1],
            session_id=row[2],
            source_key=row[3],
            delivery_policy=DeliveryPolicy(row[4]),
            slot_policy=SlotPolicy(row[5]),
            merge_key=_decode_merge_key(_text(row[6])),
            available_at_ms=row[7],
            enqueued_at_ms=row[8],
            claim_id=row[9],
            claim_owner=decode_owner(row[10], row[11], row[12]),
            claim_token=row[13],
            claim_fencing_token=row[14],
            claim_session_lease_generation=row[15],
            items=items,
        )
    except (ValueError, TypeError, ValidationError) as exc:
        _name_failing_batch_column(row, item_rows)
        raise _refused_row("queued_work_batches", row[1], exc) from exc


def _refused_row(table: str, key: object, exc: Exception) -> SessionCorrupt:
    """SessionCorrupt for a row no column of which fails to decode on its own.

    That is validation refusing a stored counter (the records are built by
    validating them where this pydantic's build could not be checked, see
    :func:`agentkeep.checked_records.checked_builder`): the field it names,
    which is the column's name, else ``row``.
    """
    column = "row"
    if isinstance(exc, ValidationError) and exc.errors():
        loc = exc.errors()[0]["loc"]
        column = str(loc[0]) if loc else column
    return SessionCorrupt(table, str(key), column, str(exc))


def _name_failing_batch_column(row: Sequence[Any], item_rows: Sequence[Sequence[Any]]) -> None:
    """Decode the columns of :func:`batch_from_row` one at a time, in its order, each
    under :class:`_Decoding`: the first that fails raises SessionCorrupt naming it."""
    for index, _item_id, payload in item_rows:
        d_item = _Decoding("queued_work_items", f"{row[1]}:{index}")
        d_item("item_index", _item_index, index)
        d_item("payload_json", lambda t: _decode_payload(_text(t)), payload)
    d = _Decoding("queued_work_batches", str(row[1]))
    d("delivery_policy", DeliveryPolicy, row[4])
    d("slot_policy", SlotPolicy, row[5])
    d("merge_key_json", lambda t: _decode_merge_key(_text(t)), row[6])


# --------------------------------------------------------------------------
# Turn inputs


def encode_ingress(ingress: Any) -> str:
    """``{"scope":"active_turn","turn_id":…,"min_boundary":…}`` or ``{"scope":"next_turn"}``."""
    return canonical_json(ingress.model_dump(mode="json"))


def _decode_ingress(raw: object) -> Any:
    return _decode_ingress_text(_text(raw))


@functools.lru_cache(maxsize=1024)
def _decode_ingress_text(text: str) -> Any:
    """The ingress a column's text holds, decoded once per distinct text (a frozen
    value shared by the inputs that hold it; an undecodable text raises every time)."""
    return _INGRESS.validate_python(loads(text))


def input_from_row(row: Sequence[Any]) -> PendingTurnInput:
    """A turn input from a row of :data:`INPUT_COLUMNS`.

    Decoded straight through; when a column does not decode,
    :func:`_name_failing_input_column` decodes them again one by one to name
    the one that fails.

    Raises:
        SessionCorrupt: the ingress, state or input does not decode; or
            validation refuses the row as a whole (column: the field it names).
    """
    try:
        return checked_input(
            enqueue_seq=row[0],
            input_id=row[1],
            session_id=row[2],
            source_key=row[3],
            ingress=_decode_ingress(row[4]),
            submitted_ingress=_decode_ingress(row[5]),
            state=TurnInputState(row[6]),
            input=loads(_text(row[7])),
            enqueued_at_ms=row[8],
            claim_id=row[9],
            claim_owner=decode_owner(row[10], row[11], row[12]),
            claim_token=row[13],
            claim_fencing_token=row[14],
            claim_session_lease_generation=row[15],
        )
    except (ValueError, TypeError, ValidationError) as exc:
        _name_failing_input_column(row)
        raise _refused_row("pending_turn_inputs", row[1], exc) from exc


def _name_failing_input_column(row: Sequence[Any]) -> None:
    """Decode the columns of :func:`input_from_row` one at a time, in its order, each
    under :class:`_Decoding`: the first that fails raises SessionCorrupt naming it."""
    d = _Decoding("pending_turn_inputs", str(row[1]))
    d("ingress_json", _decode_ingress, row[4])
    d("submitted_ingress_json", _decode_ingress, row[5])
    d("state", TurnInputState, row[6])
    d("input_json", lambda t: loads(_text(t)), row[7])
