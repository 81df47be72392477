"""Storage per email: what the platform writes per email, table by table, measured on a drain.

``python -m bench.storage --events 5000 --database-url
postgresql+psycopg://postgres@127.0.0.1:5432/capacity_x [--json PATH]`` drains ``--events`` bulk
digests (plus a trickle of critical password resets) through the real platform, the same way
``python -m bench.send`` runs its ``dagster`` system: a real ``dagster-daemon`` with PostgreSQL
run and event-log storage, resident lane workers, the sandbox provider in its own process.
Unlike ``bench.send``, the sandbox also posts signed webhooks (every message not bounced is
delivered, ~40% opened, ~10% clicked, ~2% bounced, a few complaints and unsubscribes, 5% of
posts delivered twice) to the real receiver (``email-platform webhooks serve``), and the
daemon's webhook sensor ingests them. The daemon's analytics sensor refreshes the DuckDB
warehouse as it does in production; at the end one full refresh is timed.

Then, after ``VACUUM ANALYZE``, it reports per application table: rows, rows per email, heap
(``pg_relation_size``), TOAST and free-space maps (``pg_table_size`` minus the heap), index
(``pg_indexes_size``) and total (``pg_total_relation_size``) bytes per email, and each index's
bytes per email; per table of the Dagster database the same, and the event log split by job;
and the warehouse file's size per email. "Per email" is per ``email_messages`` row.

``--database-url`` names a database this command creates (it must not exist; ``--replace``
drops one that does) and drops at the end (``--keep`` keeps it). The Dagster database is
``<that name>_dagster`` on the same server (``--dagster-database``). PostgreSQL only: the
sizes are PostgreSQL's.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import URL, make_url

from bench.faults.webhooks import wait_settled
from bench.harness import BIN, Sandbox, free_port, prepare_app_db, wait_drained, wait_first_sent
from bench.measure import ProcessSampler
from bench.workload import CriticalTrickle, publish_backlog
from email_platform.db.schema import email_messages, email_outbox, metadata
from email_platform.local.dagster_home import (
    DaemonProcess,
    PostgresStorage,
    prepare_home,
    render_dagster_yaml,
)

#: The webhook mix the sandbox emits (see ``plan`` in ``_serve_sandbox``): every message that
#: does not bounce is delivered; opens and clicks as shares of all messages.
BOUNCE_RATE = 0.02
OPEN_SHARE = 0.40
CLICK_SHARE = 0.10
MACHINE_OPEN_RATE = 0.25  # the emitter's default: Apple-proxy opens, which never click
COMPLAINT_RATE = 0.001
UNSUBSCRIBE_RATE = 0.002
DUPLICATE_RATE = 0.05  # posts delivered twice (the emitter's default; providers do this)


@dataclass
class StorageSettings:
    database_url: str
    events: int = 5000
    #: Dagster's database, on the app database's server; default ``<app name>_dagster``.
    dagster_database: str | None = None
    critical_per_s: float = 2.0
    #: Bulk lane batch size (the shipped default is 500) and bulk lane workers.
    batch_size: int = 500
    bulk_workers: int = 2
    provider_batch: int = 100
    webhooks: bool = True
    warehouse: bool = True
    #: Seconds each wait (drain, webhooks posted, inbox ingested) may take.
    timeout_s: float = 540.0
    replace: bool = False
    keep: bool = False
    workdir: Path | None = None
    users_n: int = 500
    #: The daemon's warehouse refresh interval (EMAIL_PLATFORM_ANALYTICS_REFRESH_S).
    analytics_refresh_s: float = 60.0


# ---- databases ---------------------------------------------------------------------------------


def _admin(url: URL) -> Engine:
    return create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")


def _exists(admin: Engine, name: str) -> bool:
    with admin.connect() as connection:
        found = connection.execute(
            text("select 1 from pg_database where datname = :n"), {"n": name}
        ).scalar()
    return bool(found)


def _create(admin: Engine, name: str, replace: bool) -> None:
    with admin.connect() as connection:
        if _exists(admin, name):
            if not replace:
                raise SystemExit(f"database {name!r} exists; pass --replace to drop it first")
            connection.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        connection.execute(text(f'CREATE DATABASE "{name}"'))


def _drop(admin: Engine, name: str) -> None:
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _vacuum_analyze(url: URL | str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("VACUUM ANALYZE"))
    engine.dispose()


_TABLE_SIZES = text(
    """
    select c.relname as name,
           pg_relation_size(c.oid) as heap,
           pg_table_size(c.oid) - pg_relation_size(c.oid) as toast,
           pg_indexes_size(c.oid) as index,
           pg_total_relation_size(c.oid) as total,
           coalesce(s.n_live_tup, 0) as live_estimate
    from pg_class c
    join pg_namespace n on n.oid = c.relnamespace
    left join pg_stat_user_tables s on s.relid = c.oid
    where c.relkind in ('r', 'p') and n.nspname = 'public'
    order by c.relname
    """
)
_INDEX_SIZES = text(
    """
    select t.relname as table_name, i.relname as index_name, pg_relation_size(i.oid) as bytes
    from pg_index x
    join pg_class i on i.oid = x.indexrelid
    join pg_class t on t.oid = x.indrelid
    join pg_namespace n on n.oid = t.relnamespace
    where n.nspname = 'public'
    order by t.relname, i.relname
    """
)


def table_sizes(url: URL | str) -> dict[str, dict[str, Any]]:
    """Per table of the public schema: exact rows, heap/toast/index/total bytes, the bytes of
    its live tuples (``sum(pg_column_size(t.*))``: the data without page overhead and free
    space) and each index's bytes. Run after ``VACUUM ANALYZE``. With the ``pgstattuple``
    extension (contrib; created in the database if the server has it): the heap's free space
    (reusable by later inserts, not returned to the disk) and each btree's leaf density."""
    engine = create_engine(url)
    out: dict[str, dict[str, Any]] = {}
    with engine.connect() as connection:
        stattuple = _has_pgstattuple(connection)
        for row in connection.execute(_TABLE_SIZES).mappings():
            name = row["name"]
            counted = connection.execute(
                text(f'select count(*), coalesce(sum(pg_column_size(t.*)), 0) from "{name}" t')
            ).one()
            out[name] = {
                "rows": int(counted[0]),
                "tuple_bytes": int(counted[1]),
                "heap_bytes": int(row["heap"]),
                "toast_bytes": int(row["toast"]),
                "index_bytes": int(row["index"]),
                "total_bytes": int(row["total"]),
                "indexes": {},
                "index_leaf_density": {},
            }
            if stattuple:
                free = connection.execute(
                    text("select free_space from pgstattuple(cast(:t as regclass))"),
                    {"t": f'"{name}"'},
                ).scalar()
                out[name]["heap_free_bytes"] = int(free or 0)
        for row in connection.execute(_INDEX_SIZES).mappings():
            table = out.get(row["table_name"])
            if table is None:
                continue
            table["indexes"][row["index_name"]] = int(row["bytes"])
            if stattuple:
                with contextlib.suppress(Exception), connection.begin_nested():
                    density = connection.execute(
                        text("select avg_leaf_density from pgstatindex(cast(:i as regclass))"),
                        {"i": f'"{row["index_name"]}"'},
                    ).scalar()
                    table["index_leaf_density"][row["index_name"]] = float(density)
        connection.rollback()
    engine.dispose()
    return out


