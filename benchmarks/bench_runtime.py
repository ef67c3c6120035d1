"""Runtime-store benchmark: boundary commit, input-state CAS and snapshot load vs raw sqlite3.

    .venv/bin/python benchmarks/bench_runtime.py [--n 100] [--cas-n 20] [--rounds 5]

* ``store.runtime.atomic_apply`` of a ~10 KiB reference session snapshot that
  continues the stored head (one more message per call), with a new receipt
  and 4 new input states per call.
* ``compare_and_swap_input_states_atomically`` of 256 rows, alternating
  between two values so that every call swaps.
* ``store.runtime.load_session_snapshot`` of a ~10 KiB snapshot.

Each is timed against raw ``sqlite3`` (the store's PRAGMAs, WAL) running the
repository's own statements (its ``Statement`` constants, compiled as the
store compiles them for sqlite3) in the same transaction shape
(``BEGIN IMMEDIATE``, the same SELECTs, INSERTs, upserts and fenced
UPDATEs, ``COMMIT``; the one-SELECT read runs without a transaction on both
sides; batches of upserts and the CAS's fenced swap go through
``executemany`` on both sides, the swap's row count checked on both), with the payload bytes
encoded beforehand: the raw side is the SQL alone. Before timing, one call
of each runs through the store and through the raw side on twin files with
SQLite's trace callback on: the statement texts (literals included) must be
identical, or the script exits 1; after timing, the rows both sides left
behind must be identical too.

The domain work of ``atomic_apply`` (decode the incoming snapshot, validate
its compaction intents, encode the receipt, decode the stored head, run the
boundary save guard, encode the input states) and of the CAS (validate the
batch, encode both sides) is also timed alone, without a database, to show
where the store's time goes, as atomic_apply sees them: the incoming snapshot
continues the cached head (the previous call's snapshot), so only its new
part is decoded, and the stored head is a hit of the decoded-snapshot cache.
A cold decode of the incoming snapshot (no cached head) is timed too.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from _common import raw_connect, sqlite_sql, timed, traced_store

from agentkeep import Store
from agentkeep.migrations import upgrade
from agentkeep.runtime import (
    InputStateCasOutcome,
    InputStatePersistenceRecord,
    ReferenceDomain,
    RunBoundaryReceipt,
    Session,
    StoredInputState,
    encode_receipt_sequence,
    session_model,
)
from agentkeep.runtime import boundaries as B
from agentkeep.runtime import input_cas as C
from agentkeep.runtime import inputs as I
from agentkeep.runtime import snapshot_rows as S
from agentkeep.runtime.input_cas import prepare_input_state_batch_cas
from agentkeep.runtime.inputs import encode_input_states
from agentkeep.runtime.receipts import encode_receipt

DOMAIN: Final = ReferenceDomain()
CAS_ROWS: Final = 256
INPUTS_PER_BOUNDARY: Final = 4
SNAPSHOT_BYTES: Final = 10 * 1024
ROLES: Final[tuple[Literal["user"], Literal["assistant"]]] = ("user", "assistant")

_BIND = re.compile(r"(?<![:\w]):(\w+)")


def _sql(stmt: Any, binds: Sequence[str]) -> str:
    """The text the repository hands to sqlite3 for ``stmt``, with its bind names checked."""
    sql = sqlite_sql(stmt)
    if sorted(set(_BIND.findall(sql))) != sorted(binds):
        raise SystemExit(f"benchmark out of date: {sql!r} does not bind exactly {sorted(binds)}")
    return sql


GET_SNAPSHOT: Final = _sql(S._GET, ["rt"])
UPSERT_SNAPSHOT: Final = _sql(S._UPSERT, ["rt", "data"])
CLEAR_QUARANTINE: Final = _sql(S._CLEAR_QUARANTINE, ["rt"])
INSERT_RECEIPT: Final = _sql(B._INSERT_RECEIPT, ["rt", "run", "seq", "data"])
UPSERT_INPUT: Final = _sql(I._UPSERT, ["rt", "iid", "data"])
CAS_READ: Final = _sql(C._READ, ["rt", "iid"])
CAS_SWAP: Final = _sql(C._SWAP, ["rt", "iid", "stored", "data"])


# --------------------------------------------------------------------------
# Data


def snapshot_chain(length: int, base_bytes: int) -> list[bytes]:
    """A reference session of about ``base_bytes`` encoded, then ``length`` successors.

    Each successor is the one before plus one short message (so it continues it).
    """
    session = Session.new().with_message("system", "You are a careful assistant. " * 4)
    turn = 0
    while len(DOMAIN.encode_session(session)) < base_bytes:
        text = f"message {turn}: " + "lorem ipsum dolor sit " * 12
        session = session.with_message(ROLES[turn % 2], text)
        turn += 1
    chain = [DOMAIN.encode_session(session)]
    for i in range(length):
        session = session.with_message(ROLES[(i + 1) % 2], f"ok {i}")
        chain.append(DOMAIN.encode_session(session))
    return chain


@dataclass(frozen=True)
class Boundary:
    """One atomic_apply call, as the store takes it and as the raw side writes it."""

    snapshot: bytes
    receipt: RunBoundaryReceipt
    records: tuple[InputStatePersistenceRecord, ...]
    receipt_json: bytes
    inputs_json: tuple[tuple[str, bytes], ...]


def boundaries(chain: Sequence[bytes], run_id: str) -> list[Boundary]:
    """Calls 1..n of a round: snapshot ``chain[i]``, receipt ``(run_id, i)``, 4 new inputs."""
    out = []
    for i in range(1, len(chain)):
        states = [
            StoredInputState(input_id=str(uuid.uuid4()), current_state="consumed")
            for _ in range(INPUTS_PER_BOUNDARY)
        ]
        receipt = RunBoundaryReceipt(
            run_id=run_id,
            boundary="RunCheckpoint",
            sequence=i,
            contributing_input_ids=tuple(s.input_id for s in states),
            message_count=i,
        )
        records = tuple(InputStatePersistenceRecord.from_machine_snapshot(s) for s in states)
        out.append(
            Boundary(
                chain[i],
                receipt,
                records,
                encode_receipt(receipt),
                encode_input_states(DOMAIN, records),
            )
        )
    return out


def first_receipt(run_id: str) -> RunBoundaryReceipt:
    return RunBoundaryReceipt(run_id=run_id, boundary="RunStart", sequence=0)


@dataclass(frozen=True)
class CasBatch:
    """The 256 rows in two versions; call k swaps a→b when k is even, b→a when odd."""

    a: tuple[StoredInputState, ...]
    b: tuple[StoredInputState, ...]
    a_records: tuple[InputStatePersistenceRecord, ...]
    b_records: tuple[InputStatePersistenceRecord, ...]
    a_json: tuple[bytes, ...]
    b_json: tuple[bytes, ...]

    @classmethod
    def make(cls) -> CasBatch:
        a = tuple(StoredInputState.new_accepted() for _ in range(CAS_ROWS))
        b = tuple(s.with_recovery_count(1) for s in a)
        wrap = InputStatePersistenceRecord.from_machine_snapshot
        return cls(
            a,
            b,
            tuple(wrap(s) for s in a),
            tuple(wrap(s) for s in b),
            tuple(DOMAIN.encode_input_state(s) for s in a),
            tuple(DOMAIN.encode_input_state(s) for s in b),
        )

    def seed_rows(self) -> list[tuple[str, bytes]]:
        """The rows as first stored (version a)."""
        return [(s.input_id, data) for s, data in zip(self.a, self.a_json, strict=True)]

    def store_args(self, k: int) -> tuple[Any, Any]:
        return (self.a, self.b_records) if k % 2 == 0 else (self.b, self.a_records)

    def raw_rows(self, k: int) -> list[tuple[str, bytes, bytes]]:
        exp, rep = (self.a_json, self.b_json) if k % 2 == 0 else (self.b_json, self.a_json)
        return [(s.input_id, e, r) for s, e, r in zip(self.a, exp, rep, strict=True)]


# --------------------------------------------------------------------------
# Raw sqlite3: the same statements, hand-driven


def raw_apply(
    conn: sqlite3.Connection, rt: str, snapshot: bytes, receipt: Any, inputs: Any
) -> None:
    """atomic_apply's statements: lock, read the head, upsert it, receipt, input upserts."""
    run_id, seq, receipt_json = receipt
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(GET_SNAPSHOT, {"rt": rt}).fetchone()
    conn.execute(UPSERT_SNAPSHOT, {"rt": rt, "data": snapshot})
    conn.execute(CLEAR_QUARANTINE, {"rt": rt})
    conn.execute(INSERT_RECEIPT, {"rt": rt, "run": run_id, "seq": seq, "data": receipt_json})
    conn.executemany(UPSERT_INPUT, [{"rt": rt, "iid": iid, "data": d} for iid, d in inputs])
    conn.commit()


