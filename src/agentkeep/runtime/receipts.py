"""Boundary receipts: the value, its JSON and the u64 sequence key.

A :class:`RunBoundaryReceipt` is written once per committed run boundary
(insert-only; its key ``(runtime_id, run_id, sequence)`` is the boundary's
idempotency fence, :mod:`~agentkeep.runtime.boundaries`).

The u64 ``sequence`` is stored as the i64 with the same bit pattern
(:func:`encode_receipt_sequence`): SQLite INTEGER and Postgres BIGINT are
signed 64-bit, and clamping would make every sequence at or above 2**63
share one key. The mapping is a bijection; the column is only ever matched
exactly, never ordered, so the high half sorting as negative does not matter
(docs/runtime.md#receipt-sequence-encoding).
"""

from __future__ import annotations

import struct
from typing import Final

from pydantic import BaseModel, Field

from agentkeep.bounds import U63, U64, U64_MAX, check_u64
from agentkeep.errors import InvalidInput
from agentkeep.runtime.errors import ReadFailed, WriteFailed
from agentkeep.runtime.session_model import (
    ENCODE_TEXT,
    STRICT,
    DecodeProblem,
    canonical_bytes,
    canonical_uuid,
    load_object,
    validate_strict,
)

__all__ = [
    "MAX_U64",
    "RunBoundaryReceipt",
    "decode_receipt",
    "decode_receipt_sequence",
    "encode_receipt",
    "encode_receipt_sequence",
]

MAX_U64: Final = U64_MAX
_U64: Final = struct.Struct("<Q")
_I64: Final = struct.Struct("<q")


def encode_receipt_sequence(sequence: int) -> int:
    """The stored i64 of a u64 receipt sequence (same bit pattern).

    Raises:
        InvalidInput: ``sequence`` is not an integer in ``0..2**64-1``.
    """
    check_u64(sequence, "sequence")
    value: int = _I64.unpack(_U64.pack(sequence))[0]
    return value


def decode_receipt_sequence(stored: int) -> int:
    """The u64 receipt sequence of a stored i64 (inverse of :func:`encode_receipt_sequence`)."""
    value: int = _U64.unpack(_I64.pack(stored))[0]
    return value


class RunBoundaryReceipt(BaseModel):
    """The receipt of one committed run boundary.

    Attributes:
        run_id: the run (canonical UUID).
        boundary: which boundary (``"RunStart"``, ...).
        contributing_input_ids: the inputs the boundary consumed.
        conversation_digest: digest of the conversation at the boundary, if any.
        message_count: messages in the conversation at the boundary.
        sequence: the receipt sequence (u64).
    """

    model_config = STRICT

    run_id: str
    boundary: str = Field(min_length=1)
    contributing_input_ids: tuple[str, ...] = ()
    conversation_digest: str | None = None
    message_count: U63 = 0
    sequence: U64

    def model_post_init(self, _context: object) -> None:
        canonical_uuid(self.run_id, "run_id")
        for input_id in self.contributing_input_ids:
            canonical_uuid(input_id, "contributing_input_ids")


def encode_receipt(receipt: RunBoundaryReceipt) -> bytes:
    """The receipt's canonical JSON bytes.

    Raises:
        WriteFailed: the receipt does not encode.
    """
    plain = _plain_receipt(receipt)
    if plain is not None:
        return plain
    try:
        return canonical_bytes(receipt.model_dump(mode="json"))
    except ValueError as exc:
        raise WriteFailed(f"failed to encode boundary receipt {receipt.run_id}: {exc}") from exc


def _plain_receipt(receipt: RunBoundaryReceipt) -> bytes | None:
    """The canonical bytes of a receipt of ASCII text, written directly; None for any other.

    Its canonical JSON (keys sorted, compact) is fixed but for the values, so
    it is written without the ``model_dump`` and the JSON walk; the bytes
    equal the general encoding (``tests/runtime/test_plain_encoders.py``).
    """
    if type(receipt) is not RunBoundaryReceipt:
        return None
    run_id, boundary, ids = receipt.run_id, receipt.boundary, receipt.contributing_input_ids
    digest, count, sequence = receipt.conversation_digest, receipt.message_count, receipt.sequence
    if (
        type(run_id) is not str
        or type(boundary) is not str
        or type(ids) is not tuple
        or type(count) is not int
        or type(sequence) is not int
        or not run_id.isascii()
        or not boundary.isascii()
    ):
        return None
    for input_id in ids:
        if type(input_id) is not str or not input_id.isascii():
            return None
    if digest is None:
        written = "null"
    elif type(digest) is str and digest.isascii():
        written = ENCODE_TEXT(digest)
    else:
        return None
    listed = ",".join([ENCODE_TEXT(input_id) for input_id in ids])
    return (
        f'{{"boundary":{ENCODE_TEXT(boundary)},"contributing_input_ids":[{listed}],'
        f'"conversation_digest":{written},"message_count":{count},'
        f'"run_id":{ENCODE_TEXT(run_id)},"sequence":{sequence}}}'
    ).encode("ascii")


def decode_receipt(data: bytes) -> RunBoundaryReceipt:
    """Decode stored receipt bytes strictly.

    Raises:
        ReadFailed: the bytes are not a receipt.
    """
    try:
        load_object(data, "boundary receipt")
        return validate_strict(RunBoundaryReceipt, data, "boundary receipt")
    except (DecodeProblem, InvalidInput) as exc:
        raise ReadFailed(f"failed to decode boundary receipt: {exc}") from exc