def _has_pgstattuple(connection: Any) -> bool:
    try:
        with connection.begin_nested():
            connection.execute(text("create extension if not exists pgstattuple"))
        return True
    except Exception:
        return False


def compact_sizes(url: URL | str) -> dict[str, dict[str, int]]:
    """``VACUUM FULL`` (every table rewritten, every index rebuilt), then heap/index/total bytes
    per table: the smallest the same rows take, beside the after-VACUUM figures."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("VACUUM FULL"))
        out = {
            row["name"]: {
                "heap_bytes": int(row["heap"]),
                "index_bytes": int(row["index"]),
                "total_bytes": int(row["total"]),
            }
            for row in connection.execute(_TABLE_SIZES).mappings()
        }
    engine.dispose()
    return out


_EVENT_LOG_BY_JOB = text(
    """
    select coalesce(r.pipeline_name, case when e.run_id = '' then '(no run)' else '(unknown)' end)
               as job,
           count(distinct nullif(e.run_id, '')) as runs,
           count(*) as entries,
           coalesce(sum(pg_column_size(e.*)), 0) as tuple_bytes,
           coalesce(sum(octet_length(e.event)), 0) as event_bytes
    from event_logs e
    left join runs r on r.run_id = e.run_id
    group by 1
    order by 4 desc
    """
)


def dagster_breakdown(url: URL | str) -> dict[str, Any]:
    """The event log by job (entries, runs, bytes), runs and ticks by kind."""
    engine = create_engine(url)
    with engine.connect() as connection:
        by_job = {
            row["job"]: {k: int(row[k]) for k in ("runs", "entries", "tuple_bytes", "event_bytes")}
            for row in connection.execute(_EVENT_LOG_BY_JOB).mappings()
        }
        runs = {
            f"{job}:{status}": int(n)
            for job, status, n in connection.execute(
                text("select pipeline_name, status, count(*) from runs group by 1, 2 order by 1, 2")
            )
        }
        ticks: dict[str, int] = {}
        instigators = 0
        with contextlib.suppress(Exception):
            ticks = {
                f"{kind}:{status}": int(n)
                for kind, status, n in connection.execute(
                    text("select type, status, count(*) from job_ticks group by 1, 2 order by 1, 2")
                )
            }
            instigators = int(
                connection.execute(
                    text("select count(distinct selector_id) from job_ticks")
                ).scalar()
                or 0
            )
    engine.dispose()
    return {
        "event_log_by_job": by_job,
        "runs_by_job_status": runs,
        "ticks_by_type_status": ticks,
        "instigators_ticking": instigators,
    }


# ---- the sandbox with webhooks -----------------------------------------------------------------


def _serve_sandbox(argv: list[str]) -> int:
    """``python -m bench.storage sandbox``: the sandbox provider posting the bench's webhook mix."""
    from email_platform.sandbox.emitter import WebhookPlan
    from email_platform.sandbox.server import SandboxConfig, serve

    parser = argparse.ArgumentParser(prog="python -m bench.storage sandbox")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--webhook-url", required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    delivered = 1 - BOUNCE_RATE
    human = 1 - MACHINE_OPEN_RATE
    plan = WebhookPlan(
        webhook_url=args.webhook_url,
        secret=args.secret,
        delivered_rate=1.0,
        bounce_rate=BOUNCE_RATE,
        complaint_rate=COMPLAINT_RATE,
        unsubscribe_rate=UNSUBSCRIBE_RATE,
        # Shares of all messages: opens of the delivered; clicks of the human opens.
        open_rate=OPEN_SHARE / delivered,
        machine_open_rate=MACHINE_OPEN_RATE,
        click_rate=min(1.0, CLICK_SHARE / (OPEN_SHARE * human)),
        duplicate_rate=DUPLICATE_RATE,
        # Real providers retry for hours; here a loaded host must not lose a webhook.
        max_attempts=48,
    )
    serve(SandboxConfig(seed=args.seed, webhooks=plan), "127.0.0.1", args.port)
    return 0


