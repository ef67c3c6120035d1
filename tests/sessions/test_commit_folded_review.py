"""Review of the turn commit's folded statements, attacked on both backends.

The fold: the lease, the head and the ledger totals read in one statement
(``check_fence_row``); on Postgres the usage rows and their totals in one
statement (``_PUT_USAGE_AND_TOTALS``) and the checkpoint blobs in the head
upsert's (``_PUT_HEAD_WITH_BLOBS``); ``statements._written`` measuring the
data-modifying CTEs.

* Error precedence (module docstring of :mod:`agentkeep.sessions.commits`):
  step 9's blobs come before steps 10–11, and step 10's delta rows before its
  totals. An oversized checkpoint blob is ``PayloadTooLarge("content")`` even
  when a later step would also fail (a ledger overflow, a node id that
  exists, an oversized node), on both backends as before the fold; an
  oversized delta ``source`` comes before another delta's ledger overflow.
* Size limits of the CTE writes: an oversized ``source`` / ``model`` in a
  folded shape (1..4 deltas) and in an unfolded one (5 deltas) is refused
  with nothing written.
* Fence order: a stale fence is ``SessionExecutionLeaseExpired`` before a
  head conflict; a corrupt lease row is ``SessionCorrupt`` naming the lease
  before a head conflict.
* Differential ledger: threads, each with its own Store (own connections),
  commit blind writes with 0..6 usage deltas (repeated pairs, zero deltas,
  folded and unfolded shapes) under one fence, each with a turn-commit stamp
  and replayed once; afterwards every ledger total equals the sum of its
  usage rows and of the inputs, each pair's ordinal is unique, and the row
  count is the deltas committed once.
* Retries after ``CommitOutcomeUnknown`` (a COMMIT applied and its answer
  lost; on Postgres also a backend terminated before COMMIT): the one-call
  facade settles stamped commits; the usage rows and totals count each turn
  exactly once.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import text

from agentkeep.clock import SettableClock
from agentkeep.errors import (
    HeadRevisionConflict,
    NodeAlreadyExists,
    PayloadTooLarge,
    SessionCorrupt,
    SessionExecutionLeaseExpired,
    UsageLedgerOverflow,
)
from agentkeep.limits import Limits
from agentkeep.sessions.domain import LeaseOwnerIdentity, SessionExecutionLease
from agentkeep.sessions.records import (
    AppendNodes,
    BlobProfile,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    TurnCommitStamp,
    UnchangedGraph,
    UsageDelta,
)
from agentkeep.store import Store
from tests.racing import Racing, race_threads

from .support import acquire_lease
from .test_commits import snapshot

SID = "sess-fold-1"
A = LeaseOwnerIdentity(owner_id="owner-A", incarnation_id="inc-A1")
B = LeaseOwnerIdentity(owner_id="owner-B", incarnation_id="inc-B1")
T0 = 1_700_000_000_000
TTL = 600_000
LIMIT = 4000
MAX_I64 = 2**63 - 1


def _commit(fence: SessionExecutionLease | None, **kw: Any) -> RuntimeCommit:
    kw.setdefault("checkpoint", HydratedSessionCheckpoint(turn_state={"t": 1}))
    kw.setdefault("graph", UnchangedGraph(leaf_node_id=None))
    kw.setdefault("expected_head_revision", None)
    return RuntimeCommit(session_id=SID, session_execution_lease=fence, **kw)


def _delta(source: str, model: str = "m", **counts: int) -> UsageDelta:
    return UsageDelta(source=source, model=model, usage=TokenUsage(**counts))


def _incompressible(n: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n)
    )


@pytest.fixture
def limited(db_url: str) -> Any:
    s = Store.open(
        db_url,
        clock=SettableClock(T0),
        limits=Limits(max_payload_bytes=LIMIT, max_blob_bytes=LIMIT),
    )
    yield s
    s.close()


def _seeded(store: Store) -> SessionExecutionLease:
    """A session whose head has node ``n1`` and whose ``(s, m)`` input total is 2**63-1."""
    fence = acquire_lease(store, SID, A, TTL)
    store.commits.commit_runtime_state(
        _commit(
            fence,
            graph=AppendNodes(nodes=(SessionNodeRecord(node_id="n1"),), leaf_node_id="n1"),
            usage_deltas=(_delta("s", input_tokens=MAX_I64),),
        )
    )
    return fence


# --------------------------------------------------------------------------
# Error precedence


BIG = {"x": _incompressible(20_000)}


@pytest.mark.parametrize("later", ["overflow", "node_exists", "big_node"])
def test_an_oversized_blob_is_refused_before_later_steps_fail(limited: Store, later: str) -> None:
    """Step 9 (the checkpoint's blobs) comes before steps 10–11, on both backends."""
    fence = _seeded(limited)
    before = snapshot(limited)
    kw: dict[str, Any] = {"checkpoint": HydratedSessionCheckpoint(turn_state=BIG)}
    if later == "overflow":
        kw["usage_deltas"] = (_delta("s", input_tokens=1),)
    elif later == "node_exists":
        kw["graph"] = AppendNodes(nodes=(SessionNodeRecord(node_id="n1"),), leaf_node_id="n1")
    else:
        big_node = SessionNodeRecord(node_id="n2", parent_node_id="n1", payload=BIG)
        kw["graph"] = AppendNodes(nodes=(big_node,), leaf_node_id="n2")
    with pytest.raises(PayloadTooLarge) as info:
        limited.commits.commit_runtime_state(_commit(fence, **kw))
    assert info.value.field == "content", info.value
    assert snapshot(limited) == before


def test_the_blob_limit_alone_and_the_later_errors_alone(limited: Store) -> None:
    """Each later error on its own is still raised (the precedence test is not vacuous)."""
    fence = _seeded(limited)
    with pytest.raises(UsageLedgerOverflow):
        limited.commits.commit_runtime_state(
            _commit(fence, usage_deltas=(_delta("s", input_tokens=1),))
        )
    with pytest.raises(NodeAlreadyExists):
        limited.commits.commit_runtime_state(
            _commit(
                fence,
                graph=AppendNodes(nodes=(SessionNodeRecord(node_id="n1"),), leaf_node_id="n1"),
            )
        )
    with pytest.raises(PayloadTooLarge) as info:
        limited.commits.commit_runtime_state(
            _commit(fence, checkpoint=HydratedSessionCheckpoint(turn_state=BIG))
        )
    assert info.value.field == "content"


def test_an_oversized_delta_is_refused_before_another_deltas_overflow(limited: Store) -> None:
    """Step 10: the delta rows (their size limits) come before the totals (the overflow)."""
    fence = _seeded(limited)
    before = snapshot(limited)
    deltas = (_delta("q" * (LIMIT + 1), input_tokens=1), _delta("s", input_tokens=1))
    with pytest.raises(PayloadTooLarge) as info:
        limited.commits.commit_runtime_state(_commit(fence, usage_deltas=deltas))
    assert info.value.field == "source"
    assert snapshot(limited) == before


# --------------------------------------------------------------------------
# Size limits of the folded (CTE) writes


@pytest.mark.parametrize("deltas", [1, 4, 5])
@pytest.mark.parametrize("column", ["source", "model"])
def test_an_oversized_usage_text_is_refused_folded_or_not(
    limited: Store, deltas: int, column: str
) -> None:
    fence = acquire_lease(limited, SID, A, TTL)
    limited.commits.commit_runtime_state(
        _commit(fence, usage_deltas=(_delta("s", input_tokens=3),))
    )
    before = snapshot(limited)
    big = "w" * (LIMIT + 1)
    rows = [
        _delta(f"s{i}", input_tokens=1)
        if i != deltas - 1
        else (
            _delta(big, input_tokens=1) if column == "source" else _delta("s", big, input_tokens=1)
        )
        for i in range(deltas)
    ]
    with pytest.raises(PayloadTooLarge) as info:
        limited.commits.commit_runtime_state(_commit(fence, usage_deltas=tuple(rows)))
    assert info.value.field == column
    assert snapshot(limited) == before


def test_the_folded_statements_measure_every_cte_row() -> None:
    """The driver's own check of a folded statement covers its CTE rows (``_written``).

    Independent of the commit's early check (:func:`commits._check_sizes`): a
    folded statement sent by any other caller is still measured.
    """
    from sqlalchemy.dialects.postgresql import psycopg

    from agentkeep.sessions import commits
    from agentkeep.statements import CompileTarget

    target = CompileTarget.of(psycopg.dialect(paramstyle="pyformat"))
    for (m, n), stmt in commits._PUT_USAGE_AND_TOTALS.items():
        written = {(param, column) for param, column, _ in stmt.compiled(target).written}
        for i in range(m):
            assert {(f"dsource{i}", "source"), (f"dmodel{i}", "model")} <= written, (m, n)
        for j in range(n):
            assert {(f"tsource{j}", "source"), (f"tmodel{j}", "model")} <= written, (m, n)
    for k, stmt in commits._PUT_HEAD_WITH_BLOBS.items():
        kinds = {param: (column, kind) for param, column, kind in stmt.compiled(target).written}
        for i in range(k):
            assert kinds[f"content{i}"] == ("content", "blob"), k
        assert kinds["config"][0] == "config_json", kinds


# --------------------------------------------------------------------------
# Fence order on the one-statement read


def test_a_stale_fence_is_refused_before_a_head_conflict(
    store: Store, clock: SettableClock
) -> None:
    old = acquire_lease(store, SID, A, 1_000)
    store.commits.commit_runtime_state(_commit(old, usage_deltas=(_delta("s", input_tokens=1),)))
    clock.advance(2_000)
    acquire_lease(store, SID, B, TTL)  # takes over the expired lease
    before = snapshot(store)
    for deltas in [(), (_delta("s", input_tokens=1),)]:  # the read with and without totals
        with pytest.raises(SessionExecutionLeaseExpired):
            store.commits.commit_runtime_state(
                _commit(old, expected_head_revision=7, usage_deltas=deltas)
            )
    assert snapshot(store) == before


def test_a_corrupt_lease_is_refused_before_a_head_conflict(store: Store) -> None:
    fence = acquire_lease(store, SID, A, TTL)
    store.commits.commit_runtime_state(_commit(fence))
    with store.write() as uow:
        uow.connection.execute(
            text(
                "UPDATE session_execution_leases SET lease_fencing_token = -1"
                " WHERE session_id = :sid"
            ),
            {"sid": SID},
        )
    before = snapshot(store)
    with pytest.raises(SessionCorrupt) as info:
        store.commits.commit_runtime_state(_commit(fence, expected_head_revision=7))
    assert info.value.table == "session_execution_leases"
    assert snapshot(store) == before


def test_a_live_fence_with_a_wrong_revision_is_a_head_conflict(store: Store) -> None:
    fence = acquire_lease(store, SID, A, TTL)
    store.commits.commit_runtime_state(_commit(fence, usage_deltas=(_delta("s", input_tokens=1),)))
    with pytest.raises(HeadRevisionConflict) as info:
        store.commits.commit_runtime_state(
            _commit(fence, expected_head_revision=7, usage_deltas=(_delta("s", input_tokens=1),))
        )
    assert (info.value.expected, info.value.actual) == (7, 1)


# --------------------------------------------------------------------------
# The ledger against its usage rows, with concurrent committers


PAIRS = [("s0", "m"), ("s1", "m"), ("s0", "m2"), ("s2", "m"), ("s3", "m3"), ("s4", "m")]
ROUNDS = 12


def _deltas(rng: random.Random) -> tuple[UsageDelta, ...]:
    """0..6 deltas: repeated pairs, zero-usage ones (folded and unfolded shapes)."""
    out = []
    for _ in range(rng.randint(0, 6)):
        source, model = rng.choice(PAIRS)
        zero = rng.random() < 0.2
        out.append(
            _delta(
                source,
                model,
                input_tokens=0 if zero else rng.randint(1, 1000),
                output_tokens=0 if zero else rng.randint(0, 50),
                reasoning_output_tokens=0 if zero else rng.randint(0, 3),
            )
        )
    return tuple(out)


def _counts(d: UsageDelta) -> tuple[int, int, int]:
    u = d.usage
    return u.input_tokens, u.output_tokens, u.reasoning_output_tokens


def _ledger_committer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per round: one stamped blind commit with random deltas, then its replay."""
    fence = SessionExecutionLease.model_validate_json(p["fence"])
    rng = random.Random(1000 + i)
    sent = []
    for r in range(ROUNDS):
        barrier.wait()
        deltas = _deltas(rng)
        c = _commit(
            fence,
            usage_deltas=deltas,
            checkpoint=HydratedSessionCheckpoint(turn_state={"r": r, "i": i}),
            turn_commit=TurnCommitStamp(session_id=SID, turn_id=f"t{i}-{r}", turn_commit_hash="h"),
        )
        first = store.commits.commit_runtime_state(c)
        again = store.commits.commit_runtime_state(c)  # a retry: the replay writes nothing
        assert again == first
        sent.append([(d.source, d.model, *_counts(d)) for d in deltas])
    return sent


def _check_ledger(
    store: Store, expected_rows: int, expected: dict[tuple[str, str], list[int]]
) -> None:
    with store.read() as uow:
        conn = uow.connection
        rows = conn.execute(
            text(
                "SELECT source, model, SUM(input_tokens), SUM(output_tokens),"
                " SUM(reasoning_output_tokens), COUNT(*) FROM usage_deltas"
                " WHERE session_id = :sid GROUP BY source, model"
            ),
            {"sid": SID},
        ).all()
        totals = conn.execute(
            text(
                "SELECT source, model, input_tokens, output_tokens, reasoning_output_tokens,"
                " ordinal FROM session_usage_totals WHERE session_id = :sid"
            ),
            {"sid": SID},
        ).all()
    assert sum(r[5] for r in rows) == expected_rows
    summed = {(r[0], r[1]): [int(r[2]), int(r[3]), int(r[4])] for r in rows}
    # A pair whose every delta was zero has usage rows but no total.
    summed = {k: v for k, v in summed.items() if any(v)}
    kept = {(r[0], r[1]): [r[2], r[3], r[4]] for r in totals}
    assert kept == summed
    assert kept == {k: v for k, v in expected.items() if any(v)}
    ordinals = [r[5] for r in totals]
    assert sorted(ordinals) == list(range(len(ordinals))), ordinals


def test_ledger_totals_equal_the_usage_rows_after_racing_committers(
    store: Store, db_url: str
) -> None:
    fence = acquire_lease(store, SID, A, TTL)
    racing = Racing(threads=3, clock_ms=T0, barrier_timeout_s=120.0, join_timeout_s=300.0)
    results = race_threads(racing, db_url, _ledger_committer, {"fence": fence.model_dump_json()})
    expected: dict[tuple[str, str], list[int]] = {}
    count = 0
    for racer in results:
        for round_ in racer:
            for source, model, *counts in round_:
                count += 1
                e = expected.setdefault((source, model), [0, 0, 0])
                for j, n in enumerate(counts):
                    e[j] += n
    _check_ledger(store, count, expected)
    got = store.commits.load_session(SID)
    assert got is not None
    assert got.head_revision == 3 * ROUNDS
    ledger = {(e.source, e.model): e.usage.input_tokens for e in got.token_ledger}
    assert ledger == {k: v[0] for k, v in expected.items() if any(v)}


# --------------------------------------------------------------------------
# Retries after CommitOutcomeUnknown


@pytest.mark.parametrize("shape", [1, 3, 6])
def test_a_commit_whose_outcome_was_unknown_counts_its_usage_once(
    store: Store, backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch, shape: int
) -> None:
    from tests.test_connection_loss import Admin, CommitFault

    admin = Admin(db_url) if backend == "postgres" else None
    try:
        fault = CommitFault(monkeypatch, admin)
        kinds = ["lost", "terminate"] if backend == "postgres" else ["lost", "gone"]
        fence = acquire_lease(store, SID, A, TTL)
        rng = random.Random(shape)
        expected: dict[tuple[str, str], list[int]] = {}
        count = 0
        for turn in range(8):
            deltas = tuple(
                _delta(*rng.choice(PAIRS), input_tokens=rng.randint(1, 9), output_tokens=1)
                for _ in range(shape)
            )
            c = _commit(
                fence,
                usage_deltas=deltas,
                turn_commit=TurnCommitStamp(
                    session_id=SID, turn_id=f"t{turn}", turn_commit_hash="h"
                ),
            )
            fault.arm(kinds[turn % 2])
            result = store.commits.commit_runtime_state(c)
            assert fault.fired == turn + 1
            assert result.head_revision == turn + 1
            for d in deltas:
                count += 1
                e = expected.setdefault((d.source, d.model), [0, 0, 0])
                for j, n in enumerate(_counts(d)):
                    e[j] += n
        _check_ledger(store, count, expected)
    finally:
        if admin is not None:
            admin.close()


# --------------------------------------------------------------------------
# A stale holder committing while its lease is taken over


TAKEOVER_ROUNDS = 16
SHORT_TTL = 1_000


def _stale_or_taker(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 holds each round's lease (its clock: live); racer 1's clock is past the
    expiry: it takes the lease over and commits. Both commit blind writes at once."""
    clock = store.clock
    assert isinstance(clock, SettableClock)
    if i == 1:
        clock.advance(SHORT_TTL + 1)
    out: list[Any] = []
    for r in range(TAKEOVER_ROUNDS):
        sid = f"sess-takeover-{r}"
        if i == 0:
            fence = acquire_lease(store, sid, A, SHORT_TTL)
        barrier.wait()  # the round's lease is held by racer 0
        if i == 1:
            got = store.leases.try_claim_session_execution_lease(sid, B, TTL)
            fence = got.lease  # type: ignore[union-attr]
        c = RuntimeCommit(
            session_id=sid,
            expected_head_revision=None,
            session_execution_lease=fence,
            graph=UnchangedGraph(leaf_node_id=None),
            checkpoint=HydratedSessionCheckpoint(turn_state={"racer": i}),
            usage_deltas=(_delta(f"racer{i}", input_tokens=1),),
        )
        try:
            out.append(("won", store.commits.commit_runtime_state(c).head_revision))
        except SessionExecutionLeaseExpired:
            out.append(("expired", None))
        barrier.wait()
    return out


def test_a_stale_holder_never_commits_after_the_takeover(store: Store, db_url: str) -> None:
    """The new holder always commits; the old one either commits before the takeover
    (a lower revision: its commit serialised before the new holder's) or is refused,
    and a refused commit leaves no usage row."""
    racing = Racing(threads=2, clock_ms=T0, barrier_timeout_s=120.0, join_timeout_s=300.0)
    stale, taker = race_threads(racing, db_url, _stale_or_taker, {})
    for r, (old, new) in enumerate(zip(stale, taker, strict=True)):
        assert new[0] == "won", (r, new)
        if old[0] == "won":
            assert old[1] < new[1], (r, old, new)
        got = store.commits.load_session(f"sess-takeover-{r}")
        assert got is not None
        sources = {e.source for e in got.token_ledger}
        assert sources == ({"racer0", "racer1"} if old[0] == "won" else {"racer1"}), r
        assert got.head_revision == (2 if old[0] == "won" else 1)


# --------------------------------------------------------------------------
# Blob rows of the head statement that repeat a hash


@pytest.mark.parametrize("profile", list(BlobProfile))
def test_components_with_one_body_are_stored_once_and_hydrate(store: Store, profile: Any) -> None:
    """Equal component bodies hash alike: the head statement's blob rows repeat a hash
    (``ON CONFLICT DO NOTHING`` within one INSERT); a later commit re-sends stored ones."""
    fence = acquire_lease(store, SID, A, TTL)
    body = {"same": list(range(300))}
    checkpoint = HydratedSessionCheckpoint(
        turn_state=body, tool_state=body, plugin_snapshot=body, execution_state=body
    )
    for turn in range(2):
        result = store.commits.commit_runtime_state(
            _commit(fence, checkpoint=checkpoint), blob_profile=profile
        )
        assert result.head_revision == turn + 1
        got = store.commits.load_session(SID)
        assert got is not None
        assert got.checkpoint.tool_state == got.checkpoint.execution_state == body
        assert got.checkpoint.plugin_snapshot == body
    with store.read() as uow:
        hashes = uow.connection.execute(text("SELECT hash FROM blobs")).scalars().all()
    assert len(hashes) == len(set(hashes)) == 2  # the shared body and the manifest


# --------------------------------------------------------------------------
# Several commits in one unit, with caught failures between them


def test_commits_in_one_unit_with_caught_failures_keep_the_ledger(store: Store) -> None:
    """Each commit reads the totals its predecessors in the unit wrote (the one-statement
    read under the lock); a refused commit in between leaves nothing of itself."""
    fence = acquire_lease(store, SID, A, TTL)
    expected: dict[tuple[str, str], list[int]] = {}
    count = 0

    def add(deltas: tuple[UsageDelta, ...]) -> None:
        nonlocal count
        for d in deltas:
            count += 1
            e = expected.setdefault((d.source, d.model), [0, 0, 0])
            for j, n in enumerate(_counts(d)):
                e[j] += n

    with store.write() as uow:
        for turn in range(6):
            deltas = tuple(
                _delta(*PAIRS[(turn + k) % 3], input_tokens=turn + k + 1)
                for k in range(turn % 5 + 1)
            )
            uow.commits.commit_runtime_state(_commit(fence, usage_deltas=deltas))
            add(deltas)
            with pytest.raises(HeadRevisionConflict):
                uow.commits.commit_runtime_state(
                    _commit(fence, expected_head_revision=99, usage_deltas=deltas)
                )
            with pytest.raises(UsageLedgerOverflow):
                uow.commits.commit_runtime_state(
                    _commit(fence, usage_deltas=(*deltas, _delta("s0", "m", input_tokens=MAX_I64)))
                )
    _check_ledger(store, count, expected)
    assert store.commits.get_head_revision(SID) == 6


# --------------------------------------------------------------------------
# The async drivers (asyncpg sends the folded statements one by one, unpipelined)


def test_the_ledger_on_the_async_drivers(async_url: str) -> None:
    import asyncio

    from agentkeep.aio import AsyncStore
    from tests.conftest import as_sync_url

    rng = random.Random(5)
    expected: dict[tuple[str, str], list[int]] = {}
    count = 0
    batches = [_deltas(rng) for _ in range(20)]

    async def scenario() -> None:
        astore = await AsyncStore.open(async_url, clock=SettableClock(T0))
        try:
            got = await astore.leases.try_claim_session_execution_lease(SID, A, TTL)
            fence = got.lease  # type: ignore[union-attr]
            for deltas in batches:
                await astore.commits.commit_runtime_state(
                    _commit(
                        fence,
                        usage_deltas=deltas,
                        checkpoint=HydratedSessionCheckpoint(turn_state={"n": len(deltas)}),
                    )
                )
        finally:
            await astore.close()

    asyncio.run(scenario())
    for deltas in batches:
        for d in deltas:
            count += 1
            e = expected.setdefault((d.source, d.model), [0, 0, 0])
            for j, n in enumerate(_counts(d)):
                e[j] += n
    with Store.open(as_sync_url(async_url)) as sync:
        _check_ledger(sync, count, expected)


# --------------------------------------------------------------------------
# Blob GC racing commits that re-send collected blobs in the head statement

GC_COMMITS = 40


def _recycling_committer(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> Any:
    """Racer 0 commits checkpoints cycling through three (so each commit re-sends a
    manifest and components a GC may just have collected); racer 1 runs the GC."""
    if i == 1:
        deleted = 0
        while not p["done"].is_set():
            deleted += store.call_write(
                lambda r: r.maintenance.gc_unreachable_strict()
            ).deleted_blob_count
        return deleted
    try:
        fence = SessionExecutionLease.model_validate_json(p["fence"])
        for n in range(GC_COMMITS):
            k = n % 3
            checkpoint = HydratedSessionCheckpoint(
                turn_state={"k": k}, tool_state={"tool": k}, execution_state={"exec": [k] * 50}
            )
            store.commits.commit_runtime_state(_commit(fence, checkpoint=checkpoint))
            got = store.commits.load_session(SID)
            assert got is not None
            assert got.checkpoint.tool_state == {"tool": k}
            assert got.checkpoint.execution_state == {"exec": [k] * 50}
        return None
    finally:
        p["done"].set()


def test_a_gc_never_collects_a_blob_of_a_head_committed_with_its_blobs(
    store: Store, db_url: str
) -> None:
    import threading

    fence = acquire_lease(store, SID, A, TTL)
    racing = Racing(threads=2, clock_ms=T0, barrier_timeout_s=120.0, join_timeout_s=300.0)
    params = {"fence": fence.model_dump_json(), "done": threading.Event()}
    _, deleted = race_threads(racing, db_url, _recycling_committer, params)
    assert deleted >= 0
    store.call_write(lambda r: r.maintenance.gc_unreachable_strict())
    got = store.commits.load_session(SID)
    assert got is not None and got.head_revision == GC_COMMITS
    k = (GC_COMMITS - 1) % 3
    assert got.checkpoint.execution_state == {"exec": [k] * 50}
