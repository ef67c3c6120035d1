"""Alembic environment of agentkeep: every decision lives in agentkeep.migrations.

Used by the ``alembic`` command line on these scripts (``alembic upgrade head``
from a checkout, URL from ``-x url=...``, ``AGENTKEEP_DATABASE_URL`` or
``alembic.ini``). ``agentkeep.migrate()`` and the ``agentkeep`` command drive the
same scripts directly on one connection and do not run this file.
"""

from agentkeep.migrations import run_env

run_env()
