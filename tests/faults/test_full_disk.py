"""A full disk: the write that does not fit fails with a typed error, and nothing acked is lost.

A writer fills the database with one-call operations of three stores (runs,
queued work, runtime boundary receipts, each carrying an incompressible
payload) until a write fails. That failure, and every later one, must be an
agentkeep error; every write acknowledged before it must then be read back
intact (every row still decodes), a write that failed with a definite error
(not :class:`~agentkeep.errors.CommitOutcomeUnknown`) must have left nothing,
and the database must pass its integrity check and take writes again once
there is room.

How the disk fills:

* ``sqlite-tmpfs``: the SQLite file (and its WAL) on a 1 MiB tmpfs, next to
  a filler file that is deleted to make room again. Needs ``mount`` (root,
  and a kernel/container that permits it): skipped otherwise.
* ``sqlite-rlimit``: the writer runs in a child process whose
  ``RLIMIT_FSIZE`` stops every file at 256 KiB past the database's size
  (SIGXFSZ ignored, so writes fail with EFBIG, which SQLite reports as an
  I/O error rather than SQLITE_FULL). Works wherever ``resource`` does.
* ``postgres-tablespace``: agentkeep's tables and indexes are moved to a
  tablespace on a 3 MiB tmpfs owned by the server's user; Postgres then
  fails the write extending a full relation with ``disk_full`` (53100)
  while its WAL, on the data directory's disk, is unaffected. Needs root,
  ``mount`` and a server on this machine (its data directory visible here):
  skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sqlite3
import subprocess
import tempfile
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from agentkeep import migrations
from agentkeep.errors import AgentkeepError, CommitOutcomeUnknown, RunNotFound
from agentkeep.runs.domain import RunRecord
from agentkeep.runtime import RunBoundaryReceipt, StoredInputState
from agentkeep.sessions.domain import QueuedWorkDraft, QueuedWorkPayload
from agentkeep.store import Store
from tests.conftest import (
    BACKENDS,
    PG_ADMIN_URL,
    create_pg_database,
    drop_pg_database,
    require_postgres,
)
from tests.racing import SPAWN
from tests.support import raw_rows

pytestmark = pytest.mark.slow

SESSION = "full-s"
RUNTIME = "full-rt"
#: Writes after the first failure: each must succeed or fail typed, none may lose acked data.
AFTER_FAILURE = 5
#: Stop filling after this many acked writes: the disk never filled (a test bug).
MAX_WRITES = 5_000


def _payload() -> str:
    return os.urandom(3_000).hex()  # 6 KB that no compressor shrinks much


def fill(url: str, tag: str) -> dict[str, Any]:
    """Write until a write fails, then :data:`AFTER_FAILURE` more; what was acked and raised.

    Returns a picklable summary: ``acked`` ``{"runs": [...], "batches": [[key, id]],
    "receipts": [[run_id, seq]]}``; ``failures``: ``[kind, key, error type, typed,
    unknown outcome, traceback]`` per failed write, in order.
    """
    acked: dict[str, list[Any]] = {"runs": [], "batches": [], "receipts": []}
    failures: list[list[Any]] = []
    store = Store.open(url, busy_timeout_ms=5_000)
    try:
        n = 0
        while len(failures) <= AFTER_FAILURE and n < MAX_WRITES:
            n += 1
            kind = ("runs", "batches", "receipts")[n % 3]
            key = f"{tag}-{n}"
            try:
                if kind == "runs":
                    rid = f"R-{key}"
                    store.runs.create(RunRecord.new(rid, "T-full", n, input_json=_payload()))
                    acked["runs"].append(rid)
                elif kind == "batches":
                    body = {"data": _payload()}
                    batch = store.queue.enqueue_queued_work(
                        QueuedWorkDraft(
                            session_id=SESSION,
                            source_key=key,
                            payloads=(QueuedWorkPayload(kind="m", body=body),),
                        )
                    )
                    acked["batches"].append([key, batch.batch_id])
                else:
                    run_id = str(uuid.uuid5(uuid.NAMESPACE_URL, key))
                    receipt = RunBoundaryReceipt(
                        run_id=run_id,
                        boundary="Turn",
                        conversation_digest=_payload(),
                        sequence=n,
                    )
                    store.runtime.atomic_apply(
                        RUNTIME, None, receipt, [StoredInputState.new_accepted()]
                    )
                    acked["receipts"].append([run_id, n])
            except Exception as exc:  # noqa: BLE001 - classified here, asserted by the test
                failures.append(
                    [
                        kind,
                        key,
                        f"{type(exc).__module__}.{type(exc).__qualname__}",
                        isinstance(exc, AgentkeepError),
                        isinstance(exc, CommitOutcomeUnknown),
                        "".join(traceback.format_exception(exc)),
                    ]
                )
    finally:
        with contextlib.suppress(Exception):
            store.close()
    return {"acked": acked, "failures": failures}


def _fill_limited(url: str, tag: str, limit: int) -> dict[str, Any]:
    """:func:`fill` in a process whose files may not grow past ``limit`` bytes."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return fill(url, tag)


