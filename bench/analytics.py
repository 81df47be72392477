"""Benchmark of the analytics warehouse: full build and incremental refresh, time and peak RSS.

``python -m bench.analytics --messages 100000`` (add ``--messages 1000000`` for 1M; several
``--messages`` run one after another). For each size it generates a history in a fresh SQLite
database (``--backend postgresql``: a fresh PostgreSQL database on ``BENCH_POSTGRES``; about
five provider events per message), runs a full refresh, then ``--rounds``
incremental refreshes of ``--increment`` new messages each (plus late opens for old messages,
mostly recent ones; ``--late-uniform`` spreads them over the whole history, the worst case),
and prints a table. The history is generated, and each refresh runs, in its own process so
each peak RSS is its own. ``--json FILE`` writes the results there after every step (a run
stopped part way keeps the sizes and steps it finished); ``--json`` alone prints them.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

from bench.generate import generate


def _peak_rss_mb() -> float:
    """This process's peak RSS since exec (VmHWM; ``ru_maxrss`` survives exec from a fat parent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _phase(database_url: str, warehouse_path: str, full: bool) -> None:
    from email_platform.warehouse import refresh

    started = time.perf_counter()
    summary = refresh(database_url, warehouse_path, full=full)
    print(
        json.dumps(
            {
                "seconds": time.perf_counter() - started,
                "timings": summary.timings_s,
                "loaded": summary.total_loaded,
                "read": sum(summary.rows_read.values()),
                "messages_rebuilt": summary.messages_rebuilt,
                "messages_folded": summary.messages_folded,
                # What the refresh counted (issue 42): daily rows rewritten, funnel rows read.
                "daily_rows_changed": summary.daily_rows_changed,
                "daily_rows_kept": summary.daily_rows_kept,
                "daily_rows_read": summary.daily_rows_read,
                "slices": summary.slices,
                "funnel_rows": summary.table_rows["email_funnel"],
                "events_rows": summary.table_rows["raw_email_events"],
                "peak_rss_mb": _peak_rss_mb(),
                "file_mb": Path(warehouse_path).stat().st_size / 2**20,
                "next_writer": summary.next_writer,
                "compacted": summary.compacted,
            }
        )
    )


def _generate_phase(database_url: str, messages: int, days: float, end: str) -> None:
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        elapsed = time.perf_counter() - started
        print(f"  generated {done:,}/{total:,} messages in {elapsed:.0f} s", file=sys.stderr)

    generated = generate(
        database_url, messages=messages, days=days, end=datetime.fromisoformat(end),
        chunk=GENERATE_CHUNK, progress=progress,
    )  # fmt: skip
    print(json.dumps({**asdict(generated), "peak_rss_mb": _peak_rss_mb()}))


# Messages made and written at a time: a few hundred MB of rows in flight.
GENERATE_CHUNK = 100_000