class WebhookSandbox(Sandbox):
    """``bench.harness.Sandbox`` (its own process, so its CPU is no one's), posting webhooks."""

    def __init__(self, log: Path, webhook_url: str | None, secret: str) -> None:
        if webhook_url is None:
            super().__init__(log)
            return
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.storage", "sandbox", "--port", str(self.port)),
                *("--webhook-url", webhook_url, "--secret", secret),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{self.url}/_sandbox/health", timeout=1).raise_for_status()
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"sandbox did not start; see {log}")

    def posting(self) -> int:
        """Messages whose webhooks are still being posted."""
        answer = httpx.get(f"{self.url}/_sandbox/webhooks", params={"limit": 0}, timeout=10)
        return int(answer.json()["posting"])


def _start_receiver(app_url: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            *(str(BIN / "email-platform"), "webhooks", "serve"),
            *("--port", str(port), "--url", app_url),
        ],
        env={**os.environ, **env},
        stdout=open(log, "ab"),  # noqa: SIM115 - lives with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the webhook receiver did not come up; see {log}")


def _wait(condition, timeout_s: float, what: str, poll_s: float = 0.5) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last = 0.0
    while time.monotonic() < deadline:
        if condition():
            return True
        if time.monotonic() - last > 10:
            print(f"    waiting for {what} ...", file=sys.stderr, flush=True)
            last = time.monotonic()
        time.sleep(poll_s)
    return False


