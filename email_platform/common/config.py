"""Configuration: every ``EMAIL_PLATFORM_*`` environment variable is read here and only here.

Values are read when asked for, never at import, so tests and the CLI can point one process at
another database or provider by setting the environment before calling in.
"""

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "EMAIL_PLATFORM_"
#: The one setting that names the route table, for ``publish()`` and the worker alike.
ROUTES_SETTING = PREFIX + "ROUTES"
DEFAULT_HOME = ".email_platform"
#: Every provider the platform sends through: the one list the adapters, the webhook receiver
#: and the configuration check read.
PROVIDERS = ("sandbox", "postmark", "sendgrid", "mailgun", "ses", "resend", "smtp")
#: The providers that post webhooks (SMTP has no tracking callbacks).
WEBHOOK_PROVIDERS = tuple(name for name in PROVIDERS if name != "smtp")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def home_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the embedded defaults live (SQLite file, Dagster storage, DuckDB file)."""
    return Path(_env(env).get(PREFIX + "HOME", DEFAULT_HOME)).resolve()


def database_url(env: Mapping[str, str] | None = None) -> str:
    value = _env(env).get(PREFIX + "DATABASE_URL")
    if value:
        return value
    return f"sqlite:///{home_dir(env) / 'email_platform.sqlite3'}"


def routes_spec(env: Mapping[str, str] | None = None) -> str | None:
    """``package.module:NAME`` of the route table (``routes.configured_routes()`` loads it)."""
    return _env(env).get(ROUTES_SETTING, "").strip() or None


def warehouse_path(env: Mapping[str, str] | None = None) -> str:
    return _env(env).get(PREFIX + "WAREHOUSE") or str(home_dir(env) / "warehouse.duckdb")


def dagster_home_is_set(env: Mapping[str, str] | None = None) -> bool:
    return bool(_env(env).get("DAGSTER_HOME"))


def dagster_home(env: Mapping[str, str] | None = None) -> Path:
    value = _env(env).get("DAGSTER_HOME")
    return Path(value) if value else home_dir(env) / "dagster"


def lane_overrides_json(env: Mapping[str, str] | None = None) -> str | None:
    """JSON laid over the shipped lane settings, e.g. ``{"bulk": {"batch_size": 1000}}``."""
    return _env(env).get(PREFIX + "LANES") or None


def webhook_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``EMAIL_PLATFORM_*_WEBHOOK_*`` secret, keyed lower-case without the prefix."""
    return {
        key[len(PREFIX) :].lower(): value
        for key, value in _env(env).items()
        if key.startswith(PREFIX) and "_WEBHOOK_" in key
    }


def webhook_retention_days(env: Mapping[str, str] | None = None) -> int:
    """How long processed raw webhooks stay in the inbox for re-normalization."""
    return int(_env(env).get(PREFIX + "WEBHOOK_RETENTION_DAYS", "90"))


def analytics_refresh_s(env: Mapping[str, str] | None = None) -> float:
    """At most one warehouse refresh per this many seconds while new data keeps arriving:
    the freshness analysts can count on (plus the refresh itself)."""
    raw = _env(env).get(PREFIX + "ANALYTICS_REFRESH_S", "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{PREFIX}ANALYTICS_REFRESH_S must be a positive number, got {raw!r}")
    return value


_MEMORY = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)


def warehouse_memory(env: Mapping[str, str] | None = None) -> str:
    """The most memory DuckDB may use in a warehouse refresh ("2GB"; a full build needs it);
    it spills to a temporary directory next to the file beyond it."""
    raw = _env(env).get(PREFIX + "WAREHOUSE_MEMORY", "2GB").strip()
    return checked_memory(raw, PREFIX + "WAREHOUSE_MEMORY")


