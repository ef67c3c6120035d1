"""Checkpoint nodes: opaque checkpoint bodies on the session graph, and their pending writes.

A *checkpoint node* is a row of ``graph_nodes`` whose body is stored as opaque
bytes in a content-addressed blob (``blobs.kind = 'opaque'``, ``hash`` = the
sha256 of the bytes, stored uncompressed) named by the node's ``blob_ref``;
``node_json`` holds the caller's JSON (for the LangGraph saver: the
serializer's type tag and the checkpoint metadata), ``parent_node_id`` the
checkpoint it follows and ``run_id`` the run that wrote it. A node's
``blob_ref`` is a blob-GC root while the node row exists
(docs/sessions.md#blob-gc). *Pending writes* (``session_pending_writes``) are
recorded against a node per ``(task_id, write_idx)``
(docs/sessions.md#checkpoint-nodes).

Fences. Every write takes the ``session:<id>`` lock (and a node put the
blob-GC lock shared: a GC never sweeps a deduplicated blob between the put's
insert and its node; both no-ops on SQLite, whose ``BEGIN IMMEDIATE``
serialises writers), then
LEASE_GUARD (:func:`~agentkeep.sessions.leases.guard_session_write`) on the
``lease_session_id`` it is given (default: the session itself): without a
fence the write is refused with :class:`~agentkeep.errors.SessionLeaseHeld`
while another owner holds a live lease; with a fence it must be the live
lease (:class:`~agentkeep.errors.SessionExecutionLeaseExpired` otherwise) and
is renewed when half its TTL is gone. A refused write leaves nothing: in a
unit that may hold other work or a caller that catches (``store.write()``,
``call_write``) the checks run before anything is written; in a one-call
unit on psycopg the writes go out in the round trip of the lock and the lease
read, after them, and a refusal rolls that unit (this operation alone) back;
the commit goes in that round trip too once the server found the lease free
(no fence) or the fence's live lease with no renewal due
(``CheckpointNodeRepository._guarded``). On SQLite the
guard is folded into the write itself (``INSERT … SELECT … WHERE`` the lease
passes: free, or the fence's live lease with no renewal due), under the
unit's ``BEGIN IMMEDIATE``; a write that wrote nothing (or one of more than
:data:`_SQLITE_ROWS` pending writes) runs the unfolded guard, which raises
with nothing written, or renews and writes (``_put_sqlite``,
``_writes_sqlite``).

Idempotency. Putting a node again under the same id replaces its parent,
JSON, blob and run (the last put wins, as LangGraph's savers do); a pending
write with ``write_idx >= 0`` is stored once (a repeat of the same
``(task, idx)`` is ignored), one with a negative index (LangGraph's special
channels: errors, interrupts, resumes) is replaced.

Cost of a put on SQLite: ``BEGIN IMMEDIATE``, the guarded node upsert, the
blob insert (``ON CONFLICT DO NOTHING``), ``COMMIT``; a pending-write put:
``BEGIN IMMEDIATE``, one guarded insert of all its writes, ``COMMIT``, or
that insert alone in a one-call unit that opened no transaction
(``Store._call_operation(begin=False)``: the LangGraph saver outside
``owning``). On Postgres a put is the guard's lease read and one node upsert
(the blob insert a data-modifying CTE of it); a pending-write put the lease
read, the writes of ``idx >= 0`` in one multi-row insert (per 8), each
negative index its own upsert. Nothing written is read back. A one-call put on
psycopg is one round trip of two statements, the pipeline's implicit
transaction (docs/architecture.md#one-round-trip-commit): the locks, then
the lease read as a *checking read* (:data:`_FREE_LEASE_READ` without a
fence, which refuses unless the lease is free; :data:`_FENCED_LEASE_READ`
with one, which refuses unless the fence's lease is live with no renewal
due) with the write folded in as its data-modifying CTEs (:data:`_FOLDED`;
a put_writes of several statements sends them after the read). A lease the
check refuses takes that round trip and two more: ``BEGIN``, the locks, the
lease read and the writes (the guard judges the lease: it renews it, or
raises), then ``COMMIT``. On asyncpg, which does not pipeline, a one-call put
of one statement is ``BEGIN`` with the locks, that same folded statement
(``now`` sampled once the locks are held), then ``COMMIT``: three round trips
(``CheckpointNodeRepository._checked_after_lock``); a refused check rolls the
unit back and takes the usual four.

Corrupt data fails loudly: a node whose blob is missing, stored with a
compression other than ``none``, or whose bytes do not match its hash, is
:class:`~agentkeep.errors.SessionCorrupt`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    Integer,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
    literal_column,
    or_,
    select,
)
from sqlalchemy import bindparam as p
from sqlalchemy.orm import aliased
from sqlalchemy.sql import Select

from agentkeep.clock import Clock
from agentkeep.db import Answered, Driver, PrefetchCheckFailed
from agentkeep.errors import (
    InvalidInput,
    ReadOnlyUnitOfWork,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    SessionLeaseHeld,
)
from agentkeep.sessions.checkpoints import _PUT as _PUT_BLOB
from agentkeep.sessions.domain import (
    MAX_I64,
    LeaseFence,
    check_fence,
    check_id,
    saturating_add,
)
from agentkeep.sessions.leases import begin_session_write, guard_session_write, lease_read
from agentkeep.sessions.maintenance import _batches, _in_list, _in_params
from agentkeep.sessions.models import BlobRow, GraphNodeRow, PendingWriteRow, SessionLeaseRow
from agentkeep.statements import Statement, upsert

__all__ = [
    "KIND_OPAQUE",
    "LEASE_REFUSALS",
    "CheckpointNode",
    "CheckpointNodeRepository",
    "PendingWrite",
    "StoredWrite",
    "check_text_id",
]

#: The lease guard's refusals: answers of a second run of a write that do not settle
#: a first run whose COMMIT answer was lost (that run passed the guard and may have
#: committed before the lease changed hands or expired).
LEASE_REFUSALS: Final = (SessionLeaseHeld, SessionExecutionLeaseExpired)

#: ``blobs.kind`` of an opaque body (never decoded by agentkeep).
KIND_OPAQUE: Final = "opaque"

_N = GraphNodeRow
_L = SessionLeaseRow
_W = PendingWriteRow
_LIVE = _N.tombstoned == p("live")


def _put_node(dialect: Any) -> Any:
    stmt = upsert(dialect, _N).values(
        session_id=p("sid"),
        node_id=p("nid"),
        parent_node_id=p("parent"),
        node_json=p("json"),
        tombstoned=p("live"),
        blob_ref=p("ref"),
        run_id=p("run"),
    )
    taken = ("parent_node_id", "node_json", "tombstoned", "blob_ref", "run_id")
    return stmt.on_conflict_do_update(
        index_elements=[_N.session_id, _N.node_id],
        set_={key: stmt.excluded[key] for key in taken},
    )


_PUT_NODE: Final = Statement(_put_node, name="checkpoint_nodes.put_node")


def _put_node_and_blob(dialect: Any) -> Any:
    """The node upsert; on Postgres with the blob insert as a data-modifying CTE.

    One round trip for both rows on Postgres. SQLite has no such CTE: there it
    is the node upsert alone, and ``put_checkpoint_node`` inserts the blob
    first with its own statement.
    """
    node = _put_node(dialect)
    if dialect.name != "postgresql":
        return node
    blob = (
        upsert(dialect, BlobRow)
        .values(hash=p("ref"), kind=p("kind"), compression=p("compression"), content=p("content"))
        .on_conflict_do_nothing(index_elements=[BlobRow.hash])
        .cte("put_blob")
    )
    return node.add_cte(blob)


_PUT_NODE_AND_BLOB: Final = Statement(_put_node_and_blob, name="checkpoint_nodes.put_node_and_blob")

#: The columns a :class:`CheckpointNode` is decoded from, in its order.
_NODE_COLUMNS: Final = (
    _N.node_id,
    _N.parent_node_id,
    _N.node_json,
    _N.run_id,
    _N.blob_ref,
    BlobRow.compression,
    BlobRow.content,
)
_NODES = select(*_NODE_COLUMNS).outerjoin(BlobRow, BlobRow.hash == _N.blob_ref)
_GET: Final = Statement(
    _NODES.where(_N.session_id == p("sid"), _N.node_id == p("nid"), _LIVE),
    name="checkpoint_nodes.get",
)
_LATEST: Final = Statement(
    _NODES.where(_N.session_id == p("sid"), _N.blob_ref.is_not(None), _LIVE)
    .order_by(_N.node_id.desc())
    .limit(1),
    name="checkpoint_nodes.latest",
)
_OF_SESSION = (_N.session_id == p("sid"), _N.blob_ref.is_not(None), _LIVE)
_LIST: Final = Statement(
    _NODES.where(*_OF_SESSION).order_by(_N.node_id.desc()).limit(p("limit")),
    name="checkpoint_nodes.list",
)
_LIST_BEFORE: Final = Statement(
    _NODES.where(*_OF_SESSION, _N.node_id < p("before"))
    .order_by(_N.node_id.desc())
    .limit(p("limit")),
    name="checkpoint_nodes.list_before",
)
_ALL_IDS: Final = Statement(
    select(_N.node_id)
    .where(_N.session_id == p("sid"), _N.blob_ref.is_not(None))
    .order_by(_N.node_id.desc()),
    name="checkpoint_nodes.all_ids",
)

_WRITE_COLUMNS: Final = (
    _W.node_id,
    _W.task_id,
    _W.write_idx,
    _W.channel,
    _W.value_type,
    _W.value,
    _W.task_path,
)
_WRITES_OF: Final = Statement(
    select(*_WRITE_COLUMNS)
    .where(_W.session_id == p("sid"), _W.node_id.in_(_in_list()))
    .order_by(_W.node_id, _W.task_path, _W.task_id, _W.write_idx),
    name="checkpoint_nodes.writes_of",
)
_WRITES_OF_ONE: Final = Statement(
    select(*_WRITE_COLUMNS)
    .where(_W.session_id == p("sid"), _W.node_id == p("nid"))
    .order_by(_W.task_path, _W.task_id, _W.write_idx),
    name="checkpoint_nodes.writes_of_one",
)
_ALL_WRITES: Final = Statement(
    select(*_WRITE_COLUMNS).where(_W.session_id == p("sid")).order_by(_W.node_id),
    name="checkpoint_nodes.all_writes",
)


def _put_write(dialect: Any, *, replace: bool) -> Any:
    stmt = upsert(dialect, _W).values(
        session_id=p("sid"),
        node_id=p("nid"),
        task_id=p("task"),
        write_idx=p("idx"),
        channel=p("channel"),
        value_type=p("type"),
        value=p("value"),
        task_path=p("path"),
    )
    keys = [_W.session_id, _W.node_id, _W.task_id, _W.write_idx]
    if not replace:
        return stmt.on_conflict_do_nothing(index_elements=keys)
    taken = ("channel", "value_type", "value", "task_path")
    return stmt.on_conflict_do_update(
        index_elements=keys, set_={key: stmt.excluded[key] for key in taken}
    )


_ADD_WRITE: Final = Statement(
    lambda d: _put_write(d, replace=False), name="checkpoint_nodes.add_write"
)

#: Pending writes inserted by one statement at most (Postgres; more go in several).
_ROWS_PER_INSERT: Final = 8


def _add_writes(dialect: Any, count: int) -> Any:
    """The insert of ``count`` pending writes of one task (``ON CONFLICT DO NOTHING``).

    One statement for all of them (on psycopg each pipelined statement costs
    client CPU): the shared ``sid``, ``nid``, ``task`` and ``path`` once,
    ``idx<i>``, ``channel<i>``, ``type<i>``, ``value<i>`` per row. A key
    repeated within the statement keeps its first row, as when the rows are
    inserted one by one.
    """
    rows: list[dict[str, Any]] = [
        {
            "session_id": p("sid"),
            "node_id": p("nid"),
            "task_id": p("task"),
            "write_idx": p(f"idx{i}"),
            "channel": p(f"channel{i}"),
            "value_type": p(f"type{i}"),
            "value": p(f"value{i}"),
            "task_path": p("path"),
        }
        for i in range(count)
    ]
    keys = [_W.session_id, _W.node_id, _W.task_id, _W.write_idx]
    return upsert(dialect, _W).values(rows).on_conflict_do_nothing(index_elements=keys)


#: ``_ADD_WRITES[n]``: the insert of ``n`` rows (2..``_ROWS_PER_INSERT``).
_ADD_WRITES: Final = {
    n: Statement(functools.partial(_add_writes, count=n), name=f"checkpoint_nodes.add_writes_{n}")
    for n in range(2, _ROWS_PER_INSERT + 1)
}


def _write_rows_params(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parameters of a multi-row insert of ``rows`` (of one task): the shared
    ``sid``, ``nid``, ``task`` and ``path`` (of the first row), then ``idx<i>``,
    ``channel<i>``, ``type<i>``, ``value<i>`` per row (:func:`_add_writes`,
    :func:`_sqlite_add_writes`)."""
    first = rows[0]
    params: dict[str, Any] = {
        "sid": first["sid"],
        "nid": first["nid"],
        "task": first["task"],
        "path": first["path"],
    }
    for i, row in enumerate(rows):
        idx, channel, type_, value = _ROW_NAMES[i] if i < len(_ROW_NAMES) else _row_names(i)
        params[idx] = row["idx"]
        params[channel] = row["channel"]
        params[type_] = row["type"]
        params[value] = row["value"]
    return params


