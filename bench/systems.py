"""The systems the send benchmark compares, each run on a fresh database and a sandbox that
answers every call in ``Settings.provider_latency_ms``: Dagster (lane workers or batch runs), the
Celery baseline in each configuration swept, and the bare-loop ceiling."""

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from dagster import DagsterInstance, RunsFilter
from sqlalchemy import Engine, func, select

from bench.baseline_celery import CeleryConfig
from bench.harness import (
    BIN,
    PG_SERVER,
    REDIS_URL,
    Sandbox,
    create_database,
    drop_database,
    prepare_app_db,
    wait_drained,
    wait_first_sent,
)
from bench.measure import ProcessSampler, dagster_storage, measure_app_db, postgres_server_pid
from bench.providers import dagster_env
from bench.workload import CriticalTrickle, publish_backlog
from email_platform.common.lanes import LANES
from email_platform.db.schema import lane_workers
from email_platform.local.dagster_home import (
    DaemonProcess,
    PostgresStorage,
    prepare_home,
    render_dagster_yaml,
)
from email_platform.sensors.analytics import RUN_TAGS as ANALYTICS_RUN_TAGS


@dataclass
class Settings:
    events: int
    critical_per_s: float
    batch_size: int
    concurrency: int
    bulk_runs: int
    timeout_s: float
    workdir: Path
    #: Messages per sandbox call for every system (1 = a call per message, how the real
    #: adapters send; Celery then runs a task per email, else a task per batch).
    provider_batch: int = 100
    #: How long the sandbox takes to answer each call (0 = at once).
    provider_latency_ms: float = 0.0
    #: Calls the ceiling keeps in flight; None = the Dagster system's (bulk_runs x concurrency).
    ceiling_in_flight: int | None = None
    #: ``loop`` (tasks on one event loop, the adapter's async path) or ``threads``.
    ceiling_client: str = "loop"
    users_n: int = 500
    #: Lane settings laid over the bench's own for the Dagster system (``--lanes``), e.g.
    #: ``{"critical": {"batches_in_flight": 1}}``.
    lane_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The adapter every system sends through (``bench.providers``).
    provider: str = "sandbox"
    #: The Dagster system's shared send rate (0: none; Celery and the ceiling have none).
    rate_limit_per_s: float = 0.0

    @property
    def dagster_in_flight(self) -> int:
        """Provider calls the Dagster system's bulk workers keep in flight at most."""
        return self.bulk_runs * self.concurrency

    @property
    def ceiling_calls_in_flight(self) -> int:
        return self.ceiling_in_flight or self.dagster_in_flight


@dataclass
class Result:
    system: str
    events: int
    figures: dict[str, Any] = field(default_factory=dict)


