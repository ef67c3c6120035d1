"""Builders of the runtime-store tests: sessions, intents, receipts, inputs, raw blobs.

The seed suite's shared fixtures (spec runtime §4), as plain functions, plus
the read-back helper every "refused call wrote nothing" assertion uses:

* Sessions: :func:`session_of` (a reference session from ``(role, text)``
  pairs), :func:`user_session`, :func:`session_with_compaction_intent` (the
  seed's ``S, I``), :func:`completed` (``S`` with its intents acknowledged),
  :func:`encode`.
* Intents: :func:`snapshot_with_raw_intents` (metadata intents overwritten,
  validation bypassed), :func:`unbacked_intent`, :func:`foreign_intent`,
  :func:`with_summary_tokens`.
* Receipts, inputs, lifecycle: :func:`receipt`, :func:`accepted_input`,
  :func:`input_record`, :func:`idle_lifecycle`, :func:`unversioned_lifecycle`.
* Raw blobs that must never decode as a current session: :func:`v0_session_blob`,
  :func:`v1_session_blob`, :func:`session_blob` (any JSON you like),
  :func:`malformed_history_blob`.
* :func:`runtime_state` / :func:`table_counts`: every runtime-scoped row of a
  runtime, as stored (compare before and after a refused call); :func:`reopen`
  (a process restart).

Nothing here touches a database except the read-back helpers (a separate
engine, so they see only committed data) and :func:`reopen`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Engine, create_engine, text

from agentkeep.runtime import (
    CompactionIntent,
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    Message,
    ProjectionId,
    ReferenceDomain,
    RunBoundaryReceipt,
    Session,
    StoredInputState,
)
from agentkeep.runtime.session_model import Role
from agentkeep.store import Store

DOMAIN: Final = ReferenceDomain()

#: The seed's compaction actor and intent size (spec §4 shared fixtures).
OUTBOX_ACTOR: Final = "sqlite-outbox-test"
SUMMARY_TOKENS: Final = 5

#: Every runtime-scoped table and the columns that identify and hold a row.
RUNTIME_TABLES: Final[dict[str, str]] = {
    "runtime_session_snapshots": "session_snapshot",
    "runtime_boundary_receipts": "run_id, sequence, receipt_json",
    "runtime_input_states": "input_id, state_json",
    "runtime_compaction_projection_outbox": (
        "session_id, parent_revision, revision, commit_fingerprint, intent_json, state"
    ),
    "runtime_states": "runtime_state_json",
    "runtime_projection_quarantine": "runtime_id",
    "runtime_ops_lifecycle": "state_json",
    "runtime_retired_ops_epochs": "epoch_id",
}


# --------------------------------------------------------------------------
# Sessions


def encode(session: Session) -> bytes:
    """The canonical snapshot bytes of ``session`` (what a caller submits)."""
    return DOMAIN.encode_session(session)


def session_of(*messages: tuple[Role, str], session_id: str | None = None) -> Session:
    """A history-less session with ``(role, content)`` messages, in order."""
    s = Session.new(session_id)
    for role, content in messages:
        s = s.with_message(role, content)
    return s


def user_session(*contents: str, session_id: str | None = None) -> Session:
    """A history-less session of user messages."""
    return session_of(*(("user", c) for c in contents), session_id=session_id)


def session_with_compaction_intent(
    *, session_id: str | None = None, summary_tokens: int = SUMMARY_TOKENS
) -> tuple[Session, CompactionIntent]:
    """The seed's ``S, I``: [U "verbose context one", U "verbose context two"] compacted.

    The span 0..2 is replaced by one summary message (actor
    ``sqlite-outbox-test``, selection ``compaction_message_range``); ``I``
    projects that commit (summary_tokens 5, messages_before 2,
    messages_after 1) and is carried in ``S``'s metadata.
    """
    base = user_session("verbose context one", "verbose context two", session_id=session_id)
    rewritten, commit = base.rewrite(
        0, 2, [Message(role="assistant", content="summary")], actor=OUTBOX_ACTOR, compaction=True
    )
    intent = CompactionIntent.for_commit(rewritten.id, commit, summary_tokens)
    return rewritten.with_compaction_intents([intent]), intent


def completed(session: Session) -> Session:
    """``session`` with every compaction intent acknowledged (removed from metadata)."""
    return session.with_compaction_intents([])


# --------------------------------------------------------------------------
# Intents


def with_summary_tokens(intent: CompactionIntent, summary_tokens: int) -> CompactionIntent:
    """``intent`` with another summary size (same key: a conflicting intent)."""
    return intent.model_copy(update={"summary_tokens": summary_tokens})


def unbacked_intent(session_id: str) -> CompactionIntent:
    """An intent of ``session_id`` that no rewrite commit backs (seed fixture)."""
    return CompactionIntent(
        projection=ProjectionId(
            session_id=session_id,
            parent_revision="missing-parent",
            revision="missing-revision",
            commit_fingerprint="sha256:unbacked-persisted-fixture",
        ),
        summary_tokens=SUMMARY_TOKENS,
        messages_before=2,
        messages_after=1,
    )


def foreign_intent() -> CompactionIntent:
    """The intent of another, newly built compaction session."""
    return session_with_compaction_intent()[1]


def snapshot_with_raw_intents(
    session: Session, intents: Sequence[CompactionIntent | dict[str, Any]]
) -> bytes:
    """``session``'s JSON with its metadata intents overwritten by ``intents`` (unvalidated).

    Dict entries are written as given, so a wrongly typed intent can be built too.
    """
    obj = session.with_compaction_intents([]).to_json()
    obj["metadata"]["compaction_intents"] = [
        i if isinstance(i, dict) else i.model_dump(mode="json") for i in intents
    ]
    return session_blob(obj)


# --------------------------------------------------------------------------
# Receipts, inputs, lifecycle


def receipt(
    seq: int,
    run_id: str | None = None,
    *,
    boundary: str = "RunStart",
    conversation_digest: str | None = None,
    message_count: int = 0,
    contributing_input_ids: Sequence[str] = (),
) -> RunBoundaryReceipt:
    """A boundary receipt at sequence ``seq`` (a fresh run id unless given)."""
    return RunBoundaryReceipt(
        run_id=run_id if run_id is not None else str(uuid.uuid4()),
        boundary=boundary,
        sequence=seq,
        conversation_digest=conversation_digest,
        message_count=message_count,
        contributing_input_ids=tuple(contributing_input_ids),
    )


def accepted_input(input_id: str | None = None) -> StoredInputState:
    """A new accepted input state (recovery_count 0; a fresh id unless given)."""
    return StoredInputState.new_accepted(input_id)


def input_record(state: StoredInputState | None = None) -> InputStatePersistenceRecord:
    """``state`` (a new accepted one by default) as a machine-authorized record."""
    return InputStatePersistenceRecord.from_machine_snapshot(state or accepted_input())


def idle_lifecycle() -> MachineLifecycleCommit:
    """Lifecycle Idle with the default (unbound) binding and UnboundNoReceipt authority."""
    return MachineLifecycleCommit(runtime_state="idle")


def unversioned_lifecycle() -> dict[str, Any]:
    """The seed's legacy lifecycle object (#32): retired, bound, no ``record_version``."""
    return {
        "runtime_state": "retired",
        "binding": {
            "agent_runtime_id": "rt:session:legacy",
            "fence_token": 23,
            "runtime_generation": 7,
            "runtime_epoch_id": "epoch-legacy",
        },
    }