def _row_names(i: int) -> tuple[str, str, str, str]:
    """The parameter names of row ``i`` of a multi-row insert (:func:`_write_rows_params`)."""
    return f"idx{i}", f"channel{i}", f"type{i}", f"value{i}"


#: :func:`_row_names` of the rows one insert takes at most (built once, not per put).
_ROW_NAMES: Final = tuple(_row_names(i) for i in range(32))


#: A pending write as checked by ``put_pending_writes``: index, channel, type tag, bytes.
_Row = tuple[int, str, str, bytes]


def _rows_params(shared: Mapping[str, Any], rows: Sequence[_Row]) -> dict[str, Any]:
    """The parameters of a multi-row insert of ``rows`` (of one task): ``shared``
    (``sid``, ``nid``, ``task``, ``path``), then ``idx<i>``, ``channel<i>``,
    ``type<i>``, ``value<i>`` per row (:func:`_add_writes`, :func:`_sqlite_add_writes`;
    :func:`_write_rows_params` from rows as mappings)."""
    params = dict(shared)
    names = _ROW_NAMES
    for i, (idx, channel, type_, value) in enumerate(rows):
        n_idx, n_channel, n_type, n_value = names[i] if i < len(names) else _row_names(i)
        params[n_idx] = idx
        params[n_channel] = channel
        params[n_type] = type_
        params[n_value] = value
    return params


