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

from bench.baseline_celery import CeleryConfig
from bench.harness import in_process
from bench.providers import PROVIDERS
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
        f"{'system':<20} {'in-flight':>9} {'events':>6} {'emails/s':>9} {'drain/s':>8} "
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
            f"{result.system:<20} {_fmt(f.get('in_flight')):>9} {result.events:>6} "
            f"{_fmt(eps):>9} "
            f"{_fmt(f.get('drain_emails_per_s')):>8} {trio('bulk'):>20} {trio('critical'):>20} "
            f"{_fmt(f.get('cpu_s_per_1k'), 2):>8} {_fmt(f.get('peak_rss_mb'), 0):>10} "
            f"{_fmt(f.get('storage_bytes_per_email'), 0):>8} "
            f"{_fmt(f.get('event_log_bytes_per_email'), 0):>9} "
            f"{_fmt(eps / baseline if baseline else None, 2):>8} "
            f"{_fmt(eps / ceiling if ceiling else None, 2):>9}"
        )
    for result in results:
        f = result.figures
        if f.get("sandbox_cpu_s_per_1k") is not None:
            print(
                f"  {result.system} CPU-s/1k: own {_fmt(f.get('cpu_s_per_1k'), 2)}, sandbox "
                f"{_fmt(f.get('sandbox_cpu_s_per_1k'), 2)}, PostgreSQL "
                f"{_fmt(f.get('database_cpu_s_per_1k'), 2)}, machine "
                f"{_fmt(machine_cpu_s_per_1k(f), 2)}"
            )
    for result in results:
        stages = result.figures.get("critical_stages") or {}
        if stages:
            parts = [
                f"{stage.replace('_', ' ')} {_fmt(v['p50_s'], 2)}/{_fmt(v['p99_s'], 2)}"
                for stage, v in stages.items()
            ]
            print(f"  {result.system} critical stages p50/p99 s: " + ", ".join(parts))


def machine_cpu_s_per_1k(figures: dict[str, Any]) -> float | None:
    """A system's own CPU per 1,000 emails plus what the sandbox and PostgreSQL spent meanwhile:
    on a machine whose cores are all busy, the cost that sets the speed."""
    parts = [
        figures.get(k) for k in ("cpu_s_per_1k", "sandbox_cpu_s_per_1k", "database_cpu_s_per_1k")
    ]
    # None where a part was not measured (a PostgreSQL server on another machine).
    return None if None in parts else sum(parts)  # type: ignore[arg-type]


