"""The operator commands (sessions, runs, runtime: agentkeep.cli_operate) on both backends.

The fixture database is filled through the store API (fast): one session with
a head, a branch off its active path, usage from two sources, a lease held by
this process, a queued batch and a claimed pending input; a second session
with only queued work; three runs; a runtime with a lifecycle, a snapshot, an
ops snapshot and input states.

Covered: every command's text and ``--json`` output; paging (``--limit``,
``--after``); ``--graph mermaid|dot``; exit codes (0, 2 for a missing SQLite
file or an unreachable database, 3 for an unknown id); read-only proof on
SQLite (no file created, the database file unchanged, a writer holding
``BEGIN IMMEDIATE`` does not block ``sessions list``) and Postgres (the
transaction is read-only); the plain table fallback with ``rich`` hidden, and
rich's table on a terminal.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from agentkeep import console
from agentkeep.cli import main
from agentkeep.db import LockNamespace, lock_aggregate
from agentkeep.inspection import Inspector
from agentkeep.runs.domain import RunRecord
from agentkeep.runtime.records import (
    InputStatePersistenceRecord,
    MachineLifecycleCommit,
    OpsSnapshot,
    StoredInputState,
)
from agentkeep.runtime.session_model import Session
from agentkeep.sessions.domain import (
    Acquired,
    ActiveTurnIngress,
    CheckpointKind,
    PendingTurnInputDraft,
    QueuedWorkDraft,
    QueuedWorkPayload,
)
from agentkeep.sessions.liveness import capture_liveness
from agentkeep.sessions.records import (
    AppendNodes,
    HydratedSessionCheckpoint,
    RuntimeCommit,
    SessionNodeRecord,
    TokenUsage,
    UsageDelta,
)
from agentkeep.store import Store

SID = "sess-ops-1"
SID2 = "sess-ops-2"
RT = "rt-ops-1"
UNREACHABLE_PG = "postgresql+psycopg://postgres@127.0.0.1:1/postgres"


def _node(nid: str, parent: str | None) -> SessionNodeRecord:
    return SessionNodeRecord(node_id=nid, parent_node_id=parent, timestamp=7, payload={"n": nid})


def seed(url: str) -> dict[str, Any]:
    """Fill ``url`` (migrated, empty) through the store API; return what was written."""
    from agentkeep.sessions.domain import LeaseOwnerIdentity

    me = LeaseOwnerIdentity(
        owner_id="worker-a", incarnation_id="inc-1", liveness=capture_liveness()
    )
    with Store.open(url) as store:
        claimed = store.leases.try_claim_session_execution_lease(SID, me, 600_000)
        assert isinstance(claimed, Acquired)
        fence = claimed.lease

        def commit(nodes: tuple[SessionNodeRecord, ...], leaf: str, expected: int, u: Any) -> None:
            store.call_write(
                lambda r: r.commits.commit_runtime_state(
                    RuntimeCommit(
                        session_id=SID,
                        expected_head_revision=expected,
                        session_execution_lease=fence,
                        graph=AppendNodes(nodes=nodes, leaf_node_id=leaf),
                        checkpoint=HydratedSessionCheckpoint(turn_state={"t": expected}),
                        usage_deltas=u,
                    )
                )
            )

        commit(
            (_node("n1", None), _node("n2", "n1"), _node("side", "n1")),
            "n2",
            0,
            (
                UsageDelta(source="agent", model="m1", usage=TokenUsage(input_tokens=10)),
                UsageDelta(source="tool", model="m2", usage=TokenUsage(output_tokens=3)),
            ),
        )
        commit(
            (_node("n3", "n2"),),
            "n3",
            1,
            (UsageDelta(source="agent", model="m1", usage=TokenUsage(input_tokens=5)),),
        )
        batch = store.queue.enqueue_queued_work(
            QueuedWorkDraft(session_id=SID, payloads=(QueuedWorkPayload(kind="k", body=1),))
        )
        store.queue.enqueue_queued_work(
            QueuedWorkDraft(session_id=SID2, payloads=(QueuedWorkPayload(kind="k", body=2),))
        )
        pending = store.turn_inputs.enqueue_pending_turn_input(
            PendingTurnInputDraft(
                session_id=SID, ingress=ActiveTurnIngress(turn_id="T"), input={"text": "hi"}
            )
        )
        claim = store.turn_inputs.claim_active_turn_inputs(
            SID, fence, me, "T", CheckpointKind.AFTER_WORK, 10
        )
        assert claim is not None
        for i, status in enumerate(("pending", "running", "done")):
            record = RunRecord.new(f"R-{i}", "T-ops", 1_700_000_000 + i)
            store.runs.create(record)
            if status != "pending":
                from agentkeep.runs.domain import RunStatus

                store.runs.update_status(f"R-{i}", RunStatus(status))
        session = Session.new()
        store.runtime.commit_session_snapshot(RT, ReferenceBytes.encode(session))
        state = StoredInputState.new_accepted(None)
        store.runtime.commit_machine_lifecycle(
            RT,
            MachineLifecycleCommit(runtime_state="idle"),
            (InputStatePersistenceRecord.from_machine_snapshot(state),),
        )
        store.runtime.persist_ops_lifecycle(RT, OpsSnapshot(epoch_id="epoch-1", payload={"a": 1}))
    return {
        "fence": fence.fencing_token,
        "lease_token": fence.lease_token,
        "claim_token": claim.lease_token,
        "batch": batch.batch_id,
        "input": pending.input_id,
        "revision": session.revision,
        "session_id": session.id,
        "input_state": state.input_id,
    }


class ReferenceBytes:
    @staticmethod
    def encode(session: Session) -> bytes:
        from agentkeep.runtime.domain import ReferenceDomain

        return ReferenceDomain().encode_session(session)


@pytest.fixture
def seeded(db_url: str) -> tuple[str, dict[str, Any]]:
    return db_url, seed(db_url)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# --------------------------------------------------------------------------
# sessions


def test_sessions_list_text_and_json(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, facts = seeded
    code, out, err = run_cli(capsys, "sessions", "list", "--url", url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "SESSION", "HEAD", "LEASE", "HOLDER", "LEASE", "EXPIRES", "QUEUED", "PENDING", "UPDATED"
    ]  # fmt: skip
    assert lines[1].split()[:3] == [SID, "2", "worker-a"]
    assert lines[1].split()[4:6] == ["1", "1"]
    assert lines[2].split()[:3] == [SID2, "-", "-"]
    # aligned: every column starts at the same offset on every line
    assert lines[1].index("worker-a") == lines[0].index("LEASE HOLDER")

    rows = run_json(capsys, "sessions", "list", "--url", url)
    assert [r["session_id"] for r in rows] == [SID, SID2]
    first = rows[0]
    assert first["head_revision"] == 2
    assert first["lease_holder"] == "worker-a"
    assert first["lease_expires_at_ms"] > first["last_update_ms"] > 0
    assert (first["queued_batches"], first["pending_inputs"]) == (1, 1)
    assert rows[1] == {
        "session_id": SID2,
        "head_revision": None,
        "lease_holder": None,
        "lease_expires_at_ms": None,
        "queued_batches": 1,
        "pending_inputs": 0,
        "last_update_ms": rows[1]["last_update_ms"],
    }


def test_sessions_list_pages(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    page1 = run_json(capsys, "sessions", "list", "--url", url, "--limit", "1")
    assert [r["session_id"] for r in page1] == [SID]
    page2 = run_json(capsys, "sessions", "list", "--url", url, "--limit", "1", "--after", SID)
    assert [r["session_id"] for r in page2] == [SID2]
    assert run_json(capsys, "sessions", "list", "--url", url, "--after", SID2) == []
    code, _, err = run_cli(capsys, "sessions", "list", "--url", url, "--limit", "0")
    assert code == 2 and "limit" in err


def test_sessions_show_text(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, facts = seeded
    code, out, err = run_cli(capsys, "sessions", "show", SID, "--url", url)
    assert code == 0, err
    assert f"session {SID}" in out
    assert "head: revision 2, leaf n3, 4 nodes" in out
    assert f"lease: held by worker-a (incarnation inc-1), fencing token {facts['fence']}" in out
    assert "(live), holder alive" in out
    assert facts["input"] in out and "claimed by worker-a" in out
    assert facts["batch"] in out and "unclaimed" in out
    usage = [line.split() for line in out.splitlines() if line.startswith(("agent", "tool"))]
    assert usage == [
        ["agent", "m1", "15", "0", "0", "0", "0"],
        ["tool", "m2", "0", "3", "0", "0", "0"],
    ]
    tree = out.split("active path: 3 nodes\n", 1)[1].splitlines()
    assert tree == ["n1  ├─ +1 other branch", "└─ n2", "└─ n3"]


def test_sessions_show_json(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, facts = seeded
    got = run_json(capsys, "sessions", "show", SID, "--url", url)
    assert got["head_revision"] == 2 and got["leaf_node_id"] == "n3"
    assert got["active_path"] == ["n1", "n2", "n3"] and got["branches"] == {"n1": 1}
    lease = got["lease"]
    assert lease["held"] and not lease["expired"] and lease["liveness"] == "alive"
    assert lease["fencing_token"] == facts["fence"]
    dumped = json.dumps(got)  # tokens are never printed
    assert facts["lease_token"] not in dumped and facts["claim_token"] not in dumped
    (pending,) = got["pending_inputs"]
    assert pending["input_id"] == facts["input"] and pending["state"] == "accepted"
    assert pending["claim"]["owner_id"] == "worker-a"
    assert pending["claim"]["session_lease_generation"] == facts["fence"]
    (batch,) = got["queued_work"]
    assert batch["batch_id"] == facts["batch"] and batch["items"] == 1 and batch["claim"] is None
    assert [(u["source"], u["model"], u["input_tokens"]) for u in got["usage"]] == [
        ("agent", "m1", 15),
        ("tool", "m2", 0),
    ]


def test_sessions_show_graph_exports(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    code, out, _ = run_cli(capsys, "sessions", "show", SID, "--url", url, "--graph", "mermaid")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "flowchart TD"
    assert '  n2["side"]' in lines and "  n0 --> n2" in lines and "  n1 --> n3" in lines
    assert lines[-1] == "  class n0,n1,n3 active"
    code, out, _ = run_cli(capsys, "sessions", "show", SID, "--url", url, "--graph", "dot")
    assert code == 0
    assert out.startswith(f'digraph "{SID}" {{')
    assert '  "n1" -> "side";' in out
    assert '  "n2" -> "n3" [style=bold, color="blue"];' in out
    assert out.rstrip().endswith("}")


def test_show_unknown_ids_exit_3(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    for group in ("sessions", "runs", "runtime"):
        code, out, err = run_cli(capsys, group, "show", "nope", "--url", url)
        assert code == 3, (group, err)
        assert out == "" and "not found: nope" in err


# --------------------------------------------------------------------------
# runs and runtime


def test_runs_list_and_show(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    code, out, _ = run_cli(capsys, "runs", "list", "--url", url)
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["RUN", "TASK", "STATUS", "CREATED", "UPDATED"]
    assert [r[:3] for r in rows[1:]] == [
        ["R-0", "T-ops", "pending"],
        ["R-1", "T-ops", "running"],
        ["R-2", "T-ops", "done"],
    ]
    assert rows[1][3] == "2023-11-14T22:13:20.000Z"
    got = run_json(capsys, "runs", "list", "--url", url, "--limit", "2", "--after", "R-0")
    assert [(r["run_id"], r["status"]) for r in got] == [("R-1", "running"), ("R-2", "done")]
    code, out, _ = run_cli(capsys, "runs", "show", "R-1", "--url", url)
    assert code == 0
    assert "status           running" in out and "step entries: 0" in out
    detail = run_json(capsys, "runs", "show", "R-2", "--url", url)
    assert detail["status"] == "done" and detail["created_at"] == 1_700_000_002
    assert detail["step_entries"] == [] and detail["next_generation"] == 0


def test_runtime_list_and_show(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, facts = seeded
    code, out, _ = run_cli(capsys, "runtime", "list", "--url", url)
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == [
        "RUNTIME",
        "LIFECYCLE",
        "SNAPSHOT",
        "REVISION",
        "OUTBOX",
        "OPS",
        "EPOCH",
    ]
    assert row.split() == [RT, "idle", facts["revision"], "0", "epoch-1"]
    (listed,) = run_json(capsys, "runtime", "list", "--url", url)
    assert listed == {
        "runtime_id": RT,
        "lifecycle": "idle",
        "snapshot_revision": facts["revision"],
        "pending_outbox": 0,
        "ops_epoch": "epoch-1",
        "quarantined": False,
    }
    detail = run_json(capsys, "runtime", "show", RT, "--url", url)
    assert detail["snapshot_session_id"] == facts["session_id"]
    assert detail["input_ids"] == [facts["input_state"]]
    assert detail["binding"]["fence_token"] is None and detail["retired_epochs"] == []
    code, out, _ = run_cli(capsys, "runtime", "show", RT, "--url", url)
    assert code == 0 and f"snapshot session: {facts['session_id']}" in out
    assert "input states: 1" in out and "pending outbox: 0" in out


def test_inspector_is_usable_from_python(seeded: tuple[str, dict[str, Any]]) -> None:
    url, facts = seeded
    with Inspector.open(url) as inspector:
        assert [s.session_id for s in inspector.sessions()] == [SID, SID2]
        assert inspector.session(SID).lease is not None
        assert inspector.runtime(RT).summary.ops_epoch == "epoch-1"
        assert inspector.run("R-0").status == "pending"


# --------------------------------------------------------------------------
# Exit codes, URL resolution and read-only proof


def test_url_from_the_environment(
    seeded: tuple[str, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = seeded
    monkeypatch.setenv("AGENTKEEP_DATABASE_URL", url)
    rows = run_json(capsys, "sessions", "list")
    assert [r["session_id"] for r in rows] == [SID, SID2]


def test_sqlite_missing_file_is_exit_2_and_nothing_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite only: a missing file is refused for every inspection command, never created."""
    missing = tmp_path / "missing.db"
    url = f"sqlite:///{missing}"
    for argv in (
        ("sessions", "list"),
        ("sessions", "show", "x"),
        ("runs", "list"),
        ("runs", "show", "x"),
        ("runtime", "list"),
        ("runtime", "show", "x"),
    ):
        code, out, err = run_cli(capsys, *argv, "--url", url, "--json")
        assert code == 2, argv
        assert out == "" and "does not exist" in err and "nothing was created" in err
    assert list(tmp_path.iterdir()) == []


