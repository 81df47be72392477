"""What a lane worker spends encoding, per email: its per-message log lines and the JSON
documents its batch inserts travel in.

``python -m bench.encoding`` (``--rows``, ``--repeats``). Both are measured in this process's
CPU time, best of ``--repeats``, each against the alternative at its best:

- **log lines**: ``BoundLogger.info_each`` writing a group of 100 acceptance lines to a JSON
  handler on a file, as in a run process (formatted in place, whole lines of at most
  ``PIPE_BUF`` bytes a write), against the same call made to go through logging's per-record
  path (a filter on the logger, as any handler or filter of someone else's on the way does: a
  record, a format and a flush per line);
- **batch rows**: ``store.bulk._as_json`` (orjson, after its look at the float and datetime
  columns) on ``--rows`` message rows, against the standard library's ``json.dumps`` with the
  options it replaced (datetimes through a ``default`` function, ``ensure_ascii=False``,
  ``allow_nan=False``).
"""

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime

from email_platform.db.schema import email_messages
from email_platform.observability import logs
from email_platform.store import bulk

_ACCEPTED = {
    "event_id": "01M97087E2VM7SS9H3QE4352X6",
    "idempotency_key": "01M97087E2VM7SS9H3QE4352X6:weekly_digest",
    "provider_message_id": "sbx_eb06f9fd4921f14d0752b2d5",
    "provider": "sandbox",
    "run_id": "0f3c2a9e-1b2c-4d5e-8f90-123456789abc",
    "attempt_no": 1,
    "http_status": 200,
}


def _best_us(work: Callable[[], None], items: int, repeats: int) -> float:
    """The least CPU time of ``repeats`` runs of ``work``, in microseconds per item."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best / items * 1e6


def log_lines(repeats: int, groups: int = 200) -> tuple[float, float]:
    """(grouped, per record): microseconds of CPU per acceptance line."""
    logger = logging.getLogger("email_platform.bench.encoding")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    with open(os.devnull, "w") as sink:
        logger.handlers = [logs.json_handler(sink)]
        log = logs.bind(logger, lane="bulk", provider="sandbox")
        rows = [{**_ACCEPTED, "message_id": n} for n in range(100)]

        def write() -> None:
            for _ in range(groups):
                log.info_each("accepted by the provider", rows)

        grouped = _best_us(write, groups * len(rows), repeats)
        logger.addFilter(lambda _record: True)
        per_record = _best_us(write, groups * len(rows), repeats)
        logger.handlers, logger.filters = [], []
    return grouped, per_record


def batch_rows(rows: int, repeats: int, calls: int = 20) -> tuple[float, float]:
    """(orjson, json.dumps): microseconds of CPU per message row of a batch insert."""
    now = datetime.now(UTC)
    batch = [
        {
            "event_id": "01M97087E2VM7SS9H3QE4352X6",
            "route": "weekly_digest",
            "template": "weekly_digest",
            "template_version": 3,
            "lane": "bulk",
            "recipient": f"user{n}@example.com",
            "recipient_domain": "example.com",
            "idempotency_key": "01M97087E2VM7SS9H3QE4352X6:weekly_digest",
            "status": "pending",
            "attempts": 0,
            "created_at": now,
            "updated_at": now,
            "expires_at": now,
            "locale": "en",
        }
        for n in range(rows)
    ]
    types = {name: email_messages.c[name].type for name in batch[0]}
    assert json.loads(bulk._as_json(batch, types) or "null") == json.loads(_stdlib(batch))

    def ours() -> None:
        for _ in range(calls):
            bulk._as_json(batch, types)

    def stdlib() -> None:
        for _ in range(calls):
            _stdlib(batch)

    return _best_us(ours, calls * rows, repeats), _best_us(stdlib, calls * rows, repeats)


def _stdlib(rows: list[dict]) -> str:
    return json.dumps(
        rows, default=lambda value: value.isoformat(), ensure_ascii=False, allow_nan=False
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000, help="rows in one batch insert")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    grouped, per_record = log_lines(args.repeats)
    print(
        f"log lines: {grouped:.1f} us CPU a line written per group, {per_record:.1f} us through "
        f"logging's per-record path ({per_record / grouped:.1f}x)"
    )
    ours, stdlib = batch_rows(args.rows, args.repeats)
    print(
        f"batch rows: {ours:.1f} us CPU a row with orjson, {stdlib:.1f} us with json.dumps "
        f"({stdlib / ours:.1f}x), {args.rows} rows a batch"
    )


if __name__ == "__main__":
    main()
