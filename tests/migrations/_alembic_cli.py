"""Run the ``alembic`` command line from the repository root, as a user would."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ALEMBIC = REPO_ROOT / ".venv" / "bin" / "alembic"


def run_alembic(
    *args: str, url: str | None = None, env_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``alembic [-x url=URL] ARGS...`` with cwd = repo root.

    Args:
        args: the alembic command and its arguments.
        url: passed as ``-x url=...`` when given.
        env_url: put in ``AGENTKEEP_DATABASE_URL`` when given (else removed).
    """
    env = {k: v for k, v in os.environ.items() if k != "AGENTKEEP_DATABASE_URL"}
    if env_url is not None:
        env["AGENTKEEP_DATABASE_URL"] = env_url
    argv = [str(ALEMBIC)]
    if url is not None:
        argv += ["-x", f"url={url}"]
    argv += list(args)
    return subprocess.run(
        argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
