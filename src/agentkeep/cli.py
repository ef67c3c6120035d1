"""The ``agentkeep`` command: upgrade, current, check, demo, migrate-legacy.

Every subcommand takes an optional database URL (default
``sqlite:///agentkeep.db``, or ``AGENTKEEP_DATABASE_URL`` when set).

Exit codes: 0 success; 1 an invariant failed (demo), drift was found (check)
or a runtime is blocked (migrate-legacy); 2 the database was refused (unknown
legacy shape, newer revision, a lock held by another connection) or could not
be reached.

``agentkeep migrate-legacy runtime [URL] [--apply] [--json] [--progress]``
runs :func:`agentkeep.runtime.legacy.migrate_v0_6_34_completed_idle`: a dry
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
from collections.abc import Sequence

from sqlalchemy.exc import SQLAlchemyError

from agentkeep import migrations as migrate
from agentkeep.errors import AgentkeepError

__all__ = ["main"]

DEFAULT_URL = "sqlite:///agentkeep.db"
#: ``migrate-legacy runtime`` reports progress on stderr from this many runtimes on.
PROGRESS_THRESHOLD = 100


def _url(arg: str | None) -> str:
    return arg or os.environ.get("AGENTKEEP_DATABASE_URL") or DEFAULT_URL


def _cmd_upgrade(args: argparse.Namespace) -> int:
    revisions = migrate.upgrade(_url(args.url))
    print(f"at head: {', '.join(revisions)}")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    cur = migrate.current(_url(args.url))
    heads = migrate.head_revisions()
    state = "head" if cur == heads else "behind head " + ", ".join(heads)
    print(f"{', '.join(cur) or 'none (un-versioned or empty)'} ({state})")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    problems = migrate.check(_url(args.url))
    if not problems:
        print("no drift: the database matches the models at head")
        return 0
    for line in problems:
        print(f"drift: {line}")
    return 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentkeep.db import is_memory_sqlite
    from agentkeep.demo import run_all

    url = _url(args.url)
    if is_memory_sqlite(url):
        print(
            "agentkeep demo: worker processes need a shared database; use a file or Postgres URL",
            file=sys.stderr,
        )
        return 2
    return 0 if run_all(url, workers=args.workers, ops=args.ops) else 1


def _cmd_migrate_legacy_runtime(args: argparse.Namespace) -> int:
    from agentkeep.runtime.legacy import (
        LegacyMigrationBlocked,
        LegacyMigrationProgress,
        LegacyV0634MigrationReport,
        migrate_v0_6_34_completed_idle,
    )
    from agentkeep.runtime.legacy_report import render_table

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
        report = migrate_v0_6_34_completed_idle(_url(args.url), apply=args.apply, progress=progress)
    except LegacyMigrationBlocked as refused:
        show(refused.report)
        print(f"agentkeep {args.command}: {refused}", file=sys.stderr)
        return 1
    show(report)
    return 1 if report.blocked_count() else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkeep", description="Durable state for agent runtimes."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("url", nargs="?", help=f"database URL (default {DEFAULT_URL})")
        return p

    add("upgrade", "migrate to head, adopting tables written by the original stores").set_defaults(
        fn=_cmd_upgrade
    )
    add("current", "print the database's revision").set_defaults(fn=_cmd_current)
    add("check", "report drift between the models and the database").set_defaults(fn=_cmd_check)
    demo = add("demo", "race worker processes on the stores and check the invariants")
    demo.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    demo.add_argument("--ops", type=int, default=300, help="rounds per worker (default 300)")
    demo.set_defaults(fn=_cmd_demo)
    legacy = sub.add_parser("migrate-legacy", help="explicitly migrate rows of legacy formats")
    kinds = legacy.add_subparsers(dest="legacy_kind", required=True)
    runtime = kinds.add_parser(
        "runtime",
        help="v0.6.34 completed-idle runtime rows (dry run unless --apply)",
        description="Report (or, with --apply, migrate in one transaction) runtime rows left by "
        "v0.6.34. Stop every process using the database before --apply. Exit 1 when a runtime "
        "is blocked.",
    )
    runtime.add_argument(
        "url", nargs="?", help=f"database URL or SQLite file path (default {DEFAULT_URL})"
    )
    runtime.add_argument("--apply", action="store_true", help="migrate (default: dry run)")
    runtime.add_argument("--json", action="store_true", help="print the report as JSON")
    runtime.add_argument(
        "--progress",
        action="store_true",
        help=f"progress lines on stderr (automatic from {PROGRESS_THRESHOLD} runtimes)",
    )
    runtime.set_defaults(fn=_cmd_migrate_legacy_runtime)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentkeep`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.fn(args)
    except (AgentkeepError, SQLAlchemyError) as exc:
        print(f"agentkeep {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
