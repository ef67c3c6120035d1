"""Strict decoders of the v0.6.34 row shapes, for the legacy adapter.

The rows are those the v0.6.34 legacy migrator reads
(docs/legacy-migration.md#the-v0634-legacy-migrator). The original store's
``LegacyV0_6_34InputState`` and ``LegacyV0_6_34OpsSnapshot`` deny unknown
fields; here every level does (history entries and terminal outcomes
too); the JSON must pass :mod:`agentkeep.strict_json` (a repeated key, NaN, a
lone surrogate or nesting deeper than 128 are refused, reported in serde's
texts); integers must be JSON integers in range (u32/u64, from
:mod:`agentkeep.bounds`); UUIDs are canonicalised; and timestamps must be
RFC 3339 texts (kept verbatim). :class:`LegacyReceipt` is a private model of
the original store's ``RunBoundaryReceipt``, only used to check legacy
receipts. Pure decoding: no database code and no fence here.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Final, Literal, TypeAlias, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError

from agentkeep.bounds import U32, U64
from agentkeep.strict_json import JsonError, JsonErrorKind
from agentkeep.strict_json import loads as strict_loads

__all__ = [
    "DecodeProblem",
    "LegacyInput",
    "LegacyOps",
    "LegacyReceipt",
    "decode_strict",
    "variant_name",
]


class DecodeProblem(Exception):
    """A payload does not decode; the message is the decoder message."""


def _canonical_uuid(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a UUID") from exc


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _rfc3339(text: str) -> str:
    if _RFC3339.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not an RFC 3339 timestamp")
    try:
        datetime.fromisoformat(text.replace("z", "Z").replace("t", "T"))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid timestamp: {exc}") from exc
    return text


_Uuid = Annotated[str, AfterValidator(_canonical_uuid)]
_Timestamp = Annotated[str, AfterValidator(_rfc3339)]
_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)

_InputLifecycleState: TypeAlias = Literal[
    "accepted",
    "queued",
    "staged",
    "applied",
    "applied_pending_consumption",
    "consumed",
    "superseded",
    "coalesced",
    "abandoned",
]


class _Consumed(BaseModel):
    model_config = _STRICT
    outcome_type: Literal["consumed"]


class _Superseded(BaseModel):
    model_config = _STRICT
    outcome_type: Literal["superseded"]
    superseded_by: _Uuid


class _Coalesced(BaseModel):
    model_config = _STRICT
    outcome_type: Literal["coalesced"]
    aggregate_id: _Uuid


class _Abandoned(BaseModel):
    model_config = _STRICT
    outcome_type: Literal["abandoned"]
    reason: Literal["retired", "reset", "destroyed", "cancelled"]


_TerminalOutcome = Annotated[
    _Consumed | _Superseded | _Coalesced | _Abandoned, Field(discriminator="outcome_type")
]


class _HistoryEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, populate_by_name=False)
    timestamp: _Timestamp
    from_: _InputLifecycleState = Field(alias="from")
    to: _InputLifecycleState
    reason: str | None = None


class LegacyInput(BaseModel):
    """``LegacyV0_6_34InputState`` of the original store (deny_unknown_fields)."""

    model_config = _STRICT
    input_id: _Uuid
    current_state: _InputLifecycleState
    policy: JsonValue = None
    runtime_semantics: JsonValue = None
    terminal_outcome: _TerminalOutcome | None = None
    durability: Literal["durable", "ephemeral", "derived"] | None = None
    idempotency_key: str | None = None
    attempt_count: U32 = 0
    recovery_count: U32 = 0
    history: list[_HistoryEntry] = Field(default_factory=list)
    reconstruction_source: JsonValue = None
    persisted_input: JsonValue = None
    last_run_id: _Uuid | None = None
    last_boundary_sequence: U64 | None = None
    created_at: _Timestamp
    updated_at: _Timestamp


class _OpsAuthority(BaseModel):
    model_config = _STRICT
    operations: dict[str, JsonValue]
    completed_order: list[JsonValue]
    max_completed: U64
    max_concurrent: JsonValue
    active_count: U64
    wait_request_id: JsonValue
    wait_operation_ids: list[JsonValue]
    next_completion_seq: U64


class _OpsCursors(BaseModel):
    model_config = _STRICT
    agent_applied_cursor: U64
    runtime_observed_seq: U64
    runtime_last_injected_seq: U64


class LegacyOps(BaseModel):
    """``LegacyV0_6_34OpsSnapshot`` of the original store (deny_unknown_fields)."""

    model_config = _STRICT
    epoch_id: str
    authority_state: _OpsAuthority
    operation_specs: dict[str, JsonValue]
    completion_entries: list[JsonValue]
    cursors: _OpsCursors


class LegacyReceipt(BaseModel):
    """The original store's ``RunBoundaryReceipt`` (private: this store's model is elsewhere)."""

    model_config = _STRICT
    run_id: _Uuid
    boundary: Literal[
        "immediate", "run_start", "run_checkpoint", "Immediate", "RunStart", "RunCheckpoint"
    ]
    contributing_input_ids: list[_Uuid]
    conversation_digest: str | None = None
    message_count: U64
    sequence: U64


_M = TypeVar("_M", bound=BaseModel)


#: serde_json's texts for the rules it reports by error code alone.
_SERDE_TEXT: Final[dict[JsonErrorKind, str]] = {
    "constant": "expected value",
    "number": "number out of range",
    "surrogate": "lone leading surrogate in hex escape",
    "depth": "recursion limit exceeded",
}


def _serde_message(exc: JsonError) -> str:
    """Render a strict-decoder error in the texts the original store's serde decoder gave."""
    if exc.kind == "duplicate_key":
        return f"duplicate field `{exc.what}`"
    text = _SERDE_TEXT.get(exc.kind)
    return text if text is not None else f"not UTF-8 JSON: {exc}"


def decode_strict(model: type[_M], data: bytes) -> _M:
    """Decode ``data`` strictly: a strict UTF-8 JSON object of exactly ``model``'s shape.

    The JSON rules are :func:`agentkeep.strict_json.loads`'s; its errors are
    rendered as serde's texts: ``not UTF-8 JSON: …`` (bad UTF-8 or syntax),
    ``duplicate field `k```, ``expected value`` (NaN, Infinity),
    ``number out of range``, ``lone leading surrogate in hex escape``,
    ``recursion limit exceeded`` (nesting deeper than 128).

    Raises:
        DecodeProblem: the bytes are not such a JSON object, or it does not
            validate as ``model`` (the message names every failing field).
    """
    try:
        value = strict_loads(data)
    except JsonError as exc:
        raise DecodeProblem(_serde_message(exc)) from exc
    if not isinstance(value, dict):
        raise DecodeProblem(f"expected a JSON object, got {type(value).__name__}")
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as exc:
        raise DecodeProblem(
            "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            )
        ) from exc


def variant_name(state: str) -> str:
    """``applied_pending_consumption`` -> ``AppliedPendingConsumption`` (Rust ``{:?}``)."""
    return "".join(part.capitalize() for part in state.split("_"))