def _drive(
    name: str,
    settings: Settings,
    events: int,
    start: Callable[[str, str, Path], tuple[Callable[[], bool], Callable[[], None], list[int]]],
    critical_per_s: float,
    storage: Callable[[], tuple[int, int]] | None = None,
    warm: Callable[[Engine], bool] | None = None,
) -> Result:
    """Fresh database + sandbox, start the system, publish, wait, measure, tear down.

    ``warm``: true once the system's bulk senders are up; the backlog waits for it, as it waits
    for the Celery workers' ready files, so every system is measured sending, not starting.
    """
    stamp = f"{re.sub(r'[^a-z0-9]+', '_', name)}_{os.getpid()}_{int(time.time())}"
    db_name = f"bench_app_{stamp}"
    app_url = create_database(db_name)
    engine = prepare_app_db(app_url, settings.users_n)
    work = settings.workdir / stamp
    work.mkdir(parents=True)
    sandbox = Sandbox(work / "sandbox.log", settings.provider_latency_ms)
    sampler = ProcessSampler()
    # What the system costs the machine beyond its own processes: the provider it calls and
    # the database server (all of it: both databases, and the backlog's publishing).
    shared = ProcessSampler()
    shared.watch(sandbox.process.pid, "sandbox")
    postgres = postgres_server_pid(PG_SERVER)
    if postgres is not None:
        shared.watch(postgres, "postgresql")
    stop: Callable[[], None] = lambda: None  # noqa: E731
    try:
        alive, stop, pids = start(app_url, sandbox.url, work)
        for pid in pids:
            sampler.watch(pid)
        sampler.start()
        shared.start()
        storage_before = storage() if storage else (0, 0)
        # Steady state first: the critical trickle runs until its first mail is accepted (the
        # lane is live, as it is in production), then the backlog lands on top of it.
        warmup_started = time.monotonic()
        trickle = CriticalTrickle(engine, critical_per_s, settings.users_n).start()
        if critical_per_s:
            wait_first_sent(engine, settings.timeout_s, alive)
        deadline = warmup_started + settings.timeout_s
        while warm is not None and not warm(engine) and alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        warmup_s = time.monotonic() - warmup_started
        print(f"  {name}: publishing {events} bulk events ...", file=sys.stderr, flush=True)
        sampler.mark()
        shared.mark()
        before_backlog = trickle.published
        publish_s = publish_backlog(engine, events)
        # The critical trickle runs while the bulk backlog drains, and until at least one of
        # its events was published wholly after the backlog began (a small backlog can drain
        # before the next one, and then there would be no critical latency to report).
        drained = wait_drained(engine, settings.timeout_s, alive, lane="bulk")
        deadline = time.monotonic() + settings.timeout_s
        while critical_per_s and trickle.published < before_backlog + 2 and alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        trickle.stop()
        drained = drained and wait_drained(engine, settings.timeout_s, alive)
        sampler.stop()
        shared.stop()
        storage_after = storage() if storage else (0, 0)
        figures = measure_app_db(engine)
        stats = sandbox.stats()
    finally:
        stop()
        sandbox.stop()
        engine.dispose()
        drop_database(db_name)
    sent = max(1, figures["sent"] + figures.get("warmup_sent", 0))
    figures.update(
        drained=drained,
        warmup_s=warmup_s,
        publish_s=publish_s,
        critical_published=trickle.published,
        # Per email sent in the window (publish to drained): a resident system's cost of
        # sending. The figure with start-up and the idle warm-up is kept beside it.
        cpu_s=sampler.window_cpu_s,
        cpu_s_per_1k=sampler.window_cpu_s / max(1, figures["sent"]) * 1000,
        cpu_s_by_kind={k: round(v, 1) for k, v in sampler.cpu_s_by_kind(window=True).items()},
        cpu_s_with_startup=sampler.cpu_s,
        cpu_s_per_1k_with_startup=sampler.cpu_s / sent * 1000,
        cpu_s_by_kind_with_startup={k: round(v, 1) for k, v in sampler.cpu_s_by_kind().items()},
        sandbox_cpu_s_per_1k=_per_1k(shared, "sandbox", figures["sent"]),
        database_cpu_s_per_1k=_per_1k(shared, "postgresql", figures["sent"])
        if postgres is not None
        else None,
        peak_rss_mb=sampler.peak_rss_mb("run_worker") or sampler.peak_rss_mb(),
        peak_rss_any_mb=sampler.peak_rss_mb(),
        provider_accepted=stats.get("accepted"),
        provider_requests=stats.get("requests"),
    )
    if storage:
        figures["storage_bytes_per_email"] = (storage_after[0] - storage_before[0]) / sent
        figures["event_log_bytes_per_email"] = (storage_after[1] - storage_before[1]) / sent
    return Result(name, events, figures)


def _per_1k(sampler: ProcessSampler, kind: str, sent: int) -> float:
    return sampler.cpu_s_by_kind(window=True).get(kind, 0.0) / max(1, sent) * 1000


LANE_NAMES = [lane.value for lane in LANES]


def _bulk_workers_up(engine: Engine) -> int:
    """Bulk lane workers running now (each registers itself when its run starts)."""
    with engine.connect() as connection:
        return connection.execute(
            select(func.count())
            .select_from(lane_workers)
            .where(lane_workers.c.lane == "bulk", lane_workers.c.ended_at.is_(None))
        ).scalar_one()


