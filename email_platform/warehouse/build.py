"""The models: ``analytics/*.sql``, built over the raw tables, whole or only what changed.

``MODELS`` is the one list of them, in build order, with what each holds and reads: the build,
the models' fingerprint and the Dagster asset specs all derive from it.

``analytics/stg_*.sql`` are views over the raw tables (they cost nothing to refresh and cannot
drift from the load). ``email_funnel`` and ``email_funnel_daily`` are tables: a full build runs
their SQL; an incremental build recomputes only the funnel rows of messages touched by the load
(the message changed, or it got an attempt, provider event or dead letter) and only the daily
rows of the days those messages belong to. A touched row whose message only got provider events
or a new message row is folded from its old row and those rows (``fold``); the others are
rebuilt from their raw rows. A change to a model's SQL file triggers a full build
of the models (``models_fingerprint``, kept in ``warehouse_state``).

The SQL files live in ``analytics/``, where analysts read them (file name = table name = asset
name). The package reads them as its resources through ``email_platform/warehouse/sql``, a
relative symlink to ``analytics/`` that setuptools follows, so the wheel carries them as package
data and an installed package builds the warehouse from its own copies (``sql_file``).
"""

import hashlib
import importlib.resources
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable

import duckdb

from email_platform.warehouse import fold
from email_platform.warehouse.files import literal
from email_platform.warehouse.views import shadowed


@dataclass(frozen=True)
class Model:
    """One model: ``analytics/<name>.sql``, built as the view or table ``<name>``, which is also
    its asset's name."""

    name: str
    # What it holds, for analysts (the asset's description in the Dagster UI).
    description: str
    # What its SQL reads: operational tables (their raw_* copies) or other models.
    deps: tuple[str, ...]

    @property
    def materialized_as(self) -> str:
        """Staging models are views over the raw tables; the funnel models are tables."""
        return "view" if self.name.startswith("stg_") else "table"


FUNNEL = "email_funnel"
FUNNEL_DAILY = "email_funnel_daily"
# The one list of models, in build order (a view is created after the views it reads). Only
# the two funnel models are tables; build_models builds each of them by name.
MODELS: tuple[Model, ...] = (
    Model(
        "stg_events",
        "Staging: one row per application event published to the outbox, with its lane, "
        "status and resolution.",
        ("email_outbox",),
    ),
    Model(
        "stg_sends",
        "Staging: one row per message (event x route) with its template, lane, provider, "
        "recipient domain (never the address), status and when the provider accepted it.",
        ("email_messages",),
    ),
    Model(
        "stg_attempts",
        "Staging: one row per provider call, with its outcome (accepted, transient, "
        "permanent), HTTP status and duration.",
        ("email_attempts",),
    ),
    Model(
        "stg_provider_events",
        "Staging: every normalized provider event, each once. Orphans (no matching message) "
        "have a null message_id.",
        ("email_events",),
    ),
    Model(
        "stg_deliveries",
        "Staging: delivered events.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_opens",
        "Staging: open events, with machine opens (mail privacy proxies) flagged.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_clicks",
        "Staging: link clicks.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_bounces",
        "Staging: bounces, hard or soft, including bounces after delivery.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_complaints",
        "Staging: spam complaints.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_unsubscribes",
        "Staging: unsubscribes.",
        ("stg_provider_events",),
    ),
    Model(
        "stg_dead_letters",
        "Staging: dead letters with reason, attempts and status (open, replayed, discarded, "
        "expired, suppressed).",
        ("dead_letters",),
    ),
    Model(
        FUNNEL,
        "The email funnel: one row per message, every hop joined on event_id. Event type, "
        "template and version, lane, provider, recipient domain; when the event occurred, was "
        "published, first attempted, accepted, delivered, first opened by a human, first "
        "clicked, bounced (and how), complained and unsubscribed; the final status, attempts and "
        "the latency between steps in seconds.",
        ("stg_sends", "stg_events", "stg_attempts", "stg_provider_events", "stg_dead_letters"),
    ),
    Model(
        FUNNEL_DAILY,
        "The funnel per UTC day x template x lane x provider: messages accepted, delivered, "
        "opened by a human, clicked, bounced, complained, and every rate of the funnel, defined "
        "here once (open_rate = human_opened / delivered, ...). Machine opens are left out of "
        "the open rate and reported apart. Its page opens on the funnel of the last 7 days, then "
        "their rates in percent (open rates first: '2 open rate, welcome, 7d (%)', ...) and a "
        "funnel chart per template.",
        (FUNNEL,),
    ),
)
MODEL_NAMES = tuple(model.name for model in MODELS)
STAGING_MODELS = tuple(model.name for model in MODELS if model.materialized_as == "view")
# The messages whose funnel rows the load touched (a temp table of the refresh's writer).
AFFECTED = "_affected"


