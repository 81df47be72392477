"""The code location loads from workspace.yaml and shows what the UI promises."""

from email_platform.definitions import defs
from tests.paths import ROOT


def test_workspace_points_at_the_definitions_module():
    text = (ROOT / "workspace.yaml").read_text()
    assert "module_name: email_platform.definitions" in text


def test_every_job_and_sensor_resolves_with_a_description():
    repository = defs.get_repository_def()
    assert sorted(job.name for job in repository.get_all_jobs()) == [
        "__ASSET_JOB",  # Dagster's implicit job for the analytics assets
        "alert_job",
        "email_analytics_job",
        "ingest_webhooks_job",
        "lane_worker_job",
        "retention_job",
        "send_email_job",
    ]
    sensors = {sensor.name: sensor for sensor in repository.sensor_defs}
    assert set(sensors) == {
        "critical_outbox_sensor",
        "transactional_outbox_sensor",
        "bulk_outbox_sensor",
        "email_run_failure_sensor",
        "webhook_inbox_sensor",
        "analytics_refresh_sensor",
        "bulk_brake_sensor",
        "alerts_sensor",
        "email_outcomes_sensor",
    }
    for sensor in sensors.values():
        assert sensor.description and len(sensor.description) > 40
    assert repository.get_job("send_email_job").description
    op = repository.get_job("send_email_job").graph.node_defs[0]
    assert op.name == "send_email_batch" and "idempotency key" in op.description
    # Run in their run's process, they retry by raising RetryRequested (ops/retry.py): with a
    # RetryPolicy Dagster would retry an operator's terminate too.
    for name in ("send_email_job", "ingest_webhooks_job"):
        assert repository.get_job(name).executor_def.name == "in_process"
        assert repository.get_job(name).graph.node_defs[0].retry_policy is None
    worker = repository.get_job("lane_worker_job").graph.node_defs[0]
    assert worker.name == "run_lane_worker" and "idempotency keys" in worker.description
    assert worker.retry_policy is not None


def test_lane_sensors_target_the_send_and_worker_jobs_and_start_running():
    repository = defs.get_repository_def()
    for name in ("critical_outbox_sensor", "transactional_outbox_sensor", "bulk_outbox_sensor"):
        sensor = repository.get_sensor_def(name)
        assert {t.job_name for t in sensor.targets} == {"send_email_job", "lane_worker_job"}
        assert sensor.default_status.value == "RUNNING"
    # The critical lane ticks at least as often as the others.
    intervals = {s.name: s.minimum_interval_seconds for s in repository.sensor_defs}
    assert intervals["critical_outbox_sensor"] <= intervals["transactional_outbox_sensor"]
    assert intervals["critical_outbox_sensor"] <= intervals["bulk_outbox_sensor"]


def test_required_resources_are_bound():
    repository = defs.get_repository_def()
    resources = repository.get_top_level_resources()
    assert set(resources) == {
        "email_database",
        "email_provider",
        "email_lanes",
        "email_routing",
        "email_warehouse",
        "email_alerts",
    }


class _Attempt:
    def __init__(self, retry_number: int) -> None:
        self.retry_number = retry_number


def test_an_ops_own_retry_follows_the_step_policy_and_lets_interrupts_and_outcomes_through():
    import pytest
    from dagster import Failure, RetryRequested

    from email_platform.ops.retry import STEP_RETRY_POLICY, retried_on_error

    first, last = _Attempt(0), _Attempt(STEP_RETRY_POLICY.max_retries)
    with pytest.raises(RetryRequested) as retry, retried_on_error(first):  # type: ignore[arg-type]
        raise OSError("connection reset")
    assert retry.value.max_retries == STEP_RETRY_POLICY.max_retries
    assert 0 <= retry.value.seconds_to_wait <= STEP_RETRY_POLICY.delay  # full jitter, first
    assert isinstance(retry.value.__cause__, OSError)
    # The last attempt fails with the error itself.
    with pytest.raises(OSError), retried_on_error(last):  # type: ignore[arg-type]
        raise OSError("connection reset")
    for passed in (KeyboardInterrupt(), Failure("dead letters"), RetryRequested(max_retries=4)):
        with pytest.raises(type(passed)), retried_on_error(first):  # type: ignore[arg-type]
            raise passed
