"""Namespaces: agentkeep in a database whose own tables are named like agentkeep's.

The host's database already has tables ``runs``, ``blobs`` and
``session_head`` of its own, with rows. With ``schema="agentkeep"`` every
store, migration and command runs in agentkeep's namespace (a Postgres schema;
on SQLite the file ``<db>.agentkeep<suffix>`` attached next to the database)
and leaves the host's tables exactly as they were. Every test runs on SQLite
and Postgres unless named ``test_sqlite_*`` / ``test_postgres_*``.

* every store (runs, leases, queue, turn inputs, session commits, maintenance,
  runtime) writes and reads in the namespace; a fence race there has exactly
  one winner; the host's rows are untouched;
* migrations in the namespace: upgrade, current, check, downgrade, stamp, the
  refusal of a namespace behind head, ``agentkeep.migrate(connection,
  schema=...)`` on the host's connection, offline SQL;
* two namespaces of one database are independent (rows, revisions, and on
  Postgres their advisory locks);
* the host's engine and joined units with a schema;
* ``include_object_for(schema)`` hides agentkeep's objects in its schema and
  not the host's tables of the same names;
* the ``--schema`` option of the command line;
* refusals: invalid names, in-memory SQLite.
"""

from __future__ import annotations

import io
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Engine, MetaData, Table, Text, create_engine, inspect, text
from sqlalchemy.orm import Session

import agentkeep
from agentkeep import db
from agentkeep import migrations as migrate
from agentkeep.cli import main
from agentkeep.clock import SettableClock
from agentkeep.errors import InvalidInput, LegacySchemaMismatch, SchemaBehind
from agentkeep.runs.domain import RunRecord, RunStatus
from agentkeep.store import Store
from tests.racing import Racing

T0 = 1_700_000_000_000
HEAD = migrate.head_revisions()
NS = "agentkeep"

#: The host's own tables, named like agentkeep's, with rows of its own.
HOST_DDL = (
    "CREATE TABLE runs (id TEXT PRIMARY KEY, owner TEXT NOT NULL)",
    "CREATE TABLE blobs (hash TEXT PRIMARY KEY, size INTEGER NOT NULL)",
    "CREATE TABLE session_head (session_id TEXT PRIMARY KEY, note TEXT)",
)
HOST_ROWS = (
    "INSERT INTO runs VALUES ('R-1', 'alice'), ('R-2', 'bob')",
    "INSERT INTO blobs VALUES ('h0', 7)",
    "INSERT INTO session_head VALUES ('host-session', 'mine')",
)


