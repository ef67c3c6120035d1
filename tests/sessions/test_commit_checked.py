"""The small fenced commit as one checking statement on Postgres (``commits._checked_turn``).

A one-call commit with ``expected_head_revision >= 1`` whose shape the
statement covers (``_CheckedTurn.of``) is sent on Postgres as the locks, then
one statement that fails with ``division_by_zero`` unless every check passes
and carries the writes as data-modifying CTEs. A refused check rolls back and
runs the full commit, which raises the typed error. Every test here runs on
both backends: SQLite always runs the full commit, so the outcomes are those
of the full commit by construction there, and the same outcomes are asserted
on Postgres, where the test also asserts which path ran.

* every refusal (an expired or taken-over lease, a stale head, a node id that
  exists, a replayed or conflicting turn stamp, a new ledger pair, a total
  that would overflow, a corrupt total or node count) gives the full
  commit's outcome, with nothing left of the refused statement;
* a value over the store's limits never reaches the statement;
* the race each check guards, with threads that have their own Store: the
  head compare-and-set (exactly one of the commits at one revision wins) and
  the lease (after a takeover exactly one of the old and the new holder
  commits at the revision);
* a fault injected into any table the statement writes (a trigger that
  raises) leaves nothing of the commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.db import Driver
from agentkeep.errors import (
    DatabaseError,
    HeadRevisionConflict,
    NodeAlreadyExists,
    PayloadTooLarge,
    RuntimeTurnCommitConflict,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    UsageLedgerOverflow,
)
from agentkeep.limits import Limits
from agentkeep.sessions.domain import LeaseOwnerIdentity, SessionExecutionLease
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UsageDelta,
)
from agentkeep.store import Store
from tests.racing import Racing, race_threads

from .support import acquire_lease
from .test_commits import snapshot

SID = "sess-checked"
A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B")
T0 = 1_700_000_000_000
TTL = 60_000
MAX_I64 = 2**63 - 1


class Paths:
    """Counts, on every Driver, the checking statements sent and the restarts after them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checked = self.restarts = 0
        execute_checking, restart = Driver.execute_checking, Driver.restart

        def counted_check(driver: Driver, *args: Any) -> Any:
            self.checked += 1
            return execute_checking(driver, *args)

        def counted_restart(driver: Driver) -> None:
            self.restarts += 1
            restart(driver)

        monkeypatch.setattr(Driver, "execute_checking", counted_check)
        monkeypatch.setattr(Driver, "restart", counted_restart)

    def ran(self) -> tuple[int, int]:
        out = (self.checked, self.restarts)
        self.checked = self.restarts = 0
        return out


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Paths:
    return Paths(monkeypatch)


def _node(node_id: str, parent: str | None = None) -> SessionNodeRecord:
    return SessionNodeRecord(node_id=node_id, parent_node_id=parent, payload={"id": node_id})


def _delta(model: str = "m0", **counts: int) -> UsageDelta:
    return UsageDelta(source="s", model=model, usage=TokenUsage(**(counts or {"input_tokens": 1})))


def _turn(fence: SessionExecutionLease, expected: int, node_id: str, **kw: Any) -> RuntimeCommit:
    kw.setdefault("usage_deltas", (_delta(),))
    kw.setdefault("checkpoint", HydratedSessionCheckpoint(turn_state={"at": expected}))
    return RuntimeCommit(
        session_id=kw.pop("session_id", SID),
        expected_head_revision=expected,
        session_execution_lease=fence,
        graph=AppendNodes(nodes=(_node(node_id),), leaf_node_id=node_id),
        **kw,
    )


def _seeded(store: Store, sid: str = SID) -> SessionExecutionLease:
    """``sid`` at revision 2 (nodes ``r0``, ``r1``; the ledger pair ``(s, m0)``), A's lease."""
    fence = acquire_lease(store, sid, A, TTL)
    for revision in range(2):
        store.commits.commit_runtime_state(_turn(fence, revision, f"r{revision}", session_id=sid))
    return fence


def _sql(store: Store, sql: str) -> None:
    with store.write() as uow:
        uow.connection.execute(text(sql))


