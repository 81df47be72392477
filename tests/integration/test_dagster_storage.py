"""Dagster's PostgreSQL storage as ``dagster.yaml`` configures it (``jobs/storage.py``): the
daemon's instance holds its connections open, every other process opens one per read and
write as dagster-postgres does, and a held connection the server dropped is replaced."""

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL

from email_platform.jobs import storage as held
from email_platform.local.dagster_home import PostgresStorage, render_dagster_yaml
from tests.support import fresh_pg_database

pytestmark = pytest.mark.db


@pytest.fixture
def dagster_db(postgres_admin_url: URL) -> Iterator[URL]:
    with fresh_pg_database(postgres_admin_url, "ep_held") as url:
        yield url


def _instance(url: URL, home: Path, program: str, monkeypatch) -> DagsterInstance:
    """The instance a process named ``program`` makes from the dagster.yaml the platform writes."""
    home.mkdir()
    storage = PostgresStorage(
        hostname=url.host or "127.0.0.1",
        port=url.port or 5432,
        db_name=url.database or "",
        username=url.username or "postgres",
        password=url.password or "",
    )
    (home / "dagster.yaml").write_text(render_dagster_yaml(postgres=storage))
    monkeypatch.setattr(held.sys, "argv", [program, "run"])
    return DagsterInstance.from_config(str(home))


def _engines(instance: DagsterInstance) -> list[Engine]:
    return [
        instance.run_storage._engine,  # type: ignore[attr-defined]
        instance.event_log_storage._engine,  # type: ignore[attr-defined]
        instance.schedule_storage._engine,  # type: ignore[attr-defined]
    ]


def _count_connections(instance: DagsterInstance) -> list[int]:
    opened = [0]

    def on_connect(*_args: object) -> None:
        opened[0] += 1

    for engine in _engines(instance):
        event.listen(engine, "connect", on_connect)
    return opened


def _reads(instance: DagsterInstance, times: int) -> None:
    """What a daemon iteration reads: runs, sensor state, event records."""
    for _ in range(times):
        instance.get_runs(limit=5)
        instance.all_instigator_state()
        instance.get_run_records(limit=1)


def test_the_daemons_instance_opens_each_connection_once(dagster_db, tmp_path, monkeypatch):
    instance = _instance(dagster_db, tmp_path / "home", "/srv/venv/bin/dagster-daemon", monkeypatch)
    try:
        opened = _count_connections(instance)
        _reads(instance, 20)
        # 60 reads over three storages, one after another: a connection each, held.
        assert 1 <= opened[0] <= 3
    finally:
        instance.dispose()


def test_every_other_process_opens_a_connection_per_read(dagster_db, tmp_path, monkeypatch):
    instance = _instance(dagster_db, tmp_path / "home", "/srv/venv/bin/dagster", monkeypatch)
    try:
        opened = _count_connections(instance)
        _reads(instance, 10)
        assert opened[0] >= 30  # dagster-postgres's own behaviour (a pool that holds none)
    finally:
        instance.dispose()


def test_held_connections_serve_many_threads_and_survive_the_server_dropping_them(
    dagster_db, tmp_path, monkeypatch
):
    instance = _instance(dagster_db, tmp_path / "home", "dagster-daemon", monkeypatch)
    admin = create_engine(dagster_db.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        errors: list[BaseException] = []

        def daemon_thread() -> None:
            try:
                _reads(instance, 10)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=daemon_thread) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors
        # The server ends every session of the database (a restart or a failover would): the
        # next reads replace the held connections instead of failing.
        with admin.connect() as connection:
            dropped = connection.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"
                ),
                {"db": dagster_db.database},
            ).scalar_one()
        assert dropped >= 1
        _reads(instance, 3)
        assert instance.get_runs() == []
    finally:
        instance.dispose()
        admin.dispose()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/local/bin/dagster-daemon", "run"], True),
        (["dagster-daemon"], True),
        (["/srv/venv/lib/python3.11/site-packages/dagster/_daemon/__main__.py", "run"], True),
        (["/srv/venv/lib/python3.11/site-packages/dagster/__main__.py", "api"], False),
        (["/usr/local/bin/dagster", "api", "grpc"], False),
        (["/usr/bin/python3", "-m", "dagster_webserver"], False),
        (["dagster-daemon-helper"], False),
        ([], False),
    ],
)
def test_only_the_daemon_process_holds_connections(argv, expected):
    assert held.in_daemon(argv) is expected