def _lane_overrides(text: str) -> dict[str, dict[str, Any]]:
    """``--lanes``: a JSON object of lane name to an object of settings."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError('expected {"lane": {"setting": value}, ...}')
    return value


def _setting_label(latency_ms: float, provider_batch: int, provider: str) -> str:
    calls = "one message a call" if provider_batch == 1 else f"{provider_batch} messages a call"
    return f"{provider} {latency_ms:g} ms, {calls}"


def _celery_configs(args: argparse.Namespace, latency_ms: float) -> list[CeleryConfig]:
    """The Celery sweep for a setting: prefork for an instant provider, gevent for a slow one
    (what Celery's docs advise for CPU-bound and I/O-bound tasks)."""
    specs = args.celery_instant if latency_ms == 0 else args.celery_latency
    return [CeleryConfig.parse(spec) for spec in specs.split(",") if spec.strip()]


def _summarize(
    latency_ms: float, provider_batch: int, provider: str, results: list[Result]
) -> dict[str, Any]:
    """One setting's figures: the keys the issue asks for, then every row."""
    rows = {r.system: r for r in results}
    ours = rows.get("dagster")
    celery = [r for r in results if r.system.startswith("celery")]
    best = max(celery, key=lambda r: r.figures.get("emails_per_s", 0.0), default=None)
    ceiling = rows.get("ceiling")

    def eps(result: Result | None) -> float | None:
        return result.figures.get("emails_per_s") if result else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "provider": provider,
        "provider_latency_ms": latency_ms,
        "provider_batch": provider_batch,
        "emails_per_s": eps(ours),
        "baseline_emails_per_s": eps(best),
        "baseline_config": best.figures.get("config") if best else None,
        "ceiling_emails_per_s": eps(ceiling),
        "x_baseline": ratio(eps(ours), eps(best)),
        "x_ceiling": ratio(eps(ours), eps(ceiling)),
        "critical_p50_s": _lane(ours, "critical", "p50_s"),
        "critical_p99_s": _lane(ours, "critical", "p99_s"),
        "critical_stages": ours.figures.get("critical_stages") if ours else None,
        "event_log_bytes_per_email": ours.figures.get("event_log_bytes_per_email")
        if ours
        else None,
        "cpu_s_per_1k": ours.figures.get("cpu_s_per_1k") if ours else None,
        "baseline_cpu_s_per_1k": best.figures.get("cpu_s_per_1k") if best else None,
        "ceiling_cpu_s_per_1k": ceiling.figures.get("cpu_s_per_1k") if ceiling else None,
        # Each with the sandbox's and PostgreSQL's CPU in the same window added.
        "machine_cpu_s_per_1k": machine_cpu_s_per_1k(ours.figures) if ours else None,
        "baseline_machine_cpu_s_per_1k": machine_cpu_s_per_1k(best.figures) if best else None,
        "ceiling_machine_cpu_s_per_1k": machine_cpu_s_per_1k(ceiling.figures) if ceiling else None,
        # The same three with each system's start-up and idle warm-up counted in.
        "cpu_s_per_1k_with_startup": ours.figures.get("cpu_s_per_1k_with_startup")
        if ours
        else None,
        "baseline_cpu_s_per_1k_with_startup": best.figures.get("cpu_s_per_1k_with_startup")
        if best
        else None,
        "ceiling_cpu_s_per_1k_with_startup": ceiling.figures.get("cpu_s_per_1k_with_startup")
        if ceiling
        else None,
        "storage_bytes_per_email": ours.figures.get("storage_bytes_per_email") if ours else None,
        "peak_rss_mb": ours.figures.get("peak_rss_mb") if ours else None,
        "dagster_in_flight": ours.figures.get("in_flight") if ours else None,
        "ceiling_in_flight": ceiling.figures.get("in_flight") if ceiling else None,
        "systems": {r.system: {"events": r.events, **r.figures} for r in results},
    }


def print_summary(summaries: list[dict[str, Any]]) -> None:
    """One line per setting: Dagster against the best Celery configuration and the ceiling."""
    header = (
        f"{'setting':<36} {'dagster/s':>9} {'best celery':>22} {'ceiling/s':>9} "
        f"{'x celery':>8} {'x ceiling':>9} {'cpu-s/1k d/c/ceil':>18} "
        f"{'machine d/c/ceil':>18} {'crit p50/p99 s':>14}"
    )
    print(header)
    print("-" * len(header))
    for s in summaries:
        best = (
            f"{_fmt(s['baseline_emails_per_s'])} ({s['baseline_config']})"
            if s["baseline_config"]
            else "-"
        )
        cpu = "/".join(
            _fmt(s[k], 2) for k in ("cpu_s_per_1k", "baseline_cpu_s_per_1k", "ceiling_cpu_s_per_1k")
        )
        machine = "/".join(
            _fmt(s.get(k), 2)
            for k in (
                "machine_cpu_s_per_1k",
                "baseline_machine_cpu_s_per_1k",
                "ceiling_machine_cpu_s_per_1k",
            )
        )
        crit = f"{_fmt(s['critical_p50_s'])}/{_fmt(s['critical_p99_s'])}"
        print(
            f"{_setting_label(s['provider_latency_ms'], s['provider_batch'], s['provider']):<36} "
            f"{_fmt(s['emails_per_s']):>9} {best:>22} {_fmt(s['ceiling_emails_per_s']):>9} "
            f"{_fmt(s['x_baseline'], 2):>8} {_fmt(s['x_ceiling'], 2):>9} {cpu:>18} "
            f"{machine:>18} {crit:>14}"
        )


