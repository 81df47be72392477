"""Figures of the send benchmark: CPU and RSS of the system's process tree (and the CPU of the
sandbox and PostgreSQL, which every system shares), per-lane latency and throughput from the
application database, and the Dagster database's size."""

import math
import threading
from typing import Any

import psutil
from sqlalchemy import Engine, create_engine, func, make_url, select, text

from email_platform.db.schema import email_attempts, email_messages, email_outbox


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
        self.marked: dict[tuple[int, float], float] = {}
        self.labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, pid: int, label: str | None = None) -> None:
        """Sample ``pid`` and its descendants, every one named ``label`` if given."""
        self.roots.append(pid)
        if label is not None:
            self.labels[pid] = label

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
            if root in self.labels:
                self._sample_whole(root, parent, tree)
                continue
            for proc in tree:
                try:
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
                    if key not in self.kind:
                        self.kind[key] = self.labels.get(root) or _process_kind(proc, root)
                except psutil.Error:
                    continue
                self.cpu[key] = times.user + times.system
                self.rss[key] = max(self.rss.get(key, 0), rss)

    def _sample_whole(self, root: int, parent: psutil.Process, tree: list) -> None:
        """A labelled tree as one figure, with the CPU of children that already exited: a
        PostgreSQL server starts a backend per connection, and a client without a pool (Dagster's
        storage) makes backends that live for milliseconds, between two samples."""
        total = 0.0
        for proc in tree:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue  # exited since listed: its CPU is in its parent's children's times
            total += times.user + times.system + times.children_user + times.children_system
        try:
            key = (root, parent.create_time())
        except psutil.Error:
            return
        self.kind[key] = self.labels[root]
        self.cpu[key] = total

    def mark(self) -> None:
        """Start the sending window: ``window_cpu_s`` counts CPU from here on."""
        self._sample()
        self.marked = dict(self.cpu)

    @property
    def cpu_s(self) -> float:
        """CPU since each process started: start-up and idle waiting included."""
        return sum(self.cpu.values())

    @property
    def window_cpu_s(self) -> float:
        """CPU since ``mark``: what sending cost, a process started meanwhile counted whole."""
        return sum(cpu - self.marked.get(key, 0.0) for key, cpu in self.cpu.items())

    def cpu_s_by_kind(self, window: bool = False) -> dict[str, float]:
        """CPU seconds per kind of process: where a system's CPU goes, not only how much."""
        totals: dict[str, float] = {}
        for key, cpu in self.cpu.items():
            kind = self.kind.get(key, "other")
            spent = cpu - (self.marked.get(key, 0.0) if window else 0.0)
            totals[kind] = totals.get(kind, 0.0) + spent
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def peak_rss_mb(self, kind: str | None = None) -> float:
        values = [v for k, v in self.rss.items() if self.kind.get(k, "").startswith(kind or "")]
        return max(values, default=0) / 2**20


def postgres_server_pid(url: str) -> int | None:
    """The PostgreSQL server of ``url`` when it runs on this machine: the process listening on
    its port (every backend is its child). None for a server elsewhere, or one not found."""
    parsed = make_url(url)
    if parsed.host not in ("127.0.0.1", "localhost", "::1", None):
        return None
    port = parsed.port or 5432
    for connection in psutil.net_connections(kind="tcp"):
        if (
            connection.status == psutil.CONN_LISTEN
            and connection.laddr
            and connection.laddr.port == port
            and connection.pid
        ):
            return connection.pid
    return None


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
        stages = critical_stages(connection, first_publish)
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
        "critical_stages": stages,
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


#: A critical email's way from its publish to its acceptance being recorded, in three stages:
#: until its message row is written (waiting for a poll, finding and claiming it, preparing
#: it), until its provider call starts (the hand-over to the delivery thread, which first
#: finishes the batch before), and until its acceptance is recorded (the call, then the wait
#: for its group to be written).
STAGES = ("published_to_prepared", "prepared_to_call", "call_to_recorded")


def critical_stages(connection: Any, since: Any) -> dict[str, dict[str, float | None]]:
    """p50/p99 seconds of each of ``STAGES`` over the critical emails published ``since``."""
    if since is None:
        return {}
    rows = connection.execute(
        select(
            email_outbox.c.published_at,
            email_messages.c.created_at,
            email_attempts.c.started_at,
            email_messages.c.sent_at,
        )
        .join(email_messages, email_messages.c.event_id == email_outbox.c.event_id)
        .join(email_attempts, email_attempts.c.message_id == email_messages.c.message_id)
        .where(
            email_outbox.c.lane == "critical",
            email_outbox.c.published_at >= since,
            email_attempts.c.outcome == "accepted",
            email_messages.c.sent_at.is_not(None),
        )
    ).all()
    spans: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for published, prepared, call, recorded in rows:
        points = (published, prepared, call, recorded)
        for stage, start, end in zip(STAGES, points, points[1:], strict=False):
            spans[stage].append((end - start).total_seconds())
    return {
        stage: {"p50_s": percentile(values, 0.50), "p99_s": percentile(values, 0.99)}
        for stage, values in spans.items()
        if values
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
