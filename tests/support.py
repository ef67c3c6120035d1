"""Raw SQL helpers of the test suite that know no particular store.

Tests use them to set up rows the repositories would refuse to write and to
assert on what is really stored, with plain SQLAlchemy (``sqlalchemy.text``,
``:name`` parameters), never through a repository.

* :func:`raw_rows` / :func:`raw_exec`: on a database URL, through a plain
  engine of their own (no agentkeep hooks, no pool kept): an observer and a
  foreign writer outside any :class:`~agentkeep.store.Store`.
* :func:`query` / :func:`execute_sql`: inside a unit of work of a
  :class:`~agentkeep.store.Store` (``store.read()`` / ``store.write()``), on
  the unit's ``uow.connection``.
* :func:`explain`: the query plan of a repository's statement, inside a unit.

Store-specific helpers live next to their tests: ``tests/runs/support.py``,
``tests/sessions/support.py`` and ``tests/runtime/support.py``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.pool import NullPool

from agentkeep.statements import Statement
from agentkeep.store import Store
from agentkeep.unit_of_work import UnitOfWork


def plain_engine(url: str) -> Engine:
    """An engine without agentkeep hooks and without a pool (dispose it after use)."""
    return create_engine(url, poolclass=NullPool)


def raw_rows(url: str, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Rows of one SELECT on its own connection, as stored (``bytes`` for BLOB/bytea)."""
    engine = plain_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(sql), params or {}).all()
    finally:
        engine.dispose()
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]


def raw_exec(url: str, *statements: str, params: dict[str, Any] | None = None) -> None:
    """Run ``statements`` (each with the same ``params``) in one committed transaction."""
    engine = plain_engine(url)
    try:
        with engine.begin() as conn:
            for stmt in statements:
                conn.execute(text(stmt), params or {})
    finally:
        engine.dispose()


def query(store: Store, sql: str, **params: Any) -> list[dict[str, Any]]:
    """Rows of one SELECT in a read unit of ``store``, as ``column -> value`` dicts."""
    with store.read() as uow:
        return [dict(r) for r in uow.connection.execute(text(sql), params).mappings()]


def execute_sql(store: Store, sql: str, **params: Any) -> None:
    """Run one statement in a write unit of ``store`` (committed when the unit ends)."""
    with store.write() as uow:
        uow.connection.execute(text(sql), params)


def explain(uow: UnitOfWork, stmt: Statement, params: dict[str, Any]) -> list[Any]:
    """The plan rows of ``stmt`` with ``params``, on the unit's connection.

    ``EXPLAIN QUERY PLAN`` on SQLite, ``EXPLAIN`` on Postgres, of the
    statement exactly as the store compiles and binds it for the unit's
    driver.
    """
    prefix = "EXPLAIN " if uow.driver.postgres else "EXPLAIN QUERY PLAN "
    form = stmt.compiled(uow.driver.target)
    return list(uow.connection.exec_driver_sql(prefix + form.sql, form.bind(params)).all())


def count_units(store: Store) -> list[int]:
    """A counter of the connections ``store``'s units take from now on: pool checkouts
    (``store.write()``, ``store.read()``, one-call units) and one-call units that take the
    connection a previous one parked (``Store._park_connections``), which check nothing out.
    """
    counter = [0]

    def on_checkout(*_: Any) -> None:
        counter[0] += 1

    event.listen(store.engine, "checkout", on_checkout)
    for name in ("_lean_unit", "_lean_read"):
        real = getattr(store, name)

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if store._parked:  # it may take the parked connection: no checkout
                counter[0] += 1
            return _real(*args, **kwargs)

        setattr(store, name, counted)
    return counter
