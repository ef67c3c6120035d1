"""Every statement is built from the models and compiles for every target it serves.

* Every :class:`~agentkeep.statements.Statement` the package defines compiles
  for SQLite (``named``, ``qmark``) and Postgres (``pyformat``,
  ``numeric_dollar``), and runs against a migrated database: SQLite
  ``EXPLAIN`` (which prepares the statement against the real schema) and
  Postgres ``PREPARE``. A statement that no longer matches the models or the
  migrations fails here, not in production.
* The same with the schema map ``{None: "agentkeep"}``: every statement a
  store runs names the namespace and prepares against a database migrated in
  it (SQLite: the namespace file attached), beside a host's own ``runs``.
* The compile step itself: positional binding, fixed literal values, schema
  translation, and refusal of constructs whose SQL is only known at execution
  time.
"""

from __future__ import annotations

import importlib
import pkgutil
import sqlite3
from collections.abc import Iterator

import pytest
from sqlalchemy import Integer, bindparam, column, create_engine, literal, select, table, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Dialect

import agentkeep
from agentkeep import db
from agentkeep import migrations as migrate
from agentkeep.legacy.connections import _PG_AUDIT_DDL, _SQLITE_AUDIT_DDL
from agentkeep.sessions import checkpoint_nodes, commits
from agentkeep.statements import CompileTarget, Statement, UncompilableStatement