def _expect(backend: str, paths: Paths, checked: bool, restarted: bool) -> None:
    if backend == "postgres":
        assert paths.ran() == (int(checked), int(restarted))
    else:
        assert paths.ran() == (0, 0)


# --------------------------------------------------------------------------
# The checked path and its refusals


def test_a_small_fenced_commit_is_the_checking_statement(
    store: Store, backend: str, paths: Paths
) -> None:
    fence = _seeded(store)
    paths.ran()
    stamp = TurnCommitStamp(session_id=SID, turn_id="t2", turn_commit_hash="h")
    result = store.commits.commit_runtime_state(
        _turn(fence, 2, "n2", turn_commit=stamp, release_session_execution_lease=fence)
    )
    _expect(backend, paths, checked=True, restarted=False)
    assert result.head_revision == 3
    loaded = store.commits.load_session(SID)
    assert loaded is not None and loaded.head_revision == 3
    assert [n.node_id for n in loaded.graph.nodes] == ["r0", "r1", "n2"]
    assert loaded.token_ledger[0].usage.input_tokens == 3
    assert store.leases.get_session_execution_lease(SID) is None  # released with it
    # The stamp replays the stored result (the full commit reads it: a refusal).
    again = store.commits.commit_runtime_state(_turn(fence, 2, "n2", turn_commit=stamp))
    assert again == result


def test_a_sessions_first_commit_is_the_checking_statement(
    store: Store, backend: str, paths: Paths
) -> None:
    """Expected revision 0: the statement inserts the head and the ledger totals, their
    ordinals in the order the deltas name the pairs (as the full commit numbers them)."""
    fence = acquire_lease(store, SID, A, TTL)
    paths.ran()
    deltas = (_delta("m1"), _delta("zero", input_tokens=0), _delta("m0"), _delta("m1"))
    result = store.commits.commit_runtime_state(_turn(fence, 0, "n0", usage_deltas=deltas))
    _expect(backend, paths, checked=True, restarted=False)
    assert result.head_revision == 1
    loaded = store.commits.load_session(SID)
    assert loaded is not None and loaded.head_revision == 1
    assert [n.node_id for n in loaded.graph.nodes] == ["n0"]
    assert [(e.model, e.usage.input_tokens) for e in loaded.token_ledger] == [("m1", 2), ("m0", 1)]
    # The next commit grows both totals in place.
    store.commits.commit_runtime_state(
        _turn(fence, 1, "n1", usage_deltas=(_delta("m0"), _delta("m1")))
    )
    _expect(backend, paths, checked=True, restarted=False)
    loaded = store.commits.load_session(SID)
    assert loaded is not None
    assert [(e.model, e.usage.input_tokens) for e in loaded.token_ledger] == [("m1", 3), ("m0", 2)]


def _refusals(store: Store, fence: SessionExecutionLease, clock: SettableClock) -> dict[str, Any]:
    """name -> (prepare, commit, expected error type or None for success)."""

    def corrupt_total() -> None:
        store.commits.commit_runtime_state(_turn(fence, 2, "x2", usage_deltas=(_delta("m9"),)))
        _sql(store, "UPDATE session_usage_totals SET output_tokens = -1 WHERE model = 'm9'")

    def overflow() -> None:
        store.commits.commit_runtime_state(
            _turn(fence, 2, "x2", usage_deltas=(_delta(input_tokens=MAX_I64 - 5),))
        )

    def stamped() -> None:
        stamp = TurnCommitStamp(session_id=SID, turn_id="t", turn_commit_hash="h1")
        store.commits.commit_runtime_state(_turn(fence, 2, "x2", turn_commit=stamp))

    nothing = lambda: None  # noqa: E731
    return {
        "expired": (lambda: clock.advance(TTL), _turn(fence, 2, "n"), SessionExecutionLeaseExpired),
        "stale_head": (nothing, _turn(fence, 1, "n"), HeadRevisionConflict),
        "head_exists": (nothing, _turn(fence, 0, "n"), HeadRevisionConflict),
        "node_exists": (nothing, _turn(fence, 2, "r0"), NodeAlreadyExists),
        "new_pair": (nothing, _turn(fence, 2, "n", usage_deltas=(_delta("m1"),)), None),
        "overflow": (overflow, _turn(fence, 3, "n"), None),
        "overflow_now": (
            overflow,
            _turn(fence, 3, "n", usage_deltas=(_delta(input_tokens=6),)),
            UsageLedgerOverflow,
        ),
        "corrupt_total": (corrupt_total, _turn(fence, 3, "n"), SessionCorrupt),
        "corrupt_count": (
            lambda: _sql(store, "UPDATE session_head SET graph_node_count = -1"),
            _turn(fence, 2, "n"),
            SessionCorrupt,
        ),
        "stamp_conflict": (
            stamped,
            _turn(
                fence,
                3,
                "n",
                turn_commit=TurnCommitStamp(session_id=SID, turn_id="t", turn_commit_hash="h2"),
            ),
            RuntimeTurnCommitConflict,
        ),
    }