def raw_boundary(conn: sqlite3.Connection, rt: str, b: Boundary) -> None:
    key = (b.receipt.run_id, encode_receipt_sequence(b.receipt.sequence), b.receipt_json)
    raw_apply(conn, rt, b.snapshot, key, b.inputs_json)


def raw_cas(conn: sqlite3.Connection, rt: str, rows: list[tuple[str, bytes, bytes]]) -> bool:
    """The batch CAS's statements: lock, read every row, compare in Python, fenced swap."""
    conn.execute("BEGIN IMMEDIATE")
    all_expected = all_replacements = True
    swaps = []
    for iid, expected, replacement in rows:
        row = conn.execute(CAS_READ, {"rt": rt, "iid": iid}).fetchone()
        if row is None:
            conn.commit()
            return False
        all_expected = all_expected and row[0] == expected
        all_replacements = all_replacements and row[0] == replacement
        swaps.append({"rt": rt, "iid": iid, "stored": row[0], "data": replacement})
    if all_replacements or not all_expected:
        conn.commit()
        return all_replacements
    if conn.executemany(CAS_SWAP, swaps).rowcount != len(swaps):
        raise SystemExit("raw CAS: the fence missed a row")
    conn.commit()
    return True


def raw_persist(conn: sqlite3.Connection, rt: str, rows: Sequence[tuple[str, bytes]]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(UPSERT_INPUT, [{"rt": rt, "iid": iid, "data": d} for iid, d in rows])
    conn.commit()


def raw_load(conn: sqlite3.Connection, rt: str) -> bytes:
    # One SELECT is its own snapshot: the store runs it without BEGIN/COMMIT.
    row = conn.execute(GET_SNAPSHOT, {"rt": rt}).fetchone()
    return bytes(row[0])


# --------------------------------------------------------------------------
# Same-SQL check


def _fresh(path: Path) -> Path:
    upgrade(f"sqlite:///{path}")
    return path


def table_rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    conn = raw_connect(path)
    try:
        return {
            t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall())
            for t in (
                "runtime_session_snapshots",
                "runtime_boundary_receipts",
                "runtime_input_states",
                "runtime_projection_quarantine",
            )
        }
    finally:
        conn.close()


