"""Send-path benchmark: the real Dagster path against a Celery baseline and a bare-loop ceiling.

``python -m bench.send`` (small defaults, a few minutes) prints one table; ``--json PATH`` also
writes the figures. Full size: ``python -m bench.send --events 50000 --repeats 3 --json
bench/results/$(date +%F).json``. See bench/README.md.

Each run of each system gets a fresh PostgreSQL application database (``CREATE DATABASE``), the
sandbox provider in its own process (``email-platform sandbox serve``), a bulk backlog published
through ``publish()`` and a steady trickle of critical password resets published while it
drains. Systems:

- ``dagster``: a real ``dagster-daemon`` (PostgreSQL run and event-log storage in a fresh
  database, queued run coordinator) ticks the lane sensors, which keep resident lane-worker
  runs going (the shipped default, ``--bulk-runs`` bulk workers); each worker claims, renders,
  sends and records batch after batch;
- ``dagster-batch``: the same with ``workers: 0`` on every lane: one launched run per batch;
- ``dagster-per-event``: batch runs with bulk batch size 1 (one launched run per email);
- ``celery``: ``bench.baseline_celery`` (relay + Celery worker on Redis, same adapter);
- ``ceiling``: ``bench.ceiling`` (claim a batch, send on keep-alive connections, mark sent).

``python -m bench.send hotpath --events 5000`` runs one batch through ``BatchSender`` in this
process (no Dagster), to profile the send path: ``py-spy record -o out.svg -- python -m
bench.send hotpath``.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import Column, Engine, MetaData, String, Table, create_engine, func, select, text

from email_platform import publish, publish_many
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import email_messages, email_outbox
from email_platform.lanes import LANES
from email_platform.local.dagster_home import DaemonProcess, prepare_home

PG_SERVER = os.environ.get("BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
BIN = Path(sys.executable).parent

_product = MetaData()
users = Table(
    "users",
    _product,
    Column("id", String(64), primary_key=True),
    Column("email", String(320), nullable=False),
)

DAGSTER_YAML = """\
storage:
  postgres:
    postgres_db:
      hostname: {host}
      port: {port}
      username: {user}
      password: ""
      db_name: {db}
      # psycopg 3 rejects dagster-postgres's parameterized NOTIFY; psycopg2 works.
      scheme: postgresql+psycopg2
run_queue:
  max_concurrent_runs: {max_runs}
  dequeue_interval_seconds: 1
  dequeue_use_threads: true
  tag_concurrency_limits:
    - key: email/lane
      value: bulk
      limit: {bulk_runs}
    - key: email/lane
      value: transactional
      limit: {bulk_runs}
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
sensors:
  use_threads: true
  num_workers: 4
telemetry:
  enabled: false
"""


# ---- infrastructure ----------------------------------------------------------------------------


def _admin() -> Engine:
    return create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")


def create_database(name: str) -> str:
    with _admin().connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    return f"{PG_SERVER}/{name}"


def drop_database(name: str) -> None:
    with _admin().connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sandbox:
    """``email-platform sandbox serve`` in its own process (its CPU is not charged to anyone)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [str(BIN / "email-platform"), "sandbox", "serve", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/_sandbox/health", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("sandbox did not start")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/_sandbox/stats", timeout=10).json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._log.close()


def _process_kind(proc: psutil.Process, root: int) -> str:
    """Name a sampled process by its role, from its command line."""
    cmdline = " ".join(proc.cmdline())
    # The default run launcher starts each run in a process of its own, and the multiprocess
    # executor each step in a spawned child of it.
    if "spawn_main" in cmdline:
        return "run_worker:step"
    if "execute_run" in cmdline:
        return "run_worker:run"
    if proc.pid == root:
        return "root"
    if "grpc" in cmdline:
        return "code_server"
    return "other"


class ProcessSampler:
    """CPU seconds and peak RSS of a process tree, sampled every ``interval_s``.

    CPU is the sum over every process seen of its last sampled user+system time, so a process
    that exits between samples loses at most one interval of CPU (the figure is a lower bound).
    """

    def __init__(self, interval_s: float = 0.2) -> None:
        self.roots: list[int] = []
        self.interval_s = interval_s
        self.cpu: dict[tuple[int, float], float] = {}
        self.rss: dict[tuple[int, float], int] = {}
        self.kind: dict[tuple[int, float], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, pid: int) -> None:
        self.roots.append(pid)

    def start(self) -> "ProcessSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        for root in list(self.roots):
            try:
                parent = psutil.Process(root)
                tree = [parent, *parent.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
                    if key not in self.kind:
                        self.kind[key] = _process_kind(proc, root)
                except psutil.Error:
                    continue
                self.cpu[key] = times.user + times.system
                self.rss[key] = max(self.rss.get(key, 0), rss)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    def cpu_s_by_kind(self) -> dict[str, float]:
        """CPU seconds per kind of process: where a system's CPU goes, not only how much."""
        totals: dict[str, float] = {}
        for key, cpu in self.cpu.items():
            kind = self.kind.get(key, "other")
            totals[kind] = totals.get(kind, 0.0) + cpu
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def peak_rss_mb(self, kind: str | None = None) -> float:
        values = [v for k, v in self.rss.items() if self.kind.get(k, "").startswith(kind or "")]
        return max(values, default=0) / 2**20


# ---- workload ----------------------------------------------------------------------------------


def prepare_app_db(url: str, users_n: int) -> Engine:
    engine = make_engine(url, pool_size=4)
    upgrade(engine)
    with engine.begin() as connection:
        _product.create_all(connection)
        connection.execute(
            users.insert(),
            [{"id": f"u{i}", "email": f"u{i}@example.com"} for i in range(users_n)],
        )
    return engine


def publish_backlog(engine: Engine, n: int, chunk: int = 1000) -> float:
    """``n`` bulk digests through ``publish_many()`` (a campaign's fan-out), ``chunk`` per product
    transaction."""
    started = time.monotonic()
    for start in range(0, n, chunk):
        with engine.begin() as connection:
            publish_many(
                connection,
                [
                    {
                        "event_type": "digest.ready",
                        "aggregate_id": f"u{i}",
                        "payload": {
                            "email": f"reader{i}@example.com",
                            "first_name": "Jane",
                            "highlights": ["3 new followers", "1 comment"],
                        },
                    }
                    for i in range(start, min(n, start + chunk))
                ],
            )
    return time.monotonic() - started


class CriticalTrickle:
    """Password resets (critical lane) published at a steady rate until stopped."""

    def __init__(self, engine: Engine, per_s: float, users_n: int) -> None:
        self.engine, self.per_s, self.users_n = engine, per_s, users_n
        self.published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "CriticalTrickle":
        if self.per_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            with self.engine.begin() as connection:
                user = f"u{self.published % self.users_n}"
                publish(
                    connection,
                    event_type="user.password_reset_requested",
                    aggregate_id=user,
                    payload={"user_id": user, "reset_token": f"t{self.published}"},
                )
            self.published += 1
            next_at = started + self.published / self.per_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def wait_first_sent(engine: Engine, timeout_s: float, alive: Callable[[], bool]) -> float:
    """Seconds until the first message is accepted (the system is up and its lanes live)."""
    started = time.monotonic()
    sent = email_messages.c.status == "sent"
    query = select(func.count()).select_from(email_messages).where(sent)
    while time.monotonic() - started < timeout_s and alive():
        with engine.connect() as connection:
            if connection.execute(query).scalar():
                break
        time.sleep(0.1)
    return time.monotonic() - started


def outstanding(engine: Engine, lane: str | None = None) -> tuple[int, int]:
    """(events not finished, events total), of one lane or all."""
    query = select(email_outbox.c.status, func.count()).group_by(email_outbox.c.status)
    if lane:
        query = query.where(email_outbox.c.lane == lane)
    with engine.connect() as connection:
        rows = dict(connection.execute(query).all())
    total = sum(rows.values())
    return total - rows.get("done", 0) - rows.get("dead", 0), total


def wait_drained(
    engine: Engine, timeout_s: float, alive: Callable[[], bool], lane: str | None = None
) -> bool:
    deadline = time.monotonic() + timeout_s
    last_print = 0.0
    while time.monotonic() < deadline:
        left, total = outstanding(engine, lane)
        if time.monotonic() - last_print > 10:
            print(f"    {left}/{total} events outstanding", file=sys.stderr, flush=True)
            last_print = time.monotonic()
        if left == 0:
            return True
        if not alive():
            print("    system under test exited", file=sys.stderr)
            return False
        time.sleep(0.5)
    return False


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def measure_app_db(engine: Engine) -> dict[str, Any]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_outbox.c.lane, email_outbox.c.published_at, email_messages.c.sent_at)
            .join(email_messages, email_messages.c.event_id == email_outbox.c.event_id)
            .where(email_messages.c.status == "sent")
        ).all()
        # The backlog's first publish: critical events of the warm-up before it are not counted.
        first_publish = connection.execute(
            select(func.min(email_outbox.c.published_at)).where(email_outbox.c.lane == "bulk")
        ).scalar()
        not_sent = connection.execute(
            select(func.count()).select_from(email_outbox).where(email_outbox.c.status != "done")
        ).scalar()
    warmup = [r for r in rows if first_publish is not None and r.published_at < first_publish]
    rows = [r for r in rows if first_publish is None or r.published_at >= first_publish]
    latency: dict[str, list[float]] = {}
    for lane, published, sent in rows:
        latency.setdefault(lane, []).append((sent - published).total_seconds())
    sent_times = [r.sent_at for r in rows]
    if not sent_times:
        return {"sent": 0, "emails_per_s": 0.0, "lanes": {}, "not_done": not_sent}
    last_sent = max(sent_times)
    bulk_sent = [r.sent_at for r in rows if r.lane == "bulk"]
    window_s = (last_sent - first_publish).total_seconds()
    return {
        "sent": len(rows),
        "warmup_sent": len(warmup),
        "not_done": not_sent,
        "window_s": window_s,
        # The backlog's first publish to its first acceptance: how long the system took to start.
        "first_sent_s": (min(bulk_sent) - first_publish).total_seconds() if bulk_sent else None,
        # First publish to last acceptance: the definition.
        "emails_per_s": len(rows) / window_s if window_s > 0 else 0.0,
        # The backlog's first acceptance to its last: the drain rate once sending started.
        "drain_emails_per_s": len(bulk_sent)
        / max(1e-9, (max(bulk_sent) - min(bulk_sent)).total_seconds())
        if len(bulk_sent) > 1
        else 0.0,
        "lanes": {
            lane: {
                "count": len(values),
                "p50_s": percentile(values, 0.50),
                "p95_s": percentile(values, 0.95),
                "p99_s": percentile(values, 0.99),
            }
            for lane, values in sorted(latency.items())
        },
    }


