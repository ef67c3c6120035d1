"""Races of joined units: real writers, each a host with its own engine, Session and Store.

Every racer builds its own engine with plain ``sqlalchemy.create_engine``
(:func:`tests.host_app.host_engine`), opens ``Store.open(engine)`` on it and,
in a Session of its own, joins a unit to the Session's transaction next to a
host row of its own. Racers are threads or ``spawn``-ed processes
(:mod:`tests.racing`), lined up on a barrier; every test runs on SQLite and
Postgres.

* one run, N joined ``try_transition`` calls: exactly one winner, and every
  host's commit holds its own rows;
* a host that won and then rolls back leaves the run unchanged, and exactly
  one of the racers waiting behind its lock wins instead;
* lease fencing in a joined unit: N joined ``try_claim`` → one ``Acquired``;
  stale lease holders' renewals raise ``SessionExecutionLeaseExpired`` and
  undo only their own unit, the live holder's renewal lands;
* a stale writer never wins: N joined ``vacate_assignee`` of one slot, one
  with the current generation, the others with an older one: only the
  current one releases, and the generation advances exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.orm import Session

from agentkeep.clock import SettableClock
from agentkeep.errors import SessionExecutionLeaseExpired
from agentkeep.runs.domain import Released, RunRecord, RunStatus, Stale
from agentkeep.sessions.domain import Acquired, Busy, LeaseOwnerIdentity
from agentkeep.store import Store
from tests.host_app import HostNote, host_engine, host_tables, notes
from tests.racing import Racing

T0 = 1_700_000_000_000
ROUNDS = 4
SLOT = "phase-a-op"

RACING = Racing(
    processes=3,
    threads=3,
    clock_ms=T0,
    host_engine=host_engine,
    barrier_timeout_s=60.0,
    join_timeout_s=180.0,
)
proc_pool = RACING.pool_fixture()
KINDS = pytest.mark.parametrize("kind", ["threads", "processes"])
OWNERS = [LeaseOwnerIdentity(owner_id=f"host-{i}", incarnation_id=f"inc-{i}") for i in range(3)]


def note_id(round_: int, racer: int, k: int = 0) -> int:
    return round_ * 100 + racer * 10 + k


# --------------------------------------------------------------------------
# Racer bodies (module level so that spawned children can import them)


def _body_transition(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[bool]:
    """Per run: a host row, then a joined try_transition (+ the winner's assignee), commit."""
    out = []
    for n, rid in enumerate(p["runs"]):
        with Session(store.engine) as session:
            session.add(HostNote(id=note_id(n, i), run_id=rid, note=f"host {i}"))
            barrier.wait()
            with store.write(join=session) as uow:
                won = uow.runs.try_transition(rid, RunStatus.PENDING, RunStatus.RUNNING)
                if won:
                    uow.runs.acquire_assignee(rid, SLOT, f"op-{i}", "the winner")
                uow.session.add(HostNote(id=note_id(n, i, 1), run_id=rid, note=str(won)))
            session.commit()
        out.append(won)
    return out


def _body_first_rolls_back(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Racer 0 wins first, holds its transaction while the others join, then rolls back."""
    out: list[Any] = []
    for n, rid in enumerate(p["runs"]):
        with Session(store.engine) as session:
            session.add(HostNote(id=note_id(n, i), run_id=rid, note=f"host {i}"))
            if i == 0:
                with store.write(join=session) as uow:
                    won = uow.runs.try_transition(rid, RunStatus.PENDING, RunStatus.RUNNING)
                barrier.wait()  # the others start joining now and queue behind the lock
                time.sleep(p["hold_s"])
                session.rollback()
                out.append(("rolled back", won))
            else:
                barrier.wait()
                with store.write(join=session) as uow:
                    won = uow.runs.try_transition(rid, RunStatus.PENDING, RunStatus.RUNNING)
                session.commit()
                out.append(("committed", won))
        barrier.wait()  # the round is over for everyone before racer 0 takes the next lock
    return out


def _body_lease(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per session: a joined try_claim of its lease next to a host row; commit."""
    out = []
    for n, sid in enumerate(p["sids"]):
        with Session(store.engine) as session:
            session.add(HostNote(id=note_id(n, i), run_id=sid, note=f"host {i}"))
            barrier.wait()
            with store.write(join=session) as uow:
                got = uow.leases.try_claim_session_execution_lease(sid, OWNERS[i], 60_000)
            session.commit()
        out.append(got)
    return out


def _body_renew(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[str]:
    """Per session: renew with the fence of ``p["fences"][n][i]`` in a joined unit; commit."""
    out = []
    for n, fences in enumerate(p["fences"]):
        with Session(store.engine) as session:
            session.add(HostNote(id=note_id(n, i), run_id="-", note="before the unit"))
            barrier.wait()
            try:
                with store.write(join=session) as uow:
                    uow.session.add(HostNote(id=note_id(n, i, 1), run_id="-", note="in the unit"))
                    uow.leases.renew_session_execution_lease(fences[i], 90_000)
                out.append("renewed")
            except SessionExecutionLeaseExpired:
                out.append("expired")
            session.commit()  # the host keeps its own row either way
    return out


def _body_vacate(store: Store, i: int, barrier: Any, p: dict[str, Any]) -> list[Any]:
    """Per run: joined vacate_assignee with generation ``p["gens"][n][i]``; commit."""
    out = []
    for n, rid in enumerate(p["runs"]):
        with Session(store.engine) as session:
            barrier.wait()
            with store.write(join=session) as uow:
                outcome = uow.runs.vacate_assignee(rid, SLOT, p["gens"][n][i])
                uow.session.add(HostNote(id=note_id(n, i), run_id=rid, note=type(outcome).__name__))
            session.commit()
        out.append(outcome)
    return out


# --------------------------------------------------------------------------
# Tests


@pytest.fixture
def url(db_url: str) -> Iterator[str]:
    with host_tables(db_url) as u:
        yield u


@pytest.fixture
def setup(url: str) -> Iterator[Store]:
    store = Store.open(url, clock=SettableClock(T0))
    yield store
    store.close()


def racers(kind: str) -> int:
    return RACING.threads if kind == "threads" else RACING.processes


@KINDS
def test_joined_transitions_have_one_winner_and_every_host_row_commits(
    request: pytest.FixtureRequest, url: str, setup: Store, kind: str
) -> None:
    runs = [f"R-{kind}-{n}" for n in range(ROUNDS)]
    for rid in runs:
        setup.runs.create(RunRecord.new(rid, "T-1", 10))
    results = RACING.run(request, kind, url, _body_transition, {"runs": runs})
    n_racers = racers(kind)
    committed = notes(url)
    for n, rid in enumerate(runs):
        won = [i for i in range(n_racers) if results[i][n]]
        assert len(won) == 1, (rid, results)
        record = setup.runs.get(rid)
        assert record.status is RunStatus.RUNNING
        assert record.current[SLOT].op == f"op-{won[0]}"
        assert record.next_generation == 1
        for i in range(n_racers):  # each host's commit holds both of its rows
            assert committed[note_id(n, i)] == (rid, f"host {i}")
            assert committed[note_id(n, i, 1)] == (rid, str(i == won[0]))


@KINDS
def test_a_host_rollback_after_winning_lets_another_win(
    request: pytest.FixtureRequest, url: str, setup: Store, kind: str
) -> None:
    runs = [f"R-{kind}-{n}" for n in range(2)]
    for rid in runs:
        setup.runs.create(RunRecord.new(rid, "T-1", 10))
    results = RACING.run(request, kind, url, _body_first_rolls_back, {"runs": runs, "hold_s": 0.5})
    committed = notes(url)
    for n, rid in enumerate(runs):
        assert results[0][n] == ("rolled back", True)
        others = [results[i][n] for i in range(1, racers(kind))]
        assert sorted(others) == [("committed", False)] * (len(others) - 1) + [
            ("committed", True)
        ], others
        assert setup.runs.get(rid).status is RunStatus.RUNNING
        assert note_id(n, 0) not in committed  # the rolled-back host's row is gone too
        assert all(note_id(n, i) in committed for i in range(1, racers(kind)))


@KINDS
def test_joined_lease_claims_have_one_winner(
    request: pytest.FixtureRequest, url: str, setup: Store, kind: str
) -> None:
    sids = [f"S-{kind}-{n}" for n in range(ROUNDS)]
    results = RACING.run(request, kind, url, _body_lease, {"sids": sids})
    committed = notes(url)
    for n, sid in enumerate(sids):
        outcomes = [results[i][n] for i in range(racers(kind))]
        won = [o for o in outcomes if isinstance(o, Acquired)]
        lost = [o for o in outcomes if isinstance(o, Busy)]
        assert len(won) == 1 and len(lost) == len(outcomes) - 1, outcomes
        assert won[0].lease.fencing_token == 1
        assert all(b.holder == won[0].lease for b in lost)
        assert setup.leases.get_session_execution_lease(sid) == won[0].lease
        assert all(note_id(n, i) in committed for i in range(racers(kind)))


@KINDS
def test_stale_lease_holders_never_renew_in_a_joined_unit(
    request: pytest.FixtureRequest, url: str, setup: Store, kind: str
) -> None:
    """Racer 0 holds the live lease (generation 2); the others hold generation 1, expired."""
    sids = [f"S-{kind}-{n}" for n in range(ROUNDS)]
    fences = []
    for sid in sids:
        stale = setup.leases.try_claim_session_execution_lease(sid, OWNERS[1], 0)  # expired
        live = setup.leases.try_claim_session_execution_lease(sid, OWNERS[0], 60_000)
        assert isinstance(stale, Acquired) and isinstance(live, Acquired)
        assert live.lease.fencing_token == 2
        fences.append([live.lease] + [stale.lease] * (racers(kind) - 1))
    results = RACING.run(request, kind, url, _body_renew, {"fences": fences})
    committed = notes(url)
    for n, sid in enumerate(sids):
        assert [results[i][n] for i in range(racers(kind))] == ["renewed"] + ["expired"] * (
            racers(kind) - 1
        )
        lease = setup.leases.get_session_execution_lease(sid)
        assert lease is not None
        assert (lease.owner, lease.fencing_token, lease.expires_at_epoch_ms) == (
            OWNERS[0],
            2,
            T0 + 90_000,
        )
        for i in range(racers(kind)):
            assert note_id(n, i) in committed  # the host's own row, kept
            assert (note_id(n, i, 1) in committed) is (i == 0)  # the unit's row: winners only


@KINDS
def test_a_stale_writer_never_wins_a_joined_vacate(
    request: pytest.FixtureRequest, url: str, setup: Store, kind: str
) -> None:
    runs = [f"R-{kind}-{n}" for n in range(ROUNDS)]
    gens = []
    for rid in runs:
        setup.runs.create(RunRecord.new(rid, "T-1", 10))
        old, _ = setup.runs.acquire_assignee(rid, SLOT, "old", "displaced")
        new, _ = setup.runs.acquire_assignee(rid, SLOT, "new", "current holder")
        gens.append([new] + [old] * (racers(kind) - 1))
    results = RACING.run(request, kind, url, _body_vacate, {"runs": runs, "gens": gens})
    for n, rid in enumerate(runs):
        outcomes = [results[i][n] for i in range(racers(kind))]
        assert isinstance(outcomes[0], Released), outcomes
        assert outcomes[0].released.op == "new"
        assert all(isinstance(o, Stale) for o in outcomes[1:]), outcomes
        record = setup.runs.get(rid)
        assert SLOT not in record.current
        assert record.next_generation == 3  # two acquisitions, one release
