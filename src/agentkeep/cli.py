"""The ``agentkeep`` command: migrations (upgrade, downgrade, stamp, current, check, history,
heads), the demo, the explicit legacy-row migration, and the operator commands of
:mod:`agentkeep.cli_operate` (``sessions``, ``runs``, ``runtime``, ``gc``, ``vacuum``;
docs/operations.md).

Which database: every command takes the URL as its positional argument or
``--url`` (not both); without one, ``AGENTKEEP_DATABASE_URL``; without that,
:data:`DEFAULT_URL`. Every error names the URL with its password masked.

Read-only commands (``current``, ``check``, ``history``/``heads`` with
``--indicate-current``) never create a database: a SQLite file that does not
exist is an error (exit 2). ``downgrade`` and ``stamp`` refuse a missing file
too; ``upgrade`` (and ``demo``) create it. ``history`` and ``heads`` read only
the migration scripts unless ``--indicate-current`` is given.
``upgrade --sql`` writes the upgrade as SQL on stdout for the URL's dialect
without connecting.

``--schema NAME`` (upgrade, downgrade, stamp, current, check, history,
heads): agentkeep's tables live in that namespace (a Postgres schema, created
by ``upgrade`` when missing; on SQLite the file ``<db>.NAME<suffix>`` next to
the database file), as with ``Store.open(url, schema=NAME)``. Without it, the
default namespace (no schema). For ``current`` and ``check`` a namespace that
does not exist yet is not migrated; its database must exist.

Exit codes (also in ``agentkeep --help``, see :data:`EXIT_CODES`): 0 success;
1 ``check`` found the database not migrated, behind head or drifted, ``demo``
saw an invariant fail, or ``migrate-legacy`` found a blocked runtime; 2 the
command was refused or failed: the database carries a revision this code does
not know (``current`` prints "ahead of this code: <rev>"), legacy tables of an
unknown shape, a stamp its tables do not match, an unknown revision argument, a
lock held elsewhere, a statement timeout, an unreachable database or one that
cannot be opened (a directory, a missing directory, a read-only file system, a
file that is not a database: :class:`~agentkeep.errors.DatabaseUnavailable`),
a missing SQLite file, or a usage error; 3 ``sessions|runs|runtime show`` was given
an id that names nothing. A refusal prints one line on stderr,
``agentkeep <command>: <reason>`` (the typed error's message), and no traceback.

``agentkeep migrate-legacy runtime [URL] [--apply] [--json] [--progress]``
runs :func:`agentkeep.legacy.migrator.migrate_v0_6_34_completed_idle`: a dry
run by default, one atomic migration with ``--apply`` (stop every process
using the database first). URL may also be a plain SQLite file path. It
prints the report as a table (``--json``: the report's JSON form) on stdout.
Progress goes to stderr, one line per runtime and phase, when ``--progress``
is given or the database holds at least :data:`PROGRESS_THRESHOLD` runtimes.
An apply refused because of blocked runtimes prints the blocking report and
the refusal, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final

from alembic.script import Script
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from agentkeep import migrations as migrate
from agentkeep.cli_operate import add_commands
from agentkeep.errors import AgentkeepError

__all__ = ["DEFAULT_URL", "ENV_URL", "EXIT_CODES", "PROGRESS_THRESHOLD", "main"]

DEFAULT_URL: Final = "sqlite:///agentkeep.db"
#: The environment variable consulted when no URL is given.
ENV_URL: Final = "AGENTKEEP_DATABASE_URL"
#: ``migrate-legacy runtime`` reports progress on stderr from this many runtimes on.
PROGRESS_THRESHOLD = 100

URL_RULE: Final = (
    f"The database URL is the positional argument or --url; without one, ${ENV_URL}; "
    f"without that, {DEFAULT_URL}."
)
#: The same rule for the operator commands, which take the URL only as ``--url``.
OPTION_URL_RULE: Final = (
    f"The database URL is --url; without it, ${ENV_URL}; without that, {DEFAULT_URL}."
)
EXIT_CODES: Final = """\
exit codes:
  0  success
  1  check: not migrated, behind head, or drift; demo: an invariant failed;
     migrate-legacy: a runtime is blocked
  2  refused or failed, nothing changed: the database is ahead of this code
     (a revision it does not know), legacy tables of an unknown shape, a stamp
     the tables do not match, an unknown revision, a lock held elsewhere, a
     statement timeout, an unreachable database or one that cannot be opened
     (a directory, a missing directory, a read-only file system, not a
     database), a missing SQLite file for a command that never creates one,
     or a usage error
  3  sessions/runs/runtime show: no such id"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("agentkeep")
    except PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        number = "unknown"
    return f"agentkeep {number} (migration head {', '.join(migrate.head_revisions())})"