def _row_params(shared: Mapping[str, Any], row: _Row) -> dict[str, Any]:
    """The parameters of :data:`_ADD_WRITE` / :data:`_REPLACE_WRITE` for one row."""
    idx, channel, type_, value = row
    return {**shared, "idx": idx, "channel": channel, "type": type_, "value": value}


def _add_write_statements(
    shared: Mapping[str, Any], rows: Sequence[_Row]
) -> list[tuple[Statement, Mapping[str, Any]]]:
    """``rows`` (of one task) as multi-row inserts of at most ``_ROWS_PER_INSERT``."""
    out: list[tuple[Statement, Mapping[str, Any]]] = []
    for start in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[start : start + _ROWS_PER_INSERT]
        if len(chunk) == 1:
            out.append((_ADD_WRITE, _row_params(shared, chunk[0])))
            continue
        out.append((_ADD_WRITES[len(chunk)], _rows_params(shared, chunk)))
    return out


_REPLACE_WRITE: Final = Statement(
    lambda d: _put_write(d, replace=True), name="checkpoint_nodes.replace_write"
)

_RUN_NODES = aliased(GraphNodeRow)
_DELETE_RUN_WRITES: Final = Statement(
    delete(_W).where(
        exists().where(
            _RUN_NODES.session_id == _W.session_id,
            _RUN_NODES.node_id == _W.node_id,
            _RUN_NODES.run_id.in_(_in_list()),
        )
    ),
    name="checkpoint_nodes.delete_run_writes",
)
_DELETE_RUN_NODES: Final = Statement(
    delete(_N).where(_N.run_id.in_(_in_list())), name="checkpoint_nodes.delete_run_nodes"
)
_DELETE_NODES: Final = Statement(
    delete(_N).where(_N.session_id == p("sid"), _N.node_id.in_(_in_list())),
    name="checkpoint_nodes.delete_nodes",
)
_DELETE_NODE_WRITES: Final = Statement(
    delete(_W).where(_W.session_id == p("sid"), _W.node_id.in_(_in_list())),
    name="checkpoint_nodes.delete_node_writes",
)


#: The checking reads' refusal (``division_by_zero``) unless the transaction is READ
#: COMMITTED: a condition on no row, which the planner makes a one-time filter,
#: evaluated once before any row is read (also when there is none). The one
#: round trip may run as the pipeline's implicit transaction (``implicit`` of
#: :meth:`~agentkeep.db.Driver.prefetching`), at the session's default
#: isolation: only under READ COMMITTED does each statement, the checking read
#: included, read a snapshot taken after the lock before it was granted.
_READ_COMMITTED: Final = (
    cast(
        literal(1)
        / case(
            (
                func.current_setting(literal_column("'transaction_isolation'"))
                == literal_column("'read committed'"),
                1,
            ),
            else_=0,
        ),
        Integer,
    )
    == 1
)


def _free_lease_read(dialect: Any) -> Any:
    """The guard's lease read (:func:`~agentkeep.sessions.leases.lease_read`) of the
    lease of ``lsid`` that refuses unless the lease is *free*: no row, or a row never
    claimed or released (no token, no owner, a generation >= 0).

    Its rows are the lease read's. A row that is not free makes it fail with
    ``division_by_zero`` (:data:`agentkeep.db.CHECK_FAILED_SQLSTATE`): the
    divisor depends on the row, so the planner cannot fold it, and the first
    branch keeps a scan that looks at other sessions' rows from refusing.
    LEASE_GUARD without a fence lets every free row pass (its owner decodes
    as none, and a row without a token is not live): a write that passed
    this read passes the guard, judged on the same row.
    """
    free = (
        (_L.lease_token.is_(None)) & (_L.lease_owner_id.is_(None)) & (_L.lease_fencing_token >= 0)
    )
    divisor = case((_L.session_id != p("lsid"), 1), (free, 1), else_=0)
    return (
        select(*_lease_columns(dialect))
        .where(_READ_COMMITTED)
        .where(_L.session_id == p("lsid"))
        .where(cast(literal(1) / divisor, Integer) == 1)
    )


def _fenced_lease_read(dialect: Any) -> Any:
    """The guard's lease read of the lease of ``lsid`` that refuses unless the caller's
    fence passes LEASE_GUARD on it with nothing to renew.

    Passes (one row: the lease read's) only when the row exists, its owner
    (``owner``; the incarnation ``inc``, a NULL stored incarnation read as
    the owner id, as :func:`~agentkeep.sessions.codec.decode_owner` does),
    ``token`` and generation (``fencing``) are the fence's, and it expires at
    or after ``min_expires``: the caller sends ``now + max(1, renew_ms // 2)``
    (``now + 1`` without ``renew_ms``), so the lease is live at ``now``
    (FENCE_OK: ``expires > now``) and no renewal is due (``expires - now >=
    renew_ms // 2``). Any other row, or none (the outer join from one row
    keeps a missing lease as a row of NULLs), fails with ``division_by_zero``
    (:data:`agentkeep.db.CHECK_FAILED_SQLSTATE`). The guard then judges the
    same row at the same ``now`` (``CheckpointNodeRepository._guarded``) and
    passes without a write: a fenced put that passed this read is committed
    in its round trip, and every other outcome (renewal due, fence lost,
    expired, no row) goes the two-round-trip way, where the guard renews the
    lease or raises its typed error.
    """
    fenced = (
        (_L.lease_owner_id == p("owner"))
        & (func.coalesce(_L.lease_owner_incarnation_id, _L.lease_owner_id) == p("inc"))
        & (_L.lease_token == p("token"))
        & (_L.lease_fencing_token == p("fencing"))
        & (_L.lease_expires_at_ms >= p("min_expires"))
    )
    divisor = case((fenced, 1), else_=0)
    one = select(literal(1).label("one")).subquery("one_row")
    return (
        select(*_lease_columns(dialect))
        .select_from(one.outerjoin(_L, _L.session_id == p("lsid")))
        .where(_READ_COMMITTED)
        .where(cast(literal(1) / divisor, Integer) == 1)
    )


def _lease_columns(dialect: Any) -> tuple[Any, ...]:
    """The columns of the guard's lease read, in its order (``leases.lease_read``)."""
    read = lease_read("")[0].construct(dialect)
    assert isinstance(read, Select)
    return tuple(read.selected_columns)


_FREE_LEASE_READ: Final = Statement(_free_lease_read, name="checkpoint_nodes.free_lease_read")
_FENCED_LEASE_READ: Final = Statement(_fenced_lease_read, name="checkpoint_nodes.fenced_lease_read")


