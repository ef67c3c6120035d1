"""Value types of the session store's commit half: what a turn records and what is read back.

The coordination half's values (leases, queued work, turn inputs) are in
:mod:`agentkeep.sessions.domain`; this module holds what a turn records:
graph nodes, checkpoints, usage, the runtime commit and its result, the
session read, and the maintenance reports (docs/sessions.md#turn-commits,
docs/sessions.md#session-reads, docs/sessions.md#maintenance). There is no
database code here and so no fence: the fenced commit is
:mod:`agentkeep.sessions.commits`'s. Opaque payloads (node payloads,
config, agent frames, checkpoint components) must be JSON values; they are
stored as canonical JSON. Counters and times are ``U63`` (``0..2**63-1``,
:mod:`agentkeep.bounds`): they are stored in signed 64-bit columns.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, Strict

from agentkeep.bounds import U63
from agentkeep.checked_records import checked_builder
from agentkeep.sessions.domain import (
    LeaseFence,
    QueuedWorkBatch,
    QueuedWorkCompletion,
    QueuedWorkDraft,
    TurnInputCompletion,
)

__all__ = [
    "HEAD_SCHEMA_VERSION",
    "MANIFEST_SCHEMA_VERSION",
    "ActivePathScope",
    "AppendNodes",
    "BlobProfile",
    "CheckpointManifest",
    "FullGraphScope",
    "GcReport",
    "GraphCommitDelta",
    "HeadScope",
    "HydratedSessionCheckpoint",
    "LoadScope",
    "PersistedSessionRead",
    "ReplaceFullGraph",
    "RuntimeCommit",
    "RuntimeCommitResult",
    "SessionGraph",
    "SessionMeta",
    "SessionNodeRecord",
    "TokenUsage",
    "TurnCommitStamp",
    "UnchangedGraph",
    "UsageDelta",
    "UsageLedgerEntry",
    "VacuumReport",
    "checked_builder",
]

#: Version of the head record (``session_head.schema_version``).
HEAD_SCHEMA_VERSION = 1
#: Version of the checkpoint manifest blob.
MANIFEST_SCHEMA_VERSION = 1

_FROZEN = ConfigDict(frozen=True, extra="forbid")
Text = Annotated[str, Strict()]


# --------------------------------------------------------------------------
# Graph


class SessionNodeRecord(BaseModel):
    """One node of the conversation graph; ``payload`` is an opaque JSON value."""

    model_config = _FROZEN
    node_id: Text
    parent_node_id: Text | None = None
    timestamp: U63 = 0
    payload: Any = None


class SessionGraph(BaseModel):
    """A set of nodes (in insertion order) and the leaf the session is at."""

    model_config = _FROZEN
    nodes: tuple[SessionNodeRecord, ...] = ()
    leaf_node_id: Text | None = None


class UnchangedGraph(BaseModel):
    """No node writes; the head's leaf becomes ``leaf_node_id``."""

    model_config = _FROZEN
    kind: Literal["unchanged"] = "unchanged"
    leaf_node_id: Text | None = None


class AppendNodes(BaseModel):
    """Insert ``nodes`` (a duplicate ``node_id`` fails the commit)."""

    model_config = _FROZEN
    kind: Literal["append"] = "append"
    nodes: tuple[SessionNodeRecord, ...]
    leaf_node_id: Text | None = None


class ReplaceFullGraph(BaseModel):
    """Delete every node of the session (tombstoned too), then insert ``graph``."""

    model_config = _FROZEN
    kind: Literal["replace_full"] = "replace_full"
    graph: SessionGraph


GraphCommitDelta: TypeAlias = Annotated[
    UnchangedGraph | AppendNodes | ReplaceFullGraph, Field(discriminator="kind")
]


class FullGraphScope(BaseModel):
    """Load every live node, by insertion order."""

    model_config = _FROZEN
    kind: Literal["full_graph"] = "full_graph"


class ActivePathScope(BaseModel):
    """Load the path from the root to ``leaf_node_id`` (default: the head's leaf).

    ``tail=N`` loads only the last ``N`` nodes of that path (still root-first,
    ending at the leaf): the read follows at most ``N`` parent links, so its
    cost is O(N) whatever the path's length. A tail longer than the path
    gives the whole path; ``tail=0`` gives no nodes (the read is then the
    head, the checkpoint and the ledger, like :class:`HeadScope` with the
    scope's leaf). ``None`` (the default) is the whole path.
    """

    model_config = _FROZEN
    kind: Literal["active_path"] = "active_path"
    leaf_node_id: Text | None = None
    tail: U63 | None = None


class HeadScope(BaseModel):
    """Load the head, its leaf, the checkpoint and the ledger totals; no graph node.

    The resume read whose cost does not grow with the session: the graph of
    the result has no nodes and the head's leaf as ``leaf_node_id``.
    """

    model_config = _FROZEN
    kind: Literal["head"] = "head"


LoadScope: TypeAlias = FullGraphScope | ActivePathScope | HeadScope


# --------------------------------------------------------------------------
# Checkpoints and blobs


