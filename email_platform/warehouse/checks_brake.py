"""The brake's counts over the warehouse: what ``store.lane_pauses.rates_since`` counts over
the operational tables, counted from ``email_funnel`` (one row per message, every step its
first occurrence), so the ``bulk_brake`` check and the brake sensor judge the same cohort."""

from datetime import UTC, datetime

import duckdb

from email_platform.store.lane_pauses import LaneRates
from email_platform.warehouse.build import FUNNEL


def funnel_rates(
    connection: duckdb.DuckDBPyConnection, lane: str, since: datetime, now: datetime
) -> LaneRates:
    """Of ``lane``'s messages accepted in ``[since, now]``: how many, and how many of those
    were delivered, hard-bounced or complained about (the counts email_funnel_daily sums)."""
    accepted, delivered, hard, complained = connection.execute(
        f"""
        SELECT count(*), count(delivered_at), count(*) FILTER (WHERE bounce_type = 'hard'),
               count(complained_at)
        FROM {FUNNEL}
        WHERE lane = ? AND accepted_at >= ? AND accepted_at <= ?
        """,
        # The warehouse keeps UTC as naive timestamps.
        [lane, _naive_utc(since), _naive_utc(now)],
    ).fetchone()
    return LaneRates(
        accepted=accepted, hard_bounced=hard, complained=complained, delivered=delivered
    )


def _naive_utc(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment
