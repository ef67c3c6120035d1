"""Postgres round trips per one-call operation, read off the wire.

    .venv/bin/python benchmarks/bench_roundtrips.py [--url URL] [--driver D] [--show]

(``D``: psycopg, asyncpg or psycopg_async; repeat it for several, default all three.)

A relay (``_pgwire.WireTap``) between the store and the server notes one
entry per round trip: every message after which the client waits for the
server (a simple ``Query``, or an extended-protocol batch ended by ``Sync``).
It sees the bytes, so it counts what the driver really sends: its own
``BEGIN``, a pool pre-ping, prepared-statement batches. Each operation runs
a few times first (warm pool, prepared statements, caches), then once
recorded; the count of the recorded call is printed, and with ``--show``
its round trips one per line.

The operations are those of the speed issue's table: ``runs.get``,
``runs.try_transition``, ``runs.acquire_assignee``, ``runs.update_status``,
``runs.set_result``, ``runs.set_input_json``, ``runs.delete``, a lease cycle (claim,
renew, release: three operations), a renew and a release alone, a small
fenced turn commit (one node, a checkpoint and a usage row under a lease),
``load_session`` of the active path, and ``runtime.atomic_apply`` (a ~10 KiB
snapshot, a receipt, 4 inputs); later rows add the session store's queue,
turn-input, catalog, runtime and saver operations, and operations run inside
``store.call_write(fn)``, where each runs in a SAVEPOINT.
No timing: the figure is the same on every run of the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from _pgwire import WireTap
from bench_runtime import SNAPSHOT_BYTES, boundaries, first_receipt, snapshot_chain
from sqlalchemy import create_engine, make_url, text

from agentkeep import RunRecord, RunStatus, Store
from agentkeep import migrations as migrate
from agentkeep.aio import AsyncStore
from agentkeep.integrations.langgraph import AgentkeepSaver
from agentkeep.runtime import MachineLifecycleCommit
from agentkeep.sessions.domain import (
    Acquired,
    ClaimBoundary,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)

ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
WARM = 3
OWNER = LeaseOwnerIdentity(owner_id="bench", incarnation_id="bench-1")


class Subject:
    """The operations, each a callable that runs one one-call operation (sync form)."""

    def __init__(self, call: Callable[[Any], Any], *, sync: bool = True) -> None:
        # call(fn) runs fn(store_like) and returns its result; fn gets a Store or AsyncStore
        # and returns a value or an awaitable.
        self.call = call
        self.sync = sync
        self.n = 0

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}-{uuid.uuid4().hex[:6]}"


def operations(s: Subject) -> list[tuple[str, Callable[[], Callable[[], Any] | None]]]:
    call = s.call
    chain = snapshot_chain(WARM + 2, SNAPSHOT_BYTES)

    def new_run() -> str:
        rid = s.fresh("R")
        call(lambda st: st.runs.create(RunRecord.new(rid, "T-1", created_at=1_700_000_000)))
        return rid

    # Each entry: (name, prepare) where prepare() returns the thunk to measure.
    def prep_get() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.get(rid))

    def prep_transition() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(
            lambda st: st.runs.try_transition(rid, RunStatus.PENDING, RunStatus.RUNNING)
        )

    def prep_acquire() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.acquire_assignee(rid, "slot", "op", "worker"))

    def prep_update_status() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.update_status(rid, RunStatus.RUNNING))

    def prep_set_result() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.set_result(rid, {"ok": True}))

    def prep_set_input() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.set_input_json(rid, '{"prompt":"p"}'))

    def prep_delete() -> Callable[[], Any]:
        rid = new_run()
        return lambda: call(lambda st: st.runs.delete(rid))

    def prep_lease_cycle() -> Callable[[], Any]:
        sid = s.fresh("S")

        def cycle() -> None:
            out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 60_000))
            assert isinstance(out, Acquired), out
            call(lambda st: st.leases.renew_session_execution_lease(out.lease, 60_000))
            call(lambda st: st.leases.release_session_execution_lease(out.lease))

        return cycle

    def prep_lease_renew() -> Callable[[], Any]:
        sid = s.fresh("S")
        out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 60_000))
        assert isinstance(out, Acquired), out
        return lambda: call(lambda st: st.leases.renew_session_execution_lease(out.lease, 60_000))

    def prep_lease_release() -> Callable[[], Any]:
        sid = s.fresh("S")
        out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 60_000))
        assert isinstance(out, Acquired), out
        return lambda: call(lambda st: st.leases.release_session_execution_lease(out.lease))

    def prep_commit(blind: bool) -> Callable[[], Any]:
        """A one-node fenced turn, the session's second: with its expected head
        revision (the checking commit on Postgres) or blind (the full commit)."""
        sid = s.fresh("S")
        out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
        assert isinstance(out, Acquired), out
        state = {"rev": 0, "leaf": None, "turn": 0}

        def commit() -> None:
            i = state["turn"]
            node = SessionNodeRecord(
                node_id=f"{i}-n",
                parent_node_id=state["leaf"],
                timestamp=i,
                payload={"role": "assistant", "content": "ok"},
            )
            rc = RuntimeCommit(
                session_id=sid,
                expected_head_revision=None if blind else state["rev"],
                session_execution_lease=out.lease,
                graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
                checkpoint=HydratedSessionCheckpoint(turn_state={"turn": i}),
                usage_deltas=(
                    UsageDelta(
                        source="chat",
                        model="m-1",
                        usage=TokenUsage(input_tokens=10, output_tokens=5),
                    ),
                ),
            )
            result = call(lambda st: st.commits.commit_runtime_state(rc))
            state.update(rev=result.head_revision, leaf=node.node_id, turn=i + 1)

        commit()
        return commit

    def committed_session() -> str:
        """A session of three committed turns (nodes, checkpoints) under a lease."""
        sid = s.fresh("S")
        out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
        assert isinstance(out, Acquired), out
        rev, leaf = 0, None
        for i in range(3):
            node = SessionNodeRecord(
                node_id=f"{i}-n", parent_node_id=leaf, timestamp=i, payload={"i": i}
            )
            rc = RuntimeCommit(
                session_id=sid,
                expected_head_revision=rev,
                session_execution_lease=out.lease,
                graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
                checkpoint=HydratedSessionCheckpoint(turn_state={"turn": i}),
            )
            rev = call(lambda st, rc=rc: st.commits.commit_runtime_state(rc)).head_revision
            leaf = node.node_id
        return sid

    def prep_load() -> Callable[[], Any]:
        sid = committed_session()
        return lambda: call(lambda st: st.commits.load_session(sid, ActivePathScope()))

    def leased(prefix: str) -> tuple[str, Any]:
        sid = s.fresh(prefix)
        out = call(lambda st: st.leases.try_claim_session_execution_lease(sid, OWNER, 600_000))
        assert isinstance(out, Acquired), out
        return sid, out.lease

    def queue_draft(sid: str, items: int) -> QueuedWorkDraft:
        body = QueuedWorkPayload(kind="user_message", body={"t": "hi"})
        return QueuedWorkDraft(session_id=sid, payloads=(body,) * items)

    def input_draft(sid: str) -> PendingTurnInputDraft:
        return PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"t": "hi"})

    def prep_enqueue(items: int) -> Callable[[], Any]:
        sid = s.fresh("S")
        return lambda: call(lambda st: st.queue.enqueue_queued_work(queue_draft(sid, items)))

    def queue_claim(sid: str, lease: Any) -> Any:
        return call(
            lambda st: st.queue.claim_ready_queued_work(sid, lease, OWNER, ClaimBoundary.IDLE, 1)
        )

    def prep_queue_claim() -> Callable[[], Any]:
        sid, lease = leased("S")
        call(lambda st: st.queue.enqueue_queued_work(queue_draft(sid, 1)))
        return lambda: queue_claim(sid, lease)

    def prep_queue_complete() -> Callable[[], Any]:
        sid, lease = leased("S")
        call(lambda st: st.queue.enqueue_queued_work(queue_draft(sid, 1)))
        claim = queue_claim(sid, lease)
        return lambda: call(
            lambda st: st.queue.complete_queued_work_claim(lease, claim.completion())
        )

    def prep_input_enqueue() -> Callable[[], Any]:
        sid = s.fresh("S")
        return lambda: call(lambda st: st.turn_inputs.enqueue_pending_turn_input(input_draft(sid)))

    def prep_input_claim(inputs: int) -> Callable[[], Any]:
        sid, lease = leased("S")
        for _ in range(inputs):
            call(lambda st: st.turn_inputs.enqueue_pending_turn_input(input_draft(sid)))
        return lambda: call(lambda st: st.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 8))

    def prep_input_complete() -> Callable[[], Any]:
        sid, lease = leased("S")
        call(lambda st: st.turn_inputs.enqueue_pending_turn_input(input_draft(sid)))
        claim = call(lambda st: st.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 1))
        return lambda: call(
            lambda st: st.turn_inputs.complete_turn_input_claim(lease, claim.completion())
        )

    def in_call_write(fn: Callable[[Any], Any]) -> Any:
        """``fn(repositories)`` in a ``store.call_write`` unit: each operation in a SAVEPOINT."""
        return call(lambda st: st.call_write(fn))

    def prep_nested_enqueue() -> Callable[[], Any]:
        sid = s.fresh("S")
        return lambda: in_call_write(lambda r: r.queue.enqueue_queued_work(queue_draft(sid, 1)))

    def prep_nested_input_claim() -> Callable[[], Any]:
        sid, lease = leased("S")
        call(lambda st: st.turn_inputs.enqueue_pending_turn_input(input_draft(sid)))
        return lambda: in_call_write(
            lambda r: r.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 1)
        )

    def prep_nested_enqueue_and_claim() -> Callable[[], Any]:
        sid, lease = leased("S")

        def both(r: Any) -> Any:
            r.turn_inputs.enqueue_pending_turn_input(input_draft(sid))
            return r.turn_inputs.claim_next_turn_inputs(sid, lease, OWNER, 1)

        return lambda: in_call_write(both)

    def prep_list_queue() -> Callable[[], Any]:
        sid = s.fresh("S")
        draft = QueuedWorkDraft(
            session_id=sid, payloads=(QueuedWorkPayload(kind="user_message", body={"t": "hi"}),)
        )
        call(lambda st: st.queue.enqueue_queued_work(draft))
        return lambda: call(lambda st: st.queue.list_queued_work(sid))

    def prep_list_inputs() -> Callable[[], Any]:
        sid = s.fresh("S")
        draft = PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"t": "hi"})
        call(lambda st: st.turn_inputs.enqueue_pending_turn_input(draft))
        return lambda: call(lambda st: st.turn_inputs.list_pending_turn_inputs(sid))

    def prep_delete_session() -> Callable[[], Any]:
        sid = committed_session()
        return lambda: call(lambda st: st.catalog.delete_session(sid))

    def prep_apply() -> Callable[[], Any]:
        rt, run_id = s.fresh("rt"), str(uuid.uuid4())
        calls = boundaries(chain, run_id)
        call(lambda st: st.runtime.atomic_apply(rt, chain[0], first_receipt(run_id)))
        k = [0]

        def apply() -> None:
            b = calls[k[0]]
            k[0] += 1
            call(lambda st: st.runtime.atomic_apply(rt, b.snapshot, b.receipt, b.records))

        return apply

    def prep_snapshot() -> Callable[[], Any]:
        rt = s.fresh("rt")
        call(lambda st: st.runtime.commit_session_snapshot(rt, chain[0]))
        return lambda: call(lambda st: st.runtime.commit_session_snapshot(rt, chain[1]))

    def prep_lifecycle() -> Callable[[], Any]:
        rt = s.fresh("rt")
        records = calls_inputs()
        return lambda: call(
            lambda st: st.runtime.commit_machine_lifecycle(
                rt, MachineLifecycleCommit(runtime_state="idle"), records
            )
        )

    def calls_inputs() -> tuple[Any, ...]:
        return boundaries(chain[:2], str(uuid.uuid4()))[0].records

    def saver_config(fenced: bool) -> tuple[dict[str, Any], Callable[[], Any]]:
        thread = s.fresh("T")
        holder: dict[str, Any] = {}

        def run(fn: Callable[[Any], Any]) -> Any:
            return call(lambda st: _saver_step(st, thread, fenced, fn, holder))

        return {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}, run

    def prep_saver_put(fenced: bool) -> Callable[[], Any] | None:
        if fenced and not s.sync:
            return None  # an async owning block's lease lives in the task that entered it
        config, run = saver_config(fenced)
        k = [0]

        def put() -> None:
            k[0] += 1
            cp = _checkpoint(k[0])
            run(lambda saver, a: (saver.aput if a else saver.put)(config, cp, {}, {}))

        put()
        return put

    def prep_saver_writes(fenced: bool) -> Callable[[], Any] | None:
        if fenced and not s.sync:
            return None
        config, run = saver_config(fenced)
        cp = _checkpoint(0)
        saved = run(lambda saver, a: (saver.aput if a else saver.put)(config, cp, {}, {}))
        k = [0]

        def put_writes() -> None:
            k[0] += 1
            writes = [("messages", ["hi"])]
            task = f"t{k[0]}"
            run(
                lambda saver, a: (saver.aput_writes if a else saver.put_writes)(saved, writes, task)
            )

        return put_writes

    return [
        ("runs.get", prep_get),
        ("runs.try_transition", prep_transition),
        ("runs.acquire_assignee", prep_acquire),
        ("runs.update_status", prep_update_status),
        ("runs.set_result", prep_set_result),
        ("runs.set_input_json", prep_set_input),
        ("runs.delete", prep_delete),
        ("lease cycle (claim, renew, release)", prep_lease_cycle),
        ("leases.renew", prep_lease_renew),
        ("leases.release", prep_lease_release),
        ("small fenced commit", lambda: prep_commit(False)),
        ("small fenced commit, blind (full form)", lambda: prep_commit(True)),
        ("load_session(ActivePathScope)", prep_load),
        ("queue.enqueue_queued_work (1 item)", lambda: prep_enqueue(1)),
        ("queue.enqueue_queued_work (3 items)", lambda: prep_enqueue(3)),
        ("queue.claim_ready_queued_work", prep_queue_claim),
        ("queue.complete_queued_work_claim", prep_queue_complete),
        ("turn_inputs.enqueue_pending_turn_input", prep_input_enqueue),
        ("turn_inputs.claim_next_turn_inputs (1 input)", lambda: prep_input_claim(1)),
        ("turn_inputs.claim_next_turn_inputs (2 inputs)", lambda: prep_input_claim(2)),
        ("turn_inputs.complete_turn_input_claim", prep_input_complete),
        ("call_write(queue.enqueue_queued_work, 1 item)", prep_nested_enqueue),
        ("call_write(turn_inputs.claim_next_turn_inputs, 1 input)", prep_nested_input_claim),
        ("call_write(enqueue_pending_turn_input + claim 1 input)", prep_nested_enqueue_and_claim),
        ("queue.list_queued_work", prep_list_queue),
        ("turn_inputs.list_pending_turn_inputs", prep_list_inputs),
        ("catalog.delete_session", prep_delete_session),
        ("runtime.atomic_apply", prep_apply),
        ("runtime.commit_session_snapshot", prep_snapshot),
        ("runtime.commit_machine_lifecycle (4 inputs)", prep_lifecycle),
        ("AgentkeepSaver.put", lambda: prep_saver_put(False)),
        ("AgentkeepSaver.put_writes", lambda: prep_saver_writes(False)),
        ("AgentkeepSaver.put (owning)", lambda: prep_saver_put(True)),
        ("AgentkeepSaver.put_writes (owning)", lambda: prep_saver_writes(True)),
    ]


def measure(subject: Subject, tap: WireTap, show: bool) -> list[tuple[str, int, list[str]]]:
    out = []
    for name, prepare in operations(subject):
        # Warm: a fresh subject per repetition for operations that change state
        # (a transition wins once), so every repetition does the same work.
        if prepare() is None:  # not measured with this driver
            out.append((name, -1, []))
            continue
        for _ in range(WARM):
            prepare()()  # type: ignore[misc]
        thunk = prepare()
        assert thunk is not None
        with tap.record() as trips:
            thunk()
        out.append((name, len(trips), list(trips)))
    return out


def count_driver(
    driver: str, url: str, tap: WireTap, show: bool
) -> list[tuple[str, int, list[str]]]:
    """The operations' round trips through ``driver`` (sync Store or native AsyncStore)."""
    if driver == "psycopg":
        store = Store.open(url)
        try:
            return measure(Subject(lambda fn: fn(store)), tap, show)
        finally:
            store.close()
    loop = asyncio.new_event_loop()
    astore = loop.run_until_complete(AsyncStore.open(url))
    try:
        run = Subject(lambda fn: loop.run_until_complete(_awaited(fn(astore))), sync=False)
        return measure(run, tap, show)
    finally:
        loop.run_until_complete(astore.close())
        loop.close()


