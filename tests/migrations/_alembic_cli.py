"""Run the ``alembic`` command line from the repository root, as a user would.

The executable is the one installed next to the test's interpreter
(``Path(sys.executable).parent / "alembic"``), run with the test's environment
and the package source of the imported ``agentkeep`` first on ``PYTHONPATH``,
so a worktree tests its own code and scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import agentkeep

REPO_ROOT = Path(__file__).resolve().parents[2]
ALEMBIC = Path(sys.executable).parent / "alembic"
#: The directory holding the imported ``agentkeep`` package (``src/``).
PACKAGE_SOURCE = Path(agentkeep.__file__).resolve().parents[1]


def subprocess_env(**overrides: str | None) -> dict[str, str]:
    """The test's environment with ``PACKAGE_SOURCE`` first on ``PYTHONPATH``.

    Each override sets a variable, or removes it when its value is ``None``.
    """
    env = dict(os.environ)
    paths = [str(PACKAGE_SOURCE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_alembic(
    *args: str, url: str | None = None, env_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``alembic [-x url=URL] ARGS...`` with cwd = repo root.

    Args:
        args: the alembic command and its arguments.
        url: passed as ``-x url=...`` when given.
        env_url: put in ``AGENTKEEP_DATABASE_URL`` when given (else removed).
    """
    env = subprocess_env(AGENTKEEP_DATABASE_URL=env_url)
    argv = [str(ALEMBIC)]
    if url is not None:
        argv += ["-x", f"url={url}"]
    argv += list(args)
    return subprocess.run(
        argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