REFUSALS = [
    "expired",
    "stale_head",
    "head_exists",
    "node_exists",
    "new_pair",
    "overflow",
    "overflow_now",
    "corrupt_total",
    "corrupt_count",
    "stamp_conflict",
]


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_check_gives_the_full_commits_outcome(
    store: Store, clock: SettableClock, backend: str, paths: Paths, case: str
) -> None:
    fence = _seeded(store)
    prepare, commit, error = _refusals(store, fence, clock)[case]
    prepare()
    paths.ran()
    before = snapshot(store)
    if error is None:  # passes the full commit only (a new pair; a total near the limit)
        result = store.commits.commit_runtime_state(commit)
        loaded = store.commits.load_session(SID)
        assert loaded is not None and loaded.head_revision == result.head_revision
        assert loaded.graph.nodes[-1].node_id == "n"
    else:
        with pytest.raises(error):
            store.commits.commit_runtime_state(commit)
        assert snapshot(store) == before
    restarted = case not in ("overflow",)
    _expect(backend, paths, checked=True, restarted=restarted)


def test_the_overflow_case_is_refused_only_by_its_own_pair(store: Store) -> None:
    """The ``overflow`` case above passes the check: the total was MAX-5, it adds 1."""
    fence = _seeded(store)
    store.commits.commit_runtime_state(
        _turn(fence, 2, "x2", usage_deltas=(_delta(input_tokens=MAX_I64 - 5),))
    )
    store.commits.commit_runtime_state(_turn(fence, 3, "n"))
    loaded = store.commits.load_session(SID)
    assert loaded is not None
    assert loaded.token_ledger[0].usage.input_tokens == MAX_I64 - 5 + 3


def test_a_value_over_the_limits_never_reaches_the_statement(
    db_url: str, backend: str, paths: Paths
) -> None:
    with Store.open(
        db_url, clock=SettableClock(T0), limits=Limits(max_payload_bytes=4000)
    ) as store:
        fence = _seeded(store)
        before = snapshot(store)
        paths.ran()
        big = SessionNodeRecord(node_id="big", payload={"x": "y" * 10_000})
        with pytest.raises(PayloadTooLarge):
            store.commits.commit_runtime_state(
                RuntimeCommit(
                    session_id=SID,
                    expected_head_revision=2,
                    session_execution_lease=fence,
                    graph=AppendNodes(nodes=(big,), leaf_node_id="big"),
                )
            )
        assert paths.ran() == (0, 0)
        assert snapshot(store) == before


# --------------------------------------------------------------------------
# Races (threads with a Store each)

ROUNDS = 12
CAS_RACERS = 4


def _cas_racer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Every racer commits at revision 2 of the round's session under the same lease."""
    out = []
    for r in range(ROUNDS):
        barrier.wait()  # the round's session is seeded
        fence = SessionExecutionLease.model_validate(p["fences"][r])
        try:
            store.commits.commit_runtime_state(_turn(fence, 2, f"n-{i}", session_id=f"{SID}-{r}"))
            out.append("won")
        except HeadRevisionConflict:
            out.append("conflict")
        barrier.wait()
    return out


