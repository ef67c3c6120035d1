"""The ``agentkeep`` command: upgrade, current, check, demo.

Every subcommand takes an optional database URL (default
``sqlite:///agentkeep.db``, or ``AGENTKEEP_DATABASE_URL`` when set).

Exit codes: 0 success; 1 an invariant failed (demo) or drift was found
(check); 2 the database was refused (unknown legacy shape, newer revision) or
could not be reached.
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
