"""Lease-owner liveness: capture this process's identity, and decide "definitely dead".

See docs/sessions.md#lease-owners and docs/decisions.md#lease-owner-liveness.

A takeover before expiry (``reclaim_session_execution_lease``) is allowed only
when the holder is *verifiably* gone: both owners are :class:`LocalProcess` on
the same host and boot, and the holder's pid has no procfs entry, or has one
with a different start time (the pid was reused). Anything uncertain — an
:class:`Opaque` owner, another host, an I/O error — means "not dead".

The process check is a :data:`ProcessProbe`, injectable so tests can decide
it; :func:`procfs_probe` reads ``/proc``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

from agentkeep.sessions.domain import LeaseOwnerIdentity, LocalProcess, Opaque

__all__ = [
    "ProcessProbe",
    "ProcessState",
    "capture_liveness",
    "is_definitely_dead_for_claimant",
    "procfs_probe",
]

ProcessState = Literal["gone", "alive", "unknown"]
#: ``probe(pid, process_start) -> "gone" | "alive" | "unknown"``.
ProcessProbe = Callable[[int, str], ProcessState]

_PROC: Final = Path("/proc")


def _stat_start_time(stat_text: str) -> str:
    # Field 22 (starttime): after the last ") " the fields restart at field 3.
    return stat_text.rsplit(") ", 1)[1].split()[19]


def procfs_probe(pid: int, process_start: str) -> ProcessState:
    """Read ``/proc/<pid>/stat``: gone if absent or started at another time."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    try:
        return "alive" if _stat_start_time(text) == process_start else "gone"
    except IndexError:
        return "unknown"


def _host_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return socket.gethostname()


def capture_liveness() -> LocalProcess | Opaque:
    """This process as a :class:`LocalProcess` (host, boot, pid, start time), or Opaque.

    Opaque where procfs is not available: such an owner is never taken over
    before its lease expires.
    """
    try:
        boot_id = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        start = _stat_start_time((_PROC / "self/stat").read_text())
    except (OSError, IndexError):
        return Opaque()
    return LocalProcess(host_id=_host_id(), boot_id=boot_id, pid=os.getpid(), process_start=start)


def is_definitely_dead_for_claimant(
    holder: LeaseOwnerIdentity,
    claimant: LeaseOwnerIdentity,
    probe: ProcessProbe = procfs_probe,
) -> bool:
    """True only if the claimant can verify that the holder's process is gone."""
    h, c = holder.liveness, claimant.liveness
    if not isinstance(h, LocalProcess) or not isinstance(c, LocalProcess):
        return False
    if h.host_id != c.host_id or h.boot_id != c.boot_id:
        return False
    return probe(h.pid, h.process_start) == "gone"
