"""Session-store benchmark: one-call operations vs raw sqlite3 running the same SQL.

    .venv/bin/python benchmarks/bench_sessions.py [--n N] [--rounds R] [--scale 1000,100000]

Cycles (each a sequence of one-call operations, one transaction each):

* lease: ``try_claim`` + ``renew`` + ``release`` (every cycle acquires a new generation);
* queue: ``enqueue_queued_work`` (1 item) + ``claim_ready_queued_work`` (max 1) + ``abandon``
  + a second claim and ``complete`` so the queue does not grow;
* turn input: ``enqueue_pending_turn_input`` + ``claim_next_turn_inputs`` (max 1) + ``complete``.

The raw side uses the stdlib ``sqlite3`` driver with the store's PRAGMAs and
runs the repositories' own ``Statement`` constants, compiled as the store
compiles them for sqlite3 (``_common.sqlite_form``: the text, and the values
a statement fixes itself bound with ``form.bind(params)``), in the same
transaction shapes (``BEGIN IMMEDIATE`` … ``COMMIT`` per operation, the same
SAVEPOINTs), with the same JSON and hashing work done by hand — what a
careful hand-written store would do. The parameter names the raw side passes
are checked against each statement at import, and before timing one cycle of
each kind runs both ways under SQLite's statement trace: the two sequences of
statements (literals and savepoint names masked) must be equal, so the raw
side always measures the store's own SQL.

The scale check measures one claim + abandon on a session whose queue holds
1k vs 100k batches (and 100k more in other sessions): it must stay flat
(the scan walks ``ix_queued_work_batches_session_seq`` and stops at its LIMIT).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import secrets
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import best_us, raw_connect, sqlite_form, traced_store

from agentkeep import Store
from agentkeep.migrations import upgrade
from agentkeep.sessions import leases as L
from agentkeep.sessions import queue as Q
from agentkeep.sessions import turn_inputs as T
from agentkeep.sessions.domain import (
    Acquired,
    ClaimBoundary,
    LeaseOwnerIdentity,
    NextTurnIngress,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.statements import Compiled, Statement

OWNER = LeaseOwnerIdentity(owner_id="bench-owner", incarnation_id="bench-inc")
TTL = 60_000
LIVENESS = '{"kind":"opaque"}'


_BIND = re.compile(r"(?<![:\w]):(\w+)")


def _form(stmt: Statement, *binds: str) -> Compiled:
    """The store's statement as sqlite3 receives it; ``binds`` are the names the raw side passes.

    Exits when the statement takes other parameters (a repository change the
    benchmark must follow), never silently measuring something else.
    """
    form = sqlite_form(stmt)
    own = set(_BIND.findall(form.sql)) - set(form.fixed or ())
    if own != set(binds):
        raise SystemExit(
            f"benchmark out of date: {stmt.name} binds {sorted(own)}, expected {sorted(binds)}"
        )
    return form


def _run(c: sqlite3.Connection, form: Compiled, params: dict[str, Any]) -> sqlite3.Cursor:
    """Execute one of the store's statements as the store's driver does."""
    return c.execute(form.sql, form.bind(params))


def _now() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------
# Store cycles


def store_lease_cycle(store: Store, sid: str) -> Callable[[], None]:
    def cycle() -> None:
        out = store.leases.try_claim_session_execution_lease(sid, OWNER, TTL)
        assert isinstance(out, Acquired)
        lease = store.leases.renew_session_execution_lease(out.lease, TTL)
        store.leases.release_session_execution_lease(lease)

    return cycle


def store_queue_cycle(store: Store, sid: str) -> Callable[[], None]:
    lease = store.leases.try_claim_session_execution_lease(sid, OWNER, 10**9)
    assert isinstance(lease, Acquired)
    fence = lease.lease
    draft = QueuedWorkDraft(
        session_id=sid, payloads=(QueuedWorkPayload(kind="user_message", body={"text": "hi"}),)
    )

    def cycle() -> None:
        store.queue.enqueue_queued_work(draft)
        claim = store.queue.claim_ready_queued_work(sid, fence, OWNER, ClaimBoundary.IDLE, 1)
        assert claim is not None
        store.queue.abandon_queued_work_claim(claim)
        claim = store.queue.claim_ready_queued_work(sid, fence, OWNER, ClaimBoundary.IDLE, 1)
        assert claim is not None
        store.queue.complete_queued_work_claim(fence, claim.completion())

    return cycle


def store_input_cycle(store: Store, sid: str) -> Callable[[], None]:
    lease = store.leases.try_claim_session_execution_lease(sid, OWNER, 10**9)
    assert isinstance(lease, Acquired)
    fence = lease.lease
    draft = PendingTurnInputDraft(session_id=sid, ingress=NextTurnIngress(), input={"text": "hi"})

    def cycle() -> None:
        store.turn_inputs.enqueue_pending_turn_input(draft)
        claim = store.turn_inputs.claim_next_turn_inputs(sid, fence, OWNER, 1)
        assert claim is not None
        store.turn_inputs.complete_turn_input_claim(fence, claim.completion())

    return cycle


# --------------------------------------------------------------------------
# Raw sqlite3 cycles: the same statements, hand-driven


class RawSession:
    """A hand-written equivalent of the repositories' statement sequences."""

    GET = _form(L._GET, "sid")
    ACQUIRE = _form(
        L._ACQUIRE, "sid", "owner", "inc", "liveness", "token", "fencing", "now", "expires",
        "previous",
    )  # fmt: skip
    RENEW = _form(L._RENEW, "sid", "owner", "inc", "token", "fencing", "now", "expires")
    RELEASE = _form(L._RELEASE, "sid", "owner", "inc", "token", "fencing")
    INSERT_BATCH = _form(
        Q._INSERT_BATCH, "bid", "sid", "key", "delivery", "slot", "merge_key", "available_at",
        "now",
    )  # fmt: skip
    INSERT_ITEM = _form(Q._INSERT_ITEM, "bid", "idx", "item_id", "payload")
    SCAN = _form(Q._SCAN, "sid", "now", "generation", "limit")
    STAMP = _form(
        Q._STAMP_CLAIM, "cid", "owner", "inc", "liveness", "token", "generation", "sid", "bid"
    )
    CLEAR = _form(Q._CLEAR_CLAIM, "sid", "cid", "token")
    OWNED = _form(Q._OWNED_BY_CLAIM, "sid", "cid", "token")
    DELETE = _form(Q._DELETE_CLAIMED, "sid", "cid", "token")
    INSERT_INPUT = _form(T._INSERT, "iid", "sid", "key", "ingress", "state", "input", "now")
    INPUT_SCAN = _form(T.CLAIM_SCAN, "sid", "state", "gen", "limit")
    INPUT_STAMP = _form(
        T._STAMP, "state_after", "cid", "owner", "inc", "liveness", "token", "gen", "sid", "iid"
    )
    INPUT_OWNED = _form(T._OWNED, "sid", "cid", "token")
    INPUT_COMPLETE = _form(T._COMPLETE, "sid", "cid", "token")

    def __init__(self, conn: sqlite3.Connection, sid: str) -> None:
        self.c = conn
        self.sid = sid
        self.nonce = itertools.count()
        self.sp = itertools.count()

    def cycle(self, kind: str) -> Callable[[], None]:
        """The raw cycle of ``kind`` (``lease``, ``queue`` or ``input``), set up to run."""
        if kind == "lease":
            return self.lease_cycle
        return (self.queue_cycle_fn if kind == "queue" else self.input_cycle_fn)()

    def _fence_ok(self, fencing: int, token: str, now: int) -> None:
        row = _run(self.c, self.GET, {"sid": self.sid}).fetchone()
        if row is None or row[3] != token or row[4] != fencing or row[6] <= now:
            raise RuntimeError("fence")

    def lease_cycle(self) -> None:
        c, sid = self.c, self.sid
        now = _now()
        c.execute("BEGIN IMMEDIATE")
        row = _run(c, self.GET, {"sid": sid}).fetchone()
        prev = row[4] if row else -1
        fencing = (row[4] if row else 0) + 1
        token = f"{sid}:{OWNER.owner_id}:{OWNER.incarnation_id}:{now}:{fencing}"
        _run(
            c,
            self.ACQUIRE,
            {
                "sid": sid,
                "owner": OWNER.owner_id,
                "inc": OWNER.incarnation_id,
                "liveness": LIVENESS,
                "token": token,
                "fencing": fencing,
                "now": now,
                "expires": now + TTL,
                "previous": prev,
            },
        ).fetchone()
        c.commit()
        now = _now()
        c.execute("BEGIN IMMEDIATE")
        fence = {
            "sid": sid,
            "owner": OWNER.owner_id,
            "inc": OWNER.incarnation_id,
            "token": token,
            "fencing": fencing,
        }
        # FENCE_OK is the renew's WHERE; the lease is read only to explain a refusal.
        if _run(c, self.RENEW, {**fence, "now": now, "expires": now + TTL}).fetchone() is None:
            raise RuntimeError("fence")
        c.commit()
        c.execute("BEGIN IMMEDIATE")
        _run(c, self.RELEASE, fence)
        c.commit()

    def acquire_forever(self) -> tuple[int, str]:
        now = _now()
        c, sid = self.c, self.sid
        c.execute("BEGIN IMMEDIATE")
        row = _run(c, self.GET, {"sid": sid}).fetchone()
        fencing = (row[4] if row else 0) + 1
        token = f"{sid}:raw:raw:{now}:{fencing}"
        _run(
            c,
            self.ACQUIRE,
            {
                "sid": sid,
                "owner": "raw",
                "inc": "raw",
                "liveness": LIVENESS,
                "token": token,
                "fencing": fencing,
                "now": now,
                "expires": now + 10**9,
                "previous": row[4] if row else -1,
            },
        ).fetchone()
        c.commit()
        return fencing, token

    def _claim_queue(self, fencing: int, token: str) -> tuple[str, str, str]:
        c, sid = self.c, self.sid
        now = _now()
        c.execute("BEGIN IMMEDIATE")
        self._fence_ok(fencing, token, now)
        rows = _run(
            c, self.SCAN, {"sid": sid, "now": now, "generation": fencing, "limit": 33}
        ).fetchall()
        head = rows[0]
        json.loads(head[6]) if head[6].startswith("{") else head[6]
        json.loads(head[18])
        cid = f"qwc:{head[0]}:{head[14] + 1}"
        claim_token = hashlib.sha256(f"{sid}:raw:raw:{cid}:{now}".encode()).hexdigest()
        _run(
            c,
            self.STAMP,
            {
                "cid": cid,
                "owner": "raw",
                "inc": "raw",
                "liveness": LIVENESS,
                "token": claim_token,
                "generation": fencing,
                "sid": sid,
                "bid": head[1],
            },
        )
        c.commit()
        return cid, claim_token, head[1]

    def queue_cycle_fn(self) -> Callable[[], None]:
        fencing, token = self.acquire_forever()
        c, sid = self.c, self.sid
        payload = json.dumps(
            {"body": {"text": "hi"}, "kind": "user_message"}, sort_keys=True, separators=(",", ":")
        )

        def cycle() -> None:
            now = _now()
            seed = f"{sid}:None:{now}:{next(self.nonce)}:{secrets.token_hex(8)}"
            bid = "qwb:" + hashlib.sha256(seed.encode()).hexdigest()
            c.execute("BEGIN IMMEDIATE")
            _run(
                c,
                self.INSERT_BATCH,
                {
                    "bid": bid,
                    "sid": sid,
                    "key": None,
                    "delivery": "earliest_safe_boundary",
                    "slot": "exclusive",
                    "merge_key": '"never"',
                    "available_at": 0,
                    "now": now,
                },
            ).fetchone()
            _run(
                c,
                self.INSERT_ITEM,
                {"bid": bid, "idx": 0, "item_id": f"{bid}:item:0", "payload": payload},
            )
            c.commit()
            cid, ctoken, _ = self._claim_queue(fencing, token)
            c.execute("BEGIN IMMEDIATE")
            _run(c, self.CLEAR, {"sid": sid, "cid": cid, "token": ctoken})
            c.commit()
            cid, ctoken, bid = self._claim_queue(fencing, token)
            now = _now()
            c.execute("BEGIN IMMEDIATE")
            self._fence_ok(fencing, token, now)
            owned = _run(c, self.OWNED, {"sid": sid, "cid": cid, "token": ctoken}).fetchall()
            assert [r[0] for r in owned] == [bid]
            _run(c, self.DELETE, {"sid": sid, "cid": cid, "token": ctoken})
            c.commit()

        return cycle

    def input_cycle_fn(self) -> Callable[[], None]:
        fencing, token = self.acquire_forever()
        c, sid = self.c, self.sid

        def cycle() -> None:
            now = _now()
            seed = f"{sid}:None:{now}:{next(self.nonce)}:{secrets.token_hex(8)}"
            iid = "ti:" + hashlib.sha256(seed.encode()).hexdigest()
            c.execute("BEGIN IMMEDIATE")
            _run(
                c,
                self.INSERT_INPUT,
                {
                    "iid": iid,
                    "sid": sid,
                    "key": None,
                    "ingress": '{"scope":"next_turn"}',
                    "state": "deferred_next_turn",
                    "input": '{"text":"hi"}',
                    "now": now,
                },
            ).fetchone()
            c.commit()
            now = _now()
            c.execute("BEGIN IMMEDIATE")
            self._fence_ok(fencing, token, now)
            rows = _run(
                c,
                self.INPUT_SCAN,
                {"sid": sid, "state": "deferred_next_turn", "gen": fencing, "limit": 33},
            ).fetchall()
            head = rows[0]
            json.loads(head[4])
            json.loads(head[7])
            cid = f"tic:{head[0]}:{head[14] + 1}"
            ctoken = hashlib.sha256(f"{sid}:raw:raw:{cid}:{now}".encode()).hexdigest()
            _run(
                c,
                self.INPUT_STAMP,
                {
                    "state_after": "deferred_next_turn",
                    "cid": cid,
                    "owner": "raw",
                    "inc": "raw",
                    "liveness": LIVENESS,
                    "token": ctoken,
                    "gen": fencing,
                    "sid": sid,
                    "iid": head[1],
                },
            ).fetchone()
            c.commit()
            now = _now()
            c.execute("BEGIN IMMEDIATE")
            self._fence_ok(fencing, token, now)
            owned = _run(c, self.INPUT_OWNED, {"sid": sid, "cid": cid, "token": ctoken}).fetchall()
            assert len(owned) == 1
            _run(c, self.INPUT_COMPLETE, {"sid": sid, "cid": cid, "token": ctoken})
            c.commit()

        return cycle


