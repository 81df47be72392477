"""The send jobs' executor: the shipped default, or Dagster's Celery executor, by one setting.

``EMAIL_PLATFORM_EXECUTOR=celery`` sends the lane-worker and batch-send steps to
``dagster-celery`` worker processes (``email-platform celery worker``), which may run on other
hosts sharing the Dagster instance and the application database. The setting is read when a run
starts, in its run worker, so one code location serves either way.

Two things are added to ``dagster_celery``'s executor, nothing else is changed:

* a lane can have its own Celery queue (``EMAIL_PLATFORM_CELERY_LANE_QUEUES``): step tags are
  the op's, not the run's, so the lane is read from the run's ``email/lane`` tag;
* a step whose Celery worker died is given up once the run has been reported failed (the lane
  sensor does so when a worker's heartbeat stops; what the run held is then given back and a
  new run started). Without this the run worker would wait for that task's result forever.
"""

import time
from typing import Any

from dagster import DagsterRunStatus, ExecutorDefinition
from dagster._core.execution.retries import RetryMode

from email_platform.common import config

#: How often a step's run status is read while its Celery task is out.
LOST_STEP_CHECK_S = 10.0
_GIVEN_UP = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


class StepLostError(Exception):
    """The Celery task of a step will never report: its run was failed without it."""


def switchable_executor(base: ExecutorDefinition) -> ExecutorDefinition:
    """``base`` (the job's executor today), or Celery when ``EMAIL_PLATFORM_EXECUTOR=celery``.

    Same name and config as ``base``: run configs and the UI read the same either way.
    """

    def create(init_context: Any) -> Any:
        settings = config.executor_settings()
        if settings.kind != "celery":
            return base.executor_creation_fn(init_context)  # type: ignore[misc]
        retries = RetryMode.from_config(init_context.executor_config["retries"])
        return lane_celery_executor(settings, retries)

    return ExecutorDefinition(
        name=base.name,
        config_schema=base.config_schema,
        requirements=base.get_requirements,
        executor_creation_fn=create,
        description=(
            f"{base.description or base.name}; on dagster-celery workers when "
            "EMAIL_PLATFORM_EXECUTOR=celery."
        ),
    )


def celery_app_args(settings: config.ExecutorSettings) -> dict[str, Any]:
    """The ``celery_executor`` config block: what the run workers and the Celery workers share."""
    return {
        "broker": settings.broker,
        "backend": settings.result_backend,
        "config_source": {
            "task_default_queue": settings.default_queue,
            # One step at a time per worker process: a lane worker holds its process for minutes.
            "worker_prefetch_multiplier": 1,
        },
    }


def lane_celery_executor(settings: config.ExecutorSettings, retries: RetryMode) -> Any:
    try:
        from dagster_celery.executor import CeleryExecutor
    except ImportError as error:  # pragma: no cover - the extra is part of the dev install
        from email_platform.common.errors import ConfigurationError

        raise ConfigurationError(
            "EMAIL_PLATFORM_EXECUTOR=celery needs dagster-celery: pip install "
            "'email_platform[celery]'"
        ) from error

    class LaneCeleryExecutor(CeleryExecutor):
        def execute(self, plan_context: Any, execution_plan: Any) -> Any:
            from dagster_celery.core_execution_loop import core_celery_execution_loop

            return core_celery_execution_loop(
                plan_context, execution_plan, step_execution_fn=self._submit
            )

        def _submit(self, app, plan_context, step, queue, priority, known_state):  # type: ignore[no-untyped-def]
            from dagster_celery.executor import _submit_task
            from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG

            if DAGSTER_CELERY_QUEUE_TAG not in step.tags:
                queue = settings.queue_for(plan_context.dagster_run.tags.get("email/lane"))
            result = _submit_task(app, plan_context, step, queue, priority, known_state)
            return WatchedResult(result, plan_context.instance, plan_context.dagster_run.run_id)

    args = celery_app_args(settings)
    return LaneCeleryExecutor(
        retries=retries,
        broker=args["broker"],
        backend=args["backend"],
        config_source=args["config_source"],
    )


class WatchedResult:
    """A step's Celery ``AsyncResult`` that also ends when the run was given up without it."""

    def __init__(self, result: Any, instance: Any, run_id: str) -> None:
        self._result = result
        self._instance = instance
        self._run_id = run_id
        self._next_check = time.monotonic() + LOST_STEP_CHECK_S
        self._lost: str | None = None

    def ready(self) -> bool:
        if self._lost is not None or self._result.ready():
            return True
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + LOST_STEP_CHECK_S
            run = self._instance.get_run_by_id(self._run_id)
            if run is not None and run.status in _GIVEN_UP:
                self._lost = run.status.value
        return self._lost is not None

    def get(self) -> Any:
        if self._lost is not None:
            raise StepLostError(
                f"run {self._run_id} was marked {self._lost} while Celery task "
                f"{self._result.id} had not reported: its worker is gone, and what it held "
                "was given back"
            )
        return self._result.get()

    def revoke(self) -> None:
        self._result.revoke()