def _first_refresh_ended(instance: DagsterInstance) -> bool:
    """The analytics sensor's first warehouse refresh, requested as the daemon starts, has
    ended: its run's start (a process, the code location's imports) and the refresh are part
    of starting the system, not of sending. Later refreshes (at most one a
    ``EMAIL_PLATFORM_ANALYTICS_REFRESH_S``) fall in the window as they would in production."""
    runs = instance.get_runs(filters=RunsFilter(tags=ANALYTICS_RUN_TAGS))
    return bool(runs) and all(run.is_finished for run in runs)


def run_dagster(
    settings: Settings,
    events: int,
    batch_size: int,
    name: str,
    critical_per_s: float,
    *,
    workers: bool = True,
) -> Result:
    dagster_db = f"bench_dagster_{os.getpid()}_{int(time.time())}_{batch_size}"
    dagster_url = create_database(dagster_db)
    pg = httpx.URL(PG_SERVER.replace("postgresql+psycopg", "http"))
    runs_per_tick = max(2, math.ceil(max(events, 1) / batch_size)) if batch_size > 1 else 50
    lanes: dict[str, dict[str, Any]] = {
        "bulk": {
            "batch_size": batch_size,
            "concurrency": settings.concurrency,
            "max_runs_per_tick": min(runs_per_tick, 50),
            "workers": settings.bulk_runs,
            # Resident and waiting before the backlog lands, as the Celery worker and the
            # ceiling loop are: the comparison is of sending, not of starting a process.
            "warm_workers": settings.bulk_runs,
        },
    }
    if not workers:
        lanes = {
            lane: {**lanes.get(lane, {}), "workers": 0, "warm_workers": 0} for lane in LANE_NAMES
        }
    for lane, overrides in settings.lane_overrides.items():
        lanes[lane] = {**lanes.get(lane, {}), **overrides}
    daemon_box: dict[str, DaemonProcess] = {}

    def start(app_url: str, sandbox_url: str, work: Path):  # type: ignore[no-untyped-def]
        home = work / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text(
            render_dagster_yaml(
                max_runs=settings.bulk_runs + 2,
                bulk_runs=settings.bulk_runs,
                transactional_runs=settings.bulk_runs,
                # What the bench always used (as deploy/dagster.yaml does); the demo's is 120 s.
                start_timeout_s=180,
                postgres=PostgresStorage(
                    hostname=pg.host,
                    port=pg.port or 5432,
                    username=pg.username or "postgres",
                    db_name=dagster_db,
                ),
            )
        )
        prepare_home(home)
        env = {
            "EMAIL_PLATFORM_HOME": str(work),
            "EMAIL_PLATFORM_DATABASE_URL": app_url,
            **dagster_env(
                settings.provider,
                sandbox_url,
                batch_max=settings.provider_batch,
                rate_limit_per_s=settings.rate_limit_per_s,
            ),
            "EMAIL_PLATFORM_LANES": json.dumps(lanes),
        }
        daemon = DaemonProcess(home, env).start()
        daemon_box["d"] = daemon
        if not daemon.wait_until_ticking(timeout_s=120):
            daemon.stop()
            raise RuntimeError(f"dagster-daemon did not come up; see {daemon.log_path}")
        assert daemon.process is not None
        root = daemon.process.pid

        def stop() -> None:
            # The daemon's code server can outlive it: reap the whole tree.
            try:
                tree = psutil.Process(root).children(recursive=True)
            except psutil.Error:
                tree = []
            daemon.stop()
            for proc in tree:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
            psutil.wait_procs(tree, timeout=10)

        return daemon.alive, stop, [root]

    instance_box: dict[str, DagsterInstance] = {}

    def warm(engine: Engine) -> bool:
        if workers and _bulk_workers_up(engine) < settings.bulk_runs:
            return False
        if "i" not in instance_box:
            instance_box["i"] = DagsterInstance.from_config(str(daemon_box["d"].home))
        return _first_refresh_ended(instance_box["i"])

    try:
        result = _drive(
            name,
            settings,
            events,
            start,
            critical_per_s,
            storage=lambda: dagster_storage(dagster_url),
            warm=warm,
        )
    finally:
        if "d" in daemon_box:
            daemon_box["d"].stop()
        if "i" in instance_box:
            instance_box["i"].dispose()
        drop_database(dagster_db)
    result.figures["batch_size"] = batch_size
    result.figures["in_flight"] = settings.dagster_in_flight if workers else None
    result.figures["config"] = f"{settings.bulk_runs} bulk workers x {settings.concurrency}"
    return result


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env={**os.environ, **env},
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _terminate(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_ceiling(settings: Settings) -> Result:
    def start(app_url: str, sandbox_url: str, work: Path):  # type: ignore[no-untyped-def]
        process = _spawn(
            [
                sys.executable,
                "-m",
                "bench.ceiling",
                "--database-url",
                app_url,
                "--sandbox-url",
                sandbox_url,
                "--batch-size",
                str(settings.batch_size),
                "--in-flight",
                str(settings.ceiling_calls_in_flight),
                "--provider-batch",
                str(settings.provider_batch),
                "--client",
                settings.ceiling_client,
                "--provider",
                settings.provider,
            ],
            {},
            work / "ceiling.log",
        )
        return (lambda: process.poll() is None), (lambda: _terminate(process)), [process.pid]

    result = _drive("ceiling", settings, settings.events, start, settings.critical_per_s)
    result.figures["in_flight"] = settings.ceiling_calls_in_flight
    result.figures["config"] = f"{settings.ceiling_calls_in_flight} " + (
        "threads" if settings.ceiling_client == "threads" else "tasks on one event loop"
    )
    result.figures["client"] = settings.ceiling_client
    return result


def run_celery(settings: Settings, config: CeleryConfig) -> Result:
    """The Celery baseline in one configuration: the relay and ``config.processes`` workers."""
    if config.broker == "redis":
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()

    def start(app_url: str, sandbox_url: str, work: Path):  # type: ignore[no-untyped-def]
        env = {
            "BENCH_DATABASE_URL": app_url,
            "BENCH_SANDBOX_URL": sandbox_url,
            "BENCH_REDIS_URL": REDIS_URL,
            "BENCH_CELERY_BROKER": config.broker,
            # A fresh RabbitMQ queue per run (the work directory's name is unique).
            "BENCH_CELERY_QUEUE": f"bench-{work.name}",
            "BENCH_CELERY_POOL": config.pool,
            "BENCH_CONCURRENCY": str(config.concurrency),
            "BENCH_PROVIDER_BATCH": str(settings.provider_batch),
            "BENCH_PROVIDER": settings.provider,
            "BENCH_BATCH_SIZE": str(settings.batch_size),
        }
        workers: list[subprocess.Popen] = []
        ready = [work / f"celery{i}.ready" for i in range(config.processes)]
        for i, ready_file in enumerate(ready):
            workers.append(
                _spawn(
                    [
                        *(str(BIN / "celery"), "-A", "bench.baseline_celery", "worker"),
                        *("--pool", config.pool, "-c", str(config.concurrency)),
                        *("-n", f"bench{i}@%h", "--loglevel", "WARNING"),
                        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
                    ],
                    {**env, "BENCH_READY_FILE": str(ready_file)},
                    work / f"celery_worker{i}.log",
                )
            )
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in ready):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                _terminate(*workers)
                raise RuntimeError(f"celery workers did not come up; see {work}")
            time.sleep(0.2)
        relay = _spawn(
            [sys.executable, "-m", "bench.baseline_celery", "relay"], env, work / "relay.log"
        )

        def alive() -> bool:
            return relay.poll() is None and all(w.poll() is None for w in workers)

        pids = [relay.pid, *(w.pid for w in workers)]
        return alive, (lambda: _terminate(relay, *workers)), pids

    result = _drive(
        f"celery {config.name}", settings, settings.events, start, settings.critical_per_s
    )
    result.figures["in_flight"] = config.in_flight
    result.figures["config"] = config.name
    result.figures["broker"] = config.broker
    result.figures["prefetch_multiplier"] = config.prefetch_multiplier(settings.provider_batch)
    return result
