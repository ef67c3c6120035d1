"""Lease-owner liveness (spec sessions §4.14): capture, the procfs probe, "definitely dead".

These tests need Linux procfs (the machine this project runs on); they use no
database. The start time is field 22 (``starttime``) of ``/proc/<pid>/stat``;
the tests read it themselves, and one child renames itself to a name holding
``") "`` to check that the parser counts fields after the *last* ``") "``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentkeep.sessions import liveness
from agentkeep.sessions.domain import LeaseOwnerIdentity, LocalProcess, Opaque
from agentkeep.sessions.liveness import (
    capture_liveness,
    is_definitely_dead_for_claimant,
    procfs_probe,
)
from tests.racing import READY_TIMEOUT_S

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs")

EVIL_COMM = "x) 1 2 3) y"  # 11 bytes: fits the 15-byte comm


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat, numbered from 1 (index 0 is field 1, the pid)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    open_paren, close_paren = text.index("("), text.rindex(")")
    return [text[:open_paren].strip(), text[open_paren + 1 : close_paren]] + text[
        close_paren + 1 :
    ].split()


def start_time(pid: int | str) -> str:
    """Field 22, starttime."""
    return stat_fields(pid)[21]


def _host_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        p = Path(path)
        if p.exists() and p.read_text().strip():
            return p.read_text().strip()
    return socket.gethostname()


def _child_capture(out: Any) -> None:
    out.put(capture_liveness())


# --------------------------------------------------------------------------
# capture_liveness


def test_capture_liveness_names_this_process() -> None:
    """On Linux: LocalProcess with this pid, field 22 of /proc/self/stat, boot id and host id."""
    me = capture_liveness()
    assert isinstance(me, LocalProcess)
    assert me.pid == os.getpid()
    assert me.process_start == start_time("self") == start_time(os.getpid())
    assert me.process_start.isdigit()
    assert me.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert me.host_id == _host_id()
    assert capture_liveness() == me  # stable for the life of the process


def test_capture_liveness_in_a_child_names_the_child() -> None:
    """A spawned child captures its own pid and start time, on the same host and boot."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_capture, args=(out,), daemon=True)
    child.start()
    try:
        theirs = out.get(timeout=READY_TIMEOUT_S)  # its start-up (spawn, imports) comes first
        assert child.pid is not None
        assert isinstance(theirs, LocalProcess)
        assert theirs.pid == child.pid != os.getpid()
        mine = capture_liveness()
        assert isinstance(mine, LocalProcess)
        assert (theirs.host_id, theirs.boot_id) == (mine.host_id, mine.boot_id)
        assert int(theirs.process_start) >= int(mine.process_start)  # started after us
        child.join(30)
        assert child.exitcode == 0
        # once it has exited and been reaped, it is verifiably gone
        assert procfs_probe(theirs.pid, theirs.process_start) == "gone"
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


def test_capture_liveness_without_procfs_is_opaque(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where procfs is missing, capture gives Opaque (never taken over before expiry).

    White-box: the module's procfs root is pointed at an empty directory.
    """
    monkeypatch.setattr(liveness, "_PROC", tmp_path)
    assert capture_liveness() == Opaque()


# --------------------------------------------------------------------------
# procfs_probe


def test_probe_of_this_process_is_alive() -> None:
    assert procfs_probe(os.getpid(), start_time(os.getpid())) == "alive"


def test_probe_of_this_pid_with_another_start_is_gone() -> None:
    """Same pid, another start time: the pid was reused → gone."""
    start = start_time(os.getpid())
    assert procfs_probe(os.getpid(), str(int(start) + 1)) == "gone"
    assert procfs_probe(os.getpid(), "0") == "gone"


def test_probe_of_a_dead_child_is_gone() -> None:
    """A child that was alive (probe: alive) is killed and reaped → its pid is gone."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = start_time(child.pid)
        assert procfs_probe(child.pid, start) == "alive"
    finally:
        child.kill()
        child.wait(10)
    assert not Path(f"/proc/{child.pid}").exists()
    assert procfs_probe(child.pid, start) == "gone"


def test_probe_parses_a_process_name_holding_paren_space() -> None:
    """A live process named "x) 1 2 3) y" is still read right (fields after the last ") ")."""
    code = (
        "import ctypes, sys, time\n"
        "sys.stdin.readline()\n"
        f"ctypes.CDLL(None).prctl(15, {EVIL_COMM.encode()!r}, 0, 0, 0)\n"
        "from agentkeep.sessions.liveness import capture_liveness\n"
        "print(capture_liveness().process_start, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        start = start_time(child.pid)  # read while the name is still plain
        child.stdin.write("go\n")
        child.stdin.flush()
        captured = child.stdout.readline().strip()
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == EVIL_COMM
        assert captured == start  # capture_liveness inside the renamed process
        assert procfs_probe(child.pid, start) == "alive"
        assert procfs_probe(child.pid, str(int(start) + 1)) == "gone"
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "unknown"),  # stat is unreadable (a directory here): an I/O error
        ("garbage without fields", "unknown"),
        ("42 (a) b) S" + " 0" * 18 + " 777 0 0", "alive"),  # field 22 is 777
        ("42 (a) b) S" + " 0" * 18 + " 778 0 0", "gone"),
    ],
)
def test_probe_on_a_fake_procfs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None, expected: str
) -> None:
    """I/O errors and unparsable stat files are "unknown", never "gone".

    White-box: the module's procfs root is pointed at a temporary directory.
    """
    (tmp_path / "42").mkdir()
    if content is None:
        (tmp_path / "42" / "stat").mkdir()
    else:
        (tmp_path / "42" / "stat").write_text(content)
    monkeypatch.setattr(liveness, "_PROC", tmp_path)
    assert procfs_probe(42, "777") == expected
    assert procfs_probe(43, "777") == "gone"  # no entry at all


