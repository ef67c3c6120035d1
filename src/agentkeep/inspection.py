"""Read-only inspection of a database: sessions, runs and runtimes as operators see them.

:class:`Inspector` is what ``agentkeep sessions|runs|runtime list|show`` print
(docs/operations.md#inspection), usable from Python too::

    with Inspector.open("sqlite:///app.db") as inspector:
        for s in inspector.sessions(limit=20):
            print(s.session_id, s.head_revision, s.lease_holder)

Read-only, by construction:

* **SQLite**: the file is opened with a ``file:<path>?mode=ro`` URI; a missing
  file is :class:`~agentkeep.errors.DatabaseMissing` (never a new empty
  database), and no statement takes the write lock (no ``BEGIN IMMEDIATE``):
  a writer holding it does not block an inspection, which reads the last
  committed state. The database file is never written. (On a WAL database
  SQLite itself may create the empty ``-wal``/``-shm`` side files a reader
  needs when no other connection left them.)
* **Postgres**: every read runs in a ``READ ONLY`` ``REPEATABLE READ``
  transaction; no advisory lock is taken.

Every method reads in one transaction (one consistent snapshot). Queries are
Core statements built from the ORM models; nothing here writes. Stored values
are decoded as the stores decode them: a corrupt value fails loudly
(:class:`~agentkeep.errors.CorruptData` / :class:`~agentkeep.errors.ReadFailed`),
it is never shown as absent. An id that names nothing is
:class:`~agentkeep.errors.NotFound`.

Times are epoch milliseconds. Secrets are never returned: lease and claim
tokens are reported as held or not, never by value.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy import Connection, Engine, func, select, union
from sqlalchemy.pool import NullPool

from agentkeep import db
from agentkeep.errors import (
    CorruptData,
    DatabaseError,
    DatabaseMissing,
    InvalidInput,
    NotFound,
    SchemaError,
)
from agentkeep.runs.codec import CodecError, decode_status
from agentkeep.runs.models import Run
from agentkeep.runtime.access import payload_bytes
from agentkeep.runtime.domain import ReferenceDomain, RuntimeDomain
from agentkeep.runtime.models import (
    CompactionProjectionOutboxRow,
    InputStateRow,
    OpsLifecycleRow,
    ProjectionQuarantineRow,
    RetiredOpsEpochRow,
    RuntimeStateRow,
    SessionSnapshotRow,
)
from agentkeep.sessions.codec import decode_owner
from agentkeep.sessions.domain import LeaseOwnerIdentity, LocalProcess
from agentkeep.sessions.liveness import ProcessProbe, capture_liveness, procfs_probe
from agentkeep.sessions.models import (
    GraphNodeRow,
    PendingTurnInputRow,
    QueuedWorkBatchRow,
    QueuedWorkItemRow,
    RuntimeTurnCommitRow,
    SessionHeadRow,
    SessionLeaseRow,
    SessionMetaRow,
    UsageDeltaRow,
)

__all__ = [
    "DEFAULT_LIMIT",
    "Claim",
    "GraphNode",
    "Inspector",
    "Lease",
    "PendingInput",
    "QueuedBatch",
    "RunDetail",
    "RunSummary",
    "RuntimeDetail",
    "RuntimeSummary",
    "SessionDetail",
    "SessionSummary",
    "Usage",
    "graph_dot",
    "graph_mermaid",
]

#: Rows per page of a list when no limit is given.
DEFAULT_LIMIT: Final = 50
#: Turn-input states that are still waiting for (or in) a turn.
OPEN_INPUT_STATES: Final = ("pending_active", "deferred_next_turn", "accepted")

Liveness = Literal["alive", "gone", "unknown", "other-host", "opaque"]


def _as_dict(value: Any) -> dict[str, Any]:
    return asdict(value)


class _Json:
    """``to_json()``: the dataclass as a JSON object (its fields, nested values as dicts)."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        """This value as a JSON object."""
        return _as_dict(self)


# --------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class Lease:
    """A session's execution lease as stored (its token is never reported).

    Attributes:
        owner_id, incarnation_id: the holder.
        held: a lease token is stored (released leases keep their fencing token).
        fencing_token: the lease generation; it only grows.
        claimed_at_ms, expires_at_ms: the lease's window.
        expired: ``expires_at_ms`` is not after the inspection's clock.
        liveness: the holder's process as this machine sees it: ``alive`` /
            ``gone`` (same host and boot, by procfs), ``unknown`` (procfs could
            not tell), ``other-host`` (another host or boot), ``opaque`` (the
            holder recorded no process identity).
    """

    owner_id: str | None
    incarnation_id: str | None
    held: bool
    fencing_token: int
    claimed_at_ms: int
    expires_at_ms: int
    expired: bool
    liveness: Liveness | None


@dataclass(frozen=True, slots=True)
class Claim:
    """The claim of a queued batch or a turn input (its token is never reported)."""

    claim_id: str
    owner_id: str | None
    fencing_token: int
    session_lease_generation: int


@dataclass(frozen=True, slots=True)
class SessionSummary(_Json):
    """One line of ``sessions list``.

    ``last_update_ms`` is the latest of the lease claim, the turn commits'
    ``committed_at_ms`` and the enqueue times of its queued work and turn
    inputs (None when none is stored).
    """

    session_id: str
    head_revision: int | None
    lease_holder: str | None
    lease_expires_at_ms: int | None
    queued_batches: int
    pending_inputs: int
    last_update_ms: int | None


@dataclass(frozen=True, slots=True)
class PendingInput:
    """A turn input that is not terminal (``pending_active``, ``deferred_next_turn``,
    ``accepted``), with its claim."""

    input_id: str
    state: str
    enqueue_seq: int
    enqueued_at_ms: int
    claim: Claim | None


@dataclass(frozen=True, slots=True)
class QueuedBatch:
    """A queued work batch, with its item count and claim."""

    batch_id: str
    enqueue_seq: int
    delivery_policy: str
    slot_policy: str
    available_at_ms: int
    enqueued_at_ms: int
    items: int
    claim: Claim | None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token totals of one (source, model) pair."""

    source: str
    model: str
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_write_input_tokens: int
    reasoning_output_tokens: int