#: Bytes per DuckDB size unit (KB = 1000 bytes, KiB = 1024).
_UNITS = {
    "b": 1,
    **{unit: 1000**power for power, unit in enumerate(("kb", "mb", "gb", "tb"), 1)},
    **{unit: 1024**power for power, unit in enumerate(("kib", "mib", "gib", "tib"), 1)},
}
#: Below this every query of a refresh fails out of memory; above it DuckDB cannot parse it.
MEMORY_MIN_BYTES = 64 * 1000**2
MEMORY_MAX_BYTES = 1000**5


def checked_memory(value: str, name: str) -> str:
    """``value`` if it is a DuckDB memory size (a number and a unit: 2GB, 512MiB) from 64MB
    to 1000TB."""
    match = _MEMORY.fullmatch(value.strip())
    if not match:
        raise ValueError(f"{name} must be a size such as 2GB or 512MiB, got {value!r}")
    size = float(match[0][: match.start(2) - match.start(0)]) * _UNITS[match[2].lower()]
    if not MEMORY_MIN_BYTES <= size <= MEMORY_MAX_BYTES:
        raise ValueError(f"{name} must be from 64MB to 1000TB, got {value.strip()!r}")
    return value.strip()


def webhook_max_body_bytes(env: Mapping[str, str] | None = None) -> int:
    return _positive_int(_env(env), "WEBHOOK_MAX_BODY_BYTES", 1024 * 1024)


@dataclass(frozen=True)
class ProviderSettings:
    """The provider to send through: its base URL, credentials and provider-specific options.

    ``options`` holds every other ``EMAIL_PLATFORM_<PROVIDER>_<NAME>`` variable, keyed by the
    lower-cased ``<NAME>`` (``EMAIL_PLATFORM_MAILGUN_DOMAIN`` -> ``options["domain"]``).
    """

    name: str
    base_url: str | None
    api_key: str | None
    sender: str
    timeout_s: float
    rate_limit_per_s: float
    options: dict[str, str] = field(default_factory=dict)

    def option(self, key: str, default: str | None = None) -> str | None:
        return self.options.get(key, default)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, provider: str | None = None
    ) -> "ProviderSettings":
        values = _env(env)
        name = (provider or values.get(PREFIX + "PROVIDER", "sandbox")).strip().lower()
        if name not in PROVIDERS:
            from email_platform.common.errors import ConfigurationError

            raise ConfigurationError(
                f"{PREFIX}PROVIDER={name!r} is not one of {', '.join(PROVIDERS)}"
            )
        own = f"{PREFIX}{name.upper()}_"
        options = {
            key[len(own) :].lower(): value
            for key, value in values.items()
            if key.startswith(own) and key[len(own) :] not in ("BASE_URL", "API_KEY")
        }
        default_base = "http://127.0.0.1:8025" if name == "sandbox" else None
        return cls(
            name=name,
            base_url=values.get(own + "BASE_URL", default_base),
            api_key=values.get(own + "API_KEY"),
            sender=values.get(PREFIX + "SENDER", "Example <no-reply@example.com>"),
            timeout_s=_seconds(values, "PROVIDER_TIMEOUT_S", 10.0),
            rate_limit_per_s=_rate(values, "PROVIDER_RATE_LIMIT_PER_S"),
            options=options,
        )


#: The engines the send steps can run on (``EMAIL_PLATFORM_EXECUTOR``).
EXECUTORS = ("default", "celery")