def _lease_check(
    lease_sid: str, fence: LeaseFence | None, renew_ms: int | None, now: int | None
) -> tuple[Statement | None, dict[str, Any]]:
    """The checking lease read of a put and its parameters (``_guarded``).

    Without a fence :data:`_FREE_LEASE_READ`; with one
    :data:`_FENCED_LEASE_READ`, which passes the fence's lease when it
    expires at or after ``now + max(1, renew_ms // 2)`` (live at ``now`` with
    no renewal due). None for a fence that no lease row could pass (another
    session's, or a bound past ``2**63-1``): the guard refuses it.
    """
    if fence is None:
        return _FREE_LEASE_READ, {"lsid": lease_sid}
    assert now is not None
    floor = now + max(1, (renew_ms or 0) // 2)
    params = {
        "lsid": lease_sid,
        "owner": fence.owner.owner_id,
        "inc": fence.owner.incarnation_id,
        "token": fence.lease_token,
        "fencing": fence.fencing_token,
        "min_expires": floor,
    }
    if fence.session_id != lease_sid or not 0 <= floor <= MAX_I64:
        return None, params
    return _FENCED_LEASE_READ, params


def _put_blob(dialect: Any) -> Any:
    return (
        upsert(dialect, BlobRow)
        .values(hash=p("ref"), kind=p("kind"), compression=p("compression"), content=p("content"))
        .on_conflict_do_nothing(index_elements=[BlobRow.hash])
    )


#: The inserts a write statement of ``_guarded`` is made of (Postgres), for
#: :func:`_checked_writes`: each a data-modifying CTE of the checking read.
_WRITE_PARTS: Final[dict[Statement, tuple[Any, ...]]] = {
    _PUT_NODE_AND_BLOB: (_put_blob, _put_node),
    _ADD_WRITE: (lambda d: _put_write(d, replace=False),),
    _REPLACE_WRITE: (lambda d: _put_write(d, replace=True),),
    **{stmt: (functools.partial(_add_writes, count=n),) for n, stmt in _ADD_WRITES.items()},
}


def _checked_writes(check: Any, parts: tuple[Any, ...], dialect: Any) -> Any:
    """The checking read ``check`` with ``parts`` (inserts) as its data-modifying CTEs.

    One statement: the writes and the read share its snapshot, taken after
    the lock statement before it was granted; when the read refuses
    (``division_by_zero``) the statement fails and none of its writes is
    kept. The read's parameters (``lsid``, the fence's) do not clash with
    the writes' (``sid``, ``nid``, ...).
    """
    read = check(dialect)
    for i, part in enumerate(parts):
        read = read.add_cte(part(dialect).cte(f"w{i}"))
    return read


_FOLDED: Final[dict[tuple[Statement, Statement], Statement]] = {
    (check, write): Statement(
        functools.partial(_checked_writes, check.construct, parts),
        name=f"{check.name}+{write.name}",
    )
    for check in (_FREE_LEASE_READ, _FENCED_LEASE_READ)
    for write, parts in _WRITE_PARTS.items()
}


# ---------------------------------------------------------------- SQLite: LEASE_GUARD folded
#
# On SQLite each statement costs the saver's thread a GIL hand-off (sqlite3
# releases the GIL around every step), which inside a running graph costs far
# more than the SQL: a put there folds LEASE_GUARD into its write, so the
# lease read is no statement of its own. The write is an ``INSERT … SELECT …
# WHERE <the lease passes>``: under the unit's ``BEGIN IMMEDIATE`` (every
# session writer serialised) it writes its rows when the lease passes, and
# nothing when it does not; then the repository runs the unfolded guard
# (``leases.guard_session_write``), which raises the guard's typed error, or
# renews the lease, and writes (``_put_sqlite`` / ``_writes_sqlite``).


def _integer(dialect: Any, column: Any) -> Any:
    """``column`` holds an integer (SQLite's ``typeof``; Postgres' column type says so).

    (These statements run on SQLite; Postgres only compiles them.)
    """
    if dialect.name == "sqlite":
        return func.typeof(column) == "integer"
    return literal(True)


def _sqlite_lease_passes(dialect: Any, *, fenced: bool) -> Any:
    """The folded LEASE_GUARD on the lease row of ``:lsid`` (SQLite).

    Without a fence (``fenced`` False): no row, or a row that is not live
    (no token, or ``expires <= :now``) and whose generation is a
    non-negative integer (the guard reads any other as SessionCorrupt). With
    a fence: FENCE_OK (the row's owner, incarnation, a NULL one read as the
    owner, token and generation are the fence's: ``:owner``, ``:inc``,
    ``:token``, ``:fencing``) with the expiry after ``:after``, which the
    caller sets so that the lease is live and needs no renewal (see
    :func:`_sqlite_guard_params`). Anything else does not pass: the unfolded
    guard judges it.
    """
    if not fenced:
        return ~exists().where(
            _L.session_id == p("lsid"),
            or_(
                (_L.lease_token.is_not(None)) & (_L.lease_expires_at_ms > p("now")),
                _L.lease_fencing_token < 0,
                _integer(dialect, _L.lease_fencing_token).is_(False),
            ),
        )
    return exists().where(
        _L.session_id == p("lsid"),
        _L.lease_owner_id == p("owner"),
        func.coalesce(_L.lease_owner_incarnation_id, _L.lease_owner_id) == p("inc"),
        _L.lease_token == p("token"),
        _L.lease_fencing_token == p("fencing"),
        _integer(dialect, _L.lease_fencing_token),
        _L.lease_expires_at_ms > p("after"),
    )


def _sqlite_guard_params(
    lease_sid: str, fence: LeaseFence | None, now: int, renew_ms: int | None
) -> dict[str, Any] | None:
    """The parameters of :func:`_sqlite_lease_passes` at ``now``; None when a fence names
    another session than ``lease_sid`` (the unfolded guard refuses it).

    ``:after`` is ``now`` plus, with ``renew_ms``, half of it less 1: the
    guard renews a lease with ``expires - now < renew_ms // 2`` left, so
    ``expires > :after`` is "live, and no renewal due".
    """
    if fence is None:
        return {"lsid": lease_sid, "now": now}
    if fence.session_id != lease_sid:
        return None
    after = now if renew_ms is None else saturating_add(now, max(renew_ms // 2 - 1, 0))
    return {
        "lsid": lease_sid,
        "owner": fence.owner.owner_id,
        "inc": fence.owner.incarnation_id,
        "token": fence.lease_token,
        "fencing": fence.fencing_token,
        "after": after,
    }


def _sqlite_put_node(dialect: Any, fenced: bool) -> Any:
    """The node upsert of a put as ``INSERT … SELECT … WHERE`` the folded guard passes."""
    names: tuple[str, ...] = ("session_id", "node_id", "parent_node_id", "node_json")
    names += ("tombstoned", "blob_ref", "run_id")
    row: Any = select(p("sid"), p("nid"), p("parent"), p("json"), p("live"), p("ref"), p("run"))
    passes = _sqlite_lease_passes(dialect, fenced=fenced)
    stmt = upsert(dialect, _N).from_select(names, row.where(passes))
    return stmt.on_conflict_do_update(
        index_elements=[_N.session_id, _N.node_id],
        set_={key: stmt.excluded[key] for key in names[2:]},
    )


#: ``_SQLITE_PUT_NODE[fenced]``: the guarded node upsert.
_SQLITE_PUT_NODE: Final = {
    fenced: Statement(
        functools.partial(_sqlite_put_node, fenced=fenced),
        name=f"checkpoint_nodes.sqlite_put_node_{fenced}",
    )
    for fenced in (False, True)
}

#: Pending writes one guarded SQLite insert takes at most (more: the unfolded path).
_SQLITE_ROWS: Final = 16


def _sqlite_add_writes(dialect: Any, count: int, fenced: bool) -> Any:
    """The guarded insert of ``count`` pending writes of one task (SQLite).

    One ``SELECT … WHERE <guard>`` per row (``UNION ALL``): ``sid``, ``nid``,
    ``task`` and ``path`` shared, ``idx<i>``, ``channel<i>``, ``type<i>``,
    ``value<i>`` per row. A conflict on ``(task, idx)`` keeps the stored row
    for ``idx >= 0`` and replaces it for a negative ``idx`` (the ``DO UPDATE
    … WHERE``), row by row in order, as :data:`_ADD_WRITE` and
    :data:`_REPLACE_WRITE` one row at a time.
    """
    names: tuple[str, ...] = ("session_id", "node_id", "task_id", "write_idx", "channel")
    names += ("value_type", "value", "task_path")
    passes = _sqlite_lease_passes(dialect, fenced=fenced)
    rows: list[Any] = [
        select(
            p("sid"),
            p("nid"),
            p("task"),
            p(f"idx{i}"),
            p(f"channel{i}"),
            p(f"type{i}"),
            p(f"value{i}"),
            p("path"),
        ).where(passes)
        for i in range(count)
    ]
    source: Any = rows[0]
    if count > 1:
        source = source.union_all(*rows[1:])
    stmt = upsert(dialect, _W).from_select(names, source)
    return stmt.on_conflict_do_update(
        index_elements=[_W.session_id, _W.node_id, _W.task_id, _W.write_idx],
        set_={key: stmt.excluded[key] for key in ("channel", "value_type", "value", "task_path")},
        where=stmt.excluded.write_idx < 0,
    )


#: ``_SQLITE_ADD_WRITES[fenced, n]``: the guarded insert of ``n`` rows (1..``_SQLITE_ROWS``).
_SQLITE_ADD_WRITES: Final = {
    (fenced, n): Statement(
        functools.partial(_sqlite_add_writes, count=n, fenced=fenced),
        name=f"checkpoint_nodes.sqlite_add_writes_{n}_{fenced}",
    )
    for fenced in (False, True)
    for n in range(1, _SQLITE_ROWS + 1)
}


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """One write to record: its index in the task, channel, serializer type tag and bytes."""

    idx: int
    channel: str
    value_type: str
    value: bytes


@dataclass(frozen=True, slots=True)
class StoredWrite:
    """A recorded pending write, as read back."""

    task_id: str
    idx: int
    channel: str
    value_type: str
    value: bytes
    task_path: str


@dataclass(frozen=True, slots=True)
class CheckpointNode:
    """A checkpoint node as read back, with its body and (when asked) its pending writes."""

    node_id: str
    parent_node_id: str | None
    node_json: str
    run_id: str | None
    body: bytes
    writes: list[StoredWrite]


def _node(session_id: str, row: Sequence[Any], writes: list[StoredWrite]) -> CheckpointNode:
    node_id, parent, node_json, run_id, ref, compression, content = row
    if content is None or ref is None:
        raise SessionCorrupt("graph_nodes", f"{session_id}/{node_id}", "blob_ref", "blob missing")
    if compression != "none":
        raise SessionCorrupt("blobs", str(ref), "compression", f"{compression!r} for a body")
    body = bytes(content)
    if hashlib.sha256(body).hexdigest() != ref:
        raise SessionCorrupt("blobs", str(ref), "content", "content does not match its hash")
    return CheckpointNode(str(node_id), parent, str(node_json), run_id, body, writes)


def _write(row: Sequence[Any]) -> StoredWrite:
    _, task_id, idx, channel, value_type, value, task_path = row
    return StoredWrite(
        str(task_id), int(idx), str(channel), str(value_type), bytes(value), str(task_path)
    )


def _check_bytes(value: object, field: str) -> bytes:
    if type(value) is bytes:
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidInput(field, f"expected bytes, got {type(value).__name__}")
    return bytes(value)


def _encodable(value: str, field: str) -> str:
    if value.isascii():  # no surrogate: nothing to encode (isascii is free in CPython)
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(field, "contains a lone surrogate (not UTF-8 text)") from None
    return value


def _check_str(value: object, field: str) -> str:
    if type(value) is str and value.isascii() and "\x00" not in value:
        return value  # the common case, without a call (ASCII: no surrogate)
    if not isinstance(value, str) or "\x00" in value:
        raise InvalidInput(field, "expected a string without NUL")
    return _encodable(value, field)


def check_text_id(value: object, field: str) -> str:
    """:func:`~agentkeep.sessions.domain.check_id` (a non-blank str, no NUL, no lone
    surrogate), with the common case (an ASCII str) checked without a call.

    Raises:
        InvalidInput: otherwise; nothing is written.
    """
    if type(value) is str and value.isascii() and not value.isspace() and "\x00" not in value:
        # check_id's rule for the common case, without a call: an ASCII str (no
        # surrogate) is blank when it is empty or all whitespace (what strip() removes)
        if value:
            return value
    return check_id(value, field)


def _check_ttl(value: object, field: str) -> int | None:
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_I64):
        raise InvalidInput(field, "expected None or an int in 1..2**63-1")
    return value


def _check_ids(values: object, field: str) -> list[str]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidInput(field, "expected a sequence of ids")
    return list(dict.fromkeys(check_text_id(v, f"{field}[{i}]") for i, v in enumerate(values)))


class CheckpointNodeRepository:
    """Checkpoint nodes and pending writes inside one unit of work (``uow.checkpoint_nodes``)."""

    def __init__(
        self, driver: Driver, clock: Clock, *, writable: bool, nested: bool = True
    ) -> None:
        self._db = driver
        self._clock = clock
        self._writable = writable
        self._nested = nested  # see db.atomic: False in a one-call unit

    def _guarded(
        self,
        session_id: str,
        lease_session_id: str | None,
        fence: LeaseFence | None,
        renew_ms: int | None,
        writes: Sequence[tuple[Statement, Mapping[str, Any]]],
        *,
        blobs: bool,
    ) -> None:
        """Lock the session (and, for a write that stores blobs, the blob-GC lock shared),
        LEASE_GUARD on the lease's session, then run ``writes`` in order.

        Round trips on psycopg (:meth:`~agentkeep.db.Driver.prefetching`): the
        lease read goes out right after the lock statement, in its round trip;
        in a one-call unit (not ``nested``) the writes go there too, after the
        read. The server runs them in that order: the lease read (its own
        statement, so in READ COMMITTED its snapshot is taken after the lock
        is granted) sees every committed lease change, and the writes run
        under the locks. The guard judges the lease when the round trip is
        back; a refused write then raises, and the one-call unit's
        transaction, which is this operation's alone, rolls back: nothing of
        it is committed. (A write that the database itself refuses, say a
        serialisation failure, is then the error even where the guard would
        have refused too; either way nothing is written.) In a nested unit
        (``store.write()``, ``call_write``), whose caller may catch the
        refusal and commit, the writes are sent only after the guard passed.
        Elsewhere (SQLite, asyncpg) every statement runs when executed, in
        the same order; on asyncpg a one-call put of one statement first
        tries :meth:`_checked_after_lock` (three round trips instead of four).

        One round trip (a one-call unit on psycopg): the lease read is sent as
        a *checking read* and ``COMMIT`` follows the writes in the same round
        trip (``prefetching(commit=True)``,
        docs/architecture.md#one-round-trip-commit). Without a fence it is
        :data:`_FREE_LEASE_READ` (the lease is free); with one,
        :data:`_FENCED_LEASE_READ` (the fence's lease, live at ``now`` with
        no renewal due, ``now`` sampled from the store's clock before the
        round trip and the guard then judging at that same ``now``). A write
        of one statement is folded into the checking read as its
        data-modifying CTEs (:data:`_FOLDED`): one statement fewer, the same
        snapshot. The server commits only when the check passes, and what
        passes it passes the guard, which then judges the same row without
        writing; any other row stops the round trip before ``COMMIT``
        (nothing written), the unit begins again
        (:meth:`~agentkeep.db.Driver.restart`) and the two round trips above
        let the guard judge it: renew the lease, or raise its typed error.
        """
        db = self._db
        lease_sid = lease_session_id or session_id
        if (
            not self._nested
            and len(writes) == 1
            and db.postgres
            and not db.pipelines
            and db.checks_one_call
            and self._checked_after_lock(session_id, lease_sid, fence, renew_ms, writes[0], blobs)
        ):
            return
        if not self._nested and writes and db.commits_ahead:
            now = None if fence is None else self._clock.now_ms()
            check, params = _lease_check(lease_sid, fence, renew_ms, now)
            if check is not None:
                run = writes
                sent: list[Any]
                folded = _FOLDED.get((check, writes[0][0])) if len(writes) == 1 else None
                if folded is not None:
                    read = Answered(*lease_read(lease_sid), folded, {**writes[0][1], **params})
                    sent, run = [read], ()
                else:
                    sent = [Answered(*lease_read(lease_sid), check, params), *writes]
                try:
                    with db.prefetching(sent, commit=True, implicit=True):
                        self._run_guarded(
                            session_id, lease_sid, fence, renew_ms, run, blobs, now=now
                        )
                    return
                except PrefetchCheckFailed:
                    db.restart()  # the check refused: the guard judges the lease (below)
        ahead = () if self._nested else writes
        with db.prefetching([lease_read(lease_sid), *ahead]):
            self._run_guarded(session_id, lease_sid, fence, renew_ms, writes, blobs)

    def _checked_after_lock(
        self,
        session_id: str,
        lease_sid: str,
        fence: LeaseFence | None,
        renew_ms: int | None,
        write: tuple[Statement, Mapping[str, Any]],
        blobs: bool,
    ) -> bool:
        """A one-call put of one statement on asyncpg: the locks, then the write folded
        into its checking lease read (:data:`_FOLDED`), then the unit's ``COMMIT``.

        Three round trips instead of four: the checking read (the lease free,
        or the fence's live with no renewal due, judged at ``now`` sampled
        after the locks) and the write are one statement. True when the put
        is done: the check passed (what passes it passes LEASE_GUARD without
        a write), or no check fits this put and the guard and the write ran
        here, under the locks. False when the check refused: nothing was
        written and the unit began again (:meth:`~agentkeep.db.Driver.restart`);
        the caller's usual path then lets the guard judge the lease (renew
        it, or raise its typed error).
        """
        db = self._db
        now = begin_session_write(db, self._clock, self._writable, session_id, blobs=blobs)
        check, params = _lease_check(lease_sid, fence, renew_ms, now)
        folded = _FOLDED.get((check, write[0])) if check is not None else None
        if folded is None:
            guard_session_write(db, lease_sid, fence, now, renew_ms)
            db.execute(*write)
            return True
        try:
            db.execute_checking(folded, {**write[1], **params})
        except PrefetchCheckFailed:
            db.restart()
            return False
        return True

    def _run_guarded(
        self,
        session_id: str,
        lease_sid: str,
        fence: LeaseFence | None,
        renew_ms: int | None,
        writes: Sequence[tuple[Statement, Mapping[str, Any]]],
        blobs: bool,
        *,
        now: int | None = None,
    ) -> None:
        """Lock, guard, write; the guard judges at ``now`` when given (the checking
        read's), else at the time sampled after the lock."""
        db = self._db
        locked = begin_session_write(db, self._clock, self._writable, session_id, blobs=blobs)
        guard_session_write(db, lease_sid, fence, locked if now is None else now, renew_ms)
        for stmt, params in writes:
            db.execute(stmt, params)

    # ---------------------------------------------------------------- SQLite

    def _in_transaction(self) -> bool:
        """False only in a one-call unit that opened no transaction
        (``Store._call_operation(begin=False)``, SQLite); every other unit has one."""
        return self._nested or bool(getattr(self._db.raw, "in_transaction", True))

    def _put_sqlite(
        self,
        session_id: str,
        lease_session_id: str | None,
        fence: LeaseFence | None,
        renew_ms: int | None,
        node: dict[str, Any],
        body: bytes,
    ) -> None:
        """A put on SQLite: the guarded node upsert (``node``: its parameters), then the
        blob of ``body``; three statements with the unit's ``BEGIN IMMEDIATE`` and
        ``COMMIT`` when the lease passes.

        Under the unit's ``BEGIN IMMEDIATE`` (no other writer, no blob GC, until
        it ends): the node upsert with LEASE_GUARD folded in
        (:data:`_SQLITE_PUT_NODE`). It writes the node when the lease passes
        (free, or without a renewal due, the fence's live lease); then the
        blob (``ON CONFLICT DO NOTHING``), in the same transaction, so a blob
        GC never sees the node without its blob. When it writes nothing, the
        unfolded guard judges the same lease row (nothing was written yet):
        it raises the typed error (SessionLeaseHeld,
        SessionExecutionLeaseExpired, SessionCorrupt) or renews the lease,
        and then the node and the blob are written. ``graph_nodes.blob_ref``
        has no foreign key: the node may go first. In a one-call unit that
        opened no transaction the put opens it (``BEGIN IMMEDIATE``) first.
        """
        db = self._db
        lease_sid = lease_session_id or session_id
        if self._writable and not self._in_transaction():
            db.begin(write=True)  # node and blob commit together, never in autocommit
        now = begin_session_write(db, self._clock, self._writable, session_id, blobs=True)
        guard = _sqlite_guard_params(lease_sid, fence, now, renew_ms)
        if (
            guard is None
            or db.execute(_SQLITE_PUT_NODE[fence is not None], {**node, **guard}).rowcount != 1
        ):
            guard_session_write(db, lease_sid, fence, now, renew_ms)
            db.execute(_PUT_NODE, node)
        blob = {"hash": node["ref"], "kind": KIND_OPAQUE, "compression": "none", "content": body}
        db.execute(_PUT_BLOB, blob)

    def _writes_sqlite(
        self,
        session_id: str,
        lease_session_id: str | None,
        fence: LeaseFence | None,
        renew_ms: int | None,
        shared: Mapping[str, Any],
        rows: Sequence[_Row],
    ) -> None:
        """Pending writes on SQLite (``rows``; ``shared``: their session, node, task and
        path parameters): one guarded insert of them all (:data:`_SQLITE_ADD_WRITES`),
        with the unit's ``BEGIN IMMEDIATE`` and ``COMMIT`` three statements; in a
        one-call unit that opened no transaction (the LangGraph saver's unfenced
        put_writes, ``Store._call_operation(begin=False)``) that insert alone, in
        autocommit: one statement is atomic, and SQLite runs it holding the
        database write lock, serialised with every other writer, so the lease
        it judges cannot change under it.

        Up to :data:`_SQLITE_ROWS` writes, the insert carries LEASE_GUARD
        folded (as :meth:`_put_sqlite`). When it writes no row (the lease did
        not pass, or every write was a repeat of an ``idx >= 0`` one, which
        is kept), or there are more writes, the unfolded guard runs and
        raises, or passes (renewing a fenced lease when due), and the rows
        are inserted as before (one ``executemany`` per kind); a repeat is
        still ignored. In autocommit that path first opens the transaction
        (``BEGIN IMMEDIATE``) and samples ``now`` again; the unit commits it.
        ``now`` of the folded insert is sampled before the statement takes
        the write lock: a wait for the lock only makes an unfenced write more
        careful (a lease still live at that ``now`` refuses it, and the
        unfolded guard judges it again); a fenced write never runs in
        autocommit.
        """
        db = self._db
        lease_sid = lease_session_id or session_id
        # A one-call unit that opened no transaction (Store._call_operation(begin=False)):
        # the folded insert is one atomic statement in autocommit; a fenced one
        # opens the transaction first (FENCE_OK judged at a now sampled under the lock).
        autocommit = self._writable and not self._in_transaction()
        if autocommit and fence is not None:
            db.begin(write=True)
            autocommit = False
        now = begin_session_write(db, self._clock, self._writable, session_id)
        if len(rows) <= _SQLITE_ROWS:
            guard = _sqlite_guard_params(lease_sid, fence, now, renew_ms)
            if guard is not None:
                params = _rows_params(shared, rows)
                params.update(guard)
                stmt = _SQLITE_ADD_WRITES[fence is not None, len(rows)]
                if db.execute(stmt, params).rowcount > 0:
                    return
        if autocommit:  # the unfolded path runs in a transaction (the unit commits it)
            db.begin(write=True)
            now = begin_session_write(db, self._clock, self._writable, session_id)
        guard_session_write(db, lease_sid, fence, now, renew_ms)
        db.executemany(_ADD_WRITE, [_row_params(shared, row) for row in rows if row[0] >= 0])
        db.executemany(_REPLACE_WRITE, [_row_params(shared, row) for row in rows if row[0] < 0])

    @staticmethod
    def _check_guard(lease_session_id: object, renew_ms: object) -> None:
        if lease_session_id is not None:
            check_text_id(lease_session_id, "lease_session_id")
        _check_ttl(renew_ms, "renew_ms")

    # ---------------------------------------------------------------- writes

    def put_checkpoint_node(
        self,
        session_id: str,
        node_id: str,
        body: bytes,
        *,
        node_json: str = "{}",
        parent_node_id: str | None = None,
        run_id: str | None = None,
        lease_session_id: str | None = None,
        fence: LeaseFence | None = None,
        renew_ms: int | None = None,
    ) -> str:
        """Store ``body`` as an opaque blob and the node naming it.

        See docs/sessions.md#put_checkpoint_node.

        Args:
            session_id: the session the node belongs to.
            node_id: the node (checkpoint) id; a second put of the same id
                replaces the node's parent, JSON, blob and run.
            body: the serialized checkpoint, stored as these bytes.
            node_json: the caller's JSON text kept with the node.
            parent_node_id: the node it follows (None for a root).
            run_id: the run that wrote it (``delete_nodes_for_runs``).
            lease_session_id: the session whose lease guards the write
                (default ``session_id``).
            fence: the caller's lease, when it holds one.
            renew_ms: with ``fence``, extend the lease to ``now + renew_ms``
                when less than half of it is left.

        Returns:
            The blob's hash.

        Raises:
            InvalidInput: a blank id, a body that is not bytes, a JSON text that
                is not a string; nothing is written.
            SessionLeaseHeld: no fence, and another owner holds the live lease.
            SessionExecutionLeaseExpired: ``fence`` is not the live lease.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_text_id(session_id, "session_id")
        check_text_id(node_id, "node_id")
        raw = _check_bytes(body, "body")
        _check_str(node_json, "node_json")
        if parent_node_id is not None:
            check_text_id(parent_node_id, "parent_node_id")
        if run_id is not None:
            check_text_id(run_id, "run_id")
        self._check_guard(lease_session_id, renew_ms)
        if fence is not None:
            fence = check_fence(fence, "fence")
        digest = hashlib.sha256(raw).hexdigest()
        node: dict[str, Any] = {
            "sid": session_id,
            "nid": node_id,
            "parent": parent_node_id,
            "json": node_json,
            "live": 0,
            "ref": digest,
            "run": run_id,
        }
        if self._db.postgres:  # the blob insert is a CTE of the node upsert
            node.update(kind=KIND_OPAQUE, compression="none", content=raw)
            writes = [(_PUT_NODE_AND_BLOB, node)]
            self._guarded(session_id, lease_session_id, fence, renew_ms, writes, blobs=True)
        else:
            self._put_sqlite(session_id, lease_session_id, fence, renew_ms, node, raw)
        return digest

    def put_pending_writes(
        self,
        session_id: str,
        node_id: str,
        task_id: str,
        writes: Sequence[PendingWrite],
        *,
        task_path: str = "",
        lease_session_id: str | None = None,
        fence: LeaseFence | None = None,
        renew_ms: int | None = None,
    ) -> None:
        """Record a task's writes against a node (docs/sessions.md#put_pending_writes).

        A write with ``idx >= 0`` is stored once per ``(node, task, idx)``: a
        repeat is ignored (the first stays). A negative ``idx`` is replaced.
        An empty ``writes`` returns at once. The node need not exist yet.

        Raises:
            InvalidInput: a blank id, a write that is not a :class:`PendingWrite`
                of an int index, string channel and type tag, and bytes; nothing
                is written.
            SessionLeaseHeld, SessionExecutionLeaseExpired, ReadOnlyUnitOfWork:
                as :meth:`put_checkpoint_node`.
        """
        check_text_id(session_id, "session_id")
        check_text_id(node_id, "node_id")
        check_text_id(task_id, "task_id")
        _check_str(task_path, "task_path")
        self._check_guard(lease_session_id, renew_ms)
        if type(writes) is not list and (  # a list without the ABC's isinstance
            isinstance(writes, str | bytes) or not isinstance(writes, Sequence)
        ):
            raise InvalidInput("writes", "expected a sequence of PendingWrite")
        rows: list[_Row] = []
        for i, w in enumerate(writes):
            if not isinstance(w, PendingWrite) or type(w.idx) is not int:
                raise InvalidInput(f"writes[{i}]", "expected a PendingWrite with an int idx")
            # _check_str and _check_bytes, their common case inline: the field
            # names are built only for a value that is not that case
            channel, type_, value = w.channel, w.value_type, w.value
            if type(channel) is not str or not channel.isascii() or "\x00" in channel:
                channel = _check_str(channel, f"writes[{i}].channel")
            if type(type_) is not str or not type_.isascii() or "\x00" in type_:
                type_ = _check_str(type_, f"writes[{i}].value_type")
            if type(value) is not bytes:
                value = _check_bytes(value, f"writes[{i}].value")
            rows.append((w.idx, channel, type_, value))
        if fence is not None:
            fence = check_fence(fence, "fence")
        if not rows:
            return
        shared = {"sid": session_id, "nid": node_id, "task": task_id, "path": task_path}
        if self._db.postgres:  # pipelined on psycopg (see _guarded)
            stmts = _add_write_statements(shared, [row for row in rows if row[0] >= 0])
            stmts += [(_REPLACE_WRITE, _row_params(shared, row)) for row in rows if row[0] < 0]
            self._guarded(session_id, lease_session_id, fence, renew_ms, stmts, blobs=False)
        else:
            self._writes_sqlite(session_id, lease_session_id, fence, renew_ms, shared, rows)

    def delete_nodes_for_runs(self, run_ids: Sequence[str]) -> int:
        """Delete every checkpoint node written by one of ``run_ids``, with its pending writes.

        Across all sessions; takes no session lock (each statement is one
        atomic delete). Their blobs are collected by the next blob GC.

        Returns:
            The number of nodes deleted.

        Raises:
            InvalidInput: ``run_ids`` is not a sequence of non-blank ids.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        ids = _check_ids(run_ids, "run_ids")
        if not self._writable:
            raise ReadOnlyUnitOfWork("session store writes need store.write(), not store.read()")
        deleted = 0
        for batch in _batches(ids):
            params = _in_params(batch)
            self._db.execute(_DELETE_RUN_WRITES, params)
            deleted += int(self._db.execute(_DELETE_RUN_NODES, params).rowcount)
        return deleted

    def prune_checkpoint_nodes(self, session_id: str, *, keep_latest: bool) -> int:
        """Delete a session's checkpoint nodes (all, or all but the latest id), with their writes.

        Returns:
            The number of nodes deleted.

        Raises:
            InvalidInput: a blank session id.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_text_id(session_id, "session_id")
        if not isinstance(keep_latest, bool):
            raise InvalidInput("keep_latest", "expected a bool")
        begin_session_write(self._db, self._clock, self._writable, session_id)
        ids = [str(n) for (n,) in self._db.execute(_ALL_IDS, {"sid": session_id}).fetchall()]
        doomed = ids[1:] if keep_latest else ids
        for batch in _batches(doomed):
            params = {"sid": session_id, **_in_params(batch)}
            self._db.execute(_DELETE_NODE_WRITES, params)
            self._db.execute(_DELETE_NODES, params)
        return len(doomed)

    def copy_checkpoint_nodes(self, source_session_id: str, target_session_id: str) -> int:
        """Copy a session's checkpoint nodes and their pending writes to another session.

        Nodes and writes the target has already (same ids) are kept as they
        are. The blobs are shared (content-addressed), not copied.

        Returns:
            The number of nodes read from the source.

        Raises:
            InvalidInput: a blank id, or the same session twice.
            ReadOnlyUnitOfWork: inside ``store.read()``.
        """
        check_text_id(source_session_id, "source_session_id")
        check_text_id(target_session_id, "target_session_id")
        if source_session_id == target_session_id:
            raise InvalidInput("target_session_id", "is the source session")
        begin_session_write(self._db, self._clock, self._writable, target_session_id, blobs=True)
        nodes = self._list(source_session_id, None, None, writes=False)
        for node in nodes:
            node_row = {
                "sid": target_session_id,
                "nid": node.node_id,
                "parent": node.parent_node_id,
                "json": node.node_json,
                "live": 0,
                "ref": hashlib.sha256(node.body).hexdigest(),
                "run": node.run_id,
            }
            self._db.execute(_PUT_NODE, node_row)
        rows = self._db.execute(_ALL_WRITES, {"sid": source_session_id}).fetchall()
        self._db.executemany(
            _ADD_WRITE,
            [
                {
                    "sid": target_session_id,
                    "nid": r[0],
                    "task": r[1],
                    "idx": r[2],
                    "channel": r[3],
                    "type": r[4],
                    "value": r[5],
                    "path": r[6],
                }
                for r in rows
            ],
        )
        return len(nodes)

    # ---------------------------------------------------------------- reads

    def get_checkpoint_node(
        self, session_id: str, node_id: str | None = None
    ) -> CheckpointNode | None:
        """A checkpoint node with its pending writes; with ``node_id`` None, the greatest id.

        Pending writes come in ``(task_path, task_id, idx)`` order. None when
        there is no such (live) node.

        Raises:
            InvalidInput: a blank id.
            SessionCorrupt: the node's blob is missing or not an opaque body.
        """
        check_text_id(session_id, "session_id")
        if node_id is None:
            row = self._db.execute(_LATEST, {"sid": session_id, "live": 0}).fetchone()
        else:
            check_text_id(node_id, "node_id")
            row = self._db.execute(_GET, {"sid": session_id, "nid": node_id, "live": 0}).fetchone()
        if row is None:
            return None
        found = self._db.execute(_WRITES_OF_ONE, {"sid": session_id, "nid": row[0]}).fetchall()
        return _node(session_id, row, [_write(w) for w in found])

    def list_checkpoint_nodes(
        self, session_id: str, *, before: str | None = None, limit: int | None = None
    ) -> list[CheckpointNode]:
        """A session's checkpoint nodes, greatest id first, each with its pending writes.

        Args:
            before: only nodes whose id sorts before it.
            limit: at most this many (None: all).

        Raises:
            InvalidInput: a blank id, a limit outside 0..2**63-1.
            SessionCorrupt: a node's blob is missing or not an opaque body.
        """
        check_text_id(session_id, "session_id")
        if before is not None:
            check_text_id(before, "before")
        if limit is not None and (type(limit) is not int or not 0 <= limit <= MAX_I64):
            raise InvalidInput("limit", "expected None or an int in 0..2**63-1")
        return self._list(session_id, before, limit, writes=True)

    def list_pending_writes(self, session_id: str, node_id: str) -> list[StoredWrite]:
        """The pending writes recorded against a node, in ``(task_path, task_id, idx)`` order.

        Raises:
            InvalidInput: a blank id.
        """
        check_text_id(session_id, "session_id")
        check_text_id(node_id, "node_id")
        rows = self._db.execute(_WRITES_OF_ONE, {"sid": session_id, "nid": node_id}).fetchall()
        return [_write(r) for r in rows]

    def _list(
        self, session_id: str, before: str | None, limit: int | None, *, writes: bool
    ) -> list[CheckpointNode]:
        params: dict[str, Any] = {
            "sid": session_id,
            "live": 0,
            "limit": limit if limit is not None else 2**62,
        }
        if before is not None:
            params["before"] = before
        rows = self._db.execute(_LIST if before is None else _LIST_BEFORE, params).fetchall()
        by_node: dict[str, list[StoredWrite]] = {str(r[0]): [] for r in rows}
        if writes and rows:
            for batch in _batches(list(by_node)):
                found = self._db.execute(_WRITES_OF, {"sid": session_id, **_in_params(batch)})
                for w in found.fetchall():
                    by_node[str(w[0])].append(_write(w))
        return [_node(session_id, r, by_node[str(r[0])]) for r in rows]
