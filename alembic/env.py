"""Alembic environment of agentkeep: every decision lives in agentkeep.migrate.

Run from the repository (``alembic upgrade head``) or from code
(``agentkeep.migrate(url)``, ``agentkeep upgrade``), which passes its own
connection in ``config.attributes["connection"]``.
"""

from agentkeep.migrations import run_env

run_env()