def sql_file(*parts: str) -> Traversable:
    """``analytics/<parts>`` as the package holds it: ``email_platform/warehouse/sql`` is a
    symlink to ``analytics/`` in the checkout, and the wheel carries copies of the files."""
    path = importlib.resources.files("email_platform.warehouse") / "sql"
    for part in parts:
        path = path / part
    return path


def model_sql(name: str) -> str:
    """The SELECT of one model, from ``analytics/<name>.sql``."""
    return sql_file(f"{name}.sql").read_text()


def models_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in MODEL_NAMES:
        digest.update(name.encode())
        digest.update(model_sql(name).encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class BuildCounts:
    """What a build did, counted: the work a refresh did, for tests and the benchmark."""

    # Funnel rows rebuilt (one per message), days whose daily rows changed, rows deleted to
    # replace them (funnel and daily).
    messages: int = 0
    days: int = 0
    rows_deleted: int = 0
    # Daily rows rewritten, and the funnel rows re-aggregated into them (the touched days').
    daily_rows: int = 0
    daily_rows_read: int = 0
    # A full build's slices (``SLICE_MESSAGES`` messages each).
    slices: int = 0
    # Of ``messages``, the funnel rows folded rather than rebuilt from their raw rows, and of
    # ``daily_rows``, the rows of steady days, which kept some percentiles (``fold``).
    folded: int = 0
    daily_rows_kept: int = 0


# A full build's slice: its working set (every raw row of that many messages, the join and
# the sort) stays a few hundred MB whatever the history's size.
SLICE_MESSAGES = 500_000


def build_models(
    connection: duckdb.DuckDBPyConnection,
    full: bool,
    loaded: Mapping[str, str] | None = None,
) -> BuildCounts:
    """Staging views, then the funnel and the daily table: whole, or only what changed.
    ``loaded`` names, per raw table, the rows the refresh's load wrote (see ``fold``)."""
    for name in STAGING_MODELS:
        connection.execute(f"CREATE OR REPLACE VIEW {name} AS\n{model_sql(name)}")
    exists = {
        row[0]
        for row in connection.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'"
        ).fetchall()
    }
    if full or FUNNEL not in exists or FUNNEL_DAILY not in exists:
        return _build_full(connection)
    model, daily_model = model_sql(FUNNEL), model_sql(FUNNEL_DAILY)
    folding = fold.mirrors(model, daily_model)
    folded = fold.take_old_rows(connection, FUNNEL, AFFECTED, loaded or {}, folding)
    # The messages rebuilt from their raw rows: every one touched, less the folded ones.
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _scope AS "
        f"SELECT DISTINCT message_id FROM {AFFECTED} "
        f"WHERE message_id NOT IN (SELECT message_id FROM {fold.OLD}) ORDER BY message_id"
    )
    rebuilt = connection.execute("SELECT count(*) FROM _scope").fetchone()[0]
    if not rebuilt + folded:
        return BuildCounts()
    touched = (
        f"message_id IN (SELECT message_id FROM _scope UNION ALL SELECT message_id FROM {fold.OLD})"
    )
    # The days of the rows replaced; a rebuilt message's day is not steady (see ``fold``).
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _old_days AS SELECT day, bool_and(message_id IN "
        f"(SELECT message_id FROM {fold.OLD})) AS steady FROM {FUNNEL} WHERE {touched} "
        "GROUP BY day"
    )
    deleted = connection.execute(
        f"DELETE FROM {FUNNEL} WHERE message_id IN (SELECT message_id FROM _scope)"
    ).fetchone()[0]
    new_days = "SELECT day, false AS steady FROM _rebuilt_days"
    connection.execute("CREATE OR REPLACE TEMP TABLE _rebuilt_days (day DATE)")
    if rebuilt:
        # Not sorted (0.02 s at 1M): the rows are a mix of new messages and old ones spread
        # over weeks, so sorting would not narrow the zone maps of the row groups they fill.
        with shadowed(connection, _scope_filters(connection)):
            connection.execute(
                f"INSERT INTO {FUNNEL} SELECT * FROM (\n{model}\n) "
                "WHERE message_id IN (SELECT message_id FROM _scope)"
            )
        connection.execute(
            f"INSERT INTO _rebuilt_days SELECT DISTINCT day FROM {FUNNEL} "
            "WHERE message_id IN (SELECT message_id FROM _scope)"
        )
    if folded:
        deleted += fold.insert_folded(connection, FUNNEL, model, loaded or {})
        new_days += f" UNION ALL {fold.folded_days()}"
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _days AS SELECT day, bool_and(steady) AS steady FROM "
        f"(SELECT day, steady FROM _old_days UNION ALL {new_days}) GROUP BY day"
    )
    days = connection.execute("SELECT count(*) FROM _days").fetchone()[0]
    # The days' rows are re-aggregated, not kept by deltas: its percentiles (medians, p95) are
    # no sums and need every value of their group, and late first opens move them on every
    # day they reach. A delta (add the new versions' counts, subtract the old ones', recompute
    # only the percentiles that moved) measured ~0.2 s slower at 1M messages (bench/README.md,
    # "Warehouse benchmark", 2026-12-06): the percentiles cost most of the re-aggregation.
    # A steady day (only steady folded rows) keeps the percentiles its rows did not move.
    steady = "day IN (SELECT day FROM _days WHERE steady)"
    kept = fold.keep_daily(connection, FUNNEL_DAILY, steady)
    deleted += connection.execute(
        f"DELETE FROM {FUNNEL_DAILY} WHERE day IN (SELECT day FROM _days)"
    ).fetchone()[0]
    moved = "day IN (SELECT day FROM _days WHERE NOT steady)"
    with shadowed(connection, {FUNNEL: moved}):
        daily_rows = connection.execute(
            f"INSERT INTO {FUNNEL_DAILY} SELECT * FROM (\n{daily_model}\n) "
            f"WHERE {moved} ORDER BY ALL"
        ).fetchone()[0]
    kept_rows = 0
    if kept:
        kept_rows = fold.insert_steady_daily(connection, FUNNEL, FUNNEL_DAILY, daily_model, steady)
    # The funnel rows re-aggregated: every one counts once in its daily row's messages.
    daily_read = connection.execute(
        f"SELECT coalesce(sum(messages), 0) FROM {FUNNEL_DAILY} "
        "WHERE day IN (SELECT day FROM _days)"
    ).fetchone()[0]
    return BuildCounts(
        messages=rebuilt + folded,
        folded=folded,
        days=days,
        rows_deleted=deleted,
        daily_rows=daily_rows + kept_rows,
        daily_rows_kept=kept_rows,
        daily_rows_read=daily_read,
    )


