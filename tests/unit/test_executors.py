"""The executor setting, the Celery worker's command line and the lost-step watch."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from dagster import DagsterRunStatus, in_process_executor, multiprocess_executor

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.jobs import executors, lane_worker_job, send_email_job
from email_platform.local.celery_worker import worker_command


def test_the_default_keeps_todays_executors():
    settings = config.executor_settings({})
    assert settings.kind == "default"
    assert send_email_job.executor_def.name == in_process_executor.name
    assert lane_worker_job.executor_def.name == multiprocess_executor.name
    assert lane_worker_job.executor_def.config_schema.as_field().config_type.key == (
        multiprocess_executor.config_schema.as_field().config_type.key
    )


def test_celery_settings_route_lanes_to_queues():
    settings = config.executor_settings(
        {
            "EMAIL_PLATFORM_EXECUTOR": "Celery",
            "EMAIL_PLATFORM_CELERY_BROKER": "pyamqp://guest@127.0.0.1:5672//",
            "EMAIL_PLATFORM_CELERY_LANE_QUEUES": " critical=critical , transactional=mail",
        }
    )
    assert settings.kind == "celery"
    assert settings.result_backend == "rpc://"  # AMQP: no Redis backend to reuse
    assert settings.queue_for("critical") == "critical"
    assert settings.queue_for("transactional") == "mail"
    assert settings.queue_for("bulk") == settings.queue_for(None) == "dagster"
    assert settings.queues() == ["dagster", "critical", "mail"]
    redis = config.executor_settings({"EMAIL_PLATFORM_EXECUTOR": "celery"})
    assert redis.result_backend == redis.broker == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"EMAIL_PLATFORM_EXECUTOR": "k8s"}, "EMAIL_PLATFORM_EXECUTOR"),
        ({"EMAIL_PLATFORM_CELERY_LANE_QUEUES": "urgent=fast"}, "CELERY_LANE_QUEUES"),
        ({"EMAIL_PLATFORM_CELERY_LANE_QUEUES": "critical"}, "CELERY_LANE_QUEUES"),
        ({"EMAIL_PLATFORM_CELERY_LANE_QUEUES": "critical=a b"}, "CELERY_LANE_QUEUES"),
        ({"EMAIL_PLATFORM_CELERY_BROKER": "redis://h'\nimport os"}, "CELERY_BROKER"),
        ({"EMAIL_PLATFORM_CELERY_BACKEND": "redis://h\\x"}, "CELERY_BACKEND"),
        ({"EMAIL_PLATFORM_CELERY_BROKER": "redis://h\u2028x"}, "CELERY_BROKER"),
    ],
)
def test_bad_executor_settings_name_the_variable(env, variable):
    with pytest.raises(ConfigurationError, match=variable):
        config.executor_settings(env)


def test_the_worker_command_serves_every_configured_queue_one_step_per_slot():
    settings = config.executor_settings({"EMAIL_PLATFORM_CELERY_LANE_QUEUES": "critical=crit"})
    command = worker_command(settings, Path("/x/w.yaml"), name="h1", concurrency=3)
    assert command[1:7] == ["worker", "start", "-A", "dagster_celery.app", "-y", "/x/w.yaml"]
    queues = [command[i + 1] for i, arg in enumerate(command) if arg == "-q"]
    assert queues == ["dagster,crit"]  # one argument: Celery 5 keeps only the last -Q
    assert command[command.index("--") :][:3] == ["--", "--concurrency=3", "--pool=prefork"]
    with pytest.raises(ValueError, match="concurrency"):
        worker_command(settings, Path("/x/w.yaml"), name="h1", concurrency=0)
    for bad in ("a,b", "", "crit ical", "q\n"):
        with pytest.raises(ValueError, match="queue"):
            worker_command(settings, Path("/x/w.yaml"), name="h1", queues=[bad])


class _PendingResult:
    id = "task-1"

    def ready(self) -> bool:
        return False

    def get(self) -> list:
        raise AssertionError("a pending task's result is never read")


def _instance(status: DagsterRunStatus) -> SimpleNamespace:
    return SimpleNamespace(get_run_by_id=lambda run_id: SimpleNamespace(status=status))


def test_a_step_whose_run_was_failed_is_given_up(monkeypatch):
    monkeypatch.setattr(executors, "LOST_STEP_CHECK_S", 0.0)
    watched = executors.WatchedResult(_PendingResult(), _instance(DagsterRunStatus.FAILURE), "r1")
    assert watched.ready()
    with pytest.raises(executors.StepLostError, match="r1 was marked FAILURE"):
        watched.get()


def test_a_step_of_a_live_run_is_waited_for(monkeypatch):
    monkeypatch.setattr(executors, "LOST_STEP_CHECK_S", 0.0)
    watched = executors.WatchedResult(_PendingResult(), _instance(DagsterRunStatus.STARTED), "r1")
    assert not watched.ready()
