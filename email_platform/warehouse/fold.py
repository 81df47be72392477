"""Folding what a refresh loaded into the funnel rows it changes, instead of rebuilding them.

Most old messages a refresh reaches only got late provider events (opens, clicks) and a new
version of their message row (the delivery status those events raised). Rebuilding their funnel
rows means reading every raw row of each (outbox row, attempts, every provider event), and as
they are spread over the ~11 days late events reach, the reads cover those days' row groups
of every raw table. Their old funnel rows already hold what the unchanged raw rows give, so
the new row is the old one merged with the model run over only the loaded rows, by the
model's own rules: each step's first time is the earliest of both, counts add up, a hard
bounce wins; the message's own columns come from its current row; the latencies are worked
out again from the merged times.

A message is folded only when all its loaded rows are of those two kinds (``foldable``) and it
has a funnel row. Anything else (an outbox, attempt or dead-letter row; a provider event that
replaced or removed a loaded one; a message whose event changed) is rebuilt from its raw rows,
as before.

The daily table follows: a day its refresh reached only through folded rows that kept their
group and ``accepted_at`` (``steady``) has the same values of ``event_to_accepted_s`` in each
group, so its daily rows keep their two percentiles of it and the model re-aggregates the rest
without reading that column (its percentiles were most of the re-aggregation's cost). Any
other day is re-aggregated whole.

The rules mirror ``analytics/email_funnel.sql`` and ``email_funnel_daily.sql`` as they are
(``FOLDED_MODELS``): with an edited model nothing is folded and every day is re-aggregated
whole, until the rules here are checked against it again.
"""

import hashlib
from collections.abc import Mapping

import duckdb

from email_platform.warehouse.views import main_table, shadowed, temp_views

# Temp tables: the funnel rows to fold, as keys (ids, row ids, daily group) before the fold;
# each folded message's old and new day and whether it was steady, after it.
OLD = "_folded_old"
FOLDED = "_folded"

# sha256 (first 16 hex digits) of analytics/email_funnel.sql and email_funnel_daily.sql, as
# the rules here mirror them (``mirrors``).
FOLDED_MODELS = "590d742e2fd32fda"
# The daily columns a day whose folded rows are all steady keeps (see ``_STEADY``), and the
# one funnel column they are computed from.
KEPT_DAILY = ("event_to_accepted_p50_s", "event_to_accepted_p95_s")
KEPT_DAILY_FROM = "event_to_accepted_s"

# The funnel's columns, by the rule that merges them.
# The message's own (stg_sends), from its current row.
FROM_MESSAGE = (
    "message_id", "event_id", "route", "template", "template_version", "lane", "provider",
    "recipient_domain", "day", "created_at", "accepted_at", "final_status", "delivery_status",
    "attempts", "locale",
)  # fmt: skip
# The outbox's, the attempts' and the dead letters' (nothing of theirs was loaded).
KEPT = (
    "event_type", "event_version", "event_occurred_at", "published_at", "first_attempt_at",
    "dead_lettered_at", "dead_letter_reason", "dead_letter_status", "trace_id",
    "correlation_id", "producer",
)  # fmt: skip
# Each provider step's first occurrence, and its count.
FIRSTS = (
    "delivered_at", "first_open_at", "first_click_at", "bounced_at", "complained_at",
    "unsubscribed_at", "first_machine_open_at",
)  # fmt: skip
COUNTS = ("open_count", "machine_open_count", "click_count")
# latency column: (later step, earlier step), in seconds.
LATENCIES = {
    "publish_delay_s": ("published_at", "event_occurred_at"),
    "queue_delay_s": ("first_attempt_at", "published_at"),
    "send_duration_s": ("accepted_at", "first_attempt_at"),
    "event_to_accepted_s": ("accepted_at", "event_occurred_at"),
    "delivery_delay_s": ("delivered_at", "accepted_at"),
    "time_to_open_s": ("first_open_at", "accepted_at"),
    "time_to_click_s": ("first_click_at", "accepted_at"),
    "time_to_bounce_s": ("bounced_at", "accepted_at"),
}
# The old row's columns a merge reads; the latencies are worked out again.
_MERGED_FROM_OLD = (*FROM_MESSAGE, *KEPT, *FIRSTS, *COUNTS, "bounce_type")
COLUMNS = (*_MERGED_FROM_OLD, *LATENCIES)

# The daily table's group. A folded row is steady when it stays in its group with the same
# accepted_at: the group's values of event_to_accepted_s (accepted_at less the event's time,
# which a fold keeps) are then the same.
_GROUP = ("day", "template", "lane", "provider")
_STEADY = " AND ".join(
    f"n.{name} IS NOT DISTINCT FROM o.{name}" for name in (*_GROUP, "accepted_at")
)
# The old row's columns ``OLD`` notes (``take_old_rows``).
_NOTED = ("message_id", "event_id", *_GROUP, "accepted_at")
# The raw tables whose loaded rows never fold: what they give is only in the old funnel rows.
_UNLOADED = ("raw_email_outbox", "raw_email_attempts", "raw_dead_letters")


