"""The operator commands of ``agentkeep``: inspection (sessions, runs, runtime) and maintenance.

Registered by :mod:`agentkeep.cli`; described in docs/operations.md.

* ``sessions list|show``, ``runs list|show``, ``runtime list|show`` read
  through :class:`agentkeep.inspection.Inspector`: read-only (a missing
  SQLite file is exit 2, never a new database; no write lock is taken).
* ``gc`` and ``vacuum [--session ID]`` run the maintenance jobs of
  :mod:`agentkeep.sessions.maintenance` through a store and print what they
  removed, with a progress bar on a terminal (none when piped or ``--json``).

Every command prints an aligned table for people, or with ``--json`` one JSON
document on stdout. An id that names nothing exits :data:`EXIT_NOT_FOUND`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, Final

from agentkeep.console import Progress, format_ms, print_table
from agentkeep.errors import NotFound

__all__ = ["EXIT_NOT_FOUND", "add_commands"]

#: Exit code of ``show`` for an id that names nothing.
EXIT_NOT_FOUND: Final = 3


def _dump(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def _inspector(args: argparse.Namespace) -> Any:
    from agentkeep.inspection import Inspector

    return Inspector.open(args.url)  # errors name args.url (cli._describe)


def _not_found(args: argparse.Namespace, exc: NotFound) -> int:
    print(f"agentkeep {args.command}: {exc}", file=sys.stderr)
    return EXIT_NOT_FOUND


def _listing(args: argparse.Namespace, method: str, table: Callable[[list[Any]], None]) -> int:
    """``list``: a page of ``inspector.<method>`` as JSON or a table."""
    with _inspector(args) as inspector:
        rows = getattr(inspector, method)(limit=args.limit, after=args.after)
    if args.json:
        _dump([r.to_json() for r in rows])
    else:
        table(rows)
    return 0


def _detail(
    args: argparse.Namespace,
    method: str,
    render: Callable[[Any], None],
    export: Callable[[Any], str | None] = lambda detail: None,
) -> int:
    """``show ID``: ``inspector.<method>(ID)`` exported, as JSON or rendered; exit 3 if unknown."""
    try:
        with _inspector(args) as inspector:
            detail = getattr(inspector, method)(args.id)
    except NotFound as exc:
        return _not_found(args, exc)
    exported = export(detail)
    if exported is not None:
        print(exported, end="")
    elif args.json:
        _dump(detail.to_json())
    else:
        render(detail)
    return 0


def _graph(args: argparse.Namespace) -> Callable[[Any], str | None]:
    from agentkeep.inspection import graph_dot, graph_mermaid

    exporters = {"mermaid": graph_mermaid, "dot": graph_dot}
    return lambda detail: exporters[args.graph](detail) if args.graph else None


# --------------------------------------------------------------------------
# sessions


def _sessions_table(rows: list[Any]) -> None:
    print_table(
        ["SESSION", "HEAD", "LEASE HOLDER", "LEASE EXPIRES", "QUEUED", "PENDING", "UPDATED"],
        [
            (
                r.session_id,
                r.head_revision,
                r.lease_holder,
                format_ms(r.lease_expires_at_ms),
                r.queued_batches,
                r.pending_inputs,
                format_ms(r.last_update_ms),
            )
            for r in rows
        ],
    )


def _claim_text(claim: Any) -> str:
    if claim is None:
        return "unclaimed"
    return (
        f"claimed by {claim.owner_id or '-'} (fencing {claim.fencing_token}, "
        f"lease generation {claim.session_lease_generation})"
    )


def _sessions_render(detail: Any) -> None:
    print(f"session {detail.session_id}")
    print(
        f"head: revision {_dash(detail.head_revision)}, leaf {_dash(detail.leaf_node_id)}, "
        f"{_dash(detail.graph_node_count)} nodes, checkpoint {_dash(detail.checkpoint_ref)}"
    )
    if detail.meta:
        print("meta: " + ", ".join(f"{k}={v}" for k, v in sorted(detail.meta.items())))
    lease = detail.lease
    if lease is None or not lease.held:
        fencing = f" (fencing token {lease.fencing_token})" if lease is not None else ""
        print(f"lease: none{fencing}")
    else:
        state = "expired" if lease.expired else "live"
        print(
            f"lease: held by {lease.owner_id} (incarnation {lease.incarnation_id}), "
            f"fencing token {lease.fencing_token}, claimed {format_ms(lease.claimed_at_ms)}, "
            f"expires {format_ms(lease.expires_at_ms)} ({state}), holder {lease.liveness}"
        )
    print()
    print_table(
        ["INPUT", "STATE", "SEQ", "ENQUEUED", "CLAIM"],
        [
            (i.input_id, i.state, i.enqueue_seq, format_ms(i.enqueued_at_ms), _claim_text(i.claim))
            for i in detail.pending_inputs
        ],
        title=f"pending inputs: {len(detail.pending_inputs)}",
    )
    print()
    print_table(
        ["BATCH", "SEQ", "ITEMS", "DELIVERY", "SLOT", "AVAILABLE", "CLAIM"],
        [
            (
                b.batch_id,
                b.enqueue_seq,
                b.items,
                b.delivery_policy,
                b.slot_policy,
                format_ms(b.available_at_ms),
                _claim_text(b.claim),
            )
            for b in detail.queued_work
        ],
        title=f"queued work: {len(detail.queued_work)}",
    )
    print()
    print_table(
        ["SOURCE", "MODEL", "INPUT", "OUTPUT", "CACHE READ", "CACHE WRITE", "REASONING"],
        [
            (
                u.source,
                u.model,
                u.input_tokens,
                u.output_tokens,
                u.cache_read_input_tokens,
                u.cache_write_input_tokens,
                u.reasoning_output_tokens,
            )
            for u in detail.usage
        ],
        title=f"usage by source and model: {len(detail.usage)}",
    )
    print()
    print(f"active path: {len(detail.active_path)} nodes")
    # Root first, one node a line at one indentation (a path of 10,000 nodes stays
    # readable); a node with children off the path shows them as a side branch.
    for depth, node in enumerate(detail.active_path):
        prefix = "" if depth == 0 else "└─ "
        extra = detail.branches.get(node, 0)
        branches = f"  ├─ +{extra} other branch{'es' if extra > 1 else ''}" if extra else ""
        print(f"{prefix}{node}{branches}")


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


# --------------------------------------------------------------------------
# runs


def _runs_table(rows: list[Any]) -> None:
    print_table(
        ["RUN", "TASK", "STATUS", "CREATED", "UPDATED"],
        [
            (
                r.run_id,
                r.task_id,
                r.status,
                format_ms(r.created_at * 1000),
                format_ms(r.updated_at * 1000),
            )
            for r in rows
        ],
    )


def _runs_render(detail: Any) -> None:
    data = detail.to_json()
    steps = data.pop("step_entries")
    print_table(["FIELD", "VALUE"], [(k, _compact(v)) for k, v in data.items()])
    print()
    print_table(
        ["STEP", "REF", "STATUS", "AT"],
        [
            (s.get("step_id"), s.get("step_ref"), s.get("status"), s.get("at"))
            if isinstance(s, dict)
            else (_compact(s), "", "", "")
            for s in steps
        ],
        title=f"step entries: {len(steps)}",
    )


def _compact(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, str | int):
        return str(value)
    return json.dumps(value, sort_keys=True)


# --------------------------------------------------------------------------
# runtime


_RUNTIME_HEADERS: Final = ["RUNTIME", "LIFECYCLE", "SNAPSHOT REVISION", "OUTBOX", "OPS EPOCH"]


def _runtime_row(r: Any) -> tuple[object, ...]:
    revision = r.snapshot_revision
    if revision is not None and r.quarantined:
        revision += " (quarantined)"
    return (r.runtime_id, r.lifecycle, revision, r.pending_outbox, r.ops_epoch)


def _runtime_table(rows: list[Any]) -> None:
    print_table(_RUNTIME_HEADERS, [_runtime_row(r) for r in rows])


def _runtime_render(detail: Any) -> None:
    print_table(_RUNTIME_HEADERS, [_runtime_row(detail.summary)])
    print()
    print(f"snapshot session: {_dash(detail.snapshot_session_id)}")
    binding = detail.binding
    print(
        "binding: "
        + (", ".join(f"{k}={_dash(v)}" for k, v in sorted(binding.items())) if binding else "-")
    )
    print(f"input states: {len(detail.input_ids)}")
    for input_id in detail.input_ids:
        print(f"  {input_id}")
    print(f"retired ops epochs: {', '.join(detail.retired_epochs) or '-'}")
    print()
    print_table(
        ["SESSION", "PARENT REVISION", "REVISION", "FINGERPRINT"],
        [
            (p["session_id"], p["parent_revision"], p["revision"], p["commit_fingerprint"])
            for p in detail.pending_projections
        ],
        title=f"pending outbox: {len(detail.pending_projections)}",
    )


# --------------------------------------------------------------------------
# Maintenance


def _store(args: argparse.Namespace) -> Any:
    from agentkeep import migrations
    from agentkeep.store import Store

    migrations.require_database(args.url)  # a missing SQLite file: exit 2, nothing created
    return Store.open(args.url)


def _gc(args: argparse.Namespace) -> int:
    with _store(args) as store, Progress(enabled=not args.json) as progress:
        report = store.maintenance.gc_unreachable_strict(progress=progress.update)
    if args.json:
        _dump(report.model_dump(mode="json"))
        return 0
    print(
        f"removed {report.deleted_blob_count} unreachable blobs "
        f"(kept {report.retained_blob_count}, reached from {report.root_count} roots)"
    )
    return 0


def _vacuum(args: argparse.Namespace) -> int:
    with _store(args) as store, Progress(enabled=not args.json) as progress:
        if args.session is not None:
            report = store.maintenance.vacuum(args.session, progress=progress.update)
        else:
            report = store.maintenance.vacuum_all_sessions(progress=progress.update)
    if args.json:
        out = report.model_dump(mode="json")
        out["session_id"] = args.session
        _dump(out)
        return 0
    scope = f"session {args.session}" if args.session is not None else "every session"
    print(
        f"removed {report.removed_node_count} tombstoned nodes and "
        f"{report.removed_pending_turn_input_tombstone_count} terminal turn inputs ({scope})"
    )
    return 0


# --------------------------------------------------------------------------
# Parser


def _page_options(p: argparse.ArgumentParser) -> None:
    from agentkeep.inspection import DEFAULT_LIMIT

    p.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help=f"rows per page (default {DEFAULT_LIMIT})"
    )
    p.add_argument("--after", metavar="ID", help="start after this id (the last id of a page)")


def add_commands(
    sub: Any,
    *,
    url_rule: str,
    epilog: str,
    formatter: type[argparse.HelpFormatter],
) -> None:
    """Add ``sessions``, ``runs`` and ``runtime`` (and their subcommands) to ``sub``."""

    def group(name: str, help_: str) -> Any:
        p = sub.add_parser(name, help=help_, description=help_ + ".\n\n" + url_rule)
        return p.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")

    def leaf(
        parent: Any, name: str, help_: str, fn: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(
            name,
            help=help_,
            description=help_[:1].upper() + help_[1:] + " (read-only).\n\n" + url_rule,
            epilog=epilog,
            formatter_class=formatter,
        )
        p.add_argument("--url", dest="url_option", metavar="URL", help="database URL")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(fn=fn, url=None, url_option_only=True)
        return p

    sessions = group("sessions", "inspect sessions (read-only)")
    _page_options(
        leaf(
            sessions,
            "list",
            "sessions with head revision, lease, queued batches, pending inputs, last update",
            lambda args: _listing(args, "sessions", _sessions_table),
        )
    )
    show = leaf(
        sessions,
        "show",
        "a session's head, lease, pending inputs, queued work, usage and active path",
        lambda args: _detail(args, "session", _sessions_render, _graph(args)),
    )
    show.add_argument("id", metavar="ID")
    show.add_argument(
        "--graph", choices=("mermaid", "dot"), help="print the session graph in this format"
    )

    runs = group("runs", "inspect runs (read-only)")
    _page_options(
        leaf(
            runs,
            "list",
            "runs with task, status and times",
            lambda args: _listing(args, "runs", _runs_table),
        )
    )
    leaf(
        runs, "show", "one run with its steps", lambda args: _detail(args, "run", _runs_render)
    ).add_argument("id", metavar="ID")

    runtime = group("runtime", "inspect runtimes (read-only)")
    _page_options(
        leaf(
            runtime,
            "list",
            "runtimes with lifecycle, snapshot revision, pending outbox and ops epoch",
            lambda args: _listing(args, "runtimes", _runtime_table),
        )
    )
    leaf(
        runtime,
        "show",
        "one runtime with binding, inputs and outbox",
        lambda args: _detail(args, "runtime", _runtime_render),
    ).add_argument("id", metavar="ID")

    def maintenance(name: str, help_: str, description: str, fn: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(
            name,
            help=help_,
            description=description + "\n\n" + url_rule,
            epilog=epilog,
            formatter_class=formatter,
        )
        p.add_argument("--url", dest="url_option", metavar="URL", help="database URL")
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.set_defaults(fn=fn, url=None, url_option_only=True)
        return p

    maintenance(
        "gc",
        "delete every blob no root reaches and print what was removed",
        "Blob GC (gc_unreachable_strict): one transaction holding the blob-GC lock; deletes "
        "every blob no session head, turn commit or artifact ref reaches. A progress bar on a "
        "terminal (none when piped or with --json). A corrupt root manifest aborts it (exit 2, "
        "nothing deleted).",
        _gc,
    )
    vacuum = maintenance(
        "vacuum",
        "delete tombstoned nodes and terminal turn inputs and print what was removed",
        "Vacuum one session (--session) or every session: deletes tombstoned graph nodes "
        "and cancelled/completed turn inputs, in one transaction. A progress bar on a "
        "terminal (none when piped or with --json).",
        _vacuum,
    )
    vacuum.add_argument("--session", metavar="ID", help="vacuum only this session")