def fresh_database(admin: str) -> str:
    name = f"ak_rt_{uuid.uuid4().hex[:8]}"
    eng = create_engine(admin, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    eng.dispose()
    url = make_url(admin).set(database=name)
    migrate.upgrade(url.render_as_string(hide_password=False))
    return name


def drop_database(admin: str, name: str) -> None:
    eng = create_engine(admin, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    eng.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=ADMIN, help="admin URL of the Postgres server")
    ap.add_argument(
        "--driver",
        action="append",
        choices=["psycopg", "asyncpg", "psycopg_async"],
        help="drivers to count (default: all three)",
    )
    ap.add_argument("--show", action="store_true", help="print each round trip")
    args = ap.parse_args()
    drivers = args.driver or ["psycopg", "asyncpg", "psycopg_async"]
    admin = make_url(args.url)
    tap = WireTap(admin.host or "127.0.0.1", admin.port or 5432)
    name = fresh_database(args.url)
    results: dict[str, list[tuple[str, int, list[str]]]] = {}
    try:
        for driver in drivers:
            url = admin.set(
                drivername=f"postgresql+{driver}",
                host="127.0.0.1",
                port=tap.port,
                database=name,
                query={"sslmode": "disable"} if driver != "asyncpg" else {"ssl": "disable"},
            ).render_as_string(hide_password=False)
            results[driver] = count_driver(driver, url, tap, args.show)
    finally:
        tap.close()
        drop_database(args.url, name)
    names = [n for n, _, _ in next(iter(results.values()))]
    width = max(len(n) for n in names)
    print(f"Postgres round trips per one-call operation (wire trace), {', '.join(drivers)}")
    print(f"{'operation':<{width}}  " + "  ".join(f"{d:>13}" for d in drivers))
    for i, n in enumerate(names):
        counts = (results[d][i][1] for d in drivers)
        print(f"{n:<{width}}  " + "  ".join(f"{c if c >= 0 else '-':>13}" for c in counts))
    if args.show:
        for d in drivers:
            print(f"\n{d}:")
            for n, count, trips in results[d]:
                print(f"  {n} ({count}):")
                for t in trips:
                    print(f"    {t[:110]}")
    return 0


def _checkpoint(i: int) -> dict[str, Any]:
    """A small LangGraph checkpoint (one message channel), id ``i`` in sortable form."""
    return {
        "v": 1,
        "id": f"1ef{i:012d}",
        "ts": "2026-01-01T00:00:00+00:00",
        "channel_values": {"messages": [f"message {i}"]},
        "channel_versions": {"messages": i},
        "versions_seen": {},
        "pending_sends": [],
        "updated_channels": ["messages"],
    }


def _saver_step(
    store: Any, thread: str, fenced: bool, fn: Callable[[Any, bool], Any], holder: dict[str, Any]
) -> Any:
    """``fn(saver, is_async)`` on one AgentkeepSaver of ``store`` (kept in ``holder``).

    Fenced: inside an ``owning`` block of ``thread``, entered once and left open
    (sync Store only: an async block's lease lives in the task that entered it).
    """
    saver = holder.get("saver")
    if saver is None:
        saver = holder["saver"] = AgentkeepSaver(store)
        if fenced:
            if not isinstance(store, Store):
                raise NotImplementedError("owning rows: sync Store only")
            holder["stack"] = stack = ExitStack()
            stack.enter_context(saver.owning(thread))
    return fn(saver, not isinstance(store, Store))


async def _awaited(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


if __name__ == "__main__":
    sys.exit(main())
