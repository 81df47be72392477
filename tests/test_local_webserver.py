"""The Dagster UI's server on a local home: a real ``dagster-webserver`` process loads the code
location and serves, over the GraphQL API the UI reads, the jobs and sensors we define, a run
recorded in the instance, and the analytics assets' metadata and checks.
"""

from pathlib import Path

import pytest
from dagster import DagsterInstance, job, materialize, op

from email_platform.assets import analytics_checks, analytics_warehouse
from email_platform.db.engine import make_engine, upgrade
from email_platform.definitions import defs
from email_platform.local.dagster_home import prepare_home
from email_platform.local.webserver import WebserverProcess
from email_platform.resources import AppDatabase, Warehouse

pytestmark = pytest.mark.e2e


@op
def say_hello() -> str:
    return "hello"


@job
def probe_job() -> None:
    say_hello()


def _record_runs(home: Path, app_home: Path) -> str:
    """A tiny run and the analytics assets on an empty database, straight into the instance."""
    database_url = f"sqlite:///{app_home / 'email_platform.sqlite3'}"
    engine = make_engine(database_url)
    upgrade(engine)
    engine.dispose()
    with DagsterInstance.from_config(str(home)) as instance:
        probe = probe_job.execute_in_process(instance=instance, tags={"email/probe": "yes"})
        analytics = materialize(
            [analytics_warehouse, *analytics_checks],
            instance=instance,
            resources={
                "app_database": AppDatabase(url=database_url),
                "warehouse": Warehouse(path=str(app_home / "warehouse.duckdb")),
            },
            raise_on_error=False,
        )
    assert probe.success
    assert analytics.success
    return probe.run_id


def test_the_webserver_serves_the_code_location_runs_and_asset_metadata(tmp_path: Path) -> None:
    home = tmp_path / "dagster"
    prepare_home(home)
    run_id = _record_runs(home, tmp_path)

    with WebserverProcess(home, {"EMAIL_PLATFORM_HOME": str(tmp_path)}) as webserver:
        assert webserver.wait_until_ready(timeout_s=90), webserver.log_path.read_text()[-3000:]

        served = webserver.definitions()
        assert {"lane_worker_job", "send_email_job", "ingest_webhooks_job"} <= set(served["jobs"])
        repository = defs.get_repository_def()
        assert served["sensors"] == sorted(sensor.name for sensor in repository.sensor_defs)

        runs = {run["runId"]: run for run in webserver.runs()}
        probe = runs[run_id]
        assert probe["jobName"] == "probe_job"
        assert probe["status"] == "SUCCESS"
        assert probe["tags"]["email/probe"] == "yes"
        assert [run["runId"] for run in webserver.runs(job_name="probe_job")] == [run_id]
        assert any('"say_hello"' in message for message in webserver.run_log_messages(run_id))

        funnel = webserver.latest_asset_metadata("email_funnel")
        assert funnel["dagster/row_count"] == 0
        assert isinstance(funnel["refresh_s"], float)
        assert funnel["full_build"] is True
        checks = {check["name"]: check for check in webserver.asset_checks("email_funnel")}
        assert set(checks) == {
            "one_row_per_message",
            "provider_events_joined",
            "no_negative_latencies",
        }
        assert all(check["status"] is not None for check in checks.values())
    assert webserver.process is None
