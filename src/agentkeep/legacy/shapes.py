"""Strict decoders of the v0.6.34 row shapes (spec runtime §2.39), for the legacy adapter.

The seed's ``LegacyV0_6_34InputState`` and ``LegacyV0_6_34OpsSnapshot`` deny
unknown fields; here every level does (history entries and terminal outcomes
too), JSON objects with a repeated key are refused, integers must be JSON
integers in range (u32/u64), UUIDs are canonicalised, and timestamps must be
RFC 3339 texts (kept verbatim). :class:`LegacyReceipt` is a private model of
the seed's ``RunBoundaryReceipt``, only used to check legacy receipts.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError

__all__ = [
    "DecodeProblem",
    "LegacyInput",
    "LegacyOps",
    "LegacyReceipt",
    "decode_strict",
    "variant_name",
]

_MAX_U32: Final = 2**32 - 1
_MAX_U64: Final = 2**64 - 1


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
_U32 = Annotated[int, Field(ge=0, le=_MAX_U32)]
_U64 = Annotated[int, Field(ge=0, le=_MAX_U64)]
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
    """``LegacyV0_6_34InputState`` of the seed (deny_unknown_fields)."""

    model_config = _STRICT
    input_id: _Uuid
    current_state: _InputLifecycleState
    policy: JsonValue = None
    runtime_semantics: JsonValue = None
    terminal_outcome: _TerminalOutcome | None = None
    durability: Literal["durable", "ephemeral", "derived"] | None = None
    idempotency_key: str | None = None
    attempt_count: _U32 = 0
    recovery_count: _U32 = 0
    history: list[_HistoryEntry] = Field(default_factory=list)
    reconstruction_source: JsonValue = None
    persisted_input: JsonValue = None
    last_run_id: _Uuid | None = None
    last_boundary_sequence: _U64 | None = None
    created_at: _Timestamp
    updated_at: _Timestamp


class _OpsAuthority(BaseModel):
    model_config = _STRICT
    operations: dict[str, JsonValue]
    completed_order: list[JsonValue]
    max_completed: _U64
    max_concurrent: JsonValue
    active_count: _U64
    wait_request_id: JsonValue
    wait_operation_ids: list[JsonValue]
    next_completion_seq: _U64


class _OpsCursors(BaseModel):
    model_config = _STRICT
    agent_applied_cursor: _U64
    runtime_observed_seq: _U64
    runtime_last_injected_seq: _U64


class LegacyOps(BaseModel):
    """``LegacyV0_6_34OpsSnapshot`` of the seed (deny_unknown_fields)."""

    model_config = _STRICT
    epoch_id: str
    authority_state: _OpsAuthority
    operation_specs: dict[str, JsonValue]
    completion_entries: list[JsonValue]
    cursors: _OpsCursors


class LegacyReceipt(BaseModel):
    """The seed's ``RunBoundaryReceipt`` (private: the store's own model lives elsewhere)."""

    model_config = _STRICT
    run_id: _Uuid
    boundary: Literal[
        "immediate", "run_start", "run_checkpoint", "Immediate", "RunStart", "RunCheckpoint"
    ]
    contributing_input_ids: list[_Uuid]
    conversation_digest: str | None = None
    message_count: _U64
    sequence: _U64


_M = TypeVar("_M", bound=BaseModel)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DecodeProblem(f"duplicate field `{key}`")
        out[key] = value
    return out


def decode_strict(model: type[_M], data: bytes) -> _M:
    """Decode ``data`` strictly (UTF-8 JSON object, no duplicate keys, exact shape)."""
    try:
        value = json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DecodeProblem(f"not UTF-8 JSON: {exc}") from exc
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
