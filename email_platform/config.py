"""Configuration: every ``EMAIL_PLATFORM_*`` environment variable is read here and only here.

Values are read when asked for, never at import, so tests and the CLI can point one process at
another database or provider by setting the environment before calling in.
"""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "EMAIL_PLATFORM_"
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


def webhook_max_body_bytes(env: Mapping[str, str] | None = None) -> int:
    return int(_env(env).get(PREFIX + "WEBHOOK_MAX_BODY_BYTES", str(1024 * 1024)))


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
            from email_platform.errors import ConfigurationError

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
            timeout_s=float(values.get(PREFIX + "PROVIDER_TIMEOUT_S", "10")),
            rate_limit_per_s=float(values.get(PREFIX + "PROVIDER_RATE_LIMIT_PER_S", "0")),
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
    from email_platform.errors import ConfigurationError
    from email_platform.lanes import LANES

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
    from email_platform.errors import ConfigurationError

    url = values.get(name) or None
    if url is not None and any(c in "'\"\\" or c.isspace() or not c.isprintable() for c in url):
        raise ConfigurationError(
            f"{name} must be a URL without quotes, backslashes, spaces or line breaks"
        )
    return url