def models_digest(funnel_sql: str, daily_sql: str) -> str:
    return hashlib.sha256((funnel_sql + daily_sql).encode()).hexdigest()[:16]


def mirrors(funnel_sql: str, daily_sql: str) -> bool:
    """Whether the rules here were checked against these models (else nothing is folded)."""
    return models_digest(funnel_sql, daily_sql) == FOLDED_MODELS


def foldable(raw_table: str, *, removed: bool) -> bool:
    """Whether the load's rows of ``raw_table`` leave their messages' funnel rows foldable:
    rows written to the messages or the provider events (a new version of a message row,
    provider events added), or a message row's old version removed. A provider event's removed
    version (deleted at the source, or replaced by one that may belong to another message)
    takes a step or a count away, which no merge undoes: its message is rebuilt."""
    if removed:
        return raw_table == "raw_email_messages"
    return raw_table in ("raw_email_messages", "raw_email_events")


def take_old_rows(
    connection: duckdb.DuckDBPyConnection,
    funnel: str,
    affected: str,
    loaded: Mapping[str, str],
    enabled: bool,
) -> int:
    """Note, in ``OLD``, the funnel rows of the messages the load left foldable (every row of
    theirs it loaded was ``foldable``): their ids, row ids and what ``steady`` compares; return
    how many: none unless ``enabled`` (the models are the ones the rules mirror). ``loaded``
    names, per raw table, the rows the load wrote."""
    if not enabled:
        connection.execute(f"CREATE OR REPLACE TEMP TABLE {OLD} (message_id BIGINT)")
        return 0
    # Narrow: a wide temp table costs more to write than the old rows' columns cost to read
    # again by row id when they are merged.
    connection.execute(
        f"CREATE OR REPLACE TEMP TABLE {OLD} AS SELECT rowid AS _row, {', '.join(_NOTED)} "
        f"FROM {funnel} WHERE message_id IN "
        f"(SELECT message_id FROM {affected} GROUP BY message_id HAVING bool_and(foldable))"
    )
    if "raw_email_messages" in loaded:
        # A message row now naming another event: its event's columns are not the old ones.
        connection.execute(
            f"DELETE FROM {OLD} AS o USING {loaded['raw_email_messages']} AS m "
            "WHERE m.message_id = o.message_id AND m.event_id IS DISTINCT FROM o.event_id"
        )
    return connection.execute(f"SELECT count(*) FROM {OLD}").fetchone()[0]


