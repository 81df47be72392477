"""Fixtures of the send benchmark: PostgreSQL databases, the sandbox process, the product's
users table, waiting on the outbox, and the in-process sender for ``hotpath`` and ``worker``.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Column, Engine, MetaData, String, Table, create_engine, func, select, text

from bench.workload import publish_backlog
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import email_messages, email_outbox

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

    def __init__(self, log: Path, latency_ms: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                *(str(BIN / "email-platform"), "sandbox", "serve", "--port", str(self.port)),
                # Every call answered after this long, as a real provider's API would be.
                *("--latency-ms", str(latency_ms)),
            ],
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


@contextlib.contextmanager
def in_process(
    args: argparse.Namespace, prefix: str, lane_changes: dict[str, Any]
) -> Iterator[tuple[Engine, Sandbox, Any, Any]]:
    """A fresh database holding ``--events`` bulk events, the sandbox, and a ``BatchSender``.

    Yields (engine, sandbox, provider, sender); everything is torn down afterwards.
    """
    from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
    from email_platform.providers.sandbox import SandboxProvider
    from email_platform.sending.batch import build_sender

    stamp = f"{prefix}_{os.getpid()}_{int(time.time())}"
    db_name = f"bench_app_{stamp}"
    engine = prepare_app_db(create_database(db_name), 10)
    sandbox = Sandbox(
        Path(tempfile.mkdtemp(prefix=f"bench_{prefix}_")) / "sandbox.log",
        float(str(args.provider_latency_ms).split(",")[0]),
    )
    provider = None
    try:
        publish_backlog(engine, args.events)
        lane = DEFAULT_LANE_CONFIGS[Lane.BULK]
        lane = type(lane)(
            **{
                **lane.__dict__,
                "concurrency": args.concurrency,
                **lane_changes,
                # ``--lanes '{"bulk": {...}}'`` (the Dagster system's bulk settings) here too.
                **getattr(args, "lanes", {}).get("bulk", {}),
            }
        )
        provider = SandboxProvider(
            sandbox.url,
            max_connections=lane.calls_in_flight,
            timeout_s=30,
            batch_max=args.provider_batch,
        )
        sender = build_sender(
            engine=engine,
            provider=provider,
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
