"""The lane-worker op: a resident run that sends its lane's events as they come due."""

import contextlib
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from dagster import (
    Config,
    DagsterInstance,
    DagsterRunStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    op,
)
from sqlalchemy import Engine, Row
from sqlalchemy.exc import SQLAlchemyError

from email_platform.common import config
from email_platform.common.lanes import LANES, STOP_TAG, LaneConfig, outbox_sensor_name
from email_platform.observability import logs
from email_platform.ops.reporting import WorkerReporter
from email_platform.ops.retry import STEP_RETRY_POLICY
from email_platform.ops.send_step import (
    finish_with_dead_letters,
    make_sender,
    open_provider,
    send_batch,
)
from email_platform.resources import AppDatabase, EmailProviderResource, LanePolicy, RoutingResource
from email_platform.sending.stop_watch import StopWatch
from email_platform.sending.worker import LaneWorker
from email_platform.store import dead_letters, lane_pauses

#: A paused lane, a stopped lane sensor or a terminate request is noticed within this long.
STOP_CHECK_EVERY_S = 2.0
CANCEL_STATUSES = (DagsterRunStatus.CANCELING, DagsterRunStatus.CANCELED)


#: Why a worker ended, in words (the run's last log line).
ENDINGS = {
    "idle": "idle: nothing due for worker_idle_s",
    "lifetime": "its lifetime is up; the sensor starts a successor",
    # A pause in lane_pauses says who paused the lane and why instead (StopCheck.detail).
    "paused": "paused: the lane's outbox sensor is stopped",
    "stopped": "stopped on request (the run's email/stop tag)",
    "canceled": "the run was terminated",
    "run_failed": "the run was declared failed",
}


class LaneWorkerConfig(Config):
    lane: str


class StopCheck:
    """Why the worker should stop now, if it should (see ``stop_check``); ``detail`` says it in
    words once it should (who paused the lane, and why)."""

    def __init__(
        self,
        instance: DagsterInstance,
        lane: str,
        run_id: str,
        repository_selector_id: str | None,
        engine: Engine | None = None,
    ) -> None:
        self.instance, self.lane, self.run_id = instance, lane, run_id
        self.repository_selector_id, self.engine = repository_selector_id, engine
        self.checked = 0.0
        self.reason: str | None = None
        self.detail: str | None = None

    def __call__(self) -> str | None:
        now = time.monotonic()
        if self.reason is None and now - self.checked >= STOP_CHECK_EVERY_S:
            self.checked = now
            self.reason = self._why()
            if self.reason is not None and self.detail is None:
                self.detail = ENDINGS.get(self.reason, self.reason)
        return self.reason

    def _why(self) -> str | None:
        run = self.instance.get_run_by_id(self.run_id)
        if run is not None and run.status in CANCEL_STATUSES:
            return "canceled"
        if run is not None and run.status == DagsterRunStatus.FAILURE:
            # The run was declared dead (its run process died) and its claims released: a
            # step process left behind must stop instead of sending beside a successor.
            return "run_failed"
        if run is not None and STOP_TAG in run.tags:
            return "stopped"
        pause = self._pause()
        if pause is not None:
            self.detail = f"paused: {lane_pauses.describe(pause)}"
            return "paused"
        if self.lane in stopped_lane_sensors(self.instance, self.repository_selector_id):
            return "paused"
        return None

    def _pause(self) -> Row | None:
        if self.engine is None:
            return None
        try:
            with self.engine.connect() as connection:
                return lane_pauses.active(connection, self.lane)
        except SQLAlchemyError:
            # The database is away: the worker's own claims and heartbeat notice that; a
            # stop check that cannot read the pause table does not end the worker.
            return None


def stop_check(
    instance: DagsterInstance,
    lane: str,
    run_id: str,
    repository_selector_id: str | None,
    engine: Engine | None = None,
) -> StopCheck:
    """Why the worker should stop now, if it should: ``canceled``, ``run_failed``, ``stopped``
    or ``paused``; read every ``STOP_CHECK_EVERY_S``.

    ``paused``: the lane is paused in ``lane_pauses`` (``email-platform lanes pause``, or a
    brake; read through ``engine``), or the lane's outbox sensor is stopped (only this code
    location's sensor counts, ``repository_selector_id`` when the run has one: a stopped sensor
    of the same name in another code location must not silence this lane). ``canceled``:
    someone asked to terminate the run. Dagster delivers that as one interrupt, which is lost if
    it lands in a garbage collection callback (seen here: SQLAlchemy's ``_collection_gced``),
    so the run's status is read as well. ``stopped``: the run carries ``STOP_TAG`` (a clean
    stop that ends green).
    """
    return StopCheck(instance, lane, run_id, repository_selector_id, engine)