def _build_full(connection: duckdb.DuckDBPyConnection) -> BuildCounts:
    """The funnel in slices of ``SLICE_MESSAGES`` messages (by id), each from only its own raw
    rows, appended in id order; then the daily table in slices of whole days. Each slice reads
    and sorts a bounded share, so the build's memory does not grow with the history."""
    bounds = connection.execute(
        "SELECT message_id FROM (SELECT message_id, row_number() OVER (ORDER BY message_id) "
        f"AS n FROM raw_email_messages) WHERE n % {int(SLICE_MESSAGES)} = 1 ORDER BY message_id"
    ).fetchall()
    starts = [row[0] for row in bounds]
    with shadowed(connection, {"raw_email_messages": "false"}):
        # The table, empty, with the model's columns and types.
        connection.execute(
            f"CREATE OR REPLACE TABLE {FUNNEL} AS SELECT * FROM (\n{model_sql(FUNNEL)}\n) LIMIT 0"
        )
    for index, low in enumerate(starts):
        high = starts[index + 1] if index + 1 < len(starts) else None
        scope = f"message_id >= {int(low)}" + (f" AND message_id < {int(high)}" if high else "")
        connection.execute(
            f"CREATE OR REPLACE TEMP TABLE _scope AS SELECT message_id FROM raw_email_messages "
            f"WHERE {scope}"
        )
        with shadowed(connection, _scope_filters(connection)):
            connection.execute(
                f"INSERT INTO {FUNNEL} SELECT * FROM (\n{model_sql(FUNNEL)}\n) ORDER BY message_id"
            )
    messages = connection.execute(f"SELECT count(*) FROM {FUNNEL}").fetchone()[0]
    with shadowed(connection, {FUNNEL: "false"}):
        connection.execute(
            f"CREATE OR REPLACE TABLE {FUNNEL_DAILY} AS SELECT * FROM (\n"
            f"{model_sql(FUNNEL_DAILY)}\n) LIMIT 0"
        )
    days = connection.execute(
        f"SELECT day, count(*) FROM {FUNNEL} GROUP BY day ORDER BY day"
    ).fetchall()
    for first, last in _day_slices(days, SLICE_MESSAGES):
        window = f"day BETWEEN DATE '{first}' AND DATE '{last}'"
        with shadowed(connection, {FUNNEL: window}):
            connection.execute(
                f"INSERT INTO {FUNNEL_DAILY} SELECT * FROM (\n{model_sql(FUNNEL_DAILY)}\n) "
                "ORDER BY ALL"
            )
    daily_rows = connection.execute(f"SELECT count(*) FROM {FUNNEL_DAILY}").fetchone()[0]
    return BuildCounts(
        messages=messages,
        days=len(days),
        daily_rows=daily_rows,
        daily_rows_read=messages,
        slices=len(starts),
    )


def _day_slices(days: list[tuple[object, int]], size: int) -> list[tuple[object, object]]:
    """Consecutive days grouped into slices of at most ``size`` rows (a bigger day alone)."""
    slices: list[tuple[object, object]] = []
    first, rows = None, 0
    for index, (day, count) in enumerate(days):
        if first is None:
            first, rows = day, 0
        rows += count
        following = days[index + 1][1] if index + 1 < len(days) else None
        if following is None or rows + following > size:
            slices.append((first, day))
            first = None
    return slices


def _scope_filters(connection: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """The raw rows the funnel rows of the messages in ``_scope`` read, per raw table (the
    outbox row via its event); a message's funnel row depends on nothing else."""
    scoped = "message_id IN (SELECT message_id FROM _scope)"
    events = f"(SELECT event_id FROM raw_email_messages WHERE {scoped})"
    return {
        "raw_email_messages": scoped,
        "raw_email_attempts": scoped,
        "raw_email_events": scoped,
        "raw_dead_letters": scoped,
        "raw_email_outbox": f"{event_id_range(connection, events, 'event_id')} "
        "AND event_id IN (SELECT event_id FROM temp.main.raw_email_messages)",
    }


def event_id_range(connection: duckdb.DuckDBPyConnection, rows: str, column: str) -> str:
    """``column`` within the range of ``rows``' event ids, as literals: zone maps then skip the
    row groups outside it (DuckDB derives no range from a join on strings, so matching events
    by id read every row of a 1M-row table). Correct for any ids; ULIDs, sortable by time,
    make it narrow."""
    lowest, highest = connection.execute(
        f"SELECT min(event_id), max(event_id) FROM {rows}"
    ).fetchone()
    if lowest is None:
        return "false"
    return f"{column} BETWEEN {literal(lowest)} AND {literal(highest)}"