def check_same_sql(tmp: Path) -> list[str]:
    """One call of each operation through the store and through raw sqlite3, traced."""
    a, b = _fresh(tmp / "check-store.db"), _fresh(tmp / "check-raw.db")
    rt, run_id = "rt-check", str(uuid.uuid4())
    chain = snapshot_chain(1, SNAPSHOT_BYTES)
    head, calls = chain[0], boundaries(chain, run_id)
    batch = CasBatch.make()
    problems = []
    with traced_store(a) as (store, store_trace, on):
        conn = raw_connect(b)
        store.runtime.atomic_apply(rt, head, first_receipt(run_id))
        raw_apply(conn, rt, head, (run_id, 0, encode_receipt(first_receipt(run_id))), ())
        store.runtime.persist_input_states_atomically("rt-cas", batch.a)
        raw_persist(conn, "rt-cas", batch.seed_rows())
        raw_trace: list[str] = []
        conn.set_trace_callback(raw_trace.append)
        ops: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            (
                "atomic_apply",
                lambda: store.runtime.atomic_apply(
                    rt, calls[0].snapshot, calls[0].receipt, calls[0].records
                ),
                lambda: raw_boundary(conn, rt, calls[0]),
            ),
            (
                "compare_and_swap_input_states_atomically",
                lambda: store.runtime.compare_and_swap_input_states_atomically(
                    "rt-cas", *batch.store_args(0)
                ),
                lambda: raw_cas(conn, "rt-cas", batch.raw_rows(0)),
            ),
            (
                "load_session_snapshot",
                lambda: store.runtime.load_session_snapshot(rt),
                lambda: raw_load(conn, rt),
            ),
        ]
        for name, via_store, via_raw in ops:
            store_trace.clear()
            raw_trace.clear()
            on[0] = True
            via_store()
            on[0] = False
            via_raw()
            if store_trace != raw_trace:
                problems.append(
                    f"{name}: statements differ\n  store: {[s[:90] for s in store_trace]}\n"
                    f"  raw:   {[s[:90] for s in raw_trace]}"
                )
            else:
                print(f"same SQL  {name}: {len(store_trace)} statements")
        conn.set_trace_callback(None)
        conn.close()
    if table_rows(a) != table_rows(b):
        problems.append("rows differ after the traced calls")
    return problems