# --------------------------------------------------------------------------
# Same-statements check: one cycle each way, traced by SQLite

_LITERALS = re.compile(r"'(?:[^']|'')*'|\bNULL\b|(?<![\w.])-?\d+(?![\w.])")
_SAVEPOINT = re.compile(r"SAVEPOINT \w+")


def _mask(sql: str) -> str:
    """A traced statement with its literals and savepoint name masked."""
    return _LITERALS.sub("?", _SAVEPOINT.sub("SAVEPOINT sp", " ".join(sql.split())))


def check_same_sql(tmp: Path) -> list[str]:
    """Run one cycle of each kind through the store and the raw side; the SQL must match.

    Each side gets its own fresh database; SQLite reports every statement it
    runs (``BEGIN``, ``SAVEPOINT`` and ``COMMIT`` included), so a raw side that
    drifted from the repositories (another statement, order or transaction
    shape) is reported instead of timed.
    """
    problems = []
    cycles = (
        ("lease", store_lease_cycle),
        ("queue", store_queue_cycle),
        ("input", store_input_cycle),
    )
    for kind, store_fn in cycles:
        s_path, r_path = tmp / f"check-{kind}-store.db", tmp / f"check-{kind}-raw.db"
        upgrade(f"sqlite:///{s_path}")
        upgrade(f"sqlite:///{r_path}")
        with traced_store(s_path) as (store, store_trace, on):
            store_cycle = store_fn(store, "s-check")
            on[0] = True
            store_cycle()
            on[0] = False
        raw = RawSession(raw_connect(r_path), "s-check")
        raw_cycle = raw.cycle(kind)
        raw_trace: list[str] = []
        raw.c.set_trace_callback(raw_trace.append)
        raw_cycle()
        raw.c.set_trace_callback(None)
        raw.c.close()
        s_sql, r_sql = [_mask(x) for x in store_trace], [_mask(x) for x in raw_trace]
        if s_sql != r_sql:
            diff = next(
                (i for i, (a, b) in enumerate(zip(s_sql, r_sql, strict=False)) if a != b),
                min(len(s_sql), len(r_sql)),
            )
            problems.append(
                f"{kind}: statements differ from #{diff} "
                f"(store {len(s_sql)}, raw {len(r_sql)})\n"
                f"  store: {[x[:160] for x in s_sql[diff : diff + 2]]}\n"
                f"  raw:   {[x[:160] for x in r_sql[diff : diff + 2]]}"
            )
        else:
            print(f"  same SQL  {kind}: {len(s_sql)} statements")
    return problems


