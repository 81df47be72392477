"""What the asset checks compute, on a read-only connection to the published snapshot.

One funnel row per message, provider events that match a message, no latency negative beyond
clock skew, open dead letters, and each day's bounce and complaint rates under their
``Thresholds``. Each check returns a ``CheckOutcome``; the Dagster asset checks turn it into
their result.
"""

from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY


@dataclass(frozen=True)
class CheckOutcome:
    """One asset check's verdict; ``severity`` is what a failure means ("ERROR" or "WARN")."""

    name: str
    passed: bool
    severity: str
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    bounce_rate: float = 0.05
    complaint_rate: float = 0.003
    # Rows with fewer accepted messages than this are too small to judge a rate by.
    min_accepted: int = 50
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


def check_open_dead_letters(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    by_reason = dict(
        connection.execute(
            "SELECT reason, count(*) FROM stg_dead_letters WHERE status = 'open' "
            "GROUP BY 1 ORDER BY 2 DESC, 1"
        ).fetchall()
    )
    oldest = connection.execute(
        "SELECT min(created_at) FROM stg_dead_letters WHERE status = 'open'"
    ).fetchone()[0]
    total = sum(by_reason.values())
    return CheckOutcome(
        "open_dead_letters",
        total == 0,
        "WARN",
        "No open dead letters."
        if not total
        else f"{total} open dead letters: "
        + ", ".join(f"{k}: {v}" for k, v in by_reason.items())
        + ". Replay or discard them with `email-platform dlq`.",
        {"open_dead_letters": total}
        | {f"open_{reason}": n for reason, n in by_reason.items()}
        | ({"oldest_open_at": oldest.replace(tzinfo=UTC).timestamp()} if oldest else {}),
    )


def check_daily_rate(
    connection: duckdb.DuckDBPyConnection,
    rate: str,
    threshold: float,
    thresholds: Thresholds = Thresholds(),
) -> CheckOutcome:
    """``rate`` (bounce_rate or complaint_rate) of each recent daily row against ``threshold``."""
    if rate not in ("bounce_rate", "complaint_rate"):
        raise ValueError(f"not a checked rate: {rate}")
    volume = "accepted"
    rows = connection.execute(
        f"""
        SELECT day, template, lane, provider, {volume}, {rate}
        FROM {FUNNEL_DAILY}
        WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - ?::INTEGER
          AND {volume} >= ?
        ORDER BY {rate} DESC NULLS LAST, day DESC
        """,
        [thresholds.window_days, thresholds.min_accepted],
    ).fetchall()
    breaches = [r for r in rows if r[5] is not None and r[5] > threshold]
    worst = max((r[5] for r in rows if r[5] is not None), default=None)
    label = rate.replace("_", " ")
    if breaches:
        day, template, lane, provider, n, value = breaches[0]
        description = (
            f"{len(breaches)} daily rows over the {label} threshold {threshold:.2%}; worst "
            f"{value:.2%} on {day} for {template}/{lane}/{provider} ({n} accepted)."
        )
    else:
        description = (
            f"Every day x template x lane x provider with at least {thresholds.min_accepted} "
            f"accepted in the last {thresholds.window_days} days is under {threshold:.2%}."
        )
    return CheckOutcome(
        f"{rate}_under_threshold",
        not breaches,
        "ERROR",
        description,
        {
            "threshold": threshold,
            f"worst_{rate}": worst if worst is not None else 0.0,
            "rows_checked": len(rows),
            "rows_breaching": len(breaches),
        },
    )