def dagster_storage(url: str) -> tuple[int, int]:
    """(bytes in every table of the Dagster database, bytes of event-log entries)."""
    engine = create_engine(url)
    with engine.connect() as connection:
        total = connection.execute(
            text(
                "select coalesce(sum(pg_total_relation_size(c.oid)), 0) from pg_class c "
                "join pg_namespace n on n.oid = c.relnamespace "
                "where c.relkind = 'r' and n.nspname = 'public'"
            )
        ).scalar()
        events = connection.execute(
            text("select coalesce(sum(octet_length(event)), 0) from event_logs")
        ).scalar()
    engine.dispose()
    return int(total), int(events)


# ---- systems -----------------------------------------------------------------------------------


@dataclass
class Settings:
    events: int
    critical_per_s: float
    batch_size: int
    concurrency: int
    bulk_runs: int
    timeout_s: float
    workdir: Path
    #: Messages per sandbox call for Dagster and the ceiling (1 = a call per message).
    provider_batch: int = 100
    users_n: int = 500


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
) -> Result:
    """Fresh database + sandbox, start the system, publish, wait, measure, tear down."""
    stamp = f"{name.replace('-', '_')}_{os.getpid()}_{int(time.time())}"
    db_name = f"bench_app_{stamp}"
    app_url = create_database(db_name)
    engine = prepare_app_db(app_url, settings.users_n)
    work = settings.workdir / stamp
    work.mkdir(parents=True)
    sandbox = Sandbox(work / "sandbox.log")
    sampler = ProcessSampler()
    stop: Callable[[], None] = lambda: None  # noqa: E731
    try:
        alive, stop, pids = start(app_url, sandbox.url, work)
        for pid in pids:
            sampler.watch(pid)
        sampler.start()
        storage_before = storage() if storage else (0, 0)
        # Steady state first: the critical trickle runs until its first mail is accepted (the
        # lane is live, as it is in production), then the backlog lands on top of it.
        trickle = CriticalTrickle(engine, critical_per_s, settings.users_n).start()
        warmup_s = wait_first_sent(engine, settings.timeout_s, alive) if critical_per_s else 0.0
        print(f"  {name}: publishing {events} bulk events ...", file=sys.stderr, flush=True)
        publish_s = publish_backlog(engine, events)
        # The critical trickle runs while the bulk backlog drains.
        drained = wait_drained(engine, settings.timeout_s, alive, lane="bulk")
        trickle.stop()
        drained = drained and wait_drained(engine, settings.timeout_s, alive)
        sampler.stop()
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
        cpu_s=sampler.cpu_s,
        cpu_s_per_1k=sampler.cpu_s / sent * 1000,
        cpu_s_by_kind={k: round(v, 1) for k, v in sampler.cpu_s_by_kind().items()},
        peak_rss_mb=sampler.peak_rss_mb("run_worker") or sampler.peak_rss_mb(),
        peak_rss_any_mb=sampler.peak_rss_mb(),
        provider_accepted=stats.get("accepted"),
        provider_requests=stats.get("requests"),
    )
    if storage:
        figures["storage_bytes_per_email"] = (storage_after[0] - storage_before[0]) / sent
        figures["event_log_bytes_per_email"] = (storage_after[1] - storage_before[1]) / sent
    return Result(name, events, figures)