def test_one_commit_at_a_revision_wins_the_race(store: Store, db_url: str) -> None:
    fences = [_seeded(store, f"{SID}-{r}").model_dump(mode="json") for r in range(ROUNDS)]
    racing = Racing(threads=CAS_RACERS, clock_ms=T0, barrier_timeout_s=120.0, join_timeout_s=300.0)
    results = race_threads(racing, db_url, _cas_racer, {"fences": fences})
    for r in range(ROUNDS):
        outcomes = [results[i][r] for i in range(CAS_RACERS)]
        assert outcomes.count("won") == 1, (r, outcomes)
        winner = outcomes.index("won")
        loaded = store.commits.load_session(f"{SID}-{r}")
        assert loaded is not None and loaded.head_revision == 3
        assert [n.node_id for n in loaded.graph.nodes] == ["r0", "r1", f"n-{winner}"]
        assert loaded.token_ledger[0].usage.input_tokens == 3


def _takeover_racer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 commits with A's lease; racer 1, whose clock is past A's expiry, takes
    the lease over and commits; both at revision 2."""
    clock = store.clock
    assert isinstance(clock, SettableClock)
    if i == 1:
        clock.advance(TTL + 1)
    out: list[Any] = []
    for r in range(ROUNDS):
        sid = f"{SID}-t{r}"
        barrier.wait()  # the round's session is seeded, A holds its lease
        if i == 0:
            fence = SessionExecutionLease.model_validate(p["fences"][r])
        else:
            got = store.leases.try_claim_session_execution_lease(sid, B, TTL)
            fence = got.lease  # type: ignore[union-attr]
        try:
            store.commits.commit_runtime_state(_turn(fence, 2, f"n-{i}", session_id=sid))
            out.append("won")
        except (SessionExecutionLeaseExpired, HeadRevisionConflict) as exc:
            out.append(type(exc).__name__)
        barrier.wait()
    return out


def test_after_a_takeover_one_of_the_holders_commits(store: Store, db_url: str) -> None:
    fences = [_seeded(store, f"{SID}-t{r}").model_dump(mode="json") for r in range(ROUNDS)]
    racing = Racing(threads=2, clock_ms=T0, barrier_timeout_s=120.0, join_timeout_s=300.0)
    old, new = race_threads(racing, db_url, _takeover_racer, {"fences": fences})
    for r in range(ROUNDS):
        assert [old[r], new[r]].count("won") == 1, (r, old[r], new[r])
        if old[r] == "won":  # A committed before B's takeover; B's commit then came later
            assert new[r] == "HeadRevisionConflict", r
        loaded = store.commits.load_session(f"{SID}-t{r}")
        assert loaded is not None and loaded.head_revision == 3
        winner = 0 if old[r] == "won" else 1
        assert loaded.graph.nodes[-1].node_id == f"n-{winner}"


# --------------------------------------------------------------------------
# Faults injected into the statement's writes


@pytest.mark.parametrize(
    ("table", "event"),
    [
        ("usage_deltas", "INSERT"),
        ("session_usage_totals", "UPDATE"),
        ("graph_nodes", "INSERT"),
        ("blobs", "INSERT"),
        ("session_head", "UPDATE"),
        ("session_execution_leases", "UPDATE"),
        ("runtime_turn_commits", "INSERT"),
    ],
)
def test_a_fault_in_any_write_of_the_statement_leaves_nothing(
    store: Store,
    backend: str,
    paths: Paths,
    fault_on: Callable[..., None],
    table: str,
    event: str,
) -> None:
    fence = _seeded(store)
    before = snapshot(store)
    fault_on(table, event)
    paths.ran()
    stamp = TurnCommitStamp(session_id=SID, turn_id="t2", turn_commit_hash="h")
    commit = _turn(
        fence,
        2,
        "n2",
        turn_commit=stamp,
        release_session_execution_lease=fence,
        checkpoint=HydratedSessionCheckpoint(turn_state={"fresh": table}),  # a new blob
    )
    with pytest.raises(DatabaseError, match="injected fault"):
        store.commits.commit_runtime_state(commit)
    _expect(backend, paths, checked=True, restarted=False)
    assert snapshot(store) == before


# --------------------------------------------------------------------------
# The statement's cost does not grow with the session


class _Captured(Exception):
    """Raised in place of sending the checking statement (its text and parameters kept)."""


def test_the_checking_statement_reads_no_growing_table_whatever_its_plan(
    fresh_url: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres keeps one generic plan for a prepared statement once it costs no more
    than the custom ones, planned on the tables as they were then. A check that reads
    the session's nodes (a node id as ``NOT EXISTS``) got such a plan while the
    session was small: a scan of the ``(session_id, tombstoned, seq)`` index that
    read every node of the session at every commit, so the commit grew with the
    session. The statement's node and stamp checks are the row counts of inserts
    through their unique indexes (``ON CONFLICT``), and the ledger checks those of
    the totals upsert: its generic plan (``plan_cache_mode = force_generic_plan``)
    scans none of the tables a session grows (nodes, usage rows, turn records,
    blobs), whatever the planner would choose."""
    if backend != "postgres":
        pytest.skip("Postgres only: the checking statement and its cached plan")
    import psycopg
    from sqlalchemy.dialects.postgresql import asyncpg

    from agentkeep.migrations import upgrade
    from agentkeep.statements import CompileTarget

    upgrade(fresh_url)
    captured: dict[str, Any] = {}

    def capture(driver: Driver, stmt: Any, params: Any) -> Any:
        captured["stmt"], captured["params"] = stmt, dict(params)
        raise _Captured

    with Store.open(fresh_url, clock=SettableClock(T0)) as store:
        fence = _seeded(store)
        monkeypatch.setattr(Driver, "execute_checking", capture)
        stamp = TurnCommitStamp(session_id=SID, turn_id="t2", turn_commit_hash="h")
        with pytest.raises(_Captured):  # the unit rolls back: nothing of it is kept
            store.commits.commit_runtime_state(
                _turn(fence, 2, "n2", turn_commit=stamp, release_session_execution_lease=fence)
            )
        monkeypatch.undo()
    # The statement with $n placeholders (the asyncpg form), prepared by name.
    form = captured["stmt"].compiled(CompileTarget.of(asyncpg.dialect(paramstyle="numeric_dollar")))
    values = form.bind(captured["params"])
    plain = fresh_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE checked_turn AS {form.sql}")
        cur = psycopg.ClientCursor(conn)
        marks = ", ".join(["%s"] * len(values))
        cur.execute(f"EXPLAIN EXECUTE checked_turn({marks})", list(values))
        plan = "\n".join(row[0] for row in cur.fetchall())
        conn.rollback()
    assert "Insert on graph_nodes" in plan and "uq_graph_nodes_session_id_node_id" in plan, plan
    for table in ("graph_nodes", "usage_deltas", "runtime_turn_commits", "blobs"):
        scans = [line for line in plan.splitlines() if "Scan" in line and f" on {table}" in line]
        assert not scans, (table, plan)