def _all_statements() -> list[Statement]:
    """Import every module of the package, then every statement it defined."""
    for info in pkgutil.walk_packages(agentkeep.__path__, "agentkeep."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    return [s for s in Statement.registry if not s.name.startswith("test.")]


STATEMENTS = _all_statements()
#: Statements that run only on Postgres (a repository checks ``driver.postgres``
#: first): they use Postgres functions or writable CTEs.
POSTGRES_ONLY = frozenset(
    {
        "runs.transition_alone",
        "runs.set_slots_alone",
        "runs.set_steps_alone",
        "runs.set_degradations_alone",
        "runs.set_status_alone",
        "runs.set_result_alone",
        "runs.set_input_alone",
        "runs.delete_alone",
        "leases.release_alone",
        "catalog.delete_all",
    }
)
#: The commit's folded ledger write (a data-modifying CTE): sent only on Postgres.
POSTGRES_ONLY |= frozenset(s.name for s in commits._PUT_USAGE_AND_TOTALS.values())
POSTGRES_ONLY |= frozenset(s.name for s in commits._PUT_HEAD_WITH_BLOBS.values())
#: The checkpoint puts' checking lease reads (``current_setting``) and the writes
#: folded into them as data-modifying CTEs: sent only on psycopg.
POSTGRES_ONLY |= {
    checkpoint_nodes._FREE_LEASE_READ.name,
    checkpoint_nodes._FENCED_LEASE_READ.name,
    *(s.name for s in checkpoint_nodes._FOLDED.values()),
}
#: Statements that run only on SQLite (the repository checks ``driver.postgres``
#: first): the checkpoint puts with LEASE_GUARD folded in (``INSERT … SELECT`` of
#: untyped parameters, which Postgres would read as text).
SQLITE_ONLY = frozenset(
    s.name
    for s in (
        *checkpoint_nodes._SQLITE_PUT_NODE.values(),
        *checkpoint_nodes._SQLITE_ADD_WRITES.values(),
    )
)


def _sqlite_dialect(paramstyle: str) -> Dialect:
    return sqlite.dialect(paramstyle=paramstyle)


def _pg_dialect(paramstyle: str) -> Dialect:
    from sqlalchemy.dialects.postgresql import psycopg

    return psycopg.dialect(paramstyle=paramstyle)


def test_the_package_defines_its_statements() -> None:
    names = [s.name for s in STATEMENTS]
    assert len(STATEMENTS) >= 100, "statements were not collected"
    assert all(names), "every statement has a name"
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize(
    "dialect",
    [
        _sqlite_dialect("named"),
        _sqlite_dialect("qmark"),
        _pg_dialect("pyformat"),
        _pg_dialect("numeric_dollar"),
    ],
    ids=["sqlite-named", "sqlite-qmark", "pg-pyformat", "pg-numeric_dollar"],
)
def test_every_statement_compiles_for_every_paramstyle(dialect: Dialect) -> None:
    target = CompileTarget.of(dialect)
    for stmt in STATEMENTS:
        form = stmt.compiled(target)
        assert form.sql
        if target.positional:
            assert form.names is not None
        else:
            assert form.names is None


@pytest.fixture
def migrated(db_url: str) -> Iterator[str]:
    yield db_url


def _placeholders(stmt: Statement, target: CompileTarget) -> tuple[str, object]:
    form = stmt.compiled(target)
    if form.names is not None:
        return form.sql, tuple(None for _ in form.names)
    names = {b for b in _bind_names(stmt, target)}
    return form.sql, dict.fromkeys(names)


def _bind_names(stmt: Statement, target: CompileTarget) -> set[str]:
    compiled = stmt.construct(target.dialect).compile(dialect=target.dialect)
    return set(compiled.bind_names.values())


def test_every_statement_prepares_against_the_migrated_schema(backend: str, migrated: str) -> None:
    """SQLite EXPLAIN / Postgres PREPARE each statement on a database at head."""
    failures: list[str] = []
    if backend == "sqlite":
        target = CompileTarget.of(_sqlite_dialect("named"))
        path = migrated.removeprefix("sqlite:///")
        conn = sqlite3.connect(path)
        try:
            for ddl in _SQLITE_AUDIT_DDL:  # the legacy migrator's own table
                conn.execute(ddl)
            for stmt in STATEMENTS:
                if stmt.name.startswith("advisory_lock") or stmt.name in POSTGRES_ONLY:
                    continue  # Postgres functions: taken only on Postgres
                sql, params = _placeholders(stmt, target)
                try:
                    conn.execute("EXPLAIN " + sql, params).fetchall()
                except sqlite3.Error as exc:
                    failures.append(f"{stmt.name}: {exc}")
        finally:
            conn.close()
    else:
        target = CompileTarget.of(_pg_dialect("numeric_dollar"))
        engine = create_engine(migrated)
        try:
            with engine.connect() as conn:
                for ddl in _PG_AUDIT_DDL:  # the legacy migrator's own table (rolled back)
                    conn.exec_driver_sql(ddl)
                for i, stmt in enumerate(STATEMENTS):
                    if stmt.name in SQLITE_ONLY:
                        continue
                    sql = stmt.compiled(target).sql
                    try:
                        with conn.begin_nested():
                            conn.exec_driver_sql(f"PREPARE ak_check_{i} AS {sql}")
                            conn.exec_driver_sql(f"DEALLOCATE ak_check_{i}")
                    except Exception as exc:  # noqa: BLE001 - report every failure at once
                        failures.append(f"{stmt.name}: {exc}")
                conn.rollback()
        finally:
            engine.dispose()
    assert not failures, "\n".join(failures)


def _namespaced(stmt: Statement) -> bool:
    """Statements a store runs in its namespace (the legacy migrator's run on the default one)."""
    return not stmt.name.startswith(("advisory_lock", "legacy."))


def test_every_statement_prepares_in_a_schema(backend: str, fresh_url: str) -> None:
    """With the schema map ``{None: "agentkeep"}`` every statement names agentkeep's
    namespace and prepares against it, beside a host's own ``runs`` of another shape
    (a statement that named the default namespace would fail on the host's table)."""
    schema = "agentkeep"
    engine = create_engine(fresh_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE runs (host_only TEXT PRIMARY KEY)"))
    engine.dispose()
    migrate.upgrade(fresh_url, schema=schema)
    statements = [s for s in STATEMENTS if _namespaced(s)]
    failures: list[str] = []
    if backend == "sqlite":
        target = CompileTarget.of(_sqlite_dialect("named"), {None: schema})
        path = fresh_url.removeprefix("sqlite:///")
        conn = sqlite3.connect(path)
        try:
            conn.execute(
                f"ATTACH DATABASE ? AS {schema}", (str(db.sqlite_schema_file(path, schema)),)
            )
            for stmt in statements:
                if stmt.name in POSTGRES_ONLY:
                    continue
                sql, params = _placeholders(stmt, target)
                if f"{schema}." not in sql:
                    failures.append(f"{stmt.name}: does not name the schema")
                try:
                    conn.execute("EXPLAIN " + sql, params).fetchall()
                except sqlite3.Error as exc:
                    failures.append(f"{stmt.name}: {exc}")
        finally:
            conn.close()
    else:
        target = CompileTarget.of(_pg_dialect("numeric_dollar"), {None: schema})
        engine = create_engine(fresh_url)
        try:
            with engine.connect() as conn:
                for i, stmt in enumerate(statements):
                    if stmt.name in SQLITE_ONLY:
                        continue
                    sql = stmt.compiled(target).sql
                    if f"{schema}." not in sql:
                        failures.append(f"{stmt.name}: does not name the schema")
                    try:
                        with conn.begin_nested():
                            conn.exec_driver_sql(f"PREPARE ak_ns_{i} AS {sql}")
                            conn.exec_driver_sql(f"DEALLOCATE ak_ns_{i}")
                    except Exception as exc:  # noqa: BLE001 - report every failure at once
                        failures.append(f"{stmt.name}: {exc}")
                conn.rollback()
        finally:
            engine.dispose()
    assert len(statements) >= 100
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- the compile step

_T = table("t", column("id"), column("state"), column("n", Integer))


def test_named_paramstyle_binds_the_dict_as_is() -> None:
    stmt = Statement(
        select(_T.c.id).where(_T.c.id == bindparam("id"), _T.c.n > bindparam("n")),
        name="test.named",
    )
    form = stmt.compiled(CompileTarget.of(_sqlite_dialect("named")))
    assert form.sql == "SELECT t.id \nFROM t \nWHERE t.id = :id AND t.n > :n"
    params = {"id": "a", "n": 1}
    assert form.bind(params) is params


@pytest.mark.parametrize(
    ("dialect", "placeholder", "names", "bound"),
    [
        (_sqlite_dialect("qmark"), "?", ("low", "id", "low"), (3, "x", 3)),
        # $1 is written twice: each name is bound once
        (_pg_dialect("numeric_dollar"), "$1", ("low", "id"), (3, "x")),
    ],
)
def test_positional_paramstyles_bind_in_statement_order(
    dialect: Dialect, placeholder: str, names: tuple[str, ...], bound: tuple[object, ...]
) -> None:
    stmt = Statement(
        select(_T.c.id).where(
            _T.c.n > bindparam("low"), _T.c.id == bindparam("id"), _T.c.n < bindparam("low")
        ),
        name="test.positional",
    )
    form = stmt.compiled(CompileTarget.of(dialect))
    assert placeholder in form.sql
    assert form.names == names
    assert form.bind({"id": "x", "low": 3}) == bound
    with pytest.raises(KeyError, match="'low' was not given"):
        form.bind({"id": "x"})


def test_literal_values_in_a_construct_are_bound_for_every_call() -> None:
    stmt = Statement(
        _T.update().values(state=literal("finalized")).where(_T.c.id == bindparam("id")),
        name="test.fixed",
    )
    named = stmt.compiled(CompileTarget.of(_sqlite_dialect("named")))
    assert "finalized" not in named.sql
    assert named.bind({"id": "a"}) == {"id": "a", **(named.fixed or {})}
    assert list((named.fixed or {}).values()) == ["finalized"]
    qmark = stmt.compiled(CompileTarget.of(_sqlite_dialect("qmark")))
    assert qmark.bind({"id": "a"}) == ("finalized", "a")


def test_statement_runs_with_sqlite3_in_both_sqlite_paramstyles() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (id TEXT, state TEXT, n INTEGER)")
    conn.execute("INSERT INTO t VALUES ('a', 'x', 5), ('b', 'y', 9)")
    stmt = Statement(
        select(_T.c.id).where(_T.c.n > bindparam("low")).order_by(_T.c.id), name="test.run"
    )
    for style in ("named", "qmark"):
        form = stmt.compiled(CompileTarget.of(_sqlite_dialect(style)))
        assert conn.execute(form.sql, form.bind({"low": 6})).fetchall() == [("b",)]
    conn.close()


def test_schema_translate_map_renders_the_schema() -> None:
    from agentkeep.runs.models import Run

    stmt = Statement(select(Run.id).where(Run.id == bindparam("id")), name="test.schema")
    target = CompileTarget.of(_pg_dialect("pyformat"), {None: "agentkeep"})
    assert target is CompileTarget.of(_pg_dialect("pyformat"), {None: "agentkeep"})
    assert target is not CompileTarget.of(_pg_dialect("pyformat"))
    sql = stmt.compiled(target).sql
    assert "FROM agentkeep.runs" in sql
    assert "FROM runs" in stmt.compiled(CompileTarget.of(_pg_dialect("pyformat"))).sql


def test_expanding_parameters_are_refused() -> None:
    stmt = Statement(
        select(_T.c.id).where(_T.c.id.in_(bindparam("ids", expanding=True))), name="test.expand"
    )
    with pytest.raises(UncompilableStatement, match="execution time"):
        stmt.compiled(CompileTarget.of(_sqlite_dialect("named")))


def test_a_statement_that_does_not_match_the_schema_fails_the_prepare_check(
    tmp_path: object,
) -> None:
    """The EXPLAIN check is not vacuous: a column the database lacks is reported."""
    ghost = table("runs", column("no_such_column"))
    stmt = Statement(select(ghost.c.no_such_column), name="test.ghost")
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE runs (id TEXT)")
    sql = stmt.compiled(CompileTarget.of(_sqlite_dialect("named"))).sql
    with pytest.raises(sqlite3.OperationalError, match="no_such_column"):
        conn.execute("EXPLAIN " + sql)
    conn.close()


def test_unsupported_paramstyle_is_refused() -> None:
    d = _sqlite_dialect("named")
    d.paramstyle = "bogus"
    with pytest.raises(UncompilableStatement, match="bogus"):
        CompileTarget.of(d)


def test_text_is_not_a_statement_source() -> None:
    """Plain text compiles (it is a ClauseElement) but names nothing from the models;
    the package never builds a Statement from text()."""
    for stmt in STATEMENTS:
        construct = stmt.construct(_sqlite_dialect("named"))
        assert not isinstance(construct, type(text("x"))), stmt.name


# --------------------------------------------------------------------------
# Writes merged into one statement (asyncpg's boundary writes)


def _merge_parts() -> tuple[Statement, Statement]:
    from sqlalchemy import Column, MetaData, Table, Text

    t = Table("ak_test_merged", MetaData(), Column("id", Text), Column("state", Text))
    insert = Statement(
        t.insert().values(id=bindparam("id"), state=bindparam("state")), name="test.merge_insert"
    )
    fixed = Statement(
        t.update().values(state=literal("done")).where(t.c.id == bindparam("id")),
        name="test.merge_fixed",
    )
    return insert, fixed


def test_merged_writes_take_two_to_sixteen_parts_and_are_made_once() -> None:
    from agentkeep.statements import MERGED_WRITES_MAX, merged_writes

    insert, fixed = _merge_parts()
    with pytest.raises(ValueError, match="2 to 16 parts, not 1"):
        merged_writes([insert])
    with pytest.raises(ValueError, match="not 17"):
        merged_writes([insert] * (MERGED_WRITES_MAX + 1))
    assert merged_writes([insert, fixed]) is merged_writes((insert, fixed))
    assert merged_writes([insert, fixed]).name == "test.merge_insert+test.merge_fixed"


def test_merged_writes_give_each_part_its_own_parameters() -> None:
    """Parts sharing names keep their values; fixed literals stay bound; limits see every part."""
    from agentkeep.statements import merged_params, merged_writes

    insert, fixed = _merge_parts()
    stmt = merged_writes([insert, insert, fixed])
    form = stmt.compiled(CompileTarget.of(_pg_dialect("numeric_dollar")))
    assert form.sql.startswith("WITH w0 AS")
    assert form.names is not None
    assert [n for n in form.names if not n.startswith("param")] == [
        "w0_id", "w0_state", "w1_id", "w1_state", "w2_id",
    ]  # fmt: skip
    assert [(p, c) for p, c, _ in form.written] == [
        ("w0_id", "id"), ("w0_state", "state"), ("w1_id", "id"), ("w1_state", "state"),
    ]  # fmt: skip
    params = merged_params([{"id": "a", "state": "x"}, {"id": "b", "state": "y"}, {"id": "a"}])
    assert params == {
        "w0_id": "a", "w0_state": "x", "w1_id": "b", "w1_state": "y", "w2_id": "a",
    }  # fmt: skip
    bound = form.bind(params)
    assert "done" in bound and bound.count("a") == 2


def test_merged_writes_run_every_part_or_none(backend: str, db_url: str) -> None:
    """On Postgres: both inserts and the update run, each with its own values; a failing
    part (a NOT NULL) keeps none of them."""
    if backend != "postgres":
        pytest.skip("Postgres only: data-modifying CTEs")
    from agentkeep.statements import merged_params, merged_writes

    insert, fixed = _merge_parts()
    stmt = merged_writes([insert, insert])
    eng = create_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS ak_test_merged")
            conn.exec_driver_sql("CREATE TABLE ak_test_merged (id TEXT PRIMARY KEY, state TEXT)")
        form = stmt.compiled(CompileTarget.of(eng.dialect))
        with eng.begin() as conn:
            params = merged_params([{"id": "a", "state": "x"}, {"id": "b", "state": "y"}])
            conn.exec_driver_sql(form.sql, form.bind(params))
            done = merged_writes([fixed, insert]).compiled(CompileTarget.of(eng.dialect))
            params = merged_params([{"id": "a"}, {"id": "c", "state": "z"}])
            conn.exec_driver_sql(done.sql, done.bind(params))
        with eng.connect() as conn:
            rows = conn.exec_driver_sql("SELECT id, state FROM ak_test_merged ORDER BY id").all()
        assert [tuple(r) for r in rows] == [("a", "done"), ("b", "y"), ("c", "z")]
        with pytest.raises(Exception, match="duplicate key"), eng.begin() as conn:
            params = merged_params([{"id": "d", "state": "w"}, {"id": "b", "state": "again"}])
            conn.exec_driver_sql(form.sql, form.bind(params))
        with eng.connect() as conn:
            after = conn.exec_driver_sql("SELECT id, state FROM ak_test_merged ORDER BY id").all()
        assert [tuple(r) for r in after] == [("a", "done"), ("b", "y"), ("c", "z")]
    finally:
        with eng.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS ak_test_merged")
        eng.dispose()
