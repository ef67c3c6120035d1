"""Append-only journals of acknowledged results, one per worker incarnation.

A worker writes one JSON object per line. An **ack** (a call that returned
a result the checker relies on) is written after the call returned, flushed
and fsync'd before the worker goes on, so every ack line on disk is a result
a caller really received. Lines that only feed the figures (typed refusals,
reads, unknown outcomes) are flushed without fsync. A worker SIGKILLed in
the middle of a write leaves at most one partial last line, which
:func:`read_journals` skips: that result was never acknowledged.

Every line has ``k`` (its kind), ``w`` (the worker slot) and ``i`` (the
incarnation); acks also carry ``t0``/``t1``, ``time.monotonic()`` before the
call and after it returned (CLOCK_MONOTONIC is one clock for every process
of the machine, so intervals of different workers compare).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ACK_KINDS", "Journal", "read_journals"]

#: Kinds of acknowledged results (fsync'd); the checker's input.
ACK_KINDS = frozenset(
    {
        "run_create",
        "run_trans",
        "run_step",
        "run_gen",
        "lease",
        "q_enq",
        "ti_enq",
        "ti_done",
        "commit",
        "replay",
        "boundary",
    }
)


class Journal:
    """The journal of one worker incarnation (``journal-<slot>-<inc>.jsonl`` in a directory)."""

    def __init__(self, directory: str | Path, slot: int, inc: int) -> None:
        self.path = Path(directory) / f"journal-{slot}-{inc}.jsonl"
        self._slot = slot
        self._inc = inc
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _write(self, kind: str, fields: dict[str, Any], durable: bool) -> None:
        line = json.dumps({"k": kind, "w": self._slot, "i": self._inc, **fields}) + "\n"
        os.write(self._fd, line.encode())
        if durable:
            os.fsync(self._fd)

    def ack(self, kind: str, t0: float, t1: float, **fields: Any) -> None:
        """Record an acknowledged result; returns once it is on disk."""
        assert kind in ACK_KINDS, kind
        self._write(kind, {"t0": t0, "t1": t1, **fields}, durable=True)

    def note(self, kind: str, **fields: Any) -> None:
        """Record an outcome that is not an ack (a refusal, a read, an unknown outcome)."""
        self._write(kind, fields, durable=kind in ("bad", "unknown"))

    def close(self) -> None:
        os.close(self._fd)


def read_journals(directory: str | Path) -> list[dict[str, Any]]:
    """Every complete line of every journal in ``directory`` (a torn last line is skipped)."""
    entries: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("journal-*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        # The text after the last newline is a line a SIGKILL cut short (or nothing).
        for n, raw in enumerate(lines[:-1]):
            try:
                entries.append(json.loads(raw))
            except ValueError as exc:
                raise AssertionError(
                    f"{path.name}:{n + 1}: a complete line does not parse"
                ) from exc
    return entries