# --------------------------------------------------------------------------
# Timing: rounds interleaved, best round kept

Loop = Callable[[int, int], None]


def interleaved(prepares: Sequence[Callable[[int], Loop]], n: int, rounds: int) -> list[float]:
    """µs per call of each side: best of ``rounds`` rounds of ``n`` calls, after a warm-up round.

    ``prepares[j](r)`` readies side ``j`` for round ``r`` (untimed) and returns
    its loop. Round r of every side runs before round r+1 of any, in rotating
    order, so background load hits every side alike.
    """
    best = [float("inf")] * len(prepares)
    for r in range(rounds + 1):
        for j in [(r + k) % len(prepares) for k in range(len(prepares))]:
            seconds = timed(prepares[j](r), 0, n)
            if r:
                best[j] = min(best[j], seconds)
    return [b / n * 1e6 for b in best]


def each(fn: Callable[[int], object]) -> Callable[[int], Loop]:
    """A side of :func:`interleaved` that calls ``fn(i)`` for each call index ``i``."""

    def loop(start: int, count: int) -> None:
        for i in range(start, start + count):
            fn(i)

    return lambda _round: loop


# --------------------------------------------------------------------------
# The three benchmarks

ALL_DOMAIN: Final = "all of it, as atomic_apply runs it"
COLD: Final = "decode the incoming cold (no head cached)"