@dataclass(frozen=True)
class ExecutorSettings:
    """Where the send jobs' steps execute.

    ``default``: the lane-worker step in a process of its own beside the run worker, a batch run's
    step in the run worker itself (on the daemon's host with the default run launcher).
    ``celery``: on ``dagster-celery`` worker processes, through ``broker``; a lane named in
    ``lane_queues`` goes to its own Celery queue, every other lane to ``default_queue``.
    """

    kind: str = "default"
    broker: str = "redis://127.0.0.1:6379/0"
    backend: str | None = None
    lane_queues: dict[str, str] = field(default_factory=dict)
    default_queue: str = "dagster"

    @property
    def result_backend(self) -> str:
        """The backend: the broker itself when it is Redis (``rpc://`` needs AMQP)."""
        if self.backend:
            return self.backend
        return self.broker if self.broker.startswith(("redis://", "rediss://")) else "rpc://"

    def queue_for(self, lane: str | None) -> str:
        return self.lane_queues.get(lane or "", self.default_queue)

    def queues(self) -> list[str]:
        """Every queue a worker serving all lanes listens on."""
        return [self.default_queue, *sorted(set(self.lane_queues.values()) - {self.default_queue})]


def executor_settings(env: Mapping[str, str] | None = None) -> ExecutorSettings:
    """``EMAIL_PLATFORM_EXECUTOR``, ``_CELERY_BROKER``, ``_CELERY_BACKEND`` and
    ``_CELERY_LANE_QUEUES`` (``critical=critical,transactional=mail``)."""
    from email_platform.common.errors import ConfigurationError
    from email_platform.common.lanes import LANES

    values = _env(env)
    kind = values.get(PREFIX + "EXECUTOR", "default").strip().lower() or "default"
    if kind not in EXECUTORS:
        raise ConfigurationError(f"{PREFIX}EXECUTOR={kind!r} is not one of {', '.join(EXECUTORS)}")
    lane_queues: dict[str, str] = {}
    raw = values.get(PREFIX + "CELERY_LANE_QUEUES", "")
    for item in filter(None, (part.strip() for part in raw.split(","))):
        lane, sep, queue = (piece.strip() for piece in item.partition("="))
        if not sep or lane not in LANES or not queue or not queue.replace("_", "").isalnum():
            raise ConfigurationError(
                f"{PREFIX}CELERY_LANE_QUEUES: {item!r} is not <lane>=<queue> with a lane of "
                f"{', '.join(LANES)} and a queue name of letters, digits and _"
            )
        lane_queues[lane] = queue
    defaults = ExecutorSettings()
    return ExecutorSettings(
        kind=kind,
        broker=_celery_url(values, PREFIX + "CELERY_BROKER") or defaults.broker,
        backend=_celery_url(values, PREFIX + "CELERY_BACKEND"),
        lane_queues=lane_queues,
    )


def _celery_url(values: Mapping[str, str], name: str) -> str | None:
    """dagster-celery writes the URL into a Python file between single quotes: refuse what
    would end the string or the line there."""
    from email_platform.common.errors import ConfigurationError

    url = values.get(name) or None
    if url is not None and any(c in "'\"\\" or c.isspace() or not c.isprintable() for c in url):
        raise ConfigurationError(
            f"{name} must be a URL without quotes, backslashes, spaces or line breaks"
        )
    return url


#: How long a one-click unsubscribe link works, unless ``EMAIL_PLATFORM_UNSUBSCRIBE_TTL_DAYS``.
UNSUBSCRIBE_TTL_DAYS = 60.0


@dataclass(frozen=True)
class UnsubscribeSettings:
    """One-click unsubscribe (RFC 8058): what signs the links and where they point.

    ``secret`` signs new links; ``old_secret`` still verifies links signed before a rotation.
    ``base_url`` is the public address of the webhook receiver (``https://mail.example.com``).
    ``mailto`` is the address of the ``mailto:`` alternative: ``None`` for
    ``unsubscribe@<sender domain>``, ``""`` for none at all. Bulk mail carries no
    ``List-Unsubscribe`` header while ``secret`` or ``base_url`` is unset.
    """

    secret: str | None = None
    old_secret: str | None = None
    base_url: str | None = None
    mailto: str | None = None
    ttl_s: float = UNSUBSCRIBE_TTL_DAYS * 86400


