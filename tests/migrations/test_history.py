"""The migration history itself (design §5, spec runs §1.4, §6.3), on SQLite and Postgres.

Every database test runs on both backends through ``fresh_url`` (an empty,
unmigrated database of the backend).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory

from agentkeep import migrations as migrate
from agentkeep.errors import LegacySchemaMismatch, SchemaBehind, SchemaNewer
from agentkeep.runs.domain import RunRecord
from agentkeep.store import Store
from tests.support import plain_engine, raw_exec, raw_rows

from . import _legacy as L
from ._alembic_cli import REPO_ROOT, run_alembic

CHAIN = ("runs_0001", "runs_0002", "runs_0003", "runs_0004", "runs_0005", "runs_0006")

#: The runs columns at each revision (spec runs §1.2, §1.4): literal, not read from the code.
REV_COLUMNS: dict[str, set[str]] = {
    "runs_0001": set(L.L0_COLUMNS),
    "runs_0002": set(L.L0_COLUMNS) | {"degradations_json"},
    "runs_0003": set(L.L0_COLUMNS) | {"degradations_json", "input_json"},
    "runs_0004": set(L.L0_COLUMNS) | {"degradations_json", "input_json", "current_json"},
    "runs_0005": {n for n, _ in L.FULL_COLUMNS},
    "runs_0006": {n for n, _ in L.FULL_COLUMNS} | {"seq"},
}

SESSION_TABLES = {
    "session_execution_leases",
    "queued_work_batches",
    "queued_work_items",
    "pending_turn_inputs",
    "session_head",
    "graph_nodes",
    "usage_deltas",
    "runtime_turn_commits",
    "attachment_manifest",
    "blobs",
    "artifact_refs",
    "session_meta",
    "session_pending_writes",
    "session_usage_totals",
}
RUNTIME_TABLES = {
    "runtime_input_states",
    "runtime_boundary_receipts",
    "runtime_session_snapshots",
    "runtime_states",
    "runtime_ops_lifecycle",
    "runtime_retired_ops_epochs",
    "runtime_auth_oauth_flow_state",
    "runtime_projection_quarantine",
    "runtime_compaction_projection_outbox",
    "runtime_mob_host_bindings",
    "runtime_mob_host_revocations",
}
#: Every agentkeep table at head, per backend (runs_seq_counter is SQLite-only).
OUR_TABLES = {"runs", "runs_seq_counter"} | SESSION_TABLES | RUNTIME_TABLES


# ----------------------------------------------------------------------------
# Helpers (work on either backend)


def tables(url: str) -> set[str]:
    engine = plain_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def schema(url: str) -> dict[str, Any]:
    """Columns (type, nullability, default) and indexes of every table."""
    engine = plain_engine(url)
    try:
        insp = sa.inspect(engine)
        out: dict[str, Any] = {}
        for t in sorted(insp.get_table_names()):
            cols = [
                (c["name"], str(c["type"]), c["nullable"], c.get("default"))
                for c in insp.get_columns(t)
            ]
            idx = sorted(
                (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                for i in insp.get_indexes(t)
            )
            out[t] = (sorted(cols), idx)
        return out
    finally:
        engine.dispose()


def runs_columns(url: str) -> set[str]:
    engine = plain_engine(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns("runs")}
    finally:
        engine.dispose()


def sqlite_path(url: str) -> Path | None:
    u = sa.make_url(url)
    return Path(u.database) if u.get_backend_name() == "sqlite" and u.database else None


def state(url: str) -> dict[str, Any]:
    """What a refused or no-op call must leave exactly as it was."""
    s: dict[str, Any] = {"schema": schema(url)}
    if migrate.VERSION_TABLE in s["schema"]:
        if sqlite_path(url) is None:  # xmin changes whenever the row is rewritten
            s["version"] = raw_rows(
                url, f"SELECT version_num, xmin::text FROM {migrate.VERSION_TABLE} ORDER BY 1"
            )
        else:
            s["version"] = raw_rows(
                url, f"SELECT version_num FROM {migrate.VERSION_TABLE} ORDER BY 1"
            )
    path = sqlite_path(url)
    if path is not None:
        s["sha256"] = L.sha256(path)
    return s


def insert_l0_row(url: str, run_id: str, created_at: int) -> None:
    raw_exec(
        url,
        "INSERT INTO runs (id, task_id, status, step_entries_json, created_at, updated_at)"
        " VALUES (:id, 'T-1', '\"pending\"', '[]', :c, :c)",
        params={"id": run_id, "c": created_at},
    )


# ----------------------------------------------------------------------------
# The history


def test_exactly_one_head() -> None:
    """No database: the scripts form one lineage with a single head."""
    scripts = ScriptDirectory.from_config(Config(str(REPO_ROOT / "alembic.ini")))
    heads = scripts.get_heads()
    assert len(heads) == 1
    assert len(migrate.head_revisions()) == 1
    assert set(migrate.head_revisions()) == set(heads)
    every = {r.revision for r in scripts.walk_revisions()}
    assert set(CHAIN) <= every
    # runs_0001 is the base of the runs branch, each next one revises the previous.
    assert scripts.get_revision("runs_0001").down_revision is None
    assert "runs" in scripts.get_revision("runs_0001").branch_labels
    for prev, rev in zip(CHAIN, CHAIN[1:], strict=False):
        assert scripts.get_revision(rev).down_revision == prev


def test_empty_database_upgrades_to_head_without_drift(fresh_url: str, backend: str) -> None:
    assert migrate.current(fresh_url) == ()
    assert migrate.upgrade(fresh_url) == migrate.head_revisions()
    assert migrate.current(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []
    want = OUR_TABLES if backend == "sqlite" else OUR_TABLES - {"runs_seq_counter"}
    assert tables(fresh_url) == want | {migrate.VERSION_TABLE}
    assert runs_columns(fresh_url) == REV_COLUMNS["runs_0006"]


def test_head_to_base_and_back(fresh_url: str, backend: str) -> None:
    migrate.upgrade(fresh_url)
    insert_l0_row(fresh_url, "R-1", 10)

    assert migrate.downgrade(fresh_url, "base") == ()

    assert migrate.current(fresh_url) == ()
    assert tables(fresh_url) <= {migrate.VERSION_TABLE}
    if backend == "postgres":
        assert raw_rows(fresh_url, "SELECT relname FROM pg_class WHERE relkind = 'S'") == []
    else:
        path = sqlite_path(fresh_url)
        assert path is not None
        assert L.names(path) <= {
            "sqlite_sequence",  # SQLite's own AUTOINCREMENT bookkeeping, never dropped
            migrate.VERSION_TABLE,
            f"sqlite_autoindex_{migrate.VERSION_TABLE}_1",
        }

    assert migrate.upgrade(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []
    assert raw_rows(fresh_url, "SELECT COUNT(*) FROM runs") == [(0,)]


def test_step_by_step_up_and_down(fresh_url: str) -> None:
    seen: dict[str, Any] = {}
    for i, rev in enumerate(CHAIN):
        assert migrate.upgrade(fresh_url, rev) == (rev,)
        assert migrate.current(fresh_url) == (rev,)
        assert runs_columns(fresh_url) == REV_COLUMNS[rev]
        if i == 0:
            insert_l0_row(fresh_url, "R-1", 10)
        assert raw_rows(fresh_url, "SELECT id, created_at FROM runs") == [("R-1", 10)]
        seen[rev] = schema(fresh_url)
    # At the end of the runs chain, the other branches bring the database to head...
    assert migrate.upgrade(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []
    # ...and leave again without touching the runs chain.
    assert migrate.downgrade(fresh_url, "sessions@base") == (CHAIN[-1], "runtime_0002")
    assert migrate.downgrade(fresh_url, "runtime@base") == (CHAIN[-1],)
    assert schema(fresh_url) == seen[CHAIN[-1]]
    assert raw_rows(fresh_url, "SELECT degradations_json, next_generation FROM runs") == [("[]", 0)]

    for rev in reversed(CHAIN[:-1]):
        assert migrate.downgrade(fresh_url, rev) == (rev,)
        assert migrate.current(fresh_url) == (rev,)
        assert runs_columns(fresh_url) == REV_COLUMNS[rev]
        # Downgrading lands on exactly the schema the upgrade built at that revision.
        assert schema(fresh_url) == seen[rev], rev
        assert raw_rows(fresh_url, "SELECT id, created_at FROM runs") == [("R-1", 10)]
    assert migrate.downgrade(fresh_url, "base") == ()
    assert "runs" not in tables(fresh_url)


def test_upgrading_at_head_again_is_a_noop(fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    insert_l0_row(fresh_url, "R-1", 10)
    before = state(fresh_url)

    assert migrate.upgrade(fresh_url) == migrate.head_revisions()
    Store.open(fresh_url, migrate=True).close()

    assert state(fresh_url) == before


# ----------------------------------------------------------------------------
# Refusals and fail-fast on open


@pytest.mark.parametrize("stamp", ["extra_row", "replaced"])
@pytest.mark.parametrize("entry", ["upgrade", "downgrade", "store_open", "store_open_migrate"])
def test_unknown_revision_is_refused_and_nothing_changes(
    fresh_url: str, entry: str, stamp: str
) -> None:
    migrate.upgrade(fresh_url)
    insert_l0_row(fresh_url, "R-1", 10)
    if stamp == "extra_row":
        raw_exec(
            fresh_url, f"INSERT INTO {migrate.VERSION_TABLE} (version_num) VALUES ('zzzz_9999')"
        )
    else:
        raw_exec(fresh_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'zzzz_9999'")
    before = state(fresh_url)

    with pytest.raises(SchemaNewer) as info:
        if entry == "upgrade":
            migrate.upgrade(fresh_url)
        elif entry == "downgrade":
            migrate.downgrade(fresh_url, "base")
        else:
            Store.open(fresh_url, migrate=entry == "store_open_migrate").close()

    message = str(info.value)
    assert "zzzz_9999" in message
    for head in migrate.head_revisions():
        assert head in message
    assert info.value.current == ("zzzz_9999",)
    assert info.value.head == migrate.head_revisions()
    assert state(fresh_url) == before
    assert raw_rows(fresh_url, "SELECT id FROM runs") == [("R-1",)]


@pytest.mark.parametrize("start", [None, "runs_0003"], ids=["empty", "at_runs_0003"])
def test_open_behind_head_fails_fast_then_migrate_true_upgrades(
    fresh_url: str, start: str | None
) -> None:
    if start is not None:
        migrate.upgrade(fresh_url, start)
    before = schema(fresh_url)

    with pytest.raises(SchemaBehind) as info:
        Store.open(fresh_url)

    assert "agentkeep upgrade" in str(info.value)
    assert info.value.current == (() if start is None else (start,))
    assert info.value.head == migrate.head_revisions()
    assert schema(fresh_url) == before
    if start is None:
        assert tables(fresh_url) == set()

    with Store.open(fresh_url, migrate=True) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))
        assert store.runs.get("R-1").created_at == 10
    assert migrate.current(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []


def test_unversioned_runs_table_is_adopted_on_sqlite_refused_on_postgres(
    fresh_url: str, backend: str
) -> None:
    """Spec §1.5/§1.7: no Postgres database predates agentkeep, so only SQLite adopts."""
    raw_exec(fresh_url, L.create_table_sql(L.FULL_COLUMNS))
    raw_exec(fresh_url, L.INDEX_SQL)
    insert_l0_row(fresh_url, "R-1", 10)
    before = state(fresh_url)

    if backend == "postgres":
        with pytest.raises(LegacySchemaMismatch) as info:
            migrate.upgrade(fresh_url)
        assert "Postgres" in str(info.value)
        assert state(fresh_url) == before
        assert migrate.VERSION_TABLE not in tables(fresh_url)
    else:
        assert migrate.upgrade(fresh_url) == migrate.head_revisions()
        assert migrate.check(fresh_url) == []
    assert raw_rows(fresh_url, "SELECT id, created_at FROM runs") == [("R-1", 10)]


# ----------------------------------------------------------------------------
# The alembic command line from the repository root


@pytest.mark.parametrize("via", ["x_arg", "env_var"])
def test_alembic_command_line(fresh_url: str, via: str) -> None:
    default_db = REPO_ROOT / "agentkeep.db"  # alembic.ini's fallback URL must not be used
    default_existed = default_db.exists()
    kw = {"url": fresh_url} if via == "x_arg" else {"env_url": fresh_url}

    up = run_alembic("upgrade", "head", **kw)
    assert up.returncode == 0, up.stderr
    cur = run_alembic("current", **kw)
    assert cur.returncode == 0, cur.stderr
    for head in migrate.head_revisions():
        assert f"{head} (head)" in cur.stdout

    assert migrate.current(fresh_url) == migrate.head_revisions()
    assert migrate.check(fresh_url) == []
    assert default_db.exists() == default_existed


# ----------------------------------------------------------------------------
# seq (runs_0006)

ROWS_AT_0005 = [("R-c", 100), ("R-a", 100), ("R-b", 90), ("R-d", 95)]


def _seed_at_0005(url: str) -> None:
    migrate.upgrade(url, "runs_0005")
    for run_id, created_at in ROWS_AT_0005:
        insert_l0_row(url, run_id, created_at)


def _ids_by_seq(url: str) -> list[str]:
    return [r[0] for r in raw_rows(url, "SELECT id FROM runs ORDER BY seq")]


def test_seq_backfill_order(fresh_url: str, backend: str) -> None:
    _seed_at_0005(fresh_url)
    if backend == "sqlite":  # rowid order, the old tie-break
        want = [r[0] for r in raw_rows(fresh_url, "SELECT id FROM runs ORDER BY rowid")]
    else:  # no rowid on Postgres: created_at, then id
        want = [i for i, _ in sorted(ROWS_AT_0005, key=lambda r: (r[1], r[0]))]
    assert want != sorted(want)  # the fixture distinguishes the orders

    migrate.upgrade(fresh_url)

    assert _ids_by_seq(fresh_url) == want
    seqs = [r[0] for r in raw_rows(fresh_url, "SELECT seq FROM runs")]
    assert None not in seqs and len(set(seqs)) == len(seqs)


def _foreign_insert(url: str, run_id: str) -> None:
    """An insert that omits seq, as the original store's SQL would."""
    path = sqlite_path(url)
    if path is not None:  # the sqlite3 module, like any older writer of the file
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute(
                "INSERT INTO runs (id, task_id, status, step_entries_json, created_at,"
                " updated_at) VALUES (?, 'T-1', '\"pending\"', '[]', 1, 1)",
                (run_id,),
            )
        finally:
            conn.close()
    else:
        insert_l0_row(url, run_id, 1)