def _generate(database_url: str, messages: int, days: float, end: datetime) -> dict:
    """The history, made in a process of its own (its peak RSS is the generator's alone)."""
    output = subprocess.run(
        [sys.executable, "-m", "bench.analytics", "--phase", "generate",
         "--database-url", database_url, "--messages", str(messages), "--days", str(days),
         "--end", end.isoformat()],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout  # fmt: skip
    return json.loads(output.strip().splitlines()[-1])


def _measure(database_url: str, warehouse_path: str, full: bool) -> dict:
    # Flush what the generator just wrote first: on ext4 the refresh's checkpoint fsync would
    # otherwise wait for those pages too, and charge the generator's I/O to the refresh.
    os.sync()
    output = subprocess.run(
        [sys.executable, "-m", "bench.analytics", "--phase", "full" if full else "incremental",
         "--database-url", database_url, "--warehouse", warehouse_path],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(output.strip().splitlines()[-1])


PG_SERVER = os.environ.get("BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")


@contextmanager
def _database(backend: str, workdir: Path, messages: int) -> Iterator[str]:
    """A fresh application database: a SQLite file in ``workdir``, or a PostgreSQL database
    created on ``BENCH_POSTGRES`` and dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{workdir / f'history_{messages}.sqlite3'}"
        return
    server = make_url(PG_SERVER)
    name = f"bench_analytics_{os.getpid()}_{messages}"
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run(
    messages: int,
    increment: int,
    rounds: int,
    days: float,
    workdir: Path,
    backend: str = "sqlite",
    late_recency_days: float | None = 2.0,
    on_step: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """The steps for one size; ``on_step`` gets the steps so far after each. The history and
    the warehouse are deleted afterwards (at ten million messages they take tens of GB)."""
    with _database(backend, workdir, messages) as url:
        path = workdir / f"warehouse_{backend}_{messages}.duckdb"
        try:
            return _run(url, messages, increment, rounds, days, path, late_recency_days, on_step)
        finally:
            for leftover in workdir.glob(f"*_{messages}.*"):
                leftover.unlink()


def _run(
    url: str,
    messages: int,
    increment: int,
    rounds: int,
    days: float,
    path: Path,
    late_recency_days: float | None,
    on_step: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    results: list[dict] = []

    def record(step: dict) -> None:
        if "timings" in step:
            step["visible"] = step["timings"]["visible"]
        step["load_average"] = os.getloadavg()
        results.append(step)
        _progress(f"  {step['step']}: {step['seconds']:.1f} s")
        if on_step:
            on_step(results)

    ahead = _generated_ahead(url)
    if ahead:
        # Made earlier by --generate-only: time goes on from that history's end.
        now, generated = datetime.fromisoformat(ahead["end"]), ahead["generated"]
        _progress(f"{messages:,} messages: the history generated at {ahead['end']}")
    else:
        now = datetime.now(UTC)
        _progress(f"{messages:,} messages: generating")
        generated = _generate(url, messages, days, now)
    _analyze(url)
    record({"step": "generate (not timed work)", "seconds": generated["seconds"],
            "rows": generated["messages"] + generated["attempts"] + generated["provider_events"],
            "peak_rss_mb": generated["peak_rss_mb"], "generated_ahead": bool(ahead),
            "source_mb": _source_mb(url)})  # fmt: skip
    record({"step": f"full build {messages:,}", **_measure(url, str(path), True)})
    for round_ in range(rounds):
        end = now + timedelta(minutes=10 * (round_ + 1))
        generate(url, messages=increment, days=0.005, end=end, seed=100 + round_,
                 steady_state=True, late_recency_days=late_recency_days)  # fmt: skip
        _analyze(url)
        step = _measure(url, str(path), False)
        record({"step": f"incremental +{increment:,} #{round_ + 1}", **step})
    record({"step": "re-run, nothing new", **_measure(url, str(path), False)})
    return results


def generate_ahead(messages: int, days: float, workdir: Path) -> None:
    """Generate a SQLite history into ``workdir`` for a later run to use (and consume): the
    generation of ten million messages can then precede the code it measures."""
    url = f"sqlite:///{workdir / f'history_{messages}.sqlite3'}"
    end = datetime.now(UTC)
    generated = _generate(url, messages, days, end)
    record = {"end": end.isoformat(), "days": days, "generated": generated}
    _sidecar(url).write_text(json.dumps(record))


def _sidecar(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///") + ".generated.json")


def _generated_ahead(url: str) -> dict | None:
    """The record of a history generated ahead into this SQLite file, taken (renamed) so a
    second run does not take the same, no longer pristine, history."""
    if not url.startswith("sqlite:///") or not _sidecar(url).exists():
        return None
    taken = _sidecar(url).rename(_sidecar(url).with_suffix(".taken"))
    return json.loads(taken.read_text())


def _progress(line: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {line}", file=sys.stderr, flush=True)


def _source_mb(url: str) -> float | None:
    """The application database's size on disk (SQLite file; None for PostgreSQL)."""
    if not url.startswith("sqlite:///"):
        return None
    return Path(url.removeprefix("sqlite:///")).stat().st_size / 2**20


def summarize(messages: int, backend: str, results: list[dict]) -> dict:
    """One size's figures as the README's table gives them, over the steps (JSON-ready)."""
    steps = {r["step"]: r for r in results}
    generated = results[0]
    full = steps.get(f"full build {messages:,}")
    increments = [r for r in results if r["step"].startswith("incremental")]
    return {
        "messages": messages,
        "backend": backend,
        "generate_s": generated["seconds"],
        "generate_peak_rss_mb": generated.get("peak_rss_mb"),
        "full_build_visible_s": full["visible"] if full else None,
        "full_build_peak_rss_mb": full["peak_rss_mb"] if full else None,
        "increment_visible_s": [r["visible"] for r in increments],
        "increment_peak_rss_mb": [r["peak_rss_mb"] for r in increments],
        "file_mb": results[-1].get("file_mb"),
        "steps": results,
    }


def _analyze(url: str) -> None:
    """Give PostgreSQL the statistics autovacuum keeps on a live database. Right after a bulk
    load it has none, and plans the refresh's reads by change marker as sequential scans: a
    refresh with nothing new took 0.6 s instead of 0.32 s at 300k messages, 0.87 s at 1M.
    (SQLite's planner takes the marker indexes without statistics.)"""
    if not url.startswith("postgresql"):
        return
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("ANALYZE"))
    finally:
        engine.dispose()


def _print(title: str, results: list[dict]) -> None:
    print(f"\n== {title} ==")
    print(
        f"{'step':<28}{'visible':>9}{'extract':>9}{'build':>8}{'ckpt':>7}{'next':>7}{'total s':>9}"
        f"{'rows in':>10}{'us/row':>8}{'rebuilt':>9}{'RSS MB':>8}{'file MB':>9}"
    )
    for r in results:
        if "timings" not in r:
            print(f"{r['step']:<28}{'':>9}{'':>9}{'':>8}{'':>7}{'':>7}{r['seconds']:>9.2f}"
                  f"{r['rows']:>10,}{'':>8}{'':>9}{r.get('peak_rss_mb') or 0:>8.0f}"
                  f"{r.get('source_mb') or 0:>9.0f}  source database")  # fmt: skip
            continue
        t = r["timings"]
        per_row = t["visible"] / r["loaded"] * 1e6 if r["loaded"] else 0
        print(
            f"{r['step']:<28}{t['visible']:>9.2f}{t['extract_load']:>9.2f}{t['build']:>8.2f}"
            f"{t['checkpoint']:>7.2f}{t['prepare_next']:>7.2f}{t['total']:>9.2f}"
            f"{r['loaded']:>10,}{per_row:>8.1f}{r['messages_rebuilt']:>9,}"
            f"{r['peak_rss_mb']:>8.0f}{r['file_mb']:>9.0f}  {r.get('next_writer') or ''}"
            + (f", compacted in {t['compact']:.2f} s" if r.get("compacted") else "")
        )
    print(
        "visible: refresh start -> new snapshot published (what an analyst waits for); "
        "next: preparing the next refresh's writer file after publishing (patched: the replaced "
        "snapshot, only its differing blocks rewritten; copied: a whole copy; unchanged: "
        "nothing new, neither file touched); compacted: deleted rows compacted out of the next "
        "writer file after publishing; total: all of it."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, action="append")
    parser.add_argument("--increment", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--backend",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="application database to load from (postgresql: a fresh database on "
        "BENCH_POSTGRES, default postgresql+psycopg://postgres@127.0.0.1:5432)",
    )
    parser.add_argument(
        "--phase", choices=["full", "incremental", "generate"], help=argparse.SUPPRESS
    )
    parser.add_argument("--end", help=argparse.SUPPRESS)
    parser.add_argument(
        "--generate-only",
        action="store_true",
        help="only generate SQLite histories into --workdir; a later run with the same "
        "--workdir and --messages uses (and then deletes) them instead of generating",
    )
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    parser.add_argument("--warehouse", help=argparse.SUPPRESS)
    parser.add_argument(
        "--late-uniform",
        action="store_true",
        help="late opens hit messages uniformly over the whole history (worst case) instead "
        "of mostly recent ones (exponential age, mean 2 days)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the results as JSON to FILE after every step (alone: print them at the end)",
    )
    args = parser.parse_args(argv)
    if args.phase == "generate":
        _generate_phase(args.database_url, args.messages[0], args.days, args.end)
        return
    if args.phase:
        _phase(args.database_url, args.warehouse, args.phase == "full")
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_analytics_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.generate_only:
        for messages in args.messages:
            generate_ahead(messages, args.days, workdir)
        return
    sizes: list[dict] = []
    late = "uniform late events" if args.late_uniform else "recent late events"
    for messages in args.messages or [100_000]:
        recency = None if args.late_uniform else 2.0

        def save(steps: list[dict], messages: int = messages) -> None:
            if args.json and args.json != "-":
                _write_json(Path(args.json), [*sizes, summarize(messages, args.backend, steps)])

        results = run(
            messages, args.increment, args.rounds, args.days, workdir, args.backend, recency,
            on_step=save,
        )  # fmt: skip
        sizes.append(summarize(messages, args.backend, results))
        _print(f"{messages:,} messages, {args.backend}, {late}", results)
    if args.json == "-":
        print(json.dumps(sizes, default=str))


def _write_json(path: Path, sizes: list[dict]) -> None:
    """Replace ``path`` whole: a reader (or a killed run) never sees half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(sizes, indent=1, default=str) + "\n")
    partial.replace(path)


if __name__ == "__main__":
    main()