class BlobProfile(enum.StrEnum):
    """When blobs are compressed: never, from 4 KiB, or from 1 KiB."""

    LOW_LATENCY = "low_latency"
    BALANCED = "balanced"
    COMPACT = "compact"

    def threshold(self) -> int | None:
        """Size in bytes from which a blob is zlib-compressed (None: never)."""
        return {"low_latency": None, "balanced": 4096, "compact": 1024}[self.value]


class HydratedSessionCheckpoint(BaseModel):
    """A checkpoint with its components (bodies, or references to stored blobs).

    For each component, a body (when present) is stored as a content-addressed
    blob and its hash becomes the reference; otherwise the given reference is
    kept as is.
    """

    model_config = _FROZEN
    turn_state: Any = None
    tool_state: Any = None
    tool_state_ref: Text | None = None
    plugin_snapshot: Any = None
    plugin_snapshot_ref: Text | None = None
    plugin_snapshot_revision: U63 | None = None
    execution_state: Any = None
    execution_state_ref: Text | None = None


class CheckpointManifest(BaseModel):
    """The manifest blob a checkpoint reference names."""

    model_config = _FROZEN
    schema_version: U63 = MANIFEST_SCHEMA_VERSION
    turn_state: Any = None
    tool_state_ref: Text | None = None
    plugin_snapshot_ref: Text | None = None
    plugin_snapshot_revision: U63 | None = None
    execution_state_ref: Text | None = None


# --------------------------------------------------------------------------
# Usage


class TokenUsage(BaseModel):
    """Token counts of one model call (all ``0..2**63-1``)."""

    model_config = _FROZEN
    input_tokens: U63 = 0
    output_tokens: U63 = 0
    cache_read_input_tokens: U63 = 0
    cache_write_input_tokens: U63 = 0
    reasoning_output_tokens: U63 = 0

    def total(self) -> int:
        """input + output + cache read + cache write; reasoning is excluded.

        See docs/sessions.md#usage-ledger.
        """
        return (
            self.input_tokens
            + self.output_tokens
            + self.cache_read_input_tokens
            + self.cache_write_input_tokens
        )


class UsageDelta(BaseModel):
    """Usage to append to the session's ledger."""

    model_config = _FROZEN
    source: Text
    model: Text
    usage: TokenUsage


class UsageLedgerEntry(BaseModel):
    """Merged usage of one ``(source, model)`` pair."""

    model_config = _FROZEN
    source: Text
    model: Text
    usage: TokenUsage


# --------------------------------------------------------------------------
# The commit


class TurnCommitStamp(BaseModel):
    """Makes a commit idempotent: the same ``(session, turn, hash)`` replays the first result."""

    model_config = _FROZEN
    session_id: Text
    turn_id: Text
    turn_commit_hash: Text


class RuntimeCommit(BaseModel):
    """Everything one turn records, committed atomically (docs/sessions.md#commit_runtime_state)."""

    model_config = _FROZEN
    session_id: Text
    expected_head_revision: U63 | None = None
    session_execution_lease: LeaseFence | None = None
    release_session_execution_lease: LeaseFence | None = None
    config: Any = None
    agent_frames: tuple[Any, ...] = ()
    current_agent_frame_id: Text | None = None
    graph: GraphCommitDelta = Field(default_factory=UnchangedGraph)
    checkpoint: HydratedSessionCheckpoint = Field(default_factory=HydratedSessionCheckpoint)
    usage_deltas: tuple[UsageDelta, ...] = ()
    turn_commit: TurnCommitStamp | None = None
    completed_queue_claims: tuple[QueuedWorkCompletion, ...] = ()
    completed_turn_input_claims: tuple[TurnInputCompletion, ...] = ()
    enqueued_queue_batches: tuple[QueuedWorkDraft, ...] = ()
    interrupted_turn_input_turn_id: Text | None = None
    committed_attachment_ids: tuple[Text, ...] = ()


class RuntimeCommitResult(BaseModel):
    """What a commit returns (and what a replay of the same turn returns again)."""

    model_config = _FROZEN
    head_revision: U63
    checkpoint_ref: Text
    manifest: CheckpointManifest
    enqueued_queue_batches: tuple[QueuedWorkBatch, ...] = ()


class PersistedSessionRead(BaseModel):
    """A session as loaded by ``load_session`` (one consistent snapshot)."""

    model_config = _FROZEN
    session_id: Text
    head_revision: U63
    config: Any
    agent_frames: tuple[Any, ...]
    current_agent_frame_id: Text | None
    graph: SessionGraph
    checkpoint_ref: Text
    checkpoint: HydratedSessionCheckpoint | None
    token_ledger: tuple[UsageLedgerEntry, ...]


# --------------------------------------------------------------------------
# Maintenance and metadata


class VacuumReport(BaseModel):
    """What ``vacuum`` deleted."""

    model_config = _FROZEN
    removed_node_count: U63 = 0
    removed_pending_turn_input_tombstone_count: U63 = 0


class GcReport(BaseModel):
    """What ``gc_unreachable`` found and deleted."""

    model_config = _FROZEN
    root_count: U63 = 0
    retained_blob_count: U63 = 0
    deleted_blob_count: U63 = 0


class SessionMeta(BaseModel):
    """Descriptive metadata of a session (docs/sessions.md#save_session_meta)."""

    model_config = _FROZEN
    session_id: Text
    session_name: Text
    created_at: Text
    model: Text
    cwd: Text | None = None
    relation: Any = None
