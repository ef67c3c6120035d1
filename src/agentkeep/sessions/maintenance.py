"""Maintenance of the session store: tombstones, vacuum, blob GC.

This module owns three jobs (docs/sessions.md#maintenance):

* :meth:`MaintenanceRepository.tombstone_nodes` soft-deletes graph nodes of
  one session (``tombstoned = 1``); every read skips them (I-12,
  docs/sessions.md#invariants).
* :meth:`MaintenanceRepository.vacuum` physically deletes one session's
  tombstoned nodes and its ``cancelled``/``completed`` turn inputs;
  :meth:`MaintenanceRepository.vacuum_all_sessions` does the same for every
  session at once (the original store's vacuum deleted terminal inputs of
  every session; here it takes a ``session_id`` and the global job is
  explicit: docs/decisions.md#vacuum-is-per-session). Vacuum is not SQLite's
  ``VACUUM``: it never touches blobs, queued work, turn-commit records, usage
  deltas or leases. It ends source-key idempotency for the deleted inputs
  (docs/sessions.md#enqueue_pending_turn_input).
* :meth:`MaintenanceRepository.gc_unreachable` deletes every blob that no root
  reaches (I-13).

Locks (docs/decisions.md#one-write-lock-per-aggregate,
docs/architecture.md#the-aggregate-write-lock). On SQLite every write unit
already holds the database-wide write lock (``BEGIN IMMEDIATE``), so the
advisory locks below are no-ops there. On Postgres:

* ``tombstone_nodes`` takes the ``session:<id>`` lock;
* ``vacuum(session_id)`` takes the ``session:<id>`` lock, then the blob-GC lock
  (:attr:`~agentkeep.db.LockNamespace.BLOB_GC`, key ``"blobs"``) **shared**, in
  the same order as a commit;
* ``vacuum_all_sessions`` and the GC take the blob-GC lock **exclusive** and no
  session lock.

Why the global vacuum does not iterate the sessions under their locks: one
transaction would hold one advisory lock per session (Postgres keeps them in a
shared lock table of bounded size, and a unit of work that locks two sessions
in another order could deadlock with it). It does not need them either: it
only deletes *terminal* rows (nodes already tombstoned, inputs already
``cancelled``/``completed``) that no session operation ever writes again —
``tombstone_nodes`` only updates rows with ``tombstoned = 0``, and every
turn-input write is fenced on a non-terminal state or on claim columns that a
terminal row has cleared — so a session operation running beside it sees each
such row either present or gone, as if the vacuum ran before or after it. The
exclusive blob-GC lock orders it against the multi-row writers that do touch
the same rows: a commit's ``ReplaceFull`` delete (commits hold the lock
shared) and a per-session ``vacuum`` (which takes it shared for that reason),
so two multi-row DELETEs never meet in opposite row orders (a deadlock).
Holding the blob-GC lock exclusive, a maintenance unit must not then take a
session lock (a commit holds the session lock and waits for the GC lock): run
``vacuum_all_sessions`` and the GC in their own units of work (the one-call
forms do).

Blob GC (docs/sessions.md#blob-gc, docs/decisions.md#blob-gc-roots-and-locks):

* **One write transaction** holding the blob-GC lock exclusive. Commits hold
  it shared from before they insert their blobs until their head is
  committed, so GC never runs between a commit's blob insert and its head
  write (on SQLite the database lock gives the same). Writers of
  ``artifact_refs`` outside this package must also take it shared (or write
  in a store write unit on SQLite); otherwise a GC running beside them may
  delete a blob whose ref is not committed yet.
* **Roots** (``root_count`` counts distinct refs): every
  ``session_head.checkpoint_ref`` (every session, not one head), every
  ``runtime_turn_commits.checkpoint_ref`` (the checkpoint a stored turn-commit
  result names, so an idempotent replay never returns a collected
  checkpoint), every ``artifact_refs.blob_ref``, and every
  ``graph_nodes.blob_ref`` (the opaque body of a checkpoint node,
  :mod:`agentkeep.sessions.checkpoint_nodes`; never a manifest, never read).
* **Mark**: every root is marked. Head and turn-commit roots are checkpoint
  manifests; an artifact root is one when its stored ``kind`` is
  ``checkpoint_manifest``. Each present manifest is decoded
  (:func:`~agentkeep.sessions.checkpoints.read_manifest`) and its component
  refs (:func:`~agentkeep.sessions.checkpoints.manifest_refs`) are marked. A
  missing root or component is skipped. Component blobs are never read: a
  corrupt component is not a manifest and does not stop the GC. A manifest
  root that is present but does not decode **aborts** the GC before anything
  is deleted.
* **Sweep**: every unmarked blob is deleted, scanning the ``hash`` column only
  (never ``content``) in pages of :data:`SWEEP_BATCH` hashes and deleting each
  page's unmarked hashes with one statement, so memory and round trips are
  bounded by the page size, not by the blob count.
* **Report**: ``root_count`` distinct roots; ``retained_blob_count`` the
  stored blobs kept (a marked hash with no stored blob is not counted);
  ``deleted_blob_count`` the blobs deleted.

Errors of the GC — decided here: :meth:`~MaintenanceRepository.gc_unreachable`
keeps the original store's contract
(docs/decisions.md#gc-never-fails-a-commit): it never raises for corrupt data
or a database failure, it logs the error (logger
``agentkeep.sessions.maintenance``, level ERROR) and returns an all-zero
:class:`GcReport`, having deleted nothing. It is what automatic GC after
commits calls, where a failure must not fail the commit.
:meth:`~MaintenanceRepository.gc_unreachable_strict` is the same GC for
operators and tests that must see the failure: it raises
:class:`~agentkeep.errors.SessionCorrupt` (naming ``blobs``, the manifest hash
and ``content``) or the database error. Both run inside a savepoint, so a
failure leaves nothing of the GC behind and the caller's unit of work stays
usable (docs/decisions.md#a-typed-error-means-nothing-was-written). Calling
either inside ``store.read()`` is a programming error and raises
:class:`~agentkeep.errors.ReadOnlyUnitOfWork`.

Statements are :class:`~agentkeep.statements.Statement` constants built from
:mod:`agentkeep.sessions.models`. Those that take a list of ids or hashes use a
fixed ``IN`` list of :data:`SWEEP_BATCH` named parameters (``v0..v255``), a
shorter batch padded by repeating its first value, so each is compiled once.

Argument checks run before anything is written: a session id must be a
non-blank string, node ids a sequence (not a bare string) of non-blank strings
(:class:`~agentkeep.errors.InvalidInput`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from sqlalchemy import bindparam as p
from sqlalchemy import delete, func, literal, select, union, update
from sqlalchemy.sql.elements import BindParameter

from agentkeep.clock import Clock
from agentkeep.db import Driver, LockNamespace, atomic, lock_aggregate
from agentkeep.errors import DatabaseError, InvalidInput, ReadOnlyUnitOfWork, SessionCorrupt
from agentkeep.sessions.checkpoints import KIND_MANIFEST, manifest_refs, read_manifest
from agentkeep.sessions.domain import check_id
from agentkeep.sessions.leases import begin_session_write
from agentkeep.sessions.models import (
    ArtifactRefRow,
    BlobRow,
    GraphNodeRow,
    PendingTurnInputRow,
    RuntimeTurnCommitRow,
    SessionHeadRow,
)
from agentkeep.sessions.records import GcReport, VacuumReport
from agentkeep.statements import Statement

__all__ = [
    "BLOB_GC_KEY",
    "SWEEP_BATCH",
    "MaintenanceRepository",
    "Progress",
    "log_gc_failure",
]

log = logging.getLogger(__name__)

#: Key of the blob-GC advisory lock (namespace :attr:`LockNamespace.BLOB_GC`).
BLOB_GC_KEY: Final = "blobs"
#: Hashes per sweep page and per ``IN (...)`` list (well under both drivers'
#: parameter limits).
SWEEP_BATCH: Final = 256

#: A progress callback of the maintenance jobs: ``progress(phase, done, total)``.
#:
#: Phases: the GC reports ``"mark"`` (root manifests read, of ``total``) and
#: ``"sweep"`` (blobs examined, of ``total`` blobs stored); vacuum reports
#: ``"vacuum"`` (steps done of 2: tombstoned nodes, then terminal turn
#: inputs). It is called inside the job's transaction, first with ``done = 0``:
#: keep it fast and never touch the database from it. An exception it raises
#: aborts the job, which then deletes nothing (its savepoint is rolled back).
Progress = Callable[[str, int, int | None], None]


def _in_list() -> list[BindParameter[Any]]:
    """A fixed-size ``IN`` list of :data:`SWEEP_BATCH` named parameters ``v0..v255``.

    Shorter batches are padded by repeating their first value
    (:func:`_in_params`), so each statement is one constant compiled once.
    """
    return [p(f"v{i}") for i in range(SWEEP_BATCH)]


_TOMBSTONE: Final = Statement(
    update(GraphNodeRow)
    .values(tombstoned=1)
    .where(
        GraphNodeRow.session_id == p("sid"),
        GraphNodeRow.tombstoned == 0,
        GraphNodeRow.node_id.in_(_in_list()),
    ),
    name="maintenance.tombstone",
)
_UNCOUNT: Final = Statement(
    update(SessionHeadRow)
    .values(graph_node_count=SessionHeadRow.graph_node_count - p("n"))
    .where(SessionHeadRow.session_id == p("sid")),
    name="maintenance.uncount",
)
#: Turn-input states vacuum deletes (the terminal ones).
_TERMINAL_INPUT = PendingTurnInputRow.state.in_([literal("cancelled"), literal("completed")])
_VACUUM_NODES: Final = Statement(
    delete(GraphNodeRow).where(GraphNodeRow.session_id == p("sid"), GraphNodeRow.tombstoned == 1),
    name="maintenance.vacuum_nodes",
)
_VACUUM_INPUTS: Final = Statement(
    delete(PendingTurnInputRow).where(PendingTurnInputRow.session_id == p("sid"), _TERMINAL_INPUT),
    name="maintenance.vacuum_inputs",
)
_VACUUM_ALL_NODES: Final = Statement(
    delete(GraphNodeRow).where(GraphNodeRow.tombstoned == 1), name="maintenance.vacuum_all_nodes"
)
_VACUUM_ALL_INPUTS: Final = Statement(
    delete(PendingTurnInputRow).where(_TERMINAL_INPUT), name="maintenance.vacuum_all_inputs"
)
# The roots, tagged 1 when the ref names a checkpoint manifest, 0 when it may
# (an artifact: its kind decides), 2 when it never does (a checkpoint node's
# opaque body).
_ROOTS: Final = Statement(
    union(
        select(SessionHeadRow.checkpoint_ref, literal(1)),
        select(RuntimeTurnCommitRow.checkpoint_ref, literal(1)),
        select(ArtifactRefRow.blob_ref, literal(0)),
        select(GraphNodeRow.blob_ref, literal(2)).where(GraphNodeRow.blob_ref.is_not(None)),
    ),
    name="maintenance.roots",
)
_MANIFESTS_AMONG: Final = Statement(
    select(BlobRow.hash).where(BlobRow.kind == p("kind"), BlobRow.hash.in_(_in_list())),
    name="maintenance.manifests_among",
)
_FIRST_PAGE: Final = Statement(
    select(BlobRow.hash).order_by(BlobRow.hash).limit(p("limit")),
    name="maintenance.first_page",
)
_NEXT_PAGE: Final = Statement(
    select(BlobRow.hash).where(BlobRow.hash > p("after")).order_by(BlobRow.hash).limit(p("limit")),
    name="maintenance.next_page",
)
_SWEEP: Final = Statement(
    delete(BlobRow).where(BlobRow.hash.in_(_in_list())), name="maintenance.sweep"
)
_BLOB_COUNT: Final = Statement(
    select(func.count()).select_from(BlobRow), name="maintenance.blob_count"
)


def _in_params(values: Sequence[str]) -> dict[str, str]:
    """Parameters of the ``IN`` list (:func:`_in_list`) for 1..SWEEP_BATCH values.

    Padded with the first value, which changes nothing an ``IN`` matches.
    """
    return {f"v{i}": values[i] if i < len(values) else values[0] for i in range(SWEEP_BATCH)}


def _batches(values: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(values), SWEEP_BATCH):
        yield values[start : start + SWEEP_BATCH]


def _report(progress: Progress | None, phase: str, done: int, total: int | None) -> None:
    if progress is not None:
        progress(phase, done, total)


def _check_node_ids(node_ids: object) -> list[str]:
    if isinstance(node_ids, str | bytes) or not isinstance(node_ids, Iterable):
        raise InvalidInput("node_ids", "expected a sequence of node ids")
    checked = [check_id(n, f"node_ids[{i}]") for i, n in enumerate(node_ids)]
    return list(dict.fromkeys(checked))  # unique, first-seen order


def log_gc_failure(exc: BaseException) -> None:
    """Log a blob GC that failed and deleted nothing (what ``gc_unreachable`` returns zeros for)."""
    log.error("blob GC aborted, nothing deleted: %s", exc, exc_info=exc)


class MaintenanceRepository:
    """Tombstones, vacuum and blob GC in one unit of work (see the module docstring)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested  # see db.atomic: False in a one-call unit

    def _require_writable(self) -> None:
        if not self._writable:
            raise ReadOnlyUnitOfWork("session store writes need store.write(), not store.read()")

    # ---------------------------------------------------------------- tombstones

    def tombstone_nodes(self, session_id: str, node_ids: Sequence[str]) -> None:
        """Soft-delete graph nodes of one session (docs/sessions.md#tombstone_nodes).

        Sets ``tombstoned = 1`` on the session's nodes named by ``node_ids``;
        every read skips them afterwards (I-12) and :meth:`vacuum` deletes
        them. Unknown ids, ids of other sessions' nodes and already tombstoned
        nodes are ignored; duplicates are harmless. An empty ``node_ids``
        returns at once, without a transaction round trip. The head record is
        not rewritten: its ``graph_node_count`` is the count at the last
        commit.

        Args:
            session_id: the session whose nodes are tombstoned.
            node_ids: node ids (a sequence of strings; not a bare string).

        Raises:
            InvalidInput: a blank or non-string session id or node id, or
                ``node_ids`` is not a sequence; nothing is written.
            ReadOnlyUnitOfWork: inside ``store.read()`` (also for an empty list).
        """
        check_id(session_id, "session_id")
        ids = _check_node_ids(node_ids)
        self._require_writable()
        if not ids:
            return
        begin_session_write(self._db, self._clock, self._writable, session_id)
        with atomic(self._db, self._nested):
            tombstoned = sum(
                self._db.execute(_TOMBSTONE, {"sid": session_id, **_in_params(batch)}).rowcount
                for batch in _batches(ids)
            )
            if tombstoned:
                # The head's live-node count is kept exact here so commits
                # never have to count the graph.
                self._db.execute(_UNCOUNT, {"sid": session_id, "n": tombstoned})

    # ---------------------------------------------------------------- vacuum

    def vacuum(self, session_id: str, *, progress: Progress | None = None) -> VacuumReport:
        """Delete one session's tombstoned nodes and terminal turn inputs.

        See docs/sessions.md#vacuum.

        Deletes the session's graph nodes with ``tombstoned = 1`` and its
        ``cancelled`` and ``completed`` turn inputs; other sessions are not
        touched. Takes the ``session:<id>`` lock, then the blob-GC lock shared.

        Args:
            session_id: the session to vacuum.
            progress: called as each step ends (:data:`Progress`).

        Returns:
            The counts of deleted nodes and deleted turn inputs.

        Raises:
            InvalidInput: a blank or non-string session id; nothing is written.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_id(session_id, "session_id")
        begin_session_write(self._db, self._clock, self._writable, session_id)
        lock_aggregate(self._db, LockNamespace.BLOB_GC, BLOB_GC_KEY, shared=True)
        params = {"sid": session_id}
        with atomic(self._db, self._nested):
            _report(progress, "vacuum", 0, 2)
            nodes = self._db.execute(_VACUUM_NODES, params).rowcount
            _report(progress, "vacuum", 1, 2)
            inputs = self._db.execute(_VACUUM_INPUTS, params).rowcount
            _report(progress, "vacuum", 2, 2)
        return VacuumReport(
            removed_node_count=nodes, removed_pending_turn_input_tombstone_count=inputs
        )

    def vacuum_all_sessions(self, *, progress: Progress | None = None) -> VacuumReport:
        """:meth:`vacuum` every session at once (the explicit global maintenance job).

        Deletes every tombstoned node and every ``cancelled``/``completed``
        turn input of every session. Takes the blob-GC lock exclusive and no
        session lock (why this is safe: module docstring); run it in its own
        unit of work.

        Args:
            progress: called as each step ends (:data:`Progress`).

        Returns:
            The counts of deleted nodes and deleted turn inputs, all sessions.

        Raises:
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        self._require_writable()
        lock_aggregate(self._db, LockNamespace.BLOB_GC, BLOB_GC_KEY)
        with atomic(self._db, self._nested):
            _report(progress, "vacuum", 0, 2)
            nodes = self._db.execute(_VACUUM_ALL_NODES, {}).rowcount
            _report(progress, "vacuum", 1, 2)
            inputs = self._db.execute(_VACUUM_ALL_INPUTS, {}).rowcount
            _report(progress, "vacuum", 2, 2)
        return VacuumReport(
            removed_node_count=nodes, removed_pending_turn_input_tombstone_count=inputs
        )

    # ---------------------------------------------------------------- blob GC

    def gc_unreachable(self, *, progress: Progress | None = None) -> GcReport:
        """Delete every blob no root reaches; never fails on corrupt data.

        See docs/sessions.md#gc_unreachable and docs/sessions.md#blob-gc.

        Same GC as :meth:`gc_unreachable_strict`, but a failure (a present root
        manifest that does not decode, or a database error such as a lock
        timeout) is logged and returned as an all-zero report; nothing is
        deleted then, and the caller's unit of work stays usable.

        Returns:
            ``GcReport(root_count, retained_blob_count, deleted_blob_count)``,
            or an all-zero report when the GC was aborted.

        Raises:
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        self._require_writable()
        try:
            return self.gc_unreachable_strict(progress=progress)
        except (SessionCorrupt, DatabaseError) as exc:
            log_gc_failure(exc)
            return GcReport()

    def gc_unreachable_strict(self, *, progress: Progress | None = None) -> GcReport:
        """Delete every blob no root reaches; raise when the GC cannot be trusted.

        Takes the blob-GC lock exclusive, marks the roots and the components
        of their checkpoint manifests, and deletes every unmarked blob (module
        docstring). Runs in a savepoint: when it raises, nothing was deleted.

        Args:
            progress: called as the mark and the sweep advance (:data:`Progress`).

        Returns:
            ``GcReport(root_count, retained_blob_count, deleted_blob_count)``.

        Raises:
            SessionCorrupt: a root manifest blob is present but does not
                decode (not a manifest, wrong schema version, bad content);
                nothing is deleted.
            DatabaseError: the database failed (``StoreBusy`` for a lock
                timeout); nothing is deleted.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        self._require_writable()
        with atomic(self._db, self._nested):
            lock_aggregate(self._db, LockNamespace.BLOB_GC, BLOB_GC_KEY)
            roots, marked = self._mark(progress)
            retained, deleted = self._sweep(marked, progress)
        return GcReport(root_count=roots, retained_blob_count=retained, deleted_blob_count=deleted)

    def _mark(self, progress: Progress | None = None) -> tuple[int, set[str]]:
        """``(distinct root count, marked hashes)``; raises before any delete."""
        rows = self._db.execute(_ROOTS, {}).fetchall()
        roots = {str(ref) for ref, _ in rows}
        manifests = {str(ref) for ref, tag in rows if tag == 1}
        others = sorted({str(ref) for ref, tag in rows if tag == 0} - manifests)
        for batch in _batches(others):  # artifact roots that name a checkpoint
            params = {"kind": KIND_MANIFEST, **_in_params(batch)}
            found = self._db.execute(_MANIFESTS_AMONG, params).fetchall()
            manifests.update(str(h) for (h,) in found)
        marked = set(roots)
        total = len(manifests)
        _report(progress, "mark", 0, total)
        for done, ref in enumerate(sorted(manifests), 1):
            manifest = read_manifest(self._db, ref)  # SessionCorrupt aborts the GC
            if manifest is not None:
                marked.update(manifest_refs(manifest))
            _report(progress, "mark", done, total)
        return len(roots), marked

    def _sweep(self, marked: set[str], progress: Progress | None = None) -> tuple[int, int]:
        """Delete unmarked blobs page by page; ``(retained, deleted)``."""
        present = deleted = 0
        total = None
        if progress is not None:
            total = int(self._db.execute(_BLOB_COUNT, {}).fetchone()[0])
            progress("sweep", 0, total)
        page = self._db.execute(_FIRST_PAGE, {"limit": SWEEP_BATCH}).fetchall()
        while page:
            hashes = [str(h) for (h,) in page]
            present += len(hashes)
            garbage = [h for h in hashes if h not in marked]
            if garbage:
                deleted += self._db.execute(_SWEEP, _in_params(garbage)).rowcount
            _report(progress, "sweep", present, total)
            if len(hashes) < SWEEP_BATCH:
                break
            params = {"after": hashes[-1], "limit": SWEEP_BATCH}
            page = self._db.execute(_NEXT_PAGE, params).fetchall()
        return present - deleted, deleted
