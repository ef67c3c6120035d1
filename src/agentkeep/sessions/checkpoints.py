"""Content-addressed blobs and checkpoints: encode, store, read and hydrate.

The format and the reading rules are in docs/sessions.md#checkpoints-and-blobs;
why canonical JSON and zlib (the original store used MessagePack envelopes)
in docs/decisions.md#blob-encoding.

A blob is the canonical JSON encoding of a value (sorted keys, compact, UTF-8),
compressed with zlib when its size reaches the blob profile's threshold. Its
``hash`` is the lowercase hex sha256 of the *uncompressed* canonical bytes, so
the same value always has the same hash whatever the compression, and writes
are idempotent (``INSERT … ON CONFLICT (hash) DO NOTHING``).

A checkpoint is stored as one blob per present component (tool state, plugin
snapshot, execution state) plus a manifest blob naming them; the manifest's
hash is the ``checkpoint_ref``. Everything is written inside the caller's
commit transaction, so a root is never visible without its leaves.

Reading: a missing blob is ``None`` (the component, or the whole checkpoint
when the manifest is missing); a blob that is present but does not decode is
an error (:class:`~agentkeep.errors.SessionCorrupt`), never read as empty.

Both statements (the idempotent insert and the read by hash) are
:class:`~agentkeep.statements.Statement` constants built from
:class:`~agentkeep.sessions.models.BlobRow`.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import select

from agentkeep.db import Driver
from agentkeep.errors import InvalidInput, SessionCorrupt
from agentkeep.sessions.codec import loads
from agentkeep.sessions.models import BlobRow
from agentkeep.sessions.records import (
    MANIFEST_SCHEMA_VERSION,
    BlobProfile,
    CheckpointManifest,
    HydratedSessionCheckpoint,
    checked_builder,
)
from agentkeep.statements import Statement, upsert
from agentkeep.strict_json import canonical_json

__all__ = [
    "BLOB_COLUMNS",
    "KIND_EXECUTION_STATE",
    "KIND_MANIFEST",
    "KIND_PLUGIN_SNAPSHOT",
    "KIND_TOOL_STATE",
    "decode_blob",
    "get_blob",
    "get_checkpoint",
    "hydrate",
    "manifest_of",
    "manifest_refs",
    "put_blob",
    "put_checkpoint",
    "put_opaque_blob",
    "read_manifest",
]

KIND_MANIFEST: Final = "checkpoint_manifest"
KIND_TOOL_STATE: Final = "tool_state"
KIND_PLUGIN_SNAPSHOT: Final = "plugin_snapshot"
KIND_EXECUTION_STATE: Final = "execution_state"

# Idempotent: a blob already stored under its hash is left as it is.
_PUT: Final = Statement(
    lambda d: (
        upsert(d, BlobRow)
        .values(hash=p("hash"), kind=p("kind"), compression=p("compression"), content=p("content"))
        .on_conflict_do_nothing(index_elements=[BlobRow.hash])
    ),
    name="checkpoints.put_blob",
)
#: The columns :func:`decode_blob` decodes, in its order (a query that joins
#: the blob of a reference selects them).
BLOB_COLUMNS: Final = (BlobRow.kind, BlobRow.compression, BlobRow.content)
_GET: Final = Statement(
    select(*BLOB_COLUMNS).where(BlobRow.hash == p("hash")), name="checkpoints.get_blob"
)


def _encode(value: Any, field: str) -> bytes:
    try:
        return canonical_json(value).encode("utf-8")
    except ValueError as exc:
        raise InvalidInput(field, str(exc)) from None


def put_blob(
    db: Driver,
    kind: str,
    value: Any,
    profile: BlobProfile,
    *,
    defer: bool = False,
    into: list[dict[str, Any]] | None = None,
) -> str:
    """Store ``value`` as a blob (idempotent); return its hash.

    With ``defer``, the insert (whose result nobody reads) is deferred
    (:meth:`Driver.defer`): the caller flushes before it returns. With
    ``into``, nothing is sent: the insert's parameters (``hash``, ``kind``,
    ``compression``, ``content``) are appended to it, for a caller that writes
    them in a statement of its own, in the same transaction.

    Raises:
        InvalidInput: ``value`` is not a JSON value.
    """
    raw = _encode(value, kind)
    digest = hashlib.sha256(raw).hexdigest()
    threshold = profile.threshold()
    if threshold is not None and len(raw) >= threshold:
        content, compression = zlib.compress(raw), "zlib"
    else:
        content, compression = raw, "none"
    params = {"hash": digest, "kind": kind, "compression": compression, "content": content}
    if into is not None:
        into.append(params)
    elif defer:
        db.defer(_PUT, params)
    else:
        db.execute(_PUT, params)
    return digest


def put_opaque_blob(db: Driver, kind: str, raw: bytes) -> str:
    """Store ``raw`` as it is (idempotent, uncompressed); return its hash.

    For bodies agentkeep never decodes (a checkpoint node's serialized
    checkpoint, :mod:`agentkeep.sessions.checkpoint_nodes`): the hash is the
    sha256 of the bytes, so equal bodies are stored once.
    """
    digest = hashlib.sha256(raw).hexdigest()
    db.execute(_PUT, {"hash": digest, "kind": kind, "compression": "none", "content": raw})
    return digest


def get_blob(db: Driver, digest: str) -> tuple[str, Any] | None:
    """``(kind, value)`` of a stored blob, or None if there is none.

    Raises:
        SessionCorrupt: the blob does not decompress, decode, or match its hash.
    """
    return decode_blob(digest, db.execute(_GET, {"hash": digest}).fetchone())


def decode_blob(digest: str, row: Sequence[Any] | None) -> tuple[str, Any] | None:
    """``(kind, value)`` of the blob ``digest`` read as ``row`` (:data:`BLOB_COLUMNS`).

    ``row`` is None, or its ``kind`` is None (an outer join that found no
    blob): the blob is missing, None is returned.

    Raises:
        SessionCorrupt: the blob does not decompress, decode, or match its hash.
    """
    if row is None or row[0] is None:
        return None
    kind, compression, content = row
    try:
        raw = bytes(content)
        if compression == "zlib":
            raw = zlib.decompress(raw)
        elif compression != "none":
            raise ValueError(f"unknown compression {compression!r}")
        if hashlib.sha256(raw).hexdigest() != digest:
            raise ValueError("content does not match its hash")
        return str(kind), loads(raw.decode("utf-8"))
    except (ValueError, zlib.error, UnicodeDecodeError, TypeError) as exc:
        raise SessionCorrupt("blobs", digest, "content", str(exc)) from None


def put_checkpoint(
    db: Driver,
    checkpoint: HydratedSessionCheckpoint,
    profile: BlobProfile,
    *,
    into: list[dict[str, Any]] | None = None,
) -> tuple[str, CheckpointManifest]:
    """Store a checkpoint's component blobs and its manifest; return ``(checkpoint_ref, manifest)``.

    For each component, a body (not None) is stored and its hash becomes the
    reference; otherwise the caller's reference is kept. The inserts are
    deferred (:meth:`Driver.defer`): the caller flushes before it returns.
    With ``into``, nothing is sent: each blob's insert parameters are appended
    to it (components first, the manifest last; see :func:`put_blob`), for a
    caller that writes them in one statement of its own.

    Raises:
        InvalidInput: a body or the turn state is not a JSON value.
    """

    def component(body: Any, ref: str | None, kind: str) -> str | None:
        if body is None:
            return ref
        return put_blob(db, kind, body, profile, defer=True, into=into)

    manifest = CheckpointManifest(
        schema_version=MANIFEST_SCHEMA_VERSION,
        turn_state=checkpoint.turn_state,
        tool_state_ref=component(checkpoint.tool_state, checkpoint.tool_state_ref, KIND_TOOL_STATE),
        plugin_snapshot_ref=component(
            checkpoint.plugin_snapshot, checkpoint.plugin_snapshot_ref, KIND_PLUGIN_SNAPSHOT
        ),
        plugin_snapshot_revision=checkpoint.plugin_snapshot_revision,
        execution_state_ref=component(
            checkpoint.execution_state, checkpoint.execution_state_ref, KIND_EXECUTION_STATE
        ),
    )
    ref = put_blob(
        db, KIND_MANIFEST, manifest.model_dump(mode="json"), profile, defer=True, into=into
    )
    return ref, manifest


def read_manifest(db: Driver, ref: str) -> CheckpointManifest | None:
    """The manifest named by ``ref``, or None if its blob is missing.

    Raises:
        SessionCorrupt: the blob is not a manifest of a supported schema version.
    """
    return manifest_of(ref, get_blob(db, ref))


def manifest_of(ref: str, blob: tuple[str, Any] | None) -> CheckpointManifest | None:
    """The manifest in ``blob`` (the decoded blob ``ref``), or None if it is missing.

    Raises:
        SessionCorrupt: the blob is not a manifest of a supported schema version.
    """
    if blob is None:
        return None
    kind, value = blob
    if kind != KIND_MANIFEST or not isinstance(value, dict):
        raise SessionCorrupt("blobs", ref, "content", f"a {kind} blob is not a checkpoint manifest")
    version = value.get("schema_version")
    if version != MANIFEST_SCHEMA_VERSION:
        raise SessionCorrupt(
            "blobs", ref, "content", f"unsupported checkpoint manifest schema version {version!r}"
        )
    try:
        return CheckpointManifest.model_validate(value)
    except ValueError as exc:
        raise SessionCorrupt("blobs", ref, "content", str(exc)) from None


def manifest_refs(manifest: CheckpointManifest) -> list[str]:
    """The component blob hashes a manifest names (GC marks them)."""
    return [
        r
        for r in (
            manifest.tool_state_ref,
            manifest.plugin_snapshot_ref,
            manifest.execution_state_ref,
        )
        if r is not None
    ]


def get_checkpoint(db: Driver, ref: str) -> HydratedSessionCheckpoint | None:
    """Hydrate the checkpoint ``ref`` names; None if its manifest blob is missing.

    A missing component blob leaves that component's body None (its reference
    is kept).

    Raises:
        SessionCorrupt: the manifest or a present component does not decode.
    """
    return hydrate(db, read_manifest(db, ref))


def hydrate(db: Driver, manifest: CheckpointManifest | None) -> HydratedSessionCheckpoint | None:
    """The checkpoint of ``manifest`` with its component bodies read; None for None.

    A missing component blob leaves that component's body None (its reference
    is kept). A manifest with no component reference (a turn state only)
    reads nothing.

    Raises:
        SessionCorrupt: a present component does not decode.
    """
    if manifest is None:
        return None

    def body(component_ref: str | None) -> Any:
        if component_ref is None:
            return None
        blob = get_blob(db, component_ref)
        return None if blob is None else blob[1]

    # The manifest was validated; the bodies are decoded JSON: built without validation.
    return _HYDRATED(
        turn_state=manifest.turn_state,
        tool_state=body(manifest.tool_state_ref),
        tool_state_ref=manifest.tool_state_ref,
        plugin_snapshot=body(manifest.plugin_snapshot_ref),
        plugin_snapshot_ref=manifest.plugin_snapshot_ref,
        plugin_snapshot_revision=manifest.plugin_snapshot_revision,
        execution_state=body(manifest.execution_state_ref),
        execution_state_ref=manifest.execution_state_ref,
    )


#: Builds a checkpoint from a validated manifest and decoded bodies (records.checked_builder).
_HYDRATED: Final = checked_builder(
    HydratedSessionCheckpoint,
    {
        "turn_state": {"t": [1]},
        "tool_state": 1,
        "tool_state_ref": "a",
        "plugin_snapshot": "p",
        "plugin_snapshot_ref": "b",
        "plugin_snapshot_revision": 2,
        "execution_state": None,
        "execution_state_ref": "c",
    },
)
