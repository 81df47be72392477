"""``email_funnel_daily`` kept up to date by deltas: the work follows the changed funnel rows,
not the days they fall on.

A daily row's counts are sums over its messages, so a refresh adds the new versions' counts of
the funnel rows it rebuilt and subtracts their old versions' counts; the rates are then
recomputed from the merged counts by the model's own final SELECT. Only the latency
percentiles (medians, p95) are not sums: a group's are recomputed, from its rows' latency
columns alone, only when one of its rows' latencies changed (a new accepted message, a first
human open), and kept as they are otherwise.

The model SQL stays the one definition: ``analytics/email_funnel_daily.sql`` is one
``WITH counts AS (...)`` CTE over ``email_funnel`` and a final SELECT of the rates over
``counts``, split at ``RATES_MARKER``. Both parts run unchanged here, over temp views that
shadow ``email_funnel`` with the old or new versions of the rebuilt rows (``build.shadowed``'s
mechanism) or over the merged counts.
"""

import re
from dataclasses import dataclass

import duckdb

# The input column of each percentile of the daily model: a group's percentiles change only
# when one of these changes for one of its messages. A percentile the model gains that is not
# listed here makes every changed group recompute its percentiles (correct, slower).
LATENCY_INPUTS = {
    "event_to_accepted_p50_s": "event_to_accepted_s",
    "event_to_accepted_p95_s": "event_to_accepted_s",
    "time_to_open_p50_s": "time_to_open_s",
}
KEYS = ("day", "template", "lane", "provider")
RATES_MARKER = "-- rates over counts"


@dataclass
class DailyDelta:
    """What one delta update of the daily table did (counted, for tests and the benchmark)."""

    # Daily rows (day x template x lane x provider) whose counts changed, and their days.
    rows_changed: int = 0
    days_changed: int = 0
    # Groups whose percentiles were recomputed, and the funnel rows read to recompute them.
    latency_groups: int = 0
    latency_rows_read: int = 0
    # Rows deleted from the daily table to write the changed ones.
    rows_deleted: int = 0


def split_model(sql: str) -> tuple[str, str]:
    """The daily model's ``WITH counts AS (...)`` part and its final SELECT over ``counts``."""
    head, marker, tail = sql.partition(RATES_MARKER)
    if not marker:
        raise ValueError(f"email_funnel_daily.sql has no {RATES_MARKER!r} line before its rates")
    return head, tail.split("\n", 1)[1]


def daily_columns(connection: duckdb.DuckDBPyConnection, model_sql: str, funnel: str) -> str:
    """The funnel columns the daily model can read: every column whose name appears in its
    SQL (comments included: a superset is harmless; a missing one fails to bind, loudly),
    and the message id the delta matches versions by."""
    words = set(re.findall(r"[a-z_][a-z0-9_]*", model_sql.lower())) | {"message_id"}
    columns = [row[0] for row in connection.execute(f"DESCRIBE {funnel}").fetchall()]
    return ", ".join(name for name in columns if name in words)


def _day_list(connection: duckdb.DuckDBPyConnection, query: str) -> str:
    """The days ``query`` returns, as a list of DATE literals ("" when none)."""
    days = sorted(row[0] for row in connection.execute(query).fetchall())
    return ", ".join(f"DATE '{day}'" for day in days)


def _match(left: str, right: str) -> str:
    return " AND ".join(f"{left}.{k} IS NOT DISTINCT FROM {right}.{k}" for k in KEYS)


def _over(connection: duckdb.DuckDBPyConnection, funnel: str, relation: str, sql: str) -> None:
    """Run ``sql`` with ``funnel`` shadowed by a temp view over ``relation``."""
    connection.execute(f"CREATE OR REPLACE TEMP VIEW {funnel} AS {relation}")
    try:
        connection.execute(sql)
    finally:
        connection.execute(f"DROP VIEW IF EXISTS temp.main.{funnel}")


