"""A real ``dagster-daemon`` on a PostgreSQL Dagster instance keeps its storage connections open
while its sensors tick (``jobs/storage.py``): the server processes serving it when it has come
up still serve it after several rounds of ticks, instead of one connection per read and write."""

import json

import pytest
import yaml
from sqlalchemy import create_engine, text

from email_platform.local.dagster_home import DaemonProcess, wait_for
from email_platform.sandbox.server import SandboxConfig, SandboxServer


def _daemon_sessions(admin, db: str) -> dict[int, object]:  # type: ignore[no-untyped-def]
    with admin.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT pid, backend_start FROM pg_stat_activity "
                "WHERE datname = :db AND application_name = 'dagster-daemon'"
            ),
            {"db": db},
        ).all()
    return {row.pid: row.backend_start for row in rows}


def _ticks(admin_url, db: str) -> int:  # type: ignore[no-untyped-def]
    engine = create_engine(admin_url.set(database=db))
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT count(*) FROM job_ticks")).scalar_one()
    finally:
        engine.dispose()


@pytest.mark.timeout(300)
def test_the_daemon_keeps_its_storage_connections_while_its_sensors_tick(
    pg_app_url, pg_dagster_home, postgres_admin_url
):
    config = yaml.safe_load((pg_dagster_home / "dagster.yaml").read_text())
    db = config["storage"]["custom"]["config"]["postgres_db"]["db_name"]
    sandbox = SandboxServer(SandboxConfig())
    sandbox.start()
    env = {
        "EMAIL_PLATFORM_DATABASE_URL": pg_app_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
        # Nothing to send and no warm worker: only the daemon's own reads and writes.
        "EMAIL_PLATFORM_LANES": json.dumps({"critical": {"warm_workers": 0}}),
    }
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    daemon = DaemonProcess(pg_dagster_home, env)
    try:
        daemon.start()
        assert daemon.wait_until_ticking(), daemon.log_path.read_text()[-3000:]
        assert wait_for(lambda: _daemon_sessions(admin, db), 60, 0.2)
        first = _daemon_sessions(admin, db)
        ticks = _ticks(postgres_admin_url, db)
        # Two rounds of the lane sensors' ticks (every 5 s), each written through the storage.
        assert wait_for(lambda: _ticks(postgres_admin_url, db) >= ticks + 6, 120, 0.5), (
            daemon.log_path.read_text()[-3000:]
        )
        later = _daemon_sessions(admin, db)
        kept = {pid for pid in first if later.get(pid) == first[pid]}
        assert kept, (first, later)
        assert daemon.alive()
    finally:
        daemon.stop()
        sandbox.stop()
        admin.dispose()
