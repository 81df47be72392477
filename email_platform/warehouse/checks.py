"""What the asset checks compute, on a read-only connection to the published snapshot.

One funnel row per message, provider events that match a message, no latency negative beyond
clock skew, open dead letters (and the runs that left them), and each day's bounce and
complaint rates under their ``Thresholds``, judged only where enough messages make a rate
mean something. Each check returns a ``CheckOutcome``; the Dagster asset checks turn it into
their result (a ``datetime`` becomes a timestamp, a ``Markdown`` string Markdown).
"""

from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY
from email_platform.warehouse.rates import RATES_BY_NAME


class Markdown(str):
    """Check metadata to show as Markdown (a plain ``str`` is shown as text)."""


@dataclass(frozen=True)
class CheckOutcome:
    """One asset check's verdict; ``severity`` is what a failure means ("ERROR" or "WARN").

    ``metadata`` holds plain values: numbers, strings, ``Markdown``, and aware ``datetime``s
    for timestamps."""

    name: str
    passed: bool
    severity: str
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    bounce_rate: float = 0.05
    complaint_rate: float = 0.003
    # A rate is judged only on a day x template x lane x provider whose denominator (accepted
    # messages for the bounce rate, delivered for the complaint rate) counts at least this
    # many: one complaint among 190 messages is 0.53%, which says nothing about a 0.3% limit.
    min_messages: int = 1000
    # The most recent days (ending at the newest day in the data) the rate checks look at.
    window_days: int = 7
    # Provider-side latencies compare two clocks; within this much below zero is skew.
    clock_skew_s: float = 2.0


LATENCY_COLUMNS = (
    "publish_delay_s",
    "queue_delay_s",
    "send_duration_s",
    "event_to_accepted_s",
    "delivery_delay_s",
    "time_to_open_s",
    "time_to_click_s",
    "time_to_bounce_s",
)