def test_a_rollback_that_fails_after_a_refused_check_is_retried(
    store: Store, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg can leave a connection in an aborted pipeline that ROLLBACK cannot leave
    ("cannot exit pipeline mode while busy": the refused check's error surfaced while
    the round trip was still being sent). Nothing was committed, so ``restart`` raises
    ConnectionLost: the one-call commit runs again on another connection and answers as
    it would have (here a replay of the stored result); the broken connection is dropped,
    and only it: the server answered, so the pool's other connections are kept."""
    import psycopg

    fence = _seeded(store)
    invalidated_at = store.engine.pool._invalidate_time
    stamp = TurnCommitStamp(session_id=SID, turn_id="t2", turn_commit_hash="h")
    result = store.commits.commit_runtime_state(_turn(fence, 2, "n2", turn_commit=stamp))
    before = snapshot(store)
    real = Driver.rollback
    failed: list[Driver] = []

    def rollback(driver: Driver) -> None:
        if not failed:
            failed.append(driver)
            raise psycopg.OperationalError("sending query failed: cannot exit pipeline mode")
        real(driver)

    monkeypatch.setattr(Driver, "rollback", rollback)
    again = store.commits.commit_runtime_state(_turn(fence, 2, "n2", turn_commit=stamp))
    assert failed and again == result
    assert snapshot(store) == before
    assert store.engine.pool._invalidate_time == invalidated_at  # no pool-wide invalidation
    monkeypatch.setattr(Driver, "rollback", real)
    assert store.commits.commit_runtime_state(_turn(fence, 3, "n3")).head_revision == 4
