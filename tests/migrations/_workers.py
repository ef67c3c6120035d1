"""Child-process bodies for the concurrent-upgrade tests (spawned, so importable by name)."""

from __future__ import annotations

from typing import Any


def upgrade_in_child(url: str, how: str, barrier: Any, results: Any) -> None:
    """Wait for the sibling, then bring ``url`` to head; report what happened.

    Both wait at ``barrier`` (its timeout set by the parent) once their
    imports are done, so neither starts while the other is still starting.

    Reports ``(how, "ok", revisions, adoptions)`` or ``(how, "error", repr)``.
    ``adoptions`` lists what this process's runs adopter returned each time it
    was consulted (``None``: no runs table; a revision: the legacy table was
    adopted at it). The adopter is only observed, never changed.
    """
    try:
        import agentkeep.runs.adoption as adoption
        from agentkeep import migrations as migrate
        from agentkeep.store import Store

        adoptions: list[str | None] = []
        real = adoption.detect_runs_revision

        def observed(conn: Any) -> str | None:
            rev = real(conn)
            adoptions.append(rev)
            return rev

        adoption.detect_runs_revision = observed
        barrier.wait()
        if how == "upgrade":
            revisions = migrate.upgrade(url)
        else:
            store = Store.open(url, migrate=True)
            store.close()
            revisions = migrate.current(url)
        results.put((how, "ok", revisions, adoptions))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((how, "error", repr(exc), []))
