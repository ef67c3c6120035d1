"""Session-commit benchmark: ``commit_runtime_state`` and ``load_session`` vs raw sqlite3.

    .venv/bin/python benchmarks/bench_commits.py [--n 300] [--rounds 3] [--scale 1000,100000]

* commit: a small append (one node, one usage delta, a small checkpoint), one
  call of ``store.commits.commit_runtime_state`` against raw ``sqlite3``
  running the repository's own statements in the same transaction shape
  (``BEGIN IMMEDIATE``, one read of the lease, the head's counters and the
  ledger totals, manifest blob, usage row, ledger-total upsert, node, fenced
  head upsert, ``COMMIT``) with the same canonical JSON and sha256 work.
* load: ``load_session(ActivePathScope())`` with an active path of depth 10
  and 1000, against raw ``sqlite3`` running the same two reads (the head
  with its manifest and the ledger totals, then the path) in one deferred
  transaction and decoding the node JSON.

The raw side's SQL is the repositories' own statements as the store compiles
them for sqlite3 (``_common.sqlite_form``), bound as the store binds them
(``form.bind(params)``, which adds the values a statement fixes itself, such
as ``tombstoned = 0``). Before timing, the benchmark checks that one store
commit and one store load run exactly the statements the raw side runs, in the
same order (:data:`COMMIT_STATEMENTS`, :data:`LOAD_STATEMENTS`); a change in
the store's statements makes it fail loudly instead of measuring something else.
* scale: the depth-10 active-path load when the session's graph holds 1k vs
  100k nodes: it must cost in proportion to the path, not the graph.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sqlite3
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import best_us, raw_connect, sqlite_form

from agentkeep import Store
from agentkeep.db import Driver
from agentkeep.migrations import upgrade
from agentkeep.sessions import checkpoints as C
from agentkeep.sessions import commits as K
from agentkeep.sessions import leases as L
from agentkeep.sessions.domain import Acquired, LeaseOwnerIdentity
from agentkeep.sessions.records import (
    ActivePathScope,
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.statements import Compiled, Statement

OWNER = LeaseOwnerIdentity(owner_id="bench", incarnation_id="bench")


def _form(stmt: Statement) -> Compiled:
    """A repository statement as the store runs it on sqlite3 (text and binding)."""
    return sqlite_form(stmt)


#: The repository statements of one commit, in the store's order (raw_commit runs them).
COMMIT_STATEMENTS: tuple[Statement, ...] = (
    K._GET_FENCE_AND_HEAD[True],
    C._PUT,
    K._PUT_USAGE,
    K._PUT_TOTAL,
    K._PUT_NODES[1],
    K._PUT_HEAD,
)
#: The repository statements of one active-path load, in the store's order (raw_load).
LOAD_STATEMENTS: tuple[Statement, ...] = (K._GET_HEAD_AND_TOTALS, K.ACTIVE_PATH)


def check_same_statements(what: str, call: Callable[[], object], expected: Sequence[Any]) -> None:
    """Fail unless one ``call`` of the store runs exactly ``expected``, in order."""
    seen: list[Any] = []
    real = Driver.execute

    def spy(self: Driver, stmt: Statement, params: Any) -> Any:
        seen.append(stmt)
        return real(self, stmt, params)

    Driver.execute = spy  # type: ignore[method-assign]
    try:
        call()
    finally:
        Driver.execute = real  # type: ignore[method-assign]
    if seen != list(expected):
        raise SystemExit(
            f"benchmark out of date: the store's {what} runs {seen}, the raw side {list(expected)}"
        )


def _canon(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _store(path: Path) -> tuple[Store, object]:
    upgrade(f"sqlite:///{path}")
    store = Store.open(f"sqlite:///{path}")
    out = store.leases.try_claim_session_execution_lease("s", OWNER, 10**12)
    assert isinstance(out, Acquired)
    return store, out.lease


# --------------------------------------------------------------------------
# commit


def store_commit(store: Store, lease: object) -> Callable[[], None]:
    counter = itertools.count()
    state = {"leaf": None, "rev": 0}

    def commit() -> None:
        i = next(counter)
        node = SessionNodeRecord(
            node_id=f"n{i}", parent_node_id=state["leaf"], timestamp=i, payload={"text": "hi"}
        )
        result = store.commits.commit_runtime_state(
            RuntimeCommit(
                session_id="s",
                expected_head_revision=state["rev"],
                session_execution_lease=lease,  # type: ignore[arg-type]
                graph=AppendNodes(nodes=(node,), leaf_node_id=node.node_id),
                checkpoint=HydratedSessionCheckpoint(turn_state={"turn": i}),
                usage_deltas=(UsageDelta(source="s", model="m", usage=TokenUsage(input_tokens=5)),),
            )
        )
        state["leaf"], state["rev"] = node.node_id, result.head_revision

    return commit


def raw_commit(conn: sqlite3.Connection) -> Callable[[], None]:
    now = time.time_ns() // 1_000_000
    token = f"s:raw:raw:{now}:1"
    conn.execute("BEGIN IMMEDIATE")
    acquire = _form(L._ACQUIRE)
    conn.execute(
        acquire.sql,
        acquire.bind(
            {
                "sid": "s",
                "owner": "raw",
                "inc": "raw",
                "liveness": '{"kind":"opaque"}',
                "token": token,
                "fencing": 1,
                "now": now,
                "expires": now + 10**12,
                "previous": -1,
            }
        ),
    ).fetchone()
    conn.commit()
    fence_head_totals, put_blob, put_usage, put_total, put_node, put_head = map(
        _form, COMMIT_STATEMENTS
    )
    totals_at, lease_at = K._TOTALS_AT, K._LEASE_AT
    counter = itertools.count()
    state: dict[str, object] = {"leaf": None}

    def commit() -> None:
        i = next(counter)
        now = time.time_ns() // 1_000_000
        node_id = f"n{i}"
        c = conn
        c.execute("BEGIN IMMEDIATE")
        # The lease, the head's counters and the ledger totals: one read (kind 0, 1, 2).
        rows = c.execute(fence_head_totals.sql, fence_head_totals.bind({"sid": "s"})).fetchall()
        by_kind: dict[int, list[Any]] = {0: [], 1: [], 2: []}
        for r in rows:
            by_kind[r[0]].append(r)
        lease = by_kind[2][0][lease_at]
        assert lease[3] == token and lease[4] == 1 and lease[6] > now
        actual, count = (0, 0) if not by_kind[0] else by_kind[0][0][1:3]
        total = by_kind[1][0][totals_at] if by_kind[1] else None
        manifest = {
            "execution_state_ref": None,
            "plugin_snapshot_ref": None,
            "plugin_snapshot_revision": None,
            "schema_version": 1,
            "tool_state_ref": None,
            "turn_state": {"turn": i},
        }
        raw = _canon(manifest).encode()
        ref = hashlib.sha256(raw).hexdigest()
        c.execute(
            put_blob.sql,
            put_blob.bind(
                {"hash": ref, "kind": "checkpoint_manifest", "compression": "none", "content": raw}
            ),
        )
        c.execute(
            put_usage.sql,
            put_usage.bind(
                {
                    "sid": "s",
                    "source": "s",
                    "model": "m",
                    "input": 5,
                    "output": 0,
                    "cache_read": 0,
                    "cache_write": 0,
                    "reasoning": 0,
                }
            ),
        )
        c.execute(
            put_total.sql,
            put_total.bind(
                {
                    "sid": "s",
                    "source": "s",
                    "model": "m",
                    "ordinal": 0,
                    "input": (0 if total is None else total[3]) + 5,
                    "output": 0,
                    "cache_read": 0,
                    "cache_write": 0,
                    "reasoning": 0,
                }
            ),
        )
        node_json = _canon(
            {
                "node_id": node_id,
                "parent_node_id": state["leaf"],
                "timestamp": i,
                "payload": {"text": "hi"},
            }
        )
        assert (
            c.execute(
                put_node.sql,
                put_node.bind(
                    {"sid": "s", "nid0": node_id, "parent0": state["leaf"], "json0": node_json}
                ),
            ).fetchone()
            is not None
        )
        assert (
            c.execute(
                put_head.sql,
                put_head.bind(
                    {
                        "sid": "s",
                        "schema": 1,
                        "next": actual + 1,
                        "leaf": node_id,
                        "ref": ref,
                        "config": "null",
                        "frames": "[]",
                        "frame_id": None,
                        "count": count + 1,
                        "actual": actual,
                    }
                ),
            ).fetchone()
            is not None
        )
        c.commit()
        state["leaf"] = node_id

    return commit


# --------------------------------------------------------------------------
# load


def store_load(store: Store) -> Callable[[], object]:
    def load() -> object:
        read = store.commits.load_session("s", ActivePathScope())
        assert read is not None
        return read

    return load


def raw_load(conn: sqlite3.Connection) -> Callable[[], object]:
    head_and_totals, path = map(_form, LOAD_STATEMENTS)
    head_at, total_at = K._HEAD_AT, K._TOTAL_AT

    def load() -> object:
        conn.execute("BEGIN")
        rows = conn.execute(head_and_totals.sql, head_and_totals.bind({"sid": "s"})).fetchall()
        # The head row first (its columns, then its manifest blob's), then the totals.
        head = rows[0][head_at:total_at]
        leaf, content = head[2], head[-1]
        nodes = [
            json.loads(r[3])
            for r in conn.execute(path.sql, path.bind({"sid": "s", "leaf": leaf})).fetchall()
        ]
        json.loads(bytes(content))
        ledger = [r[total_at:] for r in rows[1:]]
        conn.commit()
        return nodes, ledger

    return load


def _chain(store: Store, lease: object, depth: int, extra: int = 0) -> None:
    """A session whose active path is ``depth`` deep, plus ``extra`` side nodes."""
    nodes = [
        SessionNodeRecord(node_id=f"p{i}", parent_node_id=f"p{i - 1}" if i else None)
        for i in range(depth)
    ]
    nodes += [SessionNodeRecord(node_id=f"x{i}", parent_node_id="p0") for i in range(extra)]
    store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id="s",
            session_execution_lease=lease,  # type: ignore[arg-type]
            graph=AppendNodes(nodes=tuple(nodes), leaf_node_id=f"p{depth - 1}"),
            usage_deltas=(UsageDelta(source="s", model="m", usage=TokenUsage(input_tokens=1)),),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", default="1000,100000")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows: list[tuple[str, float, float]] = []

        store, lease = _store(tmp / "commit-store.db")
        commit = store_commit(store, lease)
        check_same_statements("commit", commit, COMMIT_STATEMENTS)
        s_us = best_us(commit, args.n, args.rounds)
        store.close()
        upgrade(f"sqlite:///{tmp / 'commit-raw.db'}")
        r_us = best_us(raw_commit(raw_connect(tmp / "commit-raw.db")), args.n, args.rounds)
        rows.append(("commit_runtime_state: 1 node, 1 usage delta, small checkpoint", s_us, r_us))

        for depth in (10, 1000):
            path = tmp / f"load-{depth}.db"
            store, lease = _store(path)
            _chain(store, lease, depth)
            check_same_statements("active-path load", store_load(store), LOAD_STATEMENTS)
            s_us = best_us(store_load(store), args.n, args.rounds)
            store.close()
            r_us = best_us(raw_load(raw_connect(path)), args.n, args.rounds)
            rows.append((f"load_session(ActivePath), path depth {depth}", s_us, r_us))

        print("SQLite, µs per call (one-call store vs raw sqlite3 running the same statements)")
        print(f"{'operation':<64} | {'store µs':>9} | {'raw µs':>9} | {'ratio':>6}")
        print("-" * 98)
        for name, a, b in rows:
            print(f"{name:<64} | {a:>9.1f} | {b:>9.1f} | {a / b:>5.2f}x")

        sizes = [int(x) for x in args.scale.split(",") if x]
        if sizes:
            print()
            print("load_session(ActivePath) of a 10-deep path while the graph holds N nodes")
            base = None
            for size in sizes:
                path = tmp / f"scale-{size}.db"
                store, lease = _store(path)
                _chain(store, lease, 10, extra=size - 10)
                us = best_us(store_load(store), args.n, args.rounds)
                store.close()
                base = base or us
                print(f"  {size:>8,} nodes: {us:8.1f} µs  ({us / base:.2f}x)")


if __name__ == "__main__":
    main()