# --------------------------------------------------------------------------
# Raw session blobs


def session_blob(obj: Any) -> bytes:
    """Any JSON value as snapshot bytes (for shapes the codec must refuse)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def v0_session_blob(session_id: str | None = None) -> bytes:
    """The seed's unversioned (v0) session row (no ``version`` key)."""
    stamp = {"secs_since_epoch": 1_700_000_000, "nanos_since_epoch": 0}
    return session_blob(
        {
            "id": session_id or str(uuid.uuid4()),
            "messages": [],
            "created_at": stamp,
            "updated_at": stamp,
            "metadata": {},
        }
    )


def v1_session_blob(session_id: str | None = None) -> bytes:
    """The seed's retired ``"version": 1`` session row."""
    obj = json.loads(v0_session_blob(session_id))
    obj["version"] = 1
    return session_blob(obj)


def malformed_history_blob(session: Session, history: Any = "not a history") -> bytes:
    """``session``'s JSON with a malformed ``transcript_history`` value (kept verbatim)."""
    obj = session.to_json()
    obj["metadata"]["transcript_history"] = history
    return session_blob(obj)


# --------------------------------------------------------------------------
# Reading back what is stored


def reopen(store: Store, url: str) -> Store:
    """Close ``store`` and open a new handle on ``url`` (a process restart)."""
    store.close()
    return Store.open(url)


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


def runtime_state(url: str | Engine, runtime_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every runtime-scoped row of ``runtime_id``, table by table, sorted, as stored.

    Args:
        url: the database URL (a throwaway engine is used), or an engine to reuse.
        runtime_id: the runtime.
    """
    eng = create_engine(url) if isinstance(url, str) else url
    try:
        with eng.connect() as conn:
            return {
                table: sorted(
                    tuple(_plain(v) for v in row)
                    for row in conn.execute(
                        text(f"SELECT {cols} FROM {table} WHERE runtime_id = :rt"),
                        {"rt": runtime_id},
                    )
                )
                for table, cols in RUNTIME_TABLES.items()
            }
    finally:
        if isinstance(url, str):
            eng.dispose()


def table_counts(url: str, tables: Sequence[str] | None = None) -> dict[str, int]:
    """Row counts of ``tables`` (every runtime-scoped table by default), all runtimes."""
    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            return {
                t: int(conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar_one())
                for t in (tables if tables is not None else list(RUNTIME_TABLES))
            }
    finally:
        eng.dispose()