@dataclass(frozen=True, slots=True)
class GraphNode:
    """A live (not tombstoned) graph node; ``active`` when it is on the path to the leaf."""

    node_id: str
    parent_node_id: str | None
    active: bool


@dataclass(frozen=True, slots=True)
class SessionDetail:
    """``sessions show``: the head, lease, pending inputs, queued work, usage and graph.

    Attributes:
        active_path: node ids from the root to the head's leaf.
        branches: for each node on the active path, how many of its children
            are off the path.
        nodes: every live node of the graph, in insertion order.
    """

    session_id: str
    head_revision: int | None
    leaf_node_id: str | None
    checkpoint_ref: str | None
    graph_node_count: int | None
    meta: dict[str, Any] | None
    lease: Lease | None
    pending_inputs: tuple[PendingInput, ...]
    queued_work: tuple[QueuedBatch, ...]
    usage: tuple[Usage, ...]
    active_path: tuple[str, ...]
    branches: dict[str, int] = field(default_factory=dict)
    nodes: tuple[GraphNode, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The detail as a JSON object (``nodes`` left out: see ``--graph``)."""
        out = _as_dict(self)
        del out["nodes"]
        return out


@dataclass(frozen=True, slots=True)
class RunSummary(_Json):
    """One line of ``runs list`` (``created_at``/``updated_at`` in Unix seconds, as stored)."""

    run_id: str
    task_id: str
    status: str
    created_at: int
    updated_at: int


@dataclass(frozen=True, slots=True)
class RunDetail(_Json):
    """``runs show``: the run's columns, its JSON values decoded."""

    run_id: str
    task_id: str
    status: str
    created_at: int
    updated_at: int
    seq: int | None
    operator_sid: str | None
    next_generation: int
    current: Any
    result_ref: Any
    input: Any
    step_entries: list[Any]
    degradations: list[Any]


@dataclass(frozen=True, slots=True)
class RuntimeSummary(_Json):
    """One line of ``runtime list``.

    Attributes:
        lifecycle: the machine lifecycle's runtime state (``idle``,
            ``stopped``, ``retired``), None when no record is stored.
        snapshot_revision: the stored session snapshot's transcript revision.
        pending_outbox: compaction projections not finalized yet.
        ops_epoch: the epoch owning the stored ops lifecycle snapshot.
        quarantined: the snapshot's projection is quarantined.
    """

    runtime_id: str
    lifecycle: str | None
    snapshot_revision: str | None
    pending_outbox: int
    ops_epoch: str | None
    quarantined: bool


@dataclass(frozen=True, slots=True)
class RuntimeDetail:
    """``runtime show``: the summary plus binding, inputs, outbox and retired epochs."""

    summary: RuntimeSummary
    snapshot_session_id: str | None
    binding: dict[str, Any] | None
    input_ids: tuple[str, ...]
    pending_projections: tuple[dict[str, str], ...]
    retired_epochs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The detail as a JSON object (the summary's keys at the top level)."""
        out = _as_dict(self)
        return {**out.pop("summary"), **out}


# --------------------------------------------------------------------------
# Engines


def read_only_engine(url: str) -> Engine:
    """An engine that can only read ``url`` (see the module docstring).

    Raises:
        DatabaseMissing: a SQLite file that does not exist (nothing is created).
        InvalidInput: an in-memory SQLite URL (nothing to inspect) or an
            unsupported URL.
    """
    u = db.check_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        path = db.sqlite_file(url)
        if path is None:
            raise InvalidInput("url", "an in-memory SQLite database has nothing to inspect")
        if not path.exists():
            raise DatabaseMissing(db.mask_url(url), str(path), "agentkeep upgrade")
        uri = f"file:{quote(str(path.resolve()))}?mode=ro"

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, timeout=5.0, check_same_thread=False)

        return sa.create_engine("sqlite://", creator=connect, poolclass=NullPool)
    if backend == "postgresql":
        if u.drivername == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
        engine = sa.create_engine(u, poolclass=NullPool)
        return engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    raise InvalidInput("url", f"unsupported backend {backend!r}: use sqlite or postgresql")


# --------------------------------------------------------------------------
# The inspector


def _id_page(limit: int, after: str | None, *columns: Any) -> Any:
    """The ids found in any of ``columns``, in order: ``limit`` of them after ``after``."""
    _check_limit(limit)
    ids = union(*(select(c.label("id")) for c in columns)).subquery()
    page = select(ids.c.id).order_by(ids.c.id).limit(limit)
    return page if after is None else page.where(ids.c.id > after)


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInput("limit", "must be an integer >= 1")
    return limit


def _json(raw: str | None, run_id: str, column: str) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptData("runs", run_id, column, f"not JSON: {exc}") from exc


def _status(raw: object, run_id: str) -> str:
    try:
        return decode_status(raw).value
    except CodecError as exc:
        raise CorruptData("runs", run_id, "status", str(exc)) from exc


def _claim(row: Any) -> Claim | None:
    if row.claim_token is None:
        return None
    return Claim(
        claim_id=str(row.claim_id),
        owner_id=row.claim_owner_id,
        fencing_token=int(row.claim_fencing_token),
        session_lease_generation=int(row.claim_session_lease_generation),
    )


def holder_liveness(holder: LeaseOwnerIdentity, probe: ProcessProbe = procfs_probe) -> Liveness:
    """How the holder's process looks from this machine (see :class:`Lease`)."""
    h = holder.liveness
    if not isinstance(h, LocalProcess):
        return "opaque"
    here = capture_liveness()
    if not isinstance(here, LocalProcess) or (here.host_id, here.boot_id) != (
        h.host_id,
        h.boot_id,
    ):
        return "other-host"
    return probe(h.pid, h.process_start)


class Inspector:
    """Read-only queries over one database (see the module docstring).

    Args:
        engine: an engine that can only read (:func:`read_only_engine`);
            :meth:`open` builds it from a URL.
        domain: decodes runtime rows (the store's :class:`RuntimeDomain`).
        now_ms: the clock that decides whether a lease has expired.
        probe: decides whether a lease holder's local process is gone.
        url: the URL errors name (default: the engine's).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        domain: RuntimeDomain[Any] | None = None,
        now_ms: Any = None,
        probe: ProcessProbe = procfs_probe,
        url: str | None = None,
    ) -> None:
        self._engine = engine
        self._url: str | Engine = url if url is not None else engine
        self._domain: RuntimeDomain[Any] = domain or ReferenceDomain()
        self._now_ms = now_ms or (lambda: int(time.time() * 1000))
        self._probe = probe

    @classmethod
    def open(cls, url: str, *, domain: RuntimeDomain[Any] | None = None) -> Inspector:
        """An inspector on ``url``, opened read-only (no connection is made yet).

        Raises:
            DatabaseMissing: a SQLite file that does not exist.
            InvalidInput: an in-memory or unsupported URL.
        """
        return cls(read_only_engine(url), domain=domain, url=url)

    def close(self) -> None:
        """Dispose of the engine."""
        self._engine.dispose()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """One read-only transaction (a consistent snapshot).

        Raises:
            SchemaError: agentkeep's tables are missing (the database is not migrated).
            DatabaseUnavailable: the database cannot be opened or reached.
        """
        try:
            with db.opening(self._url), self._engine.connect() as conn, conn.begin():
                yield conn
        except DatabaseError as exc:
            missing = _missing_table(exc)
            if missing is not None:
                where = db.mask_url(self._url) if isinstance(self._url, str) else "the database"
                raise SchemaError(
                    f"{where} is not migrated ({missing}): run `agentkeep upgrade` first"
                ) from exc
            raise

    # ---------------------------------------------------------------- sessions

    def sessions(
        self, *, limit: int = DEFAULT_LIMIT, after: str | None = None
    ) -> list[SessionSummary]:
        """Sessions in id order, ``limit`` of them after the id ``after``.

        A session is listed when it has a head, a lease, queued work or turn inputs.
        """
        page = _id_page(
            limit,
            after,
            SessionHeadRow.session_id,
            SessionLeaseRow.session_id,
            QueuedWorkBatchRow.session_id,
            PendingTurnInputRow.session_id,
        )
        with self._read() as conn:
            ids = [str(r[0]) for r in conn.execute(page)]
            if not ids:
                return []
            heads = dict(
                conn.execute(
                    select(SessionHeadRow.session_id, SessionHeadRow.head_revision).where(
                        SessionHeadRow.session_id.in_(ids)
                    )
                ).all()
            )
            leases = {
                r.session_id: r
                for r in conn.execute(
                    select(SessionLeaseRow).where(SessionLeaseRow.session_id.in_(ids))
                ).mappings()
            }
            batches = self._grouped(
                conn, QueuedWorkBatchRow, ids, QueuedWorkBatchRow.enqueued_at_ms
            )
            inputs = self._grouped(
                conn,
                PendingTurnInputRow,
                ids,
                PendingTurnInputRow.enqueued_at_ms,
                PendingTurnInputRow.state.in_(OPEN_INPUT_STATES),
            )
            commits = self._last_commits(conn, ids)
        out = []
        for sid in ids:
            lease = leases.get(sid)
            held = lease is not None and lease["lease_token"] is not None
            times = [
                t
                for t in (
                    lease["lease_claimed_at_ms"] if lease is not None else None,
                    batches.get(sid, (0, None))[1],
                    inputs.get(sid, (0, None))[1],
                    commits.get(sid),
                )
                if t
            ]
            out.append(
                SessionSummary(
                    session_id=sid,
                    head_revision=heads.get(sid),
                    lease_holder=lease["lease_owner_id"] if held and lease is not None else None,
                    lease_expires_at_ms=(
                        lease["lease_expires_at_ms"] if held and lease is not None else None
                    ),
                    queued_batches=batches.get(sid, (0, None))[0],
                    pending_inputs=inputs.get(sid, (0, None))[0],
                    last_update_ms=max(times) if times else None,
                )
            )
        return out

    @staticmethod
    def _grouped(
        conn: Connection, model: Any, ids: Sequence[str], at: Any, *where: Any
    ) -> dict[str, tuple[int, int | None]]:
        stmt = (
            select(model.session_id, func.count(), func.max(at))
            .where(model.session_id.in_(ids), *where)
            .group_by(model.session_id)
        )
        return {str(sid): (int(n), last) for sid, n, last in conn.execute(stmt)}

    @staticmethod
    def _last_commits(conn: Connection, ids: Sequence[str]) -> dict[str, int]:
        T = RuntimeTurnCommitRow
        stmt = (
            select(T.session_id, func.max(T.committed_at_ms))
            .where(T.session_id.in_(ids))
            .group_by(T.session_id)
        )
        return {str(sid): int(last) for sid, last in conn.execute(stmt) if last is not None}

    def session(self, session_id: str) -> SessionDetail:
        """Everything about one session (see :class:`SessionDetail`).

        Raises:
            NotFound: nothing is stored for ``session_id``.
        """
        with self._read() as conn:
            head = (
                conn.execute(select(SessionHeadRow).where(SessionHeadRow.session_id == session_id))
                .mappings()
                .first()
            )
            meta = (
                conn.execute(select(SessionMetaRow).where(SessionMetaRow.session_id == session_id))
                .mappings()
                .first()
            )
            lease_row = conn.execute(
                select(SessionLeaseRow).where(SessionLeaseRow.session_id == session_id)
            ).first()
            inputs = conn.execute(
                select(PendingTurnInputRow)
                .where(
                    PendingTurnInputRow.session_id == session_id,
                    PendingTurnInputRow.state.in_(OPEN_INPUT_STATES),
                )
                .order_by(PendingTurnInputRow.enqueue_seq)
            ).all()
            item_counts = (
                select(QueuedWorkItemRow.batch_id, func.count().label("n"))
                .group_by(QueuedWorkItemRow.batch_id)
                .subquery()
            )
            batches = conn.execute(
                select(QueuedWorkBatchRow, item_counts.c.n)
                .outerjoin(item_counts, item_counts.c.batch_id == QueuedWorkBatchRow.batch_id)
                .where(QueuedWorkBatchRow.session_id == session_id)
                .order_by(QueuedWorkBatchRow.enqueue_seq)
            ).all()
            U = UsageDeltaRow
            usage = conn.execute(
                select(
                    U.source,
                    U.model,
                    func.sum(U.input_tokens),
                    func.sum(U.output_tokens),
                    func.sum(U.cache_read_input_tokens),
                    func.sum(U.cache_write_input_tokens),
                    func.sum(U.reasoning_output_tokens),
                )
                .where(U.session_id == session_id)
                .group_by(U.source, U.model)
                .order_by(U.source, U.model)
            ).all()
            nodes = conn.execute(
                select(GraphNodeRow.node_id, GraphNodeRow.parent_node_id)
                .where(GraphNodeRow.session_id == session_id, GraphNodeRow.tombstoned == 0)
                .order_by(GraphNodeRow.seq)
            ).all()
        if head is None and meta is None and lease_row is None and not inputs and not batches:
            raise NotFound("session", session_id)
        leaf = head["leaf_node_id"] if head is not None else None
        path, branches = _active_path(nodes, leaf)
        on_path = set(path)
        return SessionDetail(
            session_id=session_id,
            head_revision=head["head_revision"] if head is not None else None,
            leaf_node_id=leaf,
            checkpoint_ref=head["checkpoint_ref"] if head is not None else None,
            graph_node_count=head["graph_node_count"] if head is not None else None,
            meta=(
                {k: v for k, v in meta.items() if k not in ("session_id", "relation_json")}
                if meta is not None
                else None
            ),
            lease=self._lease(lease_row) if lease_row is not None else None,
            pending_inputs=tuple(
                PendingInput(
                    input_id=r.input_id,
                    state=r.state,
                    enqueue_seq=int(r.enqueue_seq),
                    enqueued_at_ms=int(r.enqueued_at_ms),
                    claim=_claim(r),
                )
                for r in inputs
            ),
            queued_work=tuple(
                QueuedBatch(
                    batch_id=b.batch_id,
                    enqueue_seq=int(b.enqueue_seq),
                    delivery_policy=b.delivery_policy,
                    slot_policy=b.slot_policy,
                    available_at_ms=int(b.available_at_ms),
                    enqueued_at_ms=int(b.enqueued_at_ms),
                    items=int(b.n or 0),
                    claim=_claim(b),
                )
                for b in batches
            ),
            usage=tuple(
                Usage(str(s), str(m), *(int(v or 0) for v in rest)) for s, m, *rest in usage
            ),
            active_path=tuple(path),
            branches=branches,
            nodes=tuple(GraphNode(str(n), p, str(n) in on_path) for n, p in nodes),
        )

    def _lease(self, row: Any) -> Lease:
        held = row.lease_token is not None
        owner = decode_owner(
            row.lease_owner_id, row.lease_owner_incarnation_id, row.lease_owner_liveness_json
        )
        expires = int(row.lease_expires_at_ms)
        return Lease(
            owner_id=owner.owner_id if owner is not None else None,
            incarnation_id=owner.incarnation_id if owner is not None else None,
            held=held,
            fencing_token=int(row.lease_fencing_token),
            claimed_at_ms=int(row.lease_claimed_at_ms),
            expires_at_ms=expires,
            expired=expires <= self._now_ms(),
            liveness=holder_liveness(owner, self._probe) if owner is not None and held else None,
        )

    # ---------------------------------------------------------------- runs

    def runs(self, *, limit: int = DEFAULT_LIMIT, after: str | None = None) -> list[RunSummary]:
        """Runs in id order, ``limit`` of them after the id ``after``."""
        _check_limit(limit)
        stmt = (
            select(Run.id, Run.task_id, Run.status, Run.created_at, Run.updated_at)
            .order_by(Run.id)
            .limit(limit)
        )
        if after is not None:
            stmt = stmt.where(Run.id > after)
        with self._read() as conn:
            rows = conn.execute(stmt).all()
        return [RunSummary(r[0], r[1], _status(r[2], r[0]), int(r[3]), int(r[4])) for r in rows]

    def run(self, run_id: str) -> RunDetail:
        """One run (see :class:`RunDetail`).

        Raises:
            NotFound: no run ``run_id``.
            CorruptData: a JSON column does not decode.
        """
        with self._read() as conn:
            row = conn.execute(select(Run).where(Run.id == run_id)).first()
        if row is None:
            raise NotFound("run", run_id)
        r = row
        return RunDetail(
            run_id=r.id,
            task_id=r.task_id,
            status=_status(r.status, r.id),
            created_at=int(r.created_at),
            updated_at=int(r.updated_at),
            seq=r.seq,
            operator_sid=r.operator_sid,
            next_generation=int(r.next_generation),
            current=_json(r.current_json, run_id, "current_json"),
            result_ref=_json(r.result_ref_json, run_id, "result_ref_json"),
            input=_json(r.input_json, run_id, "input_json"),
            step_entries=_json(r.step_entries_json, run_id, "step_entries_json") or [],
            degradations=_json(r.degradations_json, run_id, "degradations_json") or [],
        )

    # ---------------------------------------------------------------- runtimes

    def runtimes(
        self, *, limit: int = DEFAULT_LIMIT, after: str | None = None
    ) -> list[RuntimeSummary]:
        """Runtimes in id order, ``limit`` of them after the id ``after``.

        A runtime is listed when it has a lifecycle record, a snapshot, an ops
        snapshot, input states or outbox rows.
        """
        page = _id_page(
            limit,
            after,
            RuntimeStateRow.runtime_id,
            SessionSnapshotRow.runtime_id,
            OpsLifecycleRow.runtime_id,
            InputStateRow.runtime_id,
            CompactionProjectionOutboxRow.runtime_id,
        )
        with self._read() as conn:
            ids = [str(r[0]) for r in conn.execute(page)]
            return [self._runtime_summary(conn, rid) for rid in ids]

    def _runtime_summary(self, conn: Connection, runtime_id: str) -> RuntimeSummary:
        rid = runtime_id
        lifecycle = conn.execute(
            select(RuntimeStateRow.runtime_state_json).where(RuntimeStateRow.runtime_id == rid)
        ).scalar()
        snapshot = conn.execute(
            select(SessionSnapshotRow.session_snapshot).where(SessionSnapshotRow.runtime_id == rid)
        ).scalar()
        ops = conn.execute(
            select(OpsLifecycleRow.state_json).where(OpsLifecycleRow.runtime_id == rid)
        ).scalar()
        Out = CompactionProjectionOutboxRow
        pending = conn.execute(
            select(func.count()).where(Out.runtime_id == rid, Out.state == "pending")
        ).scalar_one()
        quarantined = conn.execute(
            select(ProjectionQuarantineRow.runtime_id).where(
                ProjectionQuarantineRow.runtime_id == rid
            )
        ).first()
        d = self._domain
        return RuntimeSummary(
            runtime_id=rid,
            lifecycle=(
                d.decode_lifecycle(payload_bytes(lifecycle, f"runtime_states[{rid}]")).runtime_state
                if lifecycle is not None
                else None
            ),
            snapshot_revision=(
                _revision(d.decode_persisted_session(payload_bytes(snapshot, f"snapshot[{rid}]")))
                if snapshot is not None
                else None
            ),
            pending_outbox=int(pending),
            ops_epoch=(
                d.ops_epoch_of(payload_bytes(ops, f"runtime_ops_lifecycle[{rid}]"))
                if ops is not None
                else None
            ),
            quarantined=quarantined is not None,
        )

    def runtime(self, runtime_id: str) -> RuntimeDetail:
        """One runtime (see :class:`RuntimeDetail`).

        Raises:
            NotFound: nothing is stored for ``runtime_id``.
            ReadFailed: a stored record does not decode.
        """
        rid = runtime_id
        Out = CompactionProjectionOutboxRow
        with self._read() as conn:
            summary = self._runtime_summary(conn, rid)
            lifecycle = conn.execute(
                select(RuntimeStateRow.runtime_state_json).where(RuntimeStateRow.runtime_id == rid)
            ).scalar()
            snapshot = conn.execute(
                select(SessionSnapshotRow.session_snapshot).where(
                    SessionSnapshotRow.runtime_id == rid
                )
            ).scalar()
            inputs = (
                conn.execute(
                    select(InputStateRow.input_id)
                    .where(InputStateRow.runtime_id == rid)
                    .order_by(InputStateRow.input_id)
                )
                .scalars()
                .all()
            )
            projections = conn.execute(
                select(Out.session_id, Out.parent_revision, Out.revision, Out.commit_fingerprint)
                .where(Out.runtime_id == rid, Out.state == "pending")
                .order_by(Out.session_id, Out.parent_revision, Out.revision, Out.commit_fingerprint)
            ).all()
            retired = (
                conn.execute(
                    select(RetiredOpsEpochRow.epoch_id)
                    .where(RetiredOpsEpochRow.runtime_id == rid)
                    .order_by(RetiredOpsEpochRow.epoch_id)
                )
                .scalars()
                .all()
            )
        if (
            lifecycle is None
            and snapshot is None
            and summary.ops_epoch is None
            and not inputs
            and not projections
            and not retired
            and summary.pending_outbox == 0
        ):
            raise NotFound("runtime", runtime_id)
        d = self._domain
        binding = None
        if lifecycle is not None:
            record = d.decode_lifecycle(payload_bytes(lifecycle, f"runtime_states[{rid}]"))
            binding = record.binding.model_dump(mode="json")
        session_id = None
        if snapshot is not None:
            session_id = d.session_id(
                d.decode_persisted_session(payload_bytes(snapshot, f"snapshot[{rid}]"))
            )
        return RuntimeDetail(
            summary=summary,
            snapshot_session_id=session_id,
            binding=binding,
            input_ids=tuple(str(i) for i in inputs),
            pending_projections=tuple(
                {
                    "session_id": s,
                    "parent_revision": p,
                    "revision": r,
                    "commit_fingerprint": f,
                }
                for s, p, r, f in projections
            ),
            retired_epochs=tuple(str(e) for e in retired),
        )


def _missing_table(exc: BaseException) -> str | None:
    """The driver's message when it says a table does not exist (SQLite; Postgres 42P01)."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "sqlstate", None) == "42P01" or str(seen).startswith("no such table"):
            return str(seen).splitlines()[0]
        seen = seen.__cause__ or getattr(seen, "orig", None)
    return None


def _revision(session: Any) -> str | None:
    revision = getattr(session, "revision", None)
    return None if revision is None else str(revision)


def _active_path(nodes: Sequence[Any], leaf: str | None) -> tuple[list[str], dict[str, int]]:
    """Root-to-leaf node ids and, per path node, its children off the path."""
    parent = {str(n): p for n, p in nodes}
    path: list[str] = []
    seen: set[str] = set()
    current = leaf
    while current is not None and current in parent and current not in seen:
        seen.add(current)
        path.append(current)
        current = parent[current]
    path.reverse()
    on_path = set(path)
    branches: dict[str, int] = {}
    for node, p in parent.items():
        if p is not None and p in on_path and node not in on_path:
            branches[p] = branches.get(p, 0) + 1
    return path, branches


# --------------------------------------------------------------------------
# Graph exports


def _quote_id(node_id: str) -> str:
    return node_id.replace("\\", "\\\\").replace('"', '\\"')


def graph_dot(detail: SessionDetail) -> str:
    """The session's live graph in Graphviz DOT; the active path drawn bold."""
    lines = [f'digraph "{_quote_id(detail.session_id)}" {{', "  rankdir=TB;"]
    for n in detail.nodes:
        style = ' [style=bold, color="blue"]' if n.active else ""
        lines.append(f'  "{_quote_id(n.node_id)}"{style};')
    for n in detail.nodes:
        if n.parent_node_id is not None:
            style = ' [style=bold, color="blue"]' if n.active else ""
            lines.append(f'  "{_quote_id(n.parent_node_id)}" -> "{_quote_id(n.node_id)}"{style};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_mermaid(detail: SessionDetail) -> str:
    """The session's live graph as a Mermaid flowchart; the active path in class ``active``."""
    index = {n.node_id: f"n{i}" for i, n in enumerate(detail.nodes)}
    lines = ["flowchart TD"]
    for n in detail.nodes:
        label = n.node_id.replace('"', "#quot;")
        lines.append(f'  {index[n.node_id]}["{label}"]')
    for n in detail.nodes:
        if n.parent_node_id is not None and n.parent_node_id in index:
            lines.append(f"  {index[n.parent_node_id]} --> {index[n.node_id]}")
    active = [index[n.node_id] for n in detail.nodes if n.active]
    if active:
        lines.append("  classDef active stroke-width:3px,stroke:#1f6feb")
        lines.append(f"  class {','.join(active)} active")
    return "\n".join(lines) + "\n"