def stopped_lane_sensors(
    instance: DagsterInstance, repository_selector_id: str | None = None
) -> set[str]:
    """The lanes whose outbox sensor is stopped on ``instance`` (in the code location and
    repository ``repository_selector_id`` names, or in any); empty for an ephemeral instance,
    which has no sensors to stop.

    Filtered here, not by ``all_instigator_state(repository_origin_id=...)``: the instigators
    table Dagster 1.13 reads ignores that argument. A selector (location and repository name)
    is the same for the daemon that launched the run and the webserver that stopped the sensor,
    where an origin id may differ with their workspace files."""
    if instance.schedule_storage is None:
        return set()
    names = {outbox_sensor_name(lane.value): lane.value for lane in LANES}
    return {
        names[s.instigator_name]
        for s in instance.all_instigator_state()
        # Dagster exports no public name for the instigator enums: compare their values.
        if s.instigator_name in names
        and (repository_selector_id is None or s.repository_selector_id == repository_selector_id)
        and s.instigator_type.value == "SENSOR"
        and s.status.value == "STOPPED"
    }


def lower_priority(nice: int) -> None:
    """Make this step process ``nice`` nicer (the lane's ``nice``), where the step has a process
    of its own (the multiprocess executor). Not on a Celery worker: its process goes on to run
    other steps, a critical worker's among them, and niceness cannot be taken back. Where the
    OS refuses, the worker runs as it is."""
    if nice <= 0 or not hasattr(os, "nice") or config.executor_settings().kind == "celery":
        return
    with contextlib.suppress(OSError):
        os.nice(nice)


#: Young objects between collections in a worker's process (Python's default: 700): a batch
#: makes tens of thousands, and at 700 the collector ran all the time.
GC_THRESHOLD = (50_000, 20, 10)


def settle_heap() -> bool:
    """Leave what start-up made (Dagster, SQLAlchemy, the code location) out of garbage
    collection from here on, and collect young objects less often: a full collection scanned
    all of it every batch or so (measured in bench/README.md).

    Only where the worker has a process of its own (a multiprocess or in-process executor's
    run or step process): what is frozen is never collected, which a test process or a Celery
    worker, running step after step, must not accumulate. Garbage from before is collected
    first, so it is not frozen with the rest."""
    if multiprocessing.parent_process() is None or config.executor_settings().kind == "celery":
        return False
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    return True


@op(
    retry_policy=STEP_RETRY_POLICY,
    tags={"kind": "email"},
)
def run_lane_worker(
    context: OpExecutionContext,
    config: LaneWorkerConfig,
    email_database: AppDatabase,
    email_provider: EmailProviderResource,
    email_routing: RoutingResource,
    email_lanes: LanePolicy,
) -> dict:
    """Claim and send the lane's due events until the worker's lifetime or idle time is up.

    Polls the outbox every ``worker_poll_s``; each claim is atomic, so workers and batch runs
    can overlap without sending an event twice. Transient failures are retried with the lane's
    backoff while other events go on; permanent failures and exhausted retries become dead
    letters, and the run fails at its end so an operator can re-execute it. A re-execution
    replays the dead letters of the run it re-executes, with their original idempotency keys.
    Pause the lane (``email-platform lanes pause``, a brake, or stopping its outbox sensor):
    its workers end within seconds.
    """
    try:
        return _run_worker(
            context, config, email_database, email_provider, email_routing, email_lanes
        )
    except Failure as failure:
        # Raised on purpose (dead letters held): its description and metadata say it all, so
        # it leaves without the stack of our frames it came through.
        raise failure.with_traceback(None) from None