def _url(arg: str | None) -> str:
    return arg or os.environ.get(ENV_URL) or DEFAULT_URL


def _revisions(revisions: Sequence[str]) -> str:
    return ", ".join(revisions)


def _in(args: argparse.Namespace) -> str:
    """`` in schema NAME`` after a command's result line, when it ran in a namespace."""
    schema = getattr(args, "schema", None)
    return f" in schema {schema}" if schema else ""


# --------------------------------------------------------------------------
# Migration commands


def _cmd_upgrade(args: argparse.Namespace) -> int:
    if args.sql:
        migrate.upgrade_sql(args.url, args.revision, output=sys.stdout, schema=args.schema)
        return 0
    revisions = migrate.upgrade(args.url, args.revision, schema=args.schema)
    if revisions == migrate.head_revisions():
        print(f"at head: {_revisions(revisions)}{_in(args)}")
    else:
        print(f"at: {_revisions(revisions) or 'base'}{_in(args)}")
    return 0


def _cmd_downgrade(args: argparse.Namespace) -> int:
    revisions = migrate.downgrade(args.url, args.revision, schema=args.schema)
    print(
        f"at: {_revisions(revisions)}{_in(args)}"
        if revisions
        else f"at base: no agentkeep table is left{_in(args)}"
    )
    return 0