def bench_apply(
    store: Store, conn: sqlite3.Connection, n: int, rounds: int
) -> tuple[list[float], dict[str, float], tuple[int, int]]:
    """atomic_apply vs raw; then its domain work alone, by piece."""
    chain = snapshot_chain(n, SNAPSHOT_BYTES - 18 * n)  # ~10 KiB on average over a round
    run_ids = [str(uuid.uuid4()) for _ in range(rounds + 1)]
    calls = [boundaries(chain, run_id) for run_id in run_ids]

    def store_round(r: int) -> Loop:
        rt = f"rt-apply-{r}"
        # Every round applies the same snapshots: forget the last round's
        # decodes, so each incoming snapshot is decoded cold, as it is live
        # (the stored head is then the previous call's: a hit, as it is live).
        session_model.DECODED_SESSIONS.clear()
        store.runtime.atomic_apply(rt, chain[0], first_receipt(run_ids[r]))
        mine = calls[r]
        apply = store.runtime.atomic_apply

        def loop(start: int, count: int) -> None:
            for b in mine[start : start + count]:
                apply(rt, b.snapshot, b.receipt, b.records)

        return loop

    def raw_round(r: int) -> Loop:
        rt = f"rt-apply-{r}"
        first = first_receipt(run_ids[r])
        raw_apply(conn, rt, chain[0], (first.run_id, 0, encode_receipt(first)), ())
        mine = calls[r]

        def loop(start: int, count: int) -> None:
            for b in mine[start : start + count]:
                raw_boundary(conn, rt, b)

        return loop

    # The domain work alone (no database), call i on round 0's data: the same sizes.
    round0 = calls[0]
    decoded = [DOMAIN.decode_incoming_session(s) for s in chain]

    # As atomic_apply sees them: the incoming snapshot is new but continues
    # the cached head (decoded from its new part only), the stored head is the
    # previous call's incoming one (a cache hit). A snapshot that continues
    # no cached one is decoded in full (cold).
    cache = session_model.DECODED_SESSIONS

    def decode_incoming(i: int) -> object:
        cache.clear()
        cache.put(chain[i], decoded[i])  # the head, as the previous call left it
        return DOMAIN.decode_incoming_session(round0[i].snapshot)

    def decode_cold(i: int) -> object:
        cache.clear()
        return DOMAIN.decode_incoming_session(round0[i].snapshot)

    def decode_head(i: int) -> object:
        cache.put(chain[i], decoded[i])
        return DOMAIN.decode_persisted_session(chain[i])

    def guard(i: int) -> None:
        DOMAIN.validated_compaction_intents(decoded[i + 1])
        DOMAIN.boundary_save_guard(decoded[i + 1], decoded[i])

    def encodes(i: int) -> object:
        encode_receipt(round0[i].receipt)
        return encode_input_states(DOMAIN, [r.into_stored() for r in round0[i].records])

    def all_domain(i: int) -> None:
        b = round0[i]
        cache.clear()
        cache.put(chain[i], decoded[i])
        incoming = DOMAIN.decode_incoming_session(b.snapshot)
        DOMAIN.validated_compaction_intents(incoming)
        encode_receipt(b.receipt)
        head = DOMAIN.decode_persisted_session(chain[i])
        DOMAIN.boundary_save_guard(incoming, head)
        encode_input_states(DOMAIN, [r.into_stored() for r in b.records])

    pieces = (
        ("decode the incoming (it continues the head)", decode_incoming),
        ("decode the stored head (a cache hit)", decode_head),
        ("validate intents + boundary save guard", guard),
        ("encode the receipt + 4 input states", encodes),
        (ALL_DOMAIN, all_domain),
        (COLD, decode_cold),
    )
    us = interleaved([store_round, raw_round, *(each(fn) for _, fn in pieces)], n, rounds)
    by_piece = {name: t for (name, _), t in zip(pieces, us[2:], strict=True)}
    return us[:2], by_piece, (len(chain[1]), len(chain[-1]))


def bench_cas(
    store: Store, conn: sqlite3.Connection, n: int, rounds: int
) -> tuple[list[float], float]:
    """The 256-row batch CAS vs raw; then its prepare step (validate + encode) alone."""
    batch = CasBatch.make()
    rt = "rt-cas"
    store.runtime.persist_input_states_atomically(rt, batch.a)
    raw_persist(conn, rt, batch.seed_rows())
    raw_rows = (batch.raw_rows(0), batch.raw_rows(1))
    counters = [0, 0]
    cas = store.runtime.compare_and_swap_input_states_atomically

    def store_loop(_start: int, count: int) -> None:
        for _ in range(count):
            exp, rep = batch.store_args(counters[0])
            if cas(rt, exp, rep) is not InputStateCasOutcome.SWAPPED:
                raise SystemExit("store CAS did not swap")
            counters[0] += 1

    def raw_loop(_start: int, count: int) -> None:
        for _ in range(count):
            if not raw_cas(conn, rt, raw_rows[counters[1] % 2]):
                raise SystemExit("raw CAS did not swap")
            counters[1] += 1

    def prepare(i: int) -> object:
        return prepare_input_state_batch_cas(DOMAIN, *batch.store_args(i))

    us = interleaved([lambda _r: store_loop, lambda _r: raw_loop, each(prepare)], n, rounds)
    if counters[0] != counters[1]:
        raise SystemExit("the CAS sides ran different call counts")
    return us[:2], us[2]