def _verify(url: str, outcome: dict[str, Any]) -> None:
    """The assertions of the module docstring, on ``url`` once there is room again."""
    failures = outcome["failures"]
    acked = outcome["acked"]
    print(
        f"\nacked {sum(len(v) for v in acked.values())} writes, then: "
        + "; ".join(f"{f[0]} {f[2]}{' (unknown)' if f[4] else ''}" for f in failures)
    )
    assert failures, f"the disk never filled in {MAX_WRITES} writes"
    untyped = [f for f in failures if not f[3]]
    assert not untyped, "untyped errors:\n" + "\n".join(f[5] for f in untyped)
    assert acked["runs"] and acked["batches"] and acked["receipts"], acked
    with Store.open(url) as store:
        for rid in acked["runs"]:
            assert len(store.runs.get(rid).input_json or "") == 6_000
        stored = {b.source_key: b for b in store.queue.list_queued_work(SESSION)}
        for key, bid in acked["batches"]:
            assert stored[key].batch_id == bid
            assert len(stored[key].items[0].payload.body["data"]) == 6_000
        for run_id, seq in acked["receipts"]:
            receipt = store.runtime.load_boundary_receipt(RUNTIME, run_id, seq)
            assert receipt is not None and len(receipt.conversation_digest or "") == 6_000
        for kind, key, _, _, unknown, _ in failures:  # a definite failure left nothing
            if unknown:
                continue
            if kind == "runs":
                with pytest.raises(RunNotFound):
                    store.runs.get(f"R-{key}")
            elif kind == "batches":
                assert key not in stored
            else:
                run_id = str(uuid.uuid5(uuid.NAMESPACE_URL, key))
                assert (
                    store.runtime.load_boundary_receipt(RUNTIME, run_id, int(key.rsplit("-", 1)[1]))
                    is None
                )
        # Room again: the database takes writes.
        store.runs.create(RunRecord.new("R-after", "T-full", 1, input_json=_payload()))
        assert store.runs.get("R-after").input_json is not None
    if url.startswith("sqlite"):
        assert raw_rows(url, "PRAGMA integrity_check") == [("ok",)]


def _backend(name: str) -> None:
    """Skip unless ``name`` is one of the backends under test (AGENTKEEP_TEST_BACKENDS)."""
    if name not in BACKENDS:
        pytest.skip(f"{name} is not among AGENTKEEP_TEST_BACKENDS")
    if name == "postgres":
        require_postgres()


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a new directory (skips when mounting is not permitted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="agentkeep-full-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def test_sqlite_full_tmpfs() -> None:
    _backend("sqlite")
    with small_tmpfs("1m") as disk:
        url = f"sqlite:///{disk / 'full.db'}"
        migrations.upgrade(url)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * 64 * 1024)  # deleted below to make room again
        outcome = fill(url, "tmpfs")
        filler.unlink()
        _verify(url, outcome)


def test_sqlite_full_rlimit(tmp_path: Path) -> None:
    _backend("sqlite")
    path = tmp_path / "full.db"
    url = f"sqlite:///{path}"
    migrations.upgrade(url)
    with contextlib.closing(sqlite3.connect(path)) as conn:  # an empty WAL: the limit is per file
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    limit = path.stat().st_size + 256 * 1024
    with SPAWN.Pool(1) as pool:
        outcome = pool.apply(_fill_limited, (url, "rlimit", limit))
    _verify(url, outcome)


def _move_relations(url: str, source: str, target: str) -> None:
    """Move the database's tables and indexes from tablespace ``source`` to ``target``."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for kind in ("TABLE", "INDEX"):
                conn.execute(
                    text(f"ALTER {kind} ALL IN TABLESPACE {source} SET TABLESPACE {target}")
                )
    finally:
        engine.dispose()


def test_postgres_full_tablespace() -> None:
    _backend("postgres")
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            data_dir = conn.execute(text("SHOW data_directory")).scalar()
        if not data_dir or not os.path.isdir(data_dir):
            pytest.skip(f"the Postgres server is not on this machine ({data_dir} not found)")
        owner = os.stat(data_dir)
        space = f"agentkeep_full_{uuid.uuid4().hex[:8]}"
        with small_tmpfs("3m") as disk:
            os.chown(disk, owner.st_uid, owner.st_gid)
            os.chmod(disk, 0o700)
            with admin.connect() as conn:
                conn.execute(text(f"CREATE TABLESPACE {space} LOCATION '{disk}'"))
            url = create_pg_database("agentkeep_full")
            try:
                migrations.upgrade(url)
                _move_relations(url, "pg_default", space)
                outcome = fill(url, "pg")
                disk_full = [f for f in outcome["failures"] if "No space left" in f[5]]
                assert disk_full, [f[2] for f in outcome["failures"]]
                # Room again: the agentkeep relations go back to the data directory's disk.
                _move_relations(url, space, "pg_default")
                _verify(url, outcome)
            finally:
                drop_pg_database(url)
                with admin.connect() as conn:
                    conn.execute(text(f"DROP TABLESPACE IF EXISTS {space}"))
    finally:
        admin.dispose()