def apply_delta(
    connection: duckdb.DuckDBPyConnection,
    model_sql: str,
    funnel: str,
    daily: str,
    old_rows: str,
    new_rows: str,
) -> DailyDelta:
    """Update ``daily`` for funnel rows replaced from ``old_rows`` (temp table: their versions
    before the rebuild) to ``new_rows`` (their versions after it)."""
    head, tail = split_model(model_sql)
    database = connection.execute("SELECT current_database()").fetchone()[0]
    stored = f'"{database}".main.{funnel}'
    delta = DailyDelta()
    for name, rows in (("_daily_old", old_rows), ("_daily_new", new_rows)):
        _over(
            connection,
            funnel,
            f"SELECT * FROM {rows}",
            f"CREATE OR REPLACE TEMP TABLE {name} AS {head} SELECT * FROM counts",
        )
    columns = connection.execute("DESCRIBE _daily_new").fetchall()
    additive = [name for name, kind, *_ in columns if name not in KEYS and kind == "BIGINT"]
    percentiles = [name for name, kind, *_ in columns if name not in KEYS and kind != "BIGINT"]
    keys = ", ".join(KEYS)
    connection.execute(
        f"CREATE OR REPLACE TEMP TABLE _daily_changed AS SELECT {keys} FROM _daily_old "
        f"UNION SELECT {keys} FROM _daily_new"
    )
    delta.rows_changed, delta.days_changed = connection.execute(
        "SELECT count(*), count(DISTINCT day) FROM _daily_changed"
    ).fetchone()
    if not delta.rows_changed:
        return delta
    # The groups whose percentiles can have moved, per input: a row's input or group changed.
    # Each input is read only in the groups it moved in, and only where it is set.
    known = set(percentiles) == set(LATENCY_INPUTS)
    inputs = sorted(set(LATENCY_INPUTS.values())) if known else []
    if known:
        changed = []
        for name in inputs:
            tuple_ = ", ".join((*KEYS, "message_id", name))
            set_ = f"{name} IS NOT NULL"
            changed.append(
                f"SELECT DISTINCT {keys}, '{name}' AS _input FROM ("
                f"(SELECT {tuple_} FROM {old_rows} WHERE {set_} "
                f"EXCEPT SELECT {tuple_} FROM {new_rows} WHERE {set_}) UNION ALL "
                f"(SELECT {tuple_} FROM {new_rows} WHERE {set_} "
                f"EXCEPT SELECT {tuple_} FROM {old_rows} WHERE {set_}))"
            )
        flags = ", ".join(f"bool_or(_input = '{name}') AS _moved_{name}" for name in inputs)
        connection.execute(
            f"CREATE OR REPLACE TEMP TABLE _daily_latency AS SELECT {keys}, {flags} "
            f"FROM ({' UNION ALL '.join(changed)}) GROUP BY ALL"
        )
        # Each input only on the days it moved in: literal day lists, which zone maps use
        # (a join on the four group keys cost more than the rows it left out).
        days_moved = {
            name: _day_list(
                connection, f"SELECT DISTINCT day FROM _daily_latency WHERE _moved_{name}"
            )
            for name in inputs
        }
        projected = ", ".join(
            (
                *(f"f.{k}" for k in KEYS),
                *(
                    f"CASE WHEN f.day IN ({days_moved[n] or 'NULL'}) THEN f.{n} END AS {n}"
                    for n in inputs
                ),
            )
        )
        wanted = (
            " OR ".join(
                f"(f.day IN ({days_moved[n]}) AND f.{n} IS NOT NULL)"
                for n in inputs
                if days_moved[n]
            )
            or "false"
        )
    else:
        # A percentile this module does not know: every changed group recomputes them all.
        connection.execute("CREATE OR REPLACE TEMP TABLE _daily_latency AS FROM _daily_changed")
        changed_days = _day_list(connection, "SELECT DISTINCT day FROM _daily_changed")
        projected, wanted = "f.*", f"f.day IN ({changed_days})"
    delta.latency_groups = connection.execute("SELECT count(*) FROM _daily_latency").fetchone()[0]
    if delta.latency_groups:
        # The other columns of the shadow are NULL, so the counts computed alongside the
        # percentiles are ignored. The day range lets zone maps skip the rest of the funnel.
        low, high = connection.execute("SELECT min(day), max(day) FROM _daily_latency").fetchone()
        connection.execute(
            f"CREATE OR REPLACE TEMP TABLE _daily_inputs AS SELECT {projected} FROM {stored} AS f "
            f"WHERE f.day BETWEEN DATE '{low}' AND DATE '{high}' AND ({wanted})"
        )
        delta.latency_rows_read = connection.execute(
            "SELECT count(*) FROM _daily_inputs"
        ).fetchone()[0]
        funnel_columns = [row[0] for row in connection.execute(f"DESCRIBE {old_rows}").fetchall()]
        kept = set(KEYS) | set(inputs)
        shadow = ", ".join(
            name if name in kept or not known else f"NULL AS {name}" for name in funnel_columns
        )
        _over(
            connection,
            funnel,
            f"SELECT {shadow} FROM _daily_inputs",
            f"CREATE OR REPLACE TEMP TABLE _daily_percentiles AS {head} "
            f"SELECT {keys}, {', '.join(percentiles)} FROM counts",
        )
    else:
        connection.execute(
            f"CREATE OR REPLACE TEMP TABLE _daily_percentiles AS "
            f"SELECT {keys}, {', '.join(percentiles)} FROM _daily_new LIMIT 0"
        )
    # A percentile recomputed where its input moved; else the stored one (it did not move).
    moved = {
        name: f"g._moved_{LATENCY_INPUTS[name]}" if known else "g.day IS NOT NULL"
        for name in percentiles
    }
    merged_counts = ", ".join(
        f"coalesce(d.{name}, 0) + coalesce(n.{name}, 0) - coalesce(o.{name}, 0) AS {name}"
        for name in additive
    )
    merged_percentiles = ", ".join(
        f"CASE WHEN coalesce({moved[name]}, false) THEN p.{name} ELSE d.{name} END AS {name}"
        for name in percentiles
    )
    # Only groups left with messages: every count is at most the messages count.
    nonzero = " OR ".join(f"{name} <> 0" for name in additive)
    ordered = ", ".join(name for name, *_ in columns)
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _daily_merged AS "
        f"SELECT {ordered} FROM (SELECT {', '.join(f'c.{k}' for k in KEYS)}, {merged_counts}, "
        f"{merged_percentiles} "
        "FROM _daily_changed AS c "
        f'LEFT JOIN "{database}".main.{daily} AS d ON {_match("d", "c")} '
        f"LEFT JOIN _daily_old AS o ON {_match('o', 'c')} "
        f"LEFT JOIN _daily_new AS n ON {_match('n', 'c')} "
        f"LEFT JOIN _daily_percentiles AS p ON {_match('p', 'c')} "
        f"LEFT JOIN _daily_latency AS g ON {_match('g', 'c')}) WHERE {nonzero}"
    )
    delta.rows_deleted = connection.execute(
        f"DELETE FROM {daily} AS d WHERE EXISTS "
        f"(SELECT 1 FROM _daily_changed AS c WHERE {_match('c', 'd')})"
    ).fetchone()[0]
    connection.execute(
        f"INSERT INTO {daily} WITH counts AS (SELECT * FROM _daily_merged) {tail} ORDER BY ALL"
    )
    return delta
