"""Scaling out on Celery: bulk throughput with 1, 2 and 4 ``dagster-celery`` worker processes.

``python -m bench.celery_scaling`` brings the production stack up (``email_platform.local.stack``:
PostgreSQL instance and application database, daemon, Celery workers on Redis, the sandbox)
once per worker count, each Celery worker the same size (``--concurrency`` slots, one resident
bulk lane worker per slot), against a sandbox that answers each call in ``--latency-ms`` and
one message per call (how the real adapters send). The bulk lane workers are up and waiting
before the backlog is published, so the figure is of sending, not of starting processes.

Printed per worker count: emails/s from the backlog's first publish to its last acceptance,
the ratio to one worker, the per-worker efficiency (ratio / workers), CPU-s per 1,000 emails
of the Celery workers' process trees, and whether every event was sent once. ``--json PATH``
writes the figures. See bench/README.md ("Scaling out on Celery").
"""

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import func, select

from bench.harness import PG_SERVER, free_port, wait_drained
from bench.measure import ProcessSampler, measure_app_db
from bench.workload import publish_backlog
from email_platform.db.engine import make_engine
from email_platform.db.schema import lane_workers
from email_platform.local.dagster_home import wait_for
from email_platform.local.stack import StackSettings, down, stack_env, up

BROKER = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/13")


def _bulk_workers_up(engine: Any) -> int:
    with engine.connect() as connection:
        return connection.execute(
            select(func.count())
            .select_from(lane_workers)
            .where(lane_workers.c.lane == "bulk", lane_workers.c.ended_at.is_(None))
        ).scalar_one()


def run_one(workers: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    slots = workers * args.concurrency
    settings = StackSettings(
        workdir / f"workers_{workers}",
        postgres_url=PG_SERVER.replace("+psycopg", "") + "/postgres",
        name=f"bench_scale_{os.getpid()}_{workers}",
        receivers=1,
        celery_workers=workers,
        celery_concurrency=args.concurrency,
        broker=BROKER,
        receiver_port=free_port(),
        webserver_port=free_port(),
        sandbox_port=free_port(),
        sandbox_latency_ms=args.latency_ms,
        webhooks=False,
        lanes={
            "bulk": {
                "workers": slots,
                "warm_workers": slots,
                "concurrency": args.lane_concurrency,
                "batch_size": args.batch_size,
            }
        },
        env={"EMAIL_PLATFORM_SANDBOX_BATCH_MAX": "1"},
    )
    redis.Redis.from_url(BROKER).flushdb()
    print(f"workers={workers}: bringing the stack up", file=sys.stderr, flush=True)
    state = up(settings, echo=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    env = stack_env(settings)
    engine = make_engine(env["EMAIL_PLATFORM_DATABASE_URL"])
    sampler = ProcessSampler()
    try:
        for name, pid in state["processes"].items():
            if name.startswith("celery-w"):
                sampler.watch(pid)
        if not wait_for(lambda: _bulk_workers_up(engine) >= slots, 300, 1.0):
            raise RuntimeError(f"only {_bulk_workers_up(engine)} of {slots} bulk workers came up")
        sampler.start()
        publish_backlog(engine, args.events)
        drained = wait_drained(engine, args.timeout_s, lambda: True, lane="bulk")
        sampler.stop()
        figures = measure_app_db(engine)
        accepted = httpx.get(f"{state['urls']['sandbox']}/_sandbox/messages").json()["messages"]
        per_event = Counter(m["metadata"]["event_id"] for m in accepted)
    finally:
        engine.dispose()
        down(settings.directory, drain_s=30.0, drop=True, echo=lambda line: None)
    sent = max(1, figures["sent"])
    return {
        "celery_workers": workers,
        "slots": slots,
        "drained": drained,
        "sent": figures["sent"],
        "sent_once": len(per_event) == args.events and set(per_event.values()) == {1},
        "emails_per_s": round(figures["emails_per_s"], 1),
        "drain_emails_per_s": round(figures["drain_emails_per_s"], 1),
        "first_sent_s": figures["first_sent_s"],
        "celery_cpu_s_per_1k": round(sampler.cpu_s / sent * 1000, 2),
        "celery_peak_rss_mb": sampler.peak_rss_mb(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_scaling", description=__doc__)
    parser.add_argument("--workers", default="1,2,4", help="Celery worker counts to measure.")
    parser.add_argument("--events", type=int, default=3000, help="Bulk events per run.")
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--concurrency", type=int, default=1, help="Slots per Celery worker.")
    parser.add_argument(
        "--lane-concurrency", type=int, default=20, help="Sends in flight per bulk lane worker."
    )
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.workers.split(",") if part.strip()]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        for workers in counts:
            results.append(run_one(workers, args, Path(tmp)))
            time.sleep(2.0)
    base = results[0]["emails_per_s"] or 1.0
    print(
        f"\nbulk, sandbox {args.latency_ms:g} ms a call, one message a call, "
        f"{args.events} events, {args.concurrency} slot(s) per Celery worker, "
        f"{args.lane_concurrency} sends in flight per lane worker\n"
    )
    print("| Celery workers | emails/s | vs 1 | per-worker efficiency | CPU-s / 1k | sent once |")
    print("|---|---|---|---|---|---|")
    for row in results:
        ratio = row["emails_per_s"] / base
        row["ratio_to_first"] = round(ratio, 2)
        row["efficiency"] = round(ratio / (row["celery_workers"] / results[0]["celery_workers"]), 2)
        print(
            f"| {row['celery_workers']} | {row['emails_per_s']:,.0f} | {ratio:.2f}x | "
            f"{row['efficiency']:.2f} | {row['celery_cpu_s_per_1k']} | {row['sent_once']} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": None}, "runs": results}, indent=2, default=str
            )
        )


if __name__ == "__main__":
    main()