def _seq_of(url: str, run_id: str) -> int:
    rows = raw_rows(url, "SELECT seq FROM runs WHERE id = :id", {"id": run_id})
    assert rows and rows[0][0] is not None, run_id
    return int(rows[0][0])


def _max_seq(url: str) -> int:
    return int(raw_rows(url, "SELECT MAX(seq) FROM runs")[0][0])


def test_seq_is_filled_for_inserts_that_omit_it_and_never_reused(fresh_url: str) -> None:
    _seed_at_0005(fresh_url)
    migrate.upgrade(fresh_url)

    top = _max_seq(fresh_url)
    _foreign_insert(fresh_url, "R-new1")
    s1 = _seq_of(fresh_url, "R-new1")
    assert s1 > top

    raw_exec(fresh_url, "DELETE FROM runs WHERE id = 'R-new1'")  # the newest row goes away
    _foreign_insert(fresh_url, "R-new2")
    s2 = _seq_of(fresh_url, "R-new2")
    assert s2 > s1  # not reused

    with Store.open(fresh_url) as store:
        store.runs.create(RunRecord.new("R-new3", "T-1", 1))
    assert _seq_of(fresh_url, "R-new3") > s2
    assert _ids_by_seq(fresh_url)[-2:] == ["R-new2", "R-new3"]
    seqs = [r[0] for r in raw_rows(fresh_url, "SELECT seq FROM runs")]
    assert len(set(seqs)) == len(seqs)