def check_one_row_per_message(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    rows, distinct, messages = connection.execute(
        f"SELECT count(*), count(DISTINCT message_id), "
        f"(SELECT count(*) FROM stg_sends) FROM {FUNNEL}"
    ).fetchone()
    missing = connection.execute(
        f"SELECT count(*) FROM stg_sends WHERE message_id NOT IN (SELECT message_id FROM {FUNNEL})"
    ).fetchone()[0]
    passed = rows == distinct == messages and missing == 0
    return CheckOutcome(
        "one_row_per_message",
        passed,
        "ERROR",
        "Every message has exactly one funnel row."
        if passed
        else f"{rows} funnel rows, {distinct} distinct messages, {messages} messages loaded, "
        f"{missing} messages without a row.",
        {
            "funnel_rows": rows,
            "distinct_messages": distinct,
            "messages": messages,
            "missing": missing,
        },
    )


def check_provider_events_joined(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    total, orphans = connection.execute(
        "SELECT count(*), count(*) FILTER (WHERE message_id IS NULL OR message_id NOT IN "
        "(SELECT message_id FROM stg_sends)) FROM stg_provider_events"
    ).fetchone()
    by_type = dict(
        connection.execute(
            "SELECT event_type, count(*) FROM stg_provider_events WHERE message_id IS NULL "
            "OR message_id NOT IN (SELECT message_id FROM stg_sends) GROUP BY 1 ORDER BY 2 DESC"
        ).fetchall()
    )
    return CheckOutcome(
        "provider_events_joined",
        orphans == 0,
        "WARN",
        f"{orphans} of {total} provider events match no message"
        + (f" ({', '.join(f'{k}: {v}' for k, v in by_type.items())})." if by_type else "."),
        {
            "provider_events": total,
            "orphans": orphans,
            "orphan_share": orphans / total if total else 0.0,
            **{f"orphans_{kind}": n for kind, n in by_type.items()},
        },
    )


def check_no_negative_latencies(
    connection: duckdb.DuckDBPyConnection, thresholds: Thresholds = Thresholds()
) -> CheckOutcome:
    counts = connection.execute(
        "SELECT "
        + ", ".join(f"count(*) FILTER (WHERE {c} < ?)" for c in LATENCY_COLUMNS)
        + f" FROM {FUNNEL}",
        [-thresholds.clock_skew_s] * len(LATENCY_COLUMNS),
    ).fetchone()
    negative = {name: n for name, n in zip(LATENCY_COLUMNS, counts, strict=True) if n}
    return CheckOutcome(
        "no_negative_latencies",
        not negative,
        "ERROR",
        "No latency is negative beyond clock skew."
        if not negative
        else "Negative latencies: " + ", ".join(f"{k}: {v} rows" for k, v in negative.items()),
        {"negative_rows": sum(negative.values()), "clock_skew_s": thresholds.clock_skew_s}
        | {f"negative_{name}": n for name, n in negative.items()},
    )


# How many of the runs holding open dead letters the check's metadata lists.
TOP_RUNS = 20


def check_open_dead_letters(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    by_reason = dict(
        connection.execute(
            "SELECT reason, count(*) FROM stg_dead_letters WHERE status = 'open' "
            "GROUP BY 1 ORDER BY 2 DESC, 1"
        ).fetchall()
    )
    by_run = connection.execute(
        "SELECT run_id, count(*), min(created_at) FROM stg_dead_letters WHERE status = 'open' "
        "GROUP BY 1 ORDER BY 2 DESC, 3, 1"
    ).fetchall()
    oldest = connection.execute(
        "SELECT min(created_at) FROM stg_dead_letters WHERE status = 'open'"
    ).fetchone()[0]
    total = sum(by_reason.values())
    metadata: dict[str, Any] = {"open_dead_letters": total, "runs_with_open": len(by_run)}
    metadata |= {f"open_{reason}": n for reason, n in by_reason.items()}
    if oldest:
        metadata["oldest_open_at"] = oldest.replace(tzinfo=UTC)
    if by_run:
        metadata["runs_with_open_dead_letters"] = _runs_table(by_run)
    if not total:
        description = "No open dead letters."
    else:
        runs = ", ".join(f"{run or '(no run)'} ({n})" for run, n, _ in by_run[:3])
        description = (
            f"{total} open dead letters: "
            + ", ".join(f"{k}: {v}" for k, v in by_reason.items())
            + f". Left by {len(by_run)} run(s), most by {runs}"
            + (" ..." if len(by_run) > 3 else "")
            + " (runs_with_open_dead_letters lists them). Re-execute those runs from failure in "
            "the UI, or replay with `email-platform dlq replay` (by id, --event, --reason or "
            "--all): both resend each with its original idempotency key. `email-platform dlq "
            "discard` closes them without sending."
        )
    return CheckOutcome("open_dead_letters", total == 0, "WARN", description, metadata)


def _runs_table(by_run: list[tuple[str | None, int, Any]]) -> Markdown:
    """The runs holding the most open dead letters, each linked to its page in the Dagster UI."""
    lines = ["| run | open dead letters | oldest |", "|---|---:|---|"]
    for run, count, oldest in by_run[:TOP_RUNS]:
        name = f"[`{run}`](/runs/{run})" if run else "(no run)"
        lines.append(f"| {name} | {count:,} | {oldest:%Y-%m-%d %H:%M:%S} UTC |")
    if len(by_run) > TOP_RUNS:
        rest = sum(count for _, count, _ in by_run[TOP_RUNS:])
        lines.append(f"| {len(by_run) - TOP_RUNS} more runs | {rest:,} | |")
    return Markdown("\n".join(lines))


def check_daily_rate(
    connection: duckdb.DuckDBPyConnection,
    rate: str,
    threshold: float,
    thresholds: Thresholds = Thresholds(),
) -> CheckOutcome:
    """``rate`` (bounce_rate or complaint_rate) of each recent daily row against ``threshold``,
    judged only on rows whose denominator counts at least ``thresholds.min_messages``."""
    if rate not in ("bounce_rate", "complaint_rate"):
        raise ValueError(f"not a checked rate: {rate}")
    volume = RATES_BY_NAME[rate].denominator
    rows = connection.execute(
        f"""
        SELECT day, template, lane, provider, {volume}, {rate}
        FROM {FUNNEL_DAILY}
        WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - ?::INTEGER
        ORDER BY {rate} DESC NULLS LAST, day DESC
        """,
        [thresholds.window_days],
    ).fetchall()
    minimum = thresholds.min_messages
    judged = [r for r in rows if r[4] >= minimum]
    breaches = [r for r in judged if r[5] is not None and r[5] > threshold]
    worst = max((r[5] for r in judged if r[5] is not None), default=None)
    largest = max((r[4] for r in rows), default=0)
    label = rate.replace("_", " ")
    grain = "day x template x lane x provider"
    if breaches:
        day, template, lane, provider, n, value = breaches[0]
        description = (
            f"{len(breaches)} daily rows over the {label} threshold {threshold:.2%}; worst "
            f"{value:.2%} on {day} for {template}/{lane}/{provider} ({n:,} {volume})."
        )
    elif not judged:
        description = (
            f"No {grain} in the last {thresholds.window_days} days has at least {minimum:,} "
            f"{volume} messages (the most is {largest:,}); the {label} is not judged on so few."
        )
    else:
        description = (
            f"Every {grain} with at least {minimum:,} {volume} messages in the last "
            f"{thresholds.window_days} days is under {threshold:.2%}"
            + (
                f" ({len(rows) - len(judged)} smaller ones not judged)."
                if len(judged) < len(rows)
                else "."
            )
        )
    metadata: dict[str, Any] = {
        "threshold": threshold,
        "rate_definition": RATES_BY_NAME[rate].definition,
        "min_messages": minimum,
        "window_days": thresholds.window_days,
        "rows_in_window": len(rows),
        "rows_checked": len(judged),
        "rows_not_judged": len(rows) - len(judged),
        "rows_breaching": len(breaches),
        f"largest_{volume}": largest,
    }
    if worst is not None:
        metadata[f"worst_{rate}"] = worst
    return CheckOutcome(f"{rate}_under_threshold", not breaches, "ERROR", description, metadata)
