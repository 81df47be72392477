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
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
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


def _tree_cpu_s(pids: list[int]) -> float:
    """User+system CPU seconds so far of ``pids`` and their descendants."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
    return total


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
    celery = [pid for name, pid in state["processes"].items() if name.startswith("celery-w")]
    try:
        for pid in celery:
            sampler.watch(pid)
        # Two cores may not start every worker within its lane's start-up grace (120 s): go on
        # with those up after --startup-s, and say how many there were.
        wait_for(lambda: _bulk_workers_up(engine) >= slots, args.startup_s, 1.0)
        workers_up = _bulk_workers_up(engine)
        sampler.start()
        # CPU from here on only: the workers' start-up is not sending (a process that ends
        # meanwhile takes its share with it, so the figure is a lower bound).
        cpu_before = _tree_cpu_s(celery)
        publish_backlog(engine, args.events)
        drained = wait_drained(engine, args.timeout_s, lambda: True, lane="bulk")
        cpu_s = _tree_cpu_s(celery) - cpu_before
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
        "bulk_workers_up_at_publish": workers_up,
        "drained": drained,
        "sent": figures["sent"],
        "sent_once": len(per_event) == args.events and set(per_event.values()) == {1},
        "emails_per_s": round(figures["emails_per_s"], 1),
        "drain_emails_per_s": round(figures["drain_emails_per_s"], 1),
        "first_sent_s": figures["first_sent_s"],
        "celery_cpu_s_per_1k": round(cpu_s / sent * 1000, 2),
        "celery_peak_rss_mb": sampler.peak_rss_mb(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_scaling", description=__doc__)
    parser.add_argument("--workers", default="1,2,4", help="Celery worker counts to measure.")
    parser.add_argument("--events", type=int, default=3000, help="Bulk events per run.")
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--concurrency", type=int, default=2, help="Slots per Celery worker.")
    parser.add_argument(
        "--lane-concurrency", type=int, default=20, help="Sends in flight per bulk lane worker."
    )
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--startup-s", type=float, default=240.0, help="Longest wait for the bulk workers."
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.workers.split(",") if part.strip()]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        for workers in counts:
            try:
                results.append(run_one(workers, args, Path(tmp)))
            except Exception as exc:  # one failed count still leaves the others' figures
                print(f"workers={workers} failed: {exc!r}", file=sys.stderr, flush=True)
            time.sleep(2.0)
    if not results:
        sys.exit("no worker count was measured")
    base = results[0]["emails_per_s"] or 1.0
    print(
        f"\nbulk, sandbox {args.latency_ms:g} ms a call, one message a call, "
        f"{args.events} events, {args.concurrency} slot(s) per Celery worker, "
        f"{args.lane_concurrency} sends in flight per lane worker\n"
    )
    print(
        "| Celery workers | bulk workers up | emails/s | vs first | per-worker efficiency "
        "| CPU-s / 1k | peak RSS MB | sent once |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        ratio = row["emails_per_s"] / base
        row["ratio_to_first"] = round(ratio, 2)
        row["efficiency"] = round(ratio / (row["celery_workers"] / results[0]["celery_workers"]), 2)
        print(
            f"| {row['celery_workers']} | {row['bulk_workers_up_at_publish']}/{row['slots']} | "
            f"{row['emails_per_s']:,.0f} | {ratio:.2f}x | {row['efficiency']:.2f} | "
            f"{row['celery_cpu_s_per_1k']} | {row['celery_peak_rss_mb']:.0f} | {row['sent_once']} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": None}, "runs": results}, indent=2, default=str
            )
        )


if __name__ == "__main__":
    main()