LANE_NAMES = [lane.value for lane in LANES]


def run_dagster(
    settings: Settings,
    events: int,
    batch_size: int,
    name: str,
    critical_per_s: float,
    *,
    workers: bool = True,
    provider_batch: int | None = None,
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
    daemon_box: dict[str, DaemonProcess] = {}

    def start(app_url: str, sandbox_url: str, work: Path):  # type: ignore[no-untyped-def]
        home = work / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text(
            DAGSTER_YAML.format(
                host=pg.host,
                port=pg.port or 5432,
                user=pg.username or "postgres",
                db=dagster_db,
                max_runs=settings.bulk_runs + 2,
                bulk_runs=settings.bulk_runs,
            )
        )
        prepare_home(home)
        env = {
            "EMAIL_PLATFORM_HOME": str(work),
            "EMAIL_PLATFORM_DATABASE_URL": app_url,
            "EMAIL_PLATFORM_PROVIDER": "sandbox",
            "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox_url,
            "EMAIL_PLATFORM_SANDBOX_BATCH_MAX": str(provider_batch or settings.provider_batch),
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

    try:
        result = _drive(
            name,
            settings,
            events,
            start,
            critical_per_s,
            storage=lambda: dagster_storage(dagster_url),
        )
    finally:
        if "d" in daemon_box:
            daemon_box["d"].stop()
        drop_database(dagster_db)
    result.figures["batch_size"] = batch_size
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
                "--concurrency",
                str(settings.concurrency),
                "--provider-batch",
                str(settings.provider_batch),
            ],
            {},
            work / "ceiling.log",
        )
        return (lambda: process.poll() is None), (lambda: _terminate(process)), [process.pid]

    return _drive("ceiling", settings, settings.events, start, settings.critical_per_s)