def insert_folded(
    connection: duckdb.DuckDBPyConnection,
    funnel: str,
    model: str,
    loaded: Mapping[str, str],
) -> int:
    """Replace the funnel rows of the messages in ``OLD`` with their folded rows: the model
    over only the loaded rows, merged with the old rows; return how many old rows went. Then
    note, in ``FOLDED``, each message's old and new day and whether it was ``steady``."""
    # The old rows: the columns ``OLD`` noted from it, the others read by row id. (The noted
    # ones, the event id above all, were most of what reading the old rows' strings cost.)
    # When the key's range is under about a million, DuckDB answers an inner join on one
    # integer key with a "perfect" hash table, a slot per id in the range for every column it
    # carries: that allocation was most of the merge's time (bench/README.md). So the rows
    # read by row id join their keys on two columns, id and row id: an inner join still, so
    # DuckDB can push a bloom filter of the ids into the scan (the semi join on row ids
    # narrows it to their range). The model's rows join the old ones with a left join below
    # for the same reason.
    read = ", ".join(name for name in _MERGED_FROM_OLD if name not in _NOTED)
    old_rows = (
        f"(SELECT {', '.join(f'k.{name}' for name in _NOTED)}, r.* EXCLUDE (_id, _r) FROM "
        f"(SELECT rowid AS _r, message_id AS _id, {read} FROM {main_table(connection, funnel)} "
        f"WHERE rowid IN (SELECT _row FROM {OLD})) AS r "
        f"JOIN {OLD} AS k ON r._id = k.message_id AND r._r = k._row)"
    )
    mine = f"message_id IN (SELECT message_id FROM {OLD})"
    # No rows from the tables nothing foldable was loaded into; the loaded rows of the others.
    empty = dict.fromkeys(_UNLOADED, "false")
    views = {}
    for table in ("raw_email_messages", "raw_email_events"):
        if table in loaded:
            views[table] = f"SELECT * FROM {loaded[table]} WHERE {mine}"
        else:
            empty[table] = "false"
    # Every folded message drives one row of the model: from its loaded message row (through
    # stg_sends, which leaves out a message now marked a test send), else from its id alone;
    # its own columns then come from its old row. (A message row always names its event, so
    # a row without event_id is one of those: the model's provider steps need only the id.)
    views["stg_sends"] = (
        f"SELECT * FROM {main_table(connection, 'stg_sends')} UNION ALL BY NAME "
        f"SELECT message_id FROM {OLD} "
        "WHERE message_id NOT IN (SELECT message_id FROM temp.main.raw_email_messages)"
    )
    merged = [
        f"CASE WHEN f.event_id IS NULL THEN o.{name} ELSE f.{name} END AS {name}"
        for name in FROM_MESSAGE
    ]
    merged += [f"o.{name}" for name in KEPT]
    merged += [f"least(o.{name}, f.{name}) AS {name}" for name in FIRSTS]
    merged += [f"o.{name} + f.{name} AS {name}" for name in COUNTS]
    # One hard bounce makes the message hard-bounced, whatever order they came in.
    merged.append(
        "CASE WHEN 'hard' IN (o.bounce_type, f.bounce_type) THEN 'hard' "
        "ELSE coalesce(o.bounce_type, f.bounce_type) END AS bounce_type"
    )
    latencies = ", ".join(
        f"(epoch_ms({later}) - epoch_ms({earlier})) / 1000.0 AS {name}"
        for name, (later, earlier) in LATENCIES.items()
    )
    # Inserted before the old rows go, so the merge reads them where they are. (Rows written
    # in the transaction have row ids of their own: the delete by row id spares them.)
    # (Each row of the model has its old row: the model is driven by OLD's messages.)
    with shadowed(connection, empty), temp_views(connection, views):
        connection.execute(
            f"INSERT INTO {funnel} BY NAME SELECT *, {latencies} FROM (SELECT "
            + ", ".join(merged)
            + f" FROM (\n{model}\n) AS f LEFT JOIN {old_rows} AS o USING (message_id))"
        )
    deleted = connection.execute(
        f"DELETE FROM {funnel} WHERE rowid IN (SELECT _row FROM {OLD})"
    ).fetchone()[0]
    connection.execute(
        f"CREATE OR REPLACE TEMP TABLE {FOLDED} AS SELECT o.message_id, o.day AS _old_day, "
        f"n.day, coalesce({_STEADY}, false) AS steady FROM {OLD} AS o LEFT JOIN "
        f"(SELECT message_id, {', '.join(_GROUP)}, accepted_at FROM {funnel} WHERE {mine}) "
        "AS n USING (message_id)"
    )
    return deleted


def folded_days() -> str:
    """The days of the folded rows (old and new), each with whether its rows were steady; a
    folded message whose row went (now a test send) was not."""
    return (
        f"SELECT _old_day AS day, steady FROM {FOLDED} "
        f"UNION ALL SELECT day, steady FROM {FOLDED} WHERE day IS NOT NULL"
    )


# The daily rows' percentiles kept for the steady days (a temp table).
_KEPT = "_kept_daily"


def keep_daily(connection: duckdb.DuckDBPyConnection, daily: str, steady: str) -> int:
    """Keep the ``KEPT_DAILY`` columns of the steady days' daily rows, before they are deleted;
    return how many rows."""
    connection.execute(
        f"CREATE OR REPLACE TEMP TABLE {_KEPT} AS SELECT {', '.join((*_GROUP, *KEPT_DAILY))} "
        f"FROM {daily} WHERE {steady}"
    )
    return connection.execute(f"SELECT count(*) FROM {_KEPT}").fetchone()[0]


def insert_steady_daily(
    connection: duckdb.DuckDBPyConnection, funnel: str, daily: str, daily_model: str, steady: str
) -> int:
    """The steady days' daily rows: the model over their funnel rows, less the column the kept
    percentiles come from (reading and sorting it is most of the re-aggregation), with the
    kept percentiles. A steady day has the same groups as before, each with the same values
    of that column."""
    view = (
        f"SELECT * REPLACE (CAST(NULL AS DOUBLE) AS {KEPT_DAILY_FROM}) "
        f"FROM {main_table(connection, funnel)} WHERE {steady}"
    )
    same_group = " AND ".join(f"k.{name} IS NOT DISTINCT FROM n.{name}" for name in _GROUP)
    kept = ", ".join(f"k.{name} AS {name}" for name in KEPT_DAILY)
    with temp_views(connection, {funnel: view}):
        return connection.execute(
            f"INSERT INTO {daily} BY NAME SELECT n.* REPLACE ({kept}) FROM (\n{daily_model}\n) "
            f"AS n JOIN {_KEPT} AS k ON {same_group} ORDER BY ALL"
        ).fetchone()[0]