# --------------------------------------------------------------------------
# Scale: claim cost at 1k vs 100k queued rows


def _fill(path: Path, sid: str, count: int, others: int) -> None:
    conn = raw_connect(path)
    now = _now()
    conn.execute("BEGIN IMMEDIATE")
    payload = '{"body":{},"kind":"user_message"}'

    def rows(session: str, n: int, tag: str) -> Any:
        for i in range(n):
            bid = f"qwb:{tag}:{i}"
            yield (bid, session, now)

    for session, n, tag in ((sid, count, "s"), ("other-session", others, "o")):
        conn.executemany(
            "INSERT INTO queued_work_batches (batch_id, session_id, delivery_policy, slot_policy, "
            "merge_key_json, available_at_ms, enqueued_at_ms) VALUES (?, ?, "
            "'earliest_safe_boundary', 'exclusive', '\"never\"', 0, ?)",
            list(rows(session, n, tag)),
        )
        conn.executemany(
            "INSERT INTO queued_work_items (batch_id, item_index, item_id, payload_json) "
            "VALUES (?, 0, ?, ?)",
            [(f"qwb:{tag}:{i}", f"qwb:{tag}:{i}:item:0", payload) for i in range(n)],
        )
    conn.commit()
    conn.close()


def scale(tmp: Path, sizes: list[int], n: int, rounds: int) -> list[tuple[int, float]]:
    out = []
    for size in sizes:
        path = tmp / f"scale-{size}.db"
        upgrade(f"sqlite:///{path}")
        _fill(path, "s-scale", size, size)
        store = Store.open(f"sqlite:///{path}")
        lease = store.leases.try_claim_session_execution_lease("s-scale", OWNER, 10**9)
        assert isinstance(lease, Acquired)
        fence = lease.lease

        def claim_abandon(store: Store = store, fence: Any = fence) -> None:
            claim = store.queue.claim_ready_queued_work(
                "s-scale", fence, OWNER, ClaimBoundary.IDLE, 1
            )
            assert claim is not None
            store.queue.abandon_queued_work_claim(claim)

        out.append((size, best_us(claim_abandon, n, rounds)))
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="cycles per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (best kept)")
    parser.add_argument("--scale", default="1000,100000", help="queue sizes for the scale check")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("Same-statements check (one cycle each way, literals masked):")
        problems = check_same_sql(tmp)
        if problems:
            raise SystemExit("\n".join(problems))
        print()
        rows = []
        for name, store_fn, raw_fn in (
            ("lease: claim + renew + release", store_lease_cycle, "lease"),
            ("queue: enqueue + claim + abandon (+ claim + complete)", store_queue_cycle, "queue"),
            ("turn input: enqueue + claim + complete", store_input_cycle, "input"),
        ):
            s_path, r_path = tmp / f"{raw_fn}-store.db", tmp / f"{raw_fn}-raw.db"
            upgrade(f"sqlite:///{s_path}")
            upgrade(f"sqlite:///{r_path}")
            store = Store.open(f"sqlite:///{s_path}")
            store_us = best_us(store_fn(store, "s-bench"), args.n, args.rounds)
            store.close()
            raw = RawSession(raw_connect(r_path), "s-bench")
            raw_us = best_us(raw.cycle(raw_fn), args.n, args.rounds)
            rows.append((name, store_us, raw_us))

        print("SQLite, µs per cycle (one-call store operations vs raw sqlite3, same SQL)")
        print(f"{'cycle':<56} | {'store µs':>9} | {'raw µs':>9} | {'ratio':>6}")
        print("-" * 90)
        for name, s_us, r_us in rows:
            print(f"{name:<56} | {s_us:>9.1f} | {r_us:>9.1f} | {s_us / r_us:>5.2f}x")

        sizes = [int(x) for x in args.scale.split(",") if x]
        if sizes:
            print()
            print(
                "claim_ready_queued_work(max 1) + abandon, with the session's queue holding N rows"
            )
            print("(and N more in another session)")
            results = scale(tmp, sizes, args.n, args.rounds)
            base = results[0][1]
            for size, us in results:
                print(f"  {size:>8,} rows: {us:8.1f} µs  ({us / base:.2f}x of {sizes[0]:,})")


if __name__ == "__main__":
    main()