def unsubscribe_settings(env: Mapping[str, str] | None = None) -> UnsubscribeSettings:
    """``EMAIL_PLATFORM_UNSUBSCRIBE_SECRET``, ``_UNSUBSCRIBE_OLD_SECRET``,
    ``_UNSUBSCRIBE_BASE_URL``, ``_UNSUBSCRIBE_MAILTO`` (an address, or ``none``) and
    ``_UNSUBSCRIBE_TTL_DAYS`` (default 60). A TTL that is not a positive number raises."""
    values = _env(env)
    raw_ttl = values.get(PREFIX + "UNSUBSCRIBE_TTL_DAYS", "") or str(UNSUBSCRIBE_TTL_DAYS)
    try:
        days = float(raw_ttl)
    except ValueError:
        days = -1.0
    if not (days > 0 and math.isfinite(days) and days <= 3650):
        raise ValueError(
            f"{PREFIX}UNSUBSCRIBE_TTL_DAYS must be a number of days in (0, 3650], got {raw_ttl!r}"
        )
    mailto = values.get(PREFIX + "UNSUBSCRIBE_MAILTO")
    if mailto is not None:
        mailto = "" if mailto.strip().lower() in ("none", "off", "") else mailto.strip()
        mailto = mailto or (None if not values.get(PREFIX + "UNSUBSCRIBE_MAILTO") else "")
    return UnsubscribeSettings(
        secret=values.get(PREFIX + "UNSUBSCRIBE_SECRET") or None,
        old_secret=values.get(PREFIX + "UNSUBSCRIBE_OLD_SECRET") or None,
        base_url=(values.get(PREFIX + "UNSUBSCRIBE_BASE_URL") or "").strip() or None,
        mailto=mailto,
        ttl_s=days * 86400,
    )


def brake_settings(env: Mapping[str, str] | None = None) -> dict[str, float]:
    """The bulk lane's brakes (docs/lanes.md): ``EMAIL_PLATFORM_BRAKES`` (``off`` turns them
    off), ``_BRAKE_MIN_MESSAGES`` (200), ``_BRAKE_HARD_BOUNCE_RATE`` (0.05),
    ``_BRAKE_COMPLAINT_RATE`` (0.003) and ``_BRAKE_WINDOW_S`` (3600). A value that is not a
    number in range raises ``ValueError`` naming the variable."""
    values = _env(env)
    limits = {
        "BRAKE_MIN_MESSAGES": (200.0, 1.0, 1e9),
        "BRAKE_HARD_BOUNCE_RATE": (0.05, 0.0, 1.0),
        "BRAKE_COMPLAINT_RATE": (0.003, 0.0, 1.0),
        "BRAKE_WINDOW_S": (3600.0, 60.0, 30 * 86400.0),
    }
    settings: dict[str, float] = {}
    for name, (default, low, high) in limits.items():
        raw = (values.get(PREFIX + name) or "").strip() or str(default)
        try:
            number = float(raw)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and low <= number <= high):
            raise ValueError(f"{PREFIX}{name} must be a number in [{low:g}, {high:g}], got {raw!r}")
        settings[name.removeprefix("BRAKE_").lower()] = number
    switch = (values.get(PREFIX + "BRAKES") or "on").strip().lower()
    if switch not in ("on", "off", "true", "false", "1", "0"):
        raise ValueError(f"{PREFIX}BRAKES must be on or off, got {switch!r}")
    settings["enabled"] = 1.0 if switch in ("on", "true", "1") else 0.0
    return settings


