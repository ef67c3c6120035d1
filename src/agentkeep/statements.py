"""Statements built from the models, compiled once per target, executed on the driver.

Every statement that reads or writes an agentkeep table is a :class:`Statement`:
a SQLAlchemy Core construct (``select``, ``update``, ``insert ... on_conflict``,
``delete``, recursive CTEs) built from the mapped tables and columns, with
named :func:`~sqlalchemy.bindparam` parameters. Repositories keep them as
module-level constants and run them through :meth:`agentkeep.db.Driver.execute`.

A statement is compiled lazily, the first time it runs against a
:class:`CompileTarget`: one dialect (with its server version), one DBAPI
paramstyle (``named`` for sqlite3, ``pyformat`` for psycopg, ``qmark``,
``numeric_dollar`` for asyncpg, ...) and one ``schema_translate_map``. The
compiled form (SQL text, the positional order of parameter names where the
paramstyle is positional, and the values of parameters fixed in the construct)
is cached on the statement; each call then only binds its parameters and runs
the text straight on the driver connection. This is the "lean path": it skips
SQLAlchemy's per-execution machinery, which costs more than the statement
itself on SQLite, while every table and column name still comes from the
models (a renamed column fails when the statement is compiled, which the
suite does for every statement: ``tests/test_statements.py``).

What the compiled form may not contain: parameters that SQLAlchemy expands or
renders at execution time (``in_()`` with an expanding list, ``literal_execute``);
compiling such a construct raises :class:`UncompilableStatement`. Fixed-size
``IN`` lists of named parameters are fine.

Rows come back as the driver's plain tuples, in the order of the construct's
columns; no SQLAlchemy result or type processing is applied, so statements
bind and read only values the drivers handle natively (str, int, bytes, None).
See docs/architecture.md#statements and docs/architecture.md#the-lean-path.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, cast

from sqlalchemy import Column, Table, bindparam, literal_column, select
from sqlalchemy.dialects import postgresql as _pg
from sqlalchemy.dialects import sqlite as _sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import visitors
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert, Update
from sqlalchemy.sql.elements import BindParameter, ClauseElement
from sqlalchemy.sql.selectable import Select

from agentkeep.limits import ColumnKind, column_kind

__all__ = [
    "CompileTarget",
    "Compiled",
    "Statement",
    "UncompilableStatement",
    "merged_params",
    "merged_writes",
    "upsert",
]

#: The paramstyles the compile step serves (PEP 249 names).
PARAMSTYLES: Final = frozenset(
    {"named", "qmark", "pyformat", "format", "numeric", "numeric_dollar"}
)


class UncompilableStatement(Exception):
    """A statement cannot be compiled into a fixed text for the lean path.

    Raised at first use (and by the suite's compile-everything test), never
    for a caller's input: it means the construct uses a feature whose SQL is
    only known at execution time, or does not match the models.
    """


class CompileTarget:
    """What a statement is compiled for: a dialect, its paramstyle and a schema map.

    Targets are interned: :meth:`of` returns the same object for the same
    (dialect name, driver, server version, paramstyle, schema map), so a
    statement's cache is a dictionary keyed by identity.

    Attributes:
        dialect: the SQLAlchemy dialect compiled with (an engine's own).
        paramstyle: the DBAPI paramstyle of the compiled text.
        positional: True when parameters are passed as a sequence.
        schema_translate_map: ``{None: "schema"}`` to put agentkeep's tables
            into a schema, or None.
    """

    __slots__ = (
        "__weakref__",
        "dialect",
        "key",
        "paramstyle",
        "positional",
        "schema_translate_map",
    )

    _interned: dict[tuple[Any, ...], CompileTarget] = {}
    _lock = threading.Lock()

    def __init__(
        self,
        dialect: Dialect,
        key: tuple[Any, ...],
        schema_translate_map: Mapping[str | None, str | None] | None,
    ) -> None:
        self.dialect = dialect
        self.key = key
        self.paramstyle: str = dialect.paramstyle
        self.positional: bool = bool(dialect.positional)
        self.schema_translate_map = dict(schema_translate_map) if schema_translate_map else None

    @classmethod
    def of(
        cls,
        dialect: Dialect,
        schema_translate_map: Mapping[str | None, str | None] | None = None,
    ) -> CompileTarget:
        """The target for ``dialect`` (as configured: its paramstyle) and a schema map."""
        if dialect.paramstyle not in PARAMSTYLES:
            raise UncompilableStatement(f"unsupported paramstyle {dialect.paramstyle!r}")
        schema_items = tuple(sorted((schema_translate_map or {}).items(), key=repr))
        key = (
            dialect.name,
            dialect.driver,
            getattr(dialect, "server_version_info", None),
            dialect.paramstyle,
            schema_items,
        )
        target = cls._interned.get(key)
        if target is None:
            with cls._lock:
                target = cls._interned.get(key)
                if target is None:
                    target = cls(dialect, key, schema_translate_map)
                    cls._interned[key] = target
        return target

    def __repr__(self) -> str:
        return f"CompileTarget({self.key!r})"


class Compiled:
    """One statement's compiled form for one target.

    Attributes:
        sql: the SQL text in the target's paramstyle.
        names: the parameter names in positional order (positional
            paramstyles), else None.
        fixed: values of parameters the construct fixed itself (literals such
            as ``state = 'finalized'``), merged under each call's parameters;
            None when there are none.
        written: ``(parameter, column, kind)`` of every parameter whose value
            the statement writes into a column (``INSERT`` / ``UPDATE`` values,
            ``ON CONFLICT DO UPDATE`` sets), for the size limits
            (:mod:`agentkeep.limits`).
        raw: on psycopg, for a statement too long (or with too many
            parameters) for psycopg's cache of converted queries, the same
            statement with ``$1, $2 ...`` placeholders (a positional form),
            which the driver sends through psycopg's raw cursor: psycopg then
            converts nothing per call, where it would parse the named form
            again at every run (``Driver`` chooses); else None.
    """

    __slots__ = ("fixed", "names", "plain", "raw", "sql", "written")

    def __init__(
        self,
        sql: str,
        names: tuple[str, ...] | None,
        fixed: dict[str, Any] | None,
        written: tuple[tuple[str, str, ColumnKind], ...] = (),
        raw: Compiled | None = None,
    ):
        self.sql = sql
        self.names = names
        self.fixed = fixed
        self.written = written
        self.raw = raw
        #: True when a call's parameter dict is bound as it is (named style, nothing fixed).
        self.plain = names is None and fixed is None

    def bind(self, params: Mapping[str, Any]) -> Any:
        """The parameters of one call, in the form the driver takes."""
        if self.fixed is not None:
            params = {**self.fixed, **params}
        if self.names is not None:
            try:
                return tuple([params[n] for n in self.names])
            except KeyError as exc:
                raise KeyError(f"statement parameter {exc.args[0]!r} was not given") from None
        return params


Builder = Callable[[Dialect], ClauseElement]


class Statement:
    """A statement built from the models and compiled once per :class:`CompileTarget`.

    Args:
        build: the Core construct, or a function from a dialect to the
            construct for statements whose shape depends on the dialect
            (it is called once per target, at first use).
        name: a label for errors and the compile-everything test.
    """

    __slots__ = ("_build", "_forms", "_lock", "name")

    #: Every statement constructed, for the compile-everything test.
    registry: list[Statement] = []

    def __init__(self, build: ClauseElement | Builder, *, name: str = "") -> None:
        self._build = build
        self._forms: dict[CompileTarget, Compiled] = {}
        self._lock = threading.Lock()
        self.name = name
        Statement.registry.append(self)

    def construct(self, dialect: Dialect) -> ClauseElement:
        """The Core construct for ``dialect``."""
        build = self._build
        if isinstance(build, ClauseElement):
            return build
        return build(dialect)

    def compiled(self, target: CompileTarget) -> Compiled:
        """The compiled form for ``target`` (compiled on first use, then cached).

        Raises:
            UncompilableStatement: the construct cannot be fixed into one text.
        """
        form = self._forms.get(target)
        if form is None:
            with self._lock:
                form = self._forms.get(target)
                if form is None:
                    form = _compile(self.construct(target.dialect), target, self.name)
                    self._forms[target] = form
        return form

    def __repr__(self) -> str:
        return f"Statement({self.name or '<unnamed>'})"


def _compile(construct: ClauseElement, target: CompileTarget, name: str) -> Compiled:
    kw: dict[str, Any] = {}
    if target.schema_translate_map:
        kw["schema_translate_map"] = target.schema_translate_map
        kw["render_schema_translate"] = True
    try:
        compiled = cast(SQLCompiler, construct.compile(dialect=target.dialect, **kw))
    except Exception as exc:  # noqa: BLE001 - any compile failure is the statement's fault
        raise UncompilableStatement(f"{name or construct!r}: {exc}") from exc
    sql = compiled.string
    if "__[POSTCOMPILE" in sql or "__[SCHEMA" in sql:
        raise UncompilableStatement(
            f"{name or sql!r}: uses parameters rendered at execution time (expanding IN, "
            "literal_execute or an unrendered schema): use fixed named parameters"
        )
    fixed: dict[str, Any] = {}
    for bind in set(compiled.binds.values()):
        if bind.required:
            continue
        if bind.callable is not None:
            raise UncompilableStatement(f"{name or sql!r}: callable parameter {bind.key!r}")
        fixed[compiled.bind_names[bind]] = bind.value
    names: tuple[str, ...] | None = None
    if target.positional:
        names = tuple(compiled.positiontup or ())
    raw = None
    if _psycopg_reparses(target, sql, len(set(compiled.bind_names.values()))):
        raw = _compile(construct, _raw_target(target), name)
    return Compiled(sql, names, fixed or None, _written(construct), raw)


#: psycopg caches the conversion of a named query (``%(name)s`` to ``$n``) only
#: for queries of at most this many bytes and parameters (``psycopg._queries``);
#: a longer one is parsed again at every run.
_PSYCOPG_CACHED_BYTES: Final = 4096
_PSYCOPG_CACHED_PARAMS: Final = 50


def _psycopg_reparses(target: CompileTarget, sql: str, params: int) -> bool:
    """True for a named psycopg form psycopg would convert again at every run."""
    return (
        target.dialect.driver in ("psycopg", "psycopg_async")
        and not target.positional
        and (len(sql.encode()) > _PSYCOPG_CACHED_BYTES or params > _PSYCOPG_CACHED_PARAMS)
    )


def _raw_target(target: CompileTarget) -> CompileTarget:
    """``target``'s dialect with ``$n`` placeholders (positional), the same schema map."""
    dialect = cast(Any, type(target.dialect))(paramstyle="numeric_dollar")
    return CompileTarget.of(dialect, target.schema_translate_map)


def _written(construct: ClauseElement) -> tuple[tuple[str, str, ColumnKind], ...]:
    """``(parameter, column, kind)`` of each parameter an INSERT / UPDATE writes to a column,
    its data-modifying CTEs' (``add_cte``) included; of a SELECT, only those
    of its ``add_cte`` CTEs (a statement that writes in a CTE and reports in
    its SELECT)."""
    if not isinstance(construct, (Insert, Update, Select)):
        return ()
    inner = tuple(
        w
        for cte in getattr(construct, "_independent_ctes", ()) or ()
        for w in _written(cte.element)
    )
    return inner if isinstance(construct, Select) else inner + _written_here(construct)


def _written_here(construct: Insert | Update) -> tuple[tuple[str, str, ColumnKind], ...]:
    table = construct.table
    pairs: list[tuple[Any, Any]] = list(construct._values.items()) if construct._values else []
    for row in construct._multi_values or ():
        for values in row:
            if isinstance(values, Mapping):
                pairs += values.items()
    source = getattr(construct, "select", None)  # INSERT … SELECT: the selected parameters
    if source is not None:
        for select_ in getattr(source, "selects", None) or (source,):  # UNION ALL of rows
            for key, value in zip(
                construct._select_names or (), select_.selected_columns, strict=True
            ):
                pairs.append((key, value))
    conflict = getattr(construct, "_post_values_clause", None)
    sets = getattr(conflict, "update_values_to_set", None) or ()
    pairs += list(sets.items() if isinstance(sets, Mapping) else sets)
    out: dict[str, tuple[str, str, ColumnKind]] = {}
    for key, value in pairs:
        column = table.c.get(key) if isinstance(key, str) else key
        if isinstance(value, BindParameter) and value.required and isinstance(column, Column):
            out[value.key] = (value.key, column.name, column_kind(column))
    return tuple(out.values())


def upsert(dialect: Dialect, table: Table | type[Any]) -> Any:
    """``INSERT`` for ``table`` with the dialect's ``ON CONFLICT`` clauses.

    Returns the dialect's own insert construct (``sqlite.insert`` or
    ``postgresql.insert``), whose ``on_conflict_do_nothing`` /
    ``on_conflict_do_update`` and ``excluded`` compile on that dialect.
    ``table`` is a mapped class or its table. Use it
    inside a :class:`Statement` builder function.
    """
    module = _pg if dialect.name == "postgresql" else _sqlite
    return module.insert(table)


#: The most writes :func:`merged_writes` puts in one statement.
MERGED_WRITES_MAX: Final = 16


def merged_writes(parts: Sequence[Statement]) -> Statement:
    """Several writes as one Postgres statement: each a data-modifying CTE of a ``SELECT 1``.

    ``WITH w0 AS (<part 0>), w1 AS (<part 1>) ... SELECT 1``: Postgres runs
    every part exactly once, to completion, as one statement (one round trip,
    one snapshot, all or nothing: an error in any part fails the statement
    and none of its writes is kept). Each part's named parameters are renamed
    ``w<i>_<name>`` (:func:`merged_params` renames the values alike), so
    parts that share a name (``rt``, ``data``) keep their own values; the
    size limits still apply to every written value (:attr:`Compiled.written`
    reads the CTEs).

    Only for writes whose results are not needed and that are independent of
    each other: the parts all see the snapshot taken when the statement
    starts, not each other's writes, and run in no set order. So no two parts
    may write the same row (an upsert of a row another part inserts fails
    with a cardinality error), and no part may depend on another's effect.

    The statement of one sequence of parts is made once (``functools.cache``:
    the sequences a caller sends are few shapes). At most
    :data:`MERGED_WRITES_MAX` parts.

    Raises:
        ValueError: fewer than two parts, or more than the maximum.
    """
    key = tuple(parts)
    if not 2 <= len(key) <= MERGED_WRITES_MAX:
        raise ValueError(f"merged_writes takes 2 to {MERGED_WRITES_MAX} parts, not {len(key)}")
    return _merged(key)


def merged_params(params: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parameters of :func:`merged_writes`' statement (part ``i``'s ``x`` as ``w<i>_x``)."""
    return {f"w{i}_{name}": value for i, one in enumerate(params) for name, value in one.items()}


@functools.cache
def _merged(parts: tuple[Statement, ...]) -> Statement:
    def build(dialect: Dialect) -> ClauseElement:
        ctes = [
            _renamed(part.construct(dialect), f"w{i}_").cte(f"w{i}") for i, part in enumerate(parts)
        ]
        return select(literal_column("1")).add_cte(*ctes)

    return Statement(build, name="+".join(part.name for part in parts))


def _renamed(construct: ClauseElement, prefix: str) -> Any:
    """``construct`` with every named parameter ``name`` renamed ``prefix + name`` (a copy).

    Anonymous parameters (literals SQLAlchemy names itself) keep their
    names, which are unique in any statement already.
    """

    def rename(element: Any) -> Any:
        if not isinstance(element, BindParameter) or element.unique:
            return None
        return bindparam(
            prefix + element.key,
            value=element.value,
            type_=element.type,
            required=element.required,
            callable_=element.callable,
            expanding=element.expanding,
            literal_execute=element.literal_execute,
        )

    traverse: Any = visitors.replacement_traverse
    return traverse(construct, {}, rename)