def test_an_unmigrated_database_is_exit_2_and_stays_empty(
    fresh_url: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fresh_url
    if backend == "sqlite":
        sqlite3.connect(_sqlite_file(url)).close()  # an empty database file
    for argv in (("sessions", "list"), ("runs", "show", "R-1"), ("runtime", "list")):
        code, out, err = run_cli(capsys, *argv, "--url", url)
        assert code == 2 and out == "", argv
        assert "is not migrated" in err and "agentkeep upgrade" in err
    engine = create_engine(url)
    try:
        assert inspect(engine).get_table_names() == []  # nothing was created
    finally:
        engine.dispose()


def test_unreachable_postgres_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "sessions", "list", "--url", UNREACHABLE_PG)
    assert code == 2 and out == ""
    assert err.startswith("agentkeep sessions: ") and "Traceback" not in err


def _sqlite_file(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def test_sqlite_inspection_never_writes_the_file(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """SQLite only: every command leaves the database file's bytes and mtime as they were."""
    if backend != "sqlite":
        pytest.skip("a SQLite file property")
    url, _ = seeded
    path = _sqlite_file(url)
    before = (hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime_ns)
    for argv in (
        ("sessions", "list"),
        ("sessions", "show", SID),
        ("runs", "list"),
        ("runs", "show", "R-0"),
        ("runtime", "list"),
        ("runtime", "show", RT),
    ):
        code, _, err = run_cli(capsys, *argv, "--url", url)
        assert code == 0, (argv, err)
    after = (hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime_ns)
    assert after == before


def test_a_held_write_lock_does_not_block_inspection(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """A writer holding the write lock with an uncommitted change (SQLite: BEGIN IMMEDIATE;
    Postgres: a store write unit holding the session's advisory lock and the head row)
    does not block ``sessions list``, which sees the last committed state."""
    url, _ = seeded
    result: dict[str, Any] = {}

    def inspect() -> None:
        with Inspector.open(url) as inspector:
            result["rows"] = inspector.sessions()

    def check_while_held() -> None:
        reader = threading.Thread(target=inspect)
        reader.start()
        reader.join(timeout=60)
        assert not reader.is_alive(), "the inspection waited for the writer"
        assert result["rows"][0].head_revision == 2  # the committed state
        code, out, _ = run_cli(capsys, "sessions", "list", "--url", url, "--json")
        assert code == 0 and json.loads(out)[0]["head_revision"] == 2

    if backend == "sqlite":
        writer = sqlite3.connect(_sqlite_file(url), isolation_level=None, timeout=0)
        try:
            writer.execute("BEGIN IMMEDIATE")
            writer.execute("UPDATE session_head SET head_revision = 99")
            check_while_held()
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        return
    with Store.open(url) as store, pytest.raises(_RollBack):
        with store.write() as uow:
            lock_aggregate(uow.driver, LockNamespace.SESSION, SID)
            uow.connection.execute(text("UPDATE session_head SET head_revision = 99"))
            check_while_held()
            raise _RollBack  # nothing of the writer is committed


class _RollBack(Exception):
    """Leaves a write unit by an error: it is rolled back."""


def test_postgres_inspection_runs_in_read_only_transactions(
    seeded: tuple[str, dict[str, Any]], backend: str
) -> None:
    """Postgres only: the inspector's transactions are READ ONLY (a write would be refused)."""
    if backend != "postgres":
        pytest.skip("a Postgres transaction property")
    url, _ = seeded
    with Inspector.open(url) as inspector, inspector._read() as conn:
        assert conn.execute(text("SHOW transaction_read_only")).scalar() == "on"
        assert conn.execute(text("SHOW transaction_isolation")).scalar() == "repeatable read"


# --------------------------------------------------------------------------
# rich and the plain fallback


@pytest.fixture
def without_rich(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real_import = builtins.__import__

    def hidden(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "rich" or name.startswith("rich."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", hidden)
    monkeypatch.setattr(
        console.importlib,
        "import_module",
        lambda name: hidden(name),
    )
    yield


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_fallback_without_rich(without_rich: None) -> None:
    assert not console.have_rich()
    out = _Tty()
    console.print_table(["A", "LONGER"], [("x", 1), ("yyyy", None)], title="t", stream=out)
    assert out.getvalue().splitlines() == ["t", "A     LONGER", "x     1", "yyyy  -"]
    empty = _Tty()
    console.print_table(["A"], [], title="nothing: 0", stream=empty)
    assert empty.getvalue() == "nothing: 0\n"  # a titled table without rows: its title alone
    err = _Tty()
    with console.Progress(stream=err) as progress:
        progress.update("sweep", 5, 10)
    assert "sweep [###############...............] 5/10" in err.getvalue()


def test_rich_table_on_a_terminal() -> None:
    pytest.importorskip("rich")
    out = _Tty()
    console.print_table(["A", "LONGER"], [("x", 1)], stream=out)
    text_out = out.getvalue()
    assert "LONGER" in text_out and "┃" in text_out  # rich's box drawing
    piped = io.StringIO()
    console.print_table(["A", "LONGER"], [("x", 1)], stream=piped)
    assert piped.getvalue().splitlines() == ["A  LONGER", "x  1"]


def test_progress_is_silent_when_piped_or_disabled() -> None:
    piped = io.StringIO()
    with console.Progress(stream=piped) as progress:
        progress.update("sweep", 1, 2)
    disabled = _Tty()
    with console.Progress(enabled=False, stream=disabled) as progress:
        progress.update("sweep", 1, 2)
    assert piped.getvalue() == "" and disabled.getvalue() == ""


def test_cli_tables_on_a_terminal_with_and_without_rich(
    seeded: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal: rich's boxed table when installed, the plain table when it is hidden."""
    pytest.importorskip("rich")
    url, _ = seeded

    def on_terminal() -> str:
        out = _Tty()
        monkeypatch.setattr("sys.stdout", out)
        assert main(["runtime", "list", "--url", url]) == 0
        return out.getvalue()

    boxed = on_terminal()
    assert "┃" in boxed and RT in boxed
    with monkeypatch.context() as hidden:
        real_import = console.importlib.import_module

        def no_rich(name: str) -> Any:
            if name == "rich":
                raise ImportError("hidden")
            return real_import(name)

        hidden.setattr(console.importlib, "import_module", no_rich)
        plain = on_terminal()
    assert plain.splitlines()[0].split()[:2] == ["RUNTIME", "LIFECYCLE"]
    assert "┃" not in plain and RT in plain


# --------------------------------------------------------------------------
# gc and vacuum


def _orphan_blob(url: str, digest: str = "f" * 64) -> None:
    """A blob no root reaches (what the GC deletes)."""
    with Store.open(url) as store, store.write() as uow:
        uow.connection.execute(
            text(
                "INSERT INTO blobs (hash, kind, compression, content) VALUES (:h, 'x', 'none', :c)"
            ),
            {"h": digest, "c": b"orphan"},
        )


def _blob_count(url: str) -> int:
    with Store.open(url) as store, store.read() as uow:
        return int(uow.connection.execute(text("SELECT COUNT(*) FROM blobs")).scalar_one())


def test_vacuum_prints_what_it_removed(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    with Store.open(url) as store:
        store.maintenance.tombstone_nodes(SID, ["side"])
    code, out, err = run_cli(capsys, "vacuum", "--session", SID2, "--url", url)
    assert (code, out, err) == (0, f"removed 0 tombstoned nodes and 0 terminal turn inputs "
                                   f"(session {SID2})\n", "")  # fmt: skip
    got = run_json(capsys, "vacuum", "--session", SID, "--url", url)
    assert got == {
        "removed_node_count": 1,
        "removed_pending_turn_input_tombstone_count": 0,
        "session_id": SID,
    }
    code, out, _ = run_cli(capsys, "vacuum", "--url", url)
    assert code == 0 and out.startswith("removed 0 tombstoned nodes") and "every session" in out


def test_gc_prints_what_it_removed(
    seeded: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded
    run_json(capsys, "gc", "--url", url)  # the seed's own superseded checkpoint
    _orphan_blob(url)
    before = _blob_count(url)
    got = run_json(capsys, "gc", "--url", url)
    assert got["deleted_blob_count"] == 1
    assert got["deleted_blob_count"] + got["retained_blob_count"] == before
    assert _blob_count(url) == got["retained_blob_count"] and got["root_count"] >= 1
    code, out, err = run_cli(capsys, "gc", "--url", url)
    assert code == 0 and err == ""
    assert out == (
        f"removed 0 unreachable blobs (kept {got['retained_blob_count']}, "
        f"reached from {got['root_count']} roots)\n"
    )


def test_maintenance_progress_callbacks(seeded: tuple[str, dict[str, Any]]) -> None:
    url, _ = seeded
    calls: list[tuple[str, int, int | None]] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        calls.append((phase, done, total))

    with Store.open(url) as store:
        blobs = _blob_count(url)
        report = store.maintenance.gc_unreachable_strict(progress=progress)
        sweep = [c for c in calls if c[0] == "sweep"]
        assert sweep[0] == ("sweep", 0, blobs) and sweep[-1] == ("sweep", blobs, blobs)
        marks = [c for c in calls if c[0] == "mark"]
        assert marks[0][1] == 0 and marks[-1][1] == marks[-1][2]
        assert report.retained_blob_count + report.deleted_blob_count == blobs
        calls.clear()
        store.maintenance.vacuum(SID, progress=progress)
        assert calls == [("vacuum", 0, 2), ("vacuum", 1, 2), ("vacuum", 2, 2)]
        calls.clear()
        store.maintenance.vacuum_all_sessions(progress=progress)
        assert calls == [("vacuum", 0, 2), ("vacuum", 1, 2), ("vacuum", 2, 2)]


def test_a_failing_progress_callback_aborts_the_gc_and_deletes_nothing(
    seeded: tuple[str, dict[str, Any]],
) -> None:
    url, _ = seeded
    _orphan_blob(url)
    with Store.open(url) as store:
        before = _blob_count(url)

        def fail(phase: str, done: int, total: int | None) -> None:
            if phase == "sweep" and done > 0:
                raise RuntimeError("progress display crashed")

        with pytest.raises(RuntimeError):
            store.maintenance.gc_unreachable_strict(progress=fail)
        assert _blob_count(url) == before  # the orphan is still there
        report = store.maintenance.gc_unreachable_strict()
        assert report.deleted_blob_count >= 1  # the orphan (and the seed's old checkpoint)
        assert _blob_count(url) == before - report.deleted_blob_count


def test_gc_progress_on_a_terminal_only(
    seeded: tuple[str, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    without_rich: None,
) -> None:
    url, _ = seeded
    terminal = _Tty()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["gc", "--url", url]) == 0
    assert "sweep [" in terminal.getvalue()  # the plain bar (rich hidden)
    quiet = _Tty()
    monkeypatch.setattr("sys.stderr", quiet)
    assert main(["gc", "--url", url, "--json"]) == 0
    assert quiet.getvalue() == ""
    piped = io.StringIO()
    monkeypatch.setattr("sys.stderr", piped)
    assert main(["vacuum", "--url", url]) == 0
    assert piped.getvalue() == ""


def test_maintenance_refuses_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite only: gc and vacuum never create a database."""
    url = f"sqlite:///{tmp_path / 'missing.db'}"
    for argv in (("gc",), ("vacuum",), ("vacuum", "--session", "s")):
        code, out, err = run_cli(capsys, *argv, "--url", url)
        assert code == 2 and out == "" and "does not exist" in err
    assert list(tmp_path.iterdir()) == []
