"""Shared fixtures: every storage test runs on SQLite and on a real PostgreSQL.

PostgreSQL is the running service on 127.0.0.1:5432 when reachable (or
``EMAIL_PLATFORM_TEST_POSTGRES_URL``), else a throwaway server from the ``pgserver`` package, so
the suite passes on a machine that has only Python. Each test gets a fresh database cloned from
a migrated template (the procrastinate pattern), or a fresh SQLite file.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url

from email_platform.common.config import ROUTES_SETTING
from email_platform.db.engine import make_engine, upgrade
from email_platform.local.dagster_home import WORKSPACE_YAML, PostgresStorage, render_dagster_yaml
from email_platform.mail.routes import DEMO_ROUTES
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.support import fresh_pg_database

# The tests publish the demo's events: they choose its route table, as a deployment names its
# own (nothing falls back to it). Set before any fixture, so daemons and runs inherit it.
os.environ[ROUTES_SETTING] = DEMO_ROUTES

BACKENDS = ["sqlite", "postgresql"]
#: Fixtures that give a test a database: such a test is marked ``db``.
DATABASE_FIXTURES = frozenset(
    {"database_url", "engine", "pg_app_url", "pg_dagster_home", "postgres_admin_url"}
)
PROOF = Path(__file__).resolve().parent / "proof"


def _in_proof(arg: str) -> bool:
    path = Path(arg.split("::", 1)[0]).resolve()
    return path == PROOF or PROOF in path.parents


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (pyproject's addopts): two test processes per core for the developer's run,
    whose tests mostly wait on servers and databases; one per core for the proof, whose daemons
    and drains each keep most of a core busy (four on two cores more than doubled each one's
    time, and a Celery drain ran out of its own). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return cores if any(_in_proof(arg) for arg in config.args) else 2 * cores


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers from what a test needs and where it lives, so ``-m "not db"`` runs only the
    tests that need no database and ``-m "not proof"`` leaves out the proof."""
    for item in items:
        if DATABASE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.db)
        if PROOF in Path(item.path).parents:
            item.add_marker(pytest.mark.proof)


TEMPLATE_DB = f"ep_template_{os.getpid()}"


def _reachable(url: URL) -> bool:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def postgres_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[URL]:
    """A superuser URL to the ``postgres`` database of some real PostgreSQL server."""
    explicit = os.environ.get("EMAIL_PLATFORM_TEST_POSTGRES_URL")
    candidates = [explicit] if explicit else []
    candidates.append("postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    for candidate in candidates:
        url = make_url(candidate).set(drivername="postgresql+psycopg")
        if _reachable(url):
            yield url
            return
    import pgserver  # a PostgreSQL 16 shipped on PyPI, for machines without the service

    server = pgserver.get_server(tmp_path_factory.mktemp("pgserver"), cleanup_mode="stop")
    try:
        yield make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def postgres_template(postgres_admin_url: URL) -> Iterator[str]:
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}"'))
        connection.execute(text(f'CREATE DATABASE "{TEMPLATE_DB}"'))
    template_engine = make_engine(
        postgres_admin_url.set(database=TEMPLATE_DB).render_as_string(hide_password=False)
    )
    upgrade(template_engine)
    template_engine.dispose()
    yield TEMPLATE_DB
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty application database on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
        return
    admin_url: URL = request.getfixturevalue("postgres_admin_url")
    template: str = request.getfixturevalue("postgres_template")
    with fresh_pg_database(admin_url, "ep_test", template) as url:
        yield url.render_as_string(hide_password=False)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    """The sandbox provider over real HTTP on loopback; short waits for fault tests."""
    server = SandboxServer(SandboxConfig(retry_after_s=0.2, timeout_delay_s=2.0))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pg_app_url(postgres_admin_url: URL, postgres_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL application database for a daemon end-to-end test."""
    with fresh_pg_database(postgres_admin_url, "ep_e2e", postgres_template) as url:
        yield url.render_as_string(hide_password=False)


@pytest.fixture
def pg_dagster_home(postgres_admin_url: URL, tmp_path: Path) -> Iterator[Path]:
    """A DAGSTER_HOME whose run, event-log and schedule storage is a fresh PostgreSQL database."""
    home = tmp_path / "dagster"
    home.mkdir()
    with fresh_pg_database(postgres_admin_url, "ep_dagster") as url:
        storage = PostgresStorage(
            hostname=url.host or "127.0.0.1",
            port=url.port or 5432,
            db_name=url.database or "",
            username=url.username or "postgres",
        )
        (home / "dagster.yaml").write_text(render_dagster_yaml(max_runs=8, postgres=storage))
        (home / "workspace.yaml").write_text(WORKSPACE_YAML)
        yield home
