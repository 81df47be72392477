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

The CLI lives here; fixtures (databases, sandbox process) in ``bench/harness.py``, what is
published in ``bench/workload.py``, CPU, latency and storage figures in ``bench/measure.py``,
and the dagster, celery and ceiling runners in ``bench/systems.py``.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select

from bench.harness import in_process
from bench.systems import Result, Settings, run_ceiling, run_celery, run_dagster
from email_platform.db.schema import email_outbox

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


def hotpath(args: argparse.Namespace) -> int:
    """Publish ``--events`` bulk events and send them as one batch through ``BatchSender``."""
    with in_process(args, "hotpath", {}) as (engine, sandbox, _provider, sender):
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
            with in_process(args, "worker", changes) as (engine, _sandbox, _provider, sender):
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
