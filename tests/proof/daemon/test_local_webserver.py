"""The Dagster UI's server on a local home: a real ``dagster-webserver`` process loads the code
location and serves, over the GraphQL API the UI reads, the jobs and sensors we define, a run
recorded in the instance, and the analytics assets' metadata and checks.
"""

from pathlib import Path

from dagster import DagsterInstance, job, materialize, op

from email_platform.assets import analytics_checks, analytics_warehouse
from email_platform.db.engine import make_engine, upgrade
from email_platform.definitions import defs
from email_platform.local.dagster_home import prepare_home
from email_platform.local.webserver import WebserverProcess
from email_platform.resources import AppDatabase, Warehouse


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
                "email_database": AppDatabase(url=database_url),
                "email_warehouse": Warehouse(path=str(app_home / "warehouse.duckdb")),
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

        # Every definition the UI lists explains itself, with the text the code gives it.
        described = webserver.descriptions()
        assert described["sensors"] == {s.name: s.description for s in repository.sensor_defs}
        assert described["schedules"] == {s.name: s.description for s in repository.schedule_defs}
        jobs = {j.name: j.description for j in repository.get_all_jobs()}
        assert {name: jobs[name] for name in described["jobs"]} == described["jobs"]
        assets = defs.resolve_asset_graph()
        assert described["assets"] == {
            key.to_user_string(): assets.get(key).description for key in assets.get_all_asset_keys()
        }
        assert described["checks"] == {
            f"{key.asset_key.to_user_string()}:{key.name}": assets.get(key).description
            for key in assets.asset_check_keys
        }
        for kind, texts in described.items():
            assert all(text and len(text) > 20 for text in texts.values()), (kind, texts)
        assert {
            "email_platform/email_funnel",
            "email_platform/stg_sends",
            "email_platform/email_outbox",
        } <= set(described["assets"])
        assert "email_platform/email_funnel:one_row_per_message" in described["checks"]

        runs = {run["runId"]: run for run in webserver.runs()}
        probe = runs[run_id]
        assert probe["jobName"] == "probe_job"
        assert probe["status"] == "SUCCESS"
        assert probe["tags"]["email/probe"] == "yes"
        assert [run["runId"] for run in webserver.runs(job_name="probe_job")] == [run_id]
        assert any('"say_hello"' in message for message in webserver.run_log_messages(run_id))

        funnel = webserver.latest_asset_metadata("email_platform/email_funnel")
        assert funnel["dagster/row_count"] == 0
        assert isinstance(funnel["refresh_s"], float)
        assert funnel["full_build"] is True
        checks = {
            check["name"]: check for check in webserver.asset_checks("email_platform/email_funnel")
        }
        data_checks = {"one_row_per_message", "provider_events_joined", "no_negative_latencies"}
        # bulk_brake runs in the refresh job (email_analytics_job), not in this materialization.
        assert set(checks) == {*data_checks, "bulk_brake"}
        assert all(checks[name]["status"] is not None for name in data_checks)
    assert webserver.process is None