def _run_setting(args: argparse.Namespace, settings: Settings, systems: list[str]) -> list[Result]:
    """Every system (every Celery configuration) at one setting, ``--repeats`` times."""
    by_system: dict[str, list[Result]] = {}
    label = _setting_label(settings.provider_latency_ms, settings.provider_batch, settings.provider)
    for repeat in range(args.repeats):
        for system in systems:
            if system in ("dagster", "dagster-batch"):
                runs = [
                    lambda system=system: run_dagster(
                        settings,
                        settings.events,
                        settings.batch_size,
                        system,
                        args.critical_per_s,
                        workers=system != "dagster-batch",
                    )
                ]
            elif system == "celery":
                runs = [
                    lambda config=config: run_celery(settings, config)
                    for config in _celery_configs(args, settings.provider_latency_ms)
                ]
            elif system == "ceiling":
                runs = [lambda: run_ceiling(settings)]
            else:
                raise SystemExit(f"unknown system {system!r}")
            for run in runs:
                result = run()
                print(
                    f"[{label}, repeat {repeat + 1}/{args.repeats}] {result.system}",
                    end="",
                    file=sys.stderr,
                )
                by_system.setdefault(result.system, []).append(result)
                f = result.figures
                print(
                    f": {f.get('emails_per_s', 0):.1f} emails/s, {f.get('cpu_s_per_1k', 0):.2f} "
                    f"CPU-s/1k, first sent after {f.get('first_sent_s') or 0:.1f}s, backlog "
                    f"published in {f.get('publish_s') or 0:.1f}s; CPU-s by process: "
                    + ", ".join(f"{k} {v}" for k, v in f.get("cpu_s_by_kind", {}).items()),
                    file=sys.stderr,
                    flush=True,
                )
    return [_median_result(rs) for rs in by_system.values()]