def run_celery(settings: Settings) -> Result:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()

    def start(app_url: str, sandbox_url: str, work: Path):  # type: ignore[no-untyped-def]
        ready = work / "celery.ready"
        env = {
            "BENCH_DATABASE_URL": app_url,
            "BENCH_SANDBOX_URL": sandbox_url,
            "BENCH_REDIS_URL": REDIS_URL,
            "BENCH_CONCURRENCY": str(settings.concurrency),
            "BENCH_BATCH_SIZE": str(settings.batch_size),
            "BENCH_READY_FILE": str(ready),
        }
        worker = _spawn(
            [
                str(BIN / "celery"),
                "-A",
                "bench.baseline_celery",
                "worker",
                "--pool",
                "threads",
                "-c",
                str(settings.concurrency),
                "--loglevel",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env,
            work / "celery_worker.log",
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or worker.poll() is not None:
                _terminate(worker)
                raise RuntimeError(f"celery worker did not come up; see {work}")
            time.sleep(0.2)
        relay = _spawn(
            [sys.executable, "-m", "bench.baseline_celery", "relay"], env, work / "relay.log"
        )

        def alive() -> bool:
            return worker.poll() is None and relay.poll() is None

        return alive, (lambda: _terminate(relay, worker)), [worker.pid, relay.pid]

    return _drive("celery", settings, settings.events, start, settings.critical_per_s)


# ---- report ------------------------------------------------------------------------------------


def _median_result(results: list[Result]) -> Result:
    """The repeat with the median throughput, with every repeat's emails/s attached."""
    ordered = sorted(results, key=lambda r: r.figures.get("emails_per_s", 0.0))
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.figures["emails_per_s_repeats"] = [r.figures.get("emails_per_s") for r in results]
    chosen.figures["emails_per_s"] = statistics.median(
        r.figures.get("emails_per_s", 0.0) for r in results
    )
    return chosen


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(results: list[Result], baseline: float | None, ceiling: float | None) -> None:
    header = (
        f"{'system':<18} {'events':>6} {'emails/s':>9} {'drain/s':>8} "
        f"{'bulk p50/p95/p99 s':>20} {'crit p50/p95/p99 s':>20} {'cpu-s/1k':>8} "
        f"{'peakRSS MB':>10} {'B/email':>8} {'evlog B/e':>9} {'x celery':>8} {'x ceiling':>9}"
    )
    print(header)
    print("-" * len(header))
    for result in results:
        f = result.figures
        lanes = f.get("lanes", {})

        def trio(lane: str, lanes: dict = lanes) -> str:
            lat = lanes.get(lane)
            if not lat:
                return "-"
            return "/".join(_fmt(lat[k]) for k in ("p50_s", "p95_s", "p99_s"))

        eps = f.get("emails_per_s", 0.0)
        print(
            f"{result.system:<18} {result.events:>6} {_fmt(eps):>9} "
            f"{_fmt(f.get('drain_emails_per_s')):>8} {trio('bulk'):>20} {trio('critical'):>20} "
            f"{_fmt(f.get('cpu_s_per_1k'), 2):>8} {_fmt(f.get('peak_rss_mb'), 0):>10} "
            f"{_fmt(f.get('storage_bytes_per_email'), 0):>8} "
            f"{_fmt(f.get('event_log_bytes_per_email'), 0):>9} "
            f"{_fmt(eps / baseline if baseline else None, 2):>8} "
            f"{_fmt(eps / ceiling if ceiling else None, 2):>9}"
        )


def compare(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="bench_send_"))
    settings = Settings(
        events=args.events,
        critical_per_s=args.critical_per_s,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        bulk_runs=args.bulk_runs,
        timeout_s=args.timeout_s,
        workdir=workdir,
        provider_batch=args.provider_batch,
    )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    by_system: dict[str, list[Result]] = {}
    for repeat in range(args.repeats):
        for system in systems:
            print(f"[repeat {repeat + 1}/{args.repeats}] {system}", file=sys.stderr, flush=True)
            if system in ("dagster", "dagster-batch", "dagster-single"):
                result = run_dagster(
                    settings,
                    settings.events,
                    settings.batch_size,
                    system,
                    args.critical_per_s,
                    workers=system != "dagster-batch",
                    provider_batch=1 if system == "dagster-single" else None,
                )
            elif system == "celery":
                result = run_celery(settings)
            elif system == "ceiling":
                result = run_ceiling(settings)
            else:
                raise SystemExit(f"unknown system {system!r}")
            by_system.setdefault(system, []).append(result)
            f = result.figures
            print(
                f"  {system}: {f.get('emails_per_s', 0):.1f} emails/s, first sent after "
                f"{f.get('first_sent_s') or 0:.1f}s, backlog published in "
                f"{f.get('publish_s') or 0:.1f}s; CPU-s by process: "
                + ", ".join(f"{k} {v}" for k, v in f.get("cpu_s_by_kind", {}).items()),
                file=sys.stderr,
                flush=True,
            )
    if args.per_event_events > 0:
        print("[once] dagster-per-event (bulk batch size 1)", file=sys.stderr, flush=True)
        by_system["dagster-per-event"] = [
            # No critical trickle: one run per email saturates the run queue on its own.
            run_dagster(settings, args.per_event_events, 1, "dagster-per-event", 0.0, workers=False)
        ]
    results = [_median_result(rs) for rs in by_system.values()]
    figures = {r.system: r for r in results}
    baseline = figures["celery"].figures["emails_per_s"] if "celery" in figures else None
    ceiling = figures["ceiling"].figures["emails_per_s"] if "ceiling" in figures else None
    print()
    print_table(results, baseline, ceiling)
    print(
        f"\n{settings.events} bulk events + critical trickle at {settings.critical_per_s}/s; "
        f"bulk batch {settings.batch_size}, concurrency {settings.concurrency}, "
        f"{settings.bulk_runs} bulk runs at once; {settings.provider_batch} messages per sandbox "
        f"call (Dagster, ceiling; Celery sends one per task); median of {args.repeats} repeat(s). "
        f"CPU excludes the sandbox, PostgreSQL and Redis."
    )
    ours = figures.get("dagster")
    summary: dict[str, Any] = {
        "date": date.today().isoformat(),
        "events": settings.events,
        "emails_per_s": ours.figures["emails_per_s"] if ours else None,
        "baseline_emails_per_s": baseline,
        "ceiling_emails_per_s": ceiling,
        "critical_p50_s": _lane(ours, "critical", "p50_s"),
        "critical_p99_s": _lane(ours, "critical", "p99_s"),
        "event_log_bytes_per_email": ours.figures.get("event_log_bytes_per_email")
        if ours
        else None,
        "storage_bytes_per_email": ours.figures.get("storage_bytes_per_email") if ours else None,
        "peak_rss_mb": ours.figures.get("peak_rss_mb") if ours else None,
        "settings": {
            "critical_per_s": settings.critical_per_s,
            "batch_size": settings.batch_size,
            "concurrency": settings.concurrency,
            "bulk_runs": settings.bulk_runs,
            "provider_batch": settings.provider_batch,
            "repeats": args.repeats,
            "dagster_storage": "postgresql",
            "app_database": "postgresql",
            "cpu_count": os.cpu_count(),
        },
        "systems": {r.system: {"events": r.events, **r.figures} for r in results},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    failed = [r.system for r in results if not r.figures.get("drained")]
    if failed:
        print(f"NOT DRAINED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _lane(result: Result | None, lane: str, key: str) -> float | None:
    if result is None:
        return None
    return result.figures.get("lanes", {}).get(lane, {}).get(key)


# ---- in-process send path: one batch, or one lane worker (for the profiler) --------------------


@contextlib.contextmanager
def _in_process(
    args: argparse.Namespace, prefix: str, lane_changes: dict[str, Any]
) -> Iterator[tuple[Engine, Sandbox, Any, Any]]:
    """A fresh database holding ``--events`` bulk events, the sandbox, and a ``BatchSender``.

    Yields (engine, sandbox, provider, sender); everything is torn down afterwards.
    """
    from email_platform.lanes import DEFAULT_LANE_CONFIGS, Lane
    from email_platform.providers.sandbox import SandboxProvider
    from email_platform.recipients import SqlDirectoryResolver
    from email_platform.rendering import TemplateRenderer
    from email_platform.routes import default_routes
    from email_platform.sending.batch import BatchSender

    stamp = f"{prefix}_{os.getpid()}_{int(time.time())}"
    db_name = f"bench_app_{stamp}"
    engine = prepare_app_db(create_database(db_name), 10)
    sandbox = Sandbox(Path(tempfile.mkdtemp(prefix=f"bench_{prefix}_")) / "sandbox.log")
    provider = None
    try:
        publish_backlog(engine, args.events)
        lane = DEFAULT_LANE_CONFIGS[Lane.BULK]
        lane = type(lane)(**{**lane.__dict__, "concurrency": args.concurrency, **lane_changes})
        provider = SandboxProvider(
            sandbox.url,
            max_connections=args.concurrency,
            timeout_s=30,
            batch_max=args.provider_batch,
        )
        sender = BatchSender(
            engine=engine,
            provider=provider,
            renderer=TemplateRenderer(),
            routes=default_routes(),
            resolver=SqlDirectoryResolver(engine),
            lane=lane,
            sender_address="Bench <no-reply@example.com>",
        )
        yield engine, sandbox, provider, sender
    finally:
        if provider is not None:
            provider.close()
        sandbox.stop()
        engine.dispose()
        drop_database(db_name)


def hotpath(args: argparse.Namespace) -> int:
    """Publish ``--events`` bulk events and send them as one batch through ``BatchSender``."""
    with _in_process(args, "hotpath", {}) as (engine, sandbox, _provider, sender):
        with engine.connect() as connection:
            ids = connection.execute(select(email_outbox.c.event_id)).scalars().all()
        # The sandbox shares the two cores with this process, so its CPU is reported too.
        sandbox_proc = psutil.Process(sandbox.process.pid)
        sandbox_cpu0 = sum(sandbox_proc.cpu_times()[:2])
        cpu0, t0 = time.process_time(), time.monotonic()
        outcome = sender.run(ids, run_id="hotpath")
        elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
        sandbox_cpu = sum(sandbox_proc.cpu_times()[:2]) - sandbox_cpu0
        per_1k = 1000 / max(1, outcome.sent)
        print(
            f"hotpath: {outcome.sent} sent of {len(ids)} in {elapsed:.2f}s = "
            f"{outcome.sent / elapsed:.0f} emails/s, {cpu * per_1k:.2f} "
            f"CPU-s per 1k (this process), sandbox {sandbox_cpu * per_1k:.2f} CPU-s per 1k"
        )
        return 0 if outcome.sent == len(ids) else 1


def worker(args: argparse.Namespace) -> int:
    """Drain ``--events`` bulk events with one ``LaneWorker`` (no Dagster), pipelined or not.

    Each repeat runs the worker as shipped (the next batch claimed and prepared while the
    current one is sent) and a sequential one (claim, prepare, send, record in turn, as before)
    on the same backlog size, alternating which goes first.
    """
    from email_platform.sending.worker import LaneWorker

    class SequentialWorker(LaneWorker):
        def _send(self, event_ids: list[str], retry_number: int) -> None:
            self._count(self.sender.run(event_ids, run_id=self.run_id), retry_number)

    changes = {"batch_size": args.batch_size, "worker_idle_s": 0.5}
    figures: dict[str, list[float]] = {"pipelined": [], "sequential": []}
    for repeat in range(args.repeats):
        order = ["pipelined", "sequential"] if repeat % 2 == 0 else ["sequential", "pipelined"]
        for kind in order:
            with _in_process(args, "worker", changes) as (engine, _sandbox, _provider, sender):
                cls = LaneWorker if kind == "pipelined" else SequentialWorker
                lane_worker = cls(sender=sender, engine=engine, lane=sender.lane, run_id=kind)
                cpu0, t0 = time.process_time(), time.monotonic()
                result = lane_worker.run()
                # The worker idles out after the last batch: that wait is not sending.
                elapsed = time.monotonic() - t0 - sender.lane.worker_idle_s
                cpu = time.process_time() - cpu0
            sent = result.totals["sent"]
            figures[kind].append(sent / elapsed)
            print(
                f"worker {kind:>10}: {sent} sent of {args.events} in {elapsed:.2f}s = "
                f"{sent / elapsed:.0f} emails/s, {cpu * 1000 / max(1, sent):.2f} CPU-s "
                f"per 1k, {result.batches} batches",
                flush=True,
            )
            if sent != args.events:
                return 1
    pipelined, sequential = (statistics.median(figures[k]) for k in ("pipelined", "sequential"))
    print(
        f"median of {args.repeats}: pipelined {pipelined:.0f} emails/s, sequential "
        f"{sequential:.0f} emails/s, ratio {pipelined / sequential:.2f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.send", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "mode", nargs="?", default="compare", choices=["compare", "hotpath", "worker"]
    )
    parser.add_argument("--events", type=int, default=3000, help="bulk backlog size")
    parser.add_argument("--critical-per-s", type=float, default=2.0, help="critical trickle")
    parser.add_argument("--batch-size", type=int, default=2500, help="bulk lane batch size")
    parser.add_argument("--concurrency", type=int, default=32, help="in-flight sends per run")
    parser.add_argument(
        "--provider-batch",
        type=int,
        default=100,
        help="messages per sandbox call for Dagster and the ceiling (1: a call per message)",
    )
    parser.add_argument(
        "--bulk-runs", type=int, default=2, help="bulk workers (batch runs: runs at once)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default="dagster,dagster-single,dagster-batch,celery,ceiling")
    parser.add_argument(
        "--per-event-events",
        type=int,
        default=20,
        help="events for the one-run-per-email mode (0 skips it)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    # Tear down daemons, workers and databases on SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = {"compare": compare, "hotpath": hotpath, "worker": worker}
    return modes[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