@dataclass(frozen=True)
class RetentionSettings:
    """How long finished operational rows stay before the retention purge deletes them.

    Days count from when a row finished: an event's ``done_at``, a dead letter's
    ``resolved_at``, a webhook's ``received_at``, a Dagster run's last update. Nothing in
    flight, pending or open is ever old enough.
    """

    #: Done outbox events, with their messages, attempts and provider events.
    events_days: int = 90
    #: Processed raw webhooks (``EMAIL_PLATFORM_WEBHOOK_RETENTION_DAYS``, shared with the
    #: ingestion run's own purge).
    webhook_inbox_days: int = 90
    #: Resolved dead letters (replayed, discarded, expired, suppressed).
    dead_letters_days: int = 180
    #: Finished Dagster runs and their event logs.
    dagster_runs_days: int = 30
    #: Events whose message holds a route's dedupe key ("one welcome per user"): None keeps
    #: them for good, so the key keeps deduplicating after the rest is purged.
    dedupe_days: int | None = None
    #: Rows per delete transaction: no purge holds a long lock, however much is due.
    batch_size: int = 5000
    #: Dagster runs deleted per purge run at most.
    dagster_runs_per_purge: int = 5000


def retention_settings(env: Mapping[str, str] | None = None) -> RetentionSettings:
    """``EMAIL_PLATFORM_EVENT_RETENTION_DAYS``, ``_WEBHOOK_RETENTION_DAYS``,
    ``_DEAD_LETTER_RETENTION_DAYS``, ``_DAGSTER_RUN_RETENTION_DAYS``,
    ``_DEDUPE_RETENTION_DAYS`` (unset: kept), ``_RETENTION_BATCH_SIZE`` and
    ``_DAGSTER_RUN_PURGE_LIMIT``."""
    values = _env(env)
    defaults = RetentionSettings()
    dedupe = values.get(PREFIX + "DEDUPE_RETENTION_DAYS", "").strip()
    return RetentionSettings(
        events_days=_positive_int(values, "EVENT_RETENTION_DAYS", defaults.events_days),
        webhook_inbox_days=_positive_int(
            values, "WEBHOOK_RETENTION_DAYS", defaults.webhook_inbox_days
        ),
        dead_letters_days=_positive_int(
            values, "DEAD_LETTER_RETENTION_DAYS", defaults.dead_letters_days
        ),
        dagster_runs_days=_positive_int(
            values, "DAGSTER_RUN_RETENTION_DAYS", defaults.dagster_runs_days
        ),
        dedupe_days=_positive_int(values, "DEDUPE_RETENTION_DAYS", 1) if dedupe else None,
        batch_size=_positive_int(values, "RETENTION_BATCH_SIZE", defaults.batch_size),
        dagster_runs_per_purge=_positive_int(
            values, "DAGSTER_RUN_PURGE_LIMIT", defaults.dagster_runs_per_purge
        ),
    )


def _rate(values: Mapping[str, str], name: str) -> float:
    """Messages a second, 0 for none: a finite number >= 0, refused naming the setting."""
    from email_platform.common.errors import ConfigurationError

    raw = values.get(PREFIX + name, "").strip() or "0"
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate >= 0):
        raise ConfigurationError(
            f"{PREFIX}{name} must be a number of messages a second >= 0, got {raw!r}"
        )
    return rate


#: The longest provider timeout taken: anything longer is a mistyped setting.
MAX_TIMEOUT_S = 3600.0


def checked_timeout(value: float | str, name: str) -> float:
    """A timeout in seconds (a number, or its text): finite, above 0 (0 would fail every call)
    and at most ``MAX_TIMEOUT_S``; else a ``ConfigurationError`` naming ``name``."""
    from email_platform.common.errors import ConfigurationError

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        shown = repr(value)
        raise ConfigurationError(
            f"{name} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
            f"got {shown if len(shown) <= 60 else shown[:56] + '...'}"
        )
    return seconds


def _seconds(values: Mapping[str, str], name: str, default: float) -> float:
    raw = values.get(PREFIX + name, "").strip()
    return checked_timeout(raw, PREFIX + name) if raw else default


def _positive_int(values: Mapping[str, str], name: str, default: int) -> int:
    """A whole number of at least 1: a retention of 0 days would purge what just finished."""
    from email_platform.common.errors import ConfigurationError

    raw = values.get(PREFIX + name, "").strip()
    if not raw:
        return default
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1 or len(raw) > 9:
        raise ConfigurationError(
            f"{PREFIX}{name} must be a whole number from 1 to 999999999, got {raw!r}"
        )
    return int(raw)