# --------------------------------------------------------------------------
# is_definitely_dead_for_claimant


def _lp(pid: int = 4101, start: str = "5001", host: str = "h1", boot: str = "b1") -> LocalProcess:
    return LocalProcess(host_id=host, boot_id=boot, pid=pid, process_start=start)


def _owner(name: str, live: LocalProcess | Opaque) -> LeaseOwnerIdentity:
    return LeaseOwnerIdentity(owner_id=name, incarnation_id=f"{name}-1", liveness=live)


CLAIMANT_LP = _lp(pid=4102, start="5002")
TRUTH_TABLE = [
    # (label, holder liveness, claimant liveness, probe answer, dead?, probe consulted?)
    ("opaque holder", Opaque(), CLAIMANT_LP, "gone", False, False),
    ("opaque claimant", _lp(), Opaque(), "gone", False, False),
    ("both opaque", Opaque(), Opaque(), "gone", False, False),
    ("other host", _lp(host="h2"), CLAIMANT_LP, "gone", False, False),
    ("other boot", _lp(boot="b2"), CLAIMANT_LP, "gone", False, False),
    ("probe alive", _lp(), CLAIMANT_LP, "alive", False, True),
    ("probe unknown", _lp(), CLAIMANT_LP, "unknown", False, True),
    ("probe gone", _lp(), CLAIMANT_LP, "gone", True, True),
]


@pytest.mark.parametrize(
    "label,holder,claimant,answer,dead,consulted", TRUTH_TABLE, ids=[r[0] for r in TRUTH_TABLE]
)
def test_definitely_dead_truth_table(
    label: str,
    holder: LocalProcess | Opaque,
    claimant: LocalProcess | Opaque,
    answer: str,
    dead: bool,
    consulted: bool,
) -> None:
    """Dead only for two LocalProcess owners on one host and boot whose probe says "gone"."""
    calls: list[tuple[int, str]] = []

    def probe(pid: int, start: str) -> Any:
        calls.append((pid, start))
        return answer

    got = is_definitely_dead_for_claimant(_owner("H", holder), _owner("C", claimant), probe)
    assert got is dead
    if consulted:
        assert calls == [(4101, "5001")]  # the holder's pid and start, not the claimant's
    else:
        assert calls == []


def test_definitely_dead_with_the_default_procfs_probe() -> None:
    """Default probe = procfs: this live process is not dead; our pid with another start is."""
    me = capture_liveness()
    assert isinstance(me, LocalProcess)
    claimant = _owner("C", me)
    assert is_definitely_dead_for_claimant(_owner("H", me), claimant) is False
    reused = me.model_copy(update={"process_start": str(int(me.process_start) + 1)})
    assert is_definitely_dead_for_claimant(_owner("H", reused), claimant) is True
    elsewhere = reused.model_copy(update={"boot_id": "another-boot"})
    assert is_definitely_dead_for_claimant(_owner("H", elsewhere), claimant) is False
