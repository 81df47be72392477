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