def bench_load(
    store: Store, conn: sqlite3.Connection, n: int, rounds: int
) -> tuple[list[float], int]:
    snapshot = snapshot_chain(0, SNAPSHOT_BYTES)[0]
    rt, first = "rt-load", first_receipt(str(uuid.uuid4()))
    store.runtime.atomic_apply(rt, snapshot, first)
    raw_apply(conn, rt, snapshot, (first.run_id, 0, encode_receipt(first)), ())
    load = store.runtime.load_session_snapshot

    def store_loop(_start: int, count: int) -> None:
        for _ in range(count):
            load(rt)

    def raw_loop(_start: int, count: int) -> None:
        for _ in range(count):
            raw_load(conn, rt)

    return interleaved([lambda _r: store_loop, lambda _r: raw_loop], n, rounds), len(snapshot)


# --------------------------------------------------------------------------


def _row(name: str, store_us: float, raw_us: float) -> str:
    return (
        f"{name:<50} | {store_us:>9.1f} | {1e6 / store_us:>9,.0f} | {raw_us:>8.1f} | "
        f"{1e6 / raw_us:>9,.0f} | {store_us / raw_us:>5.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="calls per round (apply, load)")
    parser.add_argument("--cas-n", type=int, default=20, help="calls per round (256-row CAS)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (best kept)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        problems = check_same_sql(tmp)
        if problems:
            print("\n".join(problems), file=sys.stderr)
            raise SystemExit(1)

        store_path, raw_path = _fresh(tmp / "store.db"), _fresh(tmp / "raw.db")
        store = Store.open(f"sqlite:///{store_path}")
        conn = raw_connect(raw_path)
        try:
            apply_us, pieces, sizes = bench_apply(store, conn, args.n, args.rounds)
            cas_us, prepare_us = bench_cas(store, conn, args.cas_n, args.rounds)
            load_us, load_size = bench_load(store, conn, args.n, args.rounds)
        finally:
            store.close()
            conn.close()
        if table_rows(store_path) != table_rows(raw_path):
            print("the store and raw files hold different rows after the run", file=sys.stderr)
            raise SystemExit(1)

    print()
    print(
        f"SQLite file DBs (WAL, synchronous=NORMAL), one process; best of {args.rounds} rounds "
        f"of {args.n} calls ({args.cas_n} for the CAS), rounds interleaved"
    )
    header = (
        f"{'operation':<50} | {'store µs':>9} | {'store/s':>9} | {'raw µs':>8} | "
        f"{'raw/s':>9} | {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    print(
        _row(
            f"atomic_apply: {sizes[0] / 1024:.1f}–{sizes[1] / 1024:.1f} KiB snapshot, 4 inputs",
            *apply_us,
        )
    )
    print(_row(f"compare_and_swap_input_states_atomically: {CAS_ROWS}", *cas_us))
    print(_row(f"load_session_snapshot: {load_size / 1024:.1f} KiB", *load_us))
    print("(ratio = store µs / raw µs; raw = the same statements with pre-encoded bytes)")

    store_us, raw_us = apply_us
    domain_us = pieces[ALL_DOMAIN]
    print()
    print("Where atomic_apply's time goes (µs per call):")
    for name, us in pieces.items():
        if name not in (ALL_DOMAIN, COLD):
            print(f"  domain: {name:<44} {us:>8.1f}")
    rest = store_us - domain_us - raw_us
    for name, us in (
        ("domain work (decode + guard + encode), alone", domain_us),
        ("SQL (raw sqlite3, same statements)", raw_us),
        ("the rest (unit of work, pool, driver, retry)", rest),
    ):
        print(f"  {name:<52} {us:>8.1f}  {us / store_us:>4.0%}")
    print(f"  {'atomic_apply, one call':<52} {store_us:>8.1f}")
    print(f"  (for comparison) domain: {COLD:<35} {pieces[COLD]:>8.1f}")

    store_us, raw_us = cas_us
    print()
    print(f"Where the {CAS_ROWS}-row CAS's time goes (µs per call):")
    for name, us in (
        ("domain: validate the batch + encode both sides", prepare_us),
        ("SQL (raw sqlite3, same statements)", raw_us),
        ("the rest", store_us - prepare_us - raw_us),
    ):
        print(f"  {name:<52} {us:>8.1f}  {us / store_us:>4.0%}")


if __name__ == "__main__":
    main()