def _cmd_stamp(args: argparse.Namespace) -> int:
    revisions = migrate.stamp(args.url, args.revision, schema=args.schema)
    print(f"stamped: {_revisions(revisions) or 'base'}{_in(args)}")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    migrate.require_database(args.url)
    cur = migrate.current(args.url, schema=args.schema)
    heads = migrate.head_revisions()
    unknown = migrate.unknown_revisions(cur)
    if unknown:
        print(f"ahead of this code: {_revisions(unknown)} (this code's head: {_revisions(heads)})")
        return 2
    state = "head" if cur == heads else "behind head " + _revisions(heads)
    print(f"{_revisions(cur) or 'none (un-versioned or empty)'} ({state}){_in(args)}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    migrate.require_database(args.url)
    problems = migrate.check(args.url, schema=args.schema)
    if not problems:
        print("no drift: the database matches the models at head")
        return 0
    for line in problems:
        print(line)
    return 1


def _currents(args: argparse.Namespace) -> set[str]:
    if not args.indicate_current:
        return set()
    migrate.require_database(args.url)
    return set(migrate.current(args.url, schema=args.schema))


def _describe_revision(script: Script, *, parents: bool, doc: bool) -> str:
    """Alembic's one-line form of a revision, branch labels sorted (stable output)."""
    line = script.revision
    if parents:
        downs = script.down_revision
        down = (downs,) if isinstance(downs, str) else tuple(downs or ())
        line = f"{', '.join(down) or '<base>'} -> {line}"
    if script.branch_labels:
        line += f" ({', '.join(sorted(script.branch_labels))})"
    for flag, word in (
        (script.is_head, "head"),
        (script.is_branch_point, "branchpoint"),
        (script.is_merge_point, "mergepoint"),
    ):
        if flag:
            line += f" ({word})"
    if doc and script.doc:
        line += f", {script.doc}"
    return line


def _cmd_history(args: argparse.Namespace) -> int:
    currents = _currents(args)
    for script in migrate.script_directory().walk_revisions():
        line = _describe_revision(script, parents=True, doc=True)
        print(line + (" (current)" if script.revision in currents else ""))
    return 0


def _cmd_heads(args: argparse.Namespace) -> int:
    currents = _currents(args)
    scripts = migrate.script_directory()
    for head in migrate.head_revisions():
        script = scripts.get_revision(head)
        assert script is not None
        line = _describe_revision(script, parents=False, doc=False)
        print(line + (" (current)" if head in currents else ""))
    return 0


# --------------------------------------------------------------------------
# Other commands


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentkeep.db import is_memory_sqlite
    from agentkeep.demo import run_all

    if is_memory_sqlite(args.url):
        print(
            "agentkeep demo: worker processes need a shared database; use a file or Postgres URL",
            file=sys.stderr,
        )
        return 2
    return 0 if run_all(args.url, workers=args.workers, ops=args.ops) else 1


def _cmd_migrate_legacy_runtime(args: argparse.Namespace) -> int:
    from agentkeep.legacy.migrator import (
        LegacyMigrationBlocked,
        LegacyMigrationProgress,
        LegacyV0634MigrationReport,
        migrate_v0_6_34_completed_idle,
    )
    from agentkeep.legacy.report import render_table

    verbs = {"check": "checked", "migrate": "migrated"}

    def progress(step: LegacyMigrationProgress) -> None:
        if args.progress or step.total >= PROGRESS_THRESHOLD:
            print(
                f"{verbs[step.phase]} {step.index}/{step.total} {step.runtime_id}",
                file=sys.stderr,
                flush=True,
            )

    def show(report: LegacyV0634MigrationReport) -> None:
        print(report.to_json_text() if args.json else "\n".join(render_table(report)))

    try:
        report = migrate_v0_6_34_completed_idle(args.url, apply=args.apply, progress=progress)
    except LegacyMigrationBlocked as refused:
        show(refused.report)
        print(f"agentkeep {args.command}: {refused}", file=sys.stderr)
        return 1
    show(report)
    return 1 if report.blocked_count() else 0


# --------------------------------------------------------------------------
# Parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _add_url(p: argparse.ArgumentParser, what: str = "database URL") -> None:
    p.add_argument("url", nargs="?", metavar="URL", help=f"{what} (or --url)")
    p.add_argument(
        "--url",
        dest="url_option",
        metavar="URL",
        help=f"{what}; default ${ENV_URL}, else {DEFAULT_URL}",
    )


def _add_schema(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--schema",
        metavar="NAME",
        help="the namespace of agentkeep's tables: a Postgres schema, or on SQLite the file "
        "<db>.NAME<suffix> next to the database (default: none, the tables' own names)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkeep",
        description="Durable state for agent runtimes.\n\n" + URL_RULE,
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        help_: str,
        fn: Callable[[argparse.Namespace], int],
        description: str = "",
        revision: str = "",
        schema: bool = True,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_,
            description=(description or help_[:1].upper() + help_[1:] + ".") + "\n\n" + URL_RULE,
            epilog=EXIT_CODES,
            formatter_class=_Formatter,
        )
        if revision:
            p.add_argument("revision", metavar="REVISION", help=revision)
        _add_url(p)
        if schema:
            _add_schema(p)
        p.set_defaults(fn=fn)
        return p

    up = add(
        "upgrade",
        "migrate to head, adopting tables written by the original stores",
        _cmd_upgrade,
        "Migrate to head (or --revision) in one transaction holding the migration lock, "
        "adopting un-versioned tables written by the original stores; creates the database "
        "if needed. With --sql, print the upgrade as SQL for the URL's dialect instead, "
        "without connecting.",
    )
    up.add_argument(
        "-r",
        "--revision",
        default="heads",
        help="target revision (default: heads); with --sql also FROM:TO",
    )
    up.add_argument(
        "--sql", action="store_true", help="offline: print the SQL, do not touch the database"
    )
    add(
        "downgrade",
        "downgrade to a revision (base drops every agentkeep table)",
        _cmd_downgrade,
        "Downgrade to REVISION in one transaction holding the migration lock. Lossy: "
        "dropped columns and tables lose their rows. Refuses a database ahead of this code "
        "and a missing SQLite file.",
        revision="target: a revision, label@base (one branch), or base",
    )
    add(
        "stamp",
        "set the stamped revision without running migrations, if the tables match it",
        _cmd_stamp,
        "Stamp REVISION without running migrations. Refused (nothing changed) unless "
        "upgrading from REVISION reaches the models without drift, which is proven in a "
        "rolled-back savepoint; refuses a database ahead of this code and a missing SQLite "
        "file.",
        revision="the revision to stamp (heads, a revision, base)",
    )
    add(
        "current",
        "print the database's revision (read-only)",
        _cmd_current,
        "Print the stamped revision and whether it is head. Read-only: a missing SQLite file "
        "is an error. A revision this code does not know prints 'ahead of this code: <rev>' "
        "and exits 2.",
    )
    add(
        "check",
        "report what differs between the database and the models at head (read-only)",
        _cmd_check,
        "Exit 0 when the database matches the models at head; exit 1 when it is not "
        "migrated, behind head, or drifted (one line each). Read-only: a missing SQLite file "
        "is an error.",
    )
    for name, help_, fn in (
        ("history", "list the migration history", _cmd_history),
        ("heads", "list the head revisions", _cmd_heads),
    ):
        p = add(
            name,
            help_,
            fn,
            f"{help_[:1].upper() + help_[1:]} of this code's scripts. The database is read "
            "only with --indicate-current (a missing SQLite file is then an error).",
        )
        p.add_argument(
            "-i",
            "--indicate-current",
            action="store_true",
            help="mark the database's current revision",
        )
    demo = add(
        "demo",
        "race worker processes on the stores and check the invariants",
        _cmd_demo,
        schema=False,
    )
    demo.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    demo.add_argument("--ops", type=int, default=300, help="rounds per worker (default 300)")

    legacy = sub.add_parser("migrate-legacy", help="explicitly migrate rows of legacy formats")
    kinds = legacy.add_subparsers(dest="legacy_kind", required=True)
    runtime = kinds.add_parser(
        "runtime",
        help="v0.6.34 completed-idle runtime rows (dry run unless --apply)",
        description="Report (or, with --apply, migrate in one transaction) runtime rows left by "
        "v0.6.34. Stop every process using the database before --apply. Exit 1 when a runtime "
        "is blocked.\n\n" + URL_RULE,
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    _add_url(runtime, "database URL or SQLite file path")
    runtime.add_argument("--apply", action="store_true", help="migrate (default: dry run)")
    runtime.add_argument("--json", action="store_true", help="print the report as JSON")
    runtime.add_argument(
        "--progress",
        action="store_true",
        help=f"progress lines on stderr (automatic from {PROGRESS_THRESHOLD} runtimes)",
    )
    runtime.set_defaults(fn=_cmd_migrate_legacy_runtime)
    add_commands(sub, url_rule=OPTION_URL_RULE, epilog=EXIT_CODES, formatter=_Formatter)
    return parser


# --------------------------------------------------------------------------
# Errors


def _one_line(exc: BaseException) -> str:
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.strip().startswith("(Background on this error at:")
    ]
    return " ".join(lines) or type(exc).__name__


def _describe(exc: BaseException, url: str) -> str:
    """The error as one line naming the database, its password masked."""
    message = _one_line(exc)
    masked = migrate.mask_url(url)
    try:
        password = make_url(url).password
    except (SQLAlchemyError, ValueError):
        password = None
    if password:
        message = message.replace(str(password), "***")
    if masked not in message:
        message += f" (database: {masked})"
    return message


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentkeep`` command; returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if (
        len(extra) == 1
        and not extra[0].startswith("-")
        and getattr(args, "url", False) is None
        and hasattr(args, "url_option")
        and not getattr(args, "url_option_only", False)
    ):
        # argparse fills the optional URL with the positionals before an option
        # (`downgrade base --schema s URL`): the URL after it is left over.
        args.url, extra = extra[0], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.url is not None and args.url_option is not None and args.url != args.url_option:
        parser.error("give the database URL once: as the positional argument or as --url")
    args.url = _url(args.url or args.url_option)
    try:
        code: int = args.fn(args)
    except (AgentkeepError, SQLAlchemyError) as exc:
        print(f"agentkeep {args.command}: {_describe(exc, args.url)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`agentkeep history | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