def failover_provider_settings(env: Mapping[str, str] | None = None) -> ProviderSettings | None:
    """The secondary provider (``EMAIL_PLATFORM_FAILOVER_PROVIDER``), or None.

    It is read like the primary, with its own ``EMAIL_PLATFORM_<NAME>_*`` settings;
    ``EMAIL_PLATFORM_FAILOVER_BASE_URL`` and ``_FAILOVER_API_KEY`` override them (a second
    account or region of the primary's own kind).
    """
    import dataclasses

    from email_platform.common.errors import ConfigurationError

    values = _env(env)
    name = values.get(PREFIX + "FAILOVER_PROVIDER", "").strip().lower()
    if not name:
        return None
    if name not in PROVIDERS:
        raise ConfigurationError(
            f"{PREFIX}FAILOVER_PROVIDER={name!r} is not one of {', '.join(PROVIDERS)}"
        )
    settings = ProviderSettings.from_env(values, provider=name)
    return dataclasses.replace(
        settings,
        base_url=values.get(PREFIX + "FAILOVER_BASE_URL") or settings.base_url,
        api_key=values.get(PREFIX + "FAILOVER_API_KEY") or settings.api_key,
    )


#: ``EMAIL_PLATFORM_CIRCUIT_<NAME>`` -> the circuit breaker setting it sets, and its type.
CIRCUIT_VARIABLES = {
    "FAILURES": ("failures", int),
    "FAILURE_RATE": ("failure_rate", float),
    "MIN_CALLS": ("min_calls", int),
    "WINDOW_S": ("window_s", float),
    "COOLDOWN_S": ("cooldown_s", float),
    "MAX_COOLDOWN_S": ("max_cooldown_s", float),
}


def circuit_breaker_enabled(env: Mapping[str, str] | None = None) -> bool | None:
    """``EMAIL_PLATFORM_CIRCUIT_BREAKER`` (on/off); None when unset (then it is on only with
    a failover provider)."""
    from email_platform.common.errors import ConfigurationError

    raw = _env(env).get(PREFIX + "CIRCUIT_BREAKER", "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ConfigurationError(f"{PREFIX}CIRCUIT_BREAKER must be on or off, got {raw!r}")


def circuit_overrides(env: Mapping[str, str] | None = None) -> dict[str, float | int]:
    """The ``EMAIL_PLATFORM_CIRCUIT_*`` thresholds that are set, keyed by setting name."""
    from email_platform.common.errors import ConfigurationError

    values = _env(env)
    found: dict[str, float | int] = {}
    for suffix, (key, kind) in CIRCUIT_VARIABLES.items():
        raw = values.get(f"{PREFIX}CIRCUIT_{suffix}")
        if raw is None or not raw.strip():
            continue
        try:
            value = kind(raw.strip())
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise ConfigurationError(
                f"{PREFIX}CIRCUIT_{suffix} must be a positive {kind.__name__}, got {raw!r}"
            )
        found[key] = value
    return found


def alerts_slack_url(env: Mapping[str, str] | None = None) -> str | None:
    """A Slack-compatible incoming-webhook URL alerts are also posted to (none: log and UI only)."""
    return _env(env).get(PREFIX + "ALERTS_SLACK_URL") or None


#: ``package.module:NAME`` of the product's outcome callback (``email_outcomes_sensor``).
OUTCOME_HANDLER_SETTING = PREFIX + "OUTCOME_HANDLER"


def outcome_handler_spec(env: Mapping[str, str] | None = None) -> str | None:
    """The callback the outcome sensor hands provider outcomes to (unset: the sensor skips)."""
    return _env(env).get(OUTCOME_HANDLER_SETTING, "").strip() or None