def _report(
    args: argparse.Namespace, systems: list[str], summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "date": date.today().isoformat(),
        "events": args.events,
        "parameters": {
            "critical_per_s": args.critical_per_s,
            "batch_size": args.batch_size,
            "concurrency": args.concurrency,
            "bulk_runs": args.bulk_runs,
            "ceiling_in_flight": args.ceiling_in_flight or args.bulk_runs * args.concurrency,
            "ceiling_client": args.ceiling_client,
            "lane_overrides": args.lanes,
            "provider": args.provider,
            "rate_limit_per_s": args.rate_limit or None,
            "celery_instant": args.celery_instant,
            "celery_latency": args.celery_latency,
            "systems": systems,
            "repeats": args.repeats,
            "dagster_storage": "postgresql",
            "app_database": "postgresql",
            "cpu_count": os.cpu_count(),
        },
        "settings": summaries,
    }


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def compare(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="bench_send_"))
    latencies = [float(v) for v in args.provider_latency_ms.split(",") if v.strip()]
    batches = [int(v) for v in args.provider_batch.split(",") if v.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    summaries: list[dict[str, Any]] = []
    all_results: list[Result] = []
    for latency_ms in latencies:
        for provider_batch in batches:
            settings = Settings(
                events=args.events,
                critical_per_s=args.critical_per_s,
                batch_size=args.batch_size,
                concurrency=args.concurrency,
                bulk_runs=args.bulk_runs,
                timeout_s=args.timeout_s,
                workdir=workdir,
                provider_batch=provider_batch,
                provider_latency_ms=latency_ms,
                ceiling_in_flight=args.ceiling_in_flight,
                ceiling_client=args.ceiling_client,
                lane_overrides=args.lanes,
                provider=args.provider,
                rate_limit_per_s=args.rate_limit,
            )
            results = _run_setting(args, settings, systems)
            summary = _summarize(latency_ms, provider_batch, args.provider, results)
            summaries.append(summary)
            all_results.extend(results)
            print(f"\n{_setting_label(latency_ms, provider_batch, args.provider)}")
            print_table(results, summary["baseline_emails_per_s"], summary["ceiling_emails_per_s"])
            print(flush=True)
            # After every setting, so a long matrix cut short keeps what it measured.
            _write(args.json, _report(args, systems, summaries))
    if args.per_event_events > 0:
        print("[once] dagster-per-event (bulk batch size 1)", file=sys.stderr, flush=True)
        settings = Settings(
            events=args.per_event_events,
            critical_per_s=0.0,
            batch_size=1,
            concurrency=args.concurrency,
            bulk_runs=args.bulk_runs,
            timeout_s=args.timeout_s,
            workdir=workdir,
            provider_batch=batches[0],
            provider_latency_ms=latencies[0],
        )
        # No critical trickle: one run per email saturates the run queue on its own.
        per_event = run_dagster(
            settings, args.per_event_events, 1, "dagster-per-event", 0.0, workers=False
        )
        all_results.append(per_event)
        print_table([per_event], None, None)
    print()
    print_summary(summaries)
    print(
        f"\n{args.events} bulk events + critical trickle at {args.critical_per_s}/s; bulk batch "
        f"{args.batch_size}; Dagster: {args.bulk_runs} bulk workers x {args.concurrency} calls in "
        f"flight; ceiling: {args.ceiling_in_flight or args.bulk_runs * args.concurrency} calls in "
        f"flight ({args.ceiling_client}); Celery: a task per email (one message a call) or per "
        f"batch; best Celery configuration of the sweep per setting; median of {args.repeats} "
        f"repeat(s). cpu-s/1k: each system's own processes; machine: plus the sandbox and "
        f"PostgreSQL in the same window (Redis and RabbitMQ not counted)."
    )
    report = _report(args, systems, summaries)
    if args.per_event_events > 0:
        report["dagster_per_event"] = {"events": per_event.events, **per_event.figures}
    _write(args.json, report)
    failed = [r.system for r in all_results if not r.figures.get("drained")]
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
    parser.add_argument(
        "--concurrency", type=int, default=32, help="provider calls in flight per bulk worker"
    )
    parser.add_argument(
        "--provider-batch",
        default="100",
        help="messages per sandbox call, a comma-separated list of settings (1: a call per "
        "message, how the real adapters send; hotpath and worker take one number)",
    )
    parser.add_argument(
        "--provider-latency-ms",
        default="0",
        help="how long the sandbox takes to answer each call, a comma-separated list of settings",
    )
    parser.add_argument(
        "--matrix",
        action="store_true",
        help="every setting of {0, 100 ms} x {one message a call, 100 a call}",
    )
    parser.add_argument(
        "--bulk-runs", type=int, default=2, help="bulk workers (batch runs: runs at once)"
    )
    parser.add_argument(
        "--ceiling-in-flight",
        type=int,
        help="calls the ceiling keeps in flight (default: the Dagster system's, bulk runs x "
        "concurrency)",
    )
    parser.add_argument(
        "--ceiling-client",
        choices=("loop", "threads"),
        default="loop",
        help="the ceiling's calls from tasks on one event loop (as the lane workers send) or "
        "from a thread each",
    )
    parser.add_argument(
        "--lanes",
        type=_lane_overrides,
        default={},
        help="lane settings laid over the bench's own for the Dagster system, as JSON: "
        '\'{"critical": {"batches_in_flight": 1}}\'',
    )
    parser.add_argument(
        "--celery-instant",
        default="prefork-2,prefork-4,prefork-8",
        help="Celery configurations swept against an instant sandbox (0 ms)",
    )
    parser.add_argument(
        "--celery-latency",
        default="gevent-100,gevent-300,gevent-2x150",
        help="Celery configurations swept against a sandbox with latency (gevent-2x150: two "
        "worker processes of 150 greenlets)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--systems", default="dagster,celery,ceiling", help="also: dagster-batch (workers: 0)"
    )
    parser.add_argument(
        "--per-event-events",
        type=int,
        default=0,
        help="events for the one-run-per-email mode, run once (e.g. 20; 0 skips it)",
    )
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="sandbox",
        help="the adapter every system sends through: the sandbox's API, or postmark-stub (the "
        "Postmark adapter against the sandbox speaking Postmark's /email and /email/batch)",
    )
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=0.0,
        help="the Dagster system's shared send rate, messages a second (0: none)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.matrix:
        args.provider_latency_ms, args.provider_batch = "0,100", "1,100"
    if args.mode != "compare":
        args.provider_batch = int(args.provider_batch.split(",")[0])
    # Tear down daemons, workers and databases on SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = {"compare": compare, "hotpath": hotpath, "worker": worker}
    return modes[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