def _execute(url: str, *statements: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for sql in statements:
                conn.execute(text(sql))
    finally:
        engine.dispose()


def host_state(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """The host's own tables and their rows, read in the default namespace."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {
                name: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY 1"))]
                for name in ("runs", "blobs", "session_head")
            }
    finally:
        engine.dispose()


HOST_STATE = {
    "runs": [("R-1", "alice"), ("R-2", "bob")],
    "blobs": [("h0", 7)],
    "session_head": [("host-session", "mine")],
}


@pytest.fixture
def host_url(fresh_url: str) -> str:
    """A database of the host, with its own ``runs``, ``blobs`` and ``session_head``."""
    _execute(fresh_url, *HOST_DDL, *HOST_ROWS)
    return fresh_url


@pytest.fixture
def ns_store(host_url: str) -> Iterator[Store]:
    """``Store.open(host_url, schema="agentkeep", migrate=True)`` with a settable clock."""
    store = Store.open(host_url, schema=NS, migrate=True, clock=SettableClock(T0))
    yield store
    store.close()


def namespace_tables(url: str, schema: str) -> set[str]:
    """The tables of namespace ``schema`` (SQLite: of its own file)."""
    if url.startswith("sqlite"):
        path = db.sqlite_schema_file(url.removeprefix("sqlite:///"), schema)
        if not path.exists():
            return set()
        conn = sqlite3.connect(path)
        try:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
            return {r[0] for r in rows if not r[0].startswith("sqlite_")}
        finally:
            conn.close()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names(schema=schema))
    finally:
        engine.dispose()


def default_tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


# ---------------------------------------------------------------- every store in a schema


def test_without_a_schema_the_hosts_runs_table_is_refused(host_url: str) -> None:
    """Why the namespace exists: in the default one, the host's ``runs`` is not agentkeep's."""
    with pytest.raises(LegacySchemaMismatch):
        Store.open(host_url, migrate=True)
    assert host_state(host_url) == HOST_STATE
    assert default_tables(host_url) == {"runs", "blobs", "session_head"}


def test_every_store_writes_and_reads_in_the_schema(ns_store: Store, host_url: str) -> None:
    from agentkeep.runtime import ReferenceDomain, RunBoundaryReceipt, StoredInputState
    from agentkeep.runtime import Session as RuntimeSession
    from agentkeep.sessions.domain import (
        Acquired,
        ClaimBoundary,
        LeaseOwnerIdentity,
        QueuedWorkDraft,
        QueuedWorkPayload,
    )
    from agentkeep.sessions.liveness import capture_liveness
    from agentkeep.sessions.records import (
        AppendNodes,
        HydratedSessionCheckpoint,
        RuntimeCommit,
        SessionNodeRecord,
        TurnCommitStamp,
    )

    store = ns_store
    assert store.schema == NS
    # runs: the host has in its own runs table; agentkeep's runs is empty.
    assert store.runs.list() == []
    store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))  # the host's id, no clash
    assert store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
    assert not store.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
    gen, _ = store.runs.acquire_assignee("R-1", "planner", "S-1", "plans")
    assert store.runs.get("R-1").status == RunStatus.RUNNING
    assert [r.id for r in store.runs.list()] == ["R-1"]

    # sessions: lease, queue, a turn commit, turn inputs, load.
    me = LeaseOwnerIdentity(owner_id="w-1", incarnation_id="boot", liveness=capture_liveness())
    store.queue.enqueue_queued_work(
        QueuedWorkDraft(
            session_id="host-session",  # the host's session_head has this id too
            payloads=(QueuedWorkPayload(kind="user_message", body={"text": "hi"}),),
        )
    )
    outcome = store.leases.try_claim_session_execution_lease("host-session", me, ttl_ms=30_000)
    assert isinstance(outcome, Acquired)
    lease = outcome.lease
    claim = store.queue.claim_ready_queued_work("host-session", lease, me, ClaimBoundary.IDLE, 4)
    assert claim is not None
    result = store.commits.commit_runtime_state(
        RuntimeCommit(
            session_id="host-session",
            expected_head_revision=store.commits.get_head_revision("host-session"),
            session_execution_lease=lease,
            graph=AppendNodes(
                nodes=(SessionNodeRecord(node_id="n1", payload={"role": "user"}),),
                leaf_node_id="n1",
            ),
            checkpoint=HydratedSessionCheckpoint(turn_state={"step": 1}),
            turn_commit=TurnCommitStamp(
                session_id="host-session", turn_id="t1", turn_commit_hash="h1"
            ),
            completed_queue_claims=(claim.completion(),),
            release_session_execution_lease=lease,
        )
    )
    assert result is not None
    assert store.commits.get_head_revision("host-session") == 1
    assert store.queue.list_pending_queued_work("host-session") == []
    assert store.turn_inputs.list_turn_inputs("host-session") == []
    assert store.maintenance.gc_unreachable_strict() is not None

    # runtime: one boundary, then its input states.
    domain = ReferenceDomain()
    session = RuntimeSession.new().with_message("user", "hello")
    accepted = StoredInputState.new_accepted()
    receipt = RunBoundaryReceipt(run_id=str(uuid.uuid4()), boundary="RunStart", sequence=1)
    store.runtime.atomic_apply(
        "rt-1", domain.encode_session(session), receipt, [accepted], session_store_key=session.id
    )
    assert [s.input_id for s in store.runtime.load_input_states("rt-1")] == [accepted.input_id]

    # Everything landed in the namespace; the host's tables are as they were.
    assert host_state(host_url) == HOST_STATE
    assert {"runs", "blobs", "session_head", migrate.VERSION_TABLE} <= namespace_tables(
        host_url, NS
    )
    assert default_tables(host_url) == {"runs", "blobs", "session_head"}


RACING = Racing(threads=4, processes=3, clock_ms=T0, store_kwargs={"schema": NS})
proc_pool = RACING.pool_fixture()


def _body_transition(store: Store, i: int, barrier: Any, params: dict[str, Any]) -> list[bool]:
    won = []
    for run_id in params["runs"]:
        barrier.wait()
        won.append(store.runs.try_transition(run_id, RunStatus.PENDING, RunStatus.RUNNING))
    return won


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_a_fence_race_in_the_schema_has_one_winner(
    request: pytest.FixtureRequest, ns_store: Store, host_url: str, kind: str
) -> None:
    runs = [f"R-{k}" for k in range(5)]
    for run_id in runs:
        ns_store.runs.create(RunRecord.new(run_id, "T-1", created_at=1))
    results = RACING.run(request, kind, host_url, _body_transition, {"runs": runs})
    for k, run_id in enumerate(runs):
        assert sum(r[k] for r in results) == 1, run_id
        assert ns_store.runs.get(run_id).status == RunStatus.RUNNING
    assert host_state(host_url) == HOST_STATE


# ---------------------------------------------------------------- migrations in a schema


def test_migrations_run_in_the_schema(host_url: str) -> None:
    assert migrate.current(host_url, schema=NS) == ()
    assert migrate.check(host_url, schema=NS) == [
        migrate.NOT_MIGRATED.replace("`agentkeep upgrade`", f"`agentkeep upgrade --schema {NS}`")
    ]
    assert migrate.upgrade(host_url, schema=NS) == HEAD
    assert migrate.upgrade(host_url, schema=NS) == HEAD  # again: a no-op
    assert migrate.current(host_url, schema=NS) == HEAD
    assert migrate.check(host_url, schema=NS) == []
    # The default namespace is untouched: un-versioned, the host's tables only.
    assert migrate.current(host_url) == ()
    assert default_tables(host_url) == {"runs", "blobs", "session_head"}

    down = migrate.downgrade(host_url, "runs_0005", schema=NS)
    assert "runs_0005" in down
    assert migrate.check(host_url, schema=NS)[0].startswith("behind head: revision")
    with pytest.raises(SchemaBehind, match=f"--schema {NS}"):
        Store.open(host_url, schema=NS)
    assert migrate.upgrade(host_url, schema=NS) == HEAD
    assert migrate.stamp(host_url, "heads", schema=NS) == HEAD
    assert migrate.downgrade(host_url, "base", schema=NS) == ()
    assert migrate.current(host_url, schema=NS) == ()
    assert namespace_tables(host_url, NS) <= {migrate.VERSION_TABLE}
    assert host_state(host_url) == HOST_STATE


def test_postgres_the_schema_holds_the_sequence_and_the_version_table(
    backend: str, host_url: str
) -> None:
    if backend != "postgres":
        pytest.skip("Postgres only: schemas and sequences")
    migrate.upgrade(host_url, schema=NS)
    engine = create_engine(host_url)
    try:
        with engine.connect() as conn:
            seqs = conn.execute(
                text(
                    "SELECT sequence_schema, sequence_name FROM information_schema.sequences "
                    "WHERE sequence_name = 'runs_seq_seq'"
                )
            ).fetchall()
            default = conn.execute(
                text(
                    "SELECT column_default FROM information_schema.columns WHERE "
                    "table_schema = :s AND table_name = 'runs' AND column_name = 'seq'"
                ),
                {"s": NS},
            ).scalar_one()
            versions = conn.execute(
                text(f"SELECT version_num FROM {NS}.{migrate.VERSION_TABLE}")
            ).fetchall()
            path = conn.execute(text("SHOW search_path")).scalar_one()
    finally:
        engine.dispose()
    assert seqs == [(NS, "runs_seq_seq")]
    assert default == f"nextval('{NS}.runs_seq_seq'::regclass)"
    assert sorted(v[0] for v in versions) == list(HEAD)
    assert NS not in path  # the migration's SET LOCAL did not outlive it


def test_sqlite_the_namespace_is_a_file_next_to_the_database(backend: str, host_url: str) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite only: the namespace file")
    main_file = Path(host_url.removeprefix("sqlite:///"))
    with Store.open(host_url, schema=NS, migrate=True) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
        with store.engine.connect() as conn:
            files = {r[1]: r[2] for r in conn.exec_driver_sql("PRAGMA database_list")}
            modes = {
                name: conn.exec_driver_sql(f"PRAGMA {name}.journal_mode").scalar()
                for name in ("main", NS)
            }
    namespace_file = main_file.with_name(f"{main_file.stem}.{NS}{main_file.suffix}")
    assert files[NS] == str(namespace_file.resolve())
    assert modes == {"main": "delete", NS: "wal"}  # the host's file keeps its journal mode
    conn2 = sqlite3.connect(namespace_file)
    try:
        assert conn2.execute("SELECT id FROM runs").fetchall() == [("R-1",)]
    finally:
        conn2.close()
    assert host_state(host_url) == HOST_STATE


def test_migrate_on_the_hosts_connection_in_a_schema(backend: str, host_url: str) -> None:
    """``agentkeep.migrate(connection, schema=...)``, as a host's env.py calls it."""
    engine = create_engine(host_url)
    try:
        with engine.connect() as conn:
            with conn.begin():
                assert agentkeep.migrate(conn, schema=NS) == HEAD
                assert conn.get_execution_options().get("schema_translate_map") is None
                if backend == "postgres":  # the host's search_path is as it was
                    assert NS not in conn.execute(text("SHOW search_path")).scalar_one()
                conn.execute(text("INSERT INTO runs VALUES ('R-3', 'carol')"))
            if backend == "postgres":  # inside the host's transaction: a rollback undoes it
                with conn.begin() as tx:
                    assert agentkeep.migrate(conn, schema="other") == HEAD
                    tx.rollback()
    finally:
        engine.dispose()
    assert migrate.current(host_url, schema=NS) == HEAD
    assert migrate.current(host_url, schema="other") == ()
    assert host_state(host_url)["runs"] == [("R-1", "alice"), ("R-2", "bob"), ("R-3", "carol")]


def test_offline_sql_in_a_schema(backend: str, host_url: str) -> None:
    out = io.StringIO()
    assert migrate.upgrade_sql(host_url, output=out, schema=NS) == HEAD
    sql = out.getvalue()
    if backend == "postgres":
        assert f'CREATE SCHEMA IF NOT EXISTS "{NS}"' in sql
        assert f'SET LOCAL search_path TO "{NS}"' in sql
        assert f"CREATE TABLE {NS}.{migrate.VERSION_TABLE}" in sql
        assert f"pg_advisory_xact_lock({db.LockNamespace.MIGRATION}, 0)" not in sql
        # The script works: run it, then the namespace is at head without drift.
        engine = create_engine(host_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.connection.driver_connection.execute(sql)  # type: ignore[union-attr]
        finally:
            engine.dispose()
    else:
        path = db.sqlite_schema_file(host_url.removeprefix("sqlite:///"), NS)
        assert sql.startswith(
            f"-- agentkeep's namespace {NS}: apply this script to the file {path}"
        )
        conn = sqlite3.connect(path)
        try:
            conn.executescript(sql.split("\n", 1)[1])
        finally:
            conn.close()
    assert migrate.current(host_url, schema=NS) == HEAD
    assert migrate.check(host_url, schema=NS) == []
    assert host_state(host_url) == HOST_STATE


# ---------------------------------------------------------------- two namespaces


def test_two_schemas_in_one_database_are_independent(host_url: str) -> None:
    a = Store.open(host_url, schema="ns_a", migrate=True, clock=SettableClock(T0))
    b = Store.open(host_url, schema="ns_b", migrate=True, clock=SettableClock(T0))
    try:
        a.runs.create(RunRecord.new("R-1", "T-a", created_at=1))
        b.runs.create(RunRecord.new("R-1", "T-b", created_at=2))
        assert a.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
        assert b.runs.get("R-1").status == RunStatus.PENDING
        assert (a.runs.get("R-1").task_id, b.runs.get("R-1").task_id) == ("T-a", "T-b")
        # Each namespace holds its own OAuth flow state, so its own authority key.
        key_a, key_b = a.runtime.auth_authority_key(), b.runtime.auth_authority_key()
        assert key_a is not None and key_b is not None
        assert key_a.endswith("#ns_a") and key_b.endswith("#ns_b")
        assert key_a.removesuffix("#ns_a") == key_b.removesuffix("#ns_b")
        migrate.downgrade(host_url, "base", schema="ns_b")
        assert migrate.current(host_url, schema="ns_a") == HEAD
        assert a.runs.get("R-1").task_id == "T-a"
    finally:
        a.close()
        b.close()
    assert host_state(host_url) == HOST_STATE


def test_postgres_two_schemas_do_not_share_advisory_locks(backend: str, host_url: str) -> None:
    """Holding run R-1's lock in one schema does not block a writer of R-1 in another."""
    if backend != "postgres":
        pytest.skip("Postgres only: advisory locks (SQLite's write lock is one per database)")
    assert db.migration_lock_key(None) == 0
    assert len({db.migration_lock_key(s) for s in (None, "ns_a", "ns_b")}) == 3
    a = Store.open(host_url, schema="ns_a", migrate=True, busy_timeout_ms=2_000)
    b = Store.open(host_url, schema="ns_b", migrate=True, busy_timeout_ms=2_000)
    same = Store.open(host_url, schema="ns_a")
    try:
        a.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
        b.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
        with a.write() as uow:
            db.lock_aggregate(uow.driver, db.LockNamespace.RUN, "R-1")
            started = time.monotonic()
            assert b.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
            assert time.monotonic() - started < 1.5
            # The same schema's writer of R-1 does wait for the lock.
            done = threading.Event()

            def blocked() -> None:
                try:
                    same.runs.try_transition("R-1", RunStatus.PENDING, RunStatus.RUNNING)
                finally:
                    done.set()

            t = threading.Thread(target=blocked, daemon=True)
            t.start()
            assert not done.wait(0.3)
        t.join(10)
        assert done.is_set()
        assert a.runs.get("R-1").status == RunStatus.RUNNING
    finally:
        for s in (a, b, same):
            s.close()


# ---------------------------------------------------------------- the host's engine, joined units


def _host_runs(url: str) -> list[tuple[Any, ...]]:
    return host_state(url)["runs"]


@pytest.mark.parametrize("via", ["session", "connection"])
def test_joined_units_in_a_schema_commit_and_roll_back_with_the_host(
    host_url: str, via: str
) -> None:
    engine = create_engine(host_url)  # the host's engine, SQLAlchemy's defaults
    try:
        store = Store.open(engine, schema=NS, migrate=True, clock=SettableClock(T0))

        def host_unit(run_id: str, owner: str, *, commit: bool) -> None:
            if via == "session":
                with Session(engine) as session:
                    session.execute(text(f"INSERT INTO runs VALUES ('{run_id}', '{owner}')"))
                    with store.write(join=session) as uow:
                        uow.runs.create(RunRecord.new(run_id, "T-1", created_at=1))
                    if commit:
                        session.commit()
                    else:
                        session.rollback()
            else:
                with engine.connect() as conn:
                    conn.execute(text(f"INSERT INTO runs VALUES ('{run_id}', '{owner}')"))
                    with store.write(join=conn) as uow:
                        uow.runs.create(RunRecord.new(run_id, "T-1", created_at=1))
                    if commit:
                        conn.commit()
                    else:
                        conn.rollback()

        host_unit("R-J1", "joined", commit=True)
        host_unit("R-J2", "rolled back", commit=False)
        assert [r.id for r in store.runs.list()] == ["R-J1"]
        assert _host_runs(host_url) == [("R-1", "alice"), ("R-2", "bob"), ("R-J1", "joined")]
        with engine.connect() as conn, store.read(join=conn) as uow:
            assert uow.runs.get("R-J1").id == "R-J1"
        store.close()
    finally:
        engine.dispose()


def test_sqlite_a_connection_without_the_namespace_is_attached_when_joined(
    backend: str, host_url: str
) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite only: attached namespace files")
    migrate.upgrade(host_url, schema=NS)
    engine = create_engine(host_url)
    try:
        early = engine.connect()  # checked out before the store installs its hooks
        store = Store.open(engine, schema=NS)
        with store.write(join=early) as uow:
            uow.runs.create(RunRecord.new("R-E1", "T-1", created_at=1))
        early.commit()
        early.close()
        # A connection without the namespace, inside a transaction that has written
        # (the host's), is attached when it joins, and its commit covers both files.
        with engine.connect() as conn:
            conn.connection.info.pop("agentkeep.attached", None)
            conn.exec_driver_sql(f"DETACH DATABASE {NS}")
            conn.execute(text("INSERT INTO runs VALUES ('R-9', 'x')"))
            with store.write(join=conn) as uow:
                uow.runs.create(RunRecord.new("R-E2", "T-1", created_at=1))
            conn.commit()
        assert store.runs.get("R-E2").id == "R-E2"
        assert ("R-9", "x") in _host_runs(host_url)
        assert store.runs.get("R-E1").id == "R-E1"
        store.close()
    finally:
        engine.dispose()


# ---------------------------------------------------------------- include_object_for


def _table(name: str, schema: str | None = None) -> Table:
    return Table(name, MetaData(), Column("id", Text, primary_key=True), schema=schema)


def test_include_object_hides_agentkeep_only_in_its_own_namespace() -> None:
    plain = migrate.include_object
    in_ns = migrate.include_object_for(NS)
    host_runs, our_runs, other_runs = _table("runs"), _table("runs", NS), _table("runs", "sales")
    assert not plain(host_runs, "runs", "table", True, None)  # default namespace: ours
    assert plain(our_runs, "runs", "table", True, None)
    assert plain(other_runs, "runs", "table", True, None)  # a host table in another schema
    assert in_ns(host_runs, "runs", "table", True, None)  # the host's own runs
    assert not in_ns(our_runs, "runs", "table", True, None)
    assert in_ns(other_runs, "runs", "table", True, None)
    assert not in_ns(_table(migrate.VERSION_TABLE, NS), migrate.VERSION_TABLE, "table", True, None)
    column = our_runs.c.id
    assert not in_ns(column, "id", "column", True, None)
    assert in_ns(host_runs.c.id, "id", "column", True, None)
    assert in_ns(_table("host_orders"), "host_orders", "table", True, None)
    assert migrate.include_object_for(None)(host_runs, "runs", "table", True, None) is False
    with pytest.raises(InvalidInput):
        migrate.include_object_for("Bad-Name")


def test_include_object_for_in_a_hosts_autogenerate(host_url: str) -> None:
    """A host comparing every schema sees its own tables, never agentkeep's namespace."""
    with Store.open(host_url, schema=NS, migrate=True) as store:
        host_metadata = MetaData()  # the host's models: its blobs and session_head, not runs
        Table("blobs", host_metadata, Column("hash", Text, primary_key=True))
        Table("session_head", host_metadata, Column("session_id", Text, primary_key=True))
        with store.engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_object": migrate.include_object_for(NS),
                    "target_metadata": host_metadata,
                },
            )
            diffs = compare_metadata(ctx, host_metadata)
    removed = {
        (d[1].schema, d[1].name) for d in diffs if isinstance(d, tuple) and d[0] == "remove_table"
    }
    assert (None, "runs") in removed  # the host's own runs table is still the host's business
    assert not {s for s, _ in removed} & {NS}  # nothing of agentkeep's namespace


# ---------------------------------------------------------------- the command line


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_schema_option(capsys: pytest.CaptureFixture[str], host_url: str) -> None:
    head = ", ".join(HEAD)
    assert run_cli(capsys, "current", "--schema", NS, host_url) == (
        0,
        f"none (un-versioned or empty) (behind head {head}) in schema {NS}\n",
        "",
    )
    code, out, _ = run_cli(capsys, "check", "--schema", NS, host_url)
    assert (code, out) == (1, f"{migrate.NOT_MIGRATED[:-1]} --schema {NS}`\n")
    assert run_cli(capsys, "upgrade", "--schema", NS, host_url) == (
        0,
        f"at head: {head} in schema {NS}\n",
        "",
    )
    assert run_cli(capsys, "current", "--schema", NS, "--url", host_url)[1] == (
        f"{head} (head) in schema {NS}\n"
    )
    assert run_cli(capsys, "check", host_url, "--schema", NS)[:2] == (
        0,
        "no drift: the database matches the models at head\n",
    )
    code, out, _ = run_cli(capsys, "downgrade", "runs_0005", "--schema", NS, host_url)
    assert code == 0 and out.startswith("at: ") and out.endswith(f" in schema {NS}\n")
    code, out, _ = run_cli(capsys, "heads", "-i", "--schema", NS, host_url)
    assert code == 0 and head in out and "(current)" not in out
    assert run_cli(capsys, "stamp", "heads", "--schema", NS, host_url)[0] == 2  # tables behind
    assert run_cli(capsys, "upgrade", "--schema", NS, host_url)[0] == 0
    code, out, _ = run_cli(capsys, "history", "-i", "--schema", NS, host_url)
    assert code == 0 and f"{HEAD[0]} " in out and "(current)" in out
    assert run_cli(capsys, "current", host_url)[1].startswith("none")  # default namespace
    code, _, err = run_cli(capsys, "upgrade", "--schema", "Bad", host_url)
    assert code == 2 and "not a namespace name" in err
    assert host_state(host_url) == HOST_STATE


def test_sqlite_cli_schema_on_a_missing_database(
    capsys: pytest.CaptureFixture[str], backend: str, tmp_path: Path
) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite only: files")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    code, _, err = run_cli(capsys, "current", "--schema", NS, url)
    assert code == 2 and "does not exist" in err
    assert run_cli(capsys, "upgrade", "--schema", NS, url)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [
        "app.agentkeep.db",
        "app.db",
    ]
    (tmp_path / "app.agentkeep.db").unlink()
    code, _, err = run_cli(capsys, "downgrade", "base", "--schema", NS, url)
    assert code == 2 and "app.agentkeep.db" in err and f"agentkeep upgrade --schema {NS}`" in err
    assert not (tmp_path / "app.agentkeep.db").exists()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "name", ["", "Agentkeep", "1st", "a-b", "main", "temp", "public", "pg_x", "sqlite_x", "x" * 64]
)
def test_invalid_schema_names_are_refused(name: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(InvalidInput, match="schema"):
        Store.open(url, schema=name)
    with pytest.raises(InvalidInput, match="schema"):
        migrate.upgrade(url, schema=name)
    assert not (tmp_path / "x.db").exists()


def test_sqlite_in_memory_namespace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="in-memory"):
        Store.open("sqlite://", schema=NS)
    with pytest.raises(InvalidInput, match="in-memory"):
        migrate.upgrade("sqlite://", schema=NS)
    engine = create_engine("sqlite://")
    try:
        with pytest.raises(InvalidInput, match="in-memory"):
            Store.open(engine, schema=NS)
    finally:
        engine.dispose()


def test_host_engine_store_needs_no_schema_on_its_other_stores(host_url: str) -> None:
    """A second store without a schema on the same engine is the default namespace, refused
    here because the host's ``runs`` is in it; the namespaced store is unaffected."""
    engine: Engine = create_engine(host_url)
    try:
        with Store.open(engine, schema=NS, migrate=True) as store:
            with pytest.raises(LegacySchemaMismatch):
                Store.open(engine, migrate=True)
            store.runs.create(RunRecord.new("R-1", "T-1", created_at=1))
            assert store.runs.get("R-1").id == "R-1"
    finally:
        engine.dispose()
    assert host_state(host_url) == HOST_STATE