def _stop_daemon(daemon: DaemonProcess) -> None:
    """Stop the daemon and its whole tree (code server, runs), as ``bench.systems`` does."""
    if daemon.process is None:
        return
    try:
        tree = psutil.Process(daemon.process.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    daemon.stop()
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _gone, alive = psutil.wait_procs(tree, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _in_flight_runs(dagster_url: str) -> int:
    """Runs still queued or going, lane workers aside (they live until idle or their lifetime)."""
    engine = create_engine(dagster_url)
    with engine.connect() as connection:
        n = connection.execute(
            text(
                "select count(*) from runs where status in "
                "('QUEUED', 'NOT_STARTED', 'STARTING', 'STARTED') "
                "and pipeline_name <> 'lane_worker_job'"
            )
        ).scalar()
    engine.dispose()
    return int(n or 0)


def _wal_lsn(admin: Engine) -> str | None:
    """The server's current WAL position (cluster-wide: other databases' writes count too)."""
    with contextlib.suppress(Exception), admin.connect() as connection:
        return str(connection.execute(text("select pg_current_wal_lsn()")).scalar())
    return None


def _wal_bytes(admin: Engine, start: str | None, end: str | None) -> int | None:
    if start is None or end is None:
        return None
    with admin.connect() as connection:
        return int(
            connection.execute(
                text("select pg_wal_lsn_diff(cast(:e as pg_lsn), cast(:s as pg_lsn))"),
                {"s": start, "e": end},
            ).scalar()
        )


def _commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(
            [
                "git",
                "-C",
                str(Path(__file__).resolve().parent.parent),
                "rev-parse",
                "--short",
                "HEAD",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return None


# ---- the measurement ---------------------------------------------------------------------------


def measure_storage(settings: StorageSettings) -> dict[str, Any]:
    """Drain ``settings.events`` through the platform and measure what it stored."""
    app = make_url(settings.database_url)
    if app.get_backend_name() != "postgresql" or not app.database:
        raise ValueError("bench.storage needs a PostgreSQL --database-url naming a database")
    dagster_db = settings.dagster_database or f"{app.database}_dagster"
    admin = _admin(app)
    work = settings.workdir or Path(tempfile.mkdtemp(prefix="bench_storage_"))
    work.mkdir(parents=True, exist_ok=True)
    _create(admin, app.database, settings.replace)
    try:
        _create(admin, dagster_db, settings.replace)
    except BaseException:
        _drop(admin, app.database)
        raise
    try:
        report = _drain_and_measure(settings, app, dagster_db, admin, work)
    finally:
        if not settings.keep:
            _drop(admin, app.database)
            _drop(admin, dagster_db)
            if settings.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        admin.dispose()
    _per_email(report)
    return report


def _drain_and_measure(
    settings: StorageSettings, app: URL, dagster_db: str, admin: Engine, work: Path
) -> dict[str, Any]:
    app_url = app.render_as_string(hide_password=False)
    dagster_url = app.set(database=dagster_db).render_as_string(hide_password=False)
    secret = "whsec_" + "YmVuY2gtc3RvcmFnZS13ZWJob29rLXNlY3JldA=="
    receiver_port = free_port()
    warehouse_path = work / "warehouse.duckdb"
    engine = prepare_app_db(app_url, settings.users_n)
    sandbox: WebhookSandbox | None = None
    receiver: subprocess.Popen | None = None
    daemon: DaemonProcess | None = None
    trickle: CriticalTrickle | None = None
    sampler = ProcessSampler()
    report: dict[str, Any] = {
        "date": datetime.now(UTC).date().isoformat(),
        "commit": _commit(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "timings_s": {},
    }
    report["settings"]["database_url"] = app.render_as_string(hide_password=True)
    timings = report["timings_s"]
    started = time.monotonic()
    wal_start = _wal_lsn(admin)
    wal_end: str | None = None
    try:
        webhook_url = f"http://127.0.0.1:{receiver_port}/webhooks/sandbox"
        sandbox = WebhookSandbox(
            work / "sandbox.log", webhook_url if settings.webhooks else None, secret
        )
        env = {
            "EMAIL_PLATFORM_HOME": str(work),
            "EMAIL_PLATFORM_DATABASE_URL": app_url,
            "EMAIL_PLATFORM_PROVIDER": "sandbox",
            "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.url,
            "EMAIL_PLATFORM_SANDBOX_BATCH_MAX": str(settings.provider_batch),
            "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": secret,
            "EMAIL_PLATFORM_WAREHOUSE": str(warehouse_path),
            "EMAIL_PLATFORM_ANALYTICS_REFRESH_S": str(settings.analytics_refresh_s),
            "EMAIL_PLATFORM_LANES": json.dumps(
                {"bulk": {"batch_size": settings.batch_size, "workers": settings.bulk_workers}}
            ),
        }
        if settings.webhooks:
            receiver = _start_receiver(app_url, receiver_port, env, work / "receiver.log")
            sampler.watch(receiver.pid)
        home = work / "dagster_home"
        home.mkdir(exist_ok=True)
        (home / "dagster.yaml").write_text(
            render_dagster_yaml(
                max_runs=settings.bulk_workers + 4,
                bulk_runs=settings.bulk_workers,
                transactional_runs=settings.bulk_workers,
                start_timeout_s=180,
                postgres=PostgresStorage(
                    hostname=app.host or "127.0.0.1",
                    port=app.port or 5432,
                    username=app.username or "postgres",
                    db_name=dagster_db,
                ),
            )
        )
        prepare_home(home)
        daemon = DaemonProcess(home, env, work / "daemon.log").start()
        if not daemon.wait_until_ticking(timeout_s=180):
            raise RuntimeError(f"dagster-daemon did not come up; see {daemon.log_path}")
        assert daemon.process is not None
        sampler.watch(daemon.process.pid)
        sampler.start()
        timings["daemon_up"] = time.monotonic() - started
        alive = daemon.alive

        trickle = CriticalTrickle(engine, settings.critical_per_s, settings.users_n).start()
        if settings.critical_per_s:
            timings["first_critical_sent"] = wait_first_sent(engine, settings.timeout_s, alive)
        print(f"  publishing {settings.events} bulk events ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        timings["publish"] = publish_backlog(engine, settings.events)
        drained = wait_drained(engine, settings.timeout_s, alive, lane="bulk")
        trickle.stop()
        drained = drained and wait_drained(engine, settings.timeout_s, alive)
        timings["drain"] = time.monotonic() - t0
        report["drained"] = drained
        if settings.webhooks:
            t0 = time.monotonic()
            report["webhooks_posted"] = _wait(
                lambda: sandbox.posting() == 0, settings.timeout_s, "the sandbox's webhooks"
            )
            report["webhooks_ingested"] = wait_settled(engine, timeout_s=settings.timeout_s)
            timings["webhooks"] = time.monotonic() - t0
            report["sandbox_stats"] = sandbox.stats()
        # Let the last ingestion and analytics runs finish, so their event log is whole.
        _wait(lambda: _in_flight_runs(dagster_url) == 0, 120, "in-flight runs to finish")
        wal_end = _wal_lsn(admin)
        sampler.stop()
        report["cpu_s_by_kind"] = {k: round(v, 1) for k, v in sampler.cpu_s_by_kind().items()}
        timings["wall"] = time.monotonic() - started
    finally:
        if trickle is not None:
            trickle.stop()
        if daemon is not None:
            _stop_daemon(daemon)
        if receiver is not None and receiver.poll() is None:
            receiver.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                receiver.wait(timeout=10)
            if receiver.poll() is None:
                receiver.kill()
        if sandbox is not None:
            sandbox.stop()
    try:
        with engine.connect() as connection:
            report["emails"] = int(
                connection.execute(select(func.count()).select_from(email_messages)).scalar() or 0
            )
            report["events_published"] = int(
                connection.execute(select(func.count()).select_from(email_outbox)).scalar() or 0
            )
            report["messages_by_status"] = dict(
                connection.execute(
                    select(email_messages.c.status, func.count()).group_by(email_messages.c.status)
                ).all()
            )
            report["events_not_done"] = int(
                connection.execute(
                    select(func.count())
                    .select_from(email_outbox)
                    .where(email_outbox.c.status.notin_(["done", "dead"]))
                ).scalar()
                or 0
            )
        engine.dispose()
        if settings.warehouse:
            from email_platform.warehouse import refresh

            t0 = time.monotonic()
            summary = refresh(app_url, warehouse_path, full=True)
            report["warehouse"] = {
                "full_refresh_s": time.monotonic() - t0,
                "file_bytes": warehouse_path.stat().st_size,
                "writer_file_bytes": _size(Path(f"{warehouse_path}.writer")),
                "table_rows": summary.table_rows,
            }
        # Everything the server logged meanwhile, other engineers' databases included.
        report["wal_bytes_cluster_wide"] = _wal_bytes(admin, wal_start, wal_end)
        _vacuum_analyze(app_url)
        _vacuum_analyze(dagster_url)
        app_tables = table_sizes(app_url)
        ours = set(metadata.tables)
        report["app_tables"] = {k: v for k, v in app_tables.items() if k in ours}
        report["other_app_tables"] = {k: v for k, v in app_tables.items() if k not in ours}
        report["dagster_tables"] = table_sizes(dagster_url)
        report["dagster"] = dagster_breakdown(dagster_url)
        for group, url in (("app_tables", app_url), ("dagster_tables", dagster_url)):
            for name, sizes in compact_sizes(url).items():
                if name in report[group]:
                    report[group][name]["compact"] = sizes
    finally:
        engine.dispose()
    return report


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.exists() else None


def _per_email(report: dict[str, Any]) -> None:
    """Add ``*_per_email`` figures next to every count and byte figure."""
    emails = max(1, report.get("emails", 0))
    for group in ("app_tables", "dagster_tables"):
        for figures in report.get(group, {}).values():
            figures["rows_per_email"] = figures["rows"] / emails
            for key in ("heap", "toast", "index", "total", "tuple", "heap_free"):
                if f"{key}_bytes" in figures:
                    figures[f"{key}_bytes_per_email"] = figures[f"{key}_bytes"] / emails
            for key, value in list(figures.get("compact", {}).items()):
                figures["compact"][key.replace("_bytes", "_bytes_per_email")] = value / emails
            figures["indexes_bytes_per_email"] = {
                name: size / emails for name, size in figures["indexes"].items()
            }
    for kind in ("app_tables", "dagster_tables"):
        tables = report.get(kind, {})
        report[f"{kind}_total_bytes_per_email"] = sum(t["total_bytes"] for t in tables.values()) / (
            emails
        )
    for figures in report.get("dagster", {}).get("event_log_by_job", {}).values():
        figures["tuple_bytes_per_email"] = figures["tuple_bytes"] / emails
    if report.get("wal_bytes_cluster_wide") is not None:
        report["wal_bytes_per_email_upper_bound"] = report["wal_bytes_cluster_wide"] / emails
    warehouse = report.get("warehouse")
    if warehouse:
        warehouse["file_bytes_per_email"] = warehouse["file_bytes"] / emails


# ---- report ------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    emails = report.get("emails", 0)
    print(
        f"\n{emails} emails ({report.get('events_published')} events published, "
        f"messages by status {report.get('messages_by_status')}); per email = per "
        f"email_messages row; bytes after VACUUM ANALYZE"
    )
    header = (
        f"{'table':<26} {'rows':>8} {'rows/email':>10} {'heap B/e':>9} {'free B/e':>8} "
        f"{'toast B/e':>9} {'index B/e':>9} {'total B/e':>9} {'tuple B/row':>11} "
        f"{'full: heap':>10} {'index':>6} {'total':>6}"
    )

    def rows(tables: dict[str, dict[str, Any]], title: str, skip_empty: bool) -> None:
        print(f"\n{title}")
        print(header)
        print("-" * len(header))
        keys = ("heap", "heap_free", "toast", "index", "total")
        total = dict.fromkeys(keys, 0.0)
        compact = dict.fromkeys(("heap", "index", "total"), 0.0)
        for name, t in sorted(tables.items(), key=lambda kv: -kv[1]["total_bytes"]):
            for key in total:
                total[key] += t.get(f"{key}_bytes_per_email", 0.0)
            c = t.get("compact", {})
            for key in compact:
                compact[key] += c.get(f"{key}_bytes_per_email", 0.0)
            if skip_empty and t["total_bytes_per_email"] < 0.5 and not t["rows"]:
                continue
            per_row = t["tuple_bytes"] / t["rows"] if t["rows"] else 0.0
            print(
                f"{name:<26} {t['rows']:>8} {t['rows_per_email']:>10.3f} "
                f"{t['heap_bytes_per_email']:>9.1f} {t.get('heap_free_bytes_per_email', 0):>8.1f} "
                f"{t['toast_bytes_per_email']:>9.1f} "
                f"{t['index_bytes_per_email']:>9.1f} {t['total_bytes_per_email']:>9.1f} "
                f"{per_row:>11.1f} {c.get('heap_bytes_per_email', 0):>10.1f} "
                f"{c.get('index_bytes_per_email', 0):>6.1f} "
                f"{c.get('total_bytes_per_email', 0):>6.1f}"
            )
        print(
            f"{'all tables':<26} {'':>8} {'':>10} {total['heap']:>9.1f} {total['heap_free']:>8.1f} "
            f"{total['toast']:>9.1f} {total['index']:>9.1f} {total['total']:>9.1f} {'':>11} "
            f"{compact['heap']:>10.1f} {compact['index']:>6.1f} {compact['total']:>6.1f}"
        )
        print(
            "(heap, free, toast, index, total: after VACUUM ANALYZE; free: the heap's reusable "
            "free space (pgstattuple); tuple: live data per row; full: after VACUUM FULL)"
        )

    rows(report.get("app_tables", {}), "Application tables", skip_empty=False)
    print("\nApplication indexes (bytes per email)")
    for name, t in sorted(report.get("app_tables", {}).items()):
        for index, size in sorted(t["indexes_bytes_per_email"].items(), key=lambda kv: -kv[1]):
            density = t.get("index_leaf_density", {}).get(index)
            leaf = f"  leaf density {density:.0f}%" if density == density and density else ""
            print(f"  {name:<24} {index:<44} {size:>8.1f}{leaf}")
    rows(report.get("dagster_tables", {}), "Dagster database tables", skip_empty=True)
    by_job = report.get("dagster", {}).get("event_log_by_job", {})
    if by_job:
        print("\nDagster event log by job")
        print(f"{'job':<32} {'runs':>6} {'entries':>8} {'entries/email':>13} {'B/email':>8}")
        for job, f in by_job.items():
            per_email = f["entries"] / max(1, emails)
            print(
                f"{job:<32} {f['runs']:>6} {f['entries']:>8} {per_email:>13.4f} "
                f"{f['tuple_bytes_per_email']:>8.1f}"
            )
    warehouse = report.get("warehouse")
    if warehouse:
        print(
            f"\nWarehouse (DuckDB) after a full refresh: {warehouse['file_bytes']} bytes = "
            f"{warehouse['file_bytes_per_email']:.1f} B/email (the next-writer copy beside it: "
            f"{warehouse['writer_file_bytes']}), full refresh {warehouse['full_refresh_s']:.2f} s"
        )
    if report.get("wal_bytes_per_email_upper_bound") is not None:
        print(
            f"\nWAL written by the server during the drain and webhooks: "
            f"{report['wal_bytes_per_email_upper_bound']:.0f} B/email (cluster-wide: an upper "
            f"bound, other databases on the server count too)"
        )
    print(
        "\ntimings s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in report.get("timings_s", {}).items())
        + f"; CPU-s by process kind: {report.get('cpu_s_by_kind')}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sandbox"]:
        return _serve_sandbox(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench.storage", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--events", type=int, default=5000, help="bulk backlog size")
    parser.add_argument("--database-url", required=True, help="PostgreSQL database to create")
    parser.add_argument("--dagster-database", help="default: <app database>_dagster")
    parser.add_argument("--critical-per-s", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=500, help="bulk lane batch size")
    parser.add_argument("--bulk-workers", type=int, default=2)
    parser.add_argument("--provider-batch", type=int, default=100)
    parser.add_argument("--no-webhooks", action="store_true")
    parser.add_argument("--no-warehouse", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=540)
    parser.add_argument("--replace", action="store_true", help="drop the databases if they exist")
    parser.add_argument("--keep", action="store_true", help="keep the databases and files")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = measure_storage(
        StorageSettings(
            database_url=args.database_url,
            events=args.events,
            dagster_database=args.dagster_database,
            critical_per_s=args.critical_per_s,
            batch_size=args.batch_size,
            bulk_workers=args.bulk_workers,
            provider_batch=args.provider_batch,
            webhooks=not args.no_webhooks,
            warehouse=not args.no_warehouse,
            timeout_s=args.timeout_s,
            replace=args.replace,
            keep=args.keep,
            workdir=args.workdir,
        )
    )
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    ok = report.get("drained") and not report.get("events_not_done")
    if report["settings"]["webhooks"]:
        ok = ok and report.get("webhooks_posted") and report.get("webhooks_ingested")
    if not ok:
        print("NOT COMPLETE: see drained / webhooks_posted / webhooks_ingested", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
