"""A host Alembic project whose own tables are named like agentkeep's, with ``schema=``.

The host project of :mod:`tests.migrations.test_host_alembic` (``alembic
init``, the real ``alembic`` command as a subprocess) has a third model: its
own ``runs`` table. Its ``env.py`` takes the README's namespace lines
(section "Your tables named like ours: schema=")::

    include_object=agentkeep.migrations.include_object_for("agentkeep"),
    ...
    agentkeep.migrate(connection, schema="agentkeep")

What holds, on SQLite and Postgres:

* ``alembic revision --autogenerate`` creates the host's ``runs`` (the
  namespace's hook does not hide it) and nothing of agentkeep's;
* ``alembic upgrade head`` brings both to head: the host's ``runs`` in the
  default namespace, agentkeep's in its own (a Postgres schema, or the SQLite
  file next to the database), without drift; again is a no-op;
* ``alembic check`` passes; ``alembic downgrade base`` drops the host's
  tables only, agentkeep's rows stay;
* offline ``--sql``: on Postgres the host's script carries agentkeep's DDL in
  the schema; on SQLite the host's offline run is refused with the command
  that prints the namespace's script.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentkeep import migrations as migrate
from agentkeep.runs.domain import RunRecord
from agentkeep.store import Store

from .test_host_alembic import (
    MODELS,
    OFFLINE_LINE,
    SNIPPET_IMPORT,
    SNIPPET_ONLINE,
    TEMPLATE_OFFLINE,
    TEMPLATE_ONLINE,
    Host,
    init_host_project,
)

NS = "agentkeep"
ONLINE = SNIPPET_ONLINE.replace(
    "include_object=agentkeep.migrations.include_object,",
    f'include_object=agentkeep.migrations.include_object_for("{NS}"),',
).replace("agentkeep.migrate(connection)", f'agentkeep.migrate(connection, schema="{NS}")')
OFFLINE = OFFLINE_LINE.replace("context.get_bind())", f'context.get_bind(), schema="{NS}")')
HOST_MODELS = (
    MODELS
    + '''

class HostRun(Base):
    """The host's own runs: nothing to do with agentkeep's."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(50))
'''
)
HOST_TABLES = {"author", "book", "runs"}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    root = init_host_project(tmp_path, HOST_MODELS)
    env_py = root / "migrations" / "env.py"
    text = env_py.read_text()
    text, n_import = re.subn(
        r"(?m)^from alembic import context\n",
        "from alembic import context\n\n" + SNIPPET_IMPORT + "from hostapp.models import Base\n",
        text,
    )
    text, n_meta = re.subn(r"(?m)^target_metadata = None$", "target_metadata = Base.metadata", text)
    text, n_online = TEMPLATE_ONLINE.subn(ONLINE, text)
    text, n_offline = TEMPLATE_OFFLINE.subn(r"\1" + OFFLINE + r"\2", text)
    assert (n_import, n_meta, n_online, n_offline) == (1, 1, 1, 1), "alembic's template changed"
    env_py.write_text(text)

    made = Host(root, "")
    made.alembic(
        "revision", "--autogenerate", "-m", "host models", url=f"sqlite:///{tmp_path / 's.db'}"
    )
    (revision_file,) = made.revision_files()
    source = revision_file.read_text()
    upgrade_body = source.split("def upgrade()")[1].split("def downgrade()")[0]
    created = set(re.findall(r"op\.create_table\('(\w+)'", upgrade_body))
    assert created == HOST_TABLES  # the host's runs is the host's; nothing of agentkeep's
    assert "drop_table" not in upgrade_body
    made.revision = re.search(r"(?m)^revision: str = '(\w+)'", source).group(1)  # type: ignore[union-attr]
    return made


def default_tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


def host_runs(url: str) -> list[Any]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text("SELECT id, label FROM runs"))]
    finally:
        engine.dispose()


def test_host_alembic_with_its_own_runs_and_agentkeep_in_a_schema(
    host: Host, fresh_url: str, backend: str
) -> None:
    up = host.alembic("upgrade", "head", url=fresh_url)
    assert f"Running upgrade  -> {host.revision}" in up.stderr
    assert "Running upgrade  -> runs_0001" in up.stderr
    assert default_tables(fresh_url) == HOST_TABLES | {"alembic_version"}
    assert migrate.current(fresh_url, schema=NS) == migrate.head_revisions()
    assert migrate.check(fresh_url, schema=NS) == []
    assert migrate.current(fresh_url) == ()  # nothing of agentkeep's in the default namespace

    again = host.alembic("upgrade", "head", url=fresh_url)
    assert "Running upgrade" not in again.stderr

    check = host.alembic("check", url=fresh_url)
    assert "No new upgrade operations detected" in check.stdout + check.stderr

    engine = sa.create_engine(fresh_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO runs (id, label) VALUES (1, 'the host''s run')"))
    engine.dispose()
    with Store.open(fresh_url, schema=NS) as store:
        store.runs.create(RunRecord.new("R-1", "T-1", 10))

    offline = host.alembic("upgrade", "head", "--sql", url=fresh_url, ok=backend == "postgres")
    if backend == "postgres":
        assert "CREATE TABLE runs (" in offline.stdout  # the host's, in its own script part
        assert f'SET LOCAL search_path TO "{NS}"' in offline.stdout
        assert f"CREATE TABLE {NS}.{migrate.VERSION_TABLE}" in offline.stdout
    else:
        assert offline.returncode != 0
        assert f"agentkeep upgrade --sql --schema {NS}" in offline.stderr

    host.alembic("downgrade", "base", url=fresh_url)
    assert default_tables(fresh_url) == {"alembic_version"}
    assert migrate.current(fresh_url, schema=NS) == migrate.head_revisions()
    with Store.open(fresh_url, schema=NS) as store:
        assert [r.id for r in store.runs.list()] == ["R-1"]

    host.alembic("upgrade", "head", url=fresh_url)
    assert host_runs(fresh_url) == []  # the host's runs came back empty: its own table
    assert default_tables(fresh_url) == HOST_TABLES | {"alembic_version"}