def _run_worker(
    context: OpExecutionContext,
    config: LaneWorkerConfig,
    email_database: AppDatabase,
    email_provider: EmailProviderResource,
    email_routing: RoutingResource,
    email_lanes: LanePolicy,
) -> dict:
    lane = email_lanes.config_for(config.lane)
    engine = email_database.get_engine()
    run = context.run
    if run.parent_run_id is not None:
        return _replay_dead_letters(
            context, lane, email_database, email_provider, email_routing, email_lanes
        )

    lower_priority(lane.nice)
    settle_heap()
    log = logs.bind(context.log, lane=lane.lane.value, run_id=context.run_id)
    # Connections for every batch in flight: sized for one, a hung batch's calls held all of
    # them, and the next batch's calls waited for a free one instead of going out.
    provider, mirror = open_provider(
        context, email_provider, engine, lane, log, calls=lane.calls_in_flight
    )
    cancel = threading.Event()
    reporter = WorkerReporter(context, lane.lane.value)
    sender = None
    try:
        sender = make_sender(
            context,
            lane,
            engine,
            provider,
            email_provider,
            email_routing,
            cancel,
            lanes=email_lanes,
        )
        stopping = stop_check(
            context.instance,
            lane.lane.value,
            context.run_id,
            _repository_selector_id(context),
            engine,
        )
        watch = StopWatch(stopping, STOP_CHECK_EVERY_S, log=log)
        worker = LaneWorker(
            sender=sender,
            engine=engine,
            lane=lane,
            run_id=context.run_id,
            should_stop=watch,
            log=log,
            on_batch=reporter,
        )
        # The first check runs with a terminate request already turned into the flag.
        with interrupts_set(cancel), watch:
            result = worker.run()
    finally:
        if sender is not None:
            sender.close()
        provider.close()
        mirror.close(forget_rows=True)  # the worker's breaker ends with it
    reporter.flush(result.totals)
    counts = dict(result.totals)
    counts.update(batches=result.batches, released=result.released)
    ending = stopping.detail if result.reason == stopping.reason else None
    log.info(
        f"lane worker ended, {ending or ENDINGS.get(result.reason, result.reason)}; after "
        f"{result.batches} batch(es) it sent {counts.get('sent', 0)}, dead-lettered "
        f"{counts.get('dead_lettered', 0)}, gave back {result.released} event(s)"
    )
    context.add_output_metadata({"ended": MetadataValue.text(result.reason)})
    return finish_with_dead_letters(context, engine, counts)


@contextmanager
def interrupts_set(flag: threading.Event) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM (how Dagster terminates a step) set ``flag``.

    Dagster's own handler raises an exception wherever the main thread happens to be: inside a
    database transaction (an SQLite write lock then stays held until garbage collection) or in
    a garbage-collection callback, where Python ignores it and the request is lost. A flag is
    read at safe points: no new send starts, what is in flight is recorded, the rest is given
    back, and the worker ends "canceled".
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def set_flag(_signum: int, _frame: FrameType | None) -> None:
        flag.set()

    for sig in previous:
        signal.signal(sig, set_flag)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _repository_selector_id(context: OpExecutionContext) -> str | None:
    origin = context.run.remote_job_origin
    return origin.repository_origin.get_selector_id() if origin is not None else None


def _replay_dead_letters(
    context: OpExecutionContext,
    lane: LaneConfig,
    app_database: AppDatabase,
    email_provider: EmailProviderResource,
    routing: RoutingResource,
    lanes: LanePolicy,
) -> dict:
    """Re-execution of a worker run: send its open dead letters again, as a batch run would."""
    run = context.run
    log = logs.bind(context.log, lane=lane.lane.value, run_id=context.run_id)
    owners = [r for r in (run.parent_run_id, run.root_run_id) if r]
    with app_database.get_engine().connect() as connection:
        event_ids = dead_letters.open_event_ids_of_runs(connection, owners)
    if not event_ids:
        log.info("the re-executed worker run has no open dead letters: nothing to replay")
        return {"requested": 0}
    log.info(f"replaying {len(event_ids)} event(s) with open dead letters of {owners}")
    return send_batch(
        context,
        lane=lane,
        event_ids=event_ids,
        app_database=app_database,
        email_provider=email_provider,
        routing=routing,
        lanes=lanes,
    )
